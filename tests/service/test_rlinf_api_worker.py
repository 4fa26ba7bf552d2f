"""The proxy as `reward.api.api_base` of RLinf's API reward worker (RLinf main, not on PyPI).

The worker is `EmbodiedAPIRewardWorker` in rlinf/workers/reward/api_reward_worker.py (RLinf/RLinf
at a3816b5). Per env it posts, with `requests.post(json=...)` (rlinf/utils/http_client.py:
`InferenceHTTPClient.post`, no retries, a connect timeout only), to `<api_base minus /v1>/v1/chat/
completions` the body `{"model": reward.api.model, "messages": [{"role": "user", "content": [one
image_url part per history frame, a base64 JPEG data URL at quality 95, ..., one text part]}],
**reward.api.sampling_params}`; any non-2xx answer raises. It reads `choices[0].message.content`
and hands the texts to the registered parser (`vlm_trend_reward_parser`, restated below).
Each test sends that exact shape to the real proxy on loopback, in front of the fake vLLM.
"""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import numpy as np
import openai
import pytest
import requests
from PIL import Image

from proxy.config import settings_from_dict
from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict
from tests.fakes.episodes import decode_jpeg_b64, episode_frames, frame_level
from tests.fakes.fake_vllm import decode_video_part

TASK = "put the black bowl on the plate"
# VLMTrendRewardInputBuilder's prompt (rlinf/models/embodiment/reward/vlm_reward_utils/input_builder.py)
RLINF_PROMPT = (f"You are currently performing the task: {TASK}. You are given two synchronized 5-frame "
                "videos from different camera views (main view and third-person view) of the same robot "
                "action window. Judge whether the action trend is positive, negative, or unclear. Answer "
                "with exactly one word: positive, negative, or unclear.")


def rlinf_trend_reward(text: str, positive: float = 1.0, negative: float = -0.2, unclear: float = 0.0,
                       invalid: float = 0.0) -> float:
    """RLinf's `vlm_trend_reward_parser` (rlinf/models/embodiment/reward/vlm_reward_utils/reward_parser.py,
    VLMTrendRewardParser with its defaults): the `trend` of a JSON object (the whole stripped text, or
    its first '{' to last '}'), else the last whole word positive/negative/unclear; otherwise invalid."""
    label = None
    stripped = text.strip()
    candidates = [stripped]
    if 0 <= stripped.find("{") < stripped.rfind("}"):
        candidates.append(stripped[stripped.find("{"): stripped.rfind("}") + 1])
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(obj, dict):
            trend = str(obj.get("trend", "")).strip().lower()
            label = trend if trend in {"positive", "negative", "unclear"} else None
            break
    if label is None:
        words = re.findall(r"\b(positive|negative|unclear)\b", stripped.lower())
        label = words[-1] if words else None
    return {"positive": positive, "negative": negative, "unclear": unclear}.get(label, invalid)


def rlinf_frame(frame: np.ndarray) -> str:
    """A history frame as the worker's `_frame_to_data_url` sends it: RGB JPEG, quality 95."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame[..., :3]), mode="RGB").save(buffer, format="JPEG", quality=95)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def rlinf_payload(model: str, frames: np.ndarray, text: str = RLINF_PROMPT, **sampling_params) -> dict:
    """`_build_chat_payloads`: every frame an image_url part, then the prompt; sampling spread in."""
    content = [{"type": "image_url", "image_url": {"url": rlinf_frame(f)}} for f in frames]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], **sampling_params}


def rlinf_post(api_base: str, payload: dict) -> requests.Response:
    """`InferenceHTTPClient.chat_completion` → `post`: /v1 stripped from api_base, then re-added."""
    base = api_base[:-3] if api_base.endswith("/v1") else api_base
    return requests.post(f"{base}/v1/chat/completions", json=payload, timeout=(120.0, None),
                         proxies={"http": None, "https": None})


def rlinf_reward(response: requests.Response) -> float:
    """What the worker makes of an answer: a non-2xx raises; else `_extract_text`, then the parser."""
    if not response.ok:
        raise RuntimeError(f"status={response.status_code}, body={response.text[:500]}")
    return rlinf_trend_reward(response.json()["choices"][0]["message"]["content"])


def test_worker_request_runs_the_score_pipeline_and_the_parser_reads_the_reward(proxy_server, fake_qwen):
    frames = episode_frames(5, 128, 128)
    answer = rlinf_post(proxy_server.url + "/v1", rlinf_payload("score:qwen2_5_vl_vllm", frames,
                                                                max_tokens=16, temperature=0.0))
    assert answer.status_code == 200, answer.text
    assert rlinf_reward(answer) == 1.0  # <score>75</score> → 0.75 ≥ 0.5 → positive
    completion = answer.json()
    assert json.loads(completion["choices"][0]["message"]["content"]) == {"trend": "positive", "score": 0.75}
    assert completion["object"] == "chat.completion" and completion["model"] == "score:qwen2_5_vl_vllm"
    provenance = completion["vlm_reward"]
    assert provenance["score"] == 0.75 and provenance["output_text"] == "<score>75</score>"
    assert provenance["prompt"]["name"] == "qwen_progress" and provenance["frames"]["count"] == 5
    assert answer.headers["x-upstream-attempts"] == "1"

    sent = fake_qwen.chat_requests[-1]  # the template's body, not RLinf's
    assert sent["model"] == QWEN_MODEL and [m["role"] for m in sent["messages"]] == ["system", "user"]
    video, text = sent["messages"][1]["content"]
    assert f'attempting this task: "{TASK}"' in text["text"] and "synchronized" not in text["text"]
    assert sent["media_io_kwargs"]["video"]["num_frames"] == 5
    sent_frames = [decode_jpeg_b64(base64.b64encode(j).decode()) for j in decode_video_part(video["video_url"]["url"])]
    levels = [frame_level(f) for f in sent_frames]
    assert len(levels) == 5 and levels == sorted(levels)  # the image parts, in order
    assert sent["temperature"] == 0.0 and sent["max_tokens"] == 16  # sampling_params: within bounds, applied
    assert sent["top_p"] == 1.0 and sent["seed"] == 0  # the backend's for the rest


def test_each_window_leaves_the_audit_line_and_metrics_of_score(proxy_factory, fake_qwen, fake_primo, media_root,
                                                                 tmp_path):
    audit = tmp_path / "audit.jsonl"
    server = proxy_factory(settings_from_dict(libero_settings_dict(
        [fake_qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(audit))))
    fake_qwen.script({"reply": "no idea"}, {"reply": "<score>90</score>"})
    answer = rlinf_post(server.url + "/v1", rlinf_payload("score:qwen2_5_vl_vllm", episode_frames(4, 64, 64),
                                                          metadata={"episode_id": 7}))
    assert rlinf_reward(answer) == 1.0 and answer.json()["vlm_reward"]["asks"] == 2  # re-asked, then scored
    server.flush_audit()
    line = json.loads(audit.read_text().splitlines()[-1])
    assert (line["task_text"], line["score"], line["asks"]) == (TASK, 0.9, 2)
    assert line["metadata"] == {"episode_id": 7} and len(line["frames"]["sha256"]) == 4
    metrics = requests.get(server.url + "/metrics", proxies={"http": None, "https": None}).text
    assert 'vlm_proxy_episodes_total{backend="qwen2_5_vl_vllm",outcome="ok"} 1.0' in metrics
    assert 'vlm_proxy_parse_failures_total{backend="qwen2_5_vl_vllm"} 1.0' in metrics


def test_low_score_is_negative_and_a_threshold_moves_the_line(proxy_server, fake_qwen):
    fake_qwen.script({"reply": "<score>20</score>"}, {"reply": "<score>60</score>"})
    frames = episode_frames(3, 64, 64)
    low = rlinf_post(proxy_server.url + "/v1", rlinf_payload("score:qwen2_5_vl_vllm", frames))
    assert rlinf_reward(low) == -0.2 and low.json()["vlm_reward"]["score"] == 0.2
    strict = rlinf_post(proxy_server.url + "/v1", rlinf_payload("score:Qwen2.5-VL-7B-Instruct", frames,
                                                                trend_threshold=0.7))
    assert rlinf_reward(strict) == -0.2 and strict.json()["vlm_reward"]["score"] == 0.6


def test_primo_through_the_official_openai_client(proxy_server, fake_primo):
    frames = episode_frames(6, 96, 96)
    payload = rlinf_payload("score:PRIMO-R1", frames, text=f"Task: {TASK}\n\nEvaluate the task and return a "
                                                           "reward score between 0 and 1.")
    with openai.OpenAI(base_url=proxy_server.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                       http_client=httpx.Client(trust_env=False)) as client:
        ids = {m.id for m in client.models.list()}
        reply = client.chat.completions.create(model=payload["model"], messages=payload["messages"])
    assert {"score:qwen2_5_vl_vllm", "score:PRIMO-R1", QWEN_MODEL, PRIMO_MODEL} <= ids
    assert rlinf_trend_reward(reply.choices[0].message.content) == 1.0  # <answer>60</answer> → 0.6
    assert reply.model_extra["vlm_reward"]["backend"] == "PRIMO-R1"
    sent = fake_primo.chat_requests[-1]
    parts = sent["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "video_url", "image_url", "text"]  # primo_interleave
    assert TASK in parts[-1]["text"] and "Evaluate the task" not in parts[-1]["text"]
    assert sent["max_tokens"] == 1024 and sent["temperature"] == 0.01  # the backend's sampling


def test_an_unparseable_reply_is_an_error_never_a_reward(proxy_server, fake_qwen):
    fake_qwen.script({"reply": "The robot looks busy."}, {"reply": "Hard to say, maybe positive."})
    answer = rlinf_post(proxy_server.url + "/v1", rlinf_payload("score:qwen2_5_vl_vllm", episode_frames(4, 64, 64)))
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == "unparseable_score" and error["output_text"] == "Hard to say, maybe positive."
    assert "choices" not in answer.json() and len(fake_qwen.chat_requests) == 2  # asked again, then gave up
    with pytest.raises(RuntimeError, match="status=502"):
        rlinf_reward(answer)  # the worker stops on it instead of reading a reward


def _part(frames, j: int, url: str) -> dict:
    payload = rlinf_payload("score:qwen2_5_vl_vllm", frames)
    payload["messages"][0]["content"][j] = {"type": "image_url", "image_url": {"url": url}}
    return payload


@pytest.mark.parametrize(("change", "status", "code", "field"), [
    (lambda f: _part(f, 1, "data:image/jpeg;base64,not base64!"), 422, "media_decode_error", "messages[0].content[1]"),
    (lambda f: _part(f, 2, "data:image/png;base64," + base64.b64encode(b"GIF89a....").decode()), 422,
     "media_format_refused", "messages[0].content[2]"),  # only JPEG and PNG are read
    (lambda f: _part(f, 0, "https://example.com/frame.jpg"), 422, "invalid_request", "messages[0].content[0]"),
    (lambda f: _part(f, 1, rlinf_frame(episode_frames(1, 32, 48)[0])), 422, "media_decode_error",
     "messages[0].content"),  # frames of one episode must share one size
    (lambda f: {**rlinf_payload("score:qwen2_5_vl_vllm", f), "stream": True}, 422, "invalid_request", "stream"),
    (lambda f: {**rlinf_payload("score:qwen2_5_vl_vllm", f), "tools": []}, 422, "invalid_request", "tools"),
    (lambda f: rlinf_payload("score:qwen2_5_vl_vllm", f[:0]), 422, "invalid_request", "messages[0].content"),
    (lambda f: rlinf_payload("score:qwen2_5_vl_vllm", f, text=" "), 422, "invalid_request", "messages[0].content"),
    (lambda f: rlinf_payload("score:qwen2_5_vl_vllm", f, max_tokens=10**9), 422, "invalid_request", "max_tokens"),
    (lambda f: rlinf_payload("score:nobody", f), 404, "unknown_backend", "model"),
])
def test_bad_input_is_a_4xx_naming_the_part(proxy_server, fake_qwen, change, status, code, field):
    answer = rlinf_post(proxy_server.url + "/v1", change(episode_frames(3, 64, 64)))
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == (code, field) and error["request_id"]
    assert fake_qwen.chat_requests == []


def test_caps_of_score_apply(proxy_factory, fake_qwen, fake_primo, media_root):
    tight = proxy_factory(settings_from_dict(libero_settings_dict(
        [fake_qwen.base_url], [fake_primo.base_url], media_root, max_inline_frames=4,
        max_source_pixels=80 * 80, max_body_mb=0.05)))
    many = rlinf_post(tight.url + "/v1", rlinf_payload("score:qwen2_5_vl_vllm", episode_frames(5, 32, 32)))
    big = rlinf_post(tight.url + "/v1", rlinf_payload("score:qwen2_5_vl_vllm", episode_frames(2, 96, 96)))
    noise = np.random.default_rng(0).integers(0, 255, (12, 80, 80, 3), dtype=np.uint8)  # JPEG cannot shrink it
    payload = rlinf_payload("score:qwen2_5_vl_vllm", noise)
    assert len(json.dumps(payload)) > 0.05 * 2**20
    heavy = rlinf_post(tight.url + "/v1", payload)
    assert (many.status_code, many.json()["error"]["field"]) == (422, "messages[0].content")
    assert "over the cap of 4" in many.json()["error"]["message"]
    assert (big.status_code, big.json()["error"]["field"]) == (422, "messages[0].content[0]")
    assert (heavy.status_code, heavy.json()["error"]["code"]) == (413, "payload_too_large")
    assert fake_qwen.chat_requests == []


def test_other_models_are_still_relayed_untouched(proxy_server, fake_qwen):
    body = {"model": QWEN_MODEL, "messages": [{"role": "user", "content": "score: how many?"}]}
    answer = rlinf_post(proxy_server.url + "/v1", body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "<score>75</score>"
    assert fake_qwen.chat_requests[-1] == body
