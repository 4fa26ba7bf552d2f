"""Issue 15's estimates on the real server: the answer constraint (parse failures with and without
it), the reasoning pattern for PRIMO-R1, k samples in one request (`n=k`: one prefill), and the
expectation over the answer token's top_logprobs. The numbers are printed and written to
`<run dir>/estimates.json` (ratios, not thresholds: the machine is shared)."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest

from tests.real_vllm.stack import PRIMO, QWEN_DIGIT, QWEN_ONE_ASK, TASK, RealStack, episode_source, say
from vlm_protocol.frames import sample_indices

pytestmark = pytest.mark.real_vllm

EPISODES = 8
MEASURED: dict[str, object] = {}


def _record(stack: RealStack, key: str, value: object) -> None:
    MEASURED[key] = value
    (stack.run_dir / "estimates.json").write_text(json.dumps(MEASURED, indent=2))


def _batch(stack: RealStack, run: str, backend: str, kwargs: dict, *, offset: int = 0) -> list[dict]:
    items = [{"task_text": f"{TASK} (episode {i})", "backend": backend, "nframes": 8, "backend_kwargs": kwargs,
              "metadata": {"run": run, "episode_id": i},
              **episode_source("npy", 20 + offset + i, 112, 112, stack.media_root)} for i in range(EPISODES)]
    with httpx.Client(base_url=stack.proxy_url, timeout=600, trust_env=False) as http:
        answer = http.post("/score/batch", json={"items": items})
    assert answer.status_code == 200, answer.text
    return answer.json()["results"]


def test_parse_failures_with_and_without_the_constraint(real_stack: RealStack) -> None:
    rates = {}
    for constrain in (True, False):
        results = _batch(real_stack, f"constraint-{constrain}", QWEN_ONE_ASK, {"constrain": constrain})
        outcomes = Counter("scored" if r["ok"] else r["error"]["code"] for r in results)
        assert set(outcomes) <= {"scored", "unparseable_score"}, outcomes
        rates[f"constrain={constrain}"] = outcomes["unparseable_score"] / EPISODES
        say(f"qwen_seed, one greedy ask, constrain={constrain}: {dict(outcomes)} of {EPISODES}")
    _record(real_stack, "parse_failure_rate", rates)
    assert rates["constrain=True"] == 0.0  # every reply the regex allows is a score on the scale


def test_the_reasoning_pattern_is_accepted_for_primo(real_stack: RealStack, http) -> None:
    answer = http.post("/score", json={"task_text": TASK, "backend": PRIMO, "nframes": 8,
                                       "backend_kwargs": {"constrain": True}, "metadata": {"run": "primo-constrained"},
                                       **episode_source("npy", 20, 112, 112, real_stack.media_root)})
    body = answer.json()
    outcome = "scored" if answer.status_code == 200 else body["error"]["code"]
    record = real_stack.audit.one("primo-constrained")
    say(f"PRIMO-R1 constrained (<think>…</think><answer>0-100</answer>): {outcome}, "
        f"finish_reason {record.get('finish_reason')}, reply[:80] {record['output_text'][:80]!r}")
    _record(real_stack, "primo_constrained", {"outcome": outcome, "finish_reason": record.get("finish_reason"),
                                              "completion_tokens": record["usage"]["completion_tokens"]})
    # vLLM compiled and applied the pattern: the server accepted it, and the reply opens the think block
    assert outcome in ("scored", "unparseable_score"), body
    assert record["output_text"].startswith("<think>"), record["output_text"][:80]


def test_k_samples_cost_one_prefill(real_stack: RealStack, http) -> None:
    source = episode_source("npy", 24, 112, 112, real_stack.media_root)
    runs = {}
    for k in (1, 5, 1, 5):  # interleaved: a drift on the shared machine hits both alike
        run = f"samples-{k}-{len([r for r in runs if r.startswith(f'k={k}')])}"
        started = time.perf_counter()
        answer = http.post("/score", json={"task_text": TASK, "backend": QWEN_ONE_ASK, "nframes": 8,
                                           "backend_kwargs": {"samples": k, "temperature": 0.7, "seed": 7},
                                           "metadata": {"run": run}, **source})
        wall = time.perf_counter() - started
        assert answer.status_code == 200, answer.text
        result = answer.json()
        runs[f"k={k} #{run[-1]}"] = {"wall_s": round(wall, 3), "usage": result["usage"],
                                     "samples": result.get("samples"), "spread": result.get("spread")}
        if k > 1:
            assert len(result["samples"]) == k and all(s["ok"] for s in result["samples"]), result
            assert 0.0 <= result["score"] <= 1.0 and result["spread"] is not None, result
    one, five = runs["k=1 #0"], runs["k=5 #0"]
    # one request, one prefill: the prompt is counted once, the completions k times
    assert five["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"], runs
    assert five["usage"]["completion_tokens"] > one["usage"]["completion_tokens"], runs
    cost = {"wall_ratio": round(sum(r["wall_s"] for n, r in runs.items() if n.startswith("k=5"))
                                / sum(r["wall_s"] for n, r in runs.items() if n.startswith("k=1")), 2),
            "completion_token_ratio": five["usage"]["completion_tokens"] / one["usage"]["completion_tokens"],
            "prompt_tokens": one["usage"]["prompt_tokens"], "runs": runs}
    say(f"k=5 vs k=1: wall x{cost['wall_ratio']}, completion tokens x{cost['completion_token_ratio']:.1f}, "
        f"prompt tokens {cost['prompt_tokens']} both")
    _record(real_stack, "k5_cost", cost)


def test_logprob_score_on_a_single_token_scale(real_stack: RealStack, http) -> None:
    answer = http.post("/score", json={"task_text": TASK, "backend": QWEN_DIGIT, "nframes": 8,
                                       "backend_kwargs": {"logprob_score": True}, "metadata": {"run": "logprob"},
                                       **episode_source("npy", 20, 112, 112, real_stack.media_root)})
    assert answer.status_code == 200, answer.text
    result = answer.json()
    info = result["logprob"]
    say(f"logprob score {result['score']:.4f} (raw {result['raw_score']:.3f}, greedy {info['greedy_raw']}), "
        f"mass on the 0-9 scale {info['mass_on_scale']:.4f}")
    _record(real_stack, "logprob", {"score": result["score"], **info})
    assert result["parse"]["source"].endswith("+logprobs")
    assert 0.0 <= result["raw_score"] <= 9.0 and 0.0 < info["mass_on_scale"] <= 1.0
    assert abs(sum(info["distribution"].values()) - 1.0) < 1e-6
    # greedy decoding took the most likely value: the distribution was read at the answer's token
    assert float(max(info["distribution"], key=info["distribution"].get)) == info["greedy_raw"]


def test_a_dense_curve_costs_k_calls(real_stack: RealStack, http) -> None:
    """Issue 15 item 4 on the real server: k prefixes as k concurrent calls; what that costs next to one."""
    source = episode_source("npy", 24, 112, 112, real_stack.media_root)
    body = {"task_text": TASK, "backend": QWEN_ONE_ASK, "nframes": 8, **source}
    walls: dict[str, list[float]] = {"one": [], "dense4": []}
    answers: dict[str, dict] = {}
    for name in ("one", "dense4", "one", "dense4"):  # interleaved, as above
        started = time.perf_counter()
        answer = (http.post("/score", json={**body, "metadata": {"run": "dense-one"}}) if name == "one" else
                  http.post("/score/dense", json={**body, "points": 4, "metadata": {"run": "dense-4"}}))
        walls[name].append(time.perf_counter() - started)
        assert answer.status_code == 200, answer.text
        answers[name] = answer.json()
    one, dense = answers["one"], answers["dense4"]
    assert [p["frame_index"] for p in dense["curve"]] == sample_indices(24, 5)[1:]
    assert len(dense["points"]) == 4 and dense["attempts"] == 4
    # the last point is the whole episode: the same frames and prompt as the single score
    assert dense["points"][-1]["frames"]["sha256"] == one["frames"]["sha256"]
    assert dense["points"][-1]["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    shorter = [p["usage"]["prompt_tokens"] for p in dense["points"]]
    assert shorter == sorted(shorter) and dense["points"][0]["frames"]["count"] == 7  # frames 0..6
    cost = {"wall_ratio": round(sum(walls["dense4"]) / sum(walls["one"]), 2),
            "prompt_token_ratio": round(dense["usage"]["prompt_tokens"] / one["usage"]["prompt_tokens"], 2),
            "prompt_tokens_per_point": shorter, "walls_s": {k: [round(w, 3) for w in v] for k, v in walls.items()}}
    say(f"dense curve of 4 points vs one score: wall x{cost['wall_ratio']}, prompt tokens "
        f"x{cost['prompt_token_ratio']} ({shorter})")
    _record(real_stack, "dense4_cost", cost)
