"""The reward-quality report's figures: score histograms split by env success, ROC curves,
reliability diagrams, the alarm timeline, and the contact sheets of the worst disagreements. Each
is written as a PNG into the output folder and returned as bytes (the page inlines them, so
report.html is self-contained)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reports.audit import AuditSummary, Group, Worst
from reports.contact_sheet import Sheet, contact_sheet
from reports.plotting import pyplot, save_figure
from reports.quality import histogram, roc_curve

__all__ = ["LogNumbers", "alarm_timeline_figure", "histogram_figure", "reliability_figure", "roc_figure", "slug",
           "worst_sheets"]

MAX_TASK_PANELS = 24
MAX_TIMELINE_KEYS = 40  # the table lists every key; the figure the first ones
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
    calibration: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> Brier, bins, tasks
    alarms: list[dict[str, Any]] = field(default_factory=list)  # alarm periods (kind: quality_alarm lines)
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> probe numbers (kind: probe)
    dense: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> VOC of its dense curves
    cascades: dict[str, dict[str, Any]] = field(default_factory=dict)  # cascade -> its stages' numbers

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


def reliability_figure(log: LogNumbers, backend: str, out_dir: Path) -> tuple[str, bytes] | None:
    """Observed success rate per score bin at the bin's mean score, the diagonal for reference, and
    the episodes per bin below; None when no episode of the backend carries env_success."""
    numbers = log.calibration[backend]
    bins = numbers["bins"]
    if not numbers["n"]:
        return None
    plt = pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(5.5, 6.0), sharex=True,
                                         gridspec_kw={"height_ratios": (3, 1)})
    top.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="perfectly calibrated")
    shown = [b for b in bins if b["n"]]
    top.plot([b["mean_score"] for b in shown], [b["rate"] for b in shown], "o-", color=COLOURS["success"],
             label="observed success rate")
    for b in shown:
        top.annotate(str(b["n"]), (b["mean_score"], b["rate"]), textcoords="offset points", xytext=(0, 6),
                     ha="center", fontsize=7)
    top.set_xlim(0, 1)
    top.set_ylim(-0.02, 1.05)
    top.set_ylabel("env success rate")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="upper left")
    bottom.bar([b["low"] for b in bins], [b["n"] for b in bins], width=bins[0]["high"] - bins[0]["low"],
               align="edge", color="#888888", edgecolor="white")
    bottom.set_xlabel("score (10 equal bins)")
    bottom.set_ylabel("episodes")
    bottom.grid(alpha=0.3)
    title = f"{_who(backend, log)}: reliability (Brier {numbers['brier']:.3f}, {numbers['n']} episodes)"
    top.set_title(title, fontsize=10)
    figure.tight_layout()
    name = slug("reliability", log.label, backend) + ".png"
    description = "; ".join(f"[{b['low']:.1f}, {b['high']:.1f}): {b['successes']}/{b['n']}" for b in shown)
    return name, save_figure(figure, out_dir / name, title=title, description=description)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def alarm_timeline_figure(log: LogNumbers, out_dir: Path) -> tuple[str, bytes] | None:
    """One row per (run, backend, task) with an alarm, a bar over each period in wall-clock time
    (UTC): solid red when cleared, hatched when still in alarm at the end of the log, a tick at each
    raise (a period whose raise is not in the log has none). None without any alarm."""
    if not log.alarms:
        return None
    import matplotlib.dates as mdates

    first, last = log.summary.first_ts, log.summary.last_ts
    keys = list(dict.fromkeys((p["run"], p["backend"], p["task_id"]) for p in log.alarms))[:MAX_TIMELINE_KEYS]
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9.0, 1.3 + 0.35 * len(keys)))
    pad = max(1.0, 0.01 * (last - first))  # a log spanning one instant still gets an axis
    for period in log.alarms:
        key = (period["run"], period["backend"], period["task_id"])
        if key not in keys:
            continue
        row = len(keys) - 1 - keys.index(key)  # the first key on top
        left, right = mdates.date2num(_utc(period["from_ts"])), mdates.date2num(_utc(period["to_ts"]))
        axis.barh(row, right - left, left=left, height=0.6, color="#d62728",
                  alpha=0.5 if period["still_in_alarm"] else 0.85,
                  hatch="//" if period["still_in_alarm"] else None, edgecolor="#900")
        if period["raised_ts"] is not None:  # a tick at the raise: an instant alarm has no width
            axis.plot([left, left], [row - 0.3, row + 0.3], color="#900", linewidth=2)
    axis.set_yticks(range(len(keys)), [_key_label(k) for k in reversed(keys)], fontsize=8)
    axis.set_ylim(-0.6, len(keys) - 0.4)
    axis.set_xlim(mdates.date2num(_utc(first - pad)), mdates.date2num(_utc(last + pad)))
    locator = mdates.AutoDateLocator(tz=UTC)  # round ticks for a log of minutes or of days alike
    axis.xaxis.set_major_locator(locator)
    axis.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))
    axis.set_xlabel("wall-clock time (UTC); hatched: still in alarm at the end of the log")
    axis.grid(axis="x", alpha=0.3)
    title = f"{log.name}: reward-quality alarms over time"
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    name = slug("alarms", log.label) + ".png"
    description = "; ".join(f"{_key_label((p['run'], p['backend'], p['task_id']))}: "
                            f"{'still in alarm' if p['still_in_alarm'] else 'cleared'}" for p in log.alarms)
    return name, save_figure(figure, out_dir / name, title=title, description=description)


def _key_label(key: tuple[str | None, str, str]) -> str:
    run, backend, task = key
    return f"{run or '(no run)'} / {backend} / task {task}"


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
