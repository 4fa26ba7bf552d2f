"""What one episode went through in the /score pipeline (pipelines/scoring.py): the request as
asked, the prompt, the frames sent, every reply's usage, the last reply; its audit line, written the
same way for a score and for a failure. Never media."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.answers.reply import ChatReply
from proxy.errors import MAX_REPLY_CHARS
from proxy.media.encode import EncodedFrames
from proxy.protocol.common import FramesInfo, PromptInfo

__all__ = ["EpisodeTrace"]


EXTRA_VIEW = {False: (), True: ("extra_view",)}  # a second camera's record, on the lines that have one


@dataclass
class EpisodeTrace:
    """What one episode went through so far: the audit line of a success and of a failure."""

    backend: str
    task_text: str
    kind: str = "score"  # "dense_point": one prefix of a /score/dense curve (reports count episodes apart)
    dense: dict[str, Any] | None = None  # that prefix's place in its curve: point, points, curve (its id)
    metadata: dict[str, Any] | None = None
    asked: dict[str, Any] | None = None  # the request's own max_pixels and backend_kwargs (replay reuses them)
    prompt: PromptInfo | None = None
    frames: FramesInfo | None = None
    sampling: dict[str, Any] | None = None  # of the last ask sent
    asks: int = 0
    last_reply: ChatReply | None = None
    usage_all_calls: dict[str, int] = field(default_factory=dict)
    frame_store: dict[str, Any] | None = None  # what the frame store did with this episode's JPEGs
    encoded: EncodedFrames | None = None  # the frames sent (an invariance probe reorders them)

    def saw(self, reply: ChatReply) -> None:
        self.last_reply = reply
        for key, value in (reply.usage or {}).items():
            if isinstance(value, int):
                self.usage_all_calls[key] = self.usage_all_calls.get(key, 0) + value

    def record(self) -> dict[str, Any]:
        reply = self.last_reply
        return {
            "backend": self.backend, "task_text": self.task_text,
            **({"kind": self.kind} if self.kind != "score" else {}), **({"dense": self.dense} if self.dense else {}),
            "metadata": self.metadata, "asked": self.asked,
            "prompt": self.prompt.model_dump() if self.prompt else None,
            "frames": (self.frames.model_dump(include={"count", "requested", "indices", "size", "still_size", "fps",
                                                       "sampled_fps", "vision_tokens", "sha256", "still_sha256",
                                                       "forwarded", *EXTRA_VIEW[self.frames.extra_view is not None]})
                       if self.frames else None),
            "frame_store": self.frame_store,
            "sampling": self.sampling, "asks": self.asks,
            "output_text": reply.text[:MAX_REPLY_CHARS] if reply else None,
            "finish_reason": reply.finish_reason if reply else None,
            "endpoint": reply.endpoint if reply else None,
            "usage": reply.usage if reply else None, "usage_all_calls": self.usage_all_calls or None,
        }
