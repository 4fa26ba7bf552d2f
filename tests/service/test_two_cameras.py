"""Two cameras of one episode (a backend's frames.extra_view) through the real proxy and a fake vLLM:
the second view is taken at the main view's indices and placed as the backend declares — its own
video after the main one (second_video), or beside the main view in every frame at half the pixel
budget each (side_by_side) — with its provenance, its frames in the frame store, and every
mismatch refused. One proxy and one fake serve the module (the fake is reset between tests).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from proxy.config import settings_from_dict
from proxy.prompting.layouts import video_uuid
from rlinf_client import Episode, FramesError, RewardClient, RewardModelConfig
from rlinf_client._base_client import build_request_body
from tests.client.standin_env import StandInLiberoEnv
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import decode_jpeg_b64, episode_frames, frame_level, images_b64, npy_b64, write_mp4
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread, decode_video_part
from tests.fakes.proxy_server import ProxyServerThread
from vlm_protocol import frames as frame_rules
from vlm_protocol.frame_store import frame_path

TASK = "put the black bowl on the plate"
COUNT, SIZE = 24, 64
MAIN = episode_frames(COUNT, SIZE, SIZE)


def wrist_frames(count: int = COUNT, height: int = SIZE, width: int = SIZE) -> np.ndarray:
    """A view the main one cannot be mistaken for: pure blue, brightest first (the main view's grey rises)."""
    frames = np.zeros((count, height, width, 3), dtype=np.uint8)
    for i in range(count):
        frames[i, ..., 2] = 235 - round(200 * i / max(1, count - 1))
    return frames


WRIST = wrist_frames()
TIGHT_MODEL_LEN = 2200  # one 16-frame view at the video floor (~1154 vision tokens) fits, two do not
MAX_DECODED_MB = 12  # one request's decoded frames: both views of a 16-frame 64x64 episode (2 x 5.4 MB) fit


@dataclasses.dataclass
class Stack:
    proxy: ProxyServerThread
    fake: FakeVLLMThread
    http: httpx.Client
    media: Path
    frame_store: Path

    def score(self, backend: str, **fields) -> httpx.Response:
        body = {"task_text": TASK, "frames_npy": npy_b64(MAIN), "backend": backend,
                "extra_view": {"frames_npy": npy_b64(WRIST)}, **fields}
        return self.http.post("/score", json={k: v for k, v in body.items() if v is not None})

    def videos(self) -> list[list[np.ndarray]]:
        """Each video part of the one chat request made, as decoded RGB frames."""
        (body,) = self.fake.chat_requests
        return videos_of(body)


def videos_of(body: dict) -> list[list[np.ndarray]]:
    """Each video part of a chat request, as decoded RGB frames."""
    return [[decode_jpeg_b64(base64.b64encode(j).decode()) for j in decode_video_part(part["video_url"]["url"], -1)]
            for part in body["messages"][-1]["content"] if part["type"] == "video_url"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    media, store = tmp_path_factory.mktemp("media"), tmp_path_factory.mktemp("frames")
    fake = FakeVLLMThread(FakeConfig(served_model_name="Qwen2.5-VL-7B-Instruct", default_text="<score>40</score>"))
    fake.start()
    data = libero_settings_dict([fake.base_url], [fake.base_url], media, frame_store={"dir": str(store)},
                                max_decoded_mb=MAX_DECODED_MB,
                                audit_log=str(tmp_path_factory.mktemp("runs") / "audit.jsonl"))
    qwen, primo = data["backends"]["qwen2_5_vl_vllm"], data["backends"]["PRIMO-R1"]
    data["backends"] = {
        "one_view": qwen,
        "two_videos": {**qwen, "frames": {**qwen["frames"], "extra_view": "second_video"}},
        # room for one view's tokens, not two (the token check counts the second video)
        "two_videos_tight": {**qwen, "frames": {**qwen["frames"], "extra_view": "second_video"},
                             "max_model_len": TIGHT_MODEL_LEN},
        "side_by_side": {**qwen, "frames": {**qwen["frames"], "extra_view": "side_by_side"}},
        "primo_side_by_side": {**primo, "model": qwen["model"], "prompt": qwen["prompt"],
                               "frames": {**primo["frames"], "extra_view": "side_by_side"}},
    }
    proxy = ProxyServerThread(settings_from_dict(data)).start()
    http = httpx.Client(base_url=proxy.url, timeout=30, trust_env=False)
    try:
        yield Stack(proxy, fake, http, media, store)
    finally:
        http.close()
        proxy.stop()
        fake.stop()


@pytest.fixture(autouse=True)
def _fresh_fake(stack: Stack) -> Iterator[None]:
    stack.fake.fake.reset()
    yield


def blue(rgb: np.ndarray) -> float:
    return float(rgb[..., 2].mean())


def test_second_video_is_the_wrist_view_at_the_main_views_indices(stack: Stack) -> None:
    response = stack.score("two_videos")
    assert response.status_code == 200, response.text
    frames = response.json()["frames"]
    main, wrist = stack.videos()
    assert len(main) == len(wrist) == frames["count"] == 16
    for index, main_frame, wrist_frame in zip(frames["indices"], main, wrist, strict=True):
        assert abs(frame_level(main_frame) - frame_level(MAIN[index])) < 4
        assert abs(blue(wrist_frame) - WRIST[index, 0, 0, 2]) < 4 and wrist_frame[..., :2].mean() < 4
    extra = frames["extra_view"]
    (body,) = stack.fake.chat_requests
    parts = [p for p in body["messages"][-1]["content"] if p["type"] == "video_url"]
    jpegs = decode_video_part(parts[1]["video_url"]["url"], -1)
    assert extra["sha256"] == [hashlib.sha256(j).hexdigest() for j in jpegs]
    assert parts[1]["uuid"] == video_uuid(extra["sha256"], body["media_io_kwargs"]["video"])
    assert extra["placement"] == "second_video" and extra["source_count"] == COUNT
    # Each video at the backend's budget: the second costs what the first does, and both are counted.
    width, height = frames["size"]
    one = frame_rules.vision_tokens(height, width, 16, video=True)
    assert tuple(extra["size"]) == (width, height) and extra["vision_tokens"] == one
    assert frames["vision_tokens"] == 2 * one
    # The audit line names the second view as the answer does; both views' JPEGs are in the frame store.
    stack.proxy.flush_audit()
    audit = json.loads(Path(stack.proxy.settings.proxy.audit_log).read_text().splitlines()[-1])
    assert audit["frames"]["extra_view"] == extra and audit["frames"]["vision_tokens"] == 2 * one
    for sha in [*frames["sha256"], *extra["sha256"]]:
        assert frame_path(stack.frame_store, sha).read_bytes() and \
            hashlib.sha256(frame_path(stack.frame_store, sha).read_bytes()).hexdigest() == sha


def test_side_by_side_puts_both_views_in_every_frame_at_half_the_budget_each(stack: Stack) -> None:
    response = stack.score("side_by_side", max_pixels=50176, frames_npy=npy_b64(episode_frames(COUNT, 224, 224)),
                           extra_view={"frames_npy": npy_b64(wrist_frames(COUNT, 224, 224))})
    assert response.status_code == 200, response.text
    frames = response.json()["frames"]
    (video,) = stack.videos()
    extra = frames["extra_view"]
    (main_w, main_h), (wrist_w, wrist_h) = extra["main_size"], extra["size"]
    assert main_h == wrist_h == frames["size"][1] and main_w + wrist_w == frames["size"][0]
    # qwen-vl-utils' video rule over half of every budget, for each 224x224 view
    half = frame_rules.episode_sizes(224, 224, 16, max_pixels=50176 // 2, min_pixels=frame_rules.VIDEO_MIN_PIXELS // 2,
                                     video_max_pixels=frame_rules.VIDEO_MAX_PIXELS // 2,
                                     total_pixels=frame_rules.VIDEO_TOTAL_PIXELS // 2,
                                     image_min_pixels=frame_rules.IMAGE_MIN_PIXELS // 2, stills=False)[0]
    assert (main_h, main_w) == (wrist_h, wrist_w) == half
    assert main_w * main_h * 2 <= 50176
    main_source = episode_frames(COUNT, 224, 224)
    for index, frame in zip(frames["indices"], video, strict=True):
        assert frame.shape[:2] == (main_h, main_w + wrist_w)
        left, right = frame[:, :main_w], frame[:, main_w:]
        assert abs(frame_level(left) - frame_level(main_source[index])) < 4
        assert abs(blue(right) - WRIST[index, 0, 0, 2]) < 4 and right[..., :2].mean() < 6
    # One video whose frames hold both views: its tokens are the composite's
    assert frames["vision_tokens"] == frame_rules.vision_tokens(main_h, main_w + wrist_w, 16, video=True)
    assert "sha256" not in extra or extra["sha256"] == []


def test_primo_stills_show_both_views(stack: Stack) -> None:
    response = stack.score("primo_side_by_side")
    assert response.status_code == 200, response.text
    frames = response.json()["frames"]
    (body,) = stack.fake.chat_requests
    stills = [decode_jpeg_b64(p["image_url"]["url"].partition(",")[2])
              for p in body["messages"][-1]["content"] if p["type"] == "image_url"]
    assert [s.shape[1::-1] for s in stills] == [tuple(frames["still_size"])] * 2
    for still, index in zip(stills, (0, COUNT - 1), strict=True):
        half = still.shape[1] // 2
        assert abs(frame_level(still[:, :half]) - frame_level(MAIN[index])) < 4
        assert abs(blue(still[:, half:]) - WRIST[index, 0, 0, 2]) < 4


def test_a_video_file_and_images_are_views_too(stack: Stack) -> None:
    path = write_mp4(stack.media / "wrist.mp4", WRIST)
    for extra_view in ({"video_path": str(path)}, {"frames": images_b64(WRIST)}):
        stack.fake.fake.reset()
        response = stack.score("two_videos", extra_view=extra_view)
        assert response.status_code == 200, response.text
        indices = response.json()["frames"]["indices"]
        _, wrist = stack.videos()
        assert len(wrist) == len(indices) == 16
        for index, frame in zip(indices, wrist, strict=True):  # an MP4 is lossy: within a few levels
            assert abs(blue(frame) - WRIST[index, 0, 0, 2]) < 6, (extra_view.keys(), index)


@pytest.mark.parametrize(("backend", "fields", "status", "field", "words"), [
    ("one_view", {}, 422, "extra_view", "takes one camera"),
    ("two_videos", {"extra_view": None}, 422, "extra_view", "send extra_view"),
    ("two_videos", {"extra_view": {"frames_npy": npy_b64(wrist_frames(COUNT - 1))}}, 422, "extra_view",
     "holds 23 frames and the main view 24"),
    ("two_videos", {"extra_view": {"frames_npy": npy_b64(WRIST), "frames": images_b64(WRIST[:2])}}, 422, None,
     "exactly one of"),
    ("two_videos", {"extra_view": {"frames_npy": "bm90IGFuIG5weQ=="}}, 422, "extra_view.frames_npy",
     "extra_view.frames_npy:"),
    ("two_videos", {"extra_view": {"video_path": "/etc/passwd"}}, 403, "extra_view.video_path",
     "extra_view.video_path:"),
    ("side_by_side", {"frame_rules": "current"}, 422, "frame_rules", "side_by_side composes"),
    # the second view's own errors name it, where the composing finds them too
    ("side_by_side", {"extra_view": {"frames": images_b64(WRIST[:-1]) + images_b64(wrist_frames(1, 32, 32))}}, 422,
     "extra_view.frames", "extra_view.frames: frames of one view must all have the same size"),
    ("two_videos", {"extra_view": {"frames": images_b64(WRIST[:-1]) + images_b64(wrist_frames(1, 32, 32))}}, 422,
     "extra_view.frames", "extra_view.frames: frames of one episode must all have the same size"),
    # raw frames that claim the backend's current rules: refused as for one camera, never resized again
    ("two_videos", {"frame_rules": "current"}, 422, "frames", "must be RGB JPEGs at the rules' sizes"),
    # a tall view beside a wide one would be a frame many times the pixel budget: refused, never stretched
    ("side_by_side", {"frames_npy": npy_b64(episode_frames(COUNT, 512, 32)),
                      "extra_view": {"frames_npy": npy_b64(wrist_frames(COUNT, 32, 512))}}, 422, "extra_view",
     "more pixels than its half of the budget"),
])
def test_a_second_view_that_does_not_fit_is_refused_never_dropped(stack: Stack, backend, fields, status, field,
                                                                 words) -> None:
    if fields.get("frame_rules") == "current":  # the backend's rules as they are now (not a 409 for old ones)
        fields = {**fields, "frame_rules": stack.http.get("/frame-rules").json()["backends"][backend]["rules_id"]}
    response = stack.score(backend, **fields)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    if field is not None:
        assert error.get("field") == field, error
    assert stack.fake.chat_requests == []


def test_both_views_count_against_one_decode_budget(stack: Stack) -> None:
    """24 frames sent at 336x336 (the video floor) keep 8.1 MB per view: one view fits the 12 MB budget, two do not."""
    images = {"frames": images_b64(MAIN), "frames_npy": None, "nframes": 24}
    one = stack.http.post("/score", json={"task_text": TASK, "backend": "one_view", "frames": images["frames"],
                                          "nframes": 24})
    assert one.status_code == 200, one.text
    two = stack.score("two_videos", **images, extra_view={"frames": images_b64(WRIST)})
    assert two.status_code == 413, two.text
    error = two.json()["error"]
    assert error["code"] == "media_budget_exceeded" and error["field"] == "extra_view.frames", error
    assert error["limit"] == "proxy.max_decoded_mb" and error["needed"] > MAX_DECODED_MB
    assert len(stack.fake.chat_requests) == 1  # the one-view episode only


def test_a_video_second_view_over_the_budget_names_its_own_field(stack: Stack) -> None:
    """The main view's inline frames set the budget's field first; the second view's video names its own."""
    path = write_mp4(stack.media / "wrist_budget.mp4", WRIST)
    response = stack.score("two_videos", frames=images_b64(MAIN), frames_npy=None, nframes=24,
                           extra_view={"video_path": str(path)})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "media_budget_exceeded" and error["field"] == "extra_view.video_path", error
    assert stack.fake.chat_requests == []


def test_the_token_check_counts_the_second_video(stack: Stack) -> None:
    response = stack.score("two_videos_tight")
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "token_budget", error
    assert "and a second video of 16 at" in error["message"] and f"over max_model_len {TIGHT_MODEL_LEN}" in \
        error["message"], error
    needed = int(error["message"].split("need about ")[1].split()[0])
    assert needed > 2 * 1154, error  # both views' vision tokens, and the text
    assert stack.fake.chat_requests == []


def test_the_document_caps_a_second_views_inline_frames_as_the_main_views(stack: Stack) -> None:
    schemas = stack.http.get("/openapi.json").json()["components"]["schemas"]
    cap = stack.proxy.settings.proxy.max_inline_frames
    assert schemas["ViewSource"]["properties"]["frames"]["anyOf"][0]["maxItems"] == cap
    assert schemas["ScoreRequest"]["properties"]["frames"]["anyOf"][0]["maxItems"] == cap


def test_dense_curves_refuse_a_second_view(stack: Stack) -> None:
    response = stack.http.post("/score/dense", json={"task_text": TASK, "frames_npy": npy_b64(MAIN),
                                                     "backend": "two_videos", "points": 3,
                                                     "extra_view": {"frames_npy": npy_b64(WRIST)}})
    assert response.status_code == 422 and response.json()["error"]["field"] == "extra_view", response.text
    assert stack.fake.chat_requests == []


# -- the RLinf client and hook ------------------------------------------------------------------------
def client_config(stack: Stack, **overrides) -> RewardModelConfig:
    return RewardModelConfig.from_mapping({"enable": True, "endpoint": f"{stack.proxy.url}/score",
                                           "backend": "two_videos", "timeout": 30, **overrides})


@pytest.mark.parametrize("transport", ["binary", "inline"])
def test_the_client_sends_the_wrist_view_at_the_steps_it_picked(stack: Stack, transport: str) -> None:
    with RewardClient(client_config(stack, transport=transport, batch="never")) as client:
        result = client.score_episode(MAIN, TASK, extra_view=WRIST)
    assert result.ok, result.error
    indices = result.response["frames"]["indices"]  # into the 16 steps the client picked and sent
    steps = frame_rules.sample_indices(COUNT, 16)
    main, wrist = stack.videos()
    assert len(main) == len(wrist) == len(indices) == 16
    for index, main_frame, frame in zip(indices, main, wrist, strict=True):
        assert abs(frame_level(main_frame) - frame_level(MAIN[steps[index]])) < 4
        assert abs(blue(frame) - WRIST[steps[index], 0, 0, 2]) < 4
    assert result.response["frames"]["extra_view"]["source_count"] == 16  # the client sent the 16 steps it picked


def test_a_batch_of_two_camera_episodes_keeps_each_wrist_view_with_its_episode(stack: Stack) -> None:
    """/score/batch renames every part per item: each episode's wrist view must stay its own (the client
    packs what is ready, so the episodes may go in one batch or several: each must stay whole)."""
    body = build_request_body(Episode(MAIN, TASK, extra_view=WRIST), client_config(stack))
    payload, parts = body.named("i7-")
    assert payload["extra_view"] == {"frames_npy": "part:i7-extra_view"} and "i7-extra_view" in parts
    assert body.inline().payload["extra_view"]["frames_npy"] == base64.b64encode(parts["i7-extra_view"][1]).decode()
    wrists = [wrist_frames() // (k + 1) for k in range(3)]
    with RewardClient(client_config(stack, batch="auto")) as client:
        results = client.score_episodes([Episode(MAIN, f"{TASK} {k}", extra_view=w) for k, w in enumerate(wrists)])
    assert all(r.ok for r in results), [r.error for r in results]
    seen = {}
    for body in stack.fake.chat_requests:
        text = next(p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text")
        video = decode_video_part([p for p in body["messages"][-1]["content"] if p["type"] == "video_url"][1]
                                  ["video_url"]["url"], -1)[0]
        seen[int(text.split(TASK + " ")[1][0])] = blue(decode_jpeg_b64(base64.b64encode(video).decode()))
    assert sorted(seen) == [0, 1, 2]
    for k, level in seen.items():
        assert abs(level - wrists[k][0, 0, 0, 2]) < 4, (k, level)


def test_a_two_camera_episode_to_a_one_camera_backend_is_a_failure_not_a_score(stack: Stack) -> None:
    with RewardClient(client_config(stack, backend="one_view", batch="never")) as client:
        result = client.score_episode(MAIN, TASK, fallback=1.0, extra_view=WRIST)
    assert not result.ok and result.reason == "invalid_request" and result.score is None
    assert stack.fake.chat_requests == []


class SteppedCamerasEnv(StandInLiberoEnv):
    """Both cameras show the step they were taken at, as a level that survives resizing and JPEG:
    the main view's green, the wrist view's blue (STEP_LEVEL(step)), so a pair sent out of step shows."""

    def _wrap_obs(self, frames: np.ndarray) -> dict:
        obs = super()._wrap_obs(frames)
        main, wrist = obs["main_images"].copy(), np.zeros_like(obs["main_images"])
        for env, step in enumerate(self._elapsed_steps):
            main[env, ..., 1] = wrist[env, ..., 2] = step_level(int(step))
        obs["main_images"], obs["wrist_images"] = main, wrist
        return obs


def step_level(step: int) -> int:
    return 20 + 6 * step


def test_the_hook_sends_the_envs_wrist_images_in_step_with_the_main_view(stack: Stack) -> None:
    """34 steps through a 16-frame buffer: both cameras' buffers thin out (stride doubling) alike."""
    steps, nframes, buffered = 34, 8, 16
    cfg = {"reward_coef": 1.0, "use_rel_reward": False, "ignore_terminations": False, "auto_reset": False,
           "max_episode_steps": steps,
           "reward_model": {"enable": True, "endpoint": f"{stack.proxy.url}/score", "backend": "two_videos",
                            "timeout": 30, "nframes": nframes, "buffer_frames": buffered,
                            "extra_view": "wrist_images"}}
    env = SteppedCamerasEnv(cfg, [5, None], frame_size=56, wrist=True)
    try:
        env.reset()
        env.chunk_step(steps)
    finally:
        env.vlm_reward.close()
    assert env.vlm_reward.failures == 0 and len(stack.fake.chat_requests) == 2
    last_steps = []
    for body in stack.fake.chat_requests:
        main, wrist = videos_of(body)
        assert len(main) == len(wrist) == (nframes if len(main) > 6 else 6)  # env 0's episode: 6 frames
        main_steps = [round((float(f[..., 1].mean()) - 20) / 6) for f in main]
        wrist_steps = [round((float(f[..., 2].mean()) - 20) / 6) for f in wrist]
        assert main_steps == wrist_steps and main_steps == sorted(set(main_steps)), (main_steps, wrist_steps)
        assert all(f[..., 0].mean() < 4 for f in wrist)  # the wrist view, not the main one
        last_steps.append(main_steps[-1])
    assert sorted(last_steps) == [5, steps]  # env 0 ended at its success, env 1 ran through the buffer


def test_the_hook_stops_loudly_when_the_observation_has_no_such_camera(stack: Stack) -> None:
    cfg = {"reward_coef": 1.0, "use_rel_reward": False, "ignore_terminations": False, "auto_reset": False,
           "max_episode_steps": 4,
           "reward_model": {"enable": True, "endpoint": f"{stack.proxy.url}/score", "backend": "two_videos",
                            "extra_view": "wrist_images"}}
    env = StandInLiberoEnv(cfg, [None], wrist=False)
    try:
        with pytest.raises(FramesError, match="no 'wrist_images'"):
            env.reset()
    finally:
        env.vlm_reward.close()
