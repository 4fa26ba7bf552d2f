"""`eval --backend CASCADE`: every stage scores every episode once through the proxy's pipeline (in
this process) against a fake vLLM whose answers depend on the episode, and the cost–quality
frontier is replayed offline. Every number of the frontier (AUC, accuracy, escalated fraction,
tokens, GPU-seconds, the cheapest band) is computed here again from the fake's answers, the
config and the stated cost model, independently of reports/cascade_frontier.py; the page opens in
headless Chromium where the browser tier runs.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import PROMPTS_DIR, QWEN_MODEL
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.reports.browser import assert_not_blank, chromium, dom_text, screenshot
from tests.reports.expected import auc_by_pairs

BAND, AUDIT, THRESHOLD, PREFILL, DECODE = (0.3, 0.7), 0.25, 0.5, 1000.0, 50.0
# Per episode: (success, the P(done) stage's P(True), the reasoning stage's score out of 100, how
# many words it reasons). The cheap stage is right where it is sure, except episodes 4 and 9
# (confident and wrong: only an audit catches them); the reasoning stage is right on all but one.
# No P(True) sits on a band's edge (the grid's edges are 0.5 ± 0.05k): a score read back from
# logprobs may differ from it in the last bit.
EPISODES = [(True, 0.95, 90, 40), (False, 0.08, 10, 30), (True, 0.62, 85, 120), (False, 0.47, 20, 200),
            (False, 0.88, 15, 60), (True, 0.37, 70, 150), (False, 0.53, 30, 90), (True, 0.78, 95, 20),
            (False, 0.04, 5, 10), (True, 0.17, 75, 80), (False, 0.67, 55, 170), (True, 0.42, 60, 110)]
STAGES = ("p_done", "reason")


def _task(index: int) -> str:
    return f"episode {index:02d}: put the bowl on the plate"


def _index_of(body: dict) -> int:
    text = json.dumps(body["messages"])
    return next(i for i in range(len(EPISODES)) if _task(i) in text)


def _reasoning(index: int) -> str:
    _, _, score, words = EPISODES[index]
    return "because " * words + f"<score>{score}</score>"


def _completion_tokens(text: str) -> int:
    """The fake's usage rule (tests/fakes/fake_vllm.py `_completion`): a token per 4 characters."""
    return max(1, len(text) // 4)


@pytest.fixture(scope="module")
def fake():
    started = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL)).start()
    state = started.fake.state
    state.label_fn = lambda body: {"True": math.log(EPISODES[_index_of(body)][1]),
                                   "False": math.log(1 - EPISODES[_index_of(body)][1])}
    # the P(done) stage asks for one token's logprobs: its reply is one word
    state.reply_fn = lambda body: "True" if body.get("logprob_token_ids") else _reasoning(_index_of(body))
    try:
        yield started
    finally:
        started.stop()


def _episodes_dir(root: Path) -> Path:
    root.mkdir()
    lines = []
    for index, (success, *_rest) in enumerate(EPISODES):
        frames = np.full((6, 48, 48, 3), 20 + 15 * index, np.uint8)
        np.save(root / f"ep{index}.npy", frames)
        lines.append(json.dumps({"file": f"ep{index}.npy", "task_text": _task(index), "task_id": index % 2,
                                 "success": success}))
    (root / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _config(path: Path, fake: FakeVLLMThread) -> Path:
    retry = {"attempts": 2, "parse_attempts": 1, "backoff_s": [0.01, 0.05], "timeout_s": 30, "deadline_s": 60}
    base = {"model": QWEN_MODEL, "layout": "qwen_video", "score_mode": "auto", "retry": retry,
            "endpoints": [fake.base_url], "sampling": {"temperature": 0.0, "max_tokens": 1024},
            "frames": {"nframes": 4, "max_pixels": 50176}}
    backends = {"p_done": {**base, "prompt": "topreward"}, "reason": {**base, "prompt": "qwen_progress"}}
    cascades = {"cheap_first": {"aliases": ["cf"], "threshold": THRESHOLD, "stages": [
        {"backend": "p_done", "band": list(BAND), "audit_fraction": AUDIT}, {"backend": "reason"}]}}
    settings = {"prompts_dir": str(PROMPTS_DIR), "allowed_media_roots": [str(path.parent)]}
    path.write_text(yaml.safe_dump({"proxy": settings, "backends": backends, "cascades": cascades}))
    return path


def _eval(tmp_path: Path, fake: FakeVLLMThread, *extra: str) -> dict:
    from vlm_reward_cli import main

    out = tmp_path / "eval"
    code = main(["eval", str(_episodes_dir(tmp_path / "episodes")), "--config", str(_config(tmp_path / "proxy.yaml",
                fake)), "--backend", "cf", "--prefill-tps", str(PREFILL), "--decode-tps", str(DECODE),
                 "--random-draws", "20", "--out", str(out), *extra])
    assert code == 0
    return json.loads((out / "eval.json").read_text())


def _drawn(index: int) -> float:
    """The audit's draw as docs/cascades.md states it: sha256 of '<cascade>|<stage>|episode:<id>'."""
    digest = hashlib.sha256(f"cheap_first|0|episode:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _stage_cost(index: int, stage: str) -> dict[str, float]:
    completion = 1 if stage == "p_done" else _completion_tokens(_reasoning(index))
    return {"calls": 1, "prompt": 100, "completion": completion, "gpu": 100 / PREFILL + completion / DECODE}


def _expected(band: list[float] | None) -> dict[str, float]:
    """The cascade at `band` (the first stage's), the hashed audit as configured, no budget."""
    scores, spent, escalated = [], [], 0
    for index, (_, p, q, _) in enumerate(EPISODES):
        goes_on = (band is not None and band[0] <= p <= band[1]) or _drawn(index) < AUDIT
        escalated += goes_on
        scores.append(q / 100 if goes_on else p)
        spent.append([_stage_cost(index, "p_done")] + ([_stage_cost(index, "reason")] if goes_on else []))
    truth = [success for success, *_ in EPISODES]
    n = len(EPISODES)
    return {"auc": auc_by_pairs(scores, truth), "escalated": escalated / n,
            "accuracy": sum((s >= THRESHOLD) == y for s, y in zip(scores, truth, strict=True)) / n,
            **{key: sum(c[key] for calls in spent for c in calls) / n
               for key in ("calls", "prompt", "completion", "gpu")}}


def test_the_frontier_equals_an_independent_replay_of_every_policy(fake, tmp_path):
    result = _eval(tmp_path, fake)
    assert not [r for r in result["cascade_records"] if r.get("error")]
    assert len(result["cascade_records"]) == len(EPISODES) * 2  # every stage scored every episode once
    frontier = result["cascades"]["cheap_first"]
    truth = [success for success, *_ in EPISODES]
    policies = {p["policy"]: p for p in frontier["policies"]}
    for stage, scores in (("p_done", [p for _, p, _, _ in EPISODES]), ("reason", [q / 100 for _, _, q, _ in EPISODES])):
        alone = policies[f"{stage} alone"]
        costs = [_stage_cost(i, stage) for i in range(len(EPISODES))]
        assert alone["auc"] == pytest.approx(auc_by_pairs(scores, truth))
        assert alone["escalated_fraction"] == 0
        assert alone["prompt_tokens_per_episode"] == 100
        assert alone["completion_tokens_per_episode"] == pytest.approx(np.mean([c["completion"] for c in costs]))
        assert alone["gpu_seconds_per_episode"] == pytest.approx(np.mean([c["gpu"] for c in costs]))
    cascades = [p for p in frontier["policies"] if p["kind"] == "cascade"]
    assert [p["band"] for p in cascades if p["configured"]] == [list(BAND)]
    assert [0.0, 1.0] in [p["band"] for p in cascades] and None in [p["band"] for p in cascades]
    for policy in cascades:
        want = _expected(policy["band"])
        assert policy["auc"] == pytest.approx(want["auc"]), policy["policy"]
        assert policy["accuracy"] == pytest.approx(want["accuracy"])
        assert policy["escalated_fraction"] == pytest.approx(want["escalated"])
        assert policy["calls_per_episode"] == pytest.approx(want["calls"])
        assert policy["prompt_tokens_per_episode"] == pytest.approx(want["prompt"])
        assert policy["completion_tokens_per_episode"] == pytest.approx(want["completion"])
        assert policy["gpu_seconds_per_episode"] == pytest.approx(want["gpu"])
    # the hashed audit sends some episode outside the band on: the test sees both rules at work
    assert _expected(None)["escalated"] > 0
    # every episode on: the reasoning stage's own quality; random escalation at that rate is the same
    full = next(p for p in cascades if p["band"] == [0.0, 1.0])
    assert full["auc"] == pytest.approx(policies["reason alone"]["auc"])
    randoms = [p for p in frontier["policies"] if p["kind"] == "random"]
    assert {round(p["escalated_fraction"], 9) for p in randoms} == {round(p["escalated_fraction"], 9) for p in cascades}
    at_full = next(p for p in randoms if p["band"] == [0.0, 1.0])
    assert at_full["auc"] == pytest.approx(full["auc"])
    assert at_full["gpu_seconds_per_episode"] == pytest.approx(_expected([0.0, 1.0])["gpu"])
    # the cheapest band within the AUC loss of the reasoning stage alone, by the estimated GPU-seconds
    reference = auc_by_pairs([q / 100 for _, _, q, _ in EPISODES], truth)
    within = [p for p in cascades if _expected(p["band"])["auc"] >= reference - 0.01 - 1e-12]
    cheapest = min(within, key=lambda p: (_expected(p["band"])["gpu"], _expected(p["band"])["escalated"]))
    assert frontier["cheapest_within_loss"] == cheapest["policy"] and frontier["cheapest_band"] == cheapest["band"]
    assert frontier["cost_model"]["prefill_tokens_per_s"] == PREFILL
    assert frontier["cost_model"]["decode_tokens_per_s"] == DECODE


def test_random_escalation_at_no_rate_is_the_cheap_stage_and_the_measured_seconds_are_the_servers(fake, tmp_path):
    frontier = _eval(tmp_path, fake, "--bands", "0.99:1.0")["cascades"]["cheap_first"]
    policies = {p["policy"]: p for p in frontier["policies"]}
    records = {(r["episode"], r["stage"]): r for r in _eval_records(tmp_path)}
    cheap = policies["p_done alone"]
    assert cheap["measured_seconds_per_episode"] == pytest.approx(
        np.mean([records[(i, "p_done")]["seconds"] for i in range(len(EPISODES))]))
    narrow = next(p for p in frontier["policies"] if p["kind"] == "cascade" and p["band"] == [0.99, 1.0])
    assert narrow["escalated_fraction"] == pytest.approx(_expected([0.99, 1.0])["escalated"])


def _eval_records(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "eval" / "eval.json").read_text())["cascade_records"]


def test_the_frontier_page_reads_in_a_browser(fake, tmp_path):
    browser = chromium()  # noqa: F841 - skips (or fails under VLM_REQUIRE_BROWSER=1 or CI) before anything is built
    frontier = _eval(tmp_path, fake)["cascades"]["cheap_first"]
    page = tmp_path / "eval" / "eval.html"
    assert_not_blank(screenshot(page, tmp_path / "eval.png"), min_colours=4, min_stddev=1.0)
    text = dom_text(page)
    assert "Cascade cheap_first: cost against quality" in text
    assert "The cheapest band within 0.01 AUC of reason alone" in text and frontier["cheapest_within_loss"] in text
    assert "random at" in text and "GPU-s / ep (est.)" in text
