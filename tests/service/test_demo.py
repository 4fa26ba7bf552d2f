"""`make demo` (scripts/demo.py) scores an episode with both shipped backends end to end."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_the_demo_scores_with_both_shipped_backends():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py")], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "POST /score backend=qwen2_5_vl_vllm -> 200" in done.stdout
    assert "POST /score backend=PRIMO-R1 -> 200" in done.stdout
    assert '  score: 0.9' in done.stdout and '  score: 0.95' in done.stdout
