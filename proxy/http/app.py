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

from proxy.config import Settings
from proxy.errors import ConfigError, ProxyError
from proxy.http import admin_routes, openai_routes, ops_routes, progress_routes, score_routes
from proxy.http.admin_access import Credentials
from proxy.http.binary_body import BinaryBody
from proxy.http.edge import Edge, ShutdownGate
from proxy.http.error_answers import install_handlers
from proxy.http.openapi import install_openapi
from proxy.media.file import prepare_media_roots
from proxy.metrics import Metrics
from proxy.pipelines.compare import Comparer
from proxy.pipelines.passthrough import ChatPassthrough
from proxy.pipelines.services import open_services
from proxy.progress.pipeline import ProgressScorer
from proxy.progress.reference_store import ReferenceStore
from proxy.prompting.templates import PromptStore
from proxy.upstream.backends import BackendRegistry
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
    """The scoring, admin and run keys (proxy/http/admin_access.py), each named variable set, all different."""
    proxy = settings.proxy
    for key, env in (("api_key_env", proxy.api_key_env), ("admin_api_key_env", proxy.admin_api_key_env),
                     *((f"run_keys[{i}].key_env", k.key_env) for i, k in enumerate(proxy.run_keys))):
        if env and not os.environ.get(env):
            raise ConfigError(f"proxy.{key} names {env!r}, which is unset or empty")
    run_keys = tuple((value, entry.scope) for value, entry in settings.proxy_run_keys() if value is not None)
    try:
        return Credentials(settings.proxy_api_key(), settings.proxy_admin_key(), run_keys)
    except ValueError as err:
        raise ConfigError(f"proxy keys: {err}; give each key its own value") from err


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
            services = await open_services(settings, prompts, metrics, stack)
            prober = Prober(services.registry, await stack.enter_async_context(open_probe_client()),
                            interval_s=settings.proxy.health_interval_s, timeout_s=settings.proxy.health_timeout_s)
            references = ReferenceStore(settings.proxy.reference_store) if settings.proxy.reference_store else None
            if references is not None:
                await asyncio.to_thread(references.open)
            app.state.services = services
            app.state.settings, app.state.prober, app.state.gate = settings, prober, gate
            app.state.comparer = Comparer(services)
            app.state.passthrough = ChatPassthrough(services)
            app.state.progress = ProgressScorer(services, references)
            await prober.run_once()  # /health is true from the first request on
            _warn_unready(prober, services.registry)
            stop_probing = asyncio.Event()
            probing = asyncio.create_task(prober.run_until(stop_probing))
            try:
                yield
            finally:
                stop_probing.set()
                await probing

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

