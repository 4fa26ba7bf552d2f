"""The real proxy app served by uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import threading
import time

import uvicorn

from proxy.config import Settings
from proxy.http.app import create_app
from proxy.http.serve import KEEP_ALIVE_S
from tests.helpers import HANG_S


class ProxyServerThread:
    def __init__(self, settings: Settings, host: str = "127.0.0.1") -> None:
        self.settings = settings
        self.app = create_app(settings)
        # loop="asyncio": uvicorn's "auto" would install uvloop's policy for the whole test process.
        config = uvicorn.Config(self.app, host=host, port=0, log_level="warning", lifespan="on",
                                access_log=False, loop="asyncio", timeout_keep_alive=KEEP_ALIVE_S)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host
        self.port: int | None = None

    def start(self) -> ProxyServerThread:
        self._thread.start()
        deadline = time.monotonic() + HANG_S
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("proxy server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)

    def flush_audit(self) -> None:
        """Return once every audit line queued so far is in the file (the writer thread is done with
        it): a test reading the log right after its requests reads them all, deterministically."""
        self.app.state.services.audit.flush()

    def __enter__(self) -> ProxyServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
