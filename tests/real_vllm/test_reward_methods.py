"""The field's reward methods on the real server: TOPReward's P(done) and RoboReward's 1-5 score.

P(done) is read with vLLM's `logprob_token_ids`: the full-vocabulary logprob of "True" and
"False" at the reply's first token. The test checks, on the real server, that this IS the number
TOPReward computes by teacher forcing (the logprob of a "True" appended after the prompt, read
with `prompt_logprobs`), and that the ids are the served tokenizer's. Numbers go to
`<run dir>/reward_methods.json`.
"""

from __future__ import annotations

import base64
import json
import math
import time

import cv2
import httpx
import pytest

from tests.fakes.episodes import episode_frames
from tests.real_vllm.stack import (
    QWEN_GVL,
    QWEN_MODEL,
    QWEN_ONE_ASK,
    QWEN_P_DONE,
    QWEN_ROBOREWARD,
    TASK,
    RealStack,
    episode_source,
    say,
    vision_tokens_of,
)

pytestmark = pytest.mark.real_vllm

P_DONE_TEXT = (f"The above video shows a robot manipulation trajectory that completes the following task: {TASK} "
               "Decide whether the above statement is True or not. The answer is:")
MEASURED: dict[str, object] = {}


def _record(stack: RealStack, key: str, value: object) -> None:
    MEASURED[key] = value
    (stack.run_dir / "reward_methods.json").write_text(json.dumps(MEASURED, indent=2))


def _token_id(replica: str, word: str) -> int:
    answer = httpx.post(f"{replica}/tokenize", json={"model": QWEN_MODEL, "prompt": word, "add_special_tokens": False},
                        timeout=60, trust_env=False)
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["tokens"]
    assert len(tokens) == 1, (word, tokens)
    return tokens[0]


def _conversation(count: int = 8) -> list[dict]:
    jpegs = [base64.b64encode(cv2.imencode(".jpg", frame[..., ::-1])[1].tobytes()).decode()
             for frame in episode_frames(count, 112, 112)]
    return [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(jpegs)}},
        {"type": "text", "text": P_DONE_TEXT}]}]


def test_p_done_through_the_proxy_is_one_token_priced_by_the_served_vocabulary(real_stack: RealStack, http) -> None:
    answer = http.post("/score", json={"task_text": TASK, "backend": QWEN_P_DONE, "nframes": 8,
                                       "metadata": {"run": "p-done"},
                                       **episode_source("npy", 16, 112, 112, real_stack.media_root)})
    assert answer.status_code == 200, answer.text
    result = answer.json()
    probability = result["probability"]
    replica = real_stack.server_url("qwen_r0")
    assert probability["token_ids"] == [_token_id(replica, "True"), _token_id(replica, "False")]
    p_yes, p_no = probability["p_affirmative"], probability["p_negative"]
    assert result["score"] == p_yes and 0 <= p_yes <= 1 and 0 <= p_no <= 1 and p_yes + p_no <= 1 + 1e-6
    assert probability["mass_other"] == pytest.approx(1 - p_yes - p_no, abs=1e-9)
    assert result["usage"]["completion_tokens"] == 1 and result["sampling"]["max_tokens"] == 1
    record = real_stack.audit.one("p-done")
    assert record["probability"]["p_affirmative"] == p_yes
    say(f"P(done) on random weights: P(True) {p_yes:.3g}, P(False) {p_no:.3g}, first token "
        f"{probability['first_token']!r}, {result['usage']['prompt_tokens']} prompt tokens")
    _record(real_stack, "p_done", {"p_true": p_yes, "p_false": p_no, "usage": result["usage"]})


def test_the_first_token_logprob_is_teacher_forcing_of_the_appended_true(real_stack: RealStack) -> None:
    """TOPReward appends "True" to the prompt and reads its logprob in one forward pass; the proxy
    reads the first generated token's distribution. On the real server they are one number."""
    replica = real_stack.server_url("qwen_r0")
    true_id, false_id = _token_id(replica, "True"), _token_id(replica, "False")
    with httpx.Client(base_url=f"{replica}/v1", timeout=300, trust_env=False) as client:
        generated = client.post("/chat/completions", json={
            "model": QWEN_MODEL, "messages": _conversation(), "max_tokens": 1, "temperature": 0.0,
            "logprobs": True, "logprob_token_ids": [true_id, false_id], "return_tokens_as_token_ids": True})
        forced = client.post("/chat/completions", json={
            "model": QWEN_MODEL, "messages": [*_conversation(), {"role": "assistant", "content": "True"}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 0})
    assert generated.status_code == 200, generated.text
    assert forced.status_code == 200, forced.text
    top = {entry["token"]: entry["logprob"]
           for entry in generated.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
    read = top[f"token_id:{true_id}"]
    last = forced.json()["prompt_logprobs"][-1]
    assert list(last) == [str(true_id)], last  # the prompt ends with the appended "True"
    teacher = last[str(true_id)]["logprob"]
    say(f"log P(True): first generated token {read:.5f}, teacher forcing {teacher:.5f}")
    _record(real_stack, "log_p_true", {"first_token": read, "teacher_forcing": teacher})
    assert read == pytest.approx(teacher, abs=1e-3)
    assert math.exp(top[f"token_id:{false_id}"]) + math.exp(read) <= 1 + 1e-6


def test_a_dense_p_done_curve_on_the_real_server(real_stack: RealStack, http) -> None:
    answer = http.post("/score/dense", json={"task_text": TASK, "backend": QWEN_P_DONE, "nframes": 8, "points": 4,
                                             **episode_source("npy", 24, 112, 112, real_stack.media_root)})
    assert answer.status_code == 200, answer.text
    curve = answer.json()
    assert len(curve["curve"]) == 4 and curve["attempts"] == 4
    for point, result in zip(curve["curve"], curve["points"], strict=True):
        assert point["score"] == result["probability"]["p_affirmative"]
    _record(real_stack, "p_done_curve", [p["score"] for p in curve["curve"]])


def test_roboreward_constrained_replies_are_its_five_levels(real_stack: RealStack) -> None:
    items = [{"task_text": f"{TASK} (episode {i})", "backend": QWEN_ROBOREWARD, "nframes": 8,
              **episode_source("npy", 20 + i, 112, 112, real_stack.media_root)} for i in range(6)]
    with httpx.Client(base_url=real_stack.proxy_url, timeout=600, trust_env=False) as http:
        results = http.post("/score/batch", json={"items": items}).json()["results"]
    assert all(r["ok"] for r in results), [r.get("error") for r in results]
    scores = [r["result"]["score"] for r in results]
    assert set(scores) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    assert all(r["result"]["output_text"].startswith("ANSWER: ") for r in results)
    _record(real_stack, "roboreward_scores", scores)


def test_gvl_one_call_against_k_prefix_calls(real_stack: RealStack, http) -> None:
    """GVL's curve (8 shuffled images + the reference, one call) next to the prefix method's (8
    calls, a video each) on the same episode: both run, every constrained GVL reply parses, and
    what each costs in prompt tokens and wall time is recorded."""
    source = episode_source("npy", 24, 112, 112, real_stack.media_root)
    cost = {}
    for backend, fields in ((QWEN_GVL, {}), (QWEN_ONE_ASK, {"nframes": 8})):
        started = time.perf_counter()
        answer = http.post("/score/dense", json={"task_text": TASK, "backend": backend, "points": 8,
                                                 "metadata": {"run": f"cost-{backend}"}, **fields, **source})
        wall = time.perf_counter() - started
        assert answer.status_code == 200, answer.text
        dense = answer.json()
        cost[dense["method"]] = {"calls": dense["attempts"], "prompt_tokens": dense["usage"]["prompt_tokens"],
                                 "completion_tokens": dense["usage"]["completion_tokens"], "wall_s": round(wall, 2),
                                 "frame_indices": [p["frame_index"] for p in dense["curve"]]}
    gvl = http.post("/score/dense", json={"task_text": TASK, "backend": QWEN_GVL, "points": 8, **source}).json()
    (result,) = gvl["points"]
    assert sorted(result["shuffle"]["order"]) == list(range(8)) and result["frames"]["count"] == 9
    # the prompt holds 9 images (the reference and the 8 shown), each costing an image's vision tokens
    width, height = result["frames"]["size"]
    assert result["frames"]["vision_tokens"] == vision_tokens_of("shuffled_images", result["frames"]) \
        == 9 * ((width // 28) * (height // 28) + 2)
    assert result["usage"]["prompt_tokens"] > result["frames"]["vision_tokens"]
    assert cost["shuffled"]["calls"] == 1 and cost["prefixes"]["calls"] == 8
    assert cost["shuffled"]["frame_indices"] == cost["prefixes"]["frame_indices"]  # the same points in time
    say(f"dense curve, 8 points: shuffled (GVL) {cost['shuffled']}, prefixes {cost['prefixes']}")
    _record(real_stack, "gvl_vs_prefixes", cost)
