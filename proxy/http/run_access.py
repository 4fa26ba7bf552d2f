"""What a key limited to some runs (proxy.run_keys) may write and read; docs/security.md.

The Edge notes such a key's runs (a RunScope) in the request's scope; every other caller, the
unlimited scoring key, the admin key and a proxy without keys, has none and is never checked here.
A limited key writes only episodes whose `metadata.run` it holds (their ground truth, their
monitor windows, their audit lines) and only reference namespaces it holds: anything else,
an episode without a run included, is a 403 `run_forbidden` naming the field and the run, before
anything is decoded, sent or counted. A batch is refused whole: a credential's refusal is the
request's, not one item's. What it reads of the shared state (/quality, /health's alarms,
GET /progress/references, /metrics) is cut to its own runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fastapi import Request

from proxy.config import RunScope
from proxy.errors import RunForbidden

__all__ = ["check_writes", "raw_run", "runs_of", "visible_metrics", "visible_quality", "visible_store"]


def runs_of(request: Request) -> RunScope | None:
    """The caller's runs when its key is limited; None for every other caller."""
    return request.scope.get("state", {}).get("runs")


def check_writes(request: Request, named: Iterable[tuple[str, object]]) -> None:
    """A 403 for the first (field, run) the caller's key may not write; nothing for unlimited callers."""
    scope = runs_of(request)
    if scope is None:
        return
    for field, run in named:
        if not scope.allows(run):
            what = "no run" if run is None else f"run {run!r}" if isinstance(run, str) else f"{run!r}, not a run name"
            raise RunForbidden(f"{field}: this key may write only runs {scope.describe()}, and the request names "
                               f"{what}; send its episodes with their own run's key", field=field, run=run)


def raw_run(item: object, *path: str) -> object:
    """`metadata.run` of a batch item as sent (items are plain objects until each is validated)."""
    node: Any = item
    for key in (*path, "metadata"):
        node = node.get(key) if isinstance(node, dict) else None
    return node.get("run") if isinstance(node, dict) else None


def visible_quality(scope: RunScope | None, snapshot: dict[str, Any]) -> dict[str, Any]:
    """/quality (or /health's reward_quality) with only the windows of the caller's runs."""
    if scope is None:
        return snapshot
    cut = dict(snapshot)
    if "keys" in snapshot:
        cut["keys"] = [k for k in snapshot["keys"] if scope.allows(k.get("key", {}).get("run"))]
    if "cascades" in snapshot:
        cut["cascades"] = [c for c in snapshot["cascades"] if scope.allows(c.get("key", {}).get("run"))]
    if "restore" in snapshot:  # its counts are every run's: a limited key gets whether and from where only
        cut["restore"] = {k: v for k, v in snapshot["restore"].items() if k not in ("keys", "alarms")}
    if "alarms" in snapshot:
        cut["alarms"] = [a for a in snapshot["alarms"] if scope.allows(a.get("run"))]
        if snapshot.get("status") == "alarm" and not cut["alarms"]:
            # Another run's alarm says nothing of this run's reward; this run's own state is in `keys`.
            cut["status"] = "ok" if any(k.get("status") == "ok" for k in cut.get("keys", ())) else "unknown"
    return cut


def visible_store(scope: RunScope | None, status: dict[str, Any] | None) -> dict[str, Any] | None:
    """The reference store's status with only the caller's namespaces."""
    if scope is None or status is None:
        return status
    return {**status, "tasks": [t for t in status["tasks"] if scope.allows(t["namespace"])]}


_RUN_LABEL = re.compile(rb'[{,]run="((?:[^"\\]|\\.)*)"')


def visible_metrics(scope: RunScope | None, text: bytes) -> bytes:
    """Prometheus text without the series that name another run (their `run` label)."""
    if scope is None:
        return text
    kept = []
    for line in text.splitlines(keepends=True):
        found = _RUN_LABEL.search(line) if not line.startswith(b"#") else None
        if found is None or scope.allows(_unescaped(found[1])):
            kept.append(line)
    return b"".join(kept)


def _unescaped(label: bytes) -> str:
    """A label value as the Prometheus text format writes it (backslash, quote and newline escaped)."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], label.decode("utf-8", "replace"))
