"""The tree reads as the system: packages depend one way, the client stays light, modules have one job.

Between the repository's packages:

    vlm_protocol   ← proxy ← launchers ┐
        ↑   ↖ rlinf_client              ├ vlm_reward_cli (the command line, on top of all)
        └──── reports ─────────────────┘

Inside proxy/ (an arrow points at what a package may import; each may also import the
foundation: errors, protocol, metrics, audit):

    cli ─► http ─► progress ─► pipelines ─┬─► prompting ─► media ─┐
                                          └─► upstream ───────────┼─► config ─► answers (pure)
                                                                  └──────────────────────┘

`http/` is the only package that knows FastAPI, Starlette or uvicorn. The pure rules —
`answers/`, the progress math, vlm_protocol's frame rules — import no I/O package, of ours or
anyone's. docs/architecture.md draws the same picture and lists every module with its one job.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROXY = REPO / "proxy"
PACKAGES = {
    "vlm_protocol": set(),
    "proxy": {"vlm_protocol"},
    "rlinf_client": {"vlm_protocol"},
    "reports": {"vlm_protocol"},
    "launchers": {"proxy", "vlm_protocol"},
    "vlm_reward_cli": {"proxy", "launchers", "reports", "rlinf_client", "vlm_protocol"},
}

# proxy/'s parts (a subpackage, or a top-level module) and which others each may import: written
# once, here. docs/architecture.md's "Dependency direction" is this table drawn.
FOUNDATION = {"errors", "protocol", "metrics", "audit"}
ALLOWED = {
    "errors": set(),
    "protocol": {"errors"},  # the API's models, one module per surface: every layer reads them
    "metrics": set(),
    "audit": {"metrics"},
    "answers": {"errors"},
    "config": {"errors", "answers"},
    "media": FOUNDATION | {"config"},
    "upstream": FOUNDATION | {"config", "answers"},
    "prompting": FOUNDATION | {"config", "answers", "media"},
    "quality": FOUNDATION | {"config"},
    "pipelines": FOUNDATION | {"config", "answers", "media", "prompting", "upstream", "quality"},
    "progress": FOUNDATION | {"config", "answers", "media", "prompting", "upstream", "pipelines"},
    "http": FOUNDATION | {"config", "answers", "media", "prompting", "upstream", "pipelines", "progress", "quality"},
    "cli": {"errors", "config", "http"},
}
HTTP_FRAMEWORK = {"fastapi", "starlette", "uvicorn"}
# Pure: parsing and arithmetic over values given to them; no network, disk, processes or codecs.
PURE = ["proxy/answers", "proxy/progress/math.py", "proxy/quality/window.py", "vlm_protocol/frames.py",
        "vlm_protocol/agreement.py"]
PURE_THIRD_PARTY = {"numpy", "yaml"}  # yaml: templates are parsed from text the caller read
IO_STDLIB = {"asyncio", "socket", "subprocess", "threading", "multiprocessing", "concurrent", "os", "shutil",
             "tempfile", "urllib", "http", "ssl", "select", "signal", "io", "pathlib", "sqlite3"}
# What the client's base install brings (pyproject's dependencies), beside the standard library.
CLIENT_THIRD_PARTY = {"httpx", "numpy", "yaml"}
# Imported lazily by the client, for one optional feature each, with a clear error when missing.
CLIENT_OPTIONAL = {"cv2"}  # transport: path writes an MP4
# Imported only under `if TYPE_CHECKING:`, never run (tests/layout/test_client_floor.py checks where).
CLIENT_TYPING_ONLY = {"typing_extensions"}
# Past this, a module must say in its docstring why it is one job ("Longer than 400 lines because ...").
LONG_MODULE = 400


def _modules(path: Path) -> set[str]:
    """Full dotted names of every module imported anywhere in the file (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "proxy":  # `from proxy import cli`
                names.update(f"proxy.{alias.name}" for alias in node.names)
    return names


def _imports(path: Path) -> set[str]:
    """Top-level names of every module imported anywhere in the file."""
    return {name.split(".")[0] for name in _modules(path)}


def _files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _part(path: Path) -> str:
    """The part of proxy/ a file belongs to: its subpackage, or its own name at the top."""
    return path.relative_to(PROXY).parts[0].removesuffix(".py")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_depend_one_way(package):
    ours = set(PACKAGES)
    for path in _files(package):
        used = (_imports(path) & ours) - {package}
        assert used <= PACKAGES[package], f"{_rel(path)} imports {sorted(used - PACKAGES[package])}"


def test_proxy_is_one_level_of_subpackages_each_in_the_table():
    parts = {_part(path) for path in PROXY.rglob("*.py")} - {"__init__"}
    assert parts == set(ALLOWED), f"in proxy/, not in ALLOWED: {sorted(parts - set(ALLOWED))}; " \
                                  f"in ALLOWED, not in proxy/: {sorted(set(ALLOWED) - parts)}"
    nested = [_rel(path) for path in PROXY.rglob("*.py") if len(path.relative_to(PROXY).parts) > 2]
    assert not nested, f"proxy/ is one level deep: {nested}"
    for package in (p for p in PROXY.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert (package / "__init__.py").is_file(), f"{_rel(package)} has no __init__.py"


@pytest.mark.parametrize("path", sorted(PROXY.rglob("*.py")), ids=lambda p: _rel(p))
def test_proxy_parts_depend_one_way(path):
    me = _part(path)
    used = {name.split(".")[1] for name in _modules(path) if name.startswith("proxy.")} - {me}
    allowed = ALLOWED.get(me, set())  # proxy/__init__.py: nothing
    assert used <= allowed, f"{_rel(path)} ({me}) imports proxy.{sorted(used - allowed)}"


def test_only_http_knows_the_web_framework():
    for package in PACKAGES:
        for path in _files(package):
            framework = _imports(path) & HTTP_FRAMEWORK
            inside_http = path.is_relative_to(PROXY / "http")
            assert inside_http or not framework, f"{_rel(path)} imports {sorted(framework)}: that is proxy/http/'s job"


@pytest.mark.parametrize("path", [p for pure in PURE for p in (sorted((REPO / pure).rglob("*.py"))
                                                               if (REPO / pure).is_dir() else [REPO / pure])],
                         ids=lambda p: _rel(p))
def test_pure_rules_do_no_io(path):
    modules = _modules(path)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    top = {name.split(".")[0] for name in modules}
    io = (top & IO_STDLIB) | (top - stdlib - PURE_THIRD_PARTY - set(PACKAGES))
    assert not io, f"{_rel(path)} is pure but imports {sorted(io)}"
    proxy_parts = {name.split(".")[1] for name in modules if name.startswith("proxy.")}
    assert proxy_parts <= {"errors", "answers"}, f"{_rel(path)} is pure but imports proxy.{sorted(proxy_parts)}"
    assert not {name for name in modules if name.startswith("vlm_protocol.")} - {"vlm_protocol.strict_yaml",
                                                                             "vlm_protocol.agreement"}, _rel(path)


@pytest.mark.parametrize("package", ["rlinf_client", "vlm_protocol"])
def test_the_client_needs_only_its_base_install(package):
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in _files(package):
        third_party = _imports(path) - stdlib - set(PACKAGES)
        assert third_party <= CLIENT_THIRD_PARTY | CLIENT_OPTIONAL | CLIENT_TYPING_ONLY, f"{_rel(path)}: {third_party}"


@pytest.mark.parametrize("path", sorted(PROXY.rglob("*.py")), ids=lambda p: _rel(p))
def test_each_proxy_module_states_its_one_job(path):
    """One job per module, said first: its docstring opens with it. A long module says why it is
    still one job; a short one is fine — no module exists only to stay under a line count."""
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source)) or ""
    assert docstring.strip(), f"{_rel(path)}: no docstring stating its job"
    lines = len(source.splitlines())
    if lines > LONG_MODULE:
        assert f"Longer than {LONG_MODULE} lines because" in docstring, f"{_rel(path)}: {lines} lines"


def _documented_modules() -> set[str]:
    """The modules docs/architecture.md gives a line: table rows under a `proxy/…/` heading."""
    listed, folder = set(), None
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("#"):
            heading = re.search(r"`(proxy/(?:\w+/)?)`", line)
            folder = heading.group(1) if heading else None
        elif folder and line.startswith("| `"):
            first_cell = line.split("|")[1]
            listed.update(folder + name for name in re.findall(r"`(\w+\.py)`", first_cell))
    return listed


def test_the_architecture_doc_lists_every_proxy_module():
    """docs/architecture.md gives each module of proxy/ its one line: a new module is placed on the map."""
    listed = _documented_modules()
    present = {_rel(path) for path in PROXY.rglob("*.py") if path.name != "__init__.py"}
    assert present <= listed, f"docs/architecture.md does not list {sorted(present - listed)}"
    assert listed <= present, f"docs/architecture.md lists modules that are gone: {sorted(listed - present)}"


def test_other_packages_modules_are_small_or_say_why():
    for package in set(PACKAGES) - {"proxy"}:
        for path in _files(package):
            lines = len(path.read_text().splitlines())
            if lines > LONG_MODULE:
                docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
                assert f"Longer than {LONG_MODULE} lines because" in docstring, f"{_rel(path)}: {lines} lines"
