"""The tree reads as the system: packages depend one way, the client stays light, modules stay small.

    vlm_protocol   ← proxy ← launchers ┐
        ↑   ↖ rlinf_client              ├ vlm_reward_cli (the command line, on top of all)
        └──── reports ─────────────────┘
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {
    "vlm_protocol": set(),
    "proxy": {"vlm_protocol"},
    "rlinf_client": {"vlm_protocol"},
    "reports": {"vlm_protocol"},
    "launchers": {"proxy", "vlm_protocol"},
    "vlm_reward_cli": {"proxy", "launchers", "reports", "vlm_protocol"},
}
# What the client's base install brings (pyproject's dependencies), beside the standard library.
CLIENT_THIRD_PARTY = {"httpx", "numpy", "yaml"}
# Imported lazily by the client, for one optional feature each, with a clear error when missing.
CLIENT_OPTIONAL = {"cv2"}  # transport: path writes an MP4
MAX_LINES = 300


def _imports(path: Path) -> set[str]:
    """Top-level names of every module imported anywhere in the file (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_depend_one_way(package):
    ours = set(ALLOWED)
    for path in _files(package):
        used = (_imports(path) & ours) - {package}
        assert used <= ALLOWED[package], f"{path.relative_to(REPO)} imports {sorted(used - ALLOWED[package])}"


@pytest.mark.parametrize("package", ["rlinf_client", "vlm_protocol"])
def test_the_client_needs_only_its_base_install(package):
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in _files(package):
        third_party = _imports(path) - stdlib - set(ALLOWED)
        assert third_party <= CLIENT_THIRD_PARTY | CLIENT_OPTIONAL, f"{path.relative_to(REPO)}: {third_party}"


def test_modules_are_small_or_say_why():
    for package in ALLOWED:
        for path in _files(package):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
                assert "Longer than 300 lines because" in docstring, f"{path.relative_to(REPO)}: {lines} lines"
