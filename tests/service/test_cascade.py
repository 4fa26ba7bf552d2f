"""A cascade through the real proxy against a fake vLLM whose answers depend on what it is shown:
a P(done) stage (one token's logprobs) on every episode, and a generating Qwen stage on the same
replica only on doubt, on the hashed audit, within the batch's budget and the caller's deadline.
Every expected number is computed here from the fake's answers and the config, independently of
the proxy's code. One proxy and one fake serve the module (the fake is reset between tests)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import settings_from_dict
from rlinf_client import RewardClient
from tests.conftest import PROMPTS_DIR, QWEN_MODEL, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import HANG_S, wait_until
from tests.service.test_dashboard import _used_by, cascade_series
from vlm_protocol.wire import BUDGET_HEADER

FRAMES = npy_b64(episode_frames(8, 64, 64))
BAND, AUDIT, THRESHOLD = (0.3, 0.7), 0.25, 0.5
# What the fake answers per task: (P(True) at the first token, the Qwen stage's score out of 100).
TASKS = {f"task {n}": (p, q) for n, (p, q) in enumerate(
    [(0.95, 90), (0.9, 20), (0.6, 80), (0.4, 10), (0.1, 5), (0.05, 70), (0.55, 60), (0.45, 30), (0.65, 75),
     (0.35, 15), (0.85, 95), (0.15, 40)])}


@dataclasses.dataclass
class Stack:
    proxy: ProxyServerThread
    fake: FakeVLLMThread
    http: httpx.Client

    def score(self, task: str, cascade: str = "cheap_first", **fields) -> httpx.Response:
        return self.http.post("/score", json=episode(task, cascade, **fields))

    def chats(self, kind: str) -> int:
        """Chat calls the fake answered: P(done) asks (one token's logprobs) or generating asks."""
        return sum(1 for r in self.fake.fake.state.requests if r.path.endswith("/chat/completions")
                   and ("logprob_token_ids" in r.body) == (kind == "p_done"))


def episode(task: str, cascade: str, **fields) -> dict:
    return {"task_text": task, "frames_npy": FRAMES, "backend": cascade, **fields}


def _task_of(body: dict) -> str:
    text = json.dumps(body["messages"])
    return next(task for task in sorted(TASKS, key=len, reverse=True) if task in text)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    media = tmp_path_factory.mktemp("media")
    fake = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL)).start()
    data = libero_settings_dict([fake.base_url], [], media, prompts_dir=str(PROMPTS_DIR),
                                audit_log=str(tmp_path_factory.mktemp("runs") / "audit.jsonl"))
    qwen = data["backends"].pop("qwen2_5_vl_vllm")
    del data["backends"]["PRIMO-R1"]
    data["backends"] = {name: {**qwen, "prompt": prompt, "score_mode": "auto"}
                        for name, prompt in (("p_done", "topreward"), ("qwen", "qwen_progress"))}
    stages = [{"backend": "p_done", "band": list(BAND), "audit_fraction": AUDIT}, {"backend": "qwen"}]
    data["cascades"] = {
        "cheap_first": {"stages": stages, "threshold": THRESHOLD},
        "cheap_budget": {"stages": [{**stages[0], "audit_fraction": 0.0}, stages[1]], "max_escalated_fraction": 0.5},
        "cheap_or_last": {"stages": [{**stages[0], "audit_fraction": 0.0}, stages[1]], "on_deadline": "last_stage"},
    }
    data["quality"] = {"alarm": {"min_episodes": 8, "min_per_outcome": 2}}
    proxy = ProxyServerThread(settings_from_dict(data)).start()
    http = httpx.Client(base_url=proxy.url, timeout=2 * HANG_S, trust_env=False)
    try:
        yield Stack(proxy, fake, http)
    finally:
        http.close()
        proxy.stop()
        fake.stop()


@pytest.fixture(autouse=True)
def _answers_by_task(stack) -> Iterator[None]:
    stack.fake.fake.reset()
    state = stack.fake.fake.state
    state.label_fn = lambda body: {"True": math.log(TASKS[_task_of(body)][0]),
                                   "False": math.log(1 - TASKS[_task_of(body)][0])}
    state.reply_fn = lambda body: f"<score>{TASKS[_task_of(body)][1]}</score>"
    yield
    state.label_fn = state.reply_fn = None


def drawn(cascade: str, episode_id: str) -> float:
    """The audit's draw, as docs/reward-methods.md states it: sha256 of '<cascade>|<stage>|episode:<id>'."""
    digest = hashlib.sha256(f"{cascade}|0|episode:{episode_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def test_the_cascade_escalates_exactly_the_band_and_the_hashed_audit(stack):
    expected_on, answers = set(), {}
    for task, (p, _) in TASKS.items():
        episode_id = f"ep-{task}"
        goes_on = BAND[0] <= p <= BAND[1] or drawn("cheap_first", episode_id) < AUDIT
        if goes_on:
            expected_on.add(task)
        response = stack.score(task, metadata={"episode_id": episode_id, "run": "escalate"})
        assert response.status_code == 200, response.text
        answers[task] = response.json()
    assert expected_on - {t for t, (p, _) in TASKS.items() if BAND[0] <= p <= BAND[1]}, "no audit drawn: pick ids"
    for task, answer in answers.items():
        p, q = TASKS[task]
        stages = answer["cascade"]["stages"]
        assert answer["backend"] == "cheap_first" and stages[0]["backend"] == "p_done"
        assert stages[0]["score"] == pytest.approx(p, abs=1e-6)
        if task in expected_on:
            why = "band" if BAND[0] <= p <= BAND[1] else "audit"
            assert [s["backend"] for s in stages] == ["p_done", "qwen"] and stages[0]["went_on"] == why
            assert answer["score"] == pytest.approx(q / 100) and answer["cascade"]["final_stage"] == "qwen"
            assert answer["cascade"]["stopped"] is None
        else:
            assert len(stages) == 1 and answer["score"] == pytest.approx(p, abs=1e-6)
            assert answer["cascade"]["stopped"] == "sure"
        summed = {k: sum(s["usage"][k] for s in stages) for k in ("prompt_tokens", "completion_tokens")}
        assert {k: answer["usage"][k] for k in summed} == summed  # the episode pays every stage it ran
    assert stack.chats("p_done") == len(TASKS) and stack.chats("qwen") == len(expected_on)


def test_a_batch_escalates_within_its_budget_the_closest_to_the_threshold_first(stack):
    in_band = [t for t, (p, _) in TASKS.items() if BAND[0] <= p <= BAND[1]]  # 6 in doubt
    items = [episode(t, "cheap_budget") for t in TASKS]
    cap = int(0.5 * len(items))
    closest = sorted(in_band, key=lambda t: (abs(TASKS[t][0] - THRESHOLD), list(TASKS).index(t)))[:cap]
    results = stack.http.post("/score/batch", json={"items": items}).json()["results"]
    assert all(r["ok"] for r in results)
    went_on = {t for t, r in zip(TASKS, results, strict=True) if len(r["result"]["cascade"]["stages"]) == 2}
    assert went_on == set(closest) if len(in_band) > cap else set(in_band)
    for task, result in zip(TASKS, results, strict=True):
        cascade = result["result"]["cascade"]
        if task in in_band and task not in went_on:
            assert cascade["stopped"] == "budget" and result["result"]["score"] == pytest.approx(TASKS[task][0])


def test_the_deadline_rule_answers_as_configured_never_a_silent_substitute(stack):
    task = next(t for t, (p, _) in TASKS.items() if BAND[0] <= p <= BAND[1])
    stack.fake.fake.script({}, {"hang_s": 3600})  # the P(done) stage answers; the Qwen stage never does
    marked = stack.http.post("/score", json=episode(task, "cheap_or_last"), headers={BUDGET_HEADER: "3000"}).json()
    assert marked["score"] == pytest.approx(TASKS[task][0]) and marked["cascade"]["stopped"] == "deadline"
    assert [s["backend"] for s in marked["cascade"]["stages"]] == ["p_done"]
    stack.fake.fake.script({}, {"hang_s": 3600})
    refused = stack.http.post("/score", json=episode(task, "cheap_first"), headers={BUDGET_HEADER: "3000"})
    assert refused.status_code == 504 and refused.json()["error"]["code"] == "upstream_timeout"


def test_a_hacked_cheap_stage_raises_the_alarm_under_its_own_key(stack):
    """The P(done) stage calls failed episodes confident successes; the Qwen stage does not. The
    stage's own key (cascade/stage) falls into alarm, named, apart from the cascade's final key."""
    hacked = {f"hack {n}": (0.92, 10) for n in range(8)} | {f"good {n}": (0.93, 90) for n in range(8)}
    TASKS.update(hacked)
    try:
        for task in hacked:
            success = task.startswith("good")
            response = stack.score(task, metadata={"run": "hacked", "task_id": "one", "env_success": success,
                                                   "episode_id": task})
            assert response.status_code == 200, response.text
    finally:
        for task in hacked:
            del TASKS[task]
    keys = {(k["key"]["backend"], k["status"]) for k in stack.http.get("/quality").json()["keys"]
            if k["key"]["run"] == "hacked"}
    assert ("cheap_first/p_done", "alarm") in keys, keys


def test_frame_rules_and_other_routes(stack):
    rules = stack.http.get("/frame-rules").json()["backends"]
    assert rules["cheap_first"]["labels"] == ["cheap_first"] and rules["cheap_first"]["layout"] == "qwen_video"
    dense = stack.http.post("/score/dense", json={**episode("task 0", "cheap_first"), "points": 2})
    assert dense.status_code == 422 and "cascade" in dense.json()["error"]["message"]


def test_stages_on_one_replica_share_its_pool(stack):
    """A call in flight of the P(done) stage is in flight for the Qwen backend too: one replica,
    one count (its cap, circuit and queue are the same for both)."""
    held = threading.Event()
    stack.fake.fake.script({"hold": held})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stack.score, "task 0")
        try:
            wait_until(lambda: stack.fake.fake.state.chat_count >= 1, HANG_S, "the P(done) call to reach the replica")
            health = stack.http.get("/health").json()["backends"]
            assert health["p_done"]["endpoints"][0]["in_flight"] == 1
            assert health["qwen"]["endpoints"][0]["in_flight"] == 1  # the same replica's one call
        finally:
            held.set()
        assert pending.result(timeout=HANG_S).status_code == 200


def test_the_rlinf_client_scores_through_a_cascade_on_its_default_path(stack):
    """By the cascade's name, with the client's defaults: it encodes at the cascade's frame rules
    (the decoding stage's, stills included) and the proxy forwards its JPEGs as they are."""
    frames = episode_frames(40, 128, 128)
    with RewardClient(endpoint=f"{stack.proxy.url}/score", backend="cheap_first", fallback="raise") as client:
        result = client.score_episode(frames, "task 0")
    answer = result.response
    stages = answer["cascade"]["stages"]
    assert result.ok and result.score == stages[-1]["score"]  # the last stage that ran (the audit may go on)
    assert answer["backend"] == "cheap_first" and stages[0]["backend"] == "p_done"
    assert stages[0]["score"] == pytest.approx(TASKS["task 0"][0], abs=1e-6)
    assert answer["frames"]["forwarded"] == answer["frames"]["count"] > 0  # the client's JPEGs, not re-encoded


def test_the_monitor_keeps_each_cascades_escalation_and_audit_disagreement_rates(stack, tmp_path):
    """Per (run, cascade, task): the share of episodes the cheap stage sent on, by why, and of the
    audited ones, the share where the cheap stage lay across the threshold from the final stage; on
    /quality and as gauges. Episodes without env_success count too (the rates need no truth)."""
    went_on, audits, crossed = 0, 0, 0
    for n, (task, (p, q)) in enumerate(TASKS.items()):
        in_band = BAND[0] <= p <= BAND[1]
        audited = not in_band and drawn("cheap_first", f"w-{task}") < AUDIT
        went_on += in_band or audited
        audits += audited
        crossed += audited and (p >= THRESHOLD) != (q / 100 >= THRESHOLD)
        metadata = {"episode_id": f"w-{task}", "run": "watch", "task_id": "t",
                    **({"env_success": q >= 50} if n % 2 else {})}
        assert stack.score(task, metadata=metadata).status_code == 200
    assert audits and crossed, "the ids w-<task> audit some confident episodes, one of them wrong"
    [entry] = [c for c in stack.http.get("/quality").json()["cascades"] if c["key"]["run"] == "watch"]
    assert entry["key"] == {"run": "watch", "backend": "cheap_first", "task_id": "t"}
    numbers = entry["stages"]["p_done"]
    assert entry["episodes"] == numbers["episodes"] == len(TASKS) and "qwen" not in entry["stages"]
    assert numbers["escalation_rate"] == pytest.approx(went_on / len(TASKS))
    assert numbers["by_why"]["audit"] == audits and numbers["audits"] == audits
    assert numbers["audit_disagreement_rate"] == pytest.approx(crossed / audits)
    gauges = {(s.name, s.labels.get("stage")): s.value for family in text_string_to_metric_families(
        stack.http.get("/metrics").text) for s in family.samples if s.labels.get("run") == "watch"}
    assert gauges[("vlm_proxy_cascade_escalation_rate", "p_done")] == pytest.approx(went_on / len(TASKS))
    assert gauges[("vlm_proxy_cascade_audit_disagreement_rate", "p_done")] == pytest.approx(crossed / audits)
    assert gauges[("vlm_proxy_cascade_window_audits", "p_done")] == audits
    # the report reads the same numbers from the audit lines' cascade fields
    stack.proxy.flush_audit()
    lines = [json.loads(text) for text in Path(stack.proxy.settings.proxy.audit_log).read_text().splitlines()]
    log = tmp_path / "watch.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines if (r.get("metadata") or {}).get("run") == "watch"))
    from reports.report import build_report

    stages = build_report(log, out=tmp_path / "report")["logs"][0]["cascades"]["cheap_first"]["stages"]
    assert stages["p_done"]["escalation_rate"] == pytest.approx(went_on / len(TASKS))
    assert (stages["p_done"]["audits"], stages["p_done"]["audit_disagreements"]) == (audits, crossed)
    assert stages["qwen"]["ran"] == went_on and stages["qwen"]["judged"] == 0
    assert "Cascades" in (tmp_path / "report" / "report.html").read_text()


def test_the_dashboards_cascade_panels_read_series_the_proxy_exports(stack):
    for task in TASKS:
        assert stack.score(task, metadata={"episode_id": f"w-{task}", "run": "panels", "env_success": True,
                                           "task_id": "t"}).status_code == 200
    exported = {s.name for family in text_string_to_metric_families(stack.http.get("/metrics").text)
                for s in family.samples}
    wanted = cascade_series(_used_by())
    assert len(wanted) >= 4, wanted  # the rates, the audits behind them, the counter by why
    assert {"vlm_proxy_cascade_escalation_rate", "vlm_proxy_cascade_audit_disagreement_rate"} <= set(wanted)
    assert not set(wanted) - exported, sorted(set(wanted) - exported)
