"""The no-GPU path of docs/stack.md "On a CPU", followed as the page writes it: its commands (`make
cpu-up`, then `make demo` beside it) run in a fresh copy of this checkout in a temporary directory,
where the tiny model does not exist yet, reusing the cached venvs (the reference venv of this tier,
the project venv running the tests). Then the answer's provenance is checked so that no fake can
pass: the server that answered serves the checkpoint `make cpu-up` just generated (vLLM's own
/v1/models), and `usage.prompt_tokens` equals the template's text tokens (the server's /tokenize)
plus the vision tokens the proxy reports (and Qwen2.5-VL's formula gives the same vision count).

Two departures from the page, both forced by running inside a test: the copy's configs/cpu-tiny.yaml
gets free ports (the machine is shared; a user's own `make cpu-up` may hold 18080), and `make` is
told not to remake `.venv/.installed` (`-o`): the copy's `.venv` is a link to the venv running the
tests, which must not be reinstalled from the copy. Ctrl-C is a SIGINT to make's process group, as
a terminal sends it; then nothing of the stack may be left running.

One `vllm serve` (~1.6 GB) and the proxy, on top of the tier's own stack; marked real_vllm, so it
runs in the tier's one xdist worker (tests/conftest.py), never beside it on another worker.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_ports
from tests.real_vllm.stack import (
    QWEN,
    REPO,
    TASK,
    child_env,
    episode_source,
    leftovers,
    reference_executables,
    say,
    shipped_backends,
    stop_group,
    text_only_messages,
    vision_tokens_of,
)

pytestmark = pytest.mark.real_vllm

DOC = REPO / "docs" / "stack.md"
SECTION = "## On a CPU"
TINY = "tiny-random-Qwen2.5-VL"  # configs/cpu-tiny.yaml's served name
READY_S = 600  # a cold reference venv check, the model build and a loaded machine's start


def documented_commands() -> list[str]:
    """The commands of the section's first bash block, comments dropped."""
    section = DOC.read_text().split(SECTION, 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def fresh_checkout(dest: Path, ports: dict[str, int]) -> Path:
    """This checkout's files as git sees them (tracked, and untracked but not ignored: no .venv,
    runs/ or models/), its `.venv` a link to the venv running the tests, free ports in the config."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    config = dest / "configs" / "cpu-tiny.yaml"
    text = config.read_text()
    assert text.count("port: 18080") == 1 and text.count(":8001/v1") == 1 and text.count("port: 8001}") == 1
    config.write_text(text.replace("port: 18080", f"port: {ports['proxy']}")
                      .replace(":8001/v1", f":{ports['vllm']}/v1").replace("port: 8001}", f"port: {ports['vllm']}}}"))
    return dest


def make_argv(command: str) -> list[str]:
    words = command.split()
    assert words[0] == "make", command
    return ["make", "-o", ".venv/.installed", *words[1:]]


@dataclass
class CpuPath:
    checkout: Path
    ports: dict[str, int]
    up_output: list[str]
    demo_output: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['vllm']}"


def _reader(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))


@pytest.fixture(scope="module")
def cpu_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuPath]:
    _python, vllm = reference_executables()
    commands = documented_commands()
    assert commands == ["make cpu-up", "make demo"], f"{DOC}'s {SECTION!r} block changed: {commands}"
    ports = dict(zip(("proxy", "vllm"), free_ports(2), strict=True))
    checkout = fresh_checkout(tmp_path_factory.mktemp("cpu-path"), ports)
    model_dir = checkout / "models" / "tiny-qwen2.5-vl"
    assert not model_dir.exists()
    env = child_env({"VLM_REFERENCE_VENV": str(Path(vllm).parent.parent), "VLM_REFERENCE_VLLM": vllm})
    output: list[str] = []
    say(f"{commands[0]} in {checkout}")
    begin = time.monotonic()
    make = subprocess.Popen(make_argv(commands[0]), cwd=checkout, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader = threading.Thread(target=_reader, args=(make.stdout, output), daemon=True)
    reader.start()
    path = CpuPath(checkout=checkout, ports=ports, up_output=output)
    pid_file = checkout / "runs" / "stack.json"
    up_pid = None
    try:
        deadline = time.monotonic() + READY_S
        while not any(line.startswith("stack is up:") for line in output):
            if make.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`{commands[0]}` not up (exit {make.poll()}) after {time.monotonic() - begin:.0f}s:\n"
                            + "\n".join(output[-60:]), pytrace=False)
            time.sleep(0.5)
        path.timings["make cpu-up to ready"] = round(time.monotonic() - begin, 1)
        built = next((m.group(1) for line in output if (m := re.search(r"time: ([\d.]+)s to build", line))), None)
        if built:
            path.timings["tiny model build"] = float(built)
        up_pid = json.loads(pid_file.read_text())["up_pid"]
        say(f"{commands[0]}: ready in {path.timings['make cpu-up to ready']:.1f}s (model built in {built}s)")
        yield path
    finally:
        begin = time.monotonic()
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in terminal 1
        try:
            make.wait(120)
        except subprocess.TimeoutExpired:
            stop_group(make.pid)
        deadline = time.monotonic() + 120
        while up_pid is not None and _alive(up_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        reader.join(10)
        make.stdout.close()
        path.timings["Ctrl-C to stopped"] = round(time.monotonic() - begin, 1)
        say(f"cpu path timings: {path.timings}")
        left = leftovers([make.pid], [str(model_dir), str(checkout / "configs")], ports.values())
        if left and pid_file.exists():
            subprocess.run([sys.executable, "-m", "vlm_reward_cli", "down", "--pid-file", str(pid_file)],
                           cwd=checkout, env=env, capture_output=True, timeout=120, check=False)
        assert not left, "after Ctrl-C of `make cpu-up`, still running:\n" + "\n".join(left) + "\n" + \
            "\n".join(output[-30:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_make_demo_beside_make_cpu_up_scores_on_the_real_server(cpu_path: CpuPath) -> None:
    command = documented_commands()[1]
    begin = time.monotonic()
    demo = subprocess.run(make_argv(command), cwd=cpu_path.checkout, capture_output=True, text=True, timeout=300,
                          env=child_env({"VLM_REFERENCE_VLLM": reference_executables()[1]}), check=False)
    cpu_path.timings["make demo"] = round(time.monotonic() - begin, 1)
    out = demo.stdout
    assert demo.returncode == 0, out[-3000:] + demo.stderr[-3000:]
    assert f"using the stack already running at {cpu_path.proxy_url}" in out, out
    assert "fake" not in out.lower(), out
    assert "episode: synthetic, LIBERO-like" in out
    assert f'model: "{TINY}"' in out and "POST /score backend=qwen2_5_vl_vllm -> 200" in out
    assert f"root {cpu_path.checkout / 'models' / 'tiny-qwen2.5-vl'}" in out
    assert re.search(r"usage\.prompt_tokens (\d+) .* = \1: equal", out), out
    say(f"{command}: {cpu_path.timings['make demo']:.1f}s; " + next(
        line.strip() for line in out.splitlines() if "usage.prompt_tokens" in line))


def test_the_answer_comes_from_the_generated_checkpoint_and_its_tokens_add_up(cpu_path: CpuPath) -> None:
    media_root = cpu_path.checkout / "runs" / "media"
    body = {"task_text": TASK, "backend": QWEN, "metadata": {"run": "cpu-path-proof"},
            **episode_source("mp4", 40, 256, 256, media_root)}
    begin = time.monotonic()
    with httpx.Client(timeout=300, trust_env=False) as http:
        answer = http.post(cpu_path.proxy_url + "/score", json=body)
        cpu_path.timings["/score"] = round(time.monotonic() - begin, 2)
        assert answer.status_code == 200, answer.text
        result = answer.json()
        served = http.get(cpu_path.vllm_url + "/v1/models").json()["data"]
        assert shipped_backends()[QWEN]["prompt"] == "qwen_seed" == result["prompt"]["name"]
        tokenized = http.post(cpu_path.vllm_url + "/tokenize",
                              json={"model": TINY, "messages": text_only_messages(QWEN)})
    assert tokenized.status_code == 200, tokenized.text

    model_dir = cpu_path.checkout / "models" / "tiny-qwen2.5-vl"
    assert [(m["id"], m["root"]) for m in served] == [(TINY, str(model_dir))]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert result["model"] == TINY and result["endpoint"] == cpu_path.vllm_url + "/v1"

    frames, usage, text = result["frames"], result["usage"], tokenized.json()["count"]
    assert frames["vision_tokens"] == vision_tokens_of("qwen_video", frames), frames
    assert usage["prompt_tokens"] == text + frames["vision_tokens"], (usage, text, frames["vision_tokens"])
    say(f"/score in {cpu_path.timings['/score']:.2f}s: prompt_tokens {usage['prompt_tokens']} = text {text} "
        f"+ vision {frames['vision_tokens']} ({frames['count']} frames {frames['size']}), from {served[0]['root']}")
