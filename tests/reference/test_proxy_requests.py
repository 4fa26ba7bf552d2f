"""The proxy's REAL upstream requests, checked with vLLM 0.32.0's own code (the contract tier).

The real proxy (uvicorn on loopback) runs on the shipped ``configs/libero.yaml`` backends, with
only their endpoints pointed at fake ``vllm serve`` processes that record each body. Each
recorded body is then handed, byte for byte, to ``vllm_oracle.py`` (vLLM's ChatCompletionRequest,
validate_request_mm_kwargs, media_io_kwargs merge, chat parser and MediaIO decoders), once for
the whole module:

* under the launchers' server config (``--media-io-kwargs '{"video": {"num_frames": -1}}'
  --trust-request-mm-kwargs --limit-mm-per-prompt ...``): valid, accepted, and the decoded frames
  are exactly the ones the proxy says it sent (count, order, size, timing metadata);
* under a stock server (no flags): refused on ``media_io_kwargs``, naming the flag;
* for long episodes, the same body without ``media_io_kwargs`` under a stock server keeps only
  32 frames (the contrast that shows the per-request kwargs are what keeps them all).

Episodes come from ``tests/fakes/episodes.py``: frame brightness increases with the frame index,
so decoded frame means identify which source frame each decoded frame is.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from launchers.commands import MEDIA_IO_KWARGS, default_limit_mm
from proxy.config import SamplingConfig, settings_from_dict
from tests.fakes.episodes import episode_frames, images_b64, npy_b64, write_mp4
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.reference.oracle import (
    LAUNCHER_SERVER,
    STOCK_SERVER,
    image_parts,
    launcher_server,
    only_video,
    payload,
    reference_python,
    run_oracle,
)

pytestmark = pytest.mark.reference

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "libero.yaml"
LAUNCHERS = REPO / "launchers"

QWEN, PRIMO, PLAIN = "qwen2_5_vl_vllm", "PRIMO-R1", "plain_images"
PLAIN_MODEL = "plain-vlm"
# Not shipped: the `images` layout, on the shipped Qwen backend's settings, 4 frames.
PLAIN_NFRAMES = 4
# A generation_config.json unlike every shipped value: a field the request left out would show.
# (vLLM 0.32's ModelConfig.get_diff_sampling_param reads these 7 + max_new_tokens from it.)
HOSTILE_GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                             "repetition_penalty": 1.05, "presence_penalty": 1.5,
                             "frequency_penalty": 0.5}
SAMPLING_FIELDS = tuple(SamplingConfig.model_fields)  # every field the config can pin
# Decoded frame mean vs the source frame's mean: JPEG + resize (~0.1 measured), and for the mp4
# case also mp4v's lossy coding (~2.6 measured). Both stay under half the smallest step between
# consecutive sampled frames (1.96 and 8.86), so each decoded frame identifies one source frame.
MEAN_TOL = 0.75
MEAN_TOL_MP4 = 4.0
VLLM_DEFAULT_NUM_FRAMES = 32


@dataclass(frozen=True)
class Case:
    backend: str
    source: str  # "npy" | "png" | "mp4"
    count: int  # source frames
    height: int
    width: int
    source_fps: float  # the episode's real rate (for "png" without fps: the backend default, 4.0)
    send_fps: bool = True
    nframes: int | None = None  # per-request; None = the backend's shipped default
    long: bool = False


CASES: dict[str, Case] = {
    # shipped Qwen: mp4 at 20 fps, 480x640 frames (over max_pixels: downscaled), 16 of 24 frames
    "qwen_mp4": Case(QWEN, "mp4", 24, 480, 640, 20.0),
    # shipped PRIMO-R1: PNG frames without fps (the backend's default_source_fps), 16 of 30
    "primo_png": Case(PRIMO, "png", 30, 128, 160, 4.0, send_fps=False),
    "images_npy": Case(PLAIN, "npy", 9, 64, 64, 10.0),
    # long episodes: 300 frames of 56x56 at 20 fps, 40 and 100 sampled (past vLLM's default 32)
    "qwen_40": Case(QWEN, "npy", 300, 56, 56, 20.0, nframes=40, long=True),
    "qwen_100": Case(QWEN, "npy", 300, 56, 56, 20.0, nframes=100, long=True),
    # shipped PRIMO-R1 takes at most 22 frames (its evaluation's cap): 40 asked, 22 sent
    "primo_40": Case(PRIMO, "npy", 300, 56, 56, 20.0, nframes=40),
    "primo_100": Case(PRIMO, "npy", 300, 56, 56, 20.0, nframes=100),
}
# Not checked by the generic tests: a per-request nframes above the images backend's configured
# nframes, which sets the --limit-mm-per-prompt that `vlm-reward-proxy up` starts vLLM with.
EDGE_CASES: dict[str, Case] = {
}
VIDEO_CASES = [n for n, c in CASES.items() if c.backend != PLAIN]
LONG_CASES = [n for n, c in CASES.items() if c.long]
PRIMO_CASES = [n for n, c in CASES.items() if c.backend == PRIMO]
QWEN_CASES = [n for n, c in CASES.items() if c.backend == QWEN]


def shipped_config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text())


def _settings_data(endpoints: dict[str, str], media_root: Path) -> dict[str, Any]:
    """configs/libero.yaml as shipped, endpoints (and the media root) replaced; + an images backend."""
    data = shipped_config()
    assert set(data["backends"]) == {QWEN, PRIMO}, "configs/libero.yaml's backends changed: update this tier"
    data["proxy"]["allowed_media_roots"] = [str(media_root)]
    for name, backend in data["backends"].items():
        backend["endpoints"] = [endpoints[name]]
    plain = copy.deepcopy(data["backends"][QWEN])
    plain.update(model=PLAIN_MODEL, aliases=[], layout="images", endpoints=[endpoints[PLAIN]],
                 frames={**plain["frames"], "nframes": PLAIN_NFRAMES})
    data["backends"][PLAIN] = plain
    return data


@dataclass
class Exchange:
    case: Case
    frames: np.ndarray  # the source episode
    response: dict[str, Any]  # the proxy's 200 answer
    body: dict[str, Any]  # the exact JSON the proxy sent to vLLM
    backend: Any  # BackendConfig the proxy ran with


def _score_request(name: str, case: Case, frames: np.ndarray, media_root: Path) -> dict[str, Any]:
    req: dict[str, Any] = {"task_text": f"put the bowl on the plate ({name})", "backend": case.backend}
    if case.source == "mp4":
        req["video_path"] = str(write_mp4(media_root / f"{name}.mp4", frames, fps=case.source_fps))
    elif case.source == "png":
        req["frames"] = images_b64(frames)
    else:
        req["frames_npy"] = npy_b64(frames)
    if case.send_fps and case.source != "mp4":
        req["fps"] = case.source_fps
    if case.nframes is not None:
        req["nframes"] = case.nframes
    return req


@pytest.fixture(scope="module")
def exchanges(tmp_path_factory) -> Iterator[dict[str, Exchange]]:
    """Every case through the real proxy, against recording fakes; the oracle venv is checked first."""
    reference_python()  # skip (or fail under VLM_REQUIRE_REFERENCE=1) before starting anything
    media_root = tmp_path_factory.mktemp("contract_media")
    models = {QWEN: None, PRIMO: None, PLAIN: PLAIN_MODEL}
    for name, backend in shipped_config()["backends"].items():
        models[name] = backend["model"]
    fakes: dict[str, FakeVLLMThread] = {}
    proxy: ProxyServerThread | None = None
    try:
        for name, model in models.items():
            # each shipped template's declared answer: PRIMO's <answer> tag, the seed's bare number
            reply = "<answer>60</answer>" if name == PRIMO else "60"
            fakes[name] = FakeVLLMThread(FakeConfig(served_model_name=model, default_text=reply)).start()
        settings = settings_from_dict(_settings_data({n: f.base_url for n, f in fakes.items()}, media_root),
                                      base_dir=CONFIG.parent, source=str(CONFIG))
        proxy = ProxyServerThread(settings).start()
        out: dict[str, Exchange] = {}
        with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
            for name, case in {**CASES, **EDGE_CASES}.items():
                frames = episode_frames(case.count, case.height, case.width)
                response = http.post("/score", json=_score_request(name, case, frames, media_root))
                assert response.status_code == 200, (name, response.text)
                body = fakes[case.backend].chat_requests[-1]
                out[name] = Exchange(case, frames, response.json(), body, settings.backends[case.backend])
        yield out
    finally:
        if proxy is not None:
            proxy.stop()
        for fake in fakes.values():
            fake.stop()


def _without_media_io_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "media_io_kwargs"}


@pytest.fixture(scope="module")
def reports(exchanges) -> dict[tuple[str, str], dict[str, Any]]:
    """One oracle run for the module: (case, server variant) -> vLLM's report."""
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for name, ex in exchanges.items():
        if name in EDGE_CASES:
            docs[(name, "launcher")] = payload(ex.body, launcher_server(default_limit_mm(ex.backend)))
            continue
        server = launcher_server(default_limit_mm(ex.backend))
        server["default_sampling_params"] = HOSTILE_GENERATION_CONFIG
        docs[(name, "launcher")] = payload(ex.body, server)
        docs[(name, "stock")] = payload(ex.body, STOCK_SERVER)
        if ex.case.long:
            stripped = _without_media_io_kwargs(ex.body)
            docs[(name, "stock_no_kwargs")] = payload(stripped, STOCK_SERVER)
            docs[(name, "launcher_no_kwargs")] = payload(stripped, launcher_server(default_limit_mm(ex.backend)))
    keys = list(docs)
    return dict(zip(keys, run_oracle([docs[k] for k in keys]), strict=True))



def _expected_means(ex: Exchange) -> list[float]:
    """Mean of each source frame the proxy says it sent (response indices), before JPEG/resize."""
    return [float(ex.frames[i].mean()) for i in ex.response["frames"]["indices"]]


def _max_pixels(ex: Exchange) -> int:
    return ex.backend.frames.max_pixels  # no case overrides max_pixels per request


def _assert_same_frames(got: list[float], ex: Exchange) -> None:
    tol = MEAN_TOL_MP4 if ex.case.source == "mp4" else MEAN_TOL
    want = _expected_means(ex)
    assert len(got) == len(want)
    worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
    assert worst <= tol, f"decoded frame means {got} vs source frames {want} (worst {worst:.2f})"
    assert all(b > a for a, b in zip(got, got[1:], strict=False)), f"not strictly increasing: {got}"
    # first ~ the darkest (episode start), last ~ the brightest (episode end)
    assert got[0] == pytest.approx(float(ex.frames[0].mean()), abs=tol)
    assert got[-1] == pytest.approx(float(ex.frames[-1].mean()), abs=tol)


# --- the launchers' server: valid, accepted, nothing ignored --------------------------------------


def test_launcher_server_block_mirrors_the_launchers():
    """LAUNCHER_SERVER is what launchers/*.sh and launchers/commands.py start vLLM with."""
    assert LAUNCHER_SERVER["trust_request_mm_kwargs"] is True
    assert LAUNCHER_SERVER["media_io_kwargs"] == json.loads(MEDIA_IO_KWARGS) == {"video": {"num_frames": -1}}
    shell = (LAUNCHERS / "_serve_vllm.sh").read_text()
    assert "MEDIA_IO_KWARGS='" + MEDIA_IO_KWARGS + "'" in shell
    assert re.search(r"^\s*--trust-request-mm-kwargs\s*$", shell, re.M)
    data = _settings_data({QWEN: "http://x/v1", PRIMO: "http://x/v1", PLAIN: "http://x/v1"}, Path("/tmp"))
    settings = settings_from_dict(data, base_dir=CONFIG.parent)
    for script, backend in (("serve_qwen2_5_vl.sh", QWEN), ("serve_primo_r1.sh", PRIMO)):
        m = re.search(r"^DEFAULT_LIMIT_MM='(.*)'$", (LAUNCHERS / script).read_text(), re.M)
        assert m, script
        assert json.loads(m.group(1)) == default_limit_mm(settings.backends[backend]), script


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_accepts_the_request_under_the_launchers_server(reports, name):
    r = reports[(name, "launcher")]
    assert r["request_valid"], r["validation_error"]
    assert r["mm_kwargs_check"]["ok"], r["mm_kwargs_check"]
    assert r["decode_ok"], r["decode_error"]
    assert r["would_accept"] and r["error_response"] is None, r["error_response"]
    assert r["ignored_fields"] == [], f"fields vLLM accepts but ignores: {r['ignored_fields']}"


@pytest.mark.parametrize("name", list(CASES))
def test_shipped_sampling_wins_over_the_generation_config(reports, exchanges, name):
    """The fields the proxy sends are the shipped ones, whatever generation_config.json says."""
    r = reports[(name, "launcher")]
    sampling = r["sampling"]
    assert sampling["ok"], sampling["message"]
    shipped = exchanges[name].backend.sampling
    assert {f: exchanges[name].body[f] for f in SAMPLING_FIELDS} == shipped.model_dump()
    params = sampling["params"]
    for field in SAMPLING_FIELDS:
        assert params[field] == pytest.approx(getattr(shipped, field)), field
    assert params["n"] == 1


def test_no_sampling_field_is_left_to_the_generation_config(reports):
    """vLLM's own list of server-defaulted sampling fields: the request must set every one."""
    left = {name: reports[(name, "launcher")]["sampling"]["omitted_fields"] for name in CASES}
    assert all(not fields for fields in left.values()), f"left to generation_config.json: {left}"
    # with the (hostile) generation config above, an omitted penalty is applied to scoring
    applied = {name: {f: reports[(name, "launcher")]["sampling"]["params"][f]
                      for f in ("presence_penalty", "frequency_penalty")} for name in CASES}
    assert all(v == {"presence_penalty": 0.0, "frequency_penalty": 0.0} for v in applied.values()), applied


@pytest.mark.parametrize("name", VIDEO_CASES)
def test_stock_server_refuses_the_request_naming_the_flag(reports, name):
    r = reports[(name, "stock")]
    assert r["request_valid"]
    check = r["mm_kwargs_check"]
    assert check["ok"] is False and check["param"] == "media_io_kwargs", check
    assert "--trust-request-mm-kwargs" in check["message"]
    assert r["would_accept"] is False
    err = r["error_response"]["error"]
    assert (err["code"], err["param"]) == (400, "media_io_kwargs"), err
    assert "--trust-request-mm-kwargs" in err["message"]


# --- the decoded video is what the proxy meant -----------------------------------------------------


@pytest.mark.parametrize("name", VIDEO_CASES)
def test_vllm_decodes_exactly_the_frames_the_proxy_sent(reports, exchanges, name):
    ex, r = exchanges[name], reports[(name, "launcher")]
    meant = ex.response["frames"]
    count = meant["count"]
    assert count == len(meant["indices"]) == ex.body["media_io_kwargs"]["video"]["num_frames"]
    asked = ex.case.nframes or ex.backend.frames.nframes
    assert meant["requested"] == asked and count == min(asked, ex.backend.frames.clamp_nframes_to or asked)
    assert meant["indices"][0] == 0 and meant["indices"][-1] == ex.case.count - 1
    # the request's kwargs win over the server's num_frames -1
    assert r["media_io_kwargs"]["merged"] == ex.body["media_io_kwargs"]
    video = only_video(r)
    assert video["num_frames"] == count
    _assert_same_frames(video["frame_means"], ex)
    # size: one size, a multiple of 28, within the pixel budget, the one the proxy reports
    width, height = video["width"], video["height"]
    assert video["frame_sizes_distinct"] == 1 and video["channels"] == 3
    assert width % 28 == 0 and height % 28 == 0 and width * height <= _max_pixels(ex)
    assert [width, height] == list(meant["size"])
    # timing: the presentation rate (shipped: "seed", the client's video_fps, 4 when not given)
    md = video["metadata"]
    assert md["fps"] == pytest.approx(meant["fps"], rel=1e-9) and meant["fps"] == ex.backend.frames.default_video_fps
    assert md["duration"] == pytest.approx(count / meant["fps"], rel=1e-5)
    assert meant["sampled_fps"] == pytest.approx(ex.case.source_fps * count / ex.case.count, rel=1e-5)
    assert md["total_num_frames"] == count
    assert md["frames_indices"] == list(range(count))
    assert md["do_sample_frames"] is False


def test_a_large_frame_is_downscaled_within_the_budget(exchanges):
    """The mp4 case's 480x640 frames exceed max_pixels: the size sent really shrank."""
    width, height = exchanges["qwen_mp4"].response["frames"]["size"]
    assert width * height < 480 * 640 and width * height > 0.6 * _max_pixels(exchanges["qwen_mp4"])


@pytest.mark.parametrize("name", LONG_CASES)
def test_long_episode_keeps_every_sampled_frame_and_the_contrast(reports, exchanges, name):
    ex = exchanges[name]
    n = ex.case.nframes
    assert n > VLLM_DEFAULT_NUM_FRAMES
    kept = only_video(reports[(name, "launcher")])
    assert kept["num_frames"] == n
    assert kept["frame_means"][-1] == pytest.approx(float(ex.frames[-1].mean()), abs=MEAN_TOL)
    assert ex.response["frames"]["indices"][-1] == ex.case.count - 1

    # contrast: the same body without media_io_kwargs, on a server without --media-io-kwargs
    stock = reports[(name, "stock_no_kwargs")]
    assert stock["would_accept"], stock["error_response"]  # 200 OK: the loss is silent
    cut = only_video(stock)
    assert cut["num_frames"] == VLLM_DEFAULT_NUM_FRAMES
    assert cut["frame_means"] == pytest.approx(kept["frame_means"][:VLLM_DEFAULT_NUM_FRAMES], abs=0.01)
    assert max(cut["frame_means"]) < kept["frame_means"][-1] - 30  # the episode's end is gone
    assert cut["metadata"]["fps"] == 1.0

    # and the launchers' --media-io-kwargs alone keeps the frames, but not the timing
    net = only_video(reports[(name, "launcher_no_kwargs")])
    assert net["num_frames"] == n
    assert net["metadata"]["fps"] == 1.0 and net["metadata"]["duration"] == pytest.approx(n)


# --- layouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", QWEN_CASES)
def test_qwen_messages_are_video_and_text_without_a_system_message_as_the_seed(reports, name):
    r = reports[(name, "launcher")]
    assert [m["role"] for m in r["messages"]] == ["user"]  # Qwen's chat template adds its default
    assert [p["type"] for p in r["messages"][0]["parts"]] == ["video_url", "text"]
    assert f"({name})" in r["messages"][0]["parts"][1]["text"]


@pytest.mark.parametrize("name", PRIMO_CASES)
def test_primo_messages_are_image_video_image_text_with_first_and_last_frames(reports, exchanges, name):
    r = reports[(name, "launcher")]
    assert [m["role"] for m in r["messages"]] == ["system", "user"]
    assert "<answer>" in r["messages"][0]["parts"][0]["text"]
    assert [p["type"] for p in r["messages"][1]["parts"]] == ["image_url", "video_url", "image_url", "text"]
    first, last = image_parts(r)
    video = only_video(r)
    width, height = exchanges[name].response["frames"]["still_size"]  # the image rule, not the video's
    for img in (first, last):
        assert img["image"] == {"width": width, "height": height, "mode": "RGB"}
    assert first["image_mean"] == pytest.approx(video["frame_means"][0], abs=1.5)
    assert last["image_mean"] == pytest.approx(video["frame_means"][-1], abs=1.5)
    assert last["image_mean"] > first["image_mean"] + 150
    assert exchanges[name].response["prompt"]["name"] == "primo_r1_trained"


def test_images_layout_sends_each_frame_as_an_image(reports, exchanges):
    ex, r = exchanges["images_npy"], reports[("images_npy", "launcher")]
    assert "media_io_kwargs" not in ex.body
    assert [p["type"] for p in r["messages"][-1]["parts"]] == ["image_url"] * PLAIN_NFRAMES + ["text"]
    images = image_parts(r)
    assert len(images) == ex.response["frames"]["count"] == PLAIN_NFRAMES
    width, height = ex.response["frames"]["size"]
    assert all(p["image"] == {"width": width, "height": height, "mode": "RGB"} for p in images)
    assert width % 28 == 0 and height % 28 == 0 and width * height <= _max_pixels(ex)
    _assert_same_frames([p["image_mean"] for p in images], ex)
    # nothing per request: a stock server takes it as is
    stock = reports[("images_npy", "stock")]
    assert stock["mm_kwargs_check"]["ok"] and stock["would_accept"], stock["error_response"]
