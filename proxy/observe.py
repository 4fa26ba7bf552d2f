"""Prometheus metrics (one registry per app, no globals) and the JSONL audit log.

The audit log never touches the disk on the event loop: `write` only puts the line on a bounded
queue; one writer thread appends, and rotates by size. A line that cannot be queued (the disk
cannot keep up) or written (an OS error) is counted, logged and shown on /health, and the score is
answered all the same: the log serves the report, never the reward.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vlm_protocol.errors import CODES

_SCORE_BUCKETS = tuple(i / 10 for i in range(1, 11))
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ENDPOINT_STATES = ("ready", "open", "draining")  # proxy.pool.Endpoint.rotation()
ENDPOINT_CHANGES = ("added", "removed")
TIMEOUT_CAUSES = ("deadline", "timeout")  # vlm_proxy_upstream_timeouts_total (proxy.backends)
log = logging.getLogger("vlm_reward_proxy.audit")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vlm_proxy_requests_total",
                                "HTTP requests by route, backend ('none' if unresolved) and outcome "
                                "(ok or the error code)", ["route", "backend", "outcome"], registry=r)
        self.episodes = Counter("vlm_proxy_episodes_total", "Episodes scored (batch items included) by "
                                "outcome (ok or the error code)", ["backend", "outcome"], registry=r)
        self.replies = Counter("vlm_proxy_replies_total", "Model replies by finish_reason "
                               "('length' = cut at max_tokens)", ["backend", "finish_reason"], registry=r)
        self.tokens = Counter("vlm_proxy_tokens_total", "Tokens vLLM reported (usage)",
                              ["backend", "kind"], registry=r)
        self.upstream_calls = Counter("vlm_proxy_upstream_calls_total",
                                      "Calls to vllm serve by endpoint and result",
                                      ["backend", "endpoint", "result"], registry=r)
        self.upstream_timeouts = Counter("vlm_proxy_upstream_timeouts_total",
                                         "Upstream calls that timed out (also in upstream_calls_total as "
                                         "upstream_timeout) by cause: timeout (the full per-call timeout_s, or "
                                         "no connection: held against the replica's circuit) or deadline (the "
                                         "caller's budget or the request's deadline cut the wait short: never "
                                         "held against it)", ["backend", "endpoint", "cause"], registry=r)
        self.parse_failures = Counter("vlm_proxy_parse_failures_total",
                                      "Replies without the declared answer", ["backend"], registry=r)
        self.scores = Histogram("vlm_proxy_score", "Scores returned (0..1)", ["backend"],
                                buckets=_SCORE_BUCKETS, registry=r)
        self.latency = Histogram("vlm_proxy_request_seconds", "Whole /score time", ["backend"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("vlm_proxy_stage_seconds", "Time per pipeline stage", ["stage"],
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("vlm_proxy_queue_wait_seconds",
                                    "Wait for a free endpoint slot (admission queue)", ["backend"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("vlm_proxy_queue_length", "Requests waiting for an endpoint slot",
                                  ["backend"], registry=r)
        self.endpoint_in_flight = Gauge("vlm_proxy_endpoint_in_flight", "Requests in flight per endpoint",
                                        ["backend", "endpoint"], registry=r)
        self.circuit_open = Gauge("vlm_proxy_circuit_open", "1 while an endpoint is out of rotation",
                                  ["backend", "endpoint"], registry=r)
        self.endpoints = Gauge("vlm_proxy_endpoints", "Endpoints of a backend by state: ready (in rotation), "
                               "open (circuit open or half-open), draining (removed at run time, calls "
                               "still in flight)", ["backend", "state"], registry=r)
        self.endpoint_changes = Counter("vlm_proxy_endpoint_changes_total", "Endpoints added and removed at run "
                                        "time (POST /admin/endpoints; a removal counts when asked, the "
                                        "endpoint leaves once drained)", ["backend", "change"], registry=r)
        self._endpoint_series: dict[str, set[str]] = {}  # backend -> endpoints with per-endpoint series
        self.routed = Gauge("vlm_proxy_routed_calls", "Upstream calls by routing decision since start: affinity "
                            "(the group's replica), spilled (a group's call sent elsewhere: load bound or down), "
                            "least_outstanding (no group, or routing.policy least_outstanding)",
                            ["backend", "decision"], registry=r)
        self.in_flight = Gauge("vlm_proxy_in_flight", "Scoring requests in progress", ["backend"],
                               registry=r)
        self.comparisons = Counter("vlm_proxy_comparisons_total", "Comparisons (POST /compare, batch items "
                                   "included) by outcome: the label (0, 1, -1) or the error code",
                                   ["backend", "outcome"], registry=r)
        self.compare_latency = Histogram("vlm_proxy_compare_seconds", "Whole /compare time", ["backend"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.progress_episodes = Counter("vlm_proxy_progress_episodes_total", "Episodes of POST /progress/batch "
                                         "by outcome: success, progress, no_reference, or the error code",
                                         ["backend", "outcome"], registry=r)
        self.progress = Histogram("vlm_proxy_progress", "Progress of failed episodes (0..1)", ["backend"],
                                  buckets=_SCORE_BUCKETS, registry=r)
        self.reference_refusals = Counter("vlm_proxy_reference_store_refusals_total",
                                          "References the store did not keep, by code (reference_keys_full: "
                                          "a new namespace/task beyond reference_store.max_keys) and route",
                                          ["code", "route"], registry=r)
        self.frame_store_bytes = Gauge("vlm_proxy_frame_store_bytes", "Bytes held by the frame store",
                                       registry=r)
        self.frame_store_errors = Counter("vlm_proxy_frame_store_errors_total",
                                          "Episodes whose frames the store could not keep (full, os_error)",
                                          ["reason"], registry=r)
        self.audit_dropped = Counter("vlm_proxy_audit_dropped_total", "Audit lines lost: queue_full (the disk "
                                     "did not keep up) or os_error (writing failed); the score was answered",
                                     ["reason"], registry=r)
        self.audit_queued = Gauge("vlm_proxy_audit_queued", "Audit lines waiting for the writer thread", registry=r)

    def observe_endpoints(self, backend: str, endpoints: Iterable[Any]) -> None:
        """The gauges of one backend's endpoints (proxy.pool.Endpoint), on a change and at each
        scrape; the per-endpoint series of endpoints that left the pool are dropped."""
        endpoints = list(endpoints)
        present = {e.base_url for e in endpoints}
        for url in self._endpoint_series.get(backend, set()) - present:
            self.forget_endpoint(backend, url)
        self._endpoint_series[backend] = present
        for endpoint in endpoints:
            self.endpoint_in_flight.labels(backend, endpoint.base_url).set(endpoint.in_flight)
            self.circuit_open.labels(backend, endpoint.base_url).set(int(endpoint.circuit_open))
        states = collections.Counter(e.rotation() for e in endpoints)
        for state in ENDPOINT_STATES:
            self.endpoints.labels(backend, state).set(states[state])
        for change in ENDPOINT_CHANGES:  # present from the first scrape, at 0
            self.endpoint_changes.labels(backend, change)

    def forget_endpoint(self, backend: str, url: str) -> None:
        """Drop every series naming an endpoint that left the pool (removed at run time): /metrics
        stays bounded however many endpoints come and go. Its calls leave the per-endpoint
        counters with it; vlm_proxy_requests_total and the per-backend series keep counting them."""
        for gauge in (self.endpoint_in_flight, self.circuit_open):
            with contextlib.suppress(KeyError):
                gauge.remove(backend, url)
        for counter, values in ((self.upstream_calls, ("ok", *CODES)), (self.upstream_timeouts, TIMEOUT_CAUSES)):
            for value in values:  # every label value it can hold: prometheus_client lists none
                with contextlib.suppress(KeyError):
                    counter.remove(backend, url, value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_STOP = object()  # tells the writer thread to end, after every line queued before it


class AuditLog:
    """One JSON line per scored (or failed) episode. No media: hashes only.

    `write` (on the loop) serialises and queues the line, never blocking; the writer thread
    appends it and rotates the file past `max_bytes` (file -> file.1 -> ... -> file.<keep>, the
    oldest deleted). `flush` waits until every line queued so far is on disk (the kernel's, not
    fsync'd); `close` flushes and ends the thread (the app's lifespan, at a clean stop)."""

    def __init__(self, path: Path | None, *, max_bytes: int | None = None, keep: int = 10,
                 queue_lines: int = 10_000, metrics: Metrics | None = None) -> None:
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self._metrics = metrics
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_lines)
        self.written = 0
        self.dropped: collections.Counter[str] = collections.Counter()  # reason -> lines
        self.error: str | None = None  # the last write failure, until a write succeeds
        self._thread: threading.Thread | None = None
        self._fh: Any = None  # the writer thread's own: the open file and its size
        self._size = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
            self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        if self._thread is None:
            return
        line = json.dumps({"ts": round(time.time(), 3), **record}, separators=(",", ":")) + "\n"
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self._drop("queue_full", 1, f"the writer is {self._queue.maxsize} lines behind (audit.queue_lines)")

    def status(self) -> dict[str, Any]:
        """/health's `audit` entry."""
        return {"path": str(self.path), "queued": self._queue.qsize(), "written": self.written,
                "dropped": sum(self.dropped.values()), "dropped_by_reason": dict(self.dropped), "error": self.error}

    def flush(self) -> None:
        """Block until every line queued before this call was written (or counted as dropped)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then end the writer thread. Blocking: call it off the loop."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def _drop(self, reason: str, lines: int, why: str) -> None:
        if not self.dropped[reason]:
            log.error("audit log %s: %s; lost lines are counted (vlm_proxy_audit_dropped_total, /health)",
                      self.path, why)
        self.dropped[reason] += lines
        if self._metrics is not None:
            self._metrics.audit_dropped.labels(reason).inc(lines)

    def _run(self) -> None:
        try:
            while True:
                batch = [self._queue.get()]
                while batch[-1] is not _STOP:  # take what else is waiting
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                lines, before = [line for line in batch if line is not _STOP], self.written
                try:
                    self._append(lines)
                except OSError as err:
                    self.error = f"{type(err).__name__}: {err}"
                    self._drop("os_error", len(lines) - (self.written - before), f"writing failed ({self.error})")
                    self._close_file()  # opened afresh for the next line
                finally:
                    for _ in batch:
                        self._queue.task_done()
                if self._metrics is not None:
                    self._metrics.audit_queued.set(self._queue.qsize())
                if batch[-1] is _STOP:
                    return
        finally:
            self._close_file()

    def _append(self, lines: list[str]) -> None:
        if not lines:
            return
        fh = self._current()
        for line in lines:
            data = line.encode()
            if self.max_bytes is not None and self._size and self._size + len(data) > self.max_bytes:
                self._close_file()
                self._rotate()
                fh = self._current()
            fh.write(data)  # unbuffered: a line counted as written is in the file
            self._size += len(data)
            self.written += 1
        self.error = None

    def _current(self) -> Any:
        """The open file; opened afresh when it was moved or deleted (an outside rotator's doing)."""
        assert self.path is not None
        if self._fh is not None:
            try:
                moved = os.stat(self.path).st_ino != os.fstat(self._fh.fileno()).st_ino
            except OSError:
                moved = True
            if moved:
                self._close_file()
        if self._fh is None:
            self._fh = self.path.open("ab", buffering=0)
            self._size = os.fstat(self._fh.fileno()).st_size
        return self._fh

    def _close_file(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None

    def _rotate(self) -> None:
        """file -> file.1, file.1 -> file.2, ...; file.<keep> is deleted (readers: reports/audit_lines.py)."""
        assert self.path is not None
        rotated = [self.path.with_name(f"{self.path.name}.{n}") for n in range(self.keep + 1)]
        rotated[0] = self.path
        rotated[-1].unlink(missing_ok=True)
        for n in range(self.keep - 1, -1, -1):
            if rotated[n].exists():
                rotated[n].replace(rotated[n + 1])
