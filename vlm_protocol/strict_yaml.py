"""YAML loading that refuses a key written twice in one mapping (PyYAML keeps the last silently:
a config with `model:` twice would run with whichever came second).

Merge keys (`<<: *defaults`, `<<: [*a, *b]`) work as in `yaml.safe_load`: the merged mappings'
keys come first, a key written in the mapping itself overrides a merged one, and among merged
mappings the first one listed wins. Only a key written twice in the mapping itself (`<<`
included: list the mappings to merge instead) is refused."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # mapping nodes whose own keys were checked

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Every mapping passes here before its merge keys are expanded into it (for its own
        # construction, or first when another mapping merges it): its own keys are checked then.
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_duplicates(node)
        super().flatten_mapping(node)

    def _refuse_duplicates(self, node: yaml.MappingNode) -> None:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            key = "<<" if key_node.tag == _MERGE_TAG else self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader refuses unhashable keys with its own message
            if key in seen:
                raise DuplicateKeyError(f"duplicate key {key!r} at line {line} "
                                        f"(first at line {seen[key]})")
            seen[key] = line


def load(text: str | bytes) -> Any:
    """Like yaml.safe_load (merge keys included), but a key written twice in one mapping is a
    DuplicateKeyError naming it and its lines."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
