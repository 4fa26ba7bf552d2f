"""The client runs where RLinf runs: Python 3.10 (its `requires-python`, and this project's). The
proxy needs 3.11; the client (`rlinf_client`) and the protocol it shares (`vlm_protocol`) must not.
Found by review at stop 36: the scheduler used asyncio.TaskGroup, asyncio.timeout and `except*`,
so `import rlinf_client` failed on 3.10 and runs B, C and D could not start there. vermin reads
the code for every syntax and standard-library name newer than the target."""

from __future__ import annotations

import ast
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


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes inside an `if TYPE_CHECKING:` block (never run)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            inside.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return inside


def test_typing_extensions_is_for_type_checkers_only():
    """The client's keyword arguments are typed with typing_extensions' Unpack (typing.Unpack is
    3.11), which the base install does not bring: it may be imported only where nothing runs it."""
    for package in CLIENT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            typing_only = _type_checking_only(tree)
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(name.split(".")[0] == "typing_extensions" for name in names):
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    assert id(node) in typing_only, f"{where} imports typing_extensions at run time"
