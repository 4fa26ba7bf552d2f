"""The `quality:` section: the live reward-quality monitor (proxy/quality/): how many episodes a
window holds, when a (run, backend, task) is in alarm and when it clears. Bounded in keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.strict import StrictModel as _Strict
from vlm_protocol.agreement import PROBE_KINDS

__all__ = ["PROBE_KINDS", "ProbesConfig", "QualityAlarmConfig", "QualityConfig", "QualityRestoreConfig"]


class QualityAlarmConfig(_Strict):
    """A key is in alarm when its window holds `min_episodes` episodes with known success and the
    reward disagrees with success beyond a bound; it clears only once both numbers are back inside
    by `clear_margin` (hysteresis: a window hovering at the bound does not flap)."""

    min_episodes: int = Field(32, ge=2, le=4096)
    # A number resting on a handful of one outcome is no verdict (early LIBERO runs see ~5%
    # successes): the false-success rate needs this many failures, the ROC-AUC this many of each.
    min_per_outcome: int = Field(8, ge=1, le=4096)
    max_false_success_rate: float = Field(0.3, ge=0.0, le=1.0)  # failures the reward calls a success
    min_auc: float = Field(0.6, ge=0.0, le=1.0)  # P(a success scores above a failure)
    clear_margin: float = Field(0.05, ge=0.0, le=0.5)


class ProbesConfig(_Strict):
    """Invariance probes (off by default): for a sampled `fraction` of scored episodes with known
    success, the same episode is scored again in the background — frames reversed, frames shuffled
    (seeded), or another task's instruction of the same run — and the margin (original - probe) is
    kept per key. A probe never holds up an answer in the proxy: it starts after it, only while no
    request waits for the backend and more than `reserve_slots` of its slots are free, at most
    `max_in_flight` at once; otherwise it is dropped and counted. On the server it is one more
    sequence (on the 2-core CPU vLLM, answers took 1.37x as long with every episode probed)."""

    fraction: float = Field(0.0, ge=0.0, le=1.0)
    kinds: list[Literal["reversed", "shuffled", "instruction"]] = Field(
        default_factory=lambda: list(PROBE_KINDS), min_length=1)
    seed: int = 0
    max_in_flight: int = Field(4, ge=1, le=1024)
    reserve_slots: int = Field(8, ge=0)  # free endpoint slots kept for real work

    @model_validator(mode="after")
    def _kinds_once(self) -> ProbesConfig:
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds lists a kind twice: {self.kinds}")
        return self


class QualityRestoreConfig(_Strict):
    """At start-up, with an audit log, each key's window, first window, alarm and probe numbers are
    rebuilt from the log's newest lines (rotated files included). Both bounds are hang bounds: the
    rebuild stops at whichever comes first and keeps what it read (the newest lines), and says so on
    GET /quality. bench/bench_restore.py measures it (docs/benchmarks.md)."""

    enabled: bool = True
    # Lines read back from the end of the log. 256 keys x a window of 128 is 32,768 episodes; the
    # default leaves room for the dense points, probes and other lines between them.
    max_lines: int = Field(200_000, ge=0, le=10_000_000)
    max_seconds: float = Field(60.0, gt=0.0, le=3600.0)


class QualityConfig(_Strict):
    enabled: bool = True
    # The last N episodes per key with known success. Capped: each episode recomputes its key's
    # numbers on the event loop (bench/bench_quality.py: ~0.2 ms at 128, ~1 ms at 512).
    window: int = Field(128, ge=2, le=4096)
    # Where a score says success when the episode's metadata carries no success_threshold (the RLinf
    # client sends its own; `report`'s default is the same 0.5).
    success_threshold: float = Field(0.5, ge=0.0, le=1.0)
    # (run, backend, task) keys tracked; an episode of a key beyond is counted as dropped, never tracked
    # (label sets on /metrics stay bounded).
    max_keys: int = Field(256, ge=1, le=100_000)
    alarm: QualityAlarmConfig = Field(default_factory=QualityAlarmConfig)
    probes: ProbesConfig = Field(default_factory=ProbesConfig)
    restore: QualityRestoreConfig = Field(default_factory=QualityRestoreConfig)

    @model_validator(mode="after")
    def _window_holds_the_minimum(self) -> QualityConfig:
        if self.alarm.min_episodes > self.window:
            raise ValueError(f"alarm.min_episodes ({self.alarm.min_episodes}) is more than the window ({self.window}): "
                             "no key could ever be judged")
        if (self.alarm.max_false_success_rate < self.alarm.clear_margin
                or self.alarm.min_auc + self.alarm.clear_margin > 1.0):
            raise ValueError("alarm.clear_margin leaves no room to clear: max_false_success_rate - clear_margin "
                             "must be >= 0 and min_auc + clear_margin <= 1")
        return self
