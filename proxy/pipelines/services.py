"""The app's collaborators in one plain container, and the function that opens them.

Every pipeline takes a `Services` and uses only what it needs; nothing reaches through another
pipeline to find a collaborator. `open_services` opens what needs the event loop (the aiohttp
session, the frame store, the audit log's writer thread, the media threads and decoder processes) on an exit stack, so
they close in reverse order when the app stops: the monitor's last lines before the audit log.
With an audit log, the monitor's windows are rebuilt from its tail before the app serves
(proxy/quality/restore.py, on a worker thread, bounded by quality.restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from proxy.audit import AuditLog
from proxy.config import Settings
from proxy.media.budget import MediaCaps, default_media_workers
from proxy.media.executor import MediaExecutor
from proxy.media.frame_store import FrameStore
from proxy.metrics import Metrics
from proxy.pipelines.cascade_state import CascadeState
from proxy.prompting.templates import PromptStore
from proxy.quality.monitor import QualityMonitor
from proxy.quality.probes import InvarianceProbes
from proxy.quality.restore import rebuild
from proxy.upstream.answer_tokens import AnswerTokenIds
from proxy.upstream.backends import BackendRegistry
from proxy.upstream.client import UpstreamClient, open_session

__all__ = ["Services", "open_services"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Services:
    settings: Settings
    registry: BackendRegistry
    prompts: PromptStore
    upstream: UpstreamClient
    metrics: Metrics
    audit: AuditLog
    media: MediaExecutor  # the bounded media threads (and video decoder processes): every decode and encode
    quality: QualityMonitor  # agreement with env_success per (run, backend, task), and the alarm
    answer_tokens: AnswerTokenIds  # a probability answer's two words as token ids, per endpoint
    frame_store: FrameStore | None = None
    probes: InvarianceProbes | None = None  # when quality.probes.fraction > 0
    cascades: dict[str, CascadeState] = field(default_factory=dict)  # by name: each cascade's budget and timings


async def open_services(settings: Settings, prompts: PromptStore, metrics: Metrics,
                        stack: contextlib.AsyncExitStack) -> Services:
    upstream = UpstreamClient(await stack.enter_async_context(open_session()))
    proxy = settings.proxy
    frame_store = FrameStore(proxy.frame_store, metrics) if proxy.frame_store else None
    if frame_store is not None:
        await asyncio.to_thread(frame_store.open)
        stack.callback(frame_store.close)
    audit = AuditLog(proxy.audit_log, max_bytes=int(proxy.audit.max_mb * 2**20), keep=proxy.audit.keep,
                     queue_lines=proxy.audit.queue_lines, metrics=metrics)
    stack.push_async_callback(asyncio.to_thread, audit.close)  # a clean stop writes every queued line
    media = MediaExecutor(proxy.media_workers or default_media_workers(), MediaCaps(
        int(proxy.max_decoded_mb * 2**20), proxy.max_video_frames, proxy.max_video_seconds),
        proxy.video_decoders if proxy.video_decoders.isolated else None)
    stack.push_async_callback(asyncio.to_thread, media.close)  # waits for its threads: off the loop
    quality = QualityMonitor(settings.quality, metrics, audit)
    if proxy.audit_log is not None and settings.quality.enabled and settings.quality.restore.enabled:
        await restore_monitor(quality, settings)
    stack.callback(quality.close)  # its `reset` lines, before the audit log closes
    probes = None
    if settings.quality.enabled and settings.quality.probes.fraction > 0:
        probes = InvarianceProbes(settings.quality.probes, quality, metrics)
        stack.push_async_callback(probes.close)  # before the audit log closes
    return Services(settings=settings, registry=BackendRegistry(settings), prompts=prompts, upstream=upstream,
                    metrics=metrics, audit=audit, media=media, quality=quality,
                    answer_tokens=AnswerTokenIds(upstream), frame_store=frame_store, probes=probes,
                    cascades={name: CascadeState(name, cfg) for name, cfg in settings.cascades.items()})


async def restore_monitor(quality: QualityMonitor, settings: Settings) -> None:
    """The monitor as the audit log left it: read on a worker thread (a large log takes seconds),
    adopted on the loop. A log that cannot be read starts the monitor empty, and /quality says why."""
    path = settings.proxy.audit_log
    assert path is not None
    try:
        restored = await asyncio.to_thread(rebuild, path, settings.quality)
    except OSError as err:
        log.warning("reward quality: the audit log %s could not be read back (%s); every window starts empty",
                    path, err)
        quality.restore = {"restored": False, "reason": f"reading {path} failed: {type(err).__name__}: {err}"}
        return
    quality.adopt(restored.windows, restored.sources, restored.describe(), restored.cascades)
    described = restored.describe()
    log.info("reward quality: %d window(s) (%d in alarm) restored from %d line(s) of %s in %.2f s (stopped by %s)",
             described["keys"], described["alarms"], restored.lines, path, restored.seconds, restored.stopped_by)
