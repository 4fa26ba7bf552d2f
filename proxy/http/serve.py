"""`vlm-reward-proxy serve`: run the app under uvicorn with a bounded shutdown (edge.py's ShutdownGate)."""

from __future__ import annotations

import asyncio
import gc
import logging

import uvicorn

from proxy.config import Settings
from proxy.config.launch import is_loopback
from proxy.errors import ConfigError
from proxy.http.app import create_app

log = logging.getLogger("vlm_reward_proxy")

# Longer than clients' own idle expiry (httpx: 5 s), so a client never reuses a connection the
# proxy is closing; RLinf sends bursts at episode ends with quiet gaps between them.
KEEP_ALIVE_S = 75


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on the first SIGTERM/SIGINT also opens the app's shutdown gate."""

    def __init__(self, config: uvicorn.Config, grace_s: float) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        # What is alive once the app has started (modules, app, config, clients) lives as long as
        # the process. Frozen, it is no longer rescanned by every full collection: those scans
        # were ~8% of the pass-through's wall time at c=1 (py-spy --native, docs/benchmarks.md).
        gc.collect()
        gc.freeze()

    def handle_exit(self, sig, frame) -> None:
        gate = getattr(self.config.app.state, "gate", None)  # set once the lifespan started
        if not self.should_exit and gate is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(gate.begin, self.grace_s)
        super().handle_exit(sig, frame)


def serve(settings: Settings, *, host: str | None = None, port: int | None = None,
          log_level: str = "info", access_log: bool = False) -> None:
    host = host or settings.proxy.host
    port = settings.proxy.port if port is None else port
    if not is_loopback(host) and not settings.proxy_api_key() and not settings.proxy.run_keys:
        raise ConfigError(f"refusing to listen on {host}, beyond loopback, without a bearer token: set "
                          "proxy.api_key_env (or proxy.run_keys) to an environment variable holding one")
    app = create_app(settings)
    grace = settings.proxy.shutdown_grace_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=KEEP_ALIVE_S,
                            # a backstop only: the gate answers what is left after `grace`
                            timeout_graceful_shutdown=grace + 5)
    log.info("serving backends %s on http://%s:%d", ", ".join(settings.backends), host, port)
    _DrainingServer(config, grace).run()
