"""`proxy.video_decoders`: the worker processes that decode video files (proxy/media/decoder_pool.py),
as a section of the one config model (proxy/config/settings.py). Their count is `proxy.media_workers`."""

from __future__ import annotations

from pydantic import Field

from proxy.config.strict import PositiveInt
from proxy.config.strict import StrictModel as _Strict

__all__ = ["VideoDecodersConfig"]


class VideoDecodersConfig(_Strict):
    """Each video file is decoded in a worker process under an address-space limit and a time limit,
    so a decoder that crashes, runs out of memory or hangs costs that one request."""

    # False: video is decoded on the media threads inside the proxy, as before (no memory or time
    # limit; a decoder crash ends the proxy). For comparison and for platforms without /proc.
    isolated: bool = True
    # The most address space one decode may add to its worker; each decode gets less: what the
    # frame size its container states and its plan need (docs/security.md says the rule).
    max_memory_mb: float = Field(1024.0, gt=0)
    task_timeout_s: float = Field(120.0, gt=0)  # one request's decode; over it, the worker is killed
    tasks_per_process: PositiveInt = 500  # then the worker is replaced (a heap that only grows)
