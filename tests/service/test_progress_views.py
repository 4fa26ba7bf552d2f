"""Issue 39, item 6: one rule for both cameras on POST /progress/batch, against the real proxy and a
fake embedding server. What only reading an episode's media finds (frames that do not decode, a
file that is not there or not allowed, a frame count over the cap, two views of different lengths)
is that item's own status inside a 200, and fails its task's other items with
progress_group_failed, whichever view it is in; what the request's shape says (a field the schema
refuses) is the whole request's 422, whichever view it is in. Other tasks are measured."""

from __future__ import annotations

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.service.test_progress import item, solid

EMBED_MODEL = "fake-embed"
CAP = 5  # proxy.max_inline_frames


@pytest.fixture
def two_camera_proxy(proxy_factory, fake_qwen, fake_primo, fake_vllm_factory, media_root):
    embed = fake_vllm_factory(served_model_name=EMBED_MODEL)
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, max_inline_frames=CAP)
    data["backends"]["embed"] = {"model": EMBED_MODEL, "kind": "embedding", "endpoints": [embed.base_url],
                                 "frames": {"nframes": 4, "extra_view": "second_video"}}
    return proxy_factory(settings_from_dict(data))


def _episode(task: int, success: bool, level: tuple[int, int, int]) -> dict:
    return {**item(task, success, level), "extra_view": {"frames_npy": solid(level)}}


def _batch(view: str, source: dict) -> list[dict]:
    """Task 1's failure with `source` as its main view's frames or its second view's."""
    broken = _episode(1, False, (2, 2, 2))
    if view == "main":
        broken = {**{k: v for k, v in broken.items() if k != "frames_npy"}, **source}
    else:
        broken["extra_view"] = source
    return [_episode(1, True, (1, 1, 1)), broken, _episode(2, True, (3, 3, 3))]


BROKEN = {  # what only reading the media finds: (source, the item's status and code)
    "not_npy": ({"frames_npy": "bm90IGFuIG5weQ=="}, 422, "media_decode_error"),
    "not_base64": ({"frames": ["!!"] * 4}, 422, "media_decode_error"),
    "not_an_image": ({"frames": ["bm90IGFuIGltYWdl"] * 4}, 422, "media_format_refused"),
    "outside_roots": ({"video_path": "/nonexistent/ep.mp4"}, 403, "media_forbidden"),
    "over_the_cap": ({"frames_npy": solid((5, 5, 5), count=CAP + 1)}, 422, "invalid_request"),
    "other_length": ({"frames_npy": solid((5, 5, 5), count=3)}, 422, "media_decode_error"),
}


@pytest.mark.parametrize("view", ["main", "extra_view"])
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_media_is_its_items_error_in_either_view(two_camera_proxy, view, case):
    source, status, code = BROKEN[case]
    answer = httpx.post(two_camera_proxy.url + "/progress/batch", json={"items": _batch(view, source)}, timeout=30)
    assert answer.status_code == 200, answer.text
    first, broken, other = answer.json()["results"]
    assert (broken["status"], broken["error"]["code"]) == (status, code), broken
    assert first["error"]["code"] == "progress_group_failed" and first["error"]["failed_index"] == 1
    assert other["ok"] and other["result"]["outcome"] == "success"


@pytest.mark.parametrize("view", ["main", "extra_view"])
@pytest.mark.parametrize("source", [{"frames": []}, {"frames_npy": solid((5, 5, 5)), "frames": ["x"]}])
def test_a_shape_the_schema_refuses_is_the_whole_requests_422_in_either_view(two_camera_proxy, view, source):
    answer = httpx.post(two_camera_proxy.url + "/progress/batch", json={"items": _batch(view, source)}, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"].startswith("items.1" + (".extra_view" if view == "extra_view" else ""))
