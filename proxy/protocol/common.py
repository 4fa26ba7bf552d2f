"""What every surface of the proxy's API shares: the episode's metadata, a source of frames, what
was sent (the prompt, the frames), the error body, and how a pydantic refusal reads as our 422.

The served API document is these models' JSON schema, so a model states in its schema every rule
about a request's shape (a minimum length, which fields go together), and a client generated from
the document cannot build a request the proxy refuses for its shape; what only the content tells
(an image that does not decode) stays a documented 422. Numbers are read as sent (`json_number`):
JSON Schema's number is neither a string nor a boolean.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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


def not_null(field: str) -> dict[str, Any]:
    """The schema of an object where `field` is given, and not as null."""
    return {"required": [field], "properties": {field: {"not": {"type": "null"}}}}


SOURCES = ("video_path", "frames", "frames_npy")


def one_source() -> dict[str, Any]:
    """FrameSource's rule as schema: exactly one source given (and not as null)."""
    return {"oneOf": [not_null(name) for name in SOURCES]}


# Custom string formats, so a document reader (and schemathesis) knows what a valid value is.
IMAGE_FORMAT, NPY_FORMAT, MEDIA_PATH_FORMAT = "image-base64", "npy-base64", "media-path"


def _filled(what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not value:
            raise ValueError(f"an empty string is not {what}")
        return value
    return AfterValidator(check)


# Each a string of its format, non-empty: the document says so (minLength), the validator in words.
ImageBase64 = Annotated[str, Field(json_schema_extra={"format": IMAGE_FORMAT, "minLength": 1}),
                        _filled("an image (base64 of a PNG or JPEG)")]
NpyBase64 = Annotated[str, Field(json_schema_extra={"format": NPY_FORMAT, "minLength": 1}),
                      _filled("a .npy array (base64)")]
# An absolute path: the document's pattern; media/file.py refuses a relative one, naming the rule.
MediaPath = Annotated[str, Field(json_schema_extra={"format": MEDIA_PATH_FORMAT, "pattern": "^/"})]


class FrameSource(BaseModel):
    """Exactly one source of an episode's frames: a video file under proxy.allowed_media_roots;
    base64 PNG/JPEG images of one size, in order (data: URLs accepted); or base64 of a .npy uint8
    TxHxWx3 array. The main view of /score and /compare, and the second camera (extra_view)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=one_source())

    video_path: MediaPath | None = None
    frames: list[ImageBase64] | None = Field(None, min_length=1)
    frames_npy: NpyBase64 | None = None

    def source_name(self) -> str:
        return next(n for n in SOURCES if getattr(self, n) is not None)

    @model_validator(mode="after")
    def _one_source(self) -> FrameSource:
        given = [n for n in SOURCES if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of video_path, frames, frames_npy (got {', '.join(given)})" if given
                             else "no frame source: give exactly one of video_path, frames, frames_npy")
        return self


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


def validation_error(errors: list[Any]) -> InvalidRequest:
    """A pydantic error list as our 422, naming the first bad field in plain words."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return InvalidRequest("the request body is not valid JSON" + (f" ({detail})" if detail else ""),
                              field="body")
    message = str(first["msg"]).removeprefix("Value error, ")  # our validators' words, as written
    if loc == ("body",):
        if first.get("type") == "value_error":  # a rule between fields, from a model validator
            return InvalidRequest(message, field="body")
        missing = first.get("type") == "missing"
        return InvalidRequest("the request needs a JSON object body" if missing
                              else f"the request body is not a JSON object: {message}", field="body")
    field = ".".join(str(p) for p in loc if p != "body") or None
    return InvalidRequest(f"{field}: {message}" if field else message, field=field)
