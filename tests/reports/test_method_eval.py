"""`vlm-reward-proxy eval`: candidate rewards compared on episodes whose true progress is known,
through the proxy's own pipeline (in this process) against fake vLLMs whose answers depend on what
they are shown. Its AUC and VOC equal an independent computation (scipy, every pair); the reversed
controls fall; the page opens in headless Chromium.

The synthetic episodes: a success is a grey ramp from dark to bright (progress = brightness); a
failure stays dark. The three fakes read brightness: P(done) from the last frame shown, a 0-100
score from the last video frame, GVL's value per shown frame.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy.stats import spearmanr

from tests.conftest import PROMPTS_DIR, QWEN_MODEL
from tests.fakes.episodes import decode_jpeg_b64, frame_level, write_mp4
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.grader import last_video_frame
from tests.reports.browser import assert_not_blank, chromium, dom_text, screenshot
from tests.reports.expected import auc_by_pairs

TASKS = {1: "put the bowl on the plate", 2: "open the top drawer"}


def _episode(success: bool, variant: int, count: int = 20, size: int = 64) -> np.ndarray:
    top = 235 if success else 70 + 10 * variant  # a failure never gets bright
    levels = np.linspace(20, top, count).round().astype(np.uint8)
    frames = np.repeat(levels[:, None, None, None], size, axis=1).repeat(size, axis=2).repeat(3, axis=3)
    frames[:, : size // 8, : size // 8] = (variant * 37) % 256  # each episode its own corner
    return np.ascontiguousarray(frames)


def _episodes_dir(root: Path) -> Path:
    root.mkdir()
    lines = []
    for index, (success, task) in enumerate([(True, 1), (False, 1), (True, 2), (False, 2), (True, 1), (False, 2)]):
        frames = _episode(success, index)
        if index % 2:
            name = f"ep{index}.npy"
            np.save(root / name, frames)
        else:
            name = f"ep{index}.mp4"
            write_mp4(root / name, frames)
        lines.append(json.dumps({"file": name, "task_text": TASKS[task], "task_id": task, "success": success}))
    (root / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _shown_levels(body: dict) -> list[float]:
    return [frame_level(decode_jpeg_b64(p["image_url"]["url"].partition(",")[2]))
            for p in body["messages"][-1]["content"] if p["type"] == "image_url"]


def _gvl_reply(body: dict) -> str:
    levels = _shown_levels(body)[1:]  # after the reference frame, in the shown order
    return "\n".join(f"Frame {n}: Task Completion Percentages:{round(level / 255 * 100)}%"
                     for n, level in enumerate(levels, start=1))


@pytest.fixture(scope="module")
def fakes():
    started = {name: FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL)).start()
               for name in ("p_done", "progress", "gvl")}
    started["p_done"].fake.state.label_fn = lambda body: {
        "True": math.log(max(frame_level(last_video_frame(body)) / 255 * 0.95, 1e-6)), "False": math.log(0.04)}
    started["progress"].fake.state.reply_fn = lambda body: \
        f"<score>{round(frame_level(last_video_frame(body)) / 255 * 100)}</score>"
    started["gvl"].fake.state.reply_fn = _gvl_reply
    try:
        yield started
    finally:
        for fake in started.values():
            fake.stop()


def _config(path: Path, fakes: dict, **proxy: object) -> Path:
    retry = {"attempts": 2, "parse_attempts": 1, "backoff_s": [0.01, 0.05], "timeout_s": 10, "deadline_s": 30}
    base = {"model": QWEN_MODEL, "layout": "qwen_video", "score_mode": "auto", "retry": retry,
            "sampling": {"temperature": 0.0, "max_tokens": 64}, "frames": {"nframes": 8, "max_pixels": 50176}}
    backends = {
        "p_done": {**base, "endpoints": [fakes["p_done"].base_url], "prompt": "topreward"},
        "progress": {**base, "endpoints": [fakes["progress"].base_url], "prompt": "qwen_progress"},
        "gvl": {**base, "endpoints": [fakes["gvl"].base_url], "prompt": "gvl", "layout": "shuffled_images",
                "frames": {"nframes": 9, "max_pixels": 50176}, "sampling": {"temperature": 0.0, "max_tokens": 512}},
    }
    settings = {"prompts_dir": str(PROMPTS_DIR), "allowed_media_roots": [str(path.parent)], **proxy}
    path.write_text(yaml.safe_dump({"proxy": settings, "backends": backends}))
    return path


def test_eval_ranks_methods_by_numbers_an_independent_computation_confirms(fakes, tmp_path):
    from vlm_reward_cli import main

    episodes = _episodes_dir(tmp_path / "episodes")
    out = tmp_path / "eval"
    code = main(["eval", str(episodes), "--config", str(_config(tmp_path / "proxy.yaml", fakes)), "--backend",
                 "p_done", "--backend", "progress", "--backend", "gvl", "--points", "4", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "eval.json").read_text())
    records = result["records"]
    assert len(records) == 6 * 3 * 4 and not [r for r in records if r.get("error")]
    for method in ("p_done", "progress", "gvl"):
        mine = [r for r in records if r["method"] == method]
        original = [r for r in mine if r["control"] is None]
        numbers = result["methods"][method]["all tasks"]
        scores, truth = [r["score"] for r in original], [r["success"] for r in original]
        assert numbers["auc"] == pytest.approx(auc_by_pairs(scores, truth)) and numbers["auc"] == 1.0
        assert all(r["curve"][-1] == r["score"] and len(r["curve"]) == 4 for r in original)
        successes = {r["episode"] for r in original if r["success"]}

        def voc_of(control, method_records=mine, episodes=successes):
            return np.mean([spearmanr(range(4), r["curve"]).statistic for r in method_records
                            if r["control"] == control and r["episode"] in episodes])
        assert numbers["voc"] == pytest.approx(voc_of(None)) and numbers["voc"] > 0.9
        assert numbers["voc_reversed"] == pytest.approx(voc_of("reversed")) and numbers["voc_reversed"] < -0.9
        assert numbers["voc_shuffled"] == pytest.approx(voc_of("shuffled"))
        # the fakes ignore the instruction: a success scores the same under another task's
        by_episode = {r["episode"]: r["score"] for r in original}
        drops = [by_episode[r["episode"]] - r["score"] for r in mine
                 if r["control"] == "instruction" and r["episode"] in successes]
        assert numbers["instruction_drop"] == pytest.approx(np.mean(drops), abs=1e-9)
        assert result["methods"][method]["1"]["episodes"] == 3
        expected_calls = 1 if method == "gvl" else 4  # one shuffled call against 4 prefix calls
        dense = [r for r in mine if r["control"] != "instruction"]
        assert all(r["cost"]["calls"] == expected_calls and r["curve_method"] == (
            "shuffled" if method == "gvl" else "prefixes") for r in dense)
    assert result["ranks_first"]["prompt_tokens_per_episode"] is not None
    assert result["ranks_first"]["auc"] in ("p_done", "progress", "gvl")
    # the app's own audit log: `report` reads the eval too; a control is never an episode there
    lines = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "metadata" in line]  # the monitor's own lines (its state at the stop) aside
    controls = [line for line in lines if line["metadata"]["run"] != "eval:episode"]
    assert controls and not [line for line in controls if "env_success" in line["metadata"]]


def test_a_method_with_a_failed_call_is_not_ranked():
    from reports.method_eval import method_numbers, rank

    def record(method, episode, success, score, error=None):
        return {"method": method, "episode": episode, "task_id": 1, "success": success, "control": None,
                "score": None if error else score, "curve": None if error else [0.1, score], "error": error,
                "cost": {"calls": 0 if error else 2, "prompt_tokens": 0 if error else 100, "completion_tokens": 1,
                         "seconds": 0.5}}
    records = [record("steady", 0, True, 0.8), record("steady", 1, False, 0.3), record("steady", 2, True, 0.2),
               # perfect on what it scored, and "cheaper": it failed the hard episode
               record("flaky", 0, True, 0.9), record("flaky", 1, False, 0.1),
               record("flaky", 2, True, None, error="upstream_timeout")]
    numbers = method_numbers(records)
    assert numbers["flaky"]["all tasks"]["auc"] == 1.0 > numbers["steady"]["all tasks"]["auc"]
    assert numbers["flaky"]["all tasks"]["failed"] == 1
    first = rank(numbers)
    assert first["auc"] == first["seconds_per_episode"] == "steady" and "flaky" not in first.values()


def test_the_eval_page_reads_in_a_browser(fakes, tmp_path):
    browser = chromium()  # noqa: F841 - skips (or fails under VLM_REQUIRE_BROWSER=1) before anything is built
    from vlm_reward_cli import main

    episodes = _episodes_dir(tmp_path / "episodes")
    out = tmp_path / "eval"
    assert main(["eval", str(episodes), "--config", str(_config(tmp_path / "proxy.yaml", fakes)), "--backend",
                 "p_done", "--backend", "gvl", "--points", "3", "--controls", "reversed", "--out", str(out)]) == 0
    shot = screenshot(out / "eval.html", tmp_path / "eval.png")
    assert_not_blank(shot, min_colours=2, min_stddev=1.0)
    text = dom_text(out / "eval.html")
    numbers = json.loads((out / "eval.json").read_text())["methods"]
    assert "Which method ranks first" in text and "p_done" in text and "gvl" in text
    assert f"{numbers['gvl']['all tasks']['voc_reversed']:.3f}" in text


def test_eval_takes_a_runs_own_episodes_from_its_audit_log_and_frame_store(fakes, tmp_path):
    """A first eval (GVL: an episode is one score line) writes an audit log with env_success and a
    frame store; a second eval takes those episodes (the JPEGs vLLM received) for another method."""
    from vlm_reward_cli import main

    store = tmp_path / "frames"
    config = _config(tmp_path / "proxy.yaml", fakes, frame_store={"dir": str(store), "max_mb": 64})
    first = tmp_path / "first"
    assert main(["eval", str(_episodes_dir(tmp_path / "episodes")), "--config", str(config), "--backend", "gvl",
                 "--points", "4", "--controls", "reversed", "--out", str(first)]) == 0
    second = tmp_path / "second"
    assert main(["eval", "--audit", str(first / "audit.jsonl"), "--frame-store", str(store), "--config",
                 str(config), "--backend", "p_done", "--points", "3", "--controls", "reversed",
                 "--out", str(second)]) == 0
    result = json.loads((second / "eval.json").read_text())
    # the 6 episodes' score lines (the reversed controls carry no env_success: not episodes)
    assert (result["episodes"], result["successes"]) == (6, 3)
    numbers = result["methods"]["p_done"]["all tasks"]
    assert numbers["auc"] == 1.0 and numbers["voc"] > 0.9 and numbers["voc_reversed"] < -0.9


@pytest.mark.parametrize(("listing", "says"), [
    ("", "lists no episode"),
    ('{"file": "missing.npy", "task_text": "x", "success": true}', "is not a file inside"),
    ('{"file": "../escape.npy", "task_text": "x", "success": true}', "is not a file inside"),
    ('{"file": "ep.npy", "task_text": "x", "success": "yes"}', "success true or false"),
])
def test_a_bad_episodes_listing_is_a_clear_error(tmp_path, capsys, listing, says):
    from vlm_reward_cli import main

    episodes = tmp_path / "episodes"
    episodes.mkdir()
    np.save(episodes / "ep.npy", _episode(True, 0))
    np.save(tmp_path / "escape.npy", _episode(True, 0))
    (episodes / "episodes.jsonl").write_text(listing)
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"backends": {"x": {"model": "m", "endpoints": ["http://127.0.0.1:9/v1"],
                                                         "layout": "qwen_video", "prompt": "qwen_seed"}}}))
    assert main(["eval", str(episodes), "--config", str(config), "--backend", "x", "--out", str(tmp_path / "o")]) == 2
    assert re.search(re.escape(says), capsys.readouterr().err)
