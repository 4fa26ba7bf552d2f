#!/usr/bin/env python3
"""vLLM contract oracle: check a chat-completions request body with vLLM's OWN code.

Run with the reference venv's python (``scripts/reference_env.sh`` builds it; vllm==0.32.0 on a CPU
torch). This file imports nothing from the project.

stdin : one JSON document, or a JSON list of them (answered with a list, same order)::

    {"request": <chat-completions JSON body, exactly as sent>,
     "server":  {"trust_request_mm_kwargs": bool,                 # --trust-request-mm-kwargs
                 "media_io_kwargs": {"video": {"num_frames": -1}}, # --media-io-kwargs (omit = not set)
                 # optional:
                 "video_processor": "Qwen2VLVideoProcessor",       # HF video processor class of the model
                 "limit_mm_per_prompt": {"image": 2, "video": 1},  # --limit-mm-per-prompt
                 "default_sampling_params": {...}}}                # what --generation-config auto injects

stdout: one JSON report per document::

    {"request_valid", "validation_error",
     "mm_kwargs_check": {"ok", "param", "message"},
     "media_io_kwargs": {"server", "request", "merged", "effective"},
     "messages": [{"role", "parts": [{"type": "text", "text"} |
                                     {"type": "image_url", "image": {"width", "height", "mode"},
                                       "image_mean": float} |
                                     {"type": "video_url", "video": {"num_frames", "width", "height",
                                       "frame_sizes_distinct", "metadata": {...}, "frame_means": [...]}}]}],
     "decode_ok", "decode_error": {"type", "message"} | null,
     "sampling": {"ok", "message", "params", "omitted_fields"},   # omitted = server/generation-config decides
     "ignored_fields": [top-level fields vLLM accepts but ignores],
     "error_response": <the {"error": {...}} body the server would answer, first failure> | null,
     "would_accept": bool}

What is vLLM code and what is not (vLLM 0.32.0, chat completions, non-harmony models):
  * ``ChatCompletionRequest.model_validate`` - the request model FastAPI parses the body into.
  * ``validate_request_mm_kwargs`` - called as ``OnlineRenderer.preprocess_chat`` calls it.
  * media kwargs: ``request.build_chat_params(...).with_defaults(default_template_kwargs,
    default_media_io_kwargs=<--media-io-kwargs>, ...)`` exactly as ``preprocess_chat`` does, which
    runs ``merge_media_io_kwargs`` / ``VideoMediaIO.merge_kwargs``.
  * message parsing and decoding: vLLM's ``_parse_chat_message_content`` (what
    ``parse_chat_messages_async`` loops over) with a real ``AsyncMultiModalContentParser``, whose
    ``MediaConnector`` (built from ``tracker.media_io_kwargs``, the real fallback property) decodes
    every URL through ``fetch_image_async`` / ``fetch_video_async`` -> ``ImageMediaIO`` /
    ``VideoMediaIO``.  The only stand-ins: a stub ``ModelConfig`` (no model files on CPU) and a
    tracker subclass whose ``add`` records items instead of asking the model's multimodal
    processor (so ``--limit-mm-per-prompt`` is checked here with vLLM's message, only if given).
  * ``request.to_sampling_params`` for the sampling check, ``create_error_response`` for the body.
Unlike the server, a failed mm-kwargs check does not stop the decode (the report shows both).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
import warnings
from types import SimpleNamespace
from typing import Any

# vLLM logs to stdout by default; our stdout carries the JSON answer only.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_REAL_STDOUT = sys.stdout
sys.stdout = sys.stderr  # anything printed by imported code goes to stderr

import numpy as np  # noqa: E402
import pydantic  # noqa: E402
from vllm.entrypoints.generate.base.protocol import validate_request_mm_kwargs  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.multimodal.media import ImageMediaIO, VideoMediaIO  # noqa: E402,F401  (the decoders used)
from vllm.renderers import chat_utils  # noqa: E402
from vllm.renderers.params import merge_kwargs  # noqa: E402

DEFAULT_VIDEO_PROCESSOR = "Qwen2VLVideoProcessor"  # Qwen2.5-VL / PRIMO-R1


def _err_body(exc: BaseException) -> dict[str, Any]:
    return create_error_response(exc).model_dump()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _stub_model_config(server: dict[str, Any]) -> Any:
    """The attributes of ModelConfig that message parsing + the media connector read."""
    media_io_kwargs = server.get("media_io_kwargs") or {}
    limits = server.get("limit_mm_per_prompt") or {}
    mm_config = SimpleNamespace(
        media_io_kwargs=media_io_kwargs,  # MultiModalConfig default is {}
        interleave_mm_strings=False,
        enable_mm_embeds=False,
        get_limit_per_prompt=lambda modality: limits.get(modality, 999),
    )
    return SimpleNamespace(
        multimodal_config=mm_config,
        get_multimodal_config=lambda: mm_config,
        allowed_local_media_path=server.get("allowed_local_media_path", ""),
        allowed_media_domains=server.get("allowed_media_domains"),
        enable_prompt_embeds=False,
        is_multimodal_model=True,
        hf_config=SimpleNamespace(),
        model="contract-oracle-stub",
        revision=None,
    )


class _RecordingTracker(chat_utils.AsyncMultiModalItemTracker):
    """vLLM's async tracker; ``add`` records instead of consulting the model's processor."""

    def __init__(self, model_config: Any, media_io_kwargs: Any, video_processor: str | None,
                 limits: dict[str, int] | None) -> None:
        super().__init__(model_config, media_io_kwargs=media_io_kwargs)
        self._video_processor = video_processor
        self._limits = limits or {}
        self.recorded: list[tuple[str, Any]] = []

    @property
    def video_processor_name(self) -> str | None:  # type: ignore[override]
        return self._video_processor

    def add(self, modality, item):  # type: ignore[override]
        num_items = 1 + sum(1 for m, _ in self.recorded if m == modality)
        limit = self._limits.get(modality)
        if limit is not None and num_items > limit:
            # same message as MultiModalProcessingInfo.validate_num_items
            raise VLLMValidationError(
                f"At most {limit} {modality}(s) may be provided in one prompt.", parameter=modality)
        self.recorded.append((modality, item))
        self._items_by_modality[modality].append(item)
        return None


def _describe_image(img: Any) -> dict[str, Any]:
    img = getattr(img, "media", img)  # MediaWithBytes -> PIL.Image
    return {"width": img.width, "height": img.height, "mode": img.mode}


def _image_mean(img: Any) -> float:
    """Mean over pixels and channels of the decoded image (as RGB), to compare with video frames."""
    img = getattr(img, "media", img)
    return float(np.asarray(img.convert("RGB"), dtype=np.float64).mean())


def _describe_video(video: Any) -> dict[str, Any]:
    frames, metadata = getattr(video, "media", video)
    arr = frames.numpy() if hasattr(frames, "numpy") else np.asarray(frames)
    if arr.ndim == 3:  # grayscale (T, H, W)
        arr = arr[..., None]
    shapes = {tuple(f.shape) for f in arr}
    return {
        "num_frames": int(arr.shape[0]),
        "height": int(arr.shape[1]),
        "width": int(arr.shape[2]),
        "channels": int(arr.shape[3]),
        "frame_sizes_distinct": len(shapes),
        "metadata": _jsonable(metadata),
        "frame_means": [float(f.mean()) for f in arr],
    }


async def _parse_and_decode(messages: list[Any], media_io_kwargs: Any, mm_processor_kwargs: Any,
                            server: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    model_config = _stub_model_config(server)
    tracker = _RecordingTracker(model_config, media_io_kwargs,
                                server.get("video_processor", DEFAULT_VIDEO_PROCESSOR),
                                server.get("limit_mm_per_prompt"))
    conversation: list[dict[str, Any]] = []
    for msg in messages:
        conversation.extend(chat_utils._parse_chat_message_content(
            msg, tracker, "openai", interleave_strings=False, mm_processor_kwargs=mm_processor_kwargs))
    chat_utils._postprocess_messages(conversation)

    # Await every item (the server gathers them the same way in resolve_items).
    results = await asyncio.gather(*(item() for _, item in tracker.recorded), return_exceptions=True)
    decoded = iter(zip([m for m, _ in tracker.recorded], results, strict=True))

    out: list[dict[str, Any]] = []
    first_error: BaseException | None = None
    for msg in conversation:
        content = msg.get("content")
        parts: list[dict[str, Any]] = []
        if isinstance(content, str):
            parts.append({"type": "text", "text": content})
        for piece in content if isinstance(content, list) else []:
            ptype = piece.get("type")
            if ptype == "text":
                parts.append({"type": "text", "text": piece.get("text")})
            elif ptype in ("image", "video"):
                modality, res = next(decoded)
                part: dict[str, Any] = {"type": f"{modality}_url"}
                if isinstance(res, BaseException):
                    first_error = first_error or res
                    part["error"] = {"type": type(res).__name__, "message": str(res)}
                else:
                    media, _uuid = res
                    if media is not None:
                        part[modality] = (_describe_image(media) if modality == "image"
                                          else _describe_video(media))
                        if modality == "image":
                            part["image_mean"] = _image_mean(media)
                parts.append(part)
            else:
                parts.append(_jsonable(dict(piece)))
        out.append({"role": msg.get("role"), "parts": parts})
    return out, first_error


def _sampling_check(req: ChatCompletionRequest, server: dict[str, Any]) -> dict[str, Any]:
    defaults = server.get("default_sampling_params") or {}
    omitted = [n for n in req._DEFAULT_SAMPLING_PARAMS if getattr(req, n, None) is None]
    try:
        with warnings.catch_warnings():  # reading the deprecated `max_tokens` field warns
            warnings.simplefilter("ignore", DeprecationWarning)
            max_tokens = req.max_completion_tokens or req.max_tokens or int(server.get("max_tokens", 1024))
            sp = req.to_sampling_params(max_tokens, defaults)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "message": str(exc), "params": None, "omitted_fields": omitted, "_exc": exc}
    params = {k: getattr(sp, k, None) for k in (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "stop", "logprobs")}
    return {"ok": True, "message": None, "params": _jsonable(params), "omitted_fields": omitted}


def check_one(doc: dict[str, Any]) -> dict[str, Any]:
    body = doc.get("request")
    server = doc.get("server") or {}
    trust = bool(server.get("trust_request_mm_kwargs", False))
    server_mik = server.get("media_io_kwargs") or None

    report: dict[str, Any] = {
        "request_valid": False, "validation_error": None,
        "mm_kwargs_check": {"ok": False, "param": None, "message": None},
        "media_io_kwargs": {"server": server_mik, "request": None, "merged": None, "effective": None},
        "messages": [], "decode_ok": False, "decode_error": None,
        "sampling": None, "ignored_fields": [], "error_response": None, "would_accept": False,
    }
    errors: list[BaseException] = []

    try:
        req = ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        report["validation_error"] = str(exc)
        report["error_response"] = {"error": {"message": str(exc), "type": "BadRequestError",
                                              "param": None, "code": 400}}
        return report
    report["request_valid"] = True
    # extra="allow": unknown / removed fields (e.g. old guided_*) are accepted and ignored (200 OK)
    report["ignored_fields"] = sorted((req.model_extra or {}).keys())
    report["media_io_kwargs"]["request"] = req.media_io_kwargs

    # 1. what OnlineRenderer.preprocess_chat checks first
    try:
        validate_request_mm_kwargs(mm_processor_kwargs=req.mm_processor_kwargs,
                                   media_io_kwargs=req.media_io_kwargs, trust_request_mm_kwargs=trust)
        report["mm_kwargs_check"] = {"ok": True, "param": None, "message": None}
    except VLLMValidationError as exc:
        report["mm_kwargs_check"] = {"ok": False, "param": exc.parameter, "message": str(exc)}
        errors.append(exc)

    # 2. ChatParams exactly as preprocess_chat builds them (default --default-chat-template-kwargs
    #    is None; tools=None, tokenize=False for HF tokenizers)
    tool_dicts = [t.model_dump() for t in req.tools] if req.tools else None
    default_template_kwargs = merge_kwargs(None, dict(tools=tool_dicts, tokenize=False))
    chat_params = req.build_chat_params(None, "openai").with_defaults(
        default_template_kwargs,
        default_media_io_kwargs=server_mik,
        default_mm_processor_kwargs=req.mm_processor_kwargs,
    )
    report["media_io_kwargs"]["merged"] = _jsonable(chat_params.media_io_kwargs)

    # 3. parse messages + decode media with vLLM's parser / MediaConnector
    try:
        tracker_probe = _RecordingTracker(_stub_model_config(server), chat_params.media_io_kwargs, None, None)
        report["media_io_kwargs"]["effective"] = _jsonable(tracker_probe.media_io_kwargs)
        messages, decode_exc = asyncio.run(_parse_and_decode(
            req.messages, chat_params.media_io_kwargs, chat_params.mm_processor_kwargs, server))
        report["messages"] = messages
    except Exception as exc:  # noqa: BLE001 - parse-time errors (bad part type, limits, ...)
        decode_exc = exc
    if decode_exc is not None:
        report["decode_error"] = {"type": type(decode_exc).__name__, "message": str(decode_exc)}
        errors.append(decode_exc)
    else:
        report["decode_ok"] = True

    # 4. sampling params (SamplingParams validation, e.g. greedy with n > 1)
    sampling = _sampling_check(req, server)
    if "_exc" in sampling:
        errors.append(sampling.pop("_exc"))
    report["sampling"] = sampling

    if errors:
        report["error_response"] = _err_body(errors[0])
    report["would_accept"] = not errors
    return report


def main() -> int:
    try:
        doc = json.loads(sys.stdin.read())
    except json.JSONDecodeError as exc:
        print(f"vllm_oracle: stdin is not JSON: {exc}", file=sys.stderr)
        return 2
    batch = isinstance(doc, list)
    answers = []
    for item in (doc if batch else [doc]):
        try:
            answers.append(check_one(item))
        except Exception as exc:  # noqa: BLE001 - an oracle bug must not hide the other answers
            traceback.print_exc()
            answers.append({"oracle_error": f"{type(exc).__name__}: {exc}"})
    json.dump(answers if batch else answers[0], _REAL_STDOUT)
    _REAL_STDOUT.write("\n")
    _REAL_STDOUT.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
