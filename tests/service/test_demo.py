"""`make demo` (scripts/demo.py) without the reference venv: fakes score an episode with both shipped
backends end to end, and the demo says how to get the real thing. With the reference venv it starts
a real `vllm serve`: tests/real_vllm/test_cpu_path.py runs that, serialized with the real-vLLM tier."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO


def test_without_the_reference_venv_the_demo_scores_on_fakes_and_says_how_to_get_the_real_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "VLM_REFERENCE_VLLM"}
    env["VLM_REFERENCE_VENV"] = str(tmp_path / "no-reference-venv")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py")], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("fake vLLM servers: the reference venv (a CPU build of vLLM) is not built")
    assert "`make reference-env` once" in done.stdout and 'docs/stack.md "On a CPU"' in done.stdout
    assert "episode: synthetic, LIBERO-like" in done.stdout
    assert "POST /score backend=qwen2_5_vl_vllm -> 200" in done.stdout
    assert "POST /score backend=PRIMO-R1 -> 200" in done.stdout
    assert '  score: 0.9' in done.stdout and '  score: 0.95' in done.stdout
