"""The reward-quality page: DIR/report.html, self-contained (figures inlined, also written as PNGs).

Top to bottom: red alerts (parse failures, errors, unreadable lines, no ground truth, a score
near chance), the summary table per backend, the before/after comparison when two logs are
given, the ROC curves, the live monitor's alarms over time, the invariance probes, the dense
curves' VOC, calibration
(reliability diagrams, Brier scores), then per backend: per-task numbers, histograms, errors,
prompt templates and the contact sheets of the episodes where score and simulator disagree most."""

from __future__ import annotations

import html
import math
import time
from pathlib import Path
from typing import Any

from reports.cascade_lines import cascade_section
from reports.dense_curves import dense_section
from reports.plotting import alert, fmt, image_tag, table, write_page
from reports.progress_quality import progress_alerts, progress_section
from reports.quality_figures import (
    LogNumbers,
    alarm_timeline_figure,
    histogram_figure,
    reliability_figure,
    roc_figure,
    worst_sheets,
)

__all__ = ["PARSE_ALERT", "ERROR_ALERT", "AUC_ALERT", "alarms_section", "alerts", "calibration_section",
           "probes_section", "render_report"]

PARSE_ALERT, ERROR_ALERT, AUC_ALERT = 0.02, 0.01, 0.6  # a rate at or above / an AUC below: an alert


def _pct_of(count: int, whole: int) -> str:
    return f"{count:,} ({fmt(count / whole if whole else None, '%')})"


def _best(numbers: dict[str, Any]) -> str:
    if numbers["best_accuracy"] is None:
        return "—"
    where = ("calling every episode a failure" if math.isinf(numbers["best_threshold"])
             else f"at ≥ {numbers['best_threshold']:.3g}")
    return f"{fmt(numbers['best_accuracy'], '%')} ({numbers['best_correct']}/{numbers['with_truth']}) {where}"


def summary_row(numbers: dict[str, Any]) -> dict[str, str]:
    """One backend's (or task's) key numbers, as the tables show them."""
    return {
        "episodes": fmt(numbers["lines"], "int"), "scored": fmt(numbers["scored"], "int"),
        "with env_success": f"{numbers['with_truth']:,} ({numbers['successes']:,} ✓ / {numbers['failures']:,} ✗)",
        "ROC-AUC": fmt(numbers["auc"], "3"),
        "accuracy at threshold": "—" if numbers["accuracy"] is None else
        f"{fmt(numbers['accuracy'], '%')} ({numbers['correct']}/{numbers['with_truth']})",
        "best accuracy": _best(numbers),
        "false successes": f"{numbers['false_success']}/{numbers['failures']}"
                           + (f" ({fmt(numbers['false_success_rate'], '%')})" if numbers["failures"] else ""),
        "parse failures": _pct_of(numbers["parse_failures"], numbers["lines"]),
        "errors": _pct_of(numbers["errors"], numbers["lines"]),
        "latency ms p50 / p90 / p99": " / ".join(fmt(numbers[f"latency_p{q}"], "int") for q in (50, 90, 99)),
        "tokens p50 prompt / completion": f"{fmt(numbers['prompt_tokens_p50'], 'int')} / "
                                          f"{fmt(numbers['completion_tokens_p50'], 'int')}",
    }


SUMMARY_KEYS = ("episodes", "scored", "with env_success", "ROC-AUC", "accuracy at threshold", "best accuracy",
                "false successes", "parse failures", "errors", "latency ms p50 / p90 / p99",
                "tokens p50 prompt / completion")


def alerts(logs: list[LogNumbers], pairs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for log in logs:
        who = f"{log.label} log, " if log.label else ""
        summary = log.summary
        if summary.malformed:
            first, why = summary.malformed_examples[0]
            lines.append(f"{who}{summary.path.name}: {summary.malformed} of {summary.lines} lines are not audit "
                         f"records and were skipped (first: line {first}, {why})")
        for backend, n in log.backends.items():
            if n["parse_failure_rate"] is not None and n["parse_failure_rate"] >= PARSE_ALERT:
                lines.append(f"{who}{backend}: {fmt(n['parse_failure_rate'], '%')} of episodes ({n['parse_failures']}"
                             f" of {n['lines']}) got a reply with no readable score (unparseable_score)")
            if n["error_rate"] is not None and n["error_rate"] >= ERROR_ALERT:
                lines.append(f"{who}{backend}: {fmt(n['error_rate'], '%')} of episodes ({n['errors']} of {n['lines']})"
                             " failed with an error: " + ", ".join(
                                 f"{c} ×{k}" for c, k in n["errors_by_code"].items() if c != "unparseable_score"))
            if n["lines"] and not n["truth_lines"]:
                lines.append(f"{who}{backend}: no line carries metadata.env_success, so agreement with the "
                             "simulator cannot be measured")
            elif n["auc"] is not None and n["auc"] < AUC_ALERT:
                lines.append(f"{who}{backend}: ROC-AUC {n['auc']:.3f}: the score barely separates successes "
                             "from failures")
        lines.extend(progress_alerts(log.progress, who))
        for why, count in summary.store_errors.items():
            lines.append(f"{who}the frame store did not keep the frames of {count} episodes ({why})")
    for pair in pairs:
        if pair["match"]["truth_conflicts"]:
            lines.append(f"{pair['title']}: {pair['match']['truth_conflicts']} matched episodes have a different "
                         "env_success in the two logs (left out of the comparison)")
    return lines


def _delta(kind: str, value: Any) -> str:
    if value is None:
        return "—"
    if kind == "%":
        return f"{value * 100:+.1f} pp"
    return f"{value:+.3f}" if kind == "3" else f"{value:+.4g}"


COMPARE_ROWS = (("lines", "episodes", "int"), ("with_truth", "with env_success", "int"), ("auc", "ROC-AUC", "3"),
                ("accuracy", "accuracy at threshold", "%"), ("best_accuracy", "best accuracy", "%"),
                ("false_success_rate", "false success rate", "%"), ("parse_failure_rate", "parse failures", "%"),
                ("error_rate", "errors", "%"), ("latency_p50", "latency p50 ms", "1"),
                ("latency_p99", "latency p99 ms", "1"), ("prompt_tokens_p50", "prompt tokens p50", "int"),
                ("completion_tokens_p50", "completion tokens p50", "int"))


def _compare_section(pairs: list[dict[str, Any]]) -> str:
    parts = ["<h2>Before / after</h2><p>Δ = after − before. The matched table compares the very same "
             "episodes (metadata.episode_id + task text) that both logs scored and whose env_success is known.</p>"]
    for pair in pairs:
        numbers, match = pair["numbers"], pair["match"]
        rows = [{"number": label, "before": fmt(numbers[key][0], kind), "after": fmt(numbers[key][1], kind),
                 "Δ": _delta(kind, numbers[key][2])} for key, label, kind in COMPARE_ROWS]
        parts.append(table(("number", "before", "after", "Δ"), rows, caption=f"{pair['title']}: all episodes"))
        matched = [{"number": label, "before": fmt(match[key][0], kind), "after": fmt(match[key][1], kind),
                    "Δ": _delta(kind, None if None in match[key] else match[key][1] - match[key][0])}
                   for key, label, kind in (("auc", "ROC-AUC", "3"), ("accuracy", "accuracy at threshold", "%"),
                                            ("best_accuracy", "best accuracy", "%"))]
        parts.append(table(("number", "before", "after", "Δ"), matched,
                           caption=f"{pair['title']}: {match['compared']} matched episodes"))
        facts = [("episodes in both logs", match["matched"]), ("compared (scored in both, truth known)",
                                                                 match["compared"]),
                 ("verdicts fixed (wrong before, right after)", match["fixed"]),
                 ("verdicts broken (right before, wrong after)", match["broken"]),
                 ("mean |score change|", fmt(match["mean_abs_change"], "3")),
                 ("scored only before / only after", f"{match['scored_only_before']} / {match['scored_only_after']}"),
                 ("only in before / only in after", f"{match['unmatched_before']} / {match['unmatched_after']}"),
                 ("repeated episode keys (last line kept) before / after",
                  f"{match['duplicates_before']} / {match['duplicates_after']}")]
        parts.append(table(("fact", "value"), ({"fact": f, "value": v} for f, v in facts),
                           caption=f"{pair['title']}: episode by episode"))
    return "".join(parts)


def _backend_section(log: LogNumbers, backend: str, threshold: float, store: Path | None, out_dir: Path) -> str:
    summary = log.summary
    anchor = f"{log.label} {backend}".strip()
    parts = [f'<h2 id="{html.escape(anchor.replace(" ", "-"))}">{html.escape(log.name if log.label else "")}'
             f'{" — " if log.label else ""}{html.escape(backend)}</h2>']
    rows = [{"task_id": task, **summary_row(numbers)} for task, numbers in log.tasks[backend].items()]
    parts.append(table(("task_id", *SUMMARY_KEYS), rows, caption=f"Per task — {anchor}"))
    name, png = histogram_figure(log, backend, threshold, out_dir)
    parts.append(f"<figure><figcaption>Score histograms by env success ({name})</figcaption>"
                 f"{image_tag(png, f'score histograms of {backend}')}</figure>")
    codes = log.backends[backend]["errors_by_code"]
    if codes:
        lines = log.backends[backend]["lines"]
        parts.append(table(("code", "episodes", "rate"), ({"code": c, "episodes": k, "rate": fmt(k / lines, "%")}
                                                          for c, k in codes.items()),
                           caption=f"Failed episodes — {anchor} (unparseable_score = parse failure)"))
    examples = summary.parse_examples.get(backend, [])
    if examples:
        parts.append("<p>Replies with no readable score (first few):</p><ul>"
                     + "".join(f"<li><code>{html.escape(e)}</code></li>" for e in examples) + "</ul>")
    prompts = [{"template": n, "sha256": h, "overrides": o, "episodes": k}
               for (b, n, h, o), k in sorted(summary.prompts.items()) if b == backend]
    parts.append(table(("template", "sha256", "overrides", "episodes"), prompts,
                       caption=f"Prompt templates seen — {anchor}"))
    parts.append(_worst_section(log, backend, store, out_dir))
    return "".join(parts)


def _worst_section(log: LogNumbers, backend: str, store: Path | None, out_dir: Path) -> str:
    if log.summary.worst_k == 0:
        return ""
    drawn = worst_sheets(log, backend, store, out_dir)
    who = f"{log.label} {backend}".strip()
    if not drawn:
        return "<p>No scored episode with env_success: no disagreements to show.</p>"
    parts = [f"<h3>Worst disagreements ({len(drawn)}): |score − env success| largest first</h3>"]
    if store is None:
        parts.append('<p class="note">No frame store given (--frame-store DIR): contact sheets are not drawn.</p>')
    for rank, (worst, name, sheet) in enumerate(drawn, start=1):
        outcome = "success" if worst.env_success else "failure"
        caption = (f"{who} #{rank}: episode {worst.episode_id or '—'}, task {worst.task_id}, env {outcome}, "
                   f"score {worst.score:.3f} (raw {worst.raw_score}), line {worst.line}")
        detail = f"task text: {worst.task_text!r}; reply: {worst.output_text!r}"
        if sheet is not None and sheet.missing:
            detail += f"; {sheet.missing} of {sheet.frames} frames are missing from the frame store {store}"
        img = image_tag(sheet.png, f"frames of episode {worst.episode_id} ({name})") if sheet else ""
        parts.append(f"<figure><figcaption><strong>{html.escape(caption)}</strong><br>{html.escape(detail)}"
                     f"</figcaption>{img}</figure>")
    return "".join(parts)


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _window_numbers(numbers: dict[str, Any] | None) -> str:
    """The alarm line's window numbers that the alarm is judged on, as a person reads them."""
    if not numbers:
        return "—"
    shown = [("n", "n", "int"), ("auc", "ROC-AUC", "3"), ("false_success_rate", "false-success rate", "%"),
             ("accuracy", "accuracy", "%")]
    return ", ".join(f"{label} {fmt(numbers[key], kind)}" for key, label, kind in shown if key in numbers)


ALARM_KEYS = ("run", "backend", "task_id", "raised", "cleared", "time in alarm", "reason at the raise",
              "numbers at the raise", "episodes seen at the raise")


def _alarm_row(period: dict[str, Any]) -> dict[str, str]:
    at_least = "≥ " if period["still_in_alarm"] or period["raised_ts"] is None else ""
    reason = period["reason"] or "—"
    if period["repeated_raises"]:
        reason += f" (raised again ×{period['repeated_raises']} before it cleared)"
    return {"run": period["run"] or "—", "backend": period["backend"], "task_id": period["task_id"],
            "raised": "not in this log (rotated away?)" if period["raised_ts"] is None else _utc(period["raised_ts"]),
            "cleared": "still in alarm at the end of the log" if period["still_in_alarm"]
            else _utc(period["cleared_ts"]) + (" (the proxy stopped)" if period.get("ended_by") == "proxy stopped"
                                               else ""),
            "time in alarm": at_least + _duration(period["duration_s"]), "reason at the raise": reason,
            "numbers at the raise": _window_numbers(period["numbers"]),
            "episodes seen at the raise": fmt(period["episodes_seen"], "int")}


def alarms_section(log: LogNumbers, out_dir: Path) -> str:
    """Each (run, backend, task)'s periods in alarm, from the quality_alarm lines, and their timeline."""
    who = f" — {log.name}" if log.label else ""
    head = f"<h2>Alarms over time{html.escape(who)}</h2>"
    if not log.alarms:
        return head + "<p>No alarm in this log.</p>"
    parts = [head, "<p>The proxy's live monitor writes a <code>quality_alarm</code> line each time a (run, backend, "
             "task) enters alarm (its rolling window's false-success rate or ROC-AUC out of bounds) or leaves it. "
             "Each row is one period in alarm, with the reason and window numbers at the raise "
             "(docs/reward-quality.md, What to do on an alarm).</p>",
             table(ALARM_KEYS, (_alarm_row(p) for p in log.alarms), caption=f"Alarm periods{who}")]
    figure = alarm_timeline_figure(log, out_dir)
    if figure:
        parts.append(f"<figure><figcaption>Alarms over time ({figure[0]})</figcaption>"
                     f"{image_tag(figure[1], 'alarm periods over time')}</figure>")
    return "".join(parts)


PROBE_KEYS = ("backend", "task_id", "probe", "probes", "mean margin", "inversions", "mean score original / probe",
              "errors")


def _probe_row(backend: str, task: str, kind: str, n: dict[str, Any]) -> dict[str, str]:
    return {"backend": backend, "task_id": task, "probe": kind, "probes": fmt(n["n"], "int"),
            "mean margin": "—" if n["mean_margin"] is None else f"{n['mean_margin']:+.3f}",
            "inversions": f"{n['inversions']:,} ({fmt(n['inversion_rate'], '%')})",
            "mean score original / probe": f"{fmt(n['mean_original_score'], '3')} / {fmt(n['mean_probe_score'], '3')}",
            "errors": fmt(n["errors"], "int")}


def probes_section(log: LogNumbers) -> str:
    """Per (backend, task, probe kind): probes, mean margin, inversions; all tasks first."""
    who = f" — {log.name}" if log.label else ""
    head = f"<h2>Invariance probes{html.escape(who)}</h2>"
    if not log.probes:
        return head + "<p>No invariance probe in this log.</p>"
    rows = []
    for backend, numbers in log.probes.items():
        if len(numbers["tasks"]) > 1:  # one task: its rows are the backend's already
            rows.extend(_probe_row(backend, "all tasks", kind, n) for kind, n in numbers["all"].items())
        rows.extend(_probe_row(backend, task, kind, n) for task, kinds in numbers["tasks"].items()
                    for kind, n in kinds.items())
    return (head + "<p>Each probe scores an episode again with its frames <b>reversed</b> or <b>shuffled</b>, or "
            "with another task's <b>instruction</b>. Margin = original score − probe score: a good reward model "
            "scores the probe lower (margin &gt; 0). An <b>inversion</b>: the probe scored at least the original. "
            "A reward model that ignores time order (reversed, shuffled) or the instruction shows mean margins "
            "near 0 and many inversions (half or more): a policy can be rewarded for the wrong thing. An episode "
            "already scored near 0 leaves no room for a margin, so compare tasks with the mean original "
            "score in mind.</p>" + table(PROBE_KEYS, rows, caption=f"Invariance probes{who}"))


CALIBRATION_KEYS = ("episodes with env_success", "Brier", "a constant's Brier p(1 − p)", "mean score",
                    "success rate p")


def _calibration_row(n: dict[str, Any]) -> dict[str, str]:
    return {"episodes with env_success": fmt(n["n"], "int"), "Brier": fmt(n["brier"], "3"),
            "a constant's Brier p(1 − p)": fmt(n["brier_constant"], "3"), "mean score": fmt(n["mean_score"], "3"),
            "success rate p": fmt(n["success_rate"], "%")}


def _bin_row(b: dict[str, Any]) -> dict[str, str]:
    return {"score bin": f"[{b['low']:.1f}, {b['high']:.1f}{']' if b['high'] >= 1 else ')'}",
            "episodes": fmt(b["n"], "int"), "successes": fmt(b["successes"], "int"),
            "observed success rate": fmt(b["rate"], "%"), "mean score": fmt(b["mean_score"], "3")}


def calibration_section(log: LogNumbers, out_dir: Path) -> str:
    """Reliability diagram and bins per backend; Brier per backend and per task."""
    if not log.calibration:
        return ""
    who = f" — {log.name}" if log.label else ""
    parts = [f"<h2>Calibration{html.escape(who)}</h2>",
             "<p>Does a score of 0.8 mean 80 % of such episodes succeed? Episodes with env_success are grouped by "
             "score in 10 equal bins; each point is a bin's observed success rate at its mean score, and a "
             "calibrated score lies on the diagonal. A score can rank well (high ROC-AUC) and still be badly "
             "calibrated: what matters to the RLinf client's threshold is accuracy; to a policy trained on the raw "
             "score, calibration. <b>Brier</b> = mean (score − success)²: 0 is perfect; a constant at the success "
             "rate p scores p(1 − p), so a Brier above that is worse than knowing nothing of the episode.</p>",
             table(("backend", *CALIBRATION_KEYS), ({"backend": b, **_calibration_row(n)}
                                                    for b, n in log.calibration.items()),
                   caption=f"Brier score per backend{who}")]
    for backend, numbers in log.calibration.items():
        figure = reliability_figure(log, backend, out_dir)
        if figure is None:
            parts.append(f"<p>{html.escape(backend)}: no scored episode carries env_success: no calibration.</p>")
            continue
        parts.append(f"<figure><figcaption>Reliability diagram — {html.escape(backend)} ({figure[0]})</figcaption>"
                     f"{image_tag(figure[1], f'reliability diagram of {backend}')}</figure>")
        parts.append(table(("score bin", "episodes", "successes", "observed success rate", "mean score"),
                           (_bin_row(b) for b in numbers["bins"]), caption=f"Reliability bins — {backend}{who}"))
        parts.append(table(("task_id", *CALIBRATION_KEYS), ({"task_id": t, **_calibration_row(n)}
                                                            for t, n in numbers["tasks"].items()),
                           caption=f"Brier score per task — {backend}{who}"))
    return "".join(parts)


def _health(log: LogNumbers) -> str:
    s = log.summary
    span = (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(s.first_ts))} to "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(s.last_ts))} UTC" if s.first_ts is not None else "—")
    no_truth = sum(n["lines"] - n["truth_lines"] for n in log.backends.values())
    facts = [("file", str(s.path)), ("lines read", s.lines), ("audit records", s.records),
             ("malformed lines (skipped)", s.malformed)] + [
        (f"malformed line {line}", why) for line, why in s.malformed_examples] + [
        ("records without metadata.env_success (counted, not in agreement)", no_truth),
        ("records without metadata.episode_id (cannot be matched across logs)", s.without_episode_id),
        ("progress items (kind: progress, measured apart)", sum(g.lines for g in s.progress.groups.values())),
        ("other lines, never episodes (by kind)", ", ".join(f"{k} ×{n}" for k, n in sorted(s.other_kinds.items()))
         or "none"),
        ("time span", span)]
    return table(("fact", "value"), ({"fact": f, "value": v} for f, v in facts), caption=f"Log: {log.name}")


HOW_TO_READ = (
    "<h2>How to read this</h2><ul><li><b>ROC-AUC</b>: the chance that a random successful episode scores above a "
    "random failed one (ties count half); 0.5 is a coin, 1.0 is perfect.</li><li><b>Accuracy at threshold</b>: "
    "the share of episodes where score ≥ threshold matches env success, as the RLinf client maps it "
    "(--success-threshold). <b>Best accuracy</b>: the same at the threshold that would do best on this log.</li>"
    "<li><b>False successes</b>: failed episodes the reward model would call a success: what a policy learns "
    "to exploit.</li><li>Parse failures (no readable score) and errors are shares of all episodes.</li>"
    "<li><b>Brier</b>: mean (score − success)², 0 is perfect. <b>Margin</b> of an invariance probe: original "
    "score − probe score, above 0 when the model notices the change.</li></ul>")


def render_report(out_dir: Path, logs: list[LogNumbers], pairs: list[dict[str, Any]], *, threshold: float,
                  store: Path | None) -> Path:
    names = " vs ".join(log.summary.path.name for log in logs)
    title = f"Reward quality: {names}"
    body = [alert("Look at this first:", alerts(logs, pairs)), f"<h1>{html.escape(title)}</h1>",
            f"<p>Threshold: score ≥ {threshold:g} counts as success. Frame store: "
            f"{html.escape(str(store)) if store else 'not given'}.</p>"]
    for log in logs:
        rows = [{"backend": b, "model": ", ".join(log.summary.models.get(b, {})) or "—", **summary_row(n)}
                for b, n in log.backends.items()]
        body.append(table(("backend", "model", *SUMMARY_KEYS), rows, caption=f"Summary — {log.name}"))
    if pairs:
        body.append(_compare_section(pairs))
    roc = roc_figure(logs, out_dir)
    if roc:
        body.append(f"<h2>ROC</h2><figure><figcaption>{roc[0]}</figcaption>{image_tag(roc[1], 'ROC curves')}</figure>")
    for log in logs:
        body.extend((alarms_section(log, out_dir), probes_section(log),
                     dense_section(log.dense, f" — {log.name}" if log.label else ""),
                     cascade_section(log.cascades, f" — {log.name}" if log.label else ""),
                     calibration_section(log, out_dir)))
    for log in logs:
        body.extend(_backend_section(log, backend, threshold, store, out_dir) for backend in log.backends)
    body.extend(progress_section(log.progress, log.name if log.label else "") for log in logs)
    body.append("<h2>Logs</h2>" + "".join(_health(log) for log in logs) + HOW_TO_READ)
    return write_page(out_dir / "report.html", title, "\n".join(body))
