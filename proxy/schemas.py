"""Request and response bodies of the proxy's own API (pydantic, validated at the edge)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from proxy.errors import InvalidRequest

MAX_METADATA_BYTES = 4096
Scalar = str | int | float | bool | None


class EpisodeMetadata(BaseModel):
    """What the caller knows about the episode: recorded in the audit log, never sent to the model.
    `env_success` is the simulator's ground truth (the reward-quality report compares with it)."""

    model_config = ConfigDict(extra="allow")

    env_success: bool | None = None
    task_id: int | str | None = None
    episode_id: int | str | None = None
    step: int | None = None
    run: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _small_and_flat(self) -> EpisodeMetadata:
        extra = self.model_extra or {}
        if len(extra) > 32 or any(not isinstance(v, Scalar) or (isinstance(v, str) and len(v) > 512)
                                  for v in extra.values()):
            raise ValueError("metadata holds at most 32 extra keys, each a number, bool or string of <= 512 chars")
        if len(self.model_dump_json()) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is over {MAX_METADATA_BYTES} bytes")
        return self


class ScoreRequest(BaseModel):
    """POST /score. Field names follow the seed server so its clients keep working."""

    model_config = ConfigDict(extra="forbid")

    task_text: str = Field(min_length=1, max_length=4096)
    # Exactly one source of frames:
    video_path: str | None = None  # a video file under proxy.allowed_media_roots
    frames: list[str] | None = None  # base64 PNG/JPEG images (data: URLs accepted), in order
    frames_npy: str | None = None  # base64 of a .npy uint8 array T×H×W×3
    fps: float | None = Field(None, gt=0, le=1000)  # source rate of inline frames
    # The rate the clip is presented at (the seed's reward_model.video_fps); used when the
    # backend's frames.presentation_fps is "seed".
    video_fps: float | None = Field(None, gt=0, le=1000)
    nframes: int | None = Field(None, ge=1)  # frames to sample; caps checked against config
    max_pixels: int | None = Field(None, ge=1)  # per-frame pixel budget after resize
    backend: str | None = None  # backend name or alias; None = the only/first backend
    # Per-request sampling overrides (within bounds), score_mode, and template variables.
    backend_kwargs: dict[str, Any] = Field(default_factory=dict)
    metadata: EpisodeMetadata | None = None  # recorded with the result, never sent to the model

    @model_validator(mode="after")
    def _one_source(self) -> ScoreRequest:
        given = [n for n in ("video_path", "frames", "frames_npy") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of video_path, frames, frames_npy"
                + (f" (got {', '.join(given)})" if given else "")
            )
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


class BatchScoreRequest(BaseModel):
    """POST /score/batch. Items are validated one by one, so one bad item fails alone."""

    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1)


def validation_error(errors: list[Any]) -> InvalidRequest:
    """A pydantic error list as our 422, naming the first bad field in plain words."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return InvalidRequest("the request body is not valid JSON" + (f" ({detail})" if detail else ""),
                              field="body")
    if loc == ("body",):
        missing = first.get("type") == "missing"
        return InvalidRequest("the request needs a JSON object body" if missing
                              else f"the request body is not a JSON object: {first['msg']}", field="body")
    field = ".".join(str(p) for p in loc if p != "body") or None
    return InvalidRequest(f"{field}: {first['msg']}" if field else str(first["msg"]), field=field)
