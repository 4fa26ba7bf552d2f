"""The /score/dense surface: POST /score/dense — one episode scored at several prefixes (each as
/score scores an episode that ended there) → a progress curve. A dense request is a /score
request that picks its prefixes (points or prefix_ends) instead of one prefix_end.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from proxy.protocol.common import ImageBase64, json_number, one_source
from proxy.protocol.score import QualityStatus, ScoreRequest, ScoreResponse


class DenseRequest(ScoreRequest):
    """POST /score/dense: one episode scored at several prefixes (each as /score would score an episode
    that ended there) → a progress curve. Costs one scoring call per point, run concurrently."""

    # One source, and points or prefix_ends (not both): the document's rule, as the validators'.
    model_config = ConfigDict(json_schema_extra={**one_source(), "not": {
        "required": ["points", "prefix_ends"],
        "properties": {"points": {"type": "integer"}, "prefix_ends": {"type": "array"}}}})

    points: int | None = Field(None, ge=2)  # prefixes ending evenly over the episode, the last at its end
    # or exactly these source frame indices, increasing
    prefix_ends: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=2)
    # One decode serves every prefix of a curve, one camera's: a second view is not served here (yet);
    # the document says so, and a request with one is refused (score prefixes with /score and prefix_end).
    extra_view: None = Field(None, description="not served on /score/dense: one camera per curve")
    # Chosen per point; the document says null only, the validator says why in words.
    prefix_end: Annotated[int | None, WithJsonSchema({
        "type": "null", "default": None, "description": "chosen per point: points or prefix_ends"})] = None
    stills: Annotated[list[ImageBase64] | None, WithJsonSchema({
        "type": "null", "default": None,
        "description": "not taken here: each point's stills are its own prefix's first and last frame"})] = None

    @field_validator("points", mode="before")
    @classmethod
    def _points_as_sent(cls, value: object) -> object:
        return json_number(value)

    @model_validator(mode="after")
    def _one_way_to_pick_points(self) -> DenseRequest:
        if self.prefix_end is not None:
            raise ValueError("prefix_end is chosen per point here: give points or prefix_ends")
        if self.points is not None and self.prefix_ends is not None:
            raise ValueError("give points or prefix_ends, not both")
        if self.stills is not None:
            raise ValueError("each point's stills are its own prefix's first and last frame: send no stills")
        return self

    @field_validator("prefix_ends")
    @classmethod
    def _increasing(cls, ends: list[int] | None) -> list[int] | None:
        if ends is not None and ends != sorted(set(ends)):
            raise ValueError("prefix_ends must be distinct source frame indices, in increasing order")
        return ends


class CurvePoint(BaseModel):
    frame_index: int  # the prefix's last source frame (PRIMO-R1's "current frame")
    score: float  # normalised to [0, 1], as /score
    raw_score: float


class DenseResponse(BaseModel):
    # prefixes: one /score per prefix; shuffled: the frames as numbered shuffled images in ONE call (GVL)
    method: Literal["prefixes", "shuffled"]
    curve: list[CurvePoint]  # in frame order; the last point is the whole episode (points) or prefix_ends[-1]
    points: list[ScoreResponse]  # each prefix's whole /score result (frames, prompt, sampling, usage)
    backend: str
    model: str
    source_count: int  # frames in the episode
    attempts: int  # upstream calls in all (one per point, plus retries)
    usage: dict[str, int]  # token usage summed over the points' scored replies
    timings_ms: dict[str, float]  # load (one decode for every point), total
    # the live monitor on the episode (its last point is the whole episode), as /score's `quality`
    quality: QualityStatus | None = None
