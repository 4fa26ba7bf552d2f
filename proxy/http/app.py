"""`create_app(settings)`: the FastAPI app, wired from plain objects. Routes are in the *_routes.py
modules beside it (one per surface), the error mapping in error_answers.py, the edge concerns in edge.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from proxy.audit import AuditLog
from proxy.config import Settings
from proxy.errors import ConfigError, ProxyError
from proxy.http import admin_routes, openai_routes, ops_routes, progress_routes, score_routes
from proxy.http.admin_access import Credentials
from proxy.http.binary_body import BinaryBody
from proxy.http.edge import Edge, ShutdownGate
from proxy.http.error_answers import install_handlers
from proxy.http.openapi import install_openapi
from proxy.media.budget import MediaCaps, MediaExecutor, default_media_workers
from proxy.media.file import prepare_media_roots
from proxy.media.frame_store import FrameStore
from proxy.metrics import Metrics
from proxy.pipelines.compare import Comparer
from proxy.pipelines.passthrough import ChatPassthrough
from proxy.pipelines.probes import InvarianceProbes
from proxy.pipelines.scoring import Scorer
from proxy.progress.embedding import Embedder
from proxy.progress.pipeline import ProgressScorer
from proxy.progress.reference_store import ReferenceStore
from proxy.prompting.templates import PromptStore
from proxy.quality.monitor import QualityMonitor
from proxy.upstream.backends import BackendRegistry
from proxy.upstream.client import UpstreamClient, open_session
from proxy.upstream.health import Prober, open_probe_client

log = logging.getLogger("vlm_reward_proxy")
_ROUTES = (score_routes, openai_routes, ops_routes, admin_routes, progress_routes)  # one per surface


def _check_prompts(settings: Settings, prompts: PromptStore) -> None:
    for name, backend in settings.backends.items():
        if backend.prompt is None:  # an embedding backend without text
            continue
        try:
            template = prompts.get(backend.prompt)
        except ProxyError as err:
            raise ConfigError(f"backends.{name}.prompt: {err.message}") from err
        if backend.kind == "chat" and (backend.layout == "shuffled_images") != bool(template.answer.per_frame):
            raise ConfigError(f"backends.{name}: prompt {backend.prompt!r} and layout {backend.layout!r} do not fit: "
                              "a per_frame answer (one value per shown frame) goes with layout shuffled_images, "
                              "and only it")


def _warn_unready(prober: Prober, registry: BackendRegistry) -> None:
    """One WARNING per backend nobody serves yet, with the next step."""
    for backend in registry.backends.values():
        results = [prober.readiness(backend.name, e.base_url) for e in backend.pool.endpoints]
        if not any(r.ready for r in results):
            log.warning("backend %r is not reachable yet (%s). Start its vLLM servers "
                        "(`vlm-reward-proxy up --config …` or launchers/), or run `make demo` to try "
                        "the proxy without a GPU; /health shows when it becomes ready.", backend.name,
                        "; ".join(f"{e.base_url}: {r.reason}" for e, r in zip(backend.pool.endpoints, results,
                                                                               strict=True)))


def _credentials(settings: Settings) -> Credentials:
    """The scoring and admin keys (proxy/http/admin_access.py), each named variable set, the two different."""
    proxy = settings.proxy
    for key, env in (("api_key_env", proxy.api_key_env), ("admin_api_key_env", proxy.admin_api_key_env)):
        if env and not os.environ.get(env):
            raise ConfigError(f"proxy.{key} names {env!r}, which is unset or empty")
    try:
        return Credentials(settings.proxy_api_key(), settings.proxy_admin_key())
    except ValueError as err:
        raise ConfigError(f"proxy.admin_api_key_env: {err}; give the admin its own key") from err


def create_app(settings: Settings) -> FastAPI:
    prompts = PromptStore(settings.proxy.prompts_dir)
    _check_prompts(settings, prompts)
    # Every video_path is checked against the roots' real paths as they are now, at start-up.
    roots = prepare_media_roots(settings.proxy.allowed_media_roots)
    settings = settings.model_copy(update={"proxy": settings.proxy.model_copy(update={"allowed_media_roots": roots})})
    for warning in settings.warnings():
        log.warning(warning)
    credentials = _credentials(settings)
    metrics = Metrics()
    gate = ShutdownGate()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            upstream = UpstreamClient(await stack.enter_async_context(open_session()))
            probe_client = await stack.enter_async_context(open_probe_client())
            registry = BackendRegistry(settings)
            prober = Prober(registry, probe_client, interval_s=settings.proxy.health_interval_s,
                            timeout_s=settings.proxy.health_timeout_s)
            app.state.settings = settings
            app.state.metrics = metrics
            app.state.registry = registry
            app.state.prober = prober
            app.state.gate = gate
            frame_store = FrameStore(settings.proxy.frame_store, metrics) if settings.proxy.frame_store else None
            if frame_store is not None:
                await asyncio.to_thread(frame_store.open)
            app.state.frame_store = frame_store
            audit_cfg = settings.proxy.audit
            audit = AuditLog(settings.proxy.audit_log, max_bytes=int(audit_cfg.max_mb * 2**20), keep=audit_cfg.keep,
                             queue_lines=audit_cfg.queue_lines, metrics=metrics)
            stack.push_async_callback(asyncio.to_thread, audit.close)  # a clean stop writes every queued line
            app.state.audit = audit
            proxy_cfg = settings.proxy  # media work: the app's bounded threads, each decode within one budget
            media = MediaExecutor(proxy_cfg.media_workers or default_media_workers(), MediaCaps(
                int(proxy_cfg.max_decoded_mb * 2**20), proxy_cfg.max_video_frames, proxy_cfg.max_video_seconds))
            stack.push_async_callback(asyncio.to_thread, media.close)  # waits for its threads: off the loop
            app.state.quality = QualityMonitor(settings.quality, metrics, audit)  # live agreement, the alarm
            stack.callback(app.state.quality.close)  # its `reset` lines, before the audit log closes
            app.state.scorer = Scorer(settings, registry, prompts, upstream, metrics, audit, frame_store, media=media,
                                      quality=app.state.quality)
            if settings.quality.enabled and settings.quality.probes.fraction > 0:
                app.state.scorer.probes = InvarianceProbes(app.state.scorer, settings.quality.probes,
                                                           app.state.quality, metrics, audit)
                stack.push_async_callback(app.state.scorer.probes.close)  # before the audit log closes
            app.state.comparer = Comparer(app.state.scorer)  # /compare, on the scorer's pieces
            app.state.passthrough = ChatPassthrough(registry, upstream, metrics)
            references = ReferenceStore(settings.proxy.reference_store) if settings.proxy.reference_store else None
            if references is not None:
                await asyncio.to_thread(references.open)
            app.state.progress = ProgressScorer(Embedder(app.state.scorer), references)  # /progress/*
            await prober.run_once()  # /health is true from the first request on
            _warn_unready(prober, registry)
            stop_probing = asyncio.Event()
            probing = asyncio.create_task(prober.run_until(stop_probing))
            try:
                yield
            finally:
                stop_probing.set()
                await probing
                if frame_store is not None:
                    frame_store.close()

    app = FastAPI(title="VLM Reward Proxy", version="0.1.0", lifespan=lifespan)
    for routes in _ROUTES:
        app.include_router(routes.router)
    install_handlers(app)
    install_openapi(app, settings, prompts)
    # Added before the Edge, so inside it: the cap, auth and request id come first.
    # At most: every frame of one episode, or 32 parts per item of a full batch (and the request).
    app.add_middleware(BinaryBody, max_parts=settings.proxy.max_inline_frames + 32 * settings.proxy.max_batch_items)
    app.add_middleware(Edge, max_bytes=int(settings.proxy.max_body_mb * 2**20), metrics=metrics, gate=gate,
                       routes=frozenset(p for r in (*app.routes, *(r for m in _ROUTES for r in m.router.routes))
                                        if (p := getattr(r, "path", None))),
                       credentials=credentials)
    return app

