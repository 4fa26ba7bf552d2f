"""The live monitor: one rolling window per (run, backend, task) of the episodes that carry
`metadata.env_success`, its numbers on /metrics and GET /quality, the alarm's transitions as a
WARNING, a counter and an audit line (kind `quality_alarm`). Runs on the event loop, after each
scored episode: a window of 128 costs well under a millisecond (bench/bench_quality.py).

A restart does not judge afresh: the windows rebuilt from the audit log's tail
(proxy/quality/restore.py) are adopted before the first request, an alarm open at the stop is open
again (one `quality_alarm` line says it was restored), and GET /quality says what was restored and
from where. Every line the monitor writes carries what that rebuild needs (the first window, the
episodes seen, an open alarm's reason at a stop)."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

from proxy.audit import AuditLog
from proxy.config import QualityConfig
from proxy.metrics import Metrics
from proxy.quality.cascade_window import CascadeWatch, stage_outcomes
from proxy.quality.window import KeyWindow
from vlm_protocol.agreement import ALARM, OK, RESET, UNKNOWN

__all__ = ["Key", "QualityMonitor", "quality_key", "threshold_of"]

log = logging.getLogger(__name__)
MAX_TASK_LABEL = 128  # a task text as a label: its start (task ids are short)

Key = tuple[str | None, str, str]


def stage_label(cascade: str, backend: str) -> str:
    """A cascade stage's backend on the monitor and /metrics: never the backend's own, used directly."""
    return f"{cascade}/{backend}"


def quality_key(backend: str, task_text: str, metadata: dict[str, Any] | None) -> Key:
    """(metadata.run, backend, metadata.task_id, else the task text)."""
    metadata = metadata or {}
    task = metadata.get("task_id")
    return (None if metadata.get("run") is None else str(metadata["run"]), backend,
            str(task) if task is not None else task_text[:MAX_TASK_LABEL])


def threshold_of(metadata: dict[str, Any] | None, default: float) -> float:
    """Where a score says success for this episode: the client's own success_threshold when it sends
    one (the RLinf client does), else quality.success_threshold."""
    value = (metadata or {}).get("success_threshold")
    if isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
        return float(value)
    return default


def _gauge(value: float | None) -> float:
    return math.nan if value is None else float(value)


class QualityMonitor:
    def __init__(self, config: QualityConfig, metrics: Metrics, audit: AuditLog) -> None:
        self.config, self.metrics, self.audit = config, metrics, audit
        self.windows: dict[Key, KeyWindow] = {}
        self.dropped = 0
        self.cascades = CascadeWatch(config.window, config.max_keys, metrics)  # escalation and audit rates
        # what GET /quality says of the restart's rebuild, until `adopt` says more
        self.restore: dict[str, Any] = (
            {"restored": False, "reason": "no audit log is configured (proxy.audit_log): nothing can be restored"}
            if audit.path is None else {"restored": False, "reason": "not rebuilt (quality.restore.enabled: false, "
                                                                     "or the monitor is off)"})
        self.restored_from: dict[Key, dict[str, Any]] = {}  # per key restored: episodes and time span read

    def adopt(self, windows: dict[Key, KeyWindow], sources: dict[Key, dict[str, Any]],
              described: dict[str, Any], cascades: list[tuple[Key, list[Any]]] = ()) -> None:
        """Before the first request: the windows rebuilt from the audit log become the live ones,
        their gauges set; an open alarm gets one line saying it was restored (no transition counted)."""
        self.windows = dict(windows)
        self.restored_from = dict(sources)
        self.restore = {"restored": True, **described}
        for key, outcomes in cascades:  # oldest first, as they were seen
            self.cascades.observe(key, outcomes)
        for key, window in self.windows.items():
            self._export(key, window, window.numbers)
            for kind, numbers in window.probe_numbers().items():
                labels = (key[0] or "", key[1], key[2], kind)
                self.metrics.quality_probe_margin.labels(*labels).set(numbers["mean_margin"])
                self.metrics.quality_probe_inversions.labels(*labels).set(numbers["inversion_rate"])
            if window.alarmed:
                run, backend, task = key
                log.warning("reward quality ALARM for run %r, backend %r, task %r restored from the audit log: %s",
                            run, backend, task, window.reason)
                self._line(key, window, ALARM, window.reason, restored=True)

    def observe(self, backend: str, task_text: str, metadata: dict[str, Any] | None,
                score: float | None) -> dict[str, Any] | None:
        """One episode's outcome (score None: its reply did not parse). Returns what its answer says
        about its key ({"status", "reason", "key"}), or None when the monitor is off or the key untracked."""
        if not self.config.enabled or (metadata or {}).get("replay_of_line") is not None:
            return None  # a replay re-scores an old log: never evidence about the live run
        key = quality_key(backend, task_text, metadata)
        window = self.windows.pop(key, None)
        if window is not None:
            self.windows[key] = window  # the most recently seen last: eviction takes the idlest first
        success = (metadata or {}).get("env_success")
        if success is not None:
            if window is None:
                if len(self.windows) >= self.config.max_keys and not self._evict_idlest():
                    self.dropped += 1
                    self.metrics.quality_keys_dropped.inc()
                    return None
                window = self.windows[key] = KeyWindow(self.config.window)
            numbers = window.add(score, bool(success), threshold_of(metadata, self.config.success_threshold))
            if window.judge(self.config.alarm):
                self._transition(key, window, numbers)
            self._export(key, window, numbers)
        if window is None:  # no truth for this key yet: nothing to say
            return None
        return self._answer(key, window)

    def observe_cascade(self, cascade: str, task_text: str, metadata: dict[str, Any] | None, stages: list[Any],
                        threshold: float, stopped: str | None) -> None:
        """One cascade episode's stages (proxy/quality/cascade_window.py): escalation and audit rates."""
        if self.config.enabled and (metadata or {}).get("replay_of_line") is None:
            self.cascades.observe(quality_key(cascade, task_text, metadata), stage_outcomes(stages, threshold, stopped))

    def _evict_idlest(self) -> bool:
        """Make room for a new key: forget the least recently seen key not in alarm (an alarm is never
        forgotten silently), its series with it. False when every key is in alarm."""
        for key, window in self.windows.items():
            if not window.alarmed:
                del self.windows[key]
                self._forget_series(key, window)
                self.metrics.quality_keys_evicted.inc()
                return True
        return False

    def _forget_series(self, key: Key, window: KeyWindow) -> None:
        labels = (key[0] or "", key[1], key[2])
        m = self.metrics
        for gauge in (m.quality_episodes, m.quality_auc, m.quality_accuracy, m.quality_false_success_rate,
                      m.quality_parse_failures, m.quality_alarm):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        for outcome in ("success", "failure"):
            with contextlib.suppress(KeyError):
                m.quality_mean_score.remove(*labels, outcome)
        for kind in window.probes:
            for gauge in (m.quality_probe_margin, m.quality_probe_inversions):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels, kind)

    def observe_probe(self, key: Key, kind: str, original: float, probe: float) -> dict[str, Any] | None:
        """One invariance probe of a tracked key (proxy/quality/probes.py); its kind's numbers."""
        window = self.windows.get(key)
        if window is None:
            return None
        numbers = window.add_probe(kind, original, probe)
        labels = (key[0] or "", key[1], key[2], kind)
        self.metrics.quality_probe_margin.labels(*labels).set(numbers["mean_margin"])
        self.metrics.quality_probe_inversions.labels(*labels).set(numbers["inversion_rate"])
        return numbers

    def _answer(self, key: Key, window: KeyWindow) -> dict[str, Any]:
        run, backend, task = key
        return {"status": window.status(self.config.alarm.min_episodes), "reason": window.reason,
                "key": {"run": run, "backend": backend, "task_id": task}}

    def _export(self, key: Key, window: KeyWindow, numbers: dict[str, Any]) -> None:
        labels = (key[0] or "", key[1], key[2])
        m = self.metrics
        m.quality_episodes.labels(*labels).set(numbers.get("episodes", 0))
        m.quality_auc.labels(*labels).set(_gauge(numbers.get("auc")))
        m.quality_accuracy.labels(*labels).set(_gauge(numbers.get("accuracy")))
        m.quality_false_success_rate.labels(*labels).set(_gauge(numbers.get("false_success_rate")))
        m.quality_mean_score.labels(*labels, "success").set(_gauge(numbers.get("mean_score_success")))
        m.quality_mean_score.labels(*labels, "failure").set(_gauge(numbers.get("mean_score_failure")))
        m.quality_parse_failures.labels(*labels).set(numbers.get("parse_failures", 0))
        m.quality_alarm.labels(*labels).set(int(window.alarmed))

    def _transition(self, key: Key, window: KeyWindow, numbers: dict[str, Any]) -> None:
        run, backend, task = key
        to = ALARM if window.alarmed else OK
        self.metrics.quality_transitions.labels(backend, to).inc()
        if window.alarmed:
            log.warning("reward quality ALARM for run %r, backend %r, task %r: %s; the reward may be hacked "
                        "(docs/reward-quality.md)", run, backend, task, window.reason)
        else:
            log.warning("reward quality alarm cleared for run %r, backend %r, task %r (false-success rate %s, "
                        "ROC-AUC %s over %d scored episodes)", run, backend, task, _fmt(numbers["false_success_rate"]),
                        _fmt(numbers["auc"]), numbers["n"])
        self._line(key, window, to, window.reason)

    def _line(self, key: Key, window: KeyWindow, status: str, reason: str | None, *, kind: str = "quality_alarm",
              **extra: Any) -> None:
        """One audit line of the monitor's, with what a restart's rebuild reads back (restore.py)."""
        run, backend, task = key
        self.audit.write({"kind": kind, "run": run, "backend": backend, "task_id": task, "status": status,
                          "reason": reason, "numbers": window.numbers, "episodes_seen": window.episodes,
                          "first_window": window.first, **extra})

    def close(self) -> None:
        """At shutdown: each key in alarm gets an audit line of status `reset`, meaning the process
        stopped with the alarm open (`report` ends its period there). It is not a clear: a restart
        on the same log opens the alarm again from these lines until the numbers clear it. Every
        other key gets a `quality_window` line (its status, count and first window), so a restart
        whose tail starts after a key's first episodes still has them; `report` counts it apart."""
        for key, window in self.windows.items():
            if window.alarmed:
                self._line(key, window, RESET, "the proxy stopped with the alarm open; a restart on this audit log "
                                               "restores it", alarm_reason=window.reason)
            else:
                self._line(key, window, window.status(self.config.alarm.min_episodes), None, kind="quality_window")

    def health(self) -> dict[str, Any]:
        """/health's reward_quality: alarm if any key is, ok if any key was judged, else unknown."""
        alarms = [{**self._answer(key, w)["key"], "reason": w.reason, "numbers": w.numbers}
                  for key, w in self.windows.items() if w.alarmed]
        statuses = {w.status(self.config.alarm.min_episodes) for w in self.windows.values()}
        status = ALARM if alarms else (OK if OK in statuses else UNKNOWN)
        return {"status": status, "alarms": alarms}

    def snapshot(self) -> dict[str, Any]:
        """GET /quality: every key's window numbers, its first full window (drift), its status."""
        keys = [{**self._answer(key, w), "episodes_seen": w.episodes, "window": w.numbers, "first_window": w.first,
                 "probes": w.probe_numbers(), "restored_from": self.restored_from.get(key)}
                for key, w in self.windows.items()]
        return {"config": self.config.model_dump(), "keys": keys, "keys_dropped_episodes": self.dropped,
                "restore": self.restore, "cascades": self.cascades.snapshot(), **self.health()}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
