"""The cost of run D per episode: SRPO's progress math (proxy/progress/math.py) and, with --real,
one embedding call on the real tiny pooling server, through the proxy and straight to vLLM.

A GRPO step of LIBERO-10 ends, say, 64-512 episodes over 10 tasks. Per task the proxy standardises
and clusters the successes (pairwise distances: O(successes^2 x dim)) and measures each failure
to the centres. This times `srpo_progress` for one task at several sizes and embedding widths
(3584: Qwen2.5-VL-7B's hidden size; 1408: V-JEPA 2 ViT-g), with the successes in a few tight
clusters as a trained policy's would be. Prints a table and writes JSON. Compare rows of one run
with each other (and with the embedding call's time the real-vLLM tier prints), not with other runs.

With --real (VLM_REFERENCE_VLLM set): `vlm-reward-proxy up --detach` starts the tiny random
Qwen2.5-VL as a pooling server (kind: embedding) and its proxy; each case (frames per episode) sends
one episode at a time through POST /progress/batch, and a /v1/embeddings body the proxy built
(captured with a fake) straight to the server, interleaved, new pixels on each side (vLLM caches
processed media by content); medians of wall ms and the prompt tokens vLLM counted.

    python bench/bench_progress.py [--runs 20] [--real] [--out bench/results/progress.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import ROOT, env_info, free_port, write_json  # noqa: E402
from proxy.config import settings_from_dict  # noqa: E402
from proxy.progress.math import srpo_progress  # noqa: E402
from tests.fakes.episodes import episode_frames, npy_b64  # noqa: E402
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread  # noqa: E402
from tests.fakes.proxy_server import ProxyServerThread  # noqa: E402

EMBED_MODEL = "tiny-embed"
SERVER_ARGS = ["--enforce-eager", "--max-num-batched-tokens", "16384", "--dtype", "float32",
               "--kv-cache-memory-bytes", "128M"]  # 131k tokens of the tiny model (tests/real_vllm/stack.py)


def _case(successes: int, failures: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (3, dim))
    refs = centres[rng.integers(0, 3, successes)] + rng.normal(0, 0.01, (successes, dim))
    return refs, rng.normal(0, 1, (failures, dim))


def _backend(endpoint: str, frames: int) -> dict:
    return {"model": EMBED_MODEL, "kind": "embedding", "endpoints": [endpoint], "frames": {"nframes": frames}}


def _item(frames: int, variant: int) -> dict:
    # The frames the RLinf client sends by default: already sampled (client_sampling), 224x224.
    pixels = np.roll(episode_frames(frames, 224, 224), variant, axis=2)
    return {"task_text": "put the bowl on the plate", "frames_npy": npy_b64(pixels), "fps": 20,
            "metadata": {"task_id": 0, "env_success": True}}


def _captured_body(item: dict, frames: int) -> bytes:
    """The /v1/embeddings body the proxy sends for `item` (a fake records it)."""
    with FakeVLLMThread(FakeConfig(served_model_name=EMBED_MODEL)) as fake:
        settings = settings_from_dict({"proxy": {"prompts_dir": str(ROOT / "prompts")},
                                       "backends": {"embed": _backend(fake.base_url, frames)}})
        with ProxyServerThread(settings) as proxy, httpx.Client(timeout=60, trust_env=False) as http:
            http.post(f"{proxy.url}/progress/batch", json={"items": [item], "remember_successes": False}
                      ).raise_for_status()
        return json.dumps(fake.embedding_requests[0]).encode()


def real(args) -> dict:
    vllm = os.environ.get("VLM_REFERENCE_VLLM", "").strip()
    if not vllm:
        sys.exit("--real needs VLM_REFERENCE_VLLM (scripts/reference_env.sh | tail -n1)")
    work = Path(tempfile.mkdtemp(prefix="bench-progress-"))
    model_dir = work / "tiny"
    subprocess.run([str(Path(vllm).with_name("python")), str(ROOT / "scripts/make_tiny_qwen25vl.py"), str(model_dir)],
                   check=True, capture_output=True, timeout=600)
    ports = {"proxy": free_port(), "server": free_port()}
    server = f"http://127.0.0.1:{ports['server']}/v1"
    backend = {**_backend(server, 16), "launch": {
        "model_path": str(model_dir), "max_model_len": 8192, "extra_args": SERVER_ARGS,
        "replicas": [{"gpus": [0], "port": ports["server"]}]}}
    config = {"proxy": {"port": ports["proxy"], "prompts_dir": str(ROOT / "prompts")}, "backends": {"embed": backend}}
    (work / "stack.yaml").write_text(yaml.safe_dump(config))
    cli, pid_file = str(Path(sys.executable).with_name("vlm-reward-proxy")), work / "stack.json"
    subprocess.run([cli, "up", "--config", str(work / "stack.yaml"), "--vllm", vllm, "--detach", "--runs-dir",
                    str(work / "runs"), "--pid-file", str(pid_file), "--timeout", "600"], check=True, timeout=720)
    cases = []
    try:
        with httpx.Client(timeout=600, trust_env=False) as http:
            for frames in (8, 16):
                proxied, direct, tokens, stages = [], [], None, []
                for run in range(args.real_runs + 1):  # the first of each is a warm-up
                    # New pixels on each side: vLLM caches processed media by content, so a body sent
                    # again right after the proxy's would be answered from that cache.
                    item, body = _item(frames, 2 * run), _captured_body(_item(frames, 2 * run + 1), frames)
                    begin = time.perf_counter()
                    answer = http.post(f"http://127.0.0.1:{ports['proxy']}/progress/batch",
                                       json={"items": [{**item, "nframes": frames}], "remember_successes": False})
                    through = time.perf_counter() - begin
                    answer.raise_for_status()
                    timings = answer.json()["results"][0]["result"]["embedding"]["timings_ms"]
                    begin = time.perf_counter()
                    straight = http.post(f"{server}/embeddings", content=body,
                                         headers={"content-type": "application/json"})
                    alone = time.perf_counter() - begin
                    straight.raise_for_status()
                    tokens = straight.json()["usage"]["prompt_tokens"]
                    if run:
                        proxied.append(through * 1e3)
                        direct.append(alone * 1e3)
                        stages.append(timings)
                cases.append({"frames": frames, "size": "336x336 (224x224 sources, the video floor)",
                              "prompt_tokens": tokens, "proxy_ms_median": round(statistics.median(proxied), 1),
                              "direct_ms_median": round(statistics.median(direct), 1),
                              "ratio": round(statistics.median(proxied) / statistics.median(direct), 3),
                              # what the proxy says it spent: decode + sample (load), resize + JPEG
                              # (encode), the /v1/embeddings call (upstream), its whole handling (total)
                              "proxy_stages_ms_median": {k: round(statistics.median(t[k] for t in stages), 1)
                                                         for k in ("load", "encode", "upstream", "total")}})
                print(f"real: {frames} frames, {tokens} prompt tokens: through the proxy "
                      f"{cases[-1]['proxy_ms_median']} ms, straight {cases[-1]['direct_ms_median']} ms "
                      f"(ratio {cases[-1]['ratio']}); proxy stages {cases[-1]['proxy_stages_ms_median']}", flush=True)
    finally:
        subprocess.run([cli, "down", "--pid-file", str(pid_file)], timeout=120, check=False)
        shutil.rmtree(work, ignore_errors=True)
    return {"runs": args.real_runs, "cases": cases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--real", action="store_true", help="also time embedding calls on the real tiny server")
    parser.add_argument("--real-runs", type=int, default=8)
    parser.add_argument("--out", default="bench/results/progress.json")
    args = parser.parse_args(argv)
    rows = []
    for dim in (1408, 3584):
        for successes, failures in ((4, 4), (32, 32), (128, 128), (256, 256)):
            refs, fails = _case(successes, failures, dim)
            srpo_progress(refs, fails)  # warm-up
            cpu = []
            for _ in range(args.runs):
                begin = time.process_time()
                result = srpo_progress(refs, fails)
                cpu.append((time.process_time() - begin) * 1e3)
            rows.append({"dim": dim, "successes": successes, "failures": failures, "centres": result.centres,
                         "cpu_ms_median": round(statistics.median(cpu), 3),
                         "cpu_us_per_episode": round(statistics.median(cpu) * 1e3 / (successes + failures), 1)})
            print(f"dim {dim:5d}  successes {successes:4d}  failures {failures:4d}  centres {result.centres}  "
                  f"cpu {rows[-1]['cpu_ms_median']:8.2f} ms  ({rows[-1]['cpu_us_per_episode']:.1f} us/episode)")
    result = {"bench": "progress", "runs": args.runs, "math": rows, "env": env_info()}
    if args.real:
        result["embedding_call"] = real(args)
    print("wrote", write_json(args.out, result))


if __name__ == "__main__":
    main()
