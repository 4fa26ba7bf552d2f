"""`vlm-reward-proxy eval`'s numbers and page: which reward method to train with, decided on a set
of episodes with known outcomes before any GPU-day is spent (the collection: vlm_reward_cli/evaluate.py).

Per method (a backend: its template, layout and estimator) and per task, from one record per
episode and control:

    auc           ROC-AUC of the episode score against success (vlm_protocol.agreement.roc_auc)
    voc           mean VOC of the successful episodes' dense curves: should be near 1
    voc_reversed  the same episodes reversed: should fall to 0 or below
    voc_shuffled  the same episodes' frames shuffled: should fall to about 0
    instruction   the mean drop of a successful episode's score under another task's instruction
                  (above 0 when the model reads the instruction), and the share that dropped
    cost          upstream calls, prompt and completion tokens, and seconds, per episode

A method "ranks first" on a number when it is the best there (AUC, VOC, instruction drop: highest;
the controls' VOC and the cost: lowest). A cascade's frontier is its own section of the page
(reports/cascade_frontier.py). Pure: records in, numbers and HTML out.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reports.cascade_frontier import frontier_section
from reports.plotting import fmt, table, write_page
from vlm_protocol.agreement import roc_auc, voc

__all__ = ["CONTROLS", "method_numbers", "rank", "render_eval"]

CONTROLS = ("reversed", "shuffled", "instruction")
ALL_TASKS = "all tasks"
# number → True when higher is better (which method "ranks first")
RANKED = {"auc": True, "voc": True, "voc_reversed": False, "voc_shuffled": False, "instruction_drop": True,
          "seconds_per_episode": False, "prompt_tokens_per_episode": False}


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _numbers(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's numbers over these records (its originals and their controls)."""
    original = [r for r in records if r["control"] is None]
    scored = [r for r in original if r.get("score") is not None]
    by_episode = {r["episode"]: r for r in scored}
    successes = [r for r in scored if r["success"]]

    def control_voc(kind: str) -> float | None:
        return _mean([value for r in records if r["control"] == kind and by_episode.get(r["episode"], {}).get("success")
                      and (value := voc(r["curve"] or [])) is not None])

    drops = [by_episode[r["episode"]]["score"] - r["score"] for r in records
             if r["control"] == "instruction" and r.get("score") is not None
             and by_episode.get(r["episode"], {}).get("success")]
    spent = [r for r in records if r.get("cost")]  # failed calls' seconds included
    episodes = max(len(original), 1)
    return {
        "episodes": len(original), "scored": len(scored), "failed": len(original) - len(scored),
        "successes": len(successes),
        "auc": roc_auc([r["score"] for r in scored], [r["success"] for r in scored]),
        "voc": _mean([value for r in successes if (value := voc(r["curve"] or [])) is not None]),
        "voc_reversed": control_voc("reversed"), "voc_shuffled": control_voc("shuffled"),
        "instruction_drop": _mean(drops), "instruction_dropped": (sum(d > 0 for d in drops) / len(drops)
                                                                  if drops else None),
        "calls_per_episode": sum(r["cost"]["calls"] for r in spent) / episodes,
        "prompt_tokens_per_episode": sum(r["cost"]["prompt_tokens"] for r in spent) / episodes,
        "completion_tokens_per_episode": sum(r["cost"]["completion_tokens"] for r in spent) / episodes,
        "seconds_per_episode": sum(r["cost"]["seconds"] for r in spent) / episodes,
        "errors": sorted({r["error"] for r in records if r.get("error")}),  # any: the method is not ranked
    }


def method_numbers(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """method → task (ALL_TASKS first) → numbers."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method in sorted({r["method"] for r in records}):
        mine = [r for r in records if r["method"] == method]
        tasks = sorted({str(r["task_id"]) for r in mine})
        out[method] = {ALL_TASKS: _numbers(mine), **{t: _numbers([r for r in mine if str(r["task_id"]) == t])
                                                    for t in tasks}}
    return out


def rank(numbers: dict[str, dict[str, dict[str, Any]]], task: str = ALL_TASKS) -> dict[str, str | None]:
    """number → the method that is best on it (None when no method has it). A method with a failed
    call is not ranked: its numbers rest on the episodes it could score, and failing is not cheap."""
    best: dict[str, str | None] = {}
    for key, higher in RANKED.items():
        have = [(n[task][key], m) for m, n in numbers.items()
                if task in n and n[task][key] is not None and not n[task]["errors"]]
        best[key] = (max(have) if higher else min(have))[1] if have else None
    return best


KEYS = ("method", "task", "episodes", "successes", "AUC", "VOC (successes)", "VOC reversed", "VOC shuffled",
        "instruction drop", "calls / ep", "prompt tokens / ep", "s / ep", "failed")


def _row(method: str, task: str, n: dict[str, Any], first: dict[str, str | None]) -> dict[str, str]:
    def mark(key: str, text: str) -> str:
        return f"{text} ★" if first.get(key) == method and task == ALL_TASKS else text
    return {"method": method, "task": task, "episodes": fmt(n["episodes"], "int"),
            "successes": fmt(n["successes"], "int"),
            "AUC": mark("auc", fmt(n["auc"], "3")), "VOC (successes)": mark("voc", fmt(n["voc"], "3")),
            "VOC reversed": mark("voc_reversed", fmt(n["voc_reversed"], "3")),
            "VOC shuffled": mark("voc_shuffled", fmt(n["voc_shuffled"], "3")),
            "instruction drop": mark("instruction_drop", fmt(n["instruction_drop"], "3")),
            "calls / ep": fmt(n["calls_per_episode"], "g"),
            "prompt tokens / ep": mark("prompt_tokens_per_episode", fmt(round(n["prompt_tokens_per_episode"]), "int")),
            "s / ep": mark("seconds_per_episode", fmt(round(n["seconds_per_episode"], 3), "g")),
            "failed": fmt(n["failed"], "int")}


def render_eval(out: Path, result: dict[str, Any]) -> Path:
    """eval.html: the methods' table (when any backend was named) and each cascade's frontier."""
    numbers, first = result["methods"], result["ranks_first"]
    cascades = result.get("cascades") or {}
    frontiers = "".join(frontier_section(name, f) if f.get("policies") else
                        f"<h2>Cascade {html.escape(name)}</h2><p>No episode was scored by every stage.</p>"
                        for name, f in cascades.items())
    if not numbers:
        body = (f"<h1>Reward methods on {html.escape(result['episodes_source'])}</h1>"
                f"<p>{result['episodes']} episodes ({result['successes']} successes).</p>" + frontiers)
        return write_page(out / "eval.html", "Reward methods", body)
    lines = [f"<li><b>{html.escape(key)}</b>: {html.escape(method or '—')}</li>" for key, method in first.items()]
    rows = [_row(m, t, n, first) for m, tasks in numbers.items() for t, n in tasks.items()]
    body = (f"<h1>Reward methods on {html.escape(result['episodes_source'])}</h1>"
            f"<p>{result['episodes']} episodes ({result['successes']} successes), "
            f"{len(numbers)} method(s), controls: {html.escape(', '.join(result['controls']) or 'none')}, "
            f"{result['points']} points per curve.</p>"
            "<h2>Which method ranks first</h2><ul>" + "".join(lines) + "</ul>"
            + table(KEYS, rows, caption="Per method and task (★: first over all tasks)")
            + "<h2>How to read it</h2><ul>"
            "<li><b>AUC</b>: the chance a success scores above a failure (0.5: chance).</li>"
            "<li><b>VOC</b>: the rank correlation of a successful episode's dense curve with time (1: rises "
            "throughout). On the same episodes <b>reversed</b> it should fall to 0 or below, and "
            "<b>shuffled</b> to about 0: a method whose controls keep a high VOC does not read progress from "
            "the frames.</li>"
            "<li><b>instruction drop</b>: how much a success's score falls under another task's instruction "
            "(above 0: the model reads the instruction).</li>"
            "<li><b>cost</b>: upstream calls, prompt tokens and seconds per episode, controls included.</li>"
            "<li>A method with a failed call is not ranked (★): its numbers rest on the episodes it scored.</li></ul>"
            + frontiers)
    return write_page(out / "eval.html", "Reward methods", body)
