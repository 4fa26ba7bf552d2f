"""Fidelity to the seed (10-OASIS-01/RLinf-RLAIF) and to PRIMO-R1's own format (10-OASIS-01/PRIMO-R1):
the shipped configs send what those sources sent — prompt format, pixels, presentation rate,
budget — the same whatever carries the frames; and the seed's backend_kwargs keep their meaning."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.config import settings_from_dict
from tests.fakes.episodes import decode_jpeg_b64, episode_frames, images_b64, npy_b64, write_lossless_video
from tests.fakes.fake_vllm import decode_video_part

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "libero.yaml"
QWEN, PRIMO = "qwen2_5_vl_vllm", "PRIMO-R1"
TASK = "put both the alphabet soup and the tomato sauce in the basket"

# Facts from the sources, written out here (not read from our templates): what must reach the model.
PRIMO_SYSTEM_PROMPT = (  # PRIMO-R1 src/primo_prompts.py SYSTEM_PROMPT
    "A conversation between User and Assistant. The Assistant is an expert AI specializing in embodied procedure "
    "and event reasoning based on visual input (video or images). The assistant must strictly follow a specific "
    "thought process and output format. The reasoning process is enclosed within <think> </think> tags, and the "
    "final answer is within <answer> </answer> tags. The <think> block must contain three ordered subsections: "
    "<planning>, <observation>, and <reasoning>. The <answer> block must contain only the final output required "
    "by the question type and no other commentary.")
PRIMO_RL_PREFIX = ("Given the initial state in the first image, the progress shown in the video, and the current "
                   "state in the final image, ")  # grpo_interleave.py make_conversation_image_and_video
PRIMO_NUMERICAL = " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags."
SEED_QWEN_PROMPT = (  # libero_reward_server.py DEFAULT_QWEN_PROMPT_TEMPLATE, {task_instruction} filled
    f"Task info:\n{TASK}\n\nQuestion:\nGiven the task goal and the input video, estimate the current task "
    "completion percentage (0-100). The estimation must reflect progress toward the final goal rather than scene "
    "description.\n\nAnswer format:\nPlease output a numerical number between 1 and 100 indicating the percentage "
    "of task completion.\nDo not output any words, explanations, symbols, units, or additional text.\n"
    "The response must contain only the number.")


@pytest.fixture
def shipped(proxy_factory, fake_vllm_factory, media_root):
    """configs/libero.yaml as shipped, its endpoints on fakes answering each template's answer format."""
    fakes = {QWEN: fake_vllm_factory(served_model_name="Qwen2.5-VL-7B-Instruct", default_text="75"),
             PRIMO: fake_vllm_factory(served_model_name="PRIMO-R1-7B",
                                      default_text="<think>x</think><answer>60</answer>")}

    def make(**frames_overrides):
        data = yaml.safe_load(CONFIG.read_text())
        data["proxy"]["allowed_media_roots"] = [str(media_root)]
        for name, fake in fakes.items():
            data["backends"][name]["endpoints"] = [fake.base_url]
            data["backends"][name]["frames"].update(frames_overrides)
        server = proxy_factory(settings_from_dict(data, base_dir=CONFIG.parent, source=str(CONFIG)))
        return server, fakes

    return make


def _post(server, **request):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/score", json={"task_text": TASK, **request})
    assert response.status_code == 200, response.text
    return response.json()


def test_qwen_is_asked_as_the_seed_asked_it(shipped):
    server, fakes = shipped()
    result = _post(server, backend=QWEN, frames_npy=npy_b64(episode_frames(64, 256, 256)))
    body = fakes[QWEN].chat_requests[-1]
    assert [m["role"] for m in body["messages"]] == ["user"]  # no system message: Qwen's default applies
    video, text = body["messages"][0]["content"]
    assert text == {"type": "text", "text": SEED_QWEN_PROMPT}
    assert (body["temperature"], body["max_tokens"]) == (0.0, 64)
    assert result["score"] == 0.75 and result["parse"]["source"] == "untagged"  # a bare number, /100 as the seed


def test_primo_gets_its_training_format_budget_and_image_sizes(shipped):
    server, fakes = shipped()
    result = _post(server, backend=PRIMO, frames_npy=npy_b64(episode_frames(64, 256, 256)))
    body = fakes[PRIMO].chat_requests[-1]
    system, user = body["messages"]
    assert system == {"role": "system", "content": PRIMO_SYSTEM_PROMPT}
    first, video, last, text = user["content"]
    prompt = text["text"]
    assert prompt.startswith(PRIMO_RL_PREFIX + "QUESTION:\nTask info:\n" + TASK + "\n\nQuestion:\n")
    assert "\n\nQUESTION TYPE:\nnumerical\n\n" in prompt and prompt.endswith("</answer>" + PRIMO_NUMERICAL)
    required = prompt[prompt.index("Below is the required template:"):]
    tags = ("<think>", "<planning>", "</planning>", "<observation>", "</observation>", "<reasoning>",
            "</reasoning>", "</think>", "<answer>")
    sections = [required.index(tag) for tag in tags]
    assert sections == sorted(sections)
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.1, 0.001, 4096)
    # pixels as qwen-vl-utils gave them to the seed: video frames at the video floor, images by the image rule
    frames = [decode_jpeg_b64(base64.b64encode(j).decode()) for j in decode_video_part(video["video_url"]["url"], -1)]
    assert {f.shape for f in frames} == {(336, 336, 3)}
    for image in (first, last):
        assert decode_jpeg_b64(image["image_url"]["url"].split(",", 1)[1]).shape == (252, 252, 3)
    info = result["frames"]
    assert info["size"] == [336, 336] and info["still_size"] == [252, 252] and info["fps"] == 4.0
    assert info["vision_tokens"] == (16 // 2) * 12 * 12 + 2 + 2 * (9 * 9 + 2)  # 1320


def test_primo_takes_at_most_22_frames_and_says_it_clamped(shipped):
    server, fakes = shipped()
    result = _post(server, backend=PRIMO, nframes=40, frames_npy=npy_b64(episode_frames(100, 64, 64)))
    assert (result["frames"]["requested"], result["frames"]["count"]) == (40, 22)
    assert fakes[PRIMO].chat_requests[-1]["media_io_kwargs"]["video"]["num_frames"] == 22


@pytest.mark.parametrize("presentation", ["seed", "episode", 2.0])
def test_one_episode_three_transports_one_upstream_body(shipped, media_root, presentation):
    """An MP4 path, PNG frames and frames_npy carrying the same episode give byte-identical bodies."""
    server, fakes = shipped(presentation_fps=presentation)
    frames = episode_frames(48, 256, 256)
    path = write_lossless_video(media_root / "episode.avi", frames, fps=20.0)
    common = {"backend": PRIMO, "video_fps": 4}
    results = [_post(server, video_path=str(path), **common),
               _post(server, frames=images_b64(frames), fps=20.0, **common),
               _post(server, frames_npy=npy_b64(frames), fps=20.0, **common)]
    bodies = fakes[PRIMO].chat_requests[-3:]
    assert bodies[0] == bodies[1] == bodies[2]
    told = bodies[0]["media_io_kwargs"]["video"]["fps"]
    assert told == pytest.approx({"seed": 4.0, "episode": 20.0 * 16 / 48, 2.0: 2.0}[presentation], abs=1e-6)
    assert len({r["frames"]["fps"] for r in results}) == 1 and len({tuple(r["frames"]["sha256"]) for r in results}) == 1


def test_the_seeds_prompt_kwargs_keep_their_meaning_bounded_and_recorded(shipped):
    server, fakes = shipped()
    episode = {"frames_npy": npy_b64(episode_frames(8, 64, 64))}
    template = "Rate the robot on {task_instruction}. Only a number."
    result = _post(server, backend=QWEN, backend_kwargs={"prompt_template": template}, **episode)
    sent = fakes[QWEN].chat_requests[-1]["messages"][-1]["content"][-1]["text"]
    assert sent == f"Rate the robot on {TASK}. Only a number."
    assert result["prompt"]["overrides"] == {"prompt_template": hashlib.sha256(template.encode()).hexdigest()}
    # PRIMO: system_prompt replaces the system text; a user_prompt without a placeholder gets the task in front
    _post(server, backend=PRIMO, backend_kwargs={"system_prompt": "Be brief.", "user_prompt": "How far along?"},
          **episode)
    system, user = fakes[PRIMO].chat_requests[-1]["messages"]
    assert system["content"] == "Be brief." and user["content"][-1]["text"] == f"Task info:\n{TASK}\n\nHow far along?"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        too_long = http.post("/score", json={"task_text": TASK, **episode,
                                             "backend_kwargs": {"system_prompt": "x" * 20_000}})
        both = http.post("/score", json={"task_text": TASK, **episode,
                                         "backend_kwargs": {"user_prompt": "a", "prompt_template": "b"}})
    assert too_long.status_code == 422 and too_long.json()["error"]["field"] == "backend_kwargs.system_prompt"
    assert both.status_code == 422 and "not both" in both.json()["error"]["message"]
