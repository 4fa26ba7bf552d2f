"""Chat messages per model family, and the full chat-completions body sent to `vllm serve`.

    qwen_video        [system?] user: [video, text]
    primo_interleave  system;   user: [image (first frame), video, image (last frame), text]
    images            [system?] user: [image × N, text]   (models without video support)

Frames go as one `data:video/jpeg;base64,<f1>,<f2>,...` part, which vLLM splits on commas.
Its loader keeps only `num_frames` pieces (32 by default) and assumes fps 1, so every request
carries media_io_kwargs.video with num_frames = frames sent AND fps = the sampled rate: a
request that sets only one of them drops the server's value of the other.
"""

from __future__ import annotations

import math
from typing import Any

from proxy.config import BackendConfig, SamplingConfig
from proxy.media import PATCH_FACTOR, EncodedFrames


def _video_part(b64_frames: list[str]) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(b64_frames)}}


def _image_part(b64_frame: str) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + b64_frame}}


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def build_messages(layout: str, system: str | None, user_text: str, b64_frames: list[str]) -> list[dict]:
    if layout == "qwen_video":
        content = [_video_part(b64_frames), _text_part(user_text)]
    elif layout == "primo_interleave":
        content = [_image_part(b64_frames[0]), _video_part(b64_frames), _image_part(b64_frames[-1]),
                   _text_part(user_text)]
    elif layout == "images":
        content = [*(_image_part(f) for f in b64_frames), _text_part(user_text)]
    else:  # config validation makes this unreachable
        raise ValueError(f"unknown layout {layout!r}")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return messages


def layout_has_video(layout: str) -> bool:
    return layout in ("qwen_video", "primo_interleave")


def media_io_kwargs(frames: EncodedFrames) -> dict[str, Any]:
    return {"video": {"num_frames": len(frames.jpegs), "fps": round(frames.sampled_fps, 6)}}


def build_chat_body(
    backend: BackendConfig,
    sampling: SamplingConfig,
    system: str | None,
    user_text: str,
    frames: EncodedFrames,
) -> dict[str, Any]:
    """The exact JSON sent upstream. Every sampling field is explicit (see module docstring)."""
    body: dict[str, Any] = {
        "model": backend.model,
        "messages": build_messages(backend.layout, system, user_text, frames.base64_frames),
        # every field of SamplingConfig, so a new one can never be forgotten here
        **sampling.model_dump(exclude_none=True),
        "n": 1,
        "stream": False,
    }
    if backend.request_mm_kwargs and layout_has_video(backend.layout):
        body["media_io_kwargs"] = media_io_kwargs(frames)
    return body


def estimate_prompt_tokens(layout: str, frames: EncodedFrames, text_chars: int) -> int:
    """Qwen2.5-VL's vision cost plus a generous text estimate (≈3 chars a token, + template)."""
    grid = (frames.height // PATCH_FACTOR) * (frames.width // PATCH_FACTOR)
    count = len(frames.jpegs)
    video = math.ceil(count / 2) * grid + 2
    image = grid + 2
    vision = {"qwen_video": video, "primo_interleave": video + 2 * image, "images": count * image}[layout]
    return vision + text_chars // 3 + 64
