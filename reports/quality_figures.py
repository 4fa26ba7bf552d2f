"""The reward-quality report's figures: score histograms split by env success, ROC curves, and
the contact sheets of the worst disagreements. Each is written as a PNG into the output folder
and returned as bytes (the page inlines them, so report.html is self-contained)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reports.audit import AuditSummary, Group, Worst
from reports.contact_sheet import Sheet, contact_sheet
from reports.plotting import pyplot, save_figure
from reports.quality import histogram, roc_curve

__all__ = ["LogNumbers", "histogram_figure", "roc_figure", "slug", "worst_sheets"]

MAX_TASK_PANELS = 24
COLOURS = {"success": "#2a9d3a", "failure": "#d62728", "unknown": "#999999"}


@dataclass
class LogNumbers:
    """One audit log, read and measured: what the page and the figures are drawn from."""

    label: str  # "" for a single log; "before" / "after" when comparing
    summary: AuditSummary
    groups: dict[str, Group] = field(default_factory=dict)  # backend -> all its tasks
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> numbers
    tasks: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # backend -> task -> numbers
    # kind: progress lines (run D), apart from the scores: backend -> {"all": numbers, "tasks": {...}}
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.label}: {self.summary.path.name}" if self.label else self.summary.path.name


def slug(*parts: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", part).strip("_") or "x" for part in parts if part)


def _draw_histogram(axis: Any, group: Group, threshold: float, title: str) -> None:
    counts = histogram(group.scores, group.truth)
    for name in ("failure", "success", "unknown"):
        if counts[name].any():
            axis.stairs(counts[name], counts["edges"], fill=True, alpha=0.45, color=COLOURS[name],
                        label=f"env {name} ({int(counts[name].sum())})" if name != "unknown"
                        else f"no env_success ({int(counts[name].sum())})")
    axis.axvline(threshold, color="black", linestyle="--", linewidth=1)
    axis.set_xlim(0, 1)
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)
    if group.scored:
        axis.legend(fontsize=7)
    else:
        axis.text(0.5, 0.5, "no scored episode", ha="center", va="center", transform=axis.transAxes, color="grey")


def histogram_figure(log: LogNumbers, backend: str, threshold: float, out_dir: Path) -> tuple[str, bytes]:
    """All tasks, then one panel per task (the first MAX_TASK_PANELS)."""
    plt = pyplot()
    tasks = log.summary.tasks(backend)
    panels = [("all tasks", log.groups[backend])] + [
        (f"task {task}", log.summary.groups[(backend, task)]) for task in tasks[:MAX_TASK_PANELS]]
    if len(tasks) == 1:
        panels = panels[:1]
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for axis, (title, group) in zip(axes.flat, panels, strict=False):
        _draw_histogram(axis, group, threshold, f"{title}: {group.scored} scored")
        axis.set_xlabel("score")
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    title = f"{log.name} — {backend}: score by env success (dashed: threshold {threshold:g})"
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    name = slug("hist", log.label, backend) + ".png"
    return name, save_figure(figure, out_dir / name, title=title,
                             description=f"score histograms of {backend}, split by env_success, per task")


def roc_figure(logs: list[LogNumbers], out_dir: Path) -> tuple[str, bytes] | None:
    """Every backend's ROC curve (score vs env success); when comparing, before solid, after dashed."""
    curves = [(log, backend, roc_curve(group.scores, group.truth), log.backends[backend]["auc"])
              for log in logs for backend, group in log.groups.items()]
    curves = [c for c in curves if c[2] is not None]
    if not curves:
        return None
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6.5, 5.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    backends = sorted({backend for _, backend, _, _ in curves})
    for log, backend, (fpr, tpr), auc in curves:
        style = "--" if log.label == "after" else "-"
        label = f"{_who(backend, log)} (AUC {auc:.3f})"
        axis.plot(fpr, tpr, style, color=colours[backends.index(backend) % len(colours)], linewidth=2,
                  label=label)
    axis.plot([0, 1], [0, 1], color="grey", linewidth=1, linestyle=":")
    axis.set_xlabel("false success rate (failures scored as successes)")
    axis.set_ylabel("true success rate")
    axis.set_xlim(0, 1)
    axis.set_ylim(0, 1.01)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    title = "ROC: score vs simulator success"
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    description = "; ".join(f"{_who(backend, log)} AUC {auc:.3f}" for log, backend, _, auc in curves)
    return "roc.png", save_figure(figure, out_dir / "roc.png", title=title, description=description)


def _who(backend: str, log: LogNumbers) -> str:
    return f"{backend} {log.label}" if log.label else backend


def worst_sheets(log: LogNumbers, backend: str, store: Path | None,
                 out_dir: Path) -> list[tuple[Worst, str | None, Sheet | None]]:
    """(episode, file name, sheet) for each of the backend's worst disagreements; no sheet
    without a frame store."""
    drawn = []
    for rank, worst in enumerate(log.summary.worst(backend), start=1):
        if store is None:
            drawn.append((worst, None, None))
            continue
        sheet = contact_sheet(store, worst.frames, worst.stills)
        name = slug("sheet", log.label, backend, str(rank)) + ".png"
        (out_dir / name).write_bytes(sheet.png)
        drawn.append((worst, name, sheet))
    return drawn
