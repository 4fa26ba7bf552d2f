"""Score scales: which raw answers are valid and how they become a score in [0, 1]. One place.

A numeric scale is `{min, max, zero}`: a raw number within [min, max] is valid and scores
(raw - zero) / (max - zero); `zero` defaults to 0, so 0–100 and the seed's 1–100 both divide by
100, and a 1–5 scale that should start at 0 sets `zero: 1`. The binary scale takes a verdict
(yes/no, success/failure, true/false) or 0/1.

`score_mode` (the seed's request field) picks a scale with one meaning each:
    auto        the scale the prompt template declares
    percentage  0–100, divided by 100
    unit        0–1, as is
    binary      a verdict or 0/1
No mode reads "1" and "2" on different scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BINARY", "PERCENTAGE", "SCORE_MODES", "UNIT", "Scale", "scale_for_mode"]

_POSITIVE = {"yes", "success", "successful", "succeeded", "true"}
_NEGATIVE = {"no", "fail", "failed", "failure", "unsuccessful", "false"}


@dataclass(frozen=True)
class Scale:
    min: float
    max: float
    zero: float = 0.0
    binary: bool = False

    def __post_init__(self) -> None:
        if not self.binary and not (math.isfinite(self.min) and math.isfinite(self.max)
                                    and self.zero <= self.min < self.max):
            raise ValueError(f"a scale needs zero <= min < max, got zero={self.zero:g}, "
                             f"min={self.min:g}, max={self.max:g}")

    @property
    def name(self) -> str:
        if self.binary:
            return "binary"
        zero = f", zero {self.zero:g}" if self.zero else ""
        return f"{self.min:g}-{self.max:g}{zero}"

    def normalise(self, raw: float) -> float | None:
        """The score of a raw number, or None when it is not on this scale."""
        if not math.isfinite(raw) or not self.min <= raw <= self.max:
            return None
        if self.binary:
            return raw if raw in (0.0, 1.0) else None
        return (raw - self.zero) / (self.max - self.zero)

    def verdict(self, word: str) -> float | None:
        """A yes/no word's score on the binary scale; None on numeric scales or other words."""
        if not self.binary:
            return None
        word = word.lower()
        return 1.0 if word in _POSITIVE else 0.0 if word in _NEGATIVE else None


PERCENTAGE = Scale(0.0, 100.0)
UNIT = Scale(0.0, 1.0)
BINARY = Scale(0.0, 1.0, binary=True)
SCORE_MODES = ("auto", "percentage", "unit", "binary")


def scale_for_mode(mode: str, declared: Scale) -> Scale:
    if mode == "auto":
        return declared
    try:
        return {"percentage": PERCENTAGE, "unit": UNIT, "binary": BINARY}[mode]
    except KeyError:
        raise ValueError(f"unknown score_mode {mode!r}; one of {', '.join(SCORE_MODES)}") from None
