"""`vlm-reward-proxy report AUDIT.jsonl [--compare OTHER.jsonl] --out DIR`: is the reward any good?

Reads the proxy's audit log (streaming: fine for a million lines), measures each backend's and
task's score against the simulator's success flag (metadata.env_success), and writes
DIR/report.html (self-contained), its PNGs and DIR/report.json (the same numbers, for scripts).
With --compare, AUDIT is "before" and OTHER "after" (e.g. a `replay` with an edited prompt): the
same numbers side by side, and agreement on the episodes both logs scored.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from reports.audit import Episodes, read_audit_log
from reports.cascade_lines import measure_cascades
from reports.dense_curves import measure_dense
from reports.monitor_lines import alarm_periods, measure_probes
from reports.plotting import MissingDependencyError, fmt
from reports.progress_quality import measure_progress
from reports.quality import calibration_numbers, compare_numbers, group_numbers, match_episodes
from reports.quality_figures import LogNumbers
from reports.quality_html import alerts, render_report

__all__ = ["add_subcommand", "build_report", "measure", "pair_backends"]


def measure(path: str | Path, *, threshold: float, worst: int, label: str = "") -> LogNumbers:
    summary = read_audit_log(path, worst_k=worst)
    log = LogNumbers(label, summary)
    for backend in summary.backends():
        log.groups[backend] = summary.backend_group(backend)
        log.backends[backend] = group_numbers(log.groups[backend], threshold)
        log.tasks[backend] = {task: group_numbers(summary.groups[(backend, task)], threshold)
                              for task in summary.tasks(backend)}
        log.calibration[backend] = {**calibration_numbers(log.groups[backend]), "tasks": {
            task: calibration_numbers(summary.groups[(backend, task)], bins=False) for task in summary.tasks(backend)}}
    log.progress = measure_progress(summary.progress)
    log.alarms = alarm_periods(summary.alarms, summary.first_ts, summary.last_ts)
    log.probes = measure_probes(summary.probes)
    log.dense = measure_dense(summary.dense)
    log.cascades = measure_cascades(summary.cascades)
    return log


def pair_backends(before: LogNumbers, after: LogNumbers) -> list[tuple[str, str]]:
    """Backends of the same name; then, if one backend is left on each side, those two (a replay
    on another backend)."""
    same = [(b, b) for b in before.backends if b in after.backends]
    left_before = [b for b in before.backends if b not in after.backends]
    left_after = [b for b in after.backends if b not in before.backends]
    if len(left_before) == 1 and len(left_after) == 1:
        same.append((left_before[0], left_after[0]))
    return same


def _pairs(before: LogNumbers, after: LogNumbers, threshold: float) -> list[dict[str, Any]]:
    pairs = []
    for b, a in pair_backends(before, after):
        match = match_episodes(before.summary.episodes.get(b, Episodes()), after.summary.episodes.get(a, Episodes()),
                               threshold)
        pairs.append({"title": b if a == b else f"{b} → {a}", "before": b, "after": a,
                      "numbers": compare_numbers(before.backends[b], after.backends[a]), "match": match})
    return pairs


def _plain(value: Any) -> Any:
    """JSON-safe: tuples as lists, inf/NaN as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def build_report(audit: str | Path, *, out: str | Path, compare: str | Path | None = None,
                 frame_store: str | Path | None = None, threshold: float = 0.5, worst: int = 8) -> dict[str, Any]:
    """Read, measure, write DIR/report.html, PNGs and report.json; returns what report.json holds."""
    out_dir = Path(out)
    logs = [measure(audit, threshold=threshold, worst=worst, label="before" if compare else "")]
    if compare:
        logs.append(measure(compare, threshold=threshold, worst=worst, label="after"))
    pairs = _pairs(logs[0], logs[1], threshold) if compare else []
    out_dir.mkdir(parents=True, exist_ok=True)
    page = render_report(out_dir, logs, pairs, threshold=threshold, store=Path(frame_store) if frame_store else None)
    result = {"page": str(page), "threshold": threshold, "alerts": alerts(logs, pairs), "logs": [
        {"label": log.label, "path": str(log.summary.path), "lines": log.summary.lines,
         "malformed": log.summary.malformed, "backends": log.backends, "tasks": log.tasks,
         "progress": log.progress, "calibration": log.calibration, "alarms": log.alarms, "probes": log.probes,
         "dense": log.dense, "cascades": log.cascades,
         "other_kinds": dict(sorted(log.summary.other_kinds.items()))} for log in logs],
        "compare": pairs}
    (out_dir / "report.json").write_text(json.dumps(_plain(result), indent=1), encoding="utf-8")
    return result


# -- command line ----------------------------------------------------------------------------------
def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", help="reward quality from the proxy's audit log: score vs simulator success (HTML)",
        description="Measure each backend's score against metadata.env_success in the proxy's audit log "
                    "(ROC-AUC, accuracy, histograms, parse failures, errors, latency, tokens, the worst "
                    "disagreements with their frames) and write DIR/report.html, PNGs and report.json.")
    parser.add_argument("audit", metavar="AUDIT.jsonl", help="the proxy's audit log (proxy.audit_log; .gz too)")
    parser.add_argument("--compare", metavar="OTHER.jsonl", default=None,
                        help="a second audit log (e.g. from `replay`): AUDIT is before, OTHER after")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument("--frame-store", default=None, metavar="DIR",
                        help="the proxy's frame store (proxy.frame_store.dir), for the contact sheets")
    parser.add_argument("--success-threshold", type=float, default=0.5, metavar="SCORE",
                        help="score >= T counts as success, as the RLinf client maps it (default: 0.5)")
    parser.add_argument("--worst", type=int, default=8, metavar="K",
                        help="contact sheets of the K episodes that disagree most, per backend (default: 8)")
    parser.set_defaults(func=run_command)
    return parser


def run_command(args: argparse.Namespace) -> int:
    if not 0.0 <= args.success_threshold <= 1.0:
        return _fail("--success-threshold must be in [0, 1]")
    if args.worst < 0:
        return _fail("--worst must be >= 0")
    if args.frame_store and not Path(args.frame_store).is_dir():
        return _fail(f"--frame-store {args.frame_store}: no such directory")
    try:
        result = build_report(args.audit, out=args.out, compare=args.compare, frame_store=args.frame_store,
                              threshold=args.success_threshold, worst=args.worst)
    except (FileNotFoundError, ValueError, MissingDependencyError) as err:
        return _fail(str(err))
    for log in result["logs"]:
        for backend, n in log["backends"].items():
            print(f"{log['label'] + ' ' if log['label'] else ''}{backend}: {n['lines']} episodes, "
                  f"{n['with_truth']} with env_success; ROC-AUC {fmt(n['auc'], '3')}, accuracy at "
                  f"{args.success_threshold:g} {fmt(n['accuracy'], '%')}, parse failures {n['parse_failures']}, "
                  f"errors {n['errors']}")
        for backend, n in ((b, p["all"]) for b, p in log["progress"].items()):
            print(f"{log['label'] + ' ' if log['label'] else ''}{backend} (progress): {n['lines']} items, "
                  f"{n['successes']} successes, {n['failures']} failures ({n['no_reference']} without a reference); "
                  f"failures' progress mean {fmt(n['progress_mean'], '3')}, median {fmt(n['progress_p50'], '3')}; "
                  f"errors {n['errors']}")
    for line in result["alerts"]:
        print(f"WARNING: {line}", file=sys.stderr)
    print(f"wrote {result['page']}")
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
