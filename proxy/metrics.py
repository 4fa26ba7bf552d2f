"""Prometheus metrics: one registry per app (no globals), every series the proxy exports."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vlm_protocol.errors import CODES

_SCORE_BUCKETS = tuple(i / 10 for i in range(1, 11))
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ENDPOINT_STATES = ("ready", "open", "draining")  # proxy.upstream.pool.Endpoint.rotation()
ENDPOINT_CHANGES = ("added", "removed")
TIMEOUT_CAUSES = ("deadline", "timeout")  # vlm_proxy_upstream_timeouts_total (proxy.upstream.backends)


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
        self.relay_bounded = Counter("vlm_proxy_relay_bounded_total",
                                     "Pass-through requests with media and no mm_processor_kwargs, sent with the "
                                     "backend's max_pixels cap added (x-vlm-proxy-bound)", ["backend"], registry=r)
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
        # Live reward quality per (run, backend, task) over the rolling window (proxy/quality/): the
        # same numbers as `report`; labels bounded by quality.max_keys.
        key = ["run", "backend", "task"]
        self.quality_episodes = Gauge("vlm_proxy_quality_episodes", "Episodes with env_success in the window",
                                      key, registry=r)
        self.quality_auc = Gauge("vlm_proxy_quality_auc", "ROC-AUC of score vs env_success in the window "
                                 "(NaN without both outcomes)", key, registry=r)
        self.quality_accuracy = Gauge("vlm_proxy_quality_accuracy", "Accuracy at quality.success_threshold in "
                                      "the window", key, registry=r)
        self.quality_false_success_rate = Gauge("vlm_proxy_quality_false_success_rate", "Share of env failures "
                                                "the reward calls a success, in the window", key, registry=r)
        self.quality_mean_score = Gauge("vlm_proxy_quality_mean_score", "Mean score by env outcome in the window",
                                        [*key, "outcome"], registry=r)
        self.quality_parse_failures = Gauge("vlm_proxy_quality_parse_failures", "Episodes in the window whose "
                                            "reply did not parse", key, registry=r)
        self.quality_alarm = Gauge("vlm_proxy_quality_alarm", "1 while the key's reward disagrees with success "
                                   "beyond quality.alarm's bounds", key, registry=r)
        self.quality_transitions = Counter("vlm_proxy_quality_alarm_transitions_total", "Alarms raised (to=alarm) "
                                           "and cleared (to=ok)", ["backend", "to"], registry=r)
        self.quality_probe_margin = Gauge("vlm_proxy_quality_probe_margin", "Mean (original - probe) score of the "
                                          "key's invariance probes by kind", [*key, "probe"], registry=r)
        self.quality_probe_inversions = Gauge("vlm_proxy_quality_probe_inversion_rate", "Share of the key's probes "
                                              "scoring at least the original", [*key, "probe"], registry=r)
        self.quality_probes = Counter("vlm_proxy_quality_probes_total", "Invariance probes by kind and outcome: "
                                      "scored, dropped_busy (the backend had no room to spare), dropped_cap "
                                      "(probes.max_in_flight), no_other_task, or the error code",
                                      ["backend", "probe", "outcome"], registry=r)
        self.cascade_escalations = Counter("vlm_proxy_cascade_escalations_total", "Episodes past each cascade stage "
                                           "by why they went on (band, disagree, audit) or none (they stopped "
                                           "there)", ["cascade", "stage", "why"], registry=r)
        self.cascade_audits = Counter("vlm_proxy_cascade_audits_total", "Audited episodes by whether the cheap "
                                      "stage landed on the other side of the threshold from the final stage "
                                      "(disagree) or not (agree)", ["cascade", "stage", "outcome"], registry=r)
        # A cascade's window per (run, cascade, task) and stage (proxy/quality/cascade_window.py).
        self.cascade_escalation_rate = Gauge("vlm_proxy_cascade_escalation_rate", "Share of the window's episodes "
                                             "reaching the stage that went on (band, disagree or audit)",
                                             [*key, "stage"], registry=r)
        self.cascade_audit_disagreement_rate = Gauge(
            "vlm_proxy_cascade_audit_disagreement_rate", "Share of the window's audited episodes where the stage "
            "lies across the cascade's threshold from the final stage (NaN without an audit)", [*key, "stage"],
            registry=r)
        self.cascade_window_audits = Gauge("vlm_proxy_cascade_window_audits", "Audited episodes of the stage in "
                                           "the window (what the disagreement rate rests on)", [*key, "stage"],
                                           registry=r)
        self.quality_keys_evicted = Counter("vlm_proxy_quality_keys_evicted_total", "Keys forgotten to make room "
                                            "for a new one (the least recently seen not in alarm)", registry=r)
        self.quality_keys_dropped = Counter("vlm_proxy_quality_keys_dropped_total", "Episodes not tracked: "
                                            "quality.max_keys keys are tracked, every one in alarm", registry=r)

    def observe_endpoints(self, backend: str, endpoints: Iterable[Any]) -> None:
        """The gauges of one backend's endpoints (proxy.upstream.pool.Endpoint), on a change and at each
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
