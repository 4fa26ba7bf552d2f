"""RLinf 0.3.0's real LiberoEnv (LIBERO-10, 2 envs, CPU) with and without the patch, scored by the
real proxy in front of fake vLLMs (and once a real tiny `vllm serve`).

Everything runs in ONE module fixture, because building and resetting a LiberoEnv costs 20-70 s
here (a later reset 10-25 s): ONE runner process in the RLinf venv
(tests/real_rlinf/libero_runner.py --patched --unpatched-first) runs the first episode on the
unpatched module, then every scenario below on the patched one with the same simulator
processes, one reset each, all from the same initial states (reset_state_ids [221, 434]: task 4
in env 0, task 8 in env 1) with the same seeded random actions. The tests only read the results.

Random actions never solve a LIBERO-10 task in 16 steps, so some scenarios set the
simulator's success flag from a given step on (the runner's `inject_success`: the `done` that
LiberoEnv.step receives from its vector env), to get termination-ended episodes, a True
`env_success` in the metadata and a visible `fallback: env_success`.

Run D (`reward_source: progress`, the shipped overlay) has two short episodes behind the proxy's
POST /progress/batch, an embedding backend (configs/srpo.yaml's) on a fake vLLM whose
/v1/embeddings answers the frames' mean colour, and the proxy's reference store on.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from proxy.config import settings_from_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread, decode_video_part
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import REPO, free_port
from tests.real_rlinf._support import (
    RUNNER,
    SUMMARY,
    TinyVLLM,
    clean_env,
    decode_jpegs,
    http_json,
    mad,
    mapped_score,
    reference_vllm,
    rlinf_python,
    rule_rewards,
    uniform_indices,
)
from tests.rlinf_semantics import grpo_episode_return, native_step_rewards, terminal_step_rewards

pytestmark = pytest.mark.real_rlinf

# LIBERO-10's language for the tasks of reset_state_ids [221, 434] (50 initial states per task).
TASKS = ("put the white mug on the left plate and put the yellow and white mug on the right plate",  # env 0
         "put both moka pots on the stove")  # env 1
TASK_IDS = (4, 8)
UNPARSEABLE = "I cannot tell from this video."
SHIPPED_PROXY = REPO / "configs" / "libero.yaml"
OVERLAY_A = REPO / "configs" / "rlinf" / "libero_10_grpo_openvlaoft_runA.yaml"
OVERLAY_B = REPO / "configs" / "rlinf" / "libero_10_grpo_openvlaoft_runB_qwen.yaml"
OVERLAY_D = REPO / "configs" / "rlinf" / "libero_10_grpo_openvlaoft_runD_srpo.yaml"
SHIPPED_SRPO = REPO / "configs" / "srpo.yaml"
QWEN = "qwen2_5_vl_vllm"
EMBED = "embed"  # configs/srpo.yaml's embedding backend
STEPS = 16
RUN_TIMEOUT_S = 1500

# The patched env's episodes, in order. `replies`: what the fake model answers per env's task
# (the shipped qwen_seed prompt wants a bare percentage); `down`: the endpoint is a closed port;
# `block`: changes to run B's reward_model block (the shipped overlay).
PLAN: list[dict[str, Any]] = [
    {"name": "off", "reward_model": None, "inject_success": {"1": 6}},
    {"name": "binary_rel_inline", "replies": ("49", "50"), "reward_coef": 5.0, "use_rel_reward": True,
     "block": {"transport": "inline"}, "inject_success": {"1": 6}, "keep_frames": True},
    # Two cameras: the env's wrist_images (reward_model.extra_view) go as a second video
    # (the backend's frames.extra_view), the main view as a temp MP4 and the wrist view inline.
    {"name": "continuous_nonrel_path", "replies": ("62", "18"), "reward_coef": 2.5, "use_rel_reward": False,
     "max_episode_steps": 10, "extra_view": "second_video",
     "block": {"binary_reward": False, "transport": "path", "fail_on_request_error": False, "fallback": "zero",
               "extra_view": "wrist_images"}, "keep_frames": True},
    {"name": "zero_unparseable", "replies": (UNPARSEABLE, "90"), "reward_coef": 3.0, "use_rel_reward": True,
     "block": {"binary_reward": False, "fail_on_request_error": False, "fallback": "zero"},
     "inject_success": {"0": 4}},
    # Run D (`progress`: run D's overlay block, an embedding backend, the reference store on), 8
    # steps each. Env 0's task 4 never succeeds; env 1's task 8 does (injected) at step 6 in the
    # first episode, alone in that step's request, and the store keeps it; in the second both envs
    # fail on step 8, in one request, and env 1's failure is measured against that stored success.
    # (A scenario keeps the env config's values of the one before unless it sets them: run D's.)
    {"name": "progress_first", "progress": True, "reward_coef": 5.0, "use_rel_reward": True, "steps": 8,
     "inject_success": {"1": 6}},
    {"name": "progress_stored", "progress": True, "reward_coef": 5.0, "use_rel_reward": True, "steps": 8},
    {"name": "env_success_down", "down": True, "reward_coef": 4.0, "use_rel_reward": False,
     "block": {"fail_on_request_error": False, "fallback": "env_success"}, "inject_success": {"1": 5}},
    {"name": "raise_down", "down": True, "steps": 8, "block": {}},
    {"name": "raise_unparseable", "replies": (UNPARSEABLE, UNPARSEABLE), "steps": 8, "block": {}},
]
# With the reference venv: one more episode, the real tiny vLLM behind its own proxy. Its random
# weights answer garbage, so the expected outcome is `fallback: zero` (0 and vlm_fallback 1);
# a reply that did parse would be checked against the rule instead.
REAL_VLLM = {"name": "real_vllm", "real": True, "reward_coef": 5.0, "use_rel_reward": True,
             "block": {"fail_on_request_error": False, "fallback": "zero"}, "keep_frames": True}


@dataclass
class Tier:
    result: dict[str, Any]  # the runner's JSON
    episodes: dict[str, dict[str, Any]]
    frames: dict[str, np.ndarray]
    chats: dict[str, list[dict]]  # the fake vLLM's chat requests, per scenario
    embeddings: dict[str, list[dict]]  # the embedding fakes' /v1/embeddings requests, per scenario
    references: dict[str, Any]  # the proxy's GET /progress/references after the run
    audit: dict[str, list[dict]]  # the proxy's audit lines, per scenario (= backend)
    plan: dict[str, dict[str, Any]]
    media_root: Path
    real_vllm: dict[str, Any] = field(default_factory=dict)
    wrists: dict[str, np.ndarray] = field(default_factory=dict)  # wrist_images, where frames are kept


def _user_text(body: dict) -> str:
    return "\n".join(part.get("text", "") for m in body.get("messages", []) if isinstance(m.get("content"), list)
                     for part in m["content"] if part.get("type") == "text")


def _env_of(body: dict) -> int:
    text = _user_text(body)
    found = [i for i, task in enumerate(TASKS) if task in text]
    assert len(found) == 1, f"no single LIBERO task text in the prompt: {text[:300]!r}"
    return found[0]


def _reply_fn(replies: tuple[str, str]):
    return lambda body: replies[_env_of(body)]


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


TIER_JOB = "/tmp/rlinf-logs/real-rlinf-tier/seed=0"  # what RLinf resolves the overlays' job to, for this tier


def _shipped_block(overlay: Path) -> dict[str, Any]:
    """An overlay's reward_model block as RLinf hands it to the env. Its `job` interpolates the
    launch's log path and seed, which RLinf's full config resolves; the env built here has no
    `runner` section, so it is resolved here as RLinf would resolve it."""
    block = dict(_yaml(overlay)["env"]["train"]["reward_model"])
    if isinstance(block.get("job"), str) and "${" in block["job"]:
        block["job"] = TIER_JOB
    return block


def _proxy_settings(backends: dict[str, str], media_root: Path, audit: Path, *, real: bool = False,
                    embedders: dict[str, str] | None = None, references: Path | None = None,
                    views: dict[str, str] | None = None) -> Any:
    """configs/libero.yaml's proxy and Qwen backend (prompt, sampling, frames as shipped), one
    backend per scenario pointed at that scenario's server, fast retries for the fakes; for run D,
    configs/srpo.yaml's embedding backend (one per scenario, no `launch`) and reference store
    (in `references`). `views`: a backend's frames.extra_view (a second camera), by name."""
    shipped = _yaml(SHIPPED_PROXY)
    qwen = shipped["backends"][QWEN]
    retry = (qwen["retry"] if real else
             {"attempts": 2, "parse_attempts": 2, "backoff_s": [0.01, 0.05], "timeout_s": 30, "deadline_s": 60})
    proxy = {**shipped["proxy"], "allowed_media_roots": [str(media_root)], "prompts_dir": str(REPO / "prompts"),
             "audit_log": str(audit), "health_interval_s": 1.0 if real else 5.0}
    chosen = {name: {**qwen, "endpoints": [url], "retry": retry,
                     "frames": {**qwen["frames"], "extra_view": (views or {}).get(name)}}
              for name, url in backends.items()}
    if embedders:
        srpo = _yaml(SHIPPED_SRPO)
        embed = {k: v for k, v in srpo["backends"][EMBED].items() if k != "launch"}
        assert embed["kind"] == "embedding"
        chosen.update({name: {**embed, "endpoints": [url], "retry": retry} for name, url in embedders.items()})
        proxy["reference_store"] = {**srpo["proxy"]["reference_store"], "dir": str(references)}
    return settings_from_dict({"proxy": proxy, "backends": chosen})


def _client_block(scenario: dict[str, Any], endpoint: str, media_root: Path) -> dict[str, Any]:
    overlay = OVERLAY_D if scenario.get("progress") else OVERLAY_B
    block = _shipped_block(overlay)  # run B (or D) as shipped
    block.update({"endpoint": endpoint, "backend": scenario["name"], "timeout": 60, "max_retries": 1,
                  "temp_video_dir": str(media_root)})
    block.update(scenario.get("block", {}))
    return block


def _runner_spec(scenario: dict[str, Any], block: dict[str, Any] | None) -> dict[str, Any]:
    spec = {k: scenario[k] for k in ("name", "reward_coef", "use_rel_reward", "max_episode_steps",
                                     "inject_success", "keep_frames") if k in scenario}
    spec["steps"] = scenario.get("steps", STEPS)
    spec["chunk"] = 8
    spec["reward_model"] = block
    return spec


def _run(python: str, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as stderr:
        return subprocess.Popen([python, str(RUNNER), *args], stdout=subprocess.PIPE, stderr=stderr,
                                env=clean_env(), cwd=REPO)


def _finish(proc: subprocess.Popen, out: Path, log: Path, what: str, deadline: float) -> dict[str, Any]:
    try:
        stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{what} runner timed out; log tail:\n{log.read_text(errors='replace')[-4000:]}")
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"{what} runner failed ({proc.returncode}); log tail:\n{log.read_text(errors='replace')[-4000:]}"
                    f"\nstdout tail: {stdout.decode(errors='replace')[-2000:]}")
    with np.load(out) as data:
        result = json.loads(str(data["result_json"]))
        result["_frames"] = {k.split("__", 1)[1]: data[k] for k in data.files if k.startswith("main_images__")}
        result["_wrists"] = {k.split("__", 1)[1]: data[k] for k in data.files if k.startswith("wrist_images__")}
    return result


def _audit_lines(path: Path) -> list[dict]:
    """The episodes' lines of an audit log (the monitor's own lines, written at a clean stop, carry no metadata)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [line for line in lines if isinstance(line.get("metadata"), dict | list)]


@pytest.fixture(scope="module")
def tier(tmp_path_factory) -> Tier:
    python = rlinf_python()  # skip (or fail under VLM_REQUIRE_REAL=1) before starting anything
    reference = reference_vllm()
    started = time.perf_counter()
    work = tmp_path_factory.mktemp("real_rlinf")
    media_root = work / "media"
    media_root.mkdir()
    plan = [dict(s) for s in PLAN] + ([dict(REAL_VLLM)] if reference else [])
    model = _yaml(SHIPPED_PROXY)["backends"][QWEN]["model"]
    log = work / "runner.log"
    tiny: TinyVLLM | None = None
    fakes: dict[str, FakeVLLMThread] = {}
    embedders: dict[str, FakeVLLMThread] = {}  # run D: served as configs/srpo.yaml's embedding model
    embed_model = _yaml(SHIPPED_SRPO)["backends"][EMBED]["model"]
    references: dict[str, Any] = {}
    proxies: list[ProxyServerThread] = []
    real_vllm: dict[str, Any] = {}
    try:
        if reference:  # started once the unpatched episode is done: not during the costliest env build
            tiny = TinyVLLM(*reference, work, served_model_name=model,
                            start_when=lambda: log.exists() and '"scenario": "unpatched_off"' in log.read_text())
            tiny.start()
        for scenario in plan:
            if "replies" in scenario:
                fake = FakeVLLMThread(FakeConfig(served_model_name=model, default_text="(no reply scripted)")).start()
                fake.fake.state.reply_fn = _reply_fn(scenario["replies"])
                fakes[scenario["name"]] = fake
            elif scenario.get("progress"):
                embedders[scenario["name"]] = FakeVLLMThread(FakeConfig(served_model_name=embed_model)).start()
        audit, audit_real = work / "audit.jsonl", work / "audit-real.jsonl"
        proxy = ProxyServerThread(_proxy_settings(
            {n: f.base_url for n, f in fakes.items()}, media_root, audit,
            embedders={n: f.base_url for n, f in embedders.items()}, references=work / "references",
            views={s["name"]: s["extra_view"] for s in plan if s.get("extra_view")})).start()
        proxies.append(proxy)
        proxy_real = None
        if tiny is not None:
            proxy_real = ProxyServerThread(_proxy_settings({"real_vllm": tiny.base_url}, media_root, audit_real,
                                                           real=True)).start()
            proxies.append(proxy_real)

        specs = []
        for scenario in plan:
            if scenario.get("reward_model", "unset") is None:
                block = None
            elif scenario.get("down"):
                block = _client_block(scenario, f"http://127.0.0.1:{free_port()}/score", media_root)
            elif scenario.get("real"):
                block = _client_block(scenario, f"{proxy_real.url}/score", media_root)
            else:
                block = _client_block(scenario, f"{proxy.url}/score", media_root)
            spec = _runner_spec(scenario, block)
            if scenario.get("real"):
                spec["wait_for"] = {"url": f"{proxy_real.url}/health", "timeout_s": 600}
            specs.append(spec)
        plan_file, out = work / "plan.json", work / "result.npz"
        plan_file.write_text(json.dumps(specs))
        check_init = {"absent": "absent", "null": None, "enable_false": {"enable": False},
                      "run_a": _shipped_block(OVERLAY_A),
                      "run_b": _shipped_block(OVERLAY_B),
                      "run_b_zero": {**_shipped_block(OVERLAY_B),
                                     "fail_on_request_error": False, "fallback": "zero"},
                      "run_d": _shipped_block(OVERLAY_D)}
        proc = _run(python, ["--patched", "--unpatched-first", "--scenarios", str(plan_file), "--out", str(out),
                             "--check-init", json.dumps(check_init)], log)
        result = _finish(proc, out, log, "the", time.monotonic() + RUN_TIMEOUT_S)
        runner_s = time.perf_counter() - started
        status, references = http_json(f"{proxy.url}/progress/references")
        assert status == 200, references

        if tiny is not None:
            real_vllm = {"error": tiny.error, "timings": dict(tiny.timings), "log_tail": tiny.log_tail()}
            # The prompt's text alone, tokenized by the same server: prompt_tokens minus this is
            # what the video cost (the fake scenario with the same prompt recorded the text).
            texts = {}
            for body in fakes["binary_rel_inline"].chat_requests:
                text_only = [{"role": m["role"], "content": [p for p in m["content"] if p.get("type") == "text"]}
                             if isinstance(m.get("content"), list) else m for m in body["messages"]]
                status, answer = http_json(f"http://127.0.0.1:{tiny.port}/tokenize",
                                           {"model": model, "messages": text_only})
                texts[_env_of(body)] = answer.get("count") if status == 200 else f"HTTP {status}: {answer}"
            real_vllm["text_tokens"] = texts
            proxy.flush_audit()
            written = {}
            for line in _audit_lines(audit):
                written.setdefault(line["backend"], []).append(line)
            episodes_dir = work / "env-episodes"
            _write_env_episodes({ep["name"]: ep for ep in result["scenarios"]}, result["_frames"], written,
                                episodes_dir)
            real_vllm["cascade_eval"] = _eval_cascade_on(tiny, model, episodes_dir, work)
    finally:
        for server in proxies:
            server.stop()
        chats = {name: list(fake.chat_requests) for name, fake in (fakes | embedders).items()}
        embeddings = {name: list(fake.embedding_requests) for name, fake in (fakes | embedders).items()}
        for fake in (fakes | embedders).values():
            fake.stop()
        if tiny is not None:
            tiny.stop()

    episodes = {ep["name"]: ep for ep in result["scenarios"]}
    SUMMARY["timings"] = {
        "tier_fixture_s": time.perf_counter() - started, "runner_done_s": runner_s, "runner": result["timings"],
        "resets_s": {name: ep["timings"].get("reset_s") for name, ep in episodes.items()},
        "step_mean_s": {name: ep["timings"].get("step_mean_s") for name, ep in episodes.items()},
        "scenario_s": {name: ep["timings"].get("total_s") for name, ep in episodes.items()},
        "real_vllm": real_vllm.get("timings")}
    SUMMARY["versions"] = result.get("versions")
    audit_lines: dict[str, list[dict]] = {}
    for line in _audit_lines(audit) + _audit_lines(audit_real):
        audit_lines.setdefault(line["backend"], []).append(line)
    return Tier(result=result, episodes=episodes, frames=result["_frames"], chats=chats, embeddings=embeddings,
                references=references, audit=audit_lines, plan={s["name"]: s for s in plan}, media_root=media_root,
                real_vllm=real_vllm, wrists=result["_wrists"])


# -- helpers over the recorded episodes -----------------------------------------------------------
def _column(rows: list[list[Any]], env: int) -> list[Any]:
    return [row[env] for row in rows]


def _end_step(ep: dict[str, Any], env: int) -> int:
    """1-based step the episode of `env` ended: its first termination or truncation."""
    for t, (term, trunc) in enumerate(zip(ep["terminations"], ep["truncations"], strict=True), start=1):
        if term[env] or trunc[env]:
            return t
    raise AssertionError(f"env {env} never ended in {ep['name']}")


def _expected_score(tier: Tier, name: str, env: int) -> tuple[float, bool]:
    """(the score behind the reward, whether it is a fallback) for a fake-backed scenario."""
    scenario = tier.plan[name]
    policy = tier.episodes[name]["hook_config"]["failure_policy"]
    reply = None if scenario.get("down") else scenario["replies"][env]
    if reply is not None and reply.isdigit():
        return int(reply) / 100, False
    injected = scenario.get("inject_success", {}).get(str(env))
    success = injected is not None and injected <= _end_step(tier.episodes[name], env)
    assert policy in ("zero", "env_success"), policy
    return (float(success) if policy == "env_success" else 0.0), True


def _ok(ep: dict[str, Any]) -> dict[str, Any]:
    assert "skipped" not in ep, ep["skipped"]
    assert "error" not in ep, json.dumps(ep["error"], indent=1)
    return ep


# -- the patch and the config block ---------------------------------------------------------------
def test_the_patch_applies_to_rlinf_0_3_0_without_fuzz(tier):
    patch = tier.result["patch"]
    assert tier.result["versions"]["rlinf"] == "0.3.0"
    assert patch["git_apply_check"]["rc"] == 0, patch["git_apply_check"]["output"]
    assert patch["patch"]["rc"] == 0
    assert "fuzz" not in patch["patch"]["output"].lower(), patch["patch"]["output"]
    assert tier.result["module_file"] != patch["original"]  # a patched copy, site-packages untouched


def test_the_patched_init_reads_the_reward_model_block(tier):
    report = tier.result["check_init"]
    for off in ("absent", "null", "enable_false", "run_a"):
        assert report[off] == {"has_attr": True, "vlm_reward": None}, (off, report[off])
    assert report["run_b"]["vlm_reward"] == "LiberoVLMReward"
    assert report["run_b"]["failure_policy"] == "raise"  # the shipped run B stops on a failed episode
    assert report["run_b_zero"]["failure_policy"] == "zero"
    assert report["run_b"]["reward_coef"] == 5.0 and report["run_b"]["use_rel_reward"] is True
    assert report["run_b"]["reward_source"] == "score"
    assert report["run_d"]["vlm_reward"] == "LiberoVLMReward" and report["run_d"]["reward_source"] == "progress"
    assert report["run_d"]["failure_policy"] == "raise"  # the shipped run D stops on a failed episode too


# -- reward_model off: nothing changes ------------------------------------------------------------
def test_reward_model_off_is_identical_to_the_unpatched_env(tier):
    plain, patched = tier.episodes["unpatched_off"], _ok(tier.episodes["off"])
    _ok(plain)
    assert patched["config"]["reward_model"] is None  # `reward_model: null` (the patch's `or {}`)
    assert not patched["hook_enabled"]
    for key in ("rewards", "terminations", "truncations", "frame_sha256", "wrist_sha256", "states", "episode",
                "info_keys", "task_descriptions", "reset_state_ids", "task_ids", "trial_ids", "types", "digest"):
        assert patched[key] == plain[key], key
    for a, b in zip(patched["chunks"], plain["chunks"], strict=True):
        assert a == b
    assert tier.result["unpatched_attr_vlm_reward"] is False and tier.result["patched_attr_vlm_reward"] is True
    assert tier.result["original_module_file"] == tier.result["patch"]["original"]  # site-packages' own
    # ... and the reward is RLinf's native one (the injected success of env 1 at step 6)
    for env in (0, 1):
        success = _column(plain["terminations"], env)
        assert _column(plain["rewards"], env) == native_step_rewards(success, reward_coef=5.0, use_rel_reward=True)
    assert _column(plain["rewards"], 1)[5] == 5.0 and sum(_column(plain["rewards"], 0)) == 0.0


def test_the_scenarios_replay_the_same_simulation(tier):
    """Same initial states and actions: every episode sees the unpatched episode's frames; the
    reward model changes rewards only."""
    reference = tier.episodes["unpatched_off"]
    assert reference["task_descriptions"][0] == list(TASKS)
    assert reference["task_ids"] == list(TASK_IDS)
    for name, ep in tier.episodes.items():
        if ep.get("skipped"):
            continue
        n = len(ep["frame_sha256"])
        assert ep["frame_sha256"] == reference["frame_sha256"][:n], name
        assert ep["task_descriptions"][0] == list(TASKS), name


# -- reward_model on: RLinf's rule on the VLM's score ---------------------------------------------
@pytest.mark.parametrize("name", ["binary_rel_inline", "continuous_nonrel_path", "zero_unparseable",
                                  "env_success_down"])
def test_the_end_step_reward_is_rlinf_rule_on_the_vlm_score(tier, name):
    ep = _ok(tier.episodes[name])
    config = ep["hook_config"]
    coef, rel = ep["config"]["reward_coef"], ep["config"]["use_rel_reward"]
    assert config["reward_coef"] == coef and config["use_rel_reward"] == rel
    steps = len(ep["rewards"])
    for env in (0, 1):
        end = _end_step(ep, env)
        score, fallback = _expected_score(tier, name, env)
        mapped = mapped_score(score, binary_reward=config["binary_reward"],
                              success_threshold=config["success_threshold"])
        expected = rule_rewards(steps, end, mapped, reward_coef=coef, use_rel_reward=rel)
        assert expected == pytest.approx(terminal_step_rewards(steps, end - 1, mapped, reward_coef=coef,
                                                               use_rel_reward=rel))
        got = _column(ep["rewards"], env)
        assert got == pytest.approx(expected, abs=1e-6), (env, end, score, got)
        last = ep["episode"][-1]
        assert last["vlm_score"][env] == pytest.approx(score, abs=1e-6)
        assert last["vlm_fallback"][env] == float(fallback)
        assert ep["episode"][end - 1]["vlm_score"][env] == pytest.approx(score, abs=1e-6)
        # RLinf's own episode stats stay simulator-driven
        assert last["success_once"][env] == any(_column(ep["terminations"], env))
    assert ep["hook"]["episodes_scored"] == 2
    assert ep["hook"]["failures"] == sum(_expected_score(tier, name, env)[1] for env in (0, 1))


def test_a_vlm_that_agrees_with_the_simulator_reproduces_run_a(tier):
    """Env 1 succeeds (injected) at step 6 in both episodes; scored 0.50 (>= the 0.5 threshold, so
    1) its rewards are exactly what RLinf's own native code paid in the reward-model-off episode."""
    native, vlm = tier.episodes["unpatched_off"], _ok(tier.episodes["binary_rel_inline"])
    assert _column(vlm["rewards"], 1) == _column(native["rewards"], 1)
    assert _column(native["rewards"], 1)[:6] == [0.0] * 5 + [5.0]
    assert [c["rewards"][1] for c in vlm["chunks"]] == [c["rewards"][1] for c in native["chunks"]]


def test_fallback_zero_pays_nothing_even_after_a_simulator_success(tier):
    ep = _ok(tier.episodes["zero_unparseable"])
    assert ep["terminations"][3][0] is True  # env 0 succeeded (injected) at step 4 ...
    assert _column(ep["rewards"], 0) == [0.0] * len(ep["rewards"])  # ... but the VLM failed: 0
    assert ep["episode"][-1]["vlm_fallback"] == [1.0, 0.0]
    assert ep["hook"]["client_stats"]["failure_reasons"] == {"unparseable_score": 1}


def test_fallback_env_success_pays_the_simulator_flag(tier):
    ep = _ok(tier.episodes["env_success_down"])
    assert ep["episode"][-1]["vlm_fallback"] == [1.0, 1.0]
    assert ep["episode"][-1]["vlm_score"] == [0.0, 1.0]
    assert _column(ep["rewards"], 1)[4:] == [4.0] * (len(ep["rewards"]) - 4)  # non-rel: from step 5 on
    assert set(ep["hook"]["client_stats"]["failure_reasons"]) == {"connection_error"}


@pytest.mark.parametrize(("name", "error_type", "code", "status"), [
    ("raise_down", "APIConnectionError", "connection_error", None),
    ("raise_unparseable", "BadGatewayError", "unparseable_score", 502),
])
def test_fallback_raise_raises_the_typed_error_in_the_env_process(tier, name, error_type, code, status):
    ep = tier.episodes[name]
    assert ep["hook_config"]["failure_policy"] == "raise"
    error = ep.get("error")
    assert error is not None, "the episode ended without an exception"
    assert error["type"] == error_type and error["module"].startswith("rlinf_client")
    assert "RewardAPIError" in error["classes"] and "RewardClientError" in error["classes"]
    assert error["code"] == code and error["status_code"] == status
    assert error["step"] == ep["spec"]["steps"]  # raised by the step that ended the episodes
    assert len(ep["rewards"]) == ep["spec"]["steps"] - 1  # that step never returned


# -- the frames the model gets --------------------------------------------------------------------
def _sent_frames(tier: Tier, name: str) -> dict[int, tuple[np.ndarray, dict, list[str]]]:
    """Per env: the decoded JPEGs of the video the fake vLLM received, the request, their sha256."""
    sent = {}
    for body in tier.chats[name]:
        video = [part for m in body["messages"] if isinstance(m.get("content"), list) for part in m["content"]
                 if part.get("type") == "video_url"][0]  # the main view (a second camera's video follows it)
        jpegs = decode_video_part(video["video_url"]["url"], num_frames=-1)
        sent[_env_of(body)] = (decode_jpegs(jpegs), body, [hashlib.sha256(j).hexdigest() for j in jpegs])
    return sent


@pytest.mark.parametrize(("name", "tolerance"), [("binary_rel_inline", 2.5), ("continuous_nonrel_path", 4.5)])
def test_the_model_gets_the_env_main_images_upright_in_order_at_336(tier, name, tolerance):
    """Inline (JPEGs the client made in the env) and path (a temp MP4 the proxy reads back): the env's own main_images,
    uniformly spread (first = the reset frame, last = the end step's), in order, upright (the env
    already turned the agent view 180 degrees; nobody turns it again), resized by qwen-vl-utils'
    video rule (256x256 is below its 128*28*28 floor: 336x336). Compared with the frames the runner
    recorded, resized here; `tolerance` is the codec's mean absolute error (JPEG, or MP4 + JPEG)."""
    import cv2

    ep = _ok(tier.episodes[name])
    recorded = tier.frames[name]  # [1 + steps, env, 256, 256, 3]
    assert recorded.shape[1:] == (2, 256, 256, 3) and recorded.dtype == np.uint8
    sent = _sent_frames(tier, name)
    assert sorted(sent) == [0, 1]
    audit = {line["metadata"]["env"]: line for line in tier.audit[name]}
    for env, (frames, body, sha) in sent.items():
        end = _end_step(ep, env)
        assert audit[env]["frames"]["sha256"] == sha  # the audit line names exactly these JPEGs
        # Inline: the client in RLinf's env made the 336x336 JPEGs itself (frame_encoding: auto, its
        # own OpenCV) and the proxy forwarded them; a path is an MP4 the proxy decodes.
        made_in_env = ep["hook_config"]["transport"] != "path"
        assert audit[env]["frames"]["forwarded"] == (len(sha) if made_in_env else 0)
        indices = uniform_indices(end + 1, 16)  # the reset frame + one per step, up to the end step
        assert frames.shape == (len(indices), 336, 336, 3), frames.shape
        assert body["media_io_kwargs"]["video"]["num_frames"] == len(indices)
        assert audit[env]["frames"]["indices"] == list(range(len(indices)))  # the client sent only these
        source = np.stack([cv2.resize(recorded[t, env], (336, 336), interpolation=cv2.INTER_CUBIC)
                           for t in range(end + 1)]).astype(np.int16)
        errors = [mad(frames[i], source[t]) for i, t in enumerate(indices)]
        assert max(errors) < tolerance, errors
        rotated = [mad(frames[i], source[t][::-1, ::-1]) for i, t in enumerate(indices)]
        assert min(rotated) > 5 * max(errors), (rotated, errors)  # upright, not turned again
        other = [mad(frames[i], cv2.resize(recorded[t, 1 - env], (336, 336))) for i, t in enumerate(indices)]
        assert min(other) > 5 * max(errors), (other, errors)  # this env's frames, not the other's
        # Order and indices: where the arm moves, each frame sent is closest to its own step.
        moving = (source.max(0) - source.min(0)).sum(-1) > 90
        assert moving.mean() > 0.01, "the arm hardly moved: order cannot be told from pixels"
        distance = np.array([[np.abs(f.astype(np.int16) - s)[moving].mean() for s in source] for f in frames])
        assert list(distance.argmin(1)) == indices, np.round(distance, 1)
    if ep["hook_config"]["transport"] == "path":
        assert list(tier.media_root.iterdir()) == []  # the temporary MP4s are gone


def test_the_env_wrist_images_go_as_a_second_video_when_the_config_asks(tier):
    """reward_model.extra_view: wrist_images, to a backend whose frames.extra_view is second_video:
    the env's own wrist camera, at the steps of the main view's frames, as the second video part
    (sent inline beside the main view's temp MP4), named in the audit line; not the agent view again."""
    import cv2

    name = "continuous_nonrel_path"
    ep = _ok(tier.episodes[name])
    assert ep["hook_config"]["extra_view"] == "wrist_images"
    wrists, mains = tier.wrists[name], tier.frames[name]  # [1 + steps, env, 256, 256, 3]
    assert wrists.shape == mains.shape and wrists.dtype == np.uint8
    audit = {line["metadata"]["env"]: line for line in tier.audit[name]}
    assert len(tier.chats[name]) == 2
    for body in tier.chats[name]:
        env = _env_of(body)
        main, wrist = [part for m in body["messages"] if isinstance(m.get("content"), list) for part in m["content"]
                       if part.get("type") == "video_url"]
        jpegs = decode_video_part(wrist["video_url"]["url"], num_frames=-1)
        frames = decode_jpegs(jpegs)
        extra = audit[env]["frames"]["extra_view"]
        assert extra["placement"] == "second_video"
        assert extra["sha256"] == [hashlib.sha256(j).hexdigest() for j in jpegs]
        end = _end_step(ep, env)
        indices = uniform_indices(end + 1, 16)
        assert frames.shape == (len(indices), 336, 336, 3), frames.shape
        source = np.stack([cv2.resize(wrists[t, env], (336, 336), interpolation=cv2.INTER_CUBIC)
                           for t in range(end + 1)]).astype(np.int16)
        errors = [mad(frames[i], source[t]) for i, t in enumerate(indices)]
        assert max(errors) < 2.5, errors  # one JPEG of the env's own wrist frame
        agent = [mad(frames[i], cv2.resize(mains[t, env], (336, 336))) for i, t in enumerate(indices)]
        assert min(agent) > 5 * max(errors), (agent, errors)  # the wrist camera, not the agent view again


def test_the_env_success_flag_travels_as_metadata_into_the_audit_log(tier):
    for name in ("binary_rel_inline", "continuous_nonrel_path", "zero_unparseable"):
        ep = tier.episodes[name]
        lines = sorted(tier.audit[name], key=lambda line: line["metadata"]["env"])
        assert [line["metadata"]["env"] for line in lines] == [0, 1], name
        for env, line in enumerate(lines):
            meta = line["metadata"]
            end = _end_step(ep, env)
            assert meta["env_success"] is bool(ep["terminations"][end - 1][env]), (name, env)
            assert meta["task_id"] == TASK_IDS[env]
            assert meta["step"] == end
            assert str(meta["episode_id"]).startswith(f"env{env}-ep")
            assert line["task_text"] == TASKS[env]
            assert line["frames"]["count"] == min(16, end + 1) and line["frames"]["size"] == [336, 336]
    # env 1's success (injected at step 6) and env 0's failure, as the simulator saw them
    flags = {line["metadata"]["env"]: line["metadata"]["env_success"] for line in tier.audit["binary_rel_inline"]}
    assert flags == {0: False, 1: True}
    failed = [line for line in tier.audit["zero_unparseable"] if "error" in line]
    assert [(f["metadata"]["env"], f["metadata"]["env_success"], f["error"]["code"]) for f in failed] == [
        (0, True, "unparseable_score")]


# -- run D: SRPO progress from the proxy's embeddings ---------------------------------------------
RUN_D = ("progress_first", "progress_stored")
# per env (0: task 4, never a success; 1: task 8), what the proxy must have answered
RUN_D_OUTCOMES = {"progress_first": ("no_reference", "success"), "progress_stored": ("no_reference", "progress")}


def _progress_lines(tier: Tier, name: str) -> dict[int, dict]:
    """The proxy's audit lines of a run D scenario (its backend), one per env."""
    lines = tier.audit[name]
    assert [line["kind"] for line in lines] == ["progress"] * len(lines), lines
    by_env = {line["metadata"]["env"]: line for line in lines}
    assert sorted(by_env) == [0, 1] and len(lines) == 2, lines
    return by_env


def _embedded_vector(tier: Tier, name: str, env: int) -> np.ndarray:
    """What the fake embedded for `env`'s episode: the mean colour / 255 (and a 1) of the JPEGs of
    the /v1/embeddings request whose frames the audit line names, recomputed here."""
    from io import BytesIO

    from PIL import Image

    want = _progress_lines(tier, name)[env]["frames"]["sha256"]
    for body in tier.embeddings[name]:
        video = [part for m in body["messages"] if isinstance(m.get("content"), list) for part in m["content"]
                 if part.get("type") == "video_url"][0]  # the main view (a second camera's video follows it)
        jpegs = decode_video_part(video["video_url"]["url"], num_frames=-1)
        if [hashlib.sha256(j).hexdigest() for j in jpegs] == want:
            means = [np.asarray(Image.open(BytesIO(j)).convert("RGB"), np.float64).reshape(-1, 3).mean(0)
                     for j in jpegs]
            return np.array([*(np.mean(means, axis=0) / 255.0), 1.0])
    raise AssertionError(f"no /v1/embeddings request of {name} carried env {env}'s frames")


@pytest.mark.parametrize("name", RUN_D)
def test_run_d_pays_a_success_as_run_a_and_a_failure_its_progress_times_progress_coef(tier, name):
    """The real env's rewards are RLinf's rule on what the hook maps the proxy's answer to: success
    1, a failure progress x progress_coef (the progress read from the proxy's audit line), a
    failure without a reference the native 0; logged as vlm_score / vlm_no_reference."""
    ep = _ok(tier.episodes[name])
    config = ep["hook_config"]
    assert config["reward_source"] == "progress" and config["binary_reward"] is False
    assert config["backend"] == name and config["on_no_reference"] == "native"
    assert config["failure_policy"] == "raise"  # run D as shipped: any failed item would stop the episode
    coef, rel, progress_coef = config["reward_coef"], config["use_rel_reward"], config["progress_coef"]
    assert (coef, rel, progress_coef) == (5.0, True, 0.6)
    lines = _progress_lines(tier, name)
    steps = len(ep["rewards"])
    assert steps == ep["spec"]["steps"] == 8
    for env, outcome in enumerate(RUN_D_OUTCOMES[name]):
        line, end = lines[env], _end_step(ep, env)
        assert line["outcome"] == outcome, line
        progress = line["progress"]
        paid = {"success": 1.0, "progress": None, "no_reference": 0.0}[outcome]
        if outcome == "progress":
            assert 0.0 <= progress <= 1.0
            paid = progress * progress_coef
        else:
            assert progress == (1.0 if outcome == "success" else None)
        got = _column(ep["rewards"], env)
        assert got == pytest.approx(rule_rewards(steps, end, paid, reward_coef=coef, use_rel_reward=rel),
                                    abs=1e-6), (env, end, line)
        assert got[end - 1] == pytest.approx(coef * paid, abs=1e-6)
        shown = 0.0 if progress is None else progress
        for t, info in enumerate(ep["episode"], start=1):  # 0 until the end step, then the answer's
            assert info["vlm_score"][env] == pytest.approx(shown if t >= end else 0.0, abs=1e-6), (t, info)
            assert info["vlm_no_reference"][env] == (float(outcome == "no_reference") if t >= end else 0.0)
            assert info["vlm_fallback"][env] == 0.0
        assert ep["episode"][-1]["success_once"][env] == any(_column(ep["terminations"], env))
    assert ep["hook"]["episodes_scored"] == 2 and ep["hook"]["failures"] == 0
    assert ep["hook"]["no_reference"] == 1  # env 0: task 4 never had a success


def test_run_d_pays_a_success_exactly_what_rlinf_native_code_paid(tier):
    """Env 1 succeeds (injected) at step 6 here and in the reward-model-off episode: the same
    rewards; env 0's failure without a reference gets the native 0, as there."""
    native, ep = tier.episodes["unpatched_off"], _ok(tier.episodes["progress_first"])
    steps = len(ep["rewards"])
    for env in (0, 1):
        assert _column(ep["rewards"], env) == _column(native["rewards"], env)[:steps]
    assert _column(ep["rewards"], 1) == [0.0] * 5 + [5.0, 0.0, 0.0]


def test_run_d_adds_vlm_no_reference_to_the_episode_info_and_score_runs_do_not(tier):
    """The hook documents env/vlm_no_reference for reward_source: progress only: it is in every
    step's infos["episode"] of run D (as RLinf's to_tensor made vlm_score), in no score run's."""
    for name in RUN_D:
        ep = _ok(tier.episodes[name])
        for info in ep["episode"]:
            assert {"vlm_score", "vlm_fallback", "vlm_no_reference"} <= set(info), (name, sorted(info))
        types = ep["types"]["infos_episode"]
        assert types["vlm_no_reference"] == types["vlm_score"], types
    for name in ("binary_rel_inline", "continuous_nonrel_path", "zero_unparseable", "env_success_down"):
        for info in _ok(tier.episodes[name])["episode"]:
            assert "vlm_score" in info and "vlm_no_reference" not in info, (name, sorted(info))


def test_run_d_sends_the_real_env_task_ids_and_success_flags(tier):
    for name in RUN_D:
        ep = _ok(tier.episodes[name])
        assert ep["task_ids"] == list(TASK_IDS)  # LiberoEnv.task_ids
        for env, line in _progress_lines(tier, name).items():
            meta, end = line["metadata"], _end_step(ep, env)
            assert meta["task_id"] == ep["task_ids"][env], (name, env, meta)
            assert meta["env_success"] is bool(ep["terminations"][end - 1][env]), (name, env)
            # the run's one identity: the overlay's run and a digest of this launch's job
            identity = "runD_srpo-" + hashlib.sha256(TIER_JOB.encode()).hexdigest()[:10]
            assert meta["step"] == end and meta["run"] == identity
            assert str(meta["episode_id"]).startswith(f"env{env}-ep")
            assert line["task_text"] == TASKS[env]
            assert line["frames"]["count"] == min(16, end + 1)
    ends = {name: [_end_step(tier.episodes[name], env) for env in (0, 1)] for name in RUN_D}
    assert ends == {"progress_first": [8, 6], "progress_stored": [8, 8]}


def test_run_d_embeds_the_episodes_through_v1_embeddings_not_chat(tier):
    model = _yaml(SHIPPED_SRPO)["backends"][EMBED]["model"]
    for name in RUN_D:
        assert tier.chats[name] == [], name
        bodies = tier.embeddings[name]
        assert len(bodies) == 2, name  # one per episode
        assert {body["model"] for body in bodies} == {model}
        for env in (0, 1):
            _embedded_vector(tier, name, env)  # each env's frames went to /v1/embeddings
    for name in ("binary_rel_inline", "continuous_nonrel_path", "zero_unparseable"):
        assert tier.embeddings[name] == [], name  # and /score never embeds


def test_run_d_a_success_reaches_the_reference_store_and_rates_a_later_failure(tier):
    """progress_first's success of task 8 (its own request) is kept by the proxy; progress_stored's
    failure of task 8 is measured against it: its distance is to that success's embedding."""
    store = tier.references["store"]
    assert store is not None
    tasks = {entry["task_id"]: entry for entry in store["tasks"]}
    assert sorted(tasks) == [str(TASK_IDS[1])], store  # task 4 never succeeded: nothing kept for it
    kept = tasks[str(TASK_IDS[1])]
    assert (kept["successes"], kept["demonstrations"]) == (1, 0)
    assert kept["model"] == _yaml(SHIPPED_SRPO)["backends"][EMBED]["model"]
    first = _progress_lines(tier, "progress_first")
    assert first[1]["outcome"] == "success" and first[0]["outcome"] == "no_reference"
    line = _progress_lines(tier, "progress_stored")[1]
    reference = line["reference"]
    assert (reference["batch_successes"], reference["stored"], reference["failures"]) == (0, 1, 1), reference
    # the task's single failure of the request: normalised distance 0.5, progress sigmoid(0) (docs/progress.md)
    assert line["normalised_distance"] == 0.5 and line["progress"] == 0.5
    success, failure = _embedded_vector(tier, "progress_first", 1), _embedded_vector(tier, "progress_stored", 1)
    assert line["distance"] == pytest.approx(float(np.linalg.norm(failure - success)), rel=1e-6, abs=1e-12)
    assert line["distance"] > 0  # a failure that ran to step 8 looks different from the success at step 6


# -- a real vllm serve ----------------------------------------------------------------------------
def test_a_real_tiny_vllm_behind_the_proxy(tier):
    if "real_vllm" not in tier.episodes:
        pytest.skip("VLM_REFERENCE_VLLM is not set: no real `vllm serve` episode (make test-real-rlinf sets it)")
    assert tier.real_vllm["error"] is None, tier.real_vllm
    ep = _ok(tier.episodes["real_vllm"])
    lines = sorted(tier.audit["real_vllm"], key=lambda line: line["metadata"]["env"])
    assert [line["metadata"]["env"] for line in lines] == [0, 1]
    for env, line in enumerate(lines):
        # 16 frames of 336x336 reached the model: ceil(16/2) * (336/28)^2 + 2 = 1154 vision tokens,
        # as the real server counted them next to the prompt's text alone
        assert line["frames"]["count"] == 16 and line["frames"]["size"] == [336, 336]
        assert line["frames"]["vision_tokens"] == 1154
        assert line["usage"]["prompt_tokens"] == tier.real_vllm["text_tokens"][env] + 1154, (line, tier.real_vllm)
        if "error" in line:  # random weights: no percentage in the reply
            assert line["error"]["code"] == "unparseable_score"
            score, fallback = 0.0, 1.0
        else:
            score, fallback = line["score"], 0.0
        assert ep["episode"][-1]["vlm_fallback"][env] == fallback
        assert ep["episode"][-1]["vlm_score"][env] == pytest.approx(score, abs=1e-6)
        mapped = mapped_score(score, binary_reward=True)
        assert _column(ep["rewards"], env) == pytest.approx(
            rule_rewards(len(ep["rewards"]), _end_step(ep, env), mapped, reward_coef=5.0, use_rel_reward=True))
    SUMMARY["real_vllm_outcome"] = [line.get("error", {}).get("code") or line.get("score") for line in lines]


def test_reward_table(tier):
    """Not a check: collects score -> reward per mapping for the summary at the end of the run."""
    rows = []
    for name in ("binary_rel_inline", "continuous_nonrel_path", "zero_unparseable", "env_success_down", "real_vllm",
                 "progress_first", "progress_stored"):
        ep = tier.episodes.get(name)
        if not ep or ep.get("skipped") or ep.get("error"):
            continue
        config = ep["hook_config"]
        for env in (0, 1):
            end = _end_step(ep, env)
            rewards = _column(ep["rewards"], env)
            rows.append({"scenario": name, "env": env, "score": ep["episode"][-1]["vlm_score"][env],
                         "fallback": ep["episode"][-1]["vlm_fallback"][env],
                         "binary": config["binary_reward"], "use_rel_reward": config["use_rel_reward"],
                         "reward_coef": config["reward_coef"], "end_step": end, "reward_at_end": rewards[end - 1],
                         "after_end": rewards[end:end + 1],
                         "grpo_return": grpo_episode_return(rewards, [a or b for a, b in zip(
                             _column(ep["terminations"], env), _column(ep["truncations"], env), strict=True)])})
    SUMMARY["reward_table"] = rows
    assert rows


def _write_env_episodes(episodes: dict[str, dict[str, Any]], frames: dict[str, np.ndarray],
                        audit: dict[str, list[dict]], directory: Path) -> list[dict]:
    """Each env's main images of two scenarios up to its end step, its own success flag and task
    text, written as `eval` reads them (episodes.jsonl and one .npy each)."""
    directory.mkdir(parents=True, exist_ok=True)
    listing = []
    for name in ("binary_rel_inline", "continuous_nonrel_path"):
        ep = _ok(episodes[name])
        tasks = {line["metadata"]["env"]: line["task_text"] for line in audit[name]}
        for env in (0, 1):
            end = _end_step(ep, env)
            np.save(directory / f"{name}-{env}.npy", np.ascontiguousarray(frames[name][: end + 1, env]))
            listing.append({"file": f"{name}-{env}.npy", "task_text": tasks[env], "task_id": TASK_IDS[env],
                            "success": bool(ep["terminations"][end - 1][env])})
    (directory / "episodes.jsonl").write_text("".join(json.dumps(item) + "\n" for item in listing))
    return listing


def _eval_cascade_on(tiny: TinyVLLM, model: str, episodes_dir: Path, work: Path) -> dict[str, Any]:
    """`eval` of a cascade on the real tiny `vllm serve`: P(done) then the shipped Qwen template, both
    on the one server (one pool), every stage on every episode the env wrote; the frontier replayed."""
    from vlm_reward_cli import main

    qwen = {k: v for k, v in _yaml(SHIPPED_PROXY)["backends"][QWEN].items() if k != "launch"}
    stage = {**qwen, "model": model, "endpoints": [tiny.base_url], "max_model_len": 8192,
             "frames": {"nframes": 8, "max_pixels": 200704}}
    config = work / "cascade-eval.yaml"
    config.write_text(yaml.safe_dump({
        "proxy": {"prompts_dir": str(REPO / "prompts")},
        "backends": {"p_done": {**stage, "prompt": "topreward", "score_mode": "auto"}, "qwen": stage},
        "cascades": {"p_done_then_qwen": {"stages": [{"backend": "p_done", "band": [0.2, 0.8]},
                                                     {"backend": "qwen"}]}}}))
    out = work / "cascade-eval"
    code = main(["eval", str(episodes_dir), "--config", str(config), "--backend", "p_done_then_qwen",
                 "--out", str(out), "--random-draws", "20"])
    return {"code": code, "out": out}


def test_eval_runs_on_episodes_the_real_env_wrote_and_its_page_opens(tier, tmp_path):
    """`vlm-reward-proxy eval` on the real LIBERO env's episodes: each env's main images up to its end
    step, its own success flag and task text, written as the eval reads them. Scored with TOPReward's
    P(done) against a fake whose P("True") is the last frame's brightness (what is measured here is
    that eval runs on the env's episodes, not the model)."""
    from tests.fakes.grader import last_video_frame
    from tests.reports.browser import assert_not_blank, chromium, dom_text, screenshot
    from vlm_reward_cli import main

    chromium()  # skips (or fails under VLM_REQUIRE_BROWSER=1) before anything is built
    episodes_dir = tmp_path / "episodes"
    listing = _write_env_episodes(tier.episodes, tier.frames, tier.audit, episodes_dir)
    assert {item["success"] for item in listing} == {True, False}  # env 1's injected success, and failures

    model = _yaml(SHIPPED_PROXY)["backends"][QWEN]["model"]
    fake = FakeVLLMThread(FakeConfig(served_model_name=model)).start()
    fake.fake.state.label_fn = lambda body: {"True": float(np.log(max(last_video_frame(body).mean() / 255, 1e-6))),
                                             "False": float(np.log(0.01))}
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"proxy": {"prompts_dir": str(REPO / "prompts")}, "backends": {"p_done": {
        "model": model, "endpoints": [fake.base_url], "layout": "qwen_video", "prompt": "topreward",
        "frames": {"nframes": 8, "max_pixels": 200704}, "sampling": {"temperature": 0.0, "max_tokens": 1}}}}))
    out = tmp_path / "eval"
    try:
        code = main(["eval", str(episodes_dir), "--config", str(config), "--backend", "p_done", "--points", "4",
                     "--controls", "reversed", "--out", str(out)])
    finally:
        fake.stop()
    assert code == 0
    result = json.loads((out / "eval.json").read_text())
    records = [r for r in result["records"] if r["control"] is None]
    assert len(records) == 4 and all(len(r["curve"]) == 4 and r["score"] == r["curve"][-1] for r in records)
    assert result["methods"]["p_done"]["all tasks"]["successes"] == sum(item["success"] for item in listing)
    assert_not_blank(screenshot(out / "eval.html", tmp_path / "eval.png"), min_colours=2, min_stddev=1.0)
    assert "Which method ranks first" in dom_text(out / "eval.html")


def test_a_cascade_eval_on_the_real_tiny_vllm_draws_its_frontier_and_the_page_opens(tier, tmp_path):
    """Issue 38: the cascade's stages scored by the real server on the episodes the real env wrote,
    the frontier replayed offline (each stage alone, bands, random escalation at the same rate)."""
    from tests.reports.browser import assert_not_blank, chromium, dom_text, screenshot

    chromium()
    if "cascade_eval" not in tier.real_vllm:
        pytest.skip("VLM_REFERENCE_VLLM is not set: no real `vllm serve` (make test-real-rlinf sets it)")
    run = tier.real_vllm["cascade_eval"]
    assert run["code"] == 0
    result = json.loads((run["out"] / "eval.json").read_text())
    frontier = result["cascades"]["p_done_then_qwen"]
    stage_records = [r for r in result["cascade_records"] if r.get("stage") == "p_done"]
    assert len(stage_records) == 4  # the four env episodes, each scored by the real server
    policies = {p["policy"] for p in frontier["policies"]}
    assert {"p_done alone", "qwen alone"} <= policies and any(p.startswith("random at") for p in policies), policies
    for policy in frontier["policies"]:
        assert policy["gpu_seconds_per_episode"] > 0 and 0 <= policy["escalated_fraction"] <= 1
    page = run["out"] / "eval.html"
    assert_not_blank(screenshot(page, tmp_path / "eval.png"), min_colours=4, min_stddev=1.0)
    assert "Cascade p_done_then_qwen: cost against quality" in dom_text(page)
