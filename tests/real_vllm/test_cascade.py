"""A cascade on the real server: a P(done) stage (one token's logprobs) and a generating stage on the
same two replicas, end to end. Each episode's usage is exactly the sum of the stages it ran, as
vLLM counted them; an episode that stops at the first stage pays that stage alone."""

from __future__ import annotations

import pytest

from tests.real_vllm.stack import (
    CASCADE_ALWAYS,
    CASCADE_NEVER,
    QWEN_ONE_ASK,
    QWEN_P_DONE,
    TASK,
    RealStack,
    episode_source,
)

pytestmark = pytest.mark.real_vllm

USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def test_a_cascade_on_shared_replicas_pays_exactly_the_stages_it_ran(real_stack: RealStack, http) -> None:
    source = episode_source("npy", 24, 112, 112, real_stack.media_root)
    items = [{"task_text": TASK, "backend": cascade, "nframes": 8, **source, "metadata": {"run": f"cascade-{n}"}}
             for n, cascade in enumerate([CASCADE_ALWAYS, CASCADE_NEVER, CASCADE_ALWAYS])]
    results = http.post("/score/batch", json={"items": items}).json()["results"]
    assert all(r["ok"] for r in results), results
    for item, result in zip(items, results, strict=True):
        answer = result["result"]
        stages = answer["cascade"]["stages"]
        if item["backend"] == CASCADE_ALWAYS:
            assert [s["backend"] for s in stages] == [QWEN_P_DONE, QWEN_ONE_ASK] and stages[0]["went_on"] == "band"
            assert answer["score"] == stages[1]["score"] and answer["cascade"]["stopped"] is None
        else:
            assert [s["backend"] for s in stages] == [QWEN_P_DONE] and answer["cascade"]["stopped"] == "sure"
            assert answer["score"] == stages[0]["score"]
        assert stages[0]["usage"]["completion_tokens"] == 1  # P(done) reads one token's logprobs
        for key in USAGE:
            assert answer["usage"][key] == sum(s["usage"][key] for s in stages), (key, answer["usage"], stages)
    line = real_stack.audit.one("cascade-0")
    assert line["backend"] == CASCADE_ALWAYS and line["final_stage"] == QWEN_ONE_ASK
    assert [s["backend"] for s in line["cascade"]["stages"]] == [QWEN_P_DONE, QWEN_ONE_ASK]
