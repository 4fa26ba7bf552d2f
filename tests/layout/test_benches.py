"""Every benchmark script still starts: its imports and argument parser (a bench that broke when
the code it measures changed would otherwise be found only when someone needs its numbers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPTS = sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_bench_starts(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout
