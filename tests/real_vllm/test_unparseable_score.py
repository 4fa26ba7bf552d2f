"""Random weights and the answer constraint, on the real server.

Which outcome each test asserts (issue 12's "say which"):
* the shipped Qwen backend CONSTRAINS its reply (prompts/qwen_seed.yaml `constrain: true`, sent as
  vLLM's `structured_outputs.regex`): random weights answer a number on the 0-100 scale at the
  first ask → 200 with a score;
* the same backend with `constrain: false`, and PRIMO-R1 (a reasoning template, shipped
  unconstrained), reply random text → 502 `unparseable_score` after the shipped re-ask budget
  (retry.parse_attempts: 2 asks, 2 upstream calls), the model's last reply in the error body, and
  the re-ask sampled differently from the first ask (retry.reask: temperature above 0, top_p of its
  own, seed + 1) — as the audit log's `sampling` of the last ask shows.
"""

from __future__ import annotations

import re

import httpx
import pytest

from proxy.config import ReaskConfig
from tests.real_vllm.stack import PRIMO, QWEN, TASK, RealStack, episode_source, say, shipped_backends

pytestmark = pytest.mark.real_vllm


def _finished_requests(url: str) -> float:
    """vLLM's own count of finished requests (Prometheus, summed over its labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def test_the_shipped_constraint_gives_a_score_from_random_weights(real_stack: RealStack, http) -> None:
    run = "constrained-qwen"
    answer = http.post("/score", json={"task_text": TASK, "backend": QWEN, "nframes": 16, "metadata": {"run": run},
                                       **episode_source("mp4", 40, 224, 224, real_stack.media_root)})
    say(f"{QWEN} (constrained): {answer.status_code} {answer.text[:300]}")
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["constrained"] is True and 0.0 <= result["score"] <= 1.0, result
    record = real_stack.audit.one(run)
    assert record["asks"] == 1 and re.fullmatch(r"\d{1,3}", record["output_text"]), record
    assert int(record["output_text"]) <= 100  # the regex spells out the scale: never off it


@pytest.mark.parametrize(("backend", "kwargs"), [(QWEN, {"constrain": False}), (PRIMO, {})],
                         ids=["qwen-unconstrained", "primo-shipped"])
def test_reply_without_a_score_is_unparseable_after_the_reask(real_stack: RealStack, http, backend: str,
                                                              kwargs: dict) -> None:
    shipped = shipped_backends()[backend]
    parse_attempts = shipped["retry"]["parse_attempts"]
    assert parse_attempts == 2
    reask = ReaskConfig()  # configs/libero.yaml sets no retry.reask: the defaults apply
    run = f"unparseable-{backend}"
    primo_before = _finished_requests(real_stack.server_url("primo")) if backend == PRIMO else None

    answer = http.post("/score", json={"task_text": TASK, "backend": backend, "nframes": 16, "metadata": {"run": run},
                                       "backend_kwargs": kwargs,
                                       **episode_source("mp4", 40, 224, 224, real_stack.media_root)})
    say(f"{backend}: {answer.status_code} {answer.text[:500]}")
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unparseable_score", error
    assert error["attempts"] == parse_attempts, error  # one upstream call per ask, no transport retry
    assert f"after {parse_attempts} asks" in error["message"], error
    assert isinstance(error.get("output_text"), str) and error["output_text"].strip(), error
    assert error.get("finish_reason") in ("stop", "length"), error

    record = real_stack.audit.one(run)
    assert record["error"]["code"] == "unparseable_score" and record["asks"] == parse_attempts, record
    assert record["output_text"] == error["output_text"]  # the last reply, in both places
    first = shipped["sampling"]
    last = record["sampling"]
    say(f"{backend}: first ask T={first['temperature']} top_p={first['top_p']} seed={first['seed']}; "
        f"re-ask T={last['temperature']} top_p={last['top_p']} seed={last['seed']}")
    assert (last["temperature"], last["top_p"], last["seed"]) == (reask.temperature, reask.top_p, first["seed"] + 1)
    assert last["temperature"] != first["temperature"] and last["seed"] != first["seed"]
    assert record["usage"]["prompt_tokens"] > 0 and record["usage_all_calls"]["prompt_tokens"] == \
        parse_attempts * record["usage"]["prompt_tokens"], record
    if primo_before is not None:  # one replica: its own counter shows exactly the two calls
        assert _finished_requests(real_stack.server_url("primo")) - primo_before == parse_attempts
