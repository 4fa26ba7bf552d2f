"""YAML loading that refuses a key written twice in one mapping (PyYAML keeps the last silently:
a config with `model:` twice would run with whichever came second)."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load"]


class DuplicateKeyError(yaml.YAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader refuses unhashable keys with its own message
            if key in seen:
                raise DuplicateKeyError(f"duplicate key {key!r} at line {line} "
                                        f"(first at line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load(text: str | bytes) -> Any:
    """Like yaml.safe_load, but a duplicated key is a DuplicateKeyError naming it and its lines."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
