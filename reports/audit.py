"""Reading the proxy's audit log (proxy.audit_log, one JSON line per scored or failed episode),
one line at a time (audit_lines.py reads them).

A log of a million lines streams: what is kept per (backend, task_id) is numbers in flat arrays
(score, ground truth, latency, tokens, an episode key for comparing two logs), counters, and a
bounded heap of the episodes whose score disagrees most with the simulator. Never the records.

The live monitor's lines (kind quality_alarm, probe) are read by reports/monitor_lines.py and
counted apart, like /compare lines: never episodes.

Tolerant by design: unknown keys are ignored; a line that is not a JSON object, or holds neither
a score nor an error, is counted as malformed (with its line number) and skipped; a line without
`metadata.env_success` is counted but left out of the agreement numbers.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reports.audit_lines import audit_files, audit_records
from reports.by_task import ByTask
from reports.cascade_lines import CascadeLog
from reports.dense_curves import DenseLog
from reports.monitor_lines import AlarmLog, ProbeLog
from reports.progress_quality import ProgressLog

__all__ = ["PARSE_FAILURE", "NO_TASK", "AuditSummary", "Group", "Worst", "read_audit_log"]

PARSE_FAILURE = "unparseable_score"  # the error code of a reply that held no score
NO_TASK = "(no task_id)"
NO_KEY = 0  # an episode without metadata.episode_id: matched by line only (a replay's replay_of_line)
MAX_TASKS_PER_BACKEND = 200  # more task ids than this (an id per episode?) are pooled
OTHER_TASKS = "(other tasks)"
MAX_EXAMPLES = 3  # parse-failure replies and malformed lines kept to show
TEXT_CHARS = 300


@dataclass
class Worst:
    """One episode whose score disagrees with env_success: what its contact sheet needs."""

    disagreement: float
    line: int
    backend: str
    task_id: str
    episode_id: str | None
    task_text: str
    score: float
    raw_score: Any
    env_success: bool
    output_text: str
    frames: list[str]  # video frame hashes, in order
    stills: list[str]  # still images' hashes (PRIMO's first and last)


@dataclass
class Group:
    """Everything kept about one (backend, task_id): numbers, not records. Arrays are aligned
    per scored episode (score, truth) or per line that has the value (latency, tokens)."""

    lines: int = 0
    scored: int = 0
    errors: Counter = field(default_factory=Counter)  # code -> count (parse failures included)
    truth_lines: int = 0  # lines with env_success, scored or not
    scores: array = field(default_factory=lambda: array("d"))
    truth: array = field(default_factory=lambda: array("b"))  # 1, 0, or -1 = unknown; per score
    latency_ms: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("d"))
    completion_tokens: array = field(default_factory=lambda: array("d"))

    @property
    def parse_failures(self) -> int:
        return self.errors.get(PARSE_FAILURE, 0)

    @property
    def failed(self) -> int:
        """Errors other than parse failures."""
        return sum(self.errors.values()) - self.parse_failures

    def absorb(self, other: Group) -> None:
        self.lines += other.lines
        self.scored += other.scored
        self.errors.update(other.errors)
        self.truth_lines += other.truth_lines
        for name in ("scores", "truth", "latency_ms", "prompt_tokens", "completion_tokens"):
            getattr(self, name).extend(getattr(other, name))


@dataclass
class Episodes:
    """One backend's episode keys (metadata.episode_id + task_text), for matching two logs."""

    keys: array = field(default_factory=lambda: array("q"))
    scores: array = field(default_factory=lambda: array("d"))  # NaN: not scored
    truth: array = field(default_factory=lambda: array("b"))
    lines: array = field(default_factory=lambda: array("q"))  # this line's number
    replay_of: array = field(default_factory=lambda: array("q"))  # metadata.replay_of_line, or -1


@dataclass
class AuditSummary(ByTask["Group"]):
    path: Path
    worst_k: int
    lines: int = 0  # non-blank lines read
    malformed: int = 0
    malformed_examples: list[tuple[int, str]] = field(default_factory=list)
    groups: dict[tuple[str, str], Group] = field(default_factory=dict)
    models: dict[str, Counter] = field(default_factory=dict)  # backend -> model -> count
    prompts: Counter = field(default_factory=Counter)  # (backend, name, sha256, overrides) -> count
    parse_examples: dict[str, list[str]] = field(default_factory=dict)  # backend -> replies
    store_errors: Counter = field(default_factory=Counter)  # frame_store.error -> count
    episodes: dict[str, Episodes] = field(default_factory=dict)
    without_episode_id: int = 0
    other_kinds: Counter = field(default_factory=Counter)  # e.g. /compare lines: not episode scores
    progress: ProgressLog = field(default_factory=ProgressLog)  # kind: progress lines, kept apart
    alarms: AlarmLog = field(default_factory=AlarmLog)  # kind: quality_alarm lines (also in other_kinds)
    probes: ProbeLog = field(default_factory=ProbeLog)  # kind: probe lines (also in other_kinds)
    dense: DenseLog = field(default_factory=DenseLog)  # kind: dense_point lines (also in other_kinds)
    cascades: CascadeLog = field(default_factory=CascadeLog)  # scored lines' `cascade` fields
    first_ts: float | None = None
    last_ts: float | None = None
    _worst: dict[str, list] = field(default_factory=dict)  # backend -> min-heap of the worst

    @property
    def records(self) -> int:
        return self.lines - self.malformed - sum(self.other_kinds.values())

    def new_group(self) -> Group:
        return Group()

    def worst(self, backend: str) -> list[Worst]:
        """The worst_k biggest |score - env_success|, biggest first (earlier lines first on ties)."""
        return [item for *_, item in sorted(self._worst.get(backend, []), reverse=True)]

    # -- one record -----------------------------------------------------------------------------
    def add(self, record: dict[str, Any], line: int) -> str | None:
        """Fold one parsed line in; returns why it is malformed, or None."""
        ts = _number(record.get("ts"))
        if ts is not None:
            self.first_ts = ts if self.first_ts is None or ts < self.first_ts else self.first_ts
            self.last_ts = ts if self.last_ts is None or ts > self.last_ts else self.last_ts
        if record.get("kind") == "progress":  # /progress/batch items: measured apart, never as scores
            return self.progress.add(record)
        kind = record.get("kind", "score")
        if kind in ("quality_alarm", "probe"):  # the live monitor's lines: read, yet never episodes
            why = self.alarms.add(record, line) if kind == "quality_alarm" else self.probes.add(record)
            if why is None:  # a malformed one is counted as malformed only, so `records` stays right
                self.other_kinds[kind] += 1
            return why
        if kind == "dense_point":  # a prefix of a dense curve: read for its curve's VOC, never an episode
            why = self.dense.add(record)
            if why is None:
                self.other_kinds[kind] += 1
            return why
        if kind != "score":  # a comparison (/compare) is not an episode's score
            self.other_kinds[str(record.get("kind"))] += 1
            return None
        error = record.get("error")
        score = _number(record.get("score"))
        if isinstance(error, dict):
            code = str(error.get("code") or "unknown_error")
        elif score is not None and 0.0 <= score <= 1.0:
            code = None
        else:
            return "neither a score in [0, 1] nor an error"
        backend = str(record.get("backend") or "(no backend)")
        metadata = record.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}
        success = _truth(metadata.get("env_success"))
        group = self._group(backend, metadata.get("task_id"))
        group.lines += 1
        group.truth_lines += success >= 0
        usage = record.get("usage")
        if isinstance(usage, dict):
            _append_number(group.prompt_tokens, usage.get("prompt_tokens"))
            _append_number(group.completion_tokens, usage.get("completion_tokens"))
        self._prompt(backend, record.get("prompt"))
        store = record.get("frame_store")
        if isinstance(store, dict) and store.get("error"):
            self.store_errors[str(store["error"]).split(":")[0][:80]] += 1
        self._episode(backend, metadata, record.get("task_text"), score if code is None else math.nan, success,
                      line)
        if code is not None:
            group.errors[code] += 1
            if code == PARSE_FAILURE:
                examples = self.parse_examples.setdefault(backend, [])
                if len(examples) < MAX_EXAMPLES:
                    examples.append(str(record.get("output_text") or error.get("message") or "")[:TEXT_CHARS])
            return None
        group.scored += 1
        if "cascade" in record:
            self.cascades.add(record)
        group.scores.append(score)
        group.truth.append(success)
        _append_number(group.latency_ms, (record.get("timings_ms") or {}).get("total")
                       if isinstance(record.get("timings_ms"), dict) else None)
        self.models.setdefault(backend, Counter())[str(record.get("model"))] += 1
        if isinstance(record.get("per_frame"), list):  # a one-call curve (GVL): its VOC beside the prefix curves'
            self.dense.add_curve(backend, metadata, [p.get("score") if isinstance(p, dict) else None
                                                     for p in record["per_frame"]])
        if success >= 0 and self.worst_k > 0:
            self._consider_worst(record, backend, metadata, score, bool(success), line)
        return None

    def _group(self, backend: str, task_id: Any) -> Group:
        key = (backend, NO_TASK if task_id is None else str(task_id))
        group = self.groups.get(key)
        if group is None:
            if sum(1 for b, _ in self.groups if b == backend) >= MAX_TASKS_PER_BACKEND:
                key = (backend, OTHER_TASKS)
            group = self.groups.setdefault(key, Group())
        return group

    def _prompt(self, backend: str, prompt: Any) -> None:
        if not isinstance(prompt, dict):
            prompt = {}
        overrides = prompt.get("overrides") or ""
        if isinstance(overrides, dict):
            overrides = ", ".join(f"{k}={str(v)[:12]}" for k, v in sorted(overrides.items()))
        self.prompts[(backend, str(prompt.get("name")), str(prompt.get("sha256")), str(overrides))] += 1

    def _episode(self, backend: str, metadata: dict, task_text: Any, score: float, success: int,
                 line: int) -> None:
        episode_id = metadata.get("episode_id")
        if episode_id is None:
            self.without_episode_id += 1
        replay_of = metadata.get("replay_of_line")
        episodes = self.episodes.setdefault(backend, Episodes())
        episodes.keys.append(episode_key(episode_id, task_text) if episode_id is not None else NO_KEY)
        episodes.scores.append(score)
        episodes.truth.append(success)
        episodes.lines.append(line)
        episodes.replay_of.append(replay_of if type(replay_of) is int and replay_of > 0 else -1)

    def _consider_worst(self, record: dict, backend: str, metadata: dict, score: float, success: bool,
                        line: int) -> None:
        disagreement = abs(score - float(success))
        heap = self._worst.setdefault(backend, [])
        if len(heap) >= self.worst_k and (disagreement, -line) <= heap[0][:2]:
            return  # cheap exit: most lines are not among the worst
        frames = record.get("frames") if isinstance(record.get("frames"), dict) else {}
        item = Worst(disagreement, line, backend, str(metadata.get("task_id", NO_TASK)),
                     None if metadata.get("episode_id") is None else str(metadata["episode_id"]),
                     str(record.get("task_text") or "")[:TEXT_CHARS], score, record.get("raw_score"), success,
                     str(record.get("output_text") or "")[:TEXT_CHARS],
                     _hashes(frames.get("sha256")), _hashes(frames.get("still_sha256")))
        entry = (disagreement, -line, item)
        if len(heap) < self.worst_k:
            heapq.heappush(heap, entry)
        else:
            heapq.heappushpop(heap, entry)


def episode_key(episode_id: Any, task_text: Any) -> int:
    """A 64-bit key for (episode_id, task_text): the same episode in two logs has the same key."""
    digest = hashlib.blake2b(f"{episode_id}\x00{task_text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def read_audit_log(path: str | Path, *, worst_k: int = 8) -> AuditSummary:
    """Stream the log (plain or .gz; its rotated files first). Raises FileNotFoundError / ValueError
    (empty) with a clear message."""
    path = Path(path)
    if not audit_files(path):  # the current file, or only rotated ones (just rotated)
        raise FileNotFoundError(f"{path}: no such audit log")
    summary = AuditSummary(path, worst_k)
    for number, record, why in audit_records(path):
        summary.lines += 1
        if record is not None:
            why = summary.add(record, number)
        if why is not None:
            summary.malformed += 1
            if len(summary.malformed_examples) < MAX_EXAMPLES:
                summary.malformed_examples.append((number, why))
    if summary.lines == 0:
        raise ValueError(f"{path}: the audit log is empty")
    if summary.records == 0 and summary.malformed_examples:
        raise ValueError(f"{path}: none of its {summary.lines} lines is an audit record "
                         f"(first: line {summary.malformed_examples[0][0]}, {summary.malformed_examples[0][1]})")
    if summary.records == 0:  # e.g. only the live monitor's lines: nothing to measure them against
        raise ValueError(f"{path}: none of its {summary.lines} lines is an episode's audit record (only "
                         + ", ".join(f"{kind} ×{n}" for kind, n in sorted(summary.other_kinds.items())) + ")")
    return summary


def _number(value: Any) -> float | None:
    """A finite number from JSON (int or float, not a bool) as a float; None for anything else."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    return float(value) if kind is int else None


def _append_number(target: array, value: Any) -> None:
    if (number := _number(value)) is not None:
        target.append(number)


def _truth(value: Any) -> int:
    """1 / 0 for a success flag (a bool, or 0/1), -1 when the line has none."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return int(value)
    return -1


def _hashes(value: Any) -> list[str]:
    return [h for h in value if isinstance(h, str)] if isinstance(value, list) else []
