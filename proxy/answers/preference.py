"""Preferences between two episodes of one task (RL-VLM-F): the comparison template, the label read
from a reply, and how the two orders of a swapped comparison combine.

The label follows RL-VLM-F (Wang et al., ICML 2024): 0 = the first episode is better, 1 = the
second, -1 = no preference (unsure, or no difference). A comparison template is
`prompts/compare_<name>.yaml`:

    description: what it is for
    variables: {task_text: {description: ...}}   # as in proxy/prompting/templates.py; `number`, `description` are taken
    system: "..."                                 # optional
    episode_label: "Episode ${number}:"           # the text before each episode's media (1-based)
    query: "..."                                  # one step: after both episodes, asks for the label
    describe: "..."                               # two steps, step 1: after both episodes, asks to compare
    label: "... ${description} ..."               # two steps, step 2 (text only): step 1's reply → the label
    answer: {tags: [], untagged: true}            # where the label is: the whole reply, or one tag

A label is exactly one of `-1`, `0`, `1` (a trailing full stop allowed) making up the whole reply
or the whole declared tag, after reasoning is removed; `-1` is tried before `1`, so it is never
read as 1. Anything else is `unparseable_label` with the reply, never a silent -1 or 0.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from string import Template
from typing import Any

import yaml

from proxy.answers.parse import declared_fragment, strip_reasoning
from proxy.errors import LabelParseError, PromptTemplateError, TemplateVariableError
from vlm_protocol import strict_yaml

__all__ = ["DEFAULT_COMPARE_PROMPT", "LABELS", "ComparePrompt", "combine_orders", "parse_compare_template",
           "parse_label", "read_description", "swap_label"]

DEFAULT_COMPARE_PROMPT = "compare_rlvlmf"
PROMPT_NAME = re.compile(r"\Acompare_[A-Za-z0-9_]{1,64}\Z")  # comparison templates, by file stem
LABELS = (0, 1, -1)
_LABEL_FORM = re.compile(r"\A\s*(-1|0|1)\s*\.?\s*\Z")  # -1 first: never read as 1
_TEXTS = ("system", "episode_label", "query", "describe", "label")
_BUILT_IN = {"episode_label": "number", "label": "description"}  # filled by the proxy, not the caller
_MISSING = object()


@dataclass(frozen=True)
class ComparePrompt:
    name: str
    sha256: str
    description: str
    texts: dict[str, str | None]  # system, episode_label, query, describe, label
    variables: dict[str, Any]  # name -> default, or _MISSING
    tags: tuple[str, ...]
    untagged: bool

    @property
    def variable_names(self) -> set[str]:
        return set(self.variables)

    def render(self, part: str, values: dict[str, Any]) -> str | None:
        """One text with every variable filled; a missing required one is a 422."""
        text = self.texts[part]
        if text is None:
            return None
        merged = {name: str(values.get(name, default)) for name, default in self.variables.items()
                  if name in values or default is not _MISSING}
        missing = sorted(set(self.variables) - set(merged))
        if missing:
            raise TemplateVariableError(f"prompt {self.name!r} needs variable {missing[0]!r}; pass it in "
                                        "backend_kwargs", field=f"backend_kwargs.{missing[0]}")
        if part in _BUILT_IN:
            merged[_BUILT_IN[part]] = str(values[_BUILT_IN[part]])
        return Template(text).substitute(merged).strip() or None

    def describe_answer(self) -> str:
        where = " or ".join(f"<{t}>…</{t}>" for t in self.tags) or "the whole reply"
        if self.tags and self.untagged:
            where += " or the whole reply"
        return f"one label, -1, 0 or 1, as {where}"


def parse_compare_template(name: str, raw: bytes) -> ComparePrompt:
    where = f"prompt {name!r}"
    try:
        doc = strict_yaml.load(raw)
    except yaml.YAMLError as err:
        raise PromptTemplateError(f"{where} is not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise PromptTemplateError(f"{where} must be a mapping")
    unknown = set(doc) - {"description", "variables", "answer", *_TEXTS}
    if unknown:
        raise PromptTemplateError(f"{where} has unknown keys: {sorted(unknown)}")
    for key in ("episode_label", "query", "describe", "label"):
        if not isinstance(doc.get(key), str) or not doc[key].strip():
            raise PromptTemplateError(f"{where}: {key!r} must be a non-empty string (a comparison template "
                                      "declares episode_label, query, describe and label)")
    declared = doc.get("variables") or {}
    if not isinstance(declared, dict) or not all(isinstance(s or {}, dict) for s in declared.values()):
        raise PromptTemplateError(f"{where}: 'variables' must be a mapping of mappings")
    variables = {str(k): (v or {}).get("default", _MISSING) for k, v in declared.items()}
    taken = set(variables) & set(_BUILT_IN.values())
    if taken:
        raise PromptTemplateError(f"{where}: variables {sorted(taken)} are filled by the proxy; rename them")
    for part in _TEXTS:
        text = doc.get(part)
        if text is None:
            continue
        template = Template(text) if isinstance(text, str) else None
        if template is None or not template.is_valid():
            raise PromptTemplateError(f"{where}: {part} must be a string with well-formed $ placeholders")
        allowed = set(variables) | ({_BUILT_IN[part]} if part in _BUILT_IN else set())
        undeclared = set(template.get_identifiers()) - allowed
        if undeclared:
            raise PromptTemplateError(f"{where}: {part} uses undeclared variable(s) {sorted(undeclared)}")
    if "description" not in Template(doc["label"]).get_identifiers():
        raise PromptTemplateError(f"{where}: label must carry step 1's reply as ${{description}}")
    answer = doc.get("answer") or {}
    tags, untagged = (answer.get("tags", []), answer.get("untagged", False)) if isinstance(answer, dict) else (0, 0)
    if (not isinstance(answer, dict) or set(answer) - {"tags", "untagged"} or not isinstance(untagged, bool)
            or not isinstance(tags, list) or not all(isinstance(t, str) and t.isidentifier() for t in tags)):
        raise PromptTemplateError(f"{where}: answer must be {{tags: [name, …], untagged: true|false}}")
    return ComparePrompt(name=name, sha256=hashlib.sha256(raw).hexdigest(),
                         description=str(doc.get("description", "")),
                         texts={part: doc.get(part) for part in _TEXTS}, variables=variables,
                         tags=tuple(tags), untagged=untagged or not tags)


def parse_label(text: str, prompt: ComparePrompt, *, finish_reason: str | None = None) -> tuple[int, str]:
    """(label, where it was found) from a reply, or LabelParseError carrying the reply."""

    def fail(reason: str) -> LabelParseError:
        return LabelParseError(f"{reason}; the template asks for {prompt.describe_answer()}",
                               output_text=text, finish_reason=finish_reason)

    fragment, source = declared_fragment(text, prompt.tags, prompt.untagged, fail, what="label",
                                         finish_reason=finish_reason)
    match = _LABEL_FORM.match(fragment)
    if match is None:
        raise fail(f"{fragment.strip()[:60]!r} is not a label")
    return int(match.group(1)), source


def read_description(text: str, *, finish_reason: str | None = None) -> str:
    """Step 1's reply as step 2 carries it: the text after any reasoning; an empty one is re-asked."""
    visible = strip_reasoning(text or "").strip() or (text or "").strip()
    if not visible:
        raise LabelParseError("step 1 (describe) replied with nothing to read a label from",
                              output_text=text, finish_reason=finish_reason)
    return visible


def swap_label(label: int) -> int:
    """A label about the order (B, A) in the order (A, B): 0 and 1 trade places, -1 stays."""
    return {0: 1, 1: 0, -1: -1}[label]


def combine_orders(first: int, second_swapped: int) -> tuple[int, bool]:
    """(label, agree) from the label of (A, B) and the label of (B, A) mapped back to (A, B):
    the same preference both ways is that preference; any disagreement is no preference (-1)."""
    second = swap_label(second_swapped)
    return (first, True) if first == second else (-1, False)
