"""The `cascades:` section: backends asked in turn, a cheap one on every episode and a dearer one
only where the cheap one is in doubt, on a hashed random audit, or where two cheap stages disagree.

A cascade is named like a backend and called by that name on /score and /score/batch. Its stages
are chat backends of the same config; every stage but the last says when the episode goes on.
The stages must make their frames the same way (the episode is decoded once for all of them), so
their frame settings must be equal; a stage whose layout shows stills gets them, the others not.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from proxy.config.strict import StrictModel as _Strict

__all__ = ["CascadeConfig", "CascadeStage"]


class CascadeStage(_Strict):
    backend: str  # a chat backend's name or alias
    # The doubt band on this stage's score: a score within [lo, hi] goes on to the next stage.
    band: tuple[float, float] | None = None
    # Of the episodes this stage was sure about, the share that goes on anyway, chosen by a hash of
    # the episode (its episode_id, else its frames and task), so the audit is unbiased and a replay
    # makes the same choice. It measures this stage's errors where it is confident.
    audit_fraction: float = Field(0.05, ge=0.0, le=1.0)
    # Go on when this stage and the one before it fall on opposite sides of the threshold.
    disagree: bool = False

    @model_validator(mode="after")
    def _band_is_an_interval(self) -> CascadeStage:
        if self.band is not None and not 0.0 <= self.band[0] <= self.band[1] <= 1.0:
            raise ValueError(f"band {list(self.band)} must be [lo, hi] with 0 <= lo <= hi <= 1")
        return self


class CascadeConfig(_Strict):
    aliases: list[str] = Field(default_factory=list)
    stages: list[CascadeStage] = Field(min_length=2)
    # Where a score says success: audits count a disagreement across it, and when the budget allows
    # fewer than are in doubt, the scores closest to it go on first.
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    # At most this share of a /score/batch's episodes (or of single calls over `window_s`) goes on
    # for doubt or disagreement; audits are outside it, so the cheap stage's error stays measured.
    max_escalated_fraction: float = Field(1.0, ge=0.0, le=1.0)
    window_s: float = Field(60.0, gt=0)
    # When the caller's budget cannot cover the next stage (its recent seconds, or a timeout): answer
    # the last stage's score, marked `stopped: deadline`, or fail with the timeout.
    on_deadline: Literal["error", "last_stage"] = "error"

    @model_validator(mode="after")
    def _every_stage_but_the_last_can_go_on(self) -> CascadeConfig:
        for index, stage in enumerate(self.stages[:-1]):
            if stage.band is None and stage.audit_fraction == 0 and not stage.disagree:
                raise ValueError(f"stages[{index}] ({stage.backend}) never goes on: give it a band, an "
                                 "audit_fraction or disagree")
        last = self.stages[-1]
        if last.band is not None or last.disagree:
            raise ValueError(f"the last stage ({last.backend}) has no next stage: it takes no band or disagree")
        if self.stages[0].disagree:
            raise ValueError("stages[0] has no earlier stage to disagree with")
        return self
