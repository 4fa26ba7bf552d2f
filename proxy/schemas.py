"""Request and response bodies of the proxy's own API (pydantic, validated at the edge)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.errors import InvalidRequest

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_STRING = 32, 64, 256
Scalar = str | int | float | bool | None
ShortString = Annotated[str, Field(max_length=MAX_METADATA_STRING)]


def json_number(value: object) -> object:
    """What the document calls a number or an integer: lax mode would read true as 1 and "4" as 4
    (the document refuses both); 17.0 stays an integer, as in JSON Schema."""
    if isinstance(value, bool | str):
        raise ValueError("must be a JSON number")
    return value



class EpisodeMetadata(BaseModel):
    """What the caller knows about the episode: recorded in the audit log, never sent to the model.
    `env_success` is the simulator's ground truth (the reward-quality report compares with it).
    Other keys are allowed, flat and small (at most 32 more, names <= 64 chars, values scalars,
    strings <= 256 chars): a few KB at most per audit line."""

    model_config = ConfigDict(extra="allow", json_schema_extra={
        "maxProperties": 6 + MAX_METADATA_KEYS, "propertyNames": {"maxLength": MAX_METADATA_KEY},
        "additionalProperties": {"anyOf": [{"type": "string", "maxLength": MAX_METADATA_STRING},
                                           {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}})

    env_success: bool | None = None
    task_id: int | ShortString | None = None
    episode_id: int | ShortString | None = None
    step: int | None = None
    run: ShortString | None = None
    # Episodes that share their start (a GRPO group: one initial state): routed to one replica so
    # its prefix cache is shared (routing.policy affinity). Default: the first frame's hash, where
    # the layout starts with the first frame.
    group_id: int | ShortString | None = None

    @field_validator("task_id", "episode_id", "group_id", "step", "env_success", mode="before")
    @classmethod
    def _as_sent(cls, value: Any, info: ValidationInfo) -> Any:
        """Limits hold for the value as sent, not for lax mode's reading of it: a 300-digit string
        is no int past the documented maxLength, `false` no id 0, and 0 or "no" no env_success."""
        if isinstance(value, str) and len(value) > MAX_METADATA_STRING:
            raise ValueError(f"must be at most {MAX_METADATA_STRING} characters")
        flag = info.field_name == "env_success"
        if value is not None and flag != isinstance(value, bool):
            raise ValueError("must be true, false or null" if flag else "must not be a boolean")
        return value

    @model_validator(mode="after")
    def _small_and_flat(self) -> EpisodeMetadata:
        extra = self.model_extra or {}
        if (len(extra) > MAX_METADATA_KEYS or any(len(k) > MAX_METADATA_KEY for k in extra)
                or any(not isinstance(v, Scalar) or (isinstance(v, str) and len(v) > MAX_METADATA_STRING)
                       for v in extra.values())):
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} more keys (names of at most "
                             f"{MAX_METADATA_KEY} chars), each a number, bool, null or string of at most "
                             f"{MAX_METADATA_STRING} chars")
        return self


def _not_null(field: str) -> dict[str, Any]:
    return {"required": [field], "properties": {field: {"not": {"type": "null"}}}}


# Custom string formats, so a document reader (and schemathesis) knows what a valid value is.
IMAGE_FORMAT, NPY_FORMAT, MEDIA_PATH_FORMAT = "image-base64", "npy-base64", "media-path"


class FrameSource(BaseModel):
    """Exactly one source of an episode's frames: a video file under proxy.allowed_media_roots;
    base64 PNG/JPEG images of one size, in order (data: URLs accepted); or base64 of a .npy uint8
    TxHxWx3 array. The main view of /score and /compare, and the second camera (extra_view)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "oneOf": [_not_null("video_path"), _not_null("frames"), _not_null("frames_npy")]})

    video_path: Annotated[str, Field(json_schema_extra={"format": MEDIA_PATH_FORMAT})] | None = None
    frames: list[Annotated[str, Field(json_schema_extra={"format": IMAGE_FORMAT})]] | None = Field(None, min_length=1)
    frames_npy: Annotated[str, Field(json_schema_extra={"format": NPY_FORMAT})] | None = None

    def source_name(self) -> str:
        return next(n for n in ("video_path", "frames", "frames_npy") if getattr(self, n) is not None)

    @model_validator(mode="after")
    def _one_source(self) -> FrameSource:
        given = [n for n in ("video_path", "frames", "frames_npy") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of video_path, frames, frames_npy (got {', '.join(given)})" if given
                             else "no frame source: give exactly one of video_path, frames, frames_npy")
        return self


class ViewSource(FrameSource):
    """A second camera of the same episode (ScoreRequest.extra_view): one source, as the main view's
    fields take it, with as many frames as the main view (they are taken at the same indices)."""


class ScoreRequest(FrameSource):
    """POST /score: the episode's frames (exactly one source) and what to score them for. Field
    names follow the seed server so its clients keep working."""

    task_text: str = Field(min_length=1, max_length=4096)
    # With `frames`, for a layout that sends the first and last frame as still images (PRIMO-R1's):
    # those two stills as the caller encoded them (GET /frame-rules gives their size), instead of
    # the proxy making them from the first and last frame.
    stills: list[Annotated[str, Field(json_schema_extra={"format": IMAGE_FORMAT})]] | None = Field(
        None, min_length=2, max_length=2)
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


class PromptInfo(BaseModel):
    name: str
    sha256: str  # of the template file
    # backend_kwargs that replaced prompt text (system_prompt, user_prompt, prompt_template): sha256 each
    overrides: dict[str, str] = Field(default_factory=dict)


class ExtraViewInfo(BaseModel):
    """How the second camera went to the model (backend frames.extra_view), at the main view's indices."""

    placement: Literal["second_video", "side_by_side"]
    source_count: int  # frames in the second view's source
    size: tuple[int, int]  # (width, height) of the second view as sent: its video, or its part of each frame
    main_size: tuple[int, int] | None = None  # side_by_side: the main view's part of each frame (left)
    sha256: list[str] = Field(default_factory=list)  # second_video: each JPEG of its video (side_by_side: in `sha256`)
    vision_tokens: int = 0  # second_video: its video's share of FramesInfo.vision_tokens


class FramesInfo(BaseModel):
    count: int
    requested: int  # nframes asked for; above `count` when the backend's max_nframes clamped it
    indices: list[int]  # indices into the source episode
    source_count: int
    size: tuple[int, int]  # (width, height) of the video frames sent to the model
    still_size: tuple[int, int] | None = None  # (width, height) of still images (PRIMO's first/last)
    fps: float  # the rate vLLM was told (frames.presentation_fps)
    sampled_fps: float  # the real rate of the frames sent
    vision_tokens: int  # what the frames cost in the prompt (Qwen2.5-VL's rule)
    sha256: list[str]  # hash of each JPEG sent, for reproducibility
    still_sha256: list[str] = Field(default_factory=list)  # of each still image sent (PRIMO's first, last)
    # Images sent to the model as the caller encoded them (no decode, no re-encode), stills included.
    forwarded: int = 0
    extra_view: ExtraViewInfo | None = None  # a second camera, when the backend places one


class QualityKey(BaseModel):
    run: str | None
    backend: str
    task_id: str


class QualityStatus(BaseModel):
    status: Literal["ok", "alarm", "unknown"]
    reason: str | None = None  # why the key is in alarm
    key: QualityKey


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


class BatchScoreRequest(BaseModel):
    """POST /score/batch. Items are validated one by one, so one bad item fails alone."""

    model_config = ConfigDict(extra="forbid")

    # dicts, not ScoreRequest: an invalid item is that item's 422, not the batch's
    items: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={
        "items": {"$ref": "#/components/schemas/ScoreRequest"}})


class ErrorDetail(BaseModel):
    """Every error the proxy answers, on every route (vlm_protocol.errors lists the codes)."""

    model_config = ConfigDict(extra="allow")  # e.g. output_text, finish_reason, endpoint

    code: str
    message: str
    retryable: bool
    attempts: int | None = None
    field: str | None = None
    request_id: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class BatchItem(BaseModel):
    index: int
    ok: bool
    status: int
    result: ScoreResponse | None = None
    error: ErrorDetail | None = None


class BatchScoreResponse(BaseModel):
    results: list[BatchItem]
    summary: dict[str, int]  # ok, failed


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




def validation_error(errors: list[Any]) -> InvalidRequest:
    """A pydantic error list as our 422, naming the first bad field in plain words."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return InvalidRequest("the request body is not valid JSON" + (f" ({detail})" if detail else ""),
                              field="body")
    if loc == ("body",):
        if first.get("type") == "missing":
            return InvalidRequest("the request needs a JSON object body", field="body")
        if first.get("type") == "value_error":  # a rule across the object's fields, so it is an object
            return InvalidRequest(str(first["msg"]).removeprefix("Value error, "), field="body")
        return InvalidRequest(f"the request body is not a JSON object: {first['msg']}", field="body")
    field = ".".join(str(p) for p in loc if p != "body") or None
    return InvalidRequest(f"{field}: {first['msg']}" if field else str(first["msg"]), field=field)
