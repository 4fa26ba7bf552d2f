"""`replay` re-scores an audit log's stored episodes through the proxy's own pipeline: the model
sees the stored frames again under the new prompt/backend/sampling, the ground truth travels with
each episode into the new audit log, and what cannot be replayed is counted, never guessed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import npy_b64
from tests.fakes.grader import grader, grader_score, outcome_episode
from vlm_protocol.frame_store import frame_path
from vlm_reward_cli import main
from vlm_reward_cli.replay import episode_request

QWEN, PRIMO = "qwen2_5_vl_vllm", "PRIMO-R1"
EPISODES = [(i, i % 3 != 0) for i in range(9)]  # (episode id, env success)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def recorded(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    """An audit log of EPISODES scored by Qwen through the real proxy, frames in the store, and a
    config file for `replay` pointing at the same fakes. PRIMO's fake grades with another seed."""
    fake_qwen.fake.state.reply_fn = grader(lambda s: f"<score>{s}</score>", seed=0)
    fake_primo.fake.state.reply_fn = grader(lambda s: f"<think>looked</think><answer>{s}</answer>", seed=1)
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                audit_log=str(tmp_path / "first.jsonl"), frame_store={"dir": str(tmp_path / "frames")})
    proxy = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        for episode_id, success in EPISODES:
            response = http.post("/score", json={
                "task_text": f"put the bowl on the plate #{episode_id}", "backend": QWEN,
                "frames_npy": npy_b64(outcome_episode(success, episode_id)),
                "metadata": {"env_success": success, "episode_id": episode_id, "task_id": episode_id % 2}})
            assert response.json()["raw_score"] == grader_score(success, f"#{episode_id}", seed=0)
    proxy.flush_audit()  # every line is in the file before `replay` reads it
    config = tmp_path / "replay.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    fake_qwen.fake.reset()
    return tmp_path / "first.jsonl", config, tmp_path


def test_replay_on_another_backend_carries_ground_truth_and_shows_the_same_frames(recorded, fake_primo, capsys):
    first, config, tmp_path = recorded
    out = tmp_path / "replayed.jsonl"
    code = main(["replay", str(first), "--config", str(config), "--backend", "primo_r1_vllm",
                 "--prompt", "primo_r1_trained", "--sampling", "temperature=0.2", "--out-file", str(out),
                 "--concurrency", "3"])
    assert code == 0
    assert f"sent {len(EPISODES)}, scored {len(EPISODES)}, failed 0, skipped 0" in capsys.readouterr().out
    numbered = {line["metadata"]["episode_id"]: n for n, line in enumerate(_lines(first), start=1)}
    old = {line["metadata"]["episode_id"]: line for line in _lines(first)}
    new = {line["metadata"]["episode_id"]: line for line in _lines(out)}
    assert set(new) == set(old)
    trained = yaml.safe_load(Path("prompts/primo_r1_trained.yaml").read_text())
    for episode_id, success in EPISODES:
        line = new[episode_id]
        assert line["backend"] == PRIMO and line["prompt"]["name"] == "primo_r1_trained"
        assert line["raw_score"] == grader_score(success, f"#{episode_id}", seed=1)  # PRIMO's grader saw the outcome
        assert line["metadata"] == {**old[episode_id]["metadata"], "replay_of_backend": QWEN,
                                    "replay_of_ts": old[episode_id]["ts"], "replay_of_score": old[episode_id]["score"],
                                    "replay_of_line": numbered[episode_id]}
        assert line["frames"]["count"] == old[episode_id]["frames"]["count"] == 16
        assert line["sampling"]["temperature"] == 0.2
    assert len(fake_primo.chat_requests) == len(EPISODES)
    assert all(r["messages"][0]["content"] == trained["system"] for r in fake_primo.chat_requests)
    # the replay's own frames are in the store too, so its audit log can be reported on
    assert all(frame_path(tmp_path / "frames", d).is_file() for line in new.values() for d in line["frames"]["sha256"])


def test_what_cannot_be_replayed_is_counted_and_named(recorded, fake_qwen, capsys):
    first, config, tmp_path = recorded
    lines = _lines(first)
    frame_path(tmp_path / "frames", lines[0]["frames"]["sha256"][3]).unlink()
    with first.open("a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"backend": QWEN, "task_text": "t", "error": {"code": "media_decode_error"}}) + "\n")
    out = tmp_path / "replayed.jsonl"
    assert main(["replay", str(first), "--config", str(config), "--backend", QWEN, "--out-file", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"sent {len(EPISODES) - 1}, scored {len(EPISODES) - 1}, failed 0" in printed
    for why in ("frame missing from the store 1", "malformed line 1", "no frames recorded 1"):
        assert why in printed
    assert len(_lines(out)) == len(fake_qwen.chat_requests) == len(EPISODES) - 1


def test_failures_during_replay_are_reported_and_fail_the_command(recorded, fake_qwen, capsys):
    first, config, tmp_path = recorded
    fake_qwen.fake.state.reply_fn = lambda body: "I cannot tell."
    out = tmp_path / "replayed.jsonl"
    assert main(["replay", str(first), "--config", str(config), "--backend", QWEN, "--limit", "2",
                 "--out-file", str(out)]) == 1
    assert "sent 2, scored 0, failed unparseable_score 2" in capsys.readouterr().out
    assert [line["error"]["code"] for line in _lines(out)] == ["unparseable_score"] * 2


@pytest.mark.parametrize(("args", "message"), [
    (["--backend", "gpt-9"], "--backend 'gpt-9' is not in"),
    (["--backend", QWEN, "--sampling", "temperature"], "expected NAME=VALUE"),
    (["--backend", QWEN, "--sampling", "temperature=9"], "temperature"),
    (["--backend", QWEN, "--prompt", "no_such_template"], "no_such_template"),
])
def test_bad_arguments_are_clear_errors_before_anything_is_sent(recorded, fake_qwen, capsys, args, message):
    first, config, tmp_path = recorded
    assert main(["replay", str(first), "--config", str(config), "--out-file", str(tmp_path / "n.jsonl"), *args]) == 2
    assert message in capsys.readouterr().err
    assert fake_qwen.chat_requests == [] and not (tmp_path / "n.jsonl").exists()


def test_an_existing_output_is_not_mixed_into(recorded, capsys):
    first, config, tmp_path = recorded
    out = tmp_path / "replayed.jsonl"
    out.write_text('{"kind": "score", "earlier": true}\n')
    args = ["replay", str(first), "--config", str(config), "--backend", QWEN, "--out-file", str(out)]
    assert main(args) == 2
    assert "exists; choose another --out-file, or pass --force to overwrite it or --append" in capsys.readouterr().err
    assert main([*args, "--force", "--append"]) == 2
    assert "give one" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--force"], ["--append"]])
def test_the_log_being_replayed_is_never_the_output(recorded, capsys, flags):
    first, config, _ = recorded
    before = first.read_bytes()
    assert main(["replay", str(first), "--config", str(config), "--backend", QWEN, "--out-file", str(first),
                 *flags]) == 2
    assert "is the audit log being replayed" in capsys.readouterr().err
    assert first.read_bytes() == before


def test_force_overwrites_the_output_and_append_adds_to_it(recorded, fake_qwen, capsys):
    first, config, tmp_path = recorded
    out = tmp_path / "replayed.jsonl"
    out.write_text('{"kind": "score", "earlier": true}\n')
    (tmp_path / "replayed.jsonl.1").write_text('{"kind": "score", "earlier": true}\n')  # a rotated part
    args = ["replay", str(first), "--config", str(config), "--backend", QWEN, "--out-file", str(out), "--limit", "2"]
    assert main([*args, "--force"]) == 0
    assert not (tmp_path / "replayed.jsonl.1").exists()
    assert [line.get("earlier") for line in _lines(out)] == [None, None]
    assert main([*args, "--append"]) == 0
    assert len(_lines(out)) == 4


def test_replay_keeps_the_requests_scale_budget_and_rates(recorded, proxy_factory, fake_qwen, capsys):
    """What defines the score (score_mode, the estimator, max_pixels) and the rates travel with the
    replay; the sampling and the prompt are the replay backend's."""
    first, config, tmp_path = recorded
    data = yaml.safe_load(config.read_text())
    data["proxy"]["audit_log"] = str(tmp_path / "asked.jsonl")
    proxy = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        asked = {"score_mode": "unit", "temperature": 0.4}
        fake_qwen.fake.state.reply_fn = lambda body: "<score>0.25</score>"
        response = http.post("/score", json={"task_text": "t", "backend": QWEN, "max_pixels": 150528, "fps": 10,
                                             "frames_npy": npy_b64(outcome_episode(True, 1)),
                                             "backend_kwargs": asked, "metadata": {"episode_id": 1}})
        assert response.status_code == 200 and response.json()["score"] == 0.25
    proxy.flush_audit()  # the audit writer thread has written the line
    original = _lines(tmp_path / "asked.jsonl")[-1]
    assert original["asked"] == {"max_pixels": 150528, "backend_kwargs": asked}
    fake_qwen.fake.reset()
    out = tmp_path / "again.jsonl"
    assert main(["replay", str(tmp_path / "asked.jsonl"), "--config", str(config), "--backend", QWEN,
                 "--out-file", str(out)]) == 0
    replayed = _lines(out)[-1]
    assert replayed["score"] == 0.25  # read on the unit scale again, not as 0.25 of 100
    assert replayed["asked"] == {"max_pixels": 150528, "backend_kwargs": {"score_mode": "unit"}}
    assert replayed["frames"]["size"] == original["frames"]["size"]
    assert replayed["frames"]["sampled_fps"] == original["frames"]["sampled_fps"]
    assert replayed["sampling"]["temperature"] != 0.4  # the replay backend's own sampling


def test_a_k_sample_line_is_replayed_at_its_temperature_and_a_two_camera_line_is_named(tmp_path):
    """k samples need the temperature they were drawn at (the proxy refuses k without one); a line with
    a second camera is not replayed with one view, and says why."""
    jpeg = b"\xff\xd8 a stored frame"
    digest = hashlib.sha256(jpeg).hexdigest()
    path = frame_path(tmp_path, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jpeg)
    line = {"task_text": "t", "backend": QWEN, "frames": {"sha256": [digest]},
            "asked": {"backend_kwargs": {"samples": 4, "temperature": 0.6, "top_p": 0.9}}}
    body = episode_request(line, tmp_path, QWEN)
    assert body["backend_kwargs"] == {"samples": 4, "temperature": 0.6}  # top_p is the replay backend's
    two = {**line, "frames": {"sha256": [digest], "extra_view": {"placement": "second_video"}}}
    assert episode_request(two, tmp_path, QWEN) == "a second camera (not replayed yet)"
