"""How calls to one backend's servers go: retries and re-asks, circuit breaking, admission and
routing (part of the one config model, proxy/config/settings.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from proxy.config.strict import PositiveInt
from proxy.config.strict import StrictModel as _Strict

__all__ = ["AdmissionConfig", "CircuitConfig", "ReaskConfig", "RetryConfig", "RoutingConfig"]


class ReaskConfig(_Strict):
    """How a re-ask after an unparseable reply differs from the first ask: it samples (temperature
    above 0, so greedy decoding cannot repeat the same reply) with seed + ask number."""

    temperature: float = Field(0.3, gt=0.0, le=2.0)
    # Not the backend's own: PRIMO-R1's top_p 0.001 would make any temperature greedy again.
    top_p: float = Field(0.95, gt=0.0, le=1.0)


class RetryConfig(_Strict):
    attempts: PositiveInt = 4  # upstream tries per ask (transport errors, 429, 5xx)
    parse_attempts: PositiveInt = 2  # asks when the reply has no score
    backoff_s: tuple[float, float] = (0.05, 5.0)  # first wait, cap; jittered exponential
    timeout_s: float = Field(120.0, gt=0)  # one upstream call
    # The whole /score, all retries included; capped further by the client's own budget.
    deadline_s: float = Field(300.0, gt=0)
    reask: ReaskConfig = ReaskConfig()

    @field_validator("backoff_s")
    @classmethod
    def _backoff_ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= v[0] <= v[1]:
            raise ValueError("backoff_s must be [first, cap] with 0 <= first <= cap")
        return v


class CircuitConfig(_Strict):
    """Take a failing endpoint out of rotation; bring it back after a cool-down or a good probe."""

    failures: PositiveInt = 5  # consecutive transport/5xx failures that open the circuit
    cooldown_s: float = Field(30.0, gt=0)  # then one trial request is let through


class AdmissionConfig(_Strict):
    max_in_flight_per_endpoint: PositiveInt = 256  # never flood one replica (vLLM max_num_seqs default)
    # Requests waiting for a free endpoint slot; beyond this the proxy answers 429 + Retry-After.
    max_queue: PositiveInt = 512


class RoutingConfig(_Strict):
    """Which replica an upstream call goes to (proxy/upstream/pool.py).

    least_outstanding: the fewest calls in flight. affinity: calls of one group — the request's
    metadata.group_id, else the first frame's hash for layouts that start with it (PRIMO-R1's
    first-frame image, the images layout) — go to the same replica (rendezvous hashing), so vLLM's
    prefix cache holds the shared "system prompt + first frame"; a replica already over
    load_factor x the average share of calls in flight + group_slack is passed over (bounded-load
    hashing), and calls without a group go to the least outstanding."""

    policy: Literal["least_outstanding", "affinity"] = "affinity"
    load_factor: float = Field(1.25, ge=1.0)
    group_slack: int = Field(8, ge=0)  # calls over the bound a replica still takes: one GRPO group
