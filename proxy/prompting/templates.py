"""Prompt templates as files: load, validate declared variables, render, hot-reload, hash.

A template is `prompts/<name>.yaml`:

    description: what it is for
    variables:                      # every ${name} used must be declared here
      task_text: {description: the instruction}            # required
      hint: {default: "", description: optional extra}     # optional
    system: "..."                   # optional; ${var} placeholders allowed
    user: "... ${task_text} ..."
    answer:                         # required: what counts as the model's answer (proxy/answers/parse.py)
      tags: [answer]                # the reply must hold exactly one; [] = untagged only
      untagged: false               # also accept a reply that is just the number
      scale: {min: 0, max: 100}     # or `binary`; `zero: 1` makes a 1-5 scale start at 0
      constrain: false              # ask vLLM to hold the reply to this format (proxy/answers/constraints.py)
      reasoning: false              # the reply opens with <think>…</think> (the constraint allows it)
      label: "ANSWER:"              # instead of tags: the answer follows this text on its line (RoboReward)
    or, for a probability read from the logprobs instead of a number in the text (TOPReward's P(done)):
    answer: {probability: {affirmative: "True", negative: "False"}}

`${name}` placeholders (string.Template) keep literal braces in prompts free to use. Rendered
text has no leading or trailing whitespace (YAML block scalars end in a newline). A file is
re-read when its mtime or size changes. Outside an event loop (start-up, tools) `get` checks the
file at once, so an edit applies to the next call; on the loop it never touches the disk: it
answers from the cache and has a worker thread check the file (at most one check per template at
a time, `recheck_s` apart), so an edit applies to the requests after that check, within a moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import yaml

from proxy.answers.parse import AnswerSpec, PerFrame
from proxy.answers.scales import BINARY, UNIT, Scale
from proxy.errors import PromptTemplateError, TemplateVariableError
from vlm_protocol import strict_yaml

_REQUIRED = object()
# Where a per_frame template's user text places its pictures (the layout fills them, never a caller)
MEDIA_SLOTS = ("first_frame", "frames")


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    sha256: str
    description: str
    system: str | None
    user: str
    variables: dict[str, Any]  # name -> default, or _REQUIRED
    answer: AnswerSpec
    slots: frozenset[str] = frozenset()  # MEDIA_SLOTS a per_frame template's user text holds (not variables)

    @property
    def variable_names(self) -> set[str]:
        return set(self.variables)

    def render(self, values: dict[str, Any], slots: dict[str, str] | None = None) -> tuple[str | None, str]:
        """(system, user) with every variable filled; a missing required one is a 422. `slots`: the
        layout's markers for the MEDIA_SLOTS of the user text (never a caller's value)."""
        if self.slots and set(slots or {}) != self.slots:
            raise ValueError(f"prompt {self.name!r} places pictures at {sorted(self.slots)}: the layout fills them")
        merged: dict[str, Any] = {}
        for name, default in self.variables.items():
            if name in values:
                merged[name] = str(values[name])
            elif default is _REQUIRED:
                raise TemplateVariableError(
                    f"prompt {self.name!r} needs variable {name!r}; pass it in backend_kwargs",
                    field=f"backend_kwargs.{name}")
            else:
                merged[name] = str(default)
        system = Template(self.system).substitute(merged).strip() if self.system else None
        return system or None, Template(self.user).substitute({**merged, **(slots or {})}).strip()


def parse_template(name: str, raw: bytes) -> PromptTemplate:
    try:
        doc = strict_yaml.load(raw)
    except yaml.YAMLError as err:
        raise PromptTemplateError(f"prompt {name!r} is not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise PromptTemplateError(f"prompt {name!r} must be a mapping with at least 'user'")
    unknown = set(doc) - {"description", "variables", "system", "user", "answer"}
    if unknown:
        raise PromptTemplateError(f"prompt {name!r} has unknown keys: {sorted(unknown)}")
    user, system = doc.get("user"), doc.get("system")
    if not isinstance(user, str) or not user.strip():
        raise PromptTemplateError(f"prompt {name!r}: 'user' must be a non-empty string")
    if system is not None and not isinstance(system, str):
        raise PromptTemplateError(f"prompt {name!r}: 'system' must be a string")
    declared = doc.get("variables") or {}
    if not isinstance(declared, dict):
        raise PromptTemplateError(f"prompt {name!r}: 'variables' must be a mapping")
    variables: dict[str, Any] = {}
    for var, spec in declared.items():
        spec = spec or {}
        if not isinstance(spec, dict):
            raise PromptTemplateError(f"prompt {name!r}: variables.{var} must be a mapping")
        variables[str(var)] = spec.get("default", _REQUIRED)
    answer = parse_answer_spec(name, doc.get("answer"))
    slots = set(MEDIA_SLOTS) if answer.per_frame else set()
    for part_name, text in (("system", system), ("user", user)):
        if not text:
            continue
        template = Template(text)
        if not template.is_valid():
            raise PromptTemplateError(f"prompt {name!r}: {part_name} has a malformed $ placeholder "
                                      "(write $$ for a literal $)")
        undeclared = set(template.get_identifiers()) - set(variables) - (slots if part_name == "user" else set())
        if undeclared:
            raise PromptTemplateError(
                f"prompt {name!r}: {part_name} uses undeclared variable(s) {sorted(undeclared)}")
    # the layout puts the pictures where the user text names them: ${frames} once, ${first_frame} at most
    # once and before it (proxy/prompting/layouts.py cuts the text there)
    at = {slot: [m.start() for m in re.finditer(r"\$(?:\{" + slot + r"\}|" + slot + r"\b)", user)] for slot in slots}
    if slots and (len(at["frames"]) != 1 or len(at["first_frame"]) > 1 or slots & set(variables)
                  or (at["first_frame"] and at["first_frame"][0] > at["frames"][0])):
        raise PromptTemplateError(f"prompt {name!r}: a per_frame answer's user text places the shown frames with "
                                  "${frames} once (and the reference frame with ${first_frame} at most once, before "
                                  "it); neither is declared as a variable")
    return PromptTemplate(
        name=name, sha256=hashlib.sha256(raw).hexdigest(), description=str(doc.get("description", "")),
        system=system, user=user, variables=variables, answer=answer, slots=frozenset(slots),
    )


def parse_answer_spec(name: str, declared: Any) -> AnswerSpec:
    """The template's `answer` block. Required: a reply is a score only if it holds the answer
    the template asked for, so the template must say what that is."""
    where = f"prompt {name!r}: answer"
    if not isinstance(declared, dict):
        raise PromptTemplateError(f"{where} must be declared: a mapping with tags, untagged and scale "
                                  "(e.g. answer: {tags: [answer], scale: {min: 0, max: 100}})")
    unknown = set(declared) - {"tags", "untagged", "scale", "constrain", "reasoning", "label", "probability",
                             "per_frame"}
    if unknown:
        raise PromptTemplateError(f"{where} has unknown keys: {sorted(unknown)}")
    if "probability" in declared:
        return _probability_answer(where, declared)
    per_frame = _per_frame(where, declared.get("per_frame"))
    tags = declared.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and t.isidentifier() for t in tags):
        raise PromptTemplateError(f"{where}.tags must be a list of tag names, e.g. [answer]")
    flags = {key: declared.get(key, False) for key in ("untagged", "constrain", "reasoning")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise PromptTemplateError(f"{where}.{key} must be true or false")
    raw_scale = declared.get("scale")
    if raw_scale == "binary":
        scale = BINARY
    elif isinstance(raw_scale, dict) and set(raw_scale) <= {"min", "max", "zero"} and {"min", "max"} <= set(raw_scale):
        try:
            scale = Scale(float(raw_scale["min"]), float(raw_scale["max"]), float(raw_scale.get("zero", 0)))
        except (TypeError, ValueError) as err:
            raise PromptTemplateError(f"{where}.scale: {err}") from err
    else:
        raise PromptTemplateError(f"{where}.scale must be `binary` or {{min, max[, zero]}}, got {raw_scale!r}")
    label = declared.get("label")
    if label is not None and (not isinstance(label, str) or not label.strip() or "\n" in label or tags):
        raise PromptTemplateError(f"{where}.label must be the text that opens the answer on one line "
                                  "(e.g. 'ANSWER:'), without tags")
    if per_frame and (tags or label is not None or scale.binary or flags["reasoning"]):
        raise PromptTemplateError(f"{where}: a per_frame answer's lines are its format: no tags, label, reasoning or "
                                  "binary scale")
    return AnswerSpec(tags=tuple(tags), untagged=(flags["untagged"] or not tags) and label is None and not per_frame,
                      scale=scale, constrain=flags["constrain"], reasoning=flags["reasoning"], label=label,
                      per_frame=per_frame)


def _per_frame(where: str, declared: Any) -> PerFrame | None:
    """`per_frame: {label: "Frame {i}:", reply: "Frame {i}: ... {value}%"}` (GVL: one value per frame)."""
    if declared is None:
        return None
    if not (isinstance(declared, dict) and set(declared) == {"label", "reply"}
            and all(isinstance(v, str) and "\n" not in v for v in declared.values())
            and declared["label"].count("{i}") == 1 and declared["reply"].count("{i}") == 1
            and declared["reply"].count("{value}") == 1
            and declared["reply"].index("{i}") < declared["reply"].index("{value}")):
        raise PromptTemplateError(f"{where}.per_frame must be {{label: 'Frame {{i}}:', reply: 'Frame {{i}}: ... "
                                  "{value}%'}: one line each, {i} once in both, {value} once in reply after {i}")
    return PerFrame(label=declared["label"], reply=declared["reply"])


def _probability_answer(where: str, declared: dict) -> AnswerSpec:
    """`probability: {affirmative: "True", negative: "False"}`: the score is P(affirmative) as the
    reply's first token, read from the logprobs (proxy/answers/probability.py). Nothing in the
    text is parsed, so tags, a scale, a label or a constraint would mean nothing here; the
    constraint would even change the number (vLLM masks the logits before it computes logprobs)."""
    words = declared["probability"]
    if not (isinstance(words, dict) and set(words) == {"affirmative", "negative"}
            and all(isinstance(w, str) and w and w == w.strip() for w in words.values())
            and words["affirmative"] != words["negative"]):
        raise PromptTemplateError(f"{where}.probability must be {{affirmative: <token>, negative: <token>}}: two "
                                  "different words without surrounding spaces, e.g. {affirmative: 'True', "
                                  "negative: 'False'}")
    others = sorted(set(declared) - {"probability"})
    if others:
        raise PromptTemplateError(f"{where}: a probability answer is read from the logprobs, not the text: "
                                  f"{', '.join(others)} mean nothing with it")
    return AnswerSpec(tags=(), untagged=False, scale=UNIT, probability=(words["affirmative"], words["negative"]))


class PromptStore:
    """Templates by name from one directory, re-read when a file changes (off the loop on it)."""

    def __init__(self, directory: Path, parser: Callable[[str, bytes], Any] | None = None, *,
                 recheck_s: float = 0.25) -> None:
        self.directory = Path(directory)
        self._parse = parser or parse_template  # another kind of template (proxy/answers/preference.py) brings its own
        # name -> (the file's (mtime, size), its template or the error reading it gave)
        self._cache: dict[str, tuple[tuple[int, int] | None, Any]] = {}
        self._checked: dict[str, float] = {}  # name -> time.monotonic() of its last check
        self._inflight: dict[str, asyncio.Future] = {}  # name -> its check running off the loop
        self.recheck_s = recheck_s
        self._lock = threading.Lock()

    def path_of(self, name: str) -> Path:
        if "/" in name or "\\" in name or name.startswith("."):
            raise PromptTemplateError(f"prompt name {name!r} must be a plain file stem")
        return self.directory / f"{name}.yaml"

    def get(self, name: str) -> PromptTemplate:
        path = self.path_of(name)
        with self._lock:
            cached = self._cache.get(name)
        if cached is None or not _on_a_loop():  # the first use (start-up checks it) or no loop: read now
            cached = self._check(name, path)
        else:
            self._check_later(name, path)
        if isinstance(cached[1], Exception):
            raise cached[1].with_traceback(None)  # the cached error, without the last raise's frames
        return cached[1]

    async def settled(self) -> None:
        """Wait for the checks running off the loop (tests: the re-read is then in the cache)."""
        while self._inflight:
            await asyncio.gather(*self._inflight.values())

    def _check_later(self, name: str, path: Path) -> None:
        now = time.monotonic()
        with self._lock:
            if name in self._inflight or now - self._checked.get(name, 0.0) < self.recheck_s:
                return
            self._checked[name] = now
        future = asyncio.get_running_loop().run_in_executor(None, self._check, name, path)
        self._inflight[name] = future
        future.add_done_callback(lambda _: self._inflight.pop(name, None))

    def _check(self, name: str, path: Path) -> tuple[tuple[int, int] | None, Any]:
        """stat the file; re-read and parse it when it changed. Never raises: an error is cached
        (and raised by `get`) until the file changes again."""
        self._checked[name] = time.monotonic()
        try:
            stat = path.stat()
        except OSError:
            entry: tuple[tuple[int, int] | None, Any] = (None, PromptTemplateError(
                f"prompt {name!r} not found at {path}"))
        else:
            stamp = (stat.st_mtime_ns, stat.st_size)
            with self._lock:
                cached = self._cache.get(name)
            if cached and cached[0] == stamp:
                return cached
            try:
                entry = (stamp, self._parse(name, path.read_bytes()))
            except PromptTemplateError as err:
                entry = (stamp, err)
            except OSError as err:
                entry = (None, PromptTemplateError(f"prompt {name!r} cannot be read at {path}: {err}"))
        with self._lock:
            self._cache[name] = entry
        return entry


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# The seed's backend_kwargs that replace prompt text (10-OASIS-01/RLinf-RLAIF, libero_reward_server.py).
SEED_PROMPT_KWARGS = ("system_prompt", "user_prompt", "prompt_template")
_TASK_PLACEHOLDERS = ("{task_instruction}", "{task}")


def apply_seed_overrides(system: str | None, user: str, task_text: str,
                         overrides: dict[str, str]) -> tuple[str | None, str]:
    """The seed's meaning: `system_prompt` replaces the system text as given; `prompt_template`
    and `user_prompt` replace the whole user text, with {task_instruction} / {task} filled in;
    a `user_prompt` with neither placeholder gets "Task info:\n<task>\n\n" in front (the seed's
    PRIMO backend), a `prompt_template` does not (its Qwen backend). The template's declared
    answer still decides what counts as a score."""
    if "user_prompt" in overrides and "prompt_template" in overrides:
        raise TemplateVariableError("give user_prompt or prompt_template, not both: each replaces the "
                                    "whole user text", field="backend_kwargs.user_prompt")
    if "system_prompt" in overrides:
        system = overrides["system_prompt"].strip() or None
    for key in ("prompt_template", "user_prompt"):
        if key in overrides:
            text = overrides[key]
            has_placeholder = any(p in text for p in _TASK_PLACEHOLDERS)
            for placeholder in _TASK_PLACEHOLDERS:
                text = text.replace(placeholder, task_text)
            if key == "user_prompt" and not has_placeholder:
                text = f"Task info:\n{task_text}\n\n{text}"
            user = text.strip()
    return system, user
