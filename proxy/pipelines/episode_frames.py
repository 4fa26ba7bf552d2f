"""An episode's frames as a pipeline sends them: decoded on the media threads, described (the
frames' provenance), and kept in the frame store. /score, /score/dense, /compare and /progress all
load an episode here, so a frame is sampled, sized and hashed the same way on every route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.config import BackendConfig
from proxy.errors import InvalidRequest
from proxy.media.decode import FrameLimits
from proxy.media.decode_jobs import EpisodeJob
from proxy.media.encode import EncodedFrames
from proxy.media.views import check_views, extra_view_info
from proxy.pipelines.services import Services
from proxy.prompting.layouts import vision_token_count
from proxy.prompting.request import presentation_fps
from proxy.protocol.common import FramesInfo
from proxy.protocol.score import ScoreRequest, ViewSource

__all__ = ["LoadedEpisode", "decode_episode", "describe_frames", "load_episode", "source_of", "store_frames"]


@dataclass(frozen=True)
class LoadedEpisode:
    frames: EncodedFrames  # the JPEGs sent, at their sizes
    fps: float  # the presentation rate the body states
    info: FramesInfo  # their provenance, as the answer and the audit line give it
    stored: dict[str, Any] | None = None  # what the frame store did with them


def source_of(request: ScoreRequest | ViewSource, services: Services) -> dict[str, Any]:
    """The request's (or its second camera's) frame source as `decode_source` takes it (a video_path
    is checked against the roots, opened and sniffed there, on the media thread: proxy/media/file.py)."""
    return {"video_path": request.video_path, "media_roots": services.settings.proxy.allowed_media_roots,
            "frames": request.frames, "frames_npy": request.frames_npy, "fps": getattr(request, "fps", None),
            "stills": getattr(request, "stills", None)}


async def decode_episode(services: Services, request: ScoreRequest, cfg: BackendConfig,
                         limits: FrameLimits) -> EncodedFrames:
    """The request's frames sampled, sized and encoded on a media thread, a video file's in a decoder
    process (both cameras, when the backend places a second one, at the same indices within one budget)."""
    placement = check_views(cfg.frames.extra_view, given=request.extra_view is not None,
                            frame_rules=request.frame_rules is not None)
    extra = {**source_of(request.extra_view, services), "fps": request.fps} if placement is not None else None
    frames = await services.media.run_job(EpisodeJob(limits, source_of(request, services), request.prefix_end,
                                                     placement, extra))
    made = len(frames.jpegs) + len(frames.stills)  # the main view's (a second camera's go raw)
    if request.frame_rules is not None and frames.forwarded != made:
        # The caller said it encoded for these rules: a frame the proxy had to redo is its bug, never
        # a silent second resize of already-resized pixels.
        raise InvalidRequest(f"frames sent with frame_rules must be RGB JPEGs at the rules' sizes (forwarded "
                             f"as they are); {made - frames.forwarded} were not: send raw frames instead",
                             field="frames")
    services.metrics.stage.labels(stage="load").observe(frames.load_ms / 1e3)
    services.metrics.stage.labels(stage="encode").observe(frames.encode_ms / 1e3)
    return frames


def describe_frames(request: ScoreRequest, cfg: BackendConfig, frames: EncodedFrames,
                    requested: int) -> LoadedEpisode:
    """The frames' presentation rate and provenance; `requested` is the nframes asked for."""
    placement = check_views(cfg.frames.extra_view, given=request.extra_view is not None,
                            frame_rules=request.frame_rules is not None)
    fps = presentation_fps(cfg, request, frames)
    info = FramesInfo(
        count=len(frames.jpegs), requested=requested, indices=frames.indices,
        source_count=frames.source_count, size=(frames.width, frames.height), still_size=frames.still_size,
        fps=round(fps, 6), sampled_fps=round(frames.sampled_fps, 6),
        vision_tokens=vision_token_count(cfg.layout, frames), sha256=frames.sha256,
        still_sha256=frames.still_sha256, forwarded=frames.forwarded,
        extra_view=extra_view_info(placement, frames) if placement else None)
    return LoadedEpisode(frames, fps, info)


async def store_frames(services: Services, loaded: LoadedEpisode) -> LoadedEpisode:
    """The episode's JPEGs kept in the frame store (when one is configured), each once by its hash."""
    if services.frame_store is None:
        return loaded
    frames, info = loaded.frames, loaded.info
    extra = frames.extra.jpegs if frames.extra is not None else []
    stored = await services.frame_store.put([*frames.jpegs, *frames.stills, *extra],
                                            [*info.sha256, *info.still_sha256,
                                             *(info.extra_view.sha256 if info.extra_view else [])])
    return LoadedEpisode(frames, loaded.fps, info, stored.record())


async def load_episode(services: Services, request: ScoreRequest, cfg: BackendConfig, limits: FrameLimits,
                       requested: int) -> LoadedEpisode:
    """Decode, describe and store one episode's frames."""
    frames = await decode_episode(services, request, cfg, limits)
    return await store_frames(services, describe_frames(request, cfg, frames, requested))
