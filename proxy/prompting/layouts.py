"""Chat messages per model family, and the full chat-completions body sent to `vllm serve`.

    qwen_video        [system?] user: [video, text]
    primo_interleave  system;   user: [image (first frame), video, image (last frame), text]
    images            [system?] user: [image × N, text]   (models without video support)

Frames go as one `data:video/jpeg;base64,<f1>,<f2>,...` part, which vLLM splits on commas.
Its loader keeps only `num_frames` pieces (32 by default) and assumes fps 1, so every request
carries media_io_kwargs.video with num_frames = frames sent AND fps = the presentation rate
(FramesConfig.presentation_fps): a request that sets only one of them drops the server's value
of the other. PRIMO-R1's two images are the first and last frame sized by the image rule.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from proxy.config import BackendConfig, SamplingConfig
from proxy.media.encode import EncodedFrames
from vlm_protocol.frames import vision_tokens


def _video_part(b64_frames: list[str]) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(b64_frames)}}


def _image_part(b64_frame: str) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + b64_frame}}


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def build_messages(layout: str, system: str | None, user_text: str, frames: EncodedFrames) -> list[dict]:
    if layout == "qwen_video":
        content = [_video_part(frames.base64_frames), _text_part(user_text)]
    elif layout == "primo_interleave":
        first, last = frames.base64_stills
        content = [_image_part(first), _video_part(frames.base64_frames), _image_part(last), _text_part(user_text)]
    elif layout == "images":
        content = [*(_image_part(f) for f in frames.base64_frames), _text_part(user_text)]
    else:  # config validation makes this unreachable
        raise ValueError(f"unknown layout {layout!r}")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return messages


_MEDIA_TOKEN = "\x00media-" + secrets.token_hex(8) + ":"  # what no caller's text can hold


def encode_body(body: dict[str, Any], overrides: dict[str, Any] | None = None) -> bytes:
    """The chat body as sent (with `overrides`: a re-ask's sampling). The media URLs — nearly all
    of the bytes — are spliced in after encoding the rest: base64 needs no JSON escaping, and
    json.dumps scanning it was the biggest CPU cost of a /score whose frames needed no resize."""
    urls: list[str] = []

    def tokenised(part: dict) -> dict:
        kind = part.get("type")
        if kind in ("image_url", "video_url"):
            urls.append(part[kind]["url"])
            return {**part, kind: {**part[kind], "url": f"{_MEDIA_TOKEN}{len(urls) - 1}"}}
        return part

    messages = [{**m, "content": [tokenised(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
                for m in body["messages"]]
    encoded = json.dumps({**body, "messages": messages, **(overrides or {})}, separators=(",", ":"))
    pieces = encoded.split(json.dumps(_MEDIA_TOKEN)[1:-1])  # the token as JSON writes it
    if len(pieces) != len(urls) + 1 or not all(_plain(url) for url in urls):  # never, for our data: URLs
        return json.dumps({**body, **(overrides or {})}, separators=(",", ":")).encode()
    out = [pieces[0].encode()]
    for piece in pieces[1:]:
        index, _, rest = piece.partition('"')
        out += [urls[int(index)].encode("ascii"), b'"', rest.encode()]
    return b"".join(out)


def _plain(url: str) -> bool:
    """Text JSON writes as it is (what a base64 data URL always is)."""
    return url.isascii() and url.isprintable() and '"' not in url and "\\" not in url


def layout_has_video(layout: str) -> bool:
    return layout in ("qwen_video", "primo_interleave")


def layout_has_stills(layout: str) -> bool:
    return layout == "primo_interleave"


def media_io_kwargs(frames: EncodedFrames, fps: float) -> dict[str, Any]:
    return {"video": {"num_frames": len(frames.jpegs), "fps": round(fps, 6)}}


def build_chat_body(
    backend: BackendConfig,
    sampling: SamplingConfig,
    system: str | None,
    user_text: str,
    frames: EncodedFrames,
    fps: float,
    estimate_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The exact JSON sent upstream. Every sampling field is explicit (see module docstring);
    `estimate_fields` are n, structured_outputs and logprobs (request.py)."""
    body: dict[str, Any] = {
        "model": backend.model,
        "messages": build_messages(backend.layout, system, user_text, frames),
        # every field of SamplingConfig, so a new one can never be forgotten here
        **sampling.model_dump(exclude_none=True),
        "n": 1,
        **(estimate_fields or {}),
        "stream": False,
    }
    if backend.request_mm_kwargs and layout_has_video(backend.layout):
        body["media_io_kwargs"] = media_io_kwargs(frames, fps)
    return body


def build_embedding_body(backend: BackendConfig, system: str | None, user_text: str | None,
                         frames: EncodedFrames, fps: float) -> dict[str, Any]:
    """The /v1/embeddings body: one conversation, the frames laid out as for a score (a text
    part only when the backend has a prompt), with the same media_io_kwargs rule."""
    messages = build_messages(backend.layout, system, user_text or "", frames)
    if user_text is None:
        messages[-1]["content"] = messages[-1]["content"][:-1]  # the media alone
    body: dict[str, Any] = {"model": backend.model, "messages": messages, "encoding_format": "float"}
    if backend.request_mm_kwargs and layout_has_video(backend.layout):
        body["media_io_kwargs"] = media_io_kwargs(frames, fps)
    return body


def build_compare_body(backend: BackendConfig, sampling: SamplingConfig, system: str | None,
                       labels: list[str], user_text: str, episodes: list[EncodedFrames], fps: float) -> dict[str, Any]:
    """Several episodes in one user turn (POST /compare): each episode's label text, then its media
    as the layout places one episode, then the question. media_io_kwargs covers the longest video."""
    content: list[dict] = []
    for label, frames in zip(labels, episodes, strict=True):
        content += [_text_part(label), *build_messages(backend.layout, None, "", frames)[-1]["content"][:-1]]
    body = build_text_body(backend, sampling, system, [*content, _text_part(user_text)])
    if backend.request_mm_kwargs and layout_has_video(backend.layout):
        longest = max(episodes, key=lambda frames: len(frames.jpegs))
        body["media_io_kwargs"] = media_io_kwargs(longest, fps)
    return body


def build_text_body(backend: BackendConfig, sampling: SamplingConfig, system: str | None,
                    content: str | list[dict]) -> dict[str, Any]:
    """A body with one user turn and no media of its own (the second step of a two-step /compare)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return {"model": backend.model, "messages": messages, **sampling.model_dump(exclude_none=True), "n": 1,
            "stream": False}


def vision_token_count(layout: str, frames: EncodedFrames) -> int:
    """The vision tokens vLLM will count for these frames (Qwen2.5-VL), start/end tokens included."""
    if layout == "images":
        return len(frames.jpegs) * vision_tokens(frames.height, frames.width, video=False)
    count = vision_tokens(frames.height, frames.width, len(frames.jpegs), video=True)
    if layout_has_stills(layout) and frames.still_size is not None:
        width, height = frames.still_size
        count += 2 * vision_tokens(height, width, video=False)
    return count


def prompt_token_bound(layout: str, frames: EncodedFrames, text_chars: int) -> int:
    """An upper bound of a prompt's tokens: the exact vision cost plus a generous text allowance
    (≈3 chars a token, + template)."""
    return vision_token_count(layout, frames) + text_chars // 3 + 64
