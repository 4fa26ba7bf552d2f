"""The client runs where RLinf runs: Python 3.10 (its `requires-python`, and this project's). The
proxy needs 3.11; the client (`rlinf_client`) and the protocol it shares (`vlm_protocol`) must not.
Found by review at stop 36: the scheduler used asyncio.TaskGroup, asyncio.timeout and `except*`,
so `import rlinf_client` failed on 3.10 and runs B, C and D could not start there. vermin reads
the code for every syntax and standard-library name newer than the target."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers import REPO

CLIENT_PACKAGES = ("rlinf_client", "vlm_protocol")


def test_the_client_needs_no_python_newer_than_its_floor():
    floor = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor == ">=3.10"
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent))
    assert vermin, "vermin is in the test extra (pyproject.toml): reinstall with `make install`"
    done = subprocess.run([vermin, "--no-tips", "--violations", "-t=3.10-", *CLIENT_PACKAGES],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
