"""Per-episode overhead of the RLinf client: inline frames vs the seed's temporary MP4.

Not a test. Runs the real proxy and fake vLLMs (instant replies) as separate processes on
loopback, as deployed (the client lives in RLinf's env worker), so what is timed is the client,
the transfer and the proxy's media work, not a model. For each transport it reports:
  build_ms    client: pick frames from the episode buffer, encode them (npy+base64 / MP4), JSON
  body_kb     bytes sent to the proxy (the MP4 for `path`, which travels over a shared disk)
  e2e_ms      one episode through RewardClient.score_episode, sequential (p50 / p90)
  proxy_ms    the proxy's load+encode for that episode (decode npy / MP4, resize, JPEG)
  burst_s     N episodes scored at once (an env worker's end-of-rollout burst)
Episodes are LIBERO-sized: T steps of 256x256 RGB, buffered as RLinf's hook does.

    .venv/bin/python bench/bench_client.py [--steps 512] [--repeats 20] [--burst 32] [--in-process]

Prints a table and writes bench/results/bench_client-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import env_info, pct, start_fake, start_proxy, stop, write_json  # noqa: E402
from proxy.config import settings_from_dict  # noqa: E402
from rlinf_client import Episode, EpisodeFrameBuffer, RewardClient, RewardModelConfig  # noqa: E402
from rlinf_client._base_client import build_request_body  # noqa: E402
from tests.conftest import libero_settings_dict  # noqa: E402
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread  # noqa: E402
from tests.fakes.proxy_server import ProxyServerThread  # noqa: E402
from tests.helpers import PRIMO_MODEL, PRIMO_REPLY, QWEN_MODEL, QWEN_REPLY  # noqa: E402

MODES = {  # name -> reward_model overrides (the burst uses /score/batch only where batch: auto)
    "binary (16 picked, raw npy part; the default)": {"transport": "binary", "client_sampling": True},
    "binary, burst as /score/batch": {"transport": "binary", "client_sampling": True, "batch": "auto"},
    "inline (16 picked, npy)": {"transport": "inline", "client_sampling": True},
    "inline, burst as /score/batch": {"transport": "inline", "client_sampling": True, "batch": "auto"},
    "inline (all held, npy)": {"transport": "inline", "client_sampling": False},
    "path (16 picked, temp MP4)": {"transport": "path", "client_sampling": True},
}


def synthetic_episode(steps: int, size: int = 256, seed: int = 0) -> np.ndarray:
    """A moving scene: a gradient background, a square that travels, mild sensor noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    background = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1).astype(np.int16)
    frames = np.empty((steps, size, size, 3), dtype=np.uint8)
    for t in range(steps):
        frame = background.copy()
        cx = int((size - 40) * t / max(1, steps - 1))
        frame[100:140, cx:cx + 40] = (200, 40, 40)
        frame += rng.integers(-4, 5, size=frame.shape, dtype=np.int16)
        frames[t] = np.clip(frame, 0, 255)
    return frames


def filled_buffer(frames: np.ndarray, capacity: int) -> tuple[EpisodeFrameBuffer, float]:
    buffer = EpisodeFrameBuffer(capacity)
    started = time.perf_counter()
    for frame in frames:
        buffer.append(frame)
    return buffer, (time.perf_counter() - started) * 1e3 / len(frames)


@contextlib.contextmanager
def stack(media: Path, in_process: bool) -> Iterator[str]:
    """Fake Qwen + fake PRIMO + the proxy; yields the proxy's base URL."""
    if in_process:
        with FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, record=False, default_text=QWEN_REPLY)) as qwen, \
                FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL, record=False,
                                          default_text=PRIMO_REPLY)) as primo:
            settings = settings_from_dict(libero_settings_dict([qwen.base_url], [primo.base_url], media))
            with ProxyServerThread(settings) as proxy:
                yield proxy.url
        return
    servers = []
    try:
        servers.append(start_fake(media, "qwen", QWEN_MODEL))
        servers.append(start_fake(media, "primo", PRIMO_MODEL, default_text=PRIMO_REPLY))
        config = libero_settings_dict(*([f"{fake.url}/v1"] for fake in servers), media)
        servers.append(start_proxy(media, config))
        yield servers[-1].url
    finally:
        for server in servers:
            stop(server)


def bench_mode(name: str, overrides: dict, proxy_url: str, media: Path, buffer: EpisodeFrameBuffer,
               repeats: int, burst: int) -> dict:
    cfg = RewardModelConfig.from_mapping({
        "endpoint": f"{proxy_url}/score", "backend": "qwen2_5_vl_vllm", "temp_video_dir": str(media),
        "batch": "never", "fail_on_request_error": True} | overrides)
    episode = Episode(buffer, "put both the alphabet soup and the tomato sauce in the basket", 0.0)
    build_ms, body_bytes = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        body = build_request_body(episode, cfg)
        _, wire = body.encoded()  # what goes on the wire, whatever the transport
        build_ms.append((time.perf_counter() - started) * 1e3)
        body_bytes = (Path(body.temp_video).stat().st_size if body.temp_video else 0) + len(wire)
        body.discard(keep=False)
    e2e_ms, proxy_ms = [], []
    with RewardClient(cfg) as client:
        client.score_episode(buffer, episode.task_text)  # warm the connection
        for _ in range(repeats):
            started = time.perf_counter()
            result = client.score_episode(buffer, episode.task_text)
            e2e_ms.append((time.perf_counter() - started) * 1e3)
            timings = result.response["timings_ms"]
            proxy_ms.append(timings["load"] + timings["encode"])
        started = time.perf_counter()
        results = client.score_episodes([episode] * burst)
        burst_s = time.perf_counter() - started
    assert all(r.ok for r in results)
    return {"mode": name, "build_ms_p50": statistics.median(build_ms), "body_kb": body_bytes / 1024,
            "e2e_ms_p50": statistics.median(e2e_ms), "e2e_ms_p90": pct(e2e_ms, 90),
            "proxy_ms_p50": statistics.median(proxy_ms), "burst": burst, "burst_s": burst_s,
            "frames_sent": result.response["frames"]["source_count"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=512, help="episode length (LIBERO-10: 512)")
    parser.add_argument("--buffer-frames", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--in-process", action="store_true",
                        help="run the proxy and fakes in this process (threads) instead of subprocesses")
    args = parser.parse_args()

    frames = synthetic_episode(args.steps)
    buffer, append_ms = filled_buffer(frames, args.buffer_frames)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, stack(Path(tmp), args.in_process) as proxy_url:
        for name, overrides in MODES.items():
            rows.append(bench_mode(name, overrides, proxy_url, Path(tmp), buffer, args.repeats, args.burst))

    header = (f"episode {args.steps} x 256x256x3, buffer {args.buffer_frames} frames "
              f"(append {append_ms * 1e3:.1f} us/step/env, {buffer.nbytes / 2**20:.1f} MiB held), "
              f"nframes 16, {args.repeats} repeats, proxy {'in process' if args.in_process else 'in its own process'}")
    print(header)
    print(f"{'mode':30} {'sent':>5} {'build ms':>9} {'body KiB':>9} {'e2e p50':>8} {'e2e p90':>8} "
          f"{'proxy ms':>9} {'burst ' + str(args.burst) + ' s':>10}")
    for r in rows:
        print(f"{r['mode']:30} {r['frames_sent']:>5} {r['build_ms_p50']:>9.2f} {r['body_kb']:>9.0f} "
              f"{r['e2e_ms_p50']:>8.2f} {r['e2e_ms_p90']:>8.2f} {r['proxy_ms_p50']:>9.2f} {r['burst_s']:>10.2f}")
    out = write_json(f"bench/results/bench_client-{time.strftime('%Y%m%d-%H%M%S')}.json", {
        "args": vars(args), "append_us_per_step": append_ms * 1e3, "buffer_mib": buffer.nbytes / 2**20,
        "machine": env_info(), "rows": rows})
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
