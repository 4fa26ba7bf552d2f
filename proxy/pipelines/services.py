"""The app's collaborators in one plain container, and the function that opens them.

Every pipeline takes a `Services` and uses only what it needs; nothing reaches through another
pipeline to find a collaborator. `open_services` opens what needs the event loop (the aiohttp
session, the frame store, the audit log's writer thread, the media threads and decoder processes) on an exit stack, so
they close in reverse order when the app stops: the monitor's last lines before the audit log.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from proxy.audit import AuditLog
from proxy.config import Settings
from proxy.media.budget import MediaCaps, default_media_workers
from proxy.media.executor import MediaExecutor
from proxy.media.frame_store import FrameStore
from proxy.metrics import Metrics
from proxy.prompting.templates import PromptStore
from proxy.quality.monitor import QualityMonitor
from proxy.quality.probes import InvarianceProbes
from proxy.upstream.answer_tokens import AnswerTokenIds
from proxy.upstream.backends import BackendRegistry
from proxy.upstream.client import UpstreamClient, open_session

__all__ = ["Services", "open_services"]


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
    stack.callback(quality.close)  # its `reset` lines, before the audit log closes
    probes = None
    if settings.quality.enabled and settings.quality.probes.fraction > 0:
        probes = InvarianceProbes(settings.quality.probes, quality, metrics)
        stack.push_async_callback(probes.close)  # before the audit log closes
    return Services(settings=settings, registry=BackendRegistry(settings), prompts=prompts, upstream=upstream,
                    metrics=metrics, audit=audit, media=media, quality=quality,
                    answer_tokens=AnswerTokenIds(upstream), frame_store=frame_store, probes=probes)
