"""Peak RSS of a proxy process and its video decoder processes under the worst media request the caps
allow (issue 24, item 3), and under the oversized-frame AVI (issue 40).

Builds the issue's file — a few-MB MP4 of static 4096x4096 frames (at proxy.max_source_pixels) —
and an MJPEG AVI stating 64x64 with one 12000x12000 frame (tests/fakes/media_corpus.py), starts a
real proxy (`vlm_reward_cli serve`, default caps) against a fake vLLM on loopback, and samples RSS
(psutil, every 5 ms) of the proxy alone and of the proxy with every process under it (its decoder
processes and their forkserver) while it answers `/score` with nframes 128, `/score/dense` with 8
points and `/score` of the AVI. `--threads` decodes on the proxy's media threads
(`proxy.video_decoders.isolated: false`); `--tree DIR` runs the proxy from another checkout (e.g.
the previous commit, `git archive HEAD | tar -x -C DIR`) for a before/after. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cv2  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict  # noqa: E402
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread  # noqa: E402
from tests.fakes.media_corpus import oversized_frame_avi  # noqa: E402
from tests.helpers import free_ports  # noqa: E402


def write_static_mp4(path: Path, frames: int, side: int) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 20, (side, side))
    frame = np.full((side, side, 3), 90, np.uint8)
    frame[: side // 8, : side // 8] = (0, 0, 255)
    for _ in range(frames):
        writer.write(frame)
    writer.release()
    return path


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of the process, RSS of it and every process under it)."""
    own = proc.memory_info().rss
    total = own
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return own, total


def peak_rss(pid: int, send) -> tuple[int, int, int, int, object]:
    """(proxy RSS before, its peak, proxy-and-decoders RSS before, their peak, the answer) of one request."""
    proc = psutil.Process(pid)
    before, done = tree_rss(proc), threading.Event()
    peak = [0, 0]

    def sample() -> None:
        while not done.is_set():
            own, total = tree_rss(proc)
            peak[0], peak[1] = max(peak[0], own), max(peak[1], total)
            done.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answer = send()
    finally:
        done.set()
        sampler.join()
    after = tree_rss(proc)
    return before[0], max(peak[0], after[0]), before[1], max(peak[1], after[1]), answer


def run(tree: Path, frames: int, side: int, threads: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        media = Path(tmp) / "media"
        media.mkdir(mode=0o700)
        video = write_static_mp4(media / "static.mp4", frames, side)
        liar = oversized_frame_avi(media / "oversized_frame.avi")
        fake = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text="<score>75</score>")).start()
        primo = FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL, default_text="<answer>60</answer>")).start()
        port = free_ports(1)[0]
        config = Path(tmp) / "proxy.yaml"
        config.write_text(yaml.safe_dump(libero_settings_dict([fake.base_url], [primo.base_url], media,
                                                              health_interval_s=30, max_batch_items=64,
                                                              video_decoders={"isolated": not threads})))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        with (Path(tmp) / "proxy.log").open("wb") as log:
            proxy = subprocess.Popen([sys.executable, "-m", "vlm_reward_cli", "serve", "--config", str(config),
                                      "--port", str(port)], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300, trust_env=False) as http:
                    for _ in range(200):
                        try:
                            if http.get("/health").status_code in (200, 503):
                                break
                        except httpx.TransportError:
                            time.sleep(0.1)
                    bodies = {"/score nframes 128": ("/score", {"nframes": 128}, video),
                              "/score/dense 8 points x 16": ("/score/dense", {"points": 8}, video),
                              "/score oversized-frame AVI": ("/score", {}, liar)}
                    for label, (path, extra, file) in bodies.items():
                        body = {"task_text": "t", "video_path": str(file), **extra}
                        started = time.perf_counter()
                        before, peak, tree_before, tree_peak, answer = peak_rss(
                            proxy.pid, lambda p=path, b=body: http.post(p, json=b))
                        rows.append({"request": label, "status": answer.status_code,
                                     "code": answer.json().get("error", {}).get("code") if answer.status_code >= 400
                                     else None, "rss_before_mb": round(before / 2**20, 1),
                                     "rss_peak_mb": round(peak / 2**20, 1),
                                     "growth_mb": round((peak - before) / 2**20, 1),
                                     "tree_before_mb": round(tree_before / 2**20, 1),
                                     "tree_peak_mb": round(tree_peak / 2**20, 1),
                                     "seconds": round(time.perf_counter() - started, 2)})
            finally:
                proxy.terminate()
                proxy.wait(30)
                fake.stop()
                primo.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose proxy is measured")
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--side", type=int, default=4096)
    parser.add_argument("--threads", action="store_true", help="decode video on the media threads (as before)")
    parser.add_argument("--out", default="bench/results/media_budget.json")
    args = parser.parse_args()
    rows = run(args.tree.resolve(), args.frames, args.side, args.threads)
    print(f"proxy from {args.tree}; {args.frames} static {args.side}x{args.side} frames; "
          f"video decoded in {'threads' if args.threads else 'decoder processes'}")
    print(f"{'request':<28} {'status':>6} {'code':<22} {'RSS before':>11} {'peak':>8} {'growth':>8} "
          f"{'with decoders':>14} {'peak':>8} {'s':>6}")
    for r in rows:
        print(f"{r['request']:<28} {r['status']:>6} {r['code'] or '':<22} {r['rss_before_mb']:>9.0f}MB "
              f"{r['rss_peak_mb']:>6.0f}MB {r['growth_mb']:>6.0f}MB {r['tree_before_mb']:>12.0f}MB "
              f"{r['tree_peak_mb']:>6.0f}MB {r['seconds']:>6}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tree": str(args.tree), "frames": args.frames, "side": args.side, "rows": rows},
                              indent=2))


if __name__ == "__main__":
    main()
