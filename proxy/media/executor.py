"""Where a request's media work runs: the app's bounded pool of media threads (`proxy.media_workers`),
OpenCV's own thread pool off in them, and beside them the decoder processes that read video files
(proxy/media/decoder_pool.py).

Threads, not processes, for inline images and `.npy`: OpenCV releases the GIL in its decode,
resize and encode calls, so an episode holds the GIL for under a sixth of its CPU and W threads
scale ~W-fold, where a process would first have to copy the request's frames (docs/benchmarks.md
§9). A video file is opened and checked on a media thread and decoded in a process that gets its
descriptor: FFmpeg's demuxers and decoders are the code most likely to crash or allocate without
bound on a hostile file, and there that costs one request. Decoded frames live only inside one
call (what leaves is JPEG bytes), so the proxy's decoded memory is at most media_workers x
max_decoded_mb, and with the decoder processes only that of inline frames.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from collections.abc import Callable
from typing import TypeVar

import cv2

from proxy.config.video_decoders import VideoDecodersConfig
from proxy.media.budget import DecodeBudget, MediaCaps
from proxy.media.decode_jobs import Curve, Job, job_parts, opened_videos, run_job
from proxy.media.decoder_pool import DecoderPool
from proxy.media.encode import EncodedFrames

__all__ = ["MediaExecutor"]

T = TypeVar("T")


def _one_opencv_thread() -> None:
    cv2.setNumThreads(1)  # parallelism is the pool's: workers x OpenCV threads would oversubscribe


class MediaExecutor:
    """`run(fn)` calls `fn(budget)` on a media thread; when the awaiting task is cancelled (caller
    gone, deadline) the budget's flag is set and the decode stops between frames. `run_job(job)`
    runs a request's media job there, and one that reads a video file in a decoder process unless
    `decoders` is None (`proxy.video_decoders.isolated: false`)."""

    def __init__(self, workers: int, caps: MediaCaps, decoders: VideoDecodersConfig | None = None) -> None:
        self.caps = caps
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="media",
                                                           initializer=_one_opencv_thread)
        # One process per media thread at most: a thread waits for its own process, never for another's.
        self.decoders = DecoderPool(decoders, workers) if decoders is not None else None

    async def run(self, fn: Callable[[DecodeBudget], T]) -> T:
        budget = DecodeBudget(self.caps)
        # The caller's context goes along (as asyncio.to_thread does): a binary body's parts live in it.
        context = contextvars.copy_context()
        future = asyncio.get_running_loop().run_in_executor(self._pool, context.run, fn, budget)
        try:
            return await future
        except asyncio.CancelledError:
            budget.cancel()
            raise

    async def run_job(self, job: Job) -> EncodedFrames | Curve:
        """The job's JPEGs and metadata (EncodedFrames, or a dense curve's Curve)."""
        return await self.run(lambda budget: self._run_job(job, budget))

    def _run_job(self, job: Job, budget: DecodeBudget) -> EncodedFrames | Curve:
        with opened_videos(job) as (opened, videos):
            if videos and self.decoders is not None:
                return self.decoders.run(opened, videos, job_parts(opened), self.caps, budget)
            return run_job(opened, budget)

    def close(self) -> None:
        """Waits for running decodes (each stops at its next frame once cancelled; a decoder process
        is killed), then stops the decoder processes."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.decoders is not None:
            self.decoders.close()
