"""The /score surface: POST /score and /score/batch — one episode's frames and what to score them
for, and the score with everything that went into it.

A batch's items are plain objects in the model (each is validated on its own, so a bad item is
that item's 422) and ScoreRequest in the document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.protocol.common import (
    EpisodeMetadata,
    ErrorDetail,
    FramesInfo,
    FrameSource,
    ImageBase64,
    PromptInfo,
    json_number,
    not_null,
    one_source,
)

# Caller-made stills come with `frames` only, and not with a second camera (the proxy makes them
# from both views then). Beside the sources' oneOf, not inside it: a branch that failed for its
# stills would let two sources pass as one.
_STILLS_RULE = {"anyOf": [{"not": not_null("stills")}, {**not_null("frames"), "not": not_null("extra_view")}]}


class ViewSource(FrameSource):
    """A second camera of the same episode (ScoreRequest.extra_view): one source, as the main view's
    fields take it, with as many frames as the main view (they are taken at the same indices)."""


class ScoreRequest(FrameSource):
    """POST /score: the episode's frames (exactly one source) and what to score them for. Field
    names follow the seed server so its clients keep working."""

    model_config = ConfigDict(json_schema_extra={**one_source(), "allOf": [_STILLS_RULE]})

    task_text: str = Field(min_length=1, max_length=4096)
    # With `frames`, for a layout that sends the first and last frame as still images (PRIMO-R1's):
    # those two stills as the caller encoded them (GET /frame-rules gives their size), instead of
    # the proxy making them from the first and last frame.
    stills: list[ImageBase64] | None = Field(None, min_length=2, max_length=2)
    # The rules id (GET /frame-rules) the caller encoded its frames for: a 409 frame_rules_changed
    # if the backend's rules are not those now, rather than forwarding frames made for other sizes.
    frame_rules: str | None = Field(None, pattern=r"^[0-9a-f]{16}$")
    fps: float | None = Field(None, ge=0.01, le=1000)  # source rate of inline frames
    # The rate the clip is presented at (the seed's reward_model.video_fps); used when the
    # backend's frames.presentation_fps is "seed".
    video_fps: float | None = Field(None, ge=0.01, le=1000)
    nframes: int | None = Field(None, ge=1)  # frames to sample; caps checked against config
    # Score the episode as if it ended at this source frame (0-based, inclusive): frames after it
    # are dropped before sampling, and PRIMO-R1's "current frame" is this one.
    prefix_end: int | None = Field(None, ge=0)
    max_pixels: int | None = Field(None, ge=28 * 28)  # per-frame pixel budget after resize
    # A second camera (the wrist view), for a backend whose frames.extra_view places one.
    extra_view: ViewSource | None = None
    backend: str | None = None  # backend name or alias; None = the only/first backend
    # Per-request sampling overrides (within bounds), score_mode, and template variables.
    backend_kwargs: dict[str, Any] = Field(default_factory=dict)
    metadata: EpisodeMetadata | None = None  # recorded with the result, never sent to the model

    @field_validator("fps", "video_fps", "nframes", "prefix_end", "max_pixels", mode="before")
    @classmethod
    def _numbers_as_sent(cls, value: object) -> object:
        return json_number(value)

    @model_validator(mode="after")
    def _stills_with_frames(self) -> ScoreRequest:
        if getattr(self, "stills", None) is not None and self.frames is None:
            raise ValueError("stills come with frames (images the caller encoded), not with " + self.source_name())
        if getattr(self, "stills", None) is not None and getattr(self, "extra_view", None) is not None:
            raise ValueError("stills are one camera's: with extra_view the proxy makes them from both views")
        return self


class ParseInfo(BaseModel):
    mode: str  # the score_mode used
    scale: str  # the scale the answer was read on, e.g. "0-100"
    source: str  # where the answer was: answer_tag, score_tag, ... or untagged
    finish_reason: str | None = None


class QualityKey(BaseModel):
    run: str | None
    backend: str
    task_id: str


class QualityStatus(BaseModel):
    status: Literal["ok", "alarm", "unknown"]
    reason: str | None = None  # why the key is in alarm
    key: QualityKey


class CascadeStageInfo(BaseModel):
    """One stage of a cascade that ran: its score, its cost, and why the episode went on past it."""

    backend: str
    score: float
    raw_score: float
    usage: dict[str, Any] | None = None
    attempts: int
    seconds: float
    went_on: Literal["band", "disagree", "audit"] | None = None  # None: the episode stopped here


class CascadeInfo(BaseModel):
    name: str
    stages: list[CascadeStageInfo]  # every stage that ran, in order; the last one's score is the answer
    final_stage: str
    # why no later stage ran: sure (outside the band, not drawn for the audit), budget (the batch's or
    # the window's share was used), deadline (the caller's budget could not cover the next stage);
    # None when the last stage ran
    stopped: Literal["sure", "budget", "deadline"] | None = None
    threshold: float


class ScoreResponse(BaseModel):
    score: float  # normalised to [0, 1]
    raw_score: float  # the number as the model wrote it
    backend: str
    model: str
    output_text: str
    parse: ParseInfo
    attempts: int  # upstream calls made, retries included
    asks: int  # 1, or more when an unparseable reply was asked again
    prompt: PromptInfo
    frames: FramesInfo
    sampling: dict[str, Any]  # what the scored reply was sampled with (a re-ask differs)
    usage: dict[str, Any] | None = None  # vLLM's token usage of the scored reply
    endpoint: str
    timings_ms: dict[str, float]  # load, encode, upstream, total
    constrained: bool = False  # vLLM held the reply to the declared answer (structured_outputs regex)
    # samples: k — every sample (parsed or not) and the spread of the parsed ones (proxy/answers/estimate.py)
    samples: list[dict[str, Any]] | None = None
    spread: dict[str, float] | None = None
    logprob: dict[str, Any] | None = None  # logprob_score: the answer token's distribution on the scale
    # a probability answer (P(done)): p_affirmative (= score), p_negative, mass_other, normalised, token_ids,
    # first_token
    probability: dict[str, Any] | None = None
    # a per-frame answer (GVL): each shown frame's value in time order, [{frame_index, score, raw_score,
    # shown_as}], and the shuffle {seed, order}: order[n] = the frame shown as number n + 1 (after the reference)
    per_frame: list[dict[str, Any]] | None = None
    shuffle: dict[str, Any] | None = None
    # The live reward-quality monitor on this episode's (run, backend, task), once an episode of it carried
    # env_success: {"status": ok | alarm | unknown, "reason", "key": {run, backend, task_id}} (docs/reward-quality.md)
    quality: QualityStatus | None = None
    # a cascade's answer: every stage that ran (the top-level usage and attempts are their sums)
    cascade: CascadeInfo | None = None


class BatchScoreRequest(BaseModel):
    """POST /score/batch. Items are validated one by one, so one bad item fails alone."""

    model_config = ConfigDict(extra="forbid")

    # dicts, not ScoreRequest: an invalid item is that item's 422, not the batch's
    items: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={
        "items": {"$ref": "#/components/schemas/ScoreRequest"}})


class BatchItem(BaseModel):
    index: int
    ok: bool
    status: int
    result: ScoreResponse | None = None
    error: ErrorDetail | None = None


class BatchScoreResponse(BaseModel):
    results: list[BatchItem]
    summary: dict[str, int]  # ok, failed
