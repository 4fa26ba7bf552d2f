"""Scoring models on the OpenAI surface: a /v1/chat/completions request whose `model` is
`score:<backend>` runs the /score pipeline (template, layout, sampling, retries,
parsing, audit, metrics) on the request's image parts and answers a chat.completion.

Made so that RLinf's API reward worker (`EmbodiedAPIRewardWorker`, reward.worker_type: api) can use
the proxy as its `api_base`. It posts one user message: an `image_url` part per history frame (a
base64 JPEG data URL) and one text part (its prompt, which holds the task), with its
`sampling_params` spread into the body. Its `vlm_trend_reward_parser` reads a JSON object's
`trend` (positive / negative / unclear) from the reply text. So the reply's content is
`{"trend": "positive" | "negative", "score": s}`: positive when the score reaches
`trend_threshold` (0.5 unless the body says otherwise); the /score answer rides along
in the completion as `vlm_reward`. A failed score is the proxy's error answer, never a number.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from proxy.errors import InvalidRequest, UnknownBackend
from proxy.pipelines.scoring import SCORE, score_episode
from proxy.pipelines.services import Services
from proxy.prompting.request import SAMPLING_FIELDS
from proxy.protocol.common import validation_error
from proxy.protocol.json_peek import loads
from proxy.protocol.score import ScoreRequest, ScoreResponse
from proxy.upstream.backends import BackendRegistry

__all__ = ["SCORE_PREFIX", "ChatScoring", "completion", "model_cards", "parse_chat", "score_chat",
           "scoring_body"]

SCORE_PREFIX = "score:"
DEFAULT_THRESHOLD = 0.5
# /score's own fields a scoring request may also carry at the top level of its body.
SCORE_FIELDS = ("fps", "video_fps", "nframes", "max_pixels", "metadata", "backend_kwargs")
CONTENT = "messages[0].content"
OTHER_FIELDS = ("model", "messages", "stream", "n", "max_completion_tokens", "trend_threshold")
_DATA_IMAGE = re.compile(r"data:image/(?:jpeg|jpg|png);base64,", re.IGNORECASE)
# Where RLinf's prompts hold the task (rlinf/models/embodiment/reward/vlm_reward_utils/input_builder.py:
# VLMTrendRewardInputBuilder, BaseVLMInputBuilder). Any other text is the task text as it stands.
_TASK_IN_PROMPT = (re.compile(r"You are currently performing the task: (?P<task>.+?)\. You are given ", re.S),
                   re.compile(r"Task: (?P<task>.+?)\n\nEvaluate the task", re.S))


@dataclass(frozen=True)
class ChatScoring:
    model: str  # as the request named it
    request: ScoreRequest
    threshold: float
    frame_fields: tuple[str, ...]  # where frames[i] came from: messages[0].content[j]
    top_level: frozenset[str]  # sampling fields sent at the top level (as RLinf's sampling_params are)


def scoring_body(raw_body: bytes, model: str) -> dict[str, Any] | None:
    """The parsed body when `model` (read by the pass-through's routing) names a scoring model;
    None for the pass-through, whose bodies are never parsed whole."""
    if not model.startswith(SCORE_PREFIX):
        return None
    try:
        return loads(raw_body)  # routing checked the structure, not every value
    except ValueError as err:
        raise InvalidRequest(f"the request body is not valid JSON ({err})", field="body") from err


def model_cards(registry: BackendRegistry) -> list[dict[str, Any]]:
    """GET /v1/models entries: one scoring model per backend."""
    return [{"id": SCORE_PREFIX + backend.name, "object": "model", "owned_by": "vlm-reward-proxy",
             "root": backend.config.model, "backend": backend.name, "scoring": True}
            for backend in registry.of_kind("chat")]


def _invalid(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", field=field)


def _parts(body: dict[str, Any]) -> tuple[list[str], tuple[str, ...], str]:
    """The image data URLs, where each was, and the text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict) \
            or messages[0].get("role") != "user":
        raise _invalid("a scoring model takes exactly one user message (the backend's template is the prompt)",
                       "messages")
    content = messages[0].get("content")
    if not isinstance(content, list):
        raise _invalid("must be a list of image_url parts (the frames, in order) and a text part (the task)",
                       CONTENT)
    urls, fields, texts = [], [], []
    for j, part in enumerate(content):
        where = f"messages[0].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str) or not _DATA_IMAGE.match(url):
                raise _invalid("an image part must be a base64 PNG/JPEG data URL (data:image/jpeg;base64,…); "
                               "the proxy fetches no URLs", where)
            urls.append(url)
            fields.append(where)
        else:
            raise _invalid("a part must be {type: image_url, image_url: {url}} or {type: text, text}", where)
    if not urls:
        raise _invalid("holds no image_url part: the frames to score", CONTENT)
    text = "\n".join(texts).strip()
    if not text:
        raise _invalid("holds no text part: the task to score", CONTENT)
    return urls, tuple(fields), text


def task_of(text: str) -> str:
    """The task inside one of RLinf's reward prompts, or the text itself."""
    for pattern in _TASK_IN_PROMPT:
        found = pattern.search(text)
        if found:
            return found["task"].strip()
    return text


def parse_chat(body: dict[str, Any], registry: BackendRegistry) -> ChatScoring:
    model = body["model"]
    label = model[len(SCORE_PREFIX):]
    try:
        backend = registry.resolve(label, field="model")
    except UnknownBackend:
        known = ", ".join(SCORE_PREFIX + b.name for b in registry.of_kind("chat"))
        raise UnknownBackend(f"unknown scoring model {model!r}; known: {known}", field="model") from None
    allowed = {*OTHER_FIELDS, *SCORE_FIELDS, *SAMPLING_FIELDS}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _invalid(f"not a field of a scoring request; allowed: {', '.join(sorted(allowed))}", unknown[0])
    if body.get("stream"):
        raise _invalid("a scoring model answers whole completions; send stream: false", "stream")
    if body.get("n", 1) != 1:
        raise _invalid("a scoring model answers one choice; send n: 1", "n")
    threshold = body.get("trend_threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
        raise _invalid("must be a number within [0, 1]", "trend_threshold")
    kwargs = body.get("backend_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _invalid("must be an object", "backend_kwargs")
    top = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}  # null: OpenAI's "unset"
    if body.get("max_completion_tokens") is not None:
        top.setdefault("max_tokens", body["max_completion_tokens"])
    clash = sorted(top.keys() & kwargs.keys())
    if clash:
        raise _invalid("given both at the top level and in backend_kwargs", clash[0])
    urls, frame_fields, text = _parts(body)
    fields = {k: body[k] for k in SCORE_FIELDS if k in body and k != "backend_kwargs"}
    try:
        request = ScoreRequest.model_validate({**fields, "task_text": task_of(text), "frames": urls,
                                               "backend": backend.name, "backend_kwargs": {**kwargs, **top}})
    except ValidationError as err:
        raise _on_chat_fields(validation_error(err.errors()), frame_fields, frozenset(top)) from None
    return ChatScoring(model, request, float(threshold), frame_fields, frozenset(top))


def _on_chat_fields(err: InvalidRequest, frame_fields: tuple[str, ...], top_level: frozenset[str]) -> InvalidRequest:
    """A /score field name in an error (frames[3], task_text, backend_kwargs.max_tokens sent at the
    top level) as the chat request's own."""
    field = err.field or ""
    indexed = re.fullmatch(r"frames(?:\[(\d+)\]|\.(\d+))(.*)", field)
    if indexed and int(indexed[1] or indexed[2]) < len(frame_fields):
        where = frame_fields[int(indexed[1] or indexed[2])] + indexed[3]
    elif field.removeprefix("backend_kwargs.") in top_level:
        where = field.removeprefix("backend_kwargs.")
    elif field.startswith(("frames", "task_text")):
        where = CONTENT
    else:
        return err
    named = indexed or where in top_level
    err.message = err.message.replace(field, where, 1) if named and field in err.message else \
        f"{where}: {err.message}"
    err.field = err.details["field"] = where
    return err


async def score_chat(chat: ChatScoring, services: Services, *, budget_s: float | None) -> ScoreResponse:
    try:
        return await score_episode(services, chat.request, SCORE, budget_s=budget_s)
    except InvalidRequest as err:
        raise _on_chat_fields(err, chat.frame_fields, chat.top_level) from None


def completion(chat: ChatScoring, result: ScoreResponse, request_id: str | None) -> dict[str, Any]:
    """The chat.completion RLinf's parser reads: the verdict and the score as a JSON object."""
    trend = "positive" if result.score >= chat.threshold else "negative"
    content = json.dumps({"trend": trend, "score": result.score}, separators=(",", ":"))
    usage = result.usage if isinstance(result.usage, dict) and all(
        isinstance(result.usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")) \
        else None
    return {"id": f"chatcmpl-{request_id or uuid.uuid4().hex[:16]}", "object": "chat.completion",
            "created": int(time.time()), "model": chat.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": usage, "vlm_reward": result.model_dump(mode="json")}
