"""The shell launcher on a real server, and a real server WITHOUT --trust-request-mm-kwargs.

One server serves both checks (four servers at once would not fit this machine well): it is
started by ``launchers/serve_primo_r1.sh`` (session fixture, in parallel with `up`) with
``VLLM_BIN`` pointing at a wrapper that drops ``--trust-request-mm-kwargs`` and runs the reference
vllm with every other flag the launcher emitted. The launcher's flags are then accepted by the
real server (it reaches /health), and the proxy, pointed at it by a second small config, answers
``upstream_refuses_mm_kwargs`` on the first call, without retrying.
"""

from __future__ import annotations

import re

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.real_vllm.stack import (
    MAX_MODEL_LEN,
    PRIMO,
    PRIMO_MAX_TOKENS,
    PRIMO_MODEL,
    PROMPTS_DIR,
    TASK,
    RealStack,
    episode_source,
    say,
    shipped_backends,
    wait_http_ready,
)

pytestmark = pytest.mark.real_vllm


def test_shell_launcher_server_and_no_trust_refusal(real_stack: RealStack, proxy_factory) -> None:
    server = real_stack.launcher
    assert server is not None
    wait_http_ready(server, timeout_s=400, model=PRIMO_MODEL)
    serving = server.serving_after()
    assert serving is not None, server.log_tail()
    real_stack.timings["shell-launcher server start to serving (in parallel with up)"] = round(serving, 1)
    say(f"shell-launcher server serving {serving:.0f}s after it was started (its own log)")

    log = server.log_path.read_text(errors="replace")
    printed = log.splitlines()[0]  # the launcher prints the exact command before it execs it
    for flag in ("CUDA_VISIBLE_DEVICES=3", "--served-model-name PRIMO-R1-7B", "--trust-request-mm-kwargs",
                 """--media-io-kwargs '{"video": {"num_frames": -1}}'""",
                 """--limit-mm-per-prompt '{"image": 2, "video": 1}'""", f"--max-model-len {MAX_MODEL_LEN}"):
        assert flag in printed, f"{flag!r} not in the launcher's command: {printed}"
    args = next(line for line in log.splitlines() if "non-default args:" in line)
    assert "'media_io_kwargs': {'video': {'num_frames': -1}}" in args, args
    assert "'limit_mm_per_prompt': {'image': 2, 'video': 1}" in args, args
    assert "trust_request_mm_kwargs" not in args, f"the wrapper should have dropped the flag: {args}"

    primo = dict(shipped_backends()[PRIMO])
    primo.update(endpoints=[f"{server.url}/v1"], max_model_len=MAX_MODEL_LEN,
                 sampling={**primo["sampling"], "max_tokens": PRIMO_MAX_TOKENS})
    settings = settings_from_dict({"proxy": {"prompts_dir": str(PROMPTS_DIR), "health_interval_s": 1.0},
                                   "backends": {PRIMO: primo}})
    proxy = proxy_factory(settings)
    body = {"task_text": TASK, "nframes": 8, **episode_source("png", 8, 224, 224, real_stack.media_root)}
    with httpx.Client(base_url=proxy.url, timeout=120, trust_env=False) as http:
        answer = http.post("/score", json=body)
    say(f"proxy -> server without the flag: {answer.status_code} {answer.text[:400]}")
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "upstream_refuses_mm_kwargs", error
    assert error["attempts"] == 1, error
    assert "--trust-request-mm-kwargs" in error["message"], error
    # The server saw exactly one chat request (refused with 400): no retry loop.
    log = server.log_path.read_text(errors="replace")
    calls = re.findall(r'"POST /v1/chat/completions HTTP/1\.1" (\d+)', log)
    assert calls == ["400"], f"chat calls seen by the server: {calls}"

    left = server.stop()  # frees ~3 GB before the other tests; the fixture checks again at the end
    assert not left, f"launcher server still alive after stop: {left}"
