"""A restart's monitor, rebuilt from the tail of the proxy's own audit log.

The log is read from its end backwards (the current file, then `file.1`, `file.2`, ... as the
proxy rotates them), at most `quality.restore.max_lines` lines and `max_seconds` seconds, and the
lines read are replayed oldest first through the same `KeyWindow` the live monitor uses:

- an episode line that carries `metadata.env_success` (kind `score`, or the `dense_point` line
  marked `dense.episode`, the point the monitor saw as the whole episode) adds its score, or no
  score for an `unparseable_score` failure, and the alarm rule judges it as it did live;
- a `quality_alarm` line is what the live monitor decided: its status sets the alarm (`reset`,
  written when the process stopped, leaves an open alarm open), its `episodes_seen` the count and
  its `first_window` the first full window, so a tail that starts mid-history still ends right; a
  `quality_window` line (every other key's, at a clean stop) does the same for a key not in alarm;
- a `probe` line adds its scores to its key's probe numbers.

Replayed lines (`metadata.replay_of_line`) are never evidence. The state is exact when the tail
holds every key's last `window` episodes and the key's last alarm line (or its whole history);
the answer says how far back it read and why it stopped. Nothing here touches the event loop or
the metrics: the monitor adopts the windows (QualityMonitor.adopt).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.config import QualityConfig
from proxy.quality.cascade_window import StageOutcome, stage_outcomes
from proxy.quality.monitor import Key, quality_key, stage_label, threshold_of
from proxy.quality.window import KeyWindow
from vlm_protocol.agreement import ALARM, OK, RESET, UNKNOWN

__all__ = ["Restored", "log_files", "rebuild"]

BLOCK = 1 << 20  # bytes read at a time from a file's end
PARSE_ERROR = "unparseable_score"  # proxy.errors.ScoreParseError.code: a reply, but no score
# Lines that can matter, found before a line is parsed (most lines of a busy log are not).
WANTED = (b'"env_success"', b'"quality_alarm"', b'"quality_window"', b'"probe"', b'"cascade"')


@dataclass
class Restored:
    """What the rebuild found: the windows (least recently seen first) and where they came from."""

    windows: dict[Key, KeyWindow] = field(default_factory=dict)
    sources: dict[Key, dict[str, Any]] = field(default_factory=dict)  # per key: episodes and time span read
    files: list[str] = field(default_factory=list)  # the files read, newest first
    lines: int = 0
    stopped_by: str = "start_of_log"  # or max_lines, max_seconds
    seconds: float = 0.0
    oldest_ts: float | None = None
    newest_ts: float | None = None
    # each cascade episode's stage outcomes, oldest first (its escalation and audit rates)
    cascades: list[tuple[Key, list[StageOutcome]]] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"files": self.files, "lines_read": self.lines, "stopped_by": self.stopped_by,
                "seconds": round(self.seconds, 3), "from_ts": self.oldest_ts, "to_ts": self.newest_ts,
                "keys": len(self.windows), "alarms": sum(w.alarmed for w in self.windows.values())}


def log_files(path: Path) -> list[Path]:
    """The log's files, newest first: `path`, `path.1`, `path.2`, ... (proxy/audit.py's rotation)."""
    files = [path] if path.is_file() else []
    number = 1
    while (rotated := path.with_name(f"{path.name}.{number}")).is_file():
        files.append(rotated)
        number += 1
    return files


def _lines_backwards(path: Path) -> Iterator[bytes]:
    """One file's lines, last first, read in blocks from its end."""
    with path.open("rb") as fh:
        position = fh.seek(0, os.SEEK_END)
        rest = b""
        while position > 0:
            step = min(BLOCK, position)
            position -= step
            fh.seek(position)
            block = fh.read(step) + rest
            lines = block.split(b"\n")
            rest = lines[0]  # may continue in the block before
            yield from reversed(lines[1:])
        yield rest


def _event(record: dict[str, Any]) -> tuple | list[tuple] | None:
    """What one audit line tells the monitor, or None."""
    kind = record.get("kind", "score")
    if kind in ("quality_alarm", "quality_window"):
        status = record.get("status")
        if status not in (ALARM, OK, RESET, UNKNOWN) or not isinstance(record.get("backend"), str):
            return None
        key = (record.get("run"), record["backend"], str(record.get("task_id")))
        # a reset line's own reason says the process stopped; the alarm's is kept beside it
        reason = record.get("alarm_reason", record.get("reason")) if status == RESET else record.get("reason")
        return ("mark", key, status, reason, record.get("episodes_seen"), record.get("first_window"),
                record.get("numbers"))
    if kind == "probe":
        original, probe = record.get("original_score"), record.get("probe_score")
        if not (_number(original) and _number(probe) and isinstance(record.get("backend"), str)):
            return None
        return ("probe", (record.get("run"), record["backend"], str(record.get("task_id"))), record.get("probe"),
                float(original), float(probe))
    metadata = record.get("metadata")
    watched = _cascade_event(record, metadata)  # a cascade's rates need no ground truth
    if not isinstance(metadata, dict) or not isinstance(metadata.get("env_success"), bool):
        return watched
    events = [*(_episode_events(record, metadata) or []), *([watched] if watched is not None else [])]
    return events or None


def _cascade_event(record: dict[str, Any], metadata: Any) -> tuple | None:
    cascade = record.get("cascade")
    if (record.get("kind", "score") != "score" or not isinstance(cascade, dict) or "error" in record
            or not isinstance(record.get("backend"), str) or (metadata or {}).get("replay_of_line") is not None):
        return None
    stages = [s for s in cascade.get("stages") or [] if isinstance(s, dict) and _number(s.get("score"))]
    if not stages or not _number(cascade.get("threshold")):
        return None
    key = quality_key(record["backend"], str(record.get("task_text") or ""), metadata if isinstance(metadata, dict)
                      else None)
    return ("cascade", key, stage_outcomes(stages, float(cascade["threshold"]), record.get("stopped")))


def _episode_events(record: dict[str, Any], metadata: dict[str, Any]) -> list[tuple] | None:
    kind = record.get("kind", "score")
    if metadata.get("replay_of_line") is not None or not isinstance(record.get("backend"), str):
        return None
    if kind == "dense_point" and not (record.get("dense") or {}).get("episode"):
        return None  # a prefix of a curve, not the episode
    if kind not in ("score", "dense_point"):
        return None
    score = record.get("score")
    if _number(score):
        score = float(score)
    elif (record.get("error") or {}).get("code") == PARSE_ERROR:
        score = None
    else:
        return None  # failed before any reply: the monitor never saw it
    task_text = str(record.get("task_text") or "")
    final = ("episode", quality_key(record["backend"], task_text, metadata), score, metadata["env_success"], metadata)
    # A cascade's stages went to the monitor only when the episode was answered.
    stages = [] if "error" in record else (record.get("cascade") or {}).get("stages") or []
    # A cascade's stages go to the monitor after its final score, each under its own key.
    return [final, *(("episode", quality_key(stage_label(record["backend"], stage["backend"]), task_text, metadata),
                      float(stage["score"]), metadata["env_success"], metadata)
                     for stage in stages if isinstance(stage, dict) and isinstance(stage.get("backend"), str)
                     and _number(stage.get("score")))]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def rebuild(path: Path, config: QualityConfig) -> Restored:
    """Read the log's tail within the bounds and replay it. Blocking: run it off the event loop."""
    started = time.monotonic()
    deadline = started + config.restore.max_seconds
    restored = Restored()
    events: list[tuple] = []  # newest first while reading
    for file in log_files(path):
        if restored.stopped_by != "start_of_log":
            break
        restored.files.append(str(file))
        for raw in _lines_backwards(file):
            if not raw.strip():
                continue
            if restored.lines >= config.restore.max_lines:
                restored.stopped_by = "max_lines"
                break
            if restored.lines % 1024 == 0 and time.monotonic() > deadline:
                restored.stopped_by = "max_seconds"
                break
            restored.lines += 1
            if not any(marker in raw for marker in WANTED):
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a line cut short by a crash: the report counts it, the monitor skips it
            if not isinstance(record, dict) or (event := _event(record)) is None:
                continue
            for one in reversed(event) if isinstance(event, list) else (event,):  # newest first while reading
                events.append((record.get("ts"), *one))
    _replay(reversed(events), config, restored)
    restored.seconds = time.monotonic() - started
    return restored


def _replay(events: Iterator[tuple], config: QualityConfig, restored: Restored) -> None:
    windows, sources = restored.windows, restored.sources
    for ts, what, key, *rest in events:
        if _number(ts):
            restored.oldest_ts = ts if restored.oldest_ts is None else restored.oldest_ts
            restored.newest_ts = ts
        if what == "cascade":
            restored.cascades.append((key, rest[0]))
            continue
        window = windows.get(key)
        if what == "probe":
            kind, original, probe = rest
            if window is not None and isinstance(kind, str):
                window.add_probe(kind, original, probe)
            continue
        if window is None:
            window = KeyWindow(config.window)
            sources[key] = {"episodes": 0, "from_ts": ts, "to_ts": ts}
        else:
            del windows[key]  # re-inserted last: the most recently seen key ends last
        windows[key] = window
        sources[key]["to_ts"] = ts
        if what == "mark":
            status, reason, episodes_seen, first, numbers = rest
            window.alarmed = status in (ALARM, RESET)  # reset: the process stopped with the alarm open
            window.reason = reason if window.alarmed else None
            if isinstance(episodes_seen, int) and episodes_seen >= window.episodes:
                window.episodes = episodes_seen
            if isinstance(first, dict):  # the live monitor's, where the replay may have seen only part of it
                window.first = first
            if not window.entries and isinstance(numbers, dict):
                window.numbers = numbers  # the tail holds none of its episodes: the numbers as last judged
            continue
        score, success, metadata = rest
        window.add(score, success, threshold_of(metadata, config.success_threshold))
        window.judge(config.alarm)
        sources[key]["episodes"] += 1
    _keep_within(windows, sources, config.max_keys)


def _keep_within(windows: dict[Key, KeyWindow], sources: dict[Key, dict[str, Any]], max_keys: int) -> None:
    """Beyond max_keys, the least recently seen keys not in alarm go first (as the live monitor evicts)."""
    for key in [k for k, w in windows.items() if not w.alarmed][:max(0, len(windows) - max_keys)]:
        del windows[key], sources[key]
    while len(windows) > max_keys:  # every key left is in alarm: the oldest go
        key = next(iter(windows))
        del windows[key], sources[key]
