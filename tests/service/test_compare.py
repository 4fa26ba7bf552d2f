"""POST /compare (RL-VLM-F preferences) through the real proxy against the fake vLLM: the label
convention, strict label reading, two-step querying, order swapping, explicit failures, batches,
the audit line, metrics, and the request vLLM receives (both episodes' frames, in order)."""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64

# Told apart by their frame counts (all frames are sent: nframes 16 is above both).
FIRST, SECOND = npy_b64(episode_frames(4, 64, 64)), npy_b64(episode_frames(6, 64, 64))
COMPARISON = {"task_text": "put the bowl on the plate", "episodes": [{"frames_npy": FIRST}, {"frames_npy": SECOND}]}
MEDIA_TYPES = ("image_url", "video_url")


def _parts(body: dict) -> list[dict]:
    content = body["messages"][-1]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _videos(body: dict) -> list[list[bytes]]:
    """The JPEG frames of each video part, in the order the request carries them."""
    return [[base64.b64decode(piece) for piece in part["video_url"]["url"].partition(";base64,")[2].split(",")]
            for part in _parts(body) if part["type"] == "video_url"]


def _first_shown(body: dict) -> int:
    """Which episode the request shows first: 0 (4 frames) or 1 (6 frames)."""
    return {4: 0, 6: 1}[len(_videos(body)[0])]


def _texts(body: dict) -> list[str]:
    return [part["text"] for part in _parts(body) if part["type"] == "text"]


@pytest.mark.parametrize(("reply", "label"), [("0", 0), ("1", 1), ("-1", -1), (" -1.", -1), ("1.", 1),
                                              ("<think>no, -1? or 1</think>0", 0)])
def test_the_label_follows_rl_vlm_f(client, fake_qwen, reply, label):
    fake_qwen.script({"reply": reply})
    response = client.post("/compare", json=COMPARISON)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["label"] == label and result["agree"] is None
    assert [(o["order"], o["raw_label"], o["label"]) for o in result["orders"]] == [([0, 1], label, label)]
    assert result["attempts"] == 1 and len(fake_qwen.chat_requests) == 1
    assert result["prompt"]["name"] == "compare_rlvlmf" and result["backend"] == "qwen2_5_vl_vllm"


def test_minus_one_is_never_read_as_one(client, fake_qwen):
    fake_qwen.script({"reply": "-1"})
    assert client.post("/compare", json=COMPARISON).json()["label"] == -1


def test_the_request_carries_both_episodes_in_order_each_after_its_label(client, fake_qwen):
    fake_qwen.script({"reply": "0"})
    result = client.post("/compare", json=COMPARISON).json()
    body = fake_qwen.chat_requests[0]
    assert [part["type"] for part in _parts(body)] == ["text", "video_url", "text", "video_url", "text"]
    assert _texts(body)[:2] == ["Episode 1:", "Episode 2:"]
    assert "put the bowl on the plate" in _texts(body)[2] and "Reply -1" in _texts(body)[2]
    sent = [[hashlib.sha256(jpeg).hexdigest() for jpeg in video] for video in _videos(body)]
    assert sent == [result["frames"][0]["sha256"], result["frames"][1]["sha256"]]
    assert [f["count"] for f in result["frames"]] == [4, 6]
    assert body["media_io_kwargs"]["video"]["num_frames"] == 6  # vLLM keeps every frame of the longer one


def test_primo_shows_each_episode_as_first_frame_video_last_frame(client, fake_primo):
    fake_primo.script({"reply": "<think>the second is further</think>1"})
    response = client.post("/compare", json={**COMPARISON, "backend": "PRIMO-R1"})
    assert response.status_code == 200, response.text
    assert response.json()["label"] == 1
    kinds = [part["type"] for part in _parts(fake_primo.chat_requests[0])]
    episode = ["text", "image_url", "video_url", "image_url"]
    assert kinds == [*episode, *episode, "text"]


def test_two_steps_make_two_calls_the_second_text_only_carrying_the_first(client, fake_qwen):
    description = "1. The bowl ends on the plate. 2. The bowl is dropped. 3. Episode 1 achieves the goal."
    fake_qwen.script({"reply": description}, {"reply": "0"})
    response = client.post("/compare", json={**COMPARISON, "two_step": True})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["label"] == 0 and result["attempts"] == 2
    assert result["orders"][0]["description"] == description and result["orders"][0]["output_text"] == "0"
    step1, step2 = fake_qwen.chat_requests
    assert len(_videos(step1)) == 2 and "What is shown in Episode 1?" in _texts(step1)[-1]
    assert not any(part["type"] in MEDIA_TYPES for part in _parts(step2)) and "media_io_kwargs" not in step2
    assert description in _texts(step2)[0] and "Reply -1 if the text is unsure" in _texts(step2)[0]


def test_swap_with_agreement_gives_that_label(client, fake_qwen):
    # Prefers episode 0 whichever place it is shown in: 0 when it comes first, 1 when second.
    fake_qwen.fake.state.reply_fn = lambda body: "0" if _first_shown(body) == 0 else "1"
    result = client.post("/compare", json={**COMPARISON, "swap": True}).json()
    assert (result["label"], result["agree"], result["attempts"]) == (0, True, 2)
    assert [(o["order"], o["raw_label"], o["label"]) for o in result["orders"]] == [([0, 1], 0, 0), ([1, 0], 1, 0)]
    assert sorted(_first_shown(body) for body in fake_qwen.chat_requests) == [0, 1]  # both orders were shown


def test_swap_with_disagreement_is_no_preference_with_both_raw_labels(client, fake_qwen):
    fake_qwen.fake.state.reply_fn = lambda body: "0"  # always "the first shown": a position bias
    result = client.post("/compare", json={**COMPARISON, "swap": True}).json()
    assert (result["label"], result["agree"]) == (-1, False)
    assert [(o["raw_label"], o["label"]) for o in result["orders"]] == [(0, 0), (0, 1)]


def test_two_steps_and_swap_make_four_calls(client, fake_qwen):
    fake_qwen.fake.state.reply_fn = lambda body: "-1" if "Reply -1" in _texts(body)[-1] else "They look alike."
    result = client.post("/compare", json={**COMPARISON, "two_step": True, "swap": True}).json()
    assert (result["label"], result["agree"], result["attempts"]) == (-1, True, 4)
    assert len(fake_qwen.chat_requests) == 4


def test_a_reply_without_a_label_is_an_explicit_502_with_the_reply(client, fake_qwen):
    fake_qwen.script({"reply": "Episode 1, clearly."}, {"reply": "-1 or 1"})
    response = client.post("/compare", json=COMPARISON)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "unparseable_label" and error["attempts"] == 2 and error["retryable"] is False
    assert error["output_text"] == "-1 or 1" and "label" not in response.json()
    assert fake_qwen.chat_requests[1]["temperature"] > 0  # the re-ask samples


@pytest.mark.parametrize(("change", "field", "mentions"), [
    ({"episodes": [{"frames_npy": FIRST}]}, "episodes", "at least 2"),
    ({"episodes": [{"frames_npy": FIRST}, {}]}, "episodes.1", "exactly one of"),
    ({"prompt": "qwen_seed"}, "prompt", "compare_rlvlmf"),
    ({"backend_kwargs": {"samples": 3}}, "backend_kwargs.samples", "not a sampling field"),
    ({"nframes": 10_000}, "nframes", "over the cap"),
])
def test_bad_input_is_a_clear_422_and_nothing_is_sent(client, fake_qwen, change, field, mentions):
    response = client.post("/compare", json={**COMPARISON, **change})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and mentions in error["message"]
    assert fake_qwen.chat_requests == []


def test_batch_answers_each_item_in_order(client, fake_qwen):
    fake_qwen.fake.state.reply_fn = lambda body: "1"
    items = [COMPARISON, {"task_text": "t", "episodes": []}, {**COMPARISON, "backend": "nope"}]
    response = client.post("/compare/batch", json={"items": items})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(r["index"], r["ok"], r["status"]) for r in body["results"]] == [(0, True, 200), (1, False, 422),
                                                                            (2, False, 404)]
    assert body["results"][0]["result"]["label"] == 1 and body["summary"] == {"ok": 1, "failed": 2}


def test_every_comparison_leaves_an_audit_line_and_counts_in_metrics(proxy_factory, fake_qwen, fake_primo,
                                                                     media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    server = proxy_factory(settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url],
                                                                   media_root, audit_log=str(audit))))
    fake_qwen.script({"reply": "1"}, {"reply": "no idea"}, {"reply": "still no idea"})
    episodes = [{"frames_npy": FIRST, "metadata": {"episode_id": 7}}, {"frames_npy": SECOND}]
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        assert http.post("/compare", json={**COMPARISON, "episodes": episodes}).status_code == 200
        assert http.post("/compare", json=COMPARISON).status_code == 502
        metrics = http.get("/metrics").text
    server.flush_audit()
    lines = audit.read_text().splitlines()
    assert len(lines) == 2, lines  # one line per comparison, labelled or failed
    labelled, failed = (json.loads(line) for line in lines)
    assert labelled["kind"] == "compare" and labelled["label"] == 1
    assert labelled["metadata"] == [{"episode_id": 7}, None]
    assert labelled["orders"] == [{"order": [0, 1], "raw_label": 1, "label": 1, "source": "untagged",
                                   "output_text": "1", "description": None}]
    assert [len(f["sha256"]) for f in labelled["frames"]] == [4, 6] and labelled["prompt"]["name"] == "compare_rlvlmf"
    assert failed["error"]["code"] == "unparseable_label" and failed["output_text"] == "still no idea"
    assert failed["attempts"] == 2 and "label" not in failed
    assert 'vlm_proxy_comparisons_total{backend="qwen2_5_vl_vllm",outcome="1"} 1.0' in metrics
    assert 'vlm_proxy_comparisons_total{backend="qwen2_5_vl_vllm",outcome="unparseable_label"} 1.0' in metrics
    assert 'vlm_proxy_requests_total{backend="qwen2_5_vl_vllm",outcome="ok",route="/compare"} 1.0' in metrics
