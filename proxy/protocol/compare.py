"""The /compare surface: POST /compare and /compare/batch — two episodes of one task and
RL-VLM-F's preference label between them, with each query that gave it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from proxy.protocol.common import EpisodeMetadata, ErrorDetail, FramesInfo, FrameSource, PromptInfo, json_number


class CompareEpisode(FrameSource):
    """One episode of POST /compare: exactly one source of frames, as in /score."""

    fps: float | None = Field(None, ge=0.01, le=1000)  # source rate of inline frames
    metadata: EpisodeMetadata | None = None  # recorded in the audit line, never sent to the model

    @field_validator("fps", mode="before")
    @classmethod
    def _numbers_as_sent(cls, value: object) -> object:
        return json_number(value)


class CompareRequest(BaseModel):
    """POST /compare: two episodes of one task → RL-VLM-F's label (0: the first is better, 1: the
    second, -1: no preference). Frame settings apply to both episodes."""

    model_config = ConfigDict(extra="forbid")

    task_text: str = Field(min_length=1, max_length=4096)
    episodes: list[CompareEpisode] = Field(min_length=2, max_length=2)
    two_step: StrictBool = False  # step 1 compares in words, step 2 (text only) reads the label from it
    swap: StrictBool = False  # ask both orders; a disagreement is no preference (-1)
    prompt: str | None = None  # a comparison template, prompts/compare_*.yaml; None = compare_rlvlmf
    video_fps: float | None = Field(None, ge=0.01, le=1000)
    nframes: int | None = Field(None, ge=1)  # per episode
    max_pixels: int | None = Field(None, ge=28 * 28)
    backend: str | None = None
    backend_kwargs: dict[str, Any] = Field(default_factory=dict)  # sampling overrides, template variables

    @field_validator("video_fps", "nframes", "max_pixels", mode="before")
    @classmethod
    def _numbers_as_sent(cls, value: object) -> object:
        return json_number(value)


class CompareOrder(BaseModel):
    """One query: the episodes in the order shown, and what the model answered about that order."""

    order: list[int]  # indices into `episodes`, as shown: [0, 1], or [1, 0] for the swapped query
    raw_label: int  # as the model answered, about the order shown
    label: int  # the same preference in the request's order
    output_text: str  # the reply the label was read from
    description: str | None = None  # two_step: step 1's reply
    source: str  # where the label was: untagged or <tag>_tag
    attempts: int  # upstream calls of this query, retries and both steps included
    asks: int  # asks of the label (more when a reply held no label)
    endpoint: str
    usage: dict[str, Any] | None = None  # of the labelled reply


class CompareResponse(BaseModel):
    label: Literal[0, 1, -1]  # 0: episodes[0] is better, 1: episodes[1], -1: no preference
    agree: bool | None = None  # swap: both orders gave the same preference
    orders: list[CompareOrder]
    backend: str
    model: str
    two_step: bool
    swap: bool
    attempts: int  # upstream calls in all
    prompt: PromptInfo
    frames: list[FramesInfo]  # per episode, in the request's order
    sampling: dict[str, Any]
    timings_ms: dict[str, float]  # load, upstream, total


class BatchCompareRequest(BaseModel):
    """POST /compare/batch. Items are validated one by one, so one bad item fails alone."""

    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={
        "items": {"$ref": "#/components/schemas/CompareRequest"}})


class BatchCompareItem(BaseModel):
    index: int
    ok: bool
    status: int
    result: CompareResponse | None = None
    error: ErrorDetail | None = None


class BatchCompareResponse(BaseModel):
    results: list[BatchCompareItem]
    summary: dict[str, int]  # ok, failed
