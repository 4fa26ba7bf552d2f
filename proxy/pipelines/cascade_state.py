"""What a cascade remembers between episodes: the escalations of its recent single calls (the
budget over `window_s`), each stage's recent seconds (can the caller's budget cover it?), and the
one decision a /score/batch makes for its episodes in doubt. Pure bookkeeping on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from proxy.config import CascadeConfig

__all__ = ["BatchEscalation", "CascadeState", "audit_draw"]

RECENT_SECONDS = 32  # a stage's last calls whose median says how long the next one may take


def audit_draw(identity: str) -> float:
    """A number in [0, 1) fixed by the episode's identity: the audit's choice, the same on a replay."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "big") / 2**64


@dataclass
class CascadeState:
    name: str
    config: CascadeConfig
    window: deque[tuple[float, bool]] = field(default_factory=deque)  # (monotonic, went on) of single calls
    seconds: dict[str, deque[float]] = field(default_factory=dict)  # by stage backend

    def allow_single(self) -> bool:
        """A single call in doubt may go on while the window's share that went on is under the cap.
        An allowed one takes its place at once, so calls in doubt at the same moment cannot all
        pass the same check."""
        now = time.monotonic()
        while self.window and self.window[0][0] < now - self.config.window_s:
            self.window.popleft()
        went_on = sum(on for _, on in self.window)
        allowed = went_on < self.config.max_escalated_fraction * (len(self.window) + 1)
        if allowed:
            self.window.append((now, True))
        return allowed

    def note_single(self) -> None:
        """A single call that went on for no doubt of its own (it was sure, or audited: audits are
        outside the cap)."""
        self.window.append((time.monotonic(), False))

    def took(self, stage: str, seconds: float) -> None:
        recent = self.seconds.setdefault(stage, deque(maxlen=RECENT_SECONDS))
        recent.append(seconds)

    def expected_seconds(self, stage: str) -> float | None:
        recent = self.seconds.get(stage)
        return statistics.median(recent) if recent else None


class BatchEscalation:
    """One /score/batch's decision for one cascade stage: every episode of the batch at that stage
    says whether it is in doubt (and how far from the threshold), and once all have said, at most
    `max_escalated_fraction` of the batch goes on, the closest to the threshold first."""

    def __init__(self, size: int, fraction: float) -> None:
        self.size, self.fraction = size, fraction
        self.said: dict[int, float | None] = {}  # item -> distance to the threshold (None: not in doubt)
        self.decided = asyncio.Event()
        self.allowed: set[int] = set()

    async def ask(self, item: int, distance: float | None) -> bool:
        self.said[item] = distance
        self._decide_when_all_said()
        await self.decided.wait()
        return item in self.allowed

    def leave(self, item: int) -> None:
        """An episode that will not reach this stage's decision (it failed, or was sure earlier)."""
        if item not in self.said:
            self.said[item] = None
            self._decide_when_all_said()

    def _decide_when_all_said(self) -> None:
        if len(self.said) < self.size or self.decided.is_set():
            return
        doubt = sorted((d, i) for i, d in self.said.items() if d is not None)
        cap = int(self.fraction * self.size + 1e-9)
        self.allowed = {i for _, i in doubt[:cap]}
        self.decided.set()
