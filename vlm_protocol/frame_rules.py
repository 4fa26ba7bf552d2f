"""One backend's frame rules as the proxy publishes them (GET /frame-rules), so a client can send
frames already at the sizes and in the encoding the proxy would send them: the proxy then forwards
them untouched instead of decoding, resizing and encoding each one.

`rules_id` names the rules: every setting that changes a sent frame's size or bytes, the codec
rule (vlm_protocol/frame_codec.py) and this format's version. A request that says which rules it
was encoded for (`frame_rules`) is refused with 409 `frame_rules_changed` when the proxy's rules
differ now; the client then sends that episode's raw frames and fetches the rules again. Standard
library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from vlm_protocol.frame_codec import CODEC
from vlm_protocol.frames import episode_sizes

__all__ = ["FORMAT_VERSION", "FrameRules"]

FORMAT_VERSION = 1
Size = tuple[int, int]  # (height, width)


@dataclasses.dataclass(frozen=True)
class FrameRules:
    backend: str
    layout: str
    nframes: int  # the backend's default frame count
    max_nframes: int | None  # a request for more frames is clamped to this
    max_pixels: int  # the default per-frame budget (a request may give its own)
    min_pixels: int
    video_max_pixels: int
    total_pixels: int
    image_min_pixels: int
    stills: bool  # the first and last frame also go as still images (PRIMO-R1's layout)
    jpeg_quality: int

    @property
    def rules_id(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("backend", "layout")}
        canonical = json.dumps({"format": FORMAT_VERSION, "codec": CODEC, **fields}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def nframes_for(self, requested: int | None) -> int:
        """The frames a request asking for `requested` gets (the backend's cap applies)."""
        wanted = requested or self.nframes
        return min(wanted, self.max_nframes or wanted)

    def sizes(self, height: int, width: int, count: int, max_pixels: int | None = None) -> tuple[Size, Size | None]:
        """(video frame size, still size or None) for `count` frames of height x width, as the proxy
        computes them; ValueError for a frame no budget can take."""
        return episode_sizes(height, width, count, max_pixels=max_pixels or self.max_pixels,
                             min_pixels=self.min_pixels, video_max_pixels=self.video_max_pixels,
                             total_pixels=self.total_pixels, image_min_pixels=self.image_min_pixels,
                             stills=self.stills)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "rules_id": self.rules_id, "codec": CODEC, "format": FORMAT_VERSION}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FrameRules:
        """The rules from a /frame-rules entry; ValueError when it is not this format or its id does
        not match its own fields (a proxy of another version: the client then sends raw frames)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or data.get("codec") != CODEC:
            raise ValueError("frame rules of another format or codec")
        try:
            values = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        except KeyError as err:
            raise ValueError(f"frame rules without {err}") from err
        for name, value in values.items():
            kind = {"backend": str, "layout": str, "stills": bool}.get(name, int)
            wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
            if wrong and not (name == "max_nframes" and value is None):
                raise ValueError(f"frame rules with {name}={value!r}")
        rules = cls(**values)
        if rules.rules_id != data.get("rules_id"):
            raise ValueError("frame rules whose id does not match their fields")
        return rules
