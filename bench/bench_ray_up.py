"""`up --ray` timings on a local Ray cluster (a head and a worker node on this machine, each
declaring 2 GPUs), with the stand-in `vllm` (tests/fakes/bin/vllm) as the server, so what is
measured is placement, actor start, readiness probing and the proxy, not model loading:

  up_to_ready_s      `up --ray` started -> "stack is up" (3 replicas placed, serving, proxy ready)
  up_to_score_s      `up --ray` started -> the first 200 from POST /score
  restart_s          a replica's server SIGKILLed -> "ready again" (noticed, removed, restarted, re-added)
  stop_s             SIGTERM to `up` -> `up` exited, servers stopped, actors and groups released

    python bench/bench_ray_up.py [--runs 3] [--out bench/results/ray_up.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import ROOT, env_info, free_port, write_json  # noqa: E402

KEYS = {"QWEN_KEY": "q", "PRIMO_KEY": "p", "PROXY_KEY": "x", "PROXY_ADMIN_KEY": "a"}


def config(tmp: Path) -> tuple[dict, int]:
    node_env = {"PATH": os.pathsep.join([str(ROOT / "tests/fakes/bin"), str(Path(sys.executable).parent),
                                         "/usr/bin", "/bin"]), "FAKE_VLLM_LIFETIME_S": "300"}

    def backend(model: str, layout: str, prompt: str, key: str, tp: int, ports: list[int]) -> dict:
        return {"model": model, "layout": layout, "prompt": prompt, "api_key_env": key,
                "endpoints": ["http://127.0.0.1:1/v1"],
                "launch": {"model_path": "/models/x", "tensor_parallel_size": tp, "env": node_env,
                           "replicas": [{"gpus": list(range(tp)), "port": p} for p in ports]}}

    proxy_port = free_port()
    return {"proxy": {"host": "127.0.0.1", "port": proxy_port, "api_key_env": "PROXY_KEY",
                      "admin_api_key_env": "PROXY_ADMIN_KEY",
                      "prompts_dir": str(ROOT / "prompts"), "allowed_media_roots": [str(tmp)]},
            "backends": {"qwen2_5_vl_vllm": backend("Qwen2.5-VL-7B-Instruct", "qwen_video", "qwen_progress",
                                                    "QWEN_KEY", 1, [free_port(), free_port()]),
                         "PRIMO-R1": backend("PRIMO-R1-7B", "primo_interleave", "primo_r1", "PRIMO_KEY", 2,
                                             [free_port()])}}, proxy_port


def wait_for(out: Path, text: str, after: int = 0, timeout_s: float = 180) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in out.read_text(errors="replace")[after:]:
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError(f"no {text!r} within {timeout_s}s:\n{out.read_text()[-3000:]}")


def one_run(address: str, tmp: Path) -> dict:
    import httpx
    import yaml

    from tests.fakes.episodes import episode_frames, npy_b64

    data, proxy_port = config(tmp)
    config_path = tmp / "stack.yaml"
    config_path.write_text(yaml.safe_dump(data))
    out = tmp / "up.out"
    with open(out, "wb") as sink:
        begin = time.monotonic()
        up = subprocess.Popen([sys.executable, "-m", "vlm_reward_cli", "up", "--config", str(config_path),
                               "--ray", address, "--runs-dir", str(tmp / "runs"), "--poll-interval", "0.2",
                               "--grace", "5"], stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, **KEYS}, start_new_session=True)
        try:
            ready = wait_for(out, "stack is up")
            episode = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 64, 64)), "fps": 4.0}
            with httpx.Client(base_url=f"http://127.0.0.1:{proxy_port}", trust_env=False, timeout=30,
                              headers={"authorization": "Bearer x"}) as http:
                while http.post("/score", json=episode).status_code != 200:
                    time.sleep(0.02)
                scored = time.monotonic()
                placed = next((tmp / "runs").glob("*/placement.json")).read_text()
            victim = yaml.safe_load(placed)[0]
            mark = len(out.read_text(errors="replace"))
            killed = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            back = wait_for(out, f"ready again: {victim['name']}", after=mark)
            stopping = time.monotonic()
            up.send_signal(signal.SIGTERM)
            up.wait(120)
            stopped = time.monotonic()
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(30)
    return {"up_to_ready_s": ready - begin, "up_to_score_s": scored - begin, "restart_s": back - killed,
            "stop_s": stopped - stopping, "exit_code": up.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results/ray_up.json")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 4, "num_gpus": 2, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    cluster.add_node(**small)
    cluster.wait_for_nodes()
    runs = []
    try:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="bench-ray-up-") as tmp:
                runs.append(one_run(cluster.address, Path(tmp)))
            print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
    finally:
        cluster.shutdown()
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("_s")}
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    print(f"wrote {write_json(args.out, {'bench': 'ray_up', **env_info(), 'runs': runs, 'median': medians})}")


if __name__ == "__main__":
    main()
