"""See the proxy work end to end without a GPU: one LIBERO-like episode, scored, with its provenance.

    make demo                              # or: .venv/bin/python scripts/demo.py [--fake]

The real thing where it can be. With the reference venv built (`make reference-env`: a CPU build
of vLLM 0.32, outside the repo), the episode is scored by a real `vllm serve` on the CPU serving
the tiny RANDOM Qwen2.5-VL of configs/cpu-tiny.yaml: the stack `make cpu-up` started, when one
answers on that config's proxy port, else one this script starts (`up --detach`, the model built
when missing) and stops afterwards. It prints the answer and its provenance: the checkpoint vLLM
serves, the template, the frames, and usage.prompt_tokens checked against the template's text
tokens (vLLM's own /tokenize) plus the vision tokens the proxy reports. The score itself means
nothing (random weights): the demo shows the path, not a reward.

Without the reference venv, or with --fake: two fake `vllm serve` (Qwen2.5-VL and PRIMO-R1
stand-ins) behind the real proxy on configs/libero.yaml's backends, the request JSON each was sent
(frames elided), and how to get the real one.

The episode is synthetic either way (a bowl carried onto a plate, drawn at LIBERO's 256x256 and
20 fps, upside down as LIBERO's agentview is): real LIBERO renders are scored by the RLinf tier
(`make test-real-rlinf`), which needs its own venv; the demo says whether that venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proxy.config import Settings, load_settings, settings_from_dict  # noqa: E402
from proxy.prompting.templates import PromptStore, apply_seed_overrides  # noqa: E402
from tests.fakes.episodes import write_mp4  # noqa: E402
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread  # noqa: E402
from tests.fakes.proxy_server import ProxyServerThread  # noqa: E402

CPU_CONFIG = REPO / "configs" / "cpu-tiny.yaml"
TINY_MODEL = REPO / "models" / "tiny-qwen2.5-vl"  # where `make cpu-up` builds it (configs/cpu-tiny.yaml)
BACKEND = "qwen2_5_vl_vllm"
TASK = "put the black bowl on the plate"
# scripts/reference_env.sh's defaults: its venv, and the file it writes once the venv is complete.
REFERENCE_VENV = Path.home() / ".cache" / "vlm-reward-proxy" / "reference-venv-vllm0.32.0"
REFERENCE_MARKER = ".vlm-reference-env"
RLINF_VENV = Path.home() / ".cache" / "vlm-reward-proxy" / "rlinf-venv-0.3.0"  # scripts/rlinf_env.sh's
GET_REAL = ("for the real thing (a real `vllm serve` on this CPU, the tiny random Qwen2.5-VL): "
            "`make reference-env` once (~3 min, 2.6 GB under ~/.cache/vlm-reward-proxy), then `make demo` "
            "again; docs/stack.md \"On a CPU\"")

# Replies in the shipped templates' declared formats: prompts/qwen_seed.yaml wants the bare
# number, prompts/primo_r1_trained.yaml reasoning then <answer>.
PRIMO_REPLY = ("<think><planning>1. reach the bowl 2. grasp it 3. place it on the plate</planning>"
               "<observation>the bowl ends on the plate</observation><reasoning>all steps done"
               "</reasoning></think><answer>95</answer>")


def libero_like_episode(count: int = 128, size: int = 256) -> np.ndarray:
    """uint8 T×H×W×3: a table, a plate, and a bowl carried onto it, drawn upside down (LIBERO's
    agentview camera is mounted that way; RLinf's env rotates it back)."""
    import cv2

    frames = np.empty((count, size, size, 3), dtype=np.uint8)
    plate = (int(size * 0.68), int(size * 0.62))
    start = (int(size * 0.25), int(size * 0.55))
    for i in range(count):
        frame = np.full((size, size, 3), (92, 120, 150), dtype=np.uint8)  # back wall
        frame[int(size * 0.4):] = (150, 110, 70)  # table top
        cv2.circle(frame, plate, size // 9, (235, 235, 230), -1)
        t = min(1.0, i / (0.8 * (count - 1)))  # placed at 80%, still after
        lift = int(size * 0.12 * np.sin(np.pi * t))
        bowl = (int(start[0] + t * (plate[0] - start[0])), int(start[1] + t * (plate[1] - start[1])) - lift)
        cv2.ellipse(frame, bowl, (size // 14, size // 20), 0, 0, 360, (25, 25, 25), -1)
        frames[i] = frame[::-1, ::-1]
    return frames


def _elide(body: dict) -> str:
    text = json.dumps(body, indent=1)
    return re.sub(r"data:(video|image)/jpeg;base64,[A-Za-z0-9+/=,]+",
                  lambda m: f"data:{m.group(1)}/jpeg;base64,<{m.group(0).count(',')} JPEG frame(s)>", text)


def _print_answer(backend: str, status: int, result: dict) -> None:
    result = dict(result)
    if isinstance(result.get("frames"), dict) and "sha256" in result["frames"]:
        result["frames"] = {**result["frames"], "sha256": f"<{len(result['frames']['sha256'])} hashes>"}
    print(f"=== POST /score backend={backend} -> {status}")
    for key, value in result.items():
        print(f"  {key}: {json.dumps(value)}")


def _rlinf_note() -> str:
    venv = Path(os.environ.get("VLM_RLINF_VENV", RLINF_VENV))
    if (venv / "bin" / "python").exists():
        return (f"episode: synthetic, LIBERO-like (the RLinf venv exists at {venv}; real LIBERO renders "
                "are scored by `make test-real-rlinf`, not by this demo)")
    return ("episode: synthetic, LIBERO-like (no RLinf venv: `make rlinf-env` builds one, and `make "
            "test-real-rlinf` scores real LIBERO renders)")


# -- the fakes -----------------------------------------------------------------------------------
def run_fakes(why: str) -> int:
    print(f"fake vLLM servers: {why}\n{GET_REAL}\n")
    config = yaml.safe_load((REPO / "configs" / "libero.yaml").read_text())
    with tempfile.TemporaryDirectory(dir="/tmp") as media, \
            FakeVLLMThread(FakeConfig(served_model_name="Qwen2.5-VL-7B-Instruct",
                                      default_text="90")) as qwen, \
            FakeVLLMThread(FakeConfig(served_model_name="PRIMO-R1-7B", default_text=PRIMO_REPLY)) as primo:
        config["backends"]["qwen2_5_vl_vllm"]["endpoints"] = [qwen.base_url]
        config["backends"]["PRIMO-R1"]["endpoints"] = [primo.base_url]
        config["proxy"].update(prompts_dir=str(REPO / "prompts"), allowed_media_roots=[media])
        episode = write_mp4(Path(media) / "episode.mp4", libero_like_episode(), fps=20)
        print(_rlinf_note())
        with ProxyServerThread(settings_from_dict(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
            print(f"proxy on {proxy.url}; fake vLLM on {qwen.base_url} and {primo.base_url}\n")
            for backend, fake in (("qwen2_5_vl_vllm", qwen), ("PRIMO-R1", primo)):
                response = http.post("/score", json={"task_text": TASK, "video_path": str(episode),
                                                     "backend": backend})
                if response.status_code != 200:
                    print(f"{backend}: HTTP {response.status_code} {response.json()}")
                    return 1
                _print_answer(backend, response.status_code, response.json())
                print(f"--- what the proxy sent to vllm serve:\n{_elide(fake.chat_requests[-1])}\n")
    print(f"those were fakes: {GET_REAL}")
    return 0


# -- the real thing ------------------------------------------------------------------------------
def reference_vllm() -> Path | None:
    """The reference venv's `vllm`, when that venv is complete (VLM_REFERENCE_VLLM first, as make
    test sets it); never builds it."""
    given = os.environ.get("VLM_REFERENCE_VLLM", "").strip()
    if given:
        return Path(given) if Path(given).is_file() else None
    venv = Path(os.environ.get("VLM_REFERENCE_VENV", REFERENCE_VENV))
    vllm = venv / "bin" / "vllm"
    return vllm if (venv / REFERENCE_MARKER).is_file() and vllm.is_file() else None


def _proxy_url(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.proxy.port}"


def _running_tiny_proxy(settings: Settings) -> bool | None:
    """True: configs/cpu-tiny.yaml's stack answers; False: nothing on its port; None: something
    else does (another proxy on the same port)."""
    try:
        health = httpx.get(_proxy_url(settings) + "/health", timeout=3, trust_env=False)
    except httpx.HTTPError:
        return False
    try:
        model = health.json()["backends"][BACKEND]["model"]
    except (ValueError, KeyError, TypeError):
        return None
    return True if model == settings.backends[BACKEND].model and health.status_code == 200 else None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vlm_reward_cli", *args]


def _start_stack(vllm: Path, pid_file: Path) -> float:
    if not (TINY_MODEL / "config.json").exists():
        print(f"building the tiny random Qwen2.5-VL into {TINY_MODEL} (once, ~10 s) ...", flush=True)
        subprocess.run([str(vllm.parent / "python"), str(REPO / "scripts" / "make_tiny_qwen25vl.py"),
                        str(TINY_MODEL)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    print(f"starting the stack of {CPU_CONFIG.relative_to(REPO)} (`up --detach`, ~30-45 s on 2 cores) ...",
          flush=True)
    begin = time.monotonic()
    up = subprocess.run(_cli("up", "--config", str(CPU_CONFIG), "--vllm", str(vllm), "--detach",
                             "--runs-dir", str(REPO / "runs"), "--pid-file", str(pid_file),
                             "--timeout", "600", "--progress-interval", "15"),
                        cwd=REPO, text=True, capture_output=True, check=False)
    if up.returncode != 0:
        print(up.stdout + up.stderr)
        raise SystemExit(f"`up` failed (exit {up.returncode}); the logs are under {REPO / 'runs'}")
    return time.monotonic() - begin


def text_only_messages(settings: Settings) -> list[dict[str, Any]]:
    """The messages the proxy sends for BACKEND's template, without the video part."""
    prompt = settings.backends[BACKEND].prompt
    system, user = PromptStore(settings.proxy.prompts_dir).get(prompt).render({"task_text": TASK})
    system, user = apply_seed_overrides(system, user, TASK, {})
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": [{"type": "text", "text": user}]}]


def score_real(settings: Settings) -> int:
    media_root = settings.proxy.allowed_media_roots[0]
    episode = write_mp4(media_root / "demo-episode.mp4", libero_like_episode(), fps=20)
    print(_rlinf_note())
    begin = time.monotonic()
    with httpx.Client(base_url=_proxy_url(settings), timeout=300, trust_env=False) as http:
        response = http.post("/score", json={"task_text": TASK, "video_path": str(episode), "backend": BACKEND,
                                             "metadata": {"run": "demo"}})
    took = time.monotonic() - begin
    result = response.json()
    _print_answer(BACKEND, response.status_code, result)
    if response.status_code != 200:
        return 1
    server = result["endpoint"].removesuffix("/v1")
    with httpx.Client(base_url=server, timeout=60, trust_env=False) as http:
        served = http.get("/v1/models").json()["data"][0]
        tokenized = http.post("/tokenize", json={"model": result["model"],
                                                 "messages": text_only_messages(settings)}).json()
    text, vision = tokenized["count"], result["frames"]["vision_tokens"]
    prompt_tokens = result["usage"]["prompt_tokens"]
    checkpoint = Path(served["root"])
    config = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").exists() else {}
    params = config.get("text_config", config)
    print(f"\n--- provenance (answered in {took:.2f}s)")
    print(f"  served by: a real `vllm serve` at {server} (vLLM's /v1/models: id {served['id']}, "
          f"root {served['root']})")
    print(f"  checkpoint: {checkpoint} ({params.get('num_hidden_layers', '?')} layers, hidden "
          f"{params.get('hidden_size', '?')}: the tiny RANDOM model of scripts/make_tiny_qwen25vl.py)")
    print(f"  template: {result['prompt']['name']} (sha256 {result['prompt']['sha256'][:12]}), "
          f"layout {settings.backends[BACKEND].layout}")
    print(f"  frames: {result['frames']['count']} of {result['frames']['source_count']}, "
          f"{'x'.join(map(str, result['frames']['size']))}, {vision} vision tokens (the proxy's count)")
    verdict = "equal" if prompt_tokens == text + vision else "DIFFERENT"
    print(f"  usage.prompt_tokens {prompt_tokens} (vLLM's count) vs {text} text tokens (vLLM's /tokenize of "
          f"the template) + {vision} vision tokens = {text + vision}: {verdict}")
    print(f"  score {result['score']}: random weights, so it means nothing; the path is what is real")
    if settings.proxy.audit_log:
        print(f"  audit line (metadata.run \"demo\"): {settings.proxy.audit_log}")
    return 0 if verdict == "equal" else 1


def run_real(vllm: Path) -> int:
    settings = load_settings(CPU_CONFIG)
    running = _running_tiny_proxy(settings)
    if running is None:
        print(f"port {settings.proxy.port} answers, but not as {CPU_CONFIG.relative_to(REPO)}'s proxy: "
              "stop that proxy (or `make demo` from the checkout that started it)")
        return 1
    print(f"real vLLM on the CPU: {vllm}")
    if running:
        print(f"using the stack already running at {_proxy_url(settings)} (`make cpu-up`)")
        return score_real(settings)
    pid_file = REPO / "runs" / "demo-stack.json"
    ready_s = _start_stack(vllm, pid_file)
    print(f"stack ready in {ready_s:.0f}s at {_proxy_url(settings)}\n")
    try:
        return score_real(settings)
    finally:
        subprocess.run(_cli("down", "--pid-file", str(pid_file)), cwd=REPO, check=False,
                       stdout=subprocess.DEVNULL)
        print("stack stopped (`down`). `make cpu-up` keeps one running for your own requests.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--fake", action="store_true", help="fake vLLM servers even when the reference venv exists")
    args = parser.parse_args(argv)
    if args.fake:
        return run_fakes("asked for (--fake)")
    vllm = reference_vllm()
    if vllm is None:
        return run_fakes("the reference venv (a CPU build of vLLM) is not built")
    return run_real(vllm)


if __name__ == "__main__":
    sys.exit(main())
