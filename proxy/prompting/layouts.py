"""Chat messages per model family, and the full chat-completions body sent to `vllm serve`.

    qwen_video        [system?] user: [video, (second camera's video,) text]
    primo_interleave  system;   user: [image (first frame), video, (second camera's video,) image (last frame), text]
    images            [system?] user: [image × N, text]   (models without video support)
    shuffled_images   [system?] user: [text, image (first frame), text, ("Frame n:", image) × k in a
                      seeded shuffled order, ...]: the template's user text names where the reference
                      frame (${first_frame}) and the shown frames (${frames}) go (GVL, per_frame.py)

Frames go as one `data:video/jpeg;base64,<f1>,<f2>,...` part, which vLLM splits on commas.
Its loader keeps only `num_frames` pieces (32 by default) and assumes fps 1, so every request
carries media_io_kwargs.video with num_frames = frames sent AND fps = the presentation rate
(FramesConfig.presentation_fps): a request that sets only one of them drops the server's value
of the other. PRIMO-R1's two images are the first and last frame sized by the image rule.

With `media_uuids` (a backend key, on by default) every image and video part also carries vLLM's
`uuid` (vLLM >= 0.10.2): the identity vLLM's processor cache, encoder cache and prefix-cache block
hashes use for that item instead of hashing its bytes. An image's is the sha256 of the JPEG sent
(what provenance and the frame store call it); a video's the sha256 over its frames' sha256s in
order and the media_io_kwargs.video sent with it (`video_uuid`). The data always goes too:
vLLM 0.32 still decodes it, and a part without data whose uuid is not cached is refused
(docs/benchmarks.md §4, "Each picture's uuid").
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from proxy.answers.parse import PerFrame
from proxy.answers.per_frame import Shuffle
from proxy.config import BackendConfig, SamplingConfig
from proxy.errors import TokenBudgetExceeded
from proxy.media.encode import EncodedFrames
from vlm_protocol.frames import vision_tokens


class _Base64URL(str):
    """A data URL made here from base64 text: JSON writes it as it is, by construction, so
    `encode_body` splices it without scanning its bytes."""


def _video_part(b64_frames: list[str], uuid: str | None = None) -> dict:
    part = {"type": "video_url", "video_url": {"url": _Base64URL("data:video/jpeg;base64," + ",".join(b64_frames))}}
    return {**part, "uuid": uuid} if uuid else part


def _image_part(b64_frame: str, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": _Base64URL("data:image/jpeg;base64," + b64_frame)}}
    return {**part, "uuid": uuid} if uuid else part


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def video_uuid(frame_sha256: list[str], video_io: dict[str, Any] | None) -> str:
    """A video part's uuid: the sha256 of its frames' sha256s in order and of the
    media_io_kwargs.video it is sent with (None: none sent, the server's defaults apply). vLLM
    decodes a `data:video/jpeg` part into those frames with timing metadata made from exactly these
    kwargs and the server's own --media-io-kwargs (the same for every request to one server), so
    equal uuids mean equal inputs to the model. (vLLM also folds the request's media_io_kwargs into
    a uuid'd item's cache key; this does not rely on it.)"""
    what = json.dumps({"frames": frame_sha256, "media_io_kwargs.video": video_io}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(b"data:video/jpeg;" + what.encode()).hexdigest()


# Where the rendered user text of a shuffled_images template holds its pictures (what no caller's text holds)
FIRST_FRAME_SLOT, FRAMES_SLOT = (f"\x00{name}-{secrets.token_hex(8)}\x00" for name in ("first_frame", "frames"))


def _shuffled_content(user_text: str, frames: EncodedFrames, shown: tuple[Shuffle, PerFrame],
                      ids: list[str] | None) -> list[dict]:
    """The user text cut at its two slots: the reference frame at one, each shown frame after its
    label at the other, in the shuffled order (order[n] = the frame shown as number n + 1)."""
    shuffle, per_frame = shown
    pictures = [_image_part(f, ids[n] if ids else None) for n, f in enumerate(frames.base64_frames)]
    if len(shuffle.order) != len(pictures) - 1:
        raise ValueError(f"{len(shuffle.order)} shown frames for {len(pictures) - 1} frames after the reference")
    numbered = [part for n, at in enumerate(shuffle.order)
                for part in (_text_part(per_frame.label_of(n + 1)), pictures[at + 1])]
    head, first, rest = user_text.partition(FIRST_FRAME_SLOT)
    if not first:  # a template without ${first_frame}: the reference frame is not shown
        head, rest = "", user_text
    middle, slot, tail = rest.partition(FRAMES_SLOT)
    if not slot or FIRST_FRAME_SLOT in middle + tail or FRAMES_SLOT in tail:
        raise ValueError("the user text must hold the frames slot once, and the first-frame slot at most once "
                         "before it")
    content = [_text_part(head.strip())] if head.strip() else []
    content += [pictures[0]] if first else []
    content += [_text_part(middle.strip())] if middle.strip() else []
    content += numbered
    return content + ([_text_part(tail.strip())] if tail.strip() else [])


def build_messages(layout: str, system: str | None, user_text: str, frames: EncodedFrames, *,
                   media_uuids: bool = False, video_io: dict[str, Any] | None = None,
                   shown: tuple[Shuffle, PerFrame] | None = None) -> list[dict]:
    """The conversation for one episode. With `media_uuids`, each media part carries its uuid
    (module docstring); `video_io` is the media_io_kwargs.video the body carries, if any;
    `shown`: the shuffled_images layout's order and its template's per-frame words."""
    ids = frames.sha256 if media_uuids else None  # of the video's frames (the images layout: of each image)
    clip = video_uuid(ids, video_io) if ids is not None and layout_has_video(layout) else None
    # A second camera's own video (frames.extra_view: second_video) follows the main one.
    videos = [_video_part(frames.base64_frames, clip)]
    if frames.extra is not None:
        extra = frames.extra
        videos.append(_video_part(extra.base64_frames, video_uuid(extra.sha256, video_io) if media_uuids else None))
    if layout == "qwen_video":
        content = [*videos, _text_part(user_text)]
    elif layout == "primo_interleave":
        first, last = frames.base64_stills
        first_id, last_id = frames.still_sha256 if media_uuids else (None, None)
        content = [_image_part(first, first_id), *videos, _image_part(last, last_id), _text_part(user_text)]
    elif layout == "images":
        content = [*(_image_part(f, ids[n] if ids else None) for n, f in enumerate(frames.base64_frames)),
                   _text_part(user_text)]
    elif layout == "shuffled_images":
        if shown is None:
            raise ValueError("the shuffled_images layout needs the shown order")
        content = _shuffled_content(user_text, frames, shown, ids)
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
    if len(pieces) != len(urls) + 1 or not all(type(url) is _Base64URL or _plain(url) for url in urls):
        return json.dumps({**body, **(overrides or {})}, separators=(",", ":")).encode()
    out = [pieces[0].encode()]
    for piece in pieces[1:]:
        index, _, rest = piece.partition('"')
        out += [urls[int(index)].encode("ascii"), b'"', rest.encode()]
    return b"".join(out)


# The characters JSON writes as they are (printable ASCII but the quote and the backslash).
_PLAIN_BYTES = bytes(range(0x20, 0x7F)).replace(b'"', b"").replace(b"\\", b"")


def _plain(url: str) -> bool:
    """Text JSON writes as it is (what a base64 data URL always is). Checked in C over the bytes:
    str.isprintable took a fifth of the GIL time of a final-size JPEG episode (bench_capacity)."""
    return url.isascii() and not url.encode("ascii").translate(None, _PLAIN_BYTES)


def layout_has_video(layout: str) -> bool:
    return layout in ("qwen_video", "primo_interleave")


def layout_has_images(layout: str) -> bool:
    """One image part per frame (no video): the servers' --limit-mm-per-prompt counts them."""
    return layout in ("images", "shuffled_images")


def layout_has_stills(layout: str) -> bool:
    return layout == "primo_interleave"


def media_io_kwargs(frames: EncodedFrames, fps: float) -> dict[str, Any]:
    return {"video": {"num_frames": len(frames.jpegs), "fps": round(fps, 6)}}


def _body_media_io(backend: BackendConfig, frames: EncodedFrames, fps: float) -> dict[str, Any] | None:
    """The body's media_io_kwargs, or None when it sends none (no video, or request_mm_kwargs off)."""
    return media_io_kwargs(frames, fps) if backend.request_mm_kwargs and layout_has_video(backend.layout) else None


def build_chat_body(
    backend: BackendConfig,
    sampling: SamplingConfig,
    system: str | None,
    user_text: str,
    frames: EncodedFrames,
    fps: float,
    estimate_fields: dict[str, Any] | None = None,
    shown: tuple[Shuffle, PerFrame] | None = None,
) -> dict[str, Any]:
    """The exact JSON sent upstream. Every sampling field is explicit (see module docstring);
    `estimate_fields` are n, structured_outputs and logprobs (request.py)."""
    mm_io = _body_media_io(backend, frames, fps)
    body: dict[str, Any] = {
        "model": backend.model,
        "messages": build_messages(backend.layout, system, user_text, frames, media_uuids=backend.media_uuids,
                                   video_io=(mm_io or {}).get("video"), shown=shown),
        # every field of SamplingConfig, so a new one can never be forgotten here
        **sampling.model_dump(exclude_none=True),
        "n": 1,
        **(estimate_fields or {}),
        "stream": False,
    }
    if mm_io is not None:
        body["media_io_kwargs"] = mm_io
    return body


def build_embedding_body(backend: BackendConfig, system: str | None, user_text: str | None,
                         frames: EncodedFrames, fps: float) -> dict[str, Any]:
    """The /v1/embeddings body: one conversation, the frames laid out as for a score (a text
    part only when the backend has a prompt), with the same media_io_kwargs rule."""
    mm_io = _body_media_io(backend, frames, fps)
    messages = build_messages(backend.layout, system, user_text or "", frames, media_uuids=backend.media_uuids,
                              video_io=(mm_io or {}).get("video"))
    if user_text is None:
        messages[-1]["content"] = messages[-1]["content"][:-1]  # the media alone
    body: dict[str, Any] = {"model": backend.model, "messages": messages, "encoding_format": "float"}
    if mm_io is not None:
        body["media_io_kwargs"] = mm_io
    return body


def build_compare_body(backend: BackendConfig, sampling: SamplingConfig, system: str | None,
                       labels: list[str], user_text: str, episodes: list[EncodedFrames], fps: float) -> dict[str, Any]:
    """Several episodes in one user turn (POST /compare): each episode's label text, then its media
    as the layout places one episode, then the question. media_io_kwargs covers the longest video."""
    mm_io = _body_media_io(backend, max(episodes, key=lambda frames: len(frames.jpegs)), fps)
    content: list[dict] = []
    for label, frames in zip(labels, episodes, strict=True):
        episode = build_messages(backend.layout, None, "", frames, media_uuids=backend.media_uuids,
                                 video_io=(mm_io or {}).get("video"))
        content += [_text_part(label), *episode[-1]["content"][:-1]]
    body = build_text_body(backend, sampling, system, [*content, _text_part(user_text)])
    if mm_io is not None:
        body["media_io_kwargs"] = mm_io
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
    if layout_has_images(layout):
        return len(frames.jpegs) * vision_tokens(frames.height, frames.width, video=False)
    count = sum(vision_tokens(video.height, video.width, len(video.jpegs), video=True)
                for video in (frames, frames.extra) if video is not None)
    if layout_has_stills(layout) and frames.still_size is not None:
        width, height = frames.still_size
        count += 2 * vision_tokens(height, width, video=False)
    return count


def check_token_budget(cfg: BackendConfig, max_tokens: int, vision_tokens: int, text_chars: int, what: str) -> None:
    """A 422 before any call when the prompt and the reply could not fit the backend's
    max_model_len: the exact vision cost plus a generous text allowance (about 3 characters a
    token, and the template's own) plus max_tokens. `what` names the frames in the message."""
    if cfg.max_model_len is None:
        return
    needed = vision_tokens + text_chars // 3 + 64 + max_tokens
    if needed > cfg.max_model_len:
        raise TokenBudgetExceeded(f"{what} need about {needed} tokens with max_tokens {max_tokens}, over max_model_len "
                                  f"{cfg.max_model_len}; lower nframes or max_pixels", field="nframes")
