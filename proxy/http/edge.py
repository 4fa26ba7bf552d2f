"""The HTTP edge: one plain ASGI middleware around the whole app.

For every request it sets a request id (the caller's x-request-id, or a new one) on the response
and in any error body, checks the bearer token when one is configured (every route but /health;
the caller's role is noted for AdminOnly, a limited key's runs for run_access), caps the body
(refused on its Content-Length, or as soon as a streamed body crosses the cap), counts the answer
by route, backend and outcome, turns an unexpected exception into a logged `internal_error`, and
enforces the shutdown gate. It is
plain ASGI because `@app.middleware("http")` costs a measurable share of the pass-through's CPU
(docs/benchmarks.md, profiles).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.errors import PayloadTooLarge, ProxyError, ShuttingDown, Unauthorized
from proxy.http.admin_access import Credentials
from proxy.http.error_answers import error_response
from proxy.metrics import Metrics

log = logging.getLogger("vlm_reward_proxy")

OPEN_PATHS = frozenset({"/health"})  # reachable without the bearer token (load balancers, `up`)


def request_id_of(headers: dict[bytes, bytes]) -> str:
    given = headers.get(b"x-request-id")
    return given.decode("latin-1")[:64] if given else uuid.uuid4().hex[:16]


class ShutdownGate:
    """Bounded shutdown: on SIGTERM/SIGINT the proxy stops taking requests, gives the ones in flight
    `proxy.shutdown_grace_s`, then answers what is left with 503 `shutting_down` and exits.

    uvicorn alone waits for in-flight requests as long as they take (one slow upstream call held a
    process 58 s after SIGTERM) or, with its own timeout, drops them without an answer. `Edge`
    registers each request with the gate; `serve` begins the drain from uvicorn's signal handler."""

    def __init__(self) -> None:
        self.draining = False  # new requests are refused
        self.expired = False  # the grace period is over: requests still running are cut
        self._tasks: set[asyncio.Task] = set()

    def track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)

    def untrack(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)

    def begin(self, grace_s: float) -> None:
        """Start draining (on the event loop's thread)."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: %d request(s) in flight get %.1fs to finish", len(self._tasks), grace_s)
        asyncio.get_running_loop().call_later(grace_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self._tasks:
            log.warning("grace period over: answering %d unfinished request(s) with 503 shutting_down",
                        len(self._tasks))
        for task in list(self._tasks):
            task.cancel()

    def owns_cancellation(self, task: asyncio.Task) -> bool:
        """Was `task` cancelled by the gate (rather than by its client or the server)?"""
        return self.expired and task in self._tasks


class Edge:
    def __init__(self, app: ASGIApp, *, max_bytes: int, metrics: Metrics, gate: ShutdownGate,
                 routes: frozenset[str], credentials: Credentials | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.metrics, self.gate, self.routes = metrics, gate, routes
        self.credentials = credentials or Credentials()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = request_id_of(headers)
        state = scope.setdefault("state", {})  # read back as request.state
        state["request_id"] = request_id
        # A limited key's runs (proxy/http/run_access.py); None for every other caller.
        state["role"], state["runs"] = self.credentials.caller_of(headers.get(b"authorization", b""))
        route = scope["path"] if scope["path"] in self.routes else "unmatched"
        started = refused = False
        id_header = (b"x-request-id", request_id.encode("latin-1"))

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:  # the cap answered already: what the app sends after that is dropped
                return
            if message["type"] == "http.response.start":
                started = True
                outcome = state.get("error_code") or ("ok" if message["status"] < 400 else f"http_{message['status']}")
                self.metrics.requests.labels(route=route, backend=state.get("backend", "none"), outcome=outcome).inc()
                if not any(k.lower() == b"x-request-id" for k, _ in message.get("headers", ())):
                    message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        async def answer(err: ProxyError) -> None:
            await error_response(err, scope)(scope, receive, guarded_send)

        refusal = self._refusal(scope["path"], state["role"], headers.get(b"content-length"))
        if refusal is not None:
            return await answer(refusal)
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes and not started:
                await answer(self._too_large())
                refused = True
                return {"type": "http.disconnect"}
            return message

        task = asyncio.current_task()
        self.gate.track(task)
        try:
            await self.app(scope, limited_receive, guarded_send)
        except asyncio.CancelledError:
            if not self.gate.owns_cancellation(task):
                raise
            task.uncancel()  # the gate cut it: the request gets its 503, the server goes on
            if not started:
                await answer(ShuttingDown("the proxy shut down before this request finished "
                                          "(grace period over); nothing was scored"))
        except Exception as exc:  # noqa: BLE001 - the catch-all: one shape for every answer
            log.exception("unexpected error on %s %s (request %s)", scope.get("method"), scope["path"], request_id)
            if not started:
                await answer(ProxyError(f"internal error ({type(exc).__name__}); the proxy log has the "
                                        f"traceback under request id {request_id}"))
        finally:
            self.gate.untrack(task)

    def _refusal(self, path: str, role: str | None, declared: bytes | None) -> ProxyError | None:
        """Why a request is refused before its body is read, if it is."""
        if self.gate.draining and path not in OPEN_PATHS:
            return ShuttingDown("the proxy is shutting down; send this request again to another instance or after "
                                "it restarts")
        if self.credentials.scoring_required and role is None and path not in OPEN_PATHS:
            return Unauthorized("missing or wrong bearer token")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body is over the {self.max_bytes / 2**20:g} MiB cap (proxy.max_body_mb)")
