"""No module-level import cycle anywhere in the tree (type-only imports included), and one way
through the proxy: a request's effects (admission, the episode counters, the audit line) are
applied by the envelope (proxy/pipelines/envelope.py) and every call to a replica goes through the
backend's one ask (proxy/upstream/backends.py), never written again beside them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "rlinf_client", "vlm_protocol", "launchers", "reports", "vlm_reward_cli", "tests", "bench",
            "scripts")

# What only one place may do, and that place. A rule names a call by its attribute (or function)
# name and, for the attribute calls, the name of the object it is called on.
ENVELOPE = "proxy/pipelines/envelope.py"
ONLY_HERE = {
    "an audit line": ({"write"}, {"audit"}, {ENVELOPE, "proxy/quality/monitor.py"}),
    "the admission check": ({"check_admission"}, None, {ENVELOPE, "proxy/upstream/pool.py"}),
    "the retry loop": ({"call_with_retries"}, None, {"proxy/upstream/backends.py"}),
    "the episode counters": ({"episodes", "comparisons", "progress_episodes"}, {"metrics"}, {ENVELOPE}),
}
# Why the monitor writes its own lines: an alarm's transition is the monitor's event, not an
# episode's (kind quality_alarm, written when the window's numbers cross a bound). The pool's own
# check is the queue it keeps: a request that finds no free slot is admitted or refused there.


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree_modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def _top_level_imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The modules of ours this file imports when it is imported: its module-level statements, the
    bodies of `if` (TYPE_CHECKING included) and `try` at that level; `from a import b` names
    a.b where that is a module."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return {module for module in found if module in modules and module != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _tree_modules()
    return {name: _top_level_imports(path, name, modules) for name, path in modules.items()}


def test_no_module_level_import_cycle_anywhere():
    cycles = _cycles(_graph())
    assert not cycles, "module-level import cycles (type-only imports count): " + "; ".join(
        " ⇄ ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_sees_a_type_only_cycle(tmp_path):
    """The rule's own proof: two modules that import each other, one only under TYPE_CHECKING."""
    (tmp_path / "a.py").write_text("from b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import A\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: _top_level_imports(path, name, modules) for name, path in modules.items()}
    assert _cycles(graph) == [["a", "b"]]


def _called_names(node: ast.Call) -> tuple[str | None, str | None]:
    """(the called name, the name of what it is called on) of `x.y.name(...)`, `name(...)` and of
    `metrics.counter.labels(...)` (the counter's name and `metrics`)."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id, None
    if not isinstance(func, ast.Attribute):
        return None, None
    if func.attr == "labels" and isinstance(func.value, ast.Attribute):  # metrics.episodes.labels(...)
        return func.value.attr, _last_name(func.value.value)
    return func.attr, _last_name(func.value)


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _breaches(path: Path) -> list[str]:
    rel = str(path.relative_to(REPO))
    said = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        called, on = _called_names(node)
        for what, (names, owners, places) in ONLY_HERE.items():
            if called in names and (owners is None or on in owners) and rel not in places:
                said.append(f"{rel}:{node.lineno} applies {what} ({called}); only {sorted(places)} may")
    return said


def test_each_effect_is_applied_in_its_one_place():
    breaches = [line for path in sorted((REPO / "proxy").rglob("*.py")) for line in _breaches(path)]
    assert not breaches, "\n".join(breaches)


@pytest.mark.parametrize("line, what", [
    ("services.audit.write({'kind': 'score'})", "an audit line"),
    ("backend.pool.check_admission()", "the admission check"),
    ("await call_with_retries(cfg.retry, send, parse)", "the retry loop"),
    ("self.services.metrics.episodes.labels(name, 'ok').inc()", "the episode counters"),
])
def test_the_rule_sees_each_effect_written_outside_its_place(tmp_path, monkeypatch, line, what):
    """The rule's own proof: each effect, written in a pipeline module of a copy of the tree, is found."""
    module = tmp_path / "proxy" / "pipelines" / "elsewhere.py"
    module.parent.mkdir(parents=True)
    module.write_text(f"async def f(services, backend, cfg, send, parse, self, name):\n    {line}\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["REPO"]), "REPO", tmp_path)
    breaches = _breaches(module)
    assert len(breaches) == 1 and what in breaches[0], breaches
