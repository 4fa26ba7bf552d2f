"""`vlm-reward-proxy curves RUN_DIR...`: compare RLinf runs from their TensorBoard event files.

A RUN_DIR is RLinf's `runner.logger.log_path` (logs/<timestamp>-<config>), its `tensorboard/`
folder, or any folder holding `events.out.tfevents.*` files. A run is named after
`runner.logger.experiment_name` in the `config.yaml` RLinf writes beside the events (else the
folder's name). Every metric is drawn against the training step, raw (faint) and smoothed
(TensorBoard's debiased EMA), to one PNG and a self-contained HTML page with a summary table.
Runs A (native), B and C (a VLM's score) and D (SRPO progress, reward_source: progress) share the
panels; when a run logs env/vlm_no_reference (run D), a panel counts its failures that had no
reference (paid the native reward, not a progress) and a note says how many. Steps where a run
logs env/vlm_quality_alarm > 0 (the proxy's reward-quality monitor said the reward disagrees with
the simulator's success: the policy may be hacking it) are shaded in the run's colour on every
panel with curves, and listed on the console, in the figure's title and at the top of the page.

Needs tensorboard (to read events, no TensorFlow) and matplotlib, both imported lazily.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reports.plotting import MissingDependencyError, alert, image_tag, pyplot, save_figure, table, write_page

__all__ = ["ALARM_TAG", "DEFAULT_METRICS", "NO_REFERENCE_METRIC", "Run", "add_subcommand", "alarm_periods",
           "default_metrics", "fallback_warnings", "load_run", "no_reference_notes", "plot_runs",
           "quality_alarm_warnings", "shade_alarms", "smooth"]

FAILURES = "reward-model failures"
NO_REFERENCE = "failures without a reference"
# (tag, title); FAILURES is derived: env/vlm_fallback (a rate) x env/num_trajectories.
DEFAULT_METRICS: tuple[tuple[str, str], ...] = (
    ("env/success_once", "env/success_once: simulator success (ground truth)"),
    ("env/return", "env/return: episode return"),
    ("rollout/rewards", "rollout/rewards: reward the policy was trained on"),
    (FAILURES, "reward-model failures per step (rewards that are not the VLM's: reward_model.fallback)"),
)
# Run D (reward_source: progress): env/vlm_no_reference (a rate) x env/num_trajectories.
NO_REFERENCE_METRIC = (NO_REFERENCE, "failures without a reference per step (progress runs: paid the native "
                                     "reward, no progress)")
EVENT_GLOB = "events.out.tfevents.*"
# Derived count -> (RLinf's rate tag, a tag holding the count itself, if any)
COUNTS = {FAILURES: ("env/vlm_fallback", "reward_model/failures"), NO_REFERENCE: ("env/vlm_no_reference", None)}
ALARM_TAG = "env/vlm_quality_alarm"  # the share of a step's episodes whose answer said quality alarm


@dataclass
class Run:
    name: str
    path: Path
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # tag -> (step, value)

    def series(self, tag: str) -> list[tuple[int, float]]:
        if tag not in COUNTS:
            return self.scalars.get(tag, [])
        rate_tag, count_tag = COUNTS[tag]
        if count_tag in self.scalars:
            return self.scalars[count_tag]
        rate = dict(self.scalars.get(rate_tag, []))
        counts = dict(self.scalars.get("env/num_trajectories", []))
        if counts:
            return [(step, value * counts[step]) for step, value in sorted(rate.items()) if step in counts]
        return sorted(rate.items())

    def rate(self, tag: str) -> tuple[float, float] | None:
        """(mean, max) over steps of a rate RLinf logs (env/vlm_fallback: the share of episodes
        rewarded by the fallback; env/vlm_no_reference: failures without a reference); None when
        the run does not log it."""
        rates = [value for _, value in self.scalars.get(tag, [])]
        return (sum(rates) / len(rates), max(rates)) if rates else None


def _rate_lines(runs: Sequence[Run], tag: str, what: str) -> list[str]:
    lines = []
    for run in runs:
        rate = run.rate(tag)
        if rate is not None and rate[1] > 0:
            lines.append(f"{run.name}: {rate[0]:.1%} of episodes (up to {rate[1]:.1%} in one step) {what}")
    return lines


def fallback_warnings(runs: Sequence[Run]) -> list[str]:
    """One line per run whose rewards were not all the VLM's: impossible to miss in every output."""
    return _rate_lines(runs, "env/vlm_fallback", "were rewarded by the fallback, not the VLM")


def no_reference_notes(runs: Sequence[Run]) -> list[str]:
    """One line per progress run (run D) whose failures sometimes had no reference: those episodes
    were paid run A's reward (0), not a progress, so D looks more like A the higher the share."""
    return _rate_lines(runs, "env/vlm_no_reference",
                       "failed with no reference and were paid the native reward, not a progress")


def alarm_periods(run: Run) -> list[tuple[int, int]]:
    """(first step, last step) of each stretch of logged steps whose env/vlm_quality_alarm is > 0;
    neighbouring logged steps join one stretch, whatever the logging interval."""
    periods: list[list[int]] = []
    alarmed = False  # the previous logged step's
    for step, value in run.scalars.get(ALARM_TAG, []):
        if value > 0 and alarmed:
            periods[-1][1] = step
        elif value > 0:
            periods.append([step, step])
        alarmed = value > 0
    return [(first, last) for first, last in periods]


def quality_alarm_warnings(runs: Sequence[Run]) -> list[str]:
    """One line per run with quality alarms: its alarmed steps and the highest alarmed share."""
    lines = []
    for run in runs:
        periods = alarm_periods(run)
        if periods:
            steps = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in periods)
            peak = max(value for _, value in run.scalars[ALARM_TAG])
            lines.append(f"{run.name}: reward-quality alarm at steps {steps} (up to {peak:.1%} of one step's episodes)")
    return lines


def shade_alarms(axis: Any, runs: Sequence[Run], colours: Sequence[str]) -> None:
    """Shade each run's alarmed steps (half a step either side) in its colour, labelled once."""
    for number, run in enumerate(runs):
        for index, (first, last) in enumerate(alarm_periods(run)):
            axis.axvspan(first - 0.5, last + 0.5, color=colours[number % len(colours)], alpha=0.15, linewidth=0,
                         label=f"{run.name}: quality alarm" if index == 0 else None)


def default_metrics(runs: Sequence[Run]) -> list[tuple[str, str]]:
    """The default panels, and the no-reference panel when some run pays progress (run D)."""
    metrics = list(DEFAULT_METRICS)
    if any(run.rate("env/vlm_no_reference") is not None for run in runs):
        metrics.append(NO_REFERENCE_METRIC)
    return metrics


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    smoothed, last, seen = [], 0.0, 0
    for value in values:
        if not math.isfinite(value):
            smoothed.append(value)
            continue
        seen += 1
        last = last * weight + (1 - weight) * value
        smoothed.append(last / (1 - weight ** seen) if weight > 0 else value)
    return smoothed


# -- reading ---------------------------------------------------------------------------------------
def _event_files(run_dir: Path) -> list[Path]:
    files = [p for p in run_dir.rglob(EVENT_GLOB) if "worker_logs" not in p.parts]
    return sorted(files, key=lambda p: (str(p.parent), p.name))


def _run_name(run_dir: Path, files: list[Path]) -> str:
    candidates = [f.parent / "config.yaml" for f in files] + [
        run_dir / "tensorboard" / "config.yaml", run_dir / "config.yaml"]
    for path in candidates:
        if path.is_file():
            try:
                import yaml

                config = yaml.safe_load(path.read_text()) or {}
                name = config["runner"]["logger"]["experiment_name"]
            except Exception:  # noqa: BLE001 - an unreadable config only costs the pretty name
                continue
            if name:
                return str(name)
    return run_dir.resolve().name


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Every scalar in a run's event files; a later event for the same step (a resumed run)
    replaces the earlier one."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError as err:
        raise MissingDependencyError("`curves` reads TensorBoard event files with the tensorboard "
                                     "package: pip install tensorboard matplotlib") from err
    run_dir = Path(run_dir)
    files = _event_files(run_dir)
    if not files:
        raise FileNotFoundError(f"{run_dir}: no {EVENT_GLOB} files under it")
    points: dict[str, dict[int, tuple[float, float]]] = {}  # tag -> step -> (wall_time, value)
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                if value.HasField("simple_value"):  # torch's SummaryWriter (what RLinf uses)
                    number = float(value.simple_value)
                elif value.HasField("tensor"):  # tensorboard's own Writer
                    array = tensor_util.make_ndarray(value.tensor)
                    if array.size != 1 or array.dtype.kind not in "fiub":
                        continue
                    number = float(array.reshape(()))
                else:
                    continue
                by_step = points.setdefault(value.tag, {})
                previous = by_step.get(event.step)
                if previous is None or event.wall_time >= previous[0]:
                    by_step[event.step] = (event.wall_time, number)
    scalars = {tag: [(step, v) for step, (_, v) in sorted(steps.items())] for tag, steps in points.items()}
    return Run(name or _run_name(run_dir, files), run_dir, scalars)


# -- drawing ---------------------------------------------------------------------------------------
def plot_runs(runs: list[Run], metrics: Sequence[tuple[str, str]], out_dir: str | Path, *,
              smoothing: float = 0.6, title: str | None = None) -> tuple[Path, Path]:
    """Write curves.png and curves.html under `out_dir`; returns their paths."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ", ".join(r.name for r in runs)
    title = title or f"RLinf runs: {names}"
    columns = 2 if len(metrics) > 1 else 1
    rows = math.ceil(len(metrics) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4.2 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    summary: list[dict[str, Any]] = []
    for axis, (tag, label) in zip(axes.flat, metrics, strict=False):
        drawn = False
        for number, run in enumerate(runs):
            series = run.series(tag)
            if not series:
                continue
            steps = [s for s, _ in series]
            values = [v for _, v in series]
            smoothed = smooth(values, smoothing)
            colour = colours[number % len(colours)]
            axis.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
            axis.plot(steps, smoothed, color=colour, linewidth=2, label=run.name)
            drawn = True
            summary.append({"metric": tag, "run": run.name, "points": len(values),
                            "last_step": steps[-1], "last": values[-1],
                            "last_smoothed": smoothed[-1], "max_smoothed": max(smoothed)})
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
        if drawn:
            shade_alarms(axis, runs, colours)
            axis.legend(fontsize=8)
        else:
            axis.text(0.5, 0.5, f"no run logs {tag}", ha="center", va="center",
                      transform=axis.transAxes, color="grey")
    for axis in list(axes.flat)[len(metrics):]:
        axis.set_visible(False)
    warnings, alarms = fallback_warnings(runs), quality_alarm_warnings(runs)
    # In red, above everything: the comparison is not VLM vs VLM (fallbacks), or the reward may be hacked (alarms).
    red = ([f"FALLBACK REWARDS — {'; '.join(warnings)}"] if warnings else []) + \
        ([f"QUALITY ALARMS (shaded) — {'; '.join(alarms)}"] if alarms else [])
    if red:
        figure.suptitle("\n".join(red), fontsize=11, color="red", fontweight="bold")
    else:
        figure.suptitle(f"{title}  (faint: raw, solid: smoothed {smoothing:g})", fontsize=11)
    figure.tight_layout()
    description = (f"runs: {names}" + ("; FALLBACK REWARDS: " + "; ".join(warnings) if warnings else "")
                   + ("; QUALITY ALARMS: " + "; ".join(alarms) if alarms else ""))
    png_path = out_dir / "curves.png"
    png = save_figure(figure, png_path, title=title, description=description)
    return png_path, write_page(out_dir / "curves.html", title, _html_body(title, runs, summary, png))


def _html_body(title: str, runs: list[Run], summary: list[dict[str, Any]], png: bytes) -> str:
    banner = alert("Fallback rewards:", fallback_warnings(runs),
                   "These episodes were not rewarded by the VLM; compare runs only where the rate is 0, "
                   "or with that in mind.")
    banner += alert("Reward-quality alarms:", quality_alarm_warnings(runs),
                    "In these steps (shaded on the curves) the proxy found the reward disagreeing with the "
                    "simulator's success beyond its bound: the policy may be hacking the reward.")
    notes = no_reference_notes(runs)
    if notes:  # by design (on_no_reference: native), yet the reward there is run A's
        banner += ('<div class="note"><strong>Progress without a reference:</strong><ul>'
                   + "".join(f"<li>{html.escape(line)}</li>" for line in notes) + "</ul></div>")
    keys = ("metric", "run", "points", "last_step", "last", "last_smoothed", "max_smoothed")
    body = (f"{banner}<h1>{html.escape(title)}</h1>\n<h2>Runs</h2>"
            + table(("run", "directory"), ({"run": r.name, "directory": str(r.path)} for r in runs))
            + image_tag(png, f"curves of {', '.join(r.name for r in runs)}")
            + "<h2>Summary</h2>" + table(keys, summary)
            + "<p>env/success_once is the simulator's ground truth, the fair curve to compare runs on. "
              "Reward-model failures = env/vlm_fallback (a rate) x env/num_trajectories; failures without a "
              "reference (progress runs) = env/vlm_no_reference x env/num_trajectories. Shaded steps: "
              "env/vlm_quality_alarm > 0 (the proxy's reward-quality alarm), in the run's colour.</p>")
    return body


# -- command line ----------------------------------------------------------------------------------
def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "curves", help="compare RLinf runs' TensorBoard curves (PNG + HTML)",
        description="Plot env/success_once, env/return, rollout/rewards and the reward-model "
                    "failure count against the training step for each RLinf run, raw and "
                    "smoothed, to curves.png and a self-contained curves.html.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="an RLinf log_path (logs/<timestamp>-<config>) or a folder of event files")
    parser.add_argument("--out", default="curves", metavar="DIR", help="output folder (default: ./curves)")
    parser.add_argument("--name", action="append", default=None, metavar="NAME",
                        help="display name per RUN_DIR, in order (default: runner.logger."
                             "experiment_name from config.yaml, else the folder name)")
    parser.add_argument("--metric", action="append", default=None, metavar="TAG",
                        help=f"a tag to plot, repeatable (default: {', '.join(t for t, _ in DEFAULT_METRICS)})")
    parser.add_argument("--smoothing", type=float, default=0.6, metavar="W",
                        help="TensorBoard-style smoothing weight in [0, 1) (default: 0.6)")
    parser.add_argument("--title", default=None, metavar="TEXT", help="figure title")
    parser.set_defaults(func=run_command)
    return parser


def run_command(args: argparse.Namespace) -> int:
    if not 0 <= args.smoothing < 1:
        print("error: --smoothing must be in [0, 1)", file=sys.stderr)
        return 2
    names = args.name or []
    if len(names) > len(args.run_dirs):
        print("error: more --name than RUN_DIRs", file=sys.stderr)
        return 2
    try:
        runs = [load_run(d, names[i] if i < len(names) else None) for i, d in enumerate(args.run_dirs)]
    except (FileNotFoundError, MissingDependencyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    metrics = [(tag, tag) for tag in args.metric] if args.metric else default_metrics(runs)
    try:
        png, page = plot_runs(runs, metrics, args.out, smoothing=args.smoothing, title=args.title)
    except MissingDependencyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for run in runs:
        missing = [tag for tag, _ in metrics if not run.series(tag)]
        if missing:
            print(f"note: {run.name} has no {', '.join(missing)}")
    for note in no_reference_notes(runs):
        print(f"note: {note}")
    for warning in fallback_warnings(runs) + quality_alarm_warnings(runs):
        print(f"WARNING: {warning}", file=sys.stderr)
    print(f"wrote {png} and {page}")
    return 0
