"""`curves` on synthetic RLinf logs written with TensorBoard's own writers."""

from __future__ import annotations

import argparse
import base64
import html.parser
import math
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402
from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: E402
from tensorboard.summary import Writer  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402

from reports.curves import add_subcommand, load_run, smooth  # noqa: E402

NAMES = ("libero_10_grpo_openvlaoft_runA", "libero_10_grpo_openvlaoft_runB_qwen",
         "libero_10_grpo_openvlaoft_runC_primo")


def write_config(tensorboard_dir: Path, name: str) -> None:
    (tensorboard_dir / "config.yaml").write_text(
        f"runner:\n  logger:\n    experiment_name: {name}\n    log_path: {tensorboard_dir.parent}\n")


def write_simple_values(directory: Path, points: dict[str, list[float]], first_step: int = 0,
                        wall_time: float | None = None) -> None:
    """Old-style scalar summaries, as torch's SummaryWriter (RLinf's logger) writes them."""
    writer = EventFileWriter(str(directory))
    try:
        for tag, values in points.items():
            for offset, value in enumerate(values):
                summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
                writer.add_event(event_pb2.Event(wall_time=wall_time or time.time(),
                                                 step=first_step + offset, summary=summary))
    finally:
        writer.close()


def write_tensor_scalars(directory: Path, points: dict[str, list[float]]) -> None:
    """tensorboard.summary.Writer's tensor-based scalars."""
    writer = Writer(str(directory))
    try:
        for tag, values in points.items():
            for step, value in enumerate(values):
                writer.add_scalar(tag, value, step)
    finally:
        writer.close()


def curve(start: float, end: float, steps: int = 30) -> list[float]:
    return [start + (end - start) * (1 - math.exp(-4 * s / steps)) + 0.03 * math.sin(s) for s in range(steps)]


@pytest.fixture
def run_dirs(tmp_path: Path) -> list[Path]:
    return make_run_dirs(tmp_path)


def make_run_dirs(tmp_path: Path) -> list[Path]:
    """Three RLinf runs' logs: A (simple values), B (tensor scalars, fallbacks), C (resumed)."""
    dirs = []
    for index, name in enumerate(NAMES):
        tensorboard_dir = tmp_path / "logs" / f"20260101-00:0{index}:00-{name}" / "tensorboard"
        tensorboard_dir.mkdir(parents=True)
        write_config(tensorboard_dir, name)
        dirs.append(tensorboard_dir.parent)
    metrics = {"env/success_once": curve(0.2, 0.7), "env/return": curve(1.0, 3.5),
               "rollout/rewards": curve(0.01, 0.04), "env/episode_len": curve(500, 300)}
    write_simple_values(dirs[0] / "tensorboard", metrics)
    vlm = {**metrics, "env/success_once": curve(0.2, 0.6), "env/vlm_fallback": [0.0] * 29 + [0.25],
           "env/num_trajectories": [1024.0] * 30, "env/vlm_score": curve(0.3, 0.6)}
    write_tensor_scalars(dirs[1] / "tensorboard", vlm)
    # Run C was resumed: a second event file repeats step 9 with a newer value.
    write_simple_values(dirs[2] / "tensorboard", {"env/success_once": curve(0.2, 0.5, 10)},
                        wall_time=1000.0)
    write_simple_values(dirs[2] / "tensorboard", {"env/success_once": [0.99] + curve(0.5, 0.8, 20)},
                        first_step=9, wall_time=2000.0)
    return dirs


def run_curves(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["curves", *argv])
    return args.func(args)


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.text: list[str] = []
        self.open_tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag not in ("meta", "img"):
            self.open_tags.append(tag)

    def handle_endtag(self, tag):
        assert self.open_tags and self.open_tags.pop() == tag, f"unbalanced </{tag}>"

    def handle_data(self, data):
        self.text.append(data)


def test_curves_write_a_png_and_an_html_page_naming_the_runs(run_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_curves([str(d) for d in run_dirs] + ["--out", str(out)]) == 0
    png, page = out / "curves.png", out / "curves.html"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        assert image.size[0] > 800
        description = image.text["Description"]
    assert all(name in description for name in NAMES)

    parser = _Page()
    parser.feed(page.read_text(encoding="utf-8"))
    parser.close()
    assert parser.open_tags == [] and len(parser.images) == 1
    assert base64.b64decode(parser.images[0].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    text = " ".join(parser.text)
    assert all(name in text for name in NAMES)
    assert "env/success_once" in text and "reward-model failures" in text
    assert "note: libero_10_grpo_openvlaoft_runC_primo has no env/return" in capsys.readouterr().out


def test_runs_read_both_scalar_formats_and_resumed_files(run_dirs):
    run_a, run_b, run_c = (load_run(d) for d in run_dirs)
    assert (run_a.name, run_b.name, run_c.name) == NAMES
    assert len(run_a.series("env/success_once")) == 30 and len(run_b.series("env/return")) == 30
    assert run_b.series("reward-model failures")[-1] == (29, 256.0)  # rate x trajectories
    assert run_a.series("reward-model failures") == []
    steps = dict(run_c.series("env/success_once"))
    assert len(steps) == 30 and steps[9] == pytest.approx(0.99)  # the newer event wins


def test_names_and_metrics_from_the_command_line(run_dirs, tmp_path):
    out = tmp_path / "named"
    assert run_curves([str(run_dirs[0]), str(run_dirs[1]), "--out", str(out), "--name", "A",
                       "--name", "B", "--metric", "env/episode_len", "--smoothing", "0.9"]) == 0
    with Image.open(out / "curves.png") as image:
        assert image.text["Description"] .startswith("runs: A, B")


def test_a_folder_without_event_files_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert run_curves([str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no events.out.tfevents" in capsys.readouterr().err


def test_smoothing_is_tensorboards_debiased_ema():
    assert smooth([1.0, 1.0, 1.0], 0.6) == pytest.approx([1.0, 1.0, 1.0])
    assert smooth([0.0, 10.0], 0.5) == pytest.approx([0.0, 5.0 / 0.75])
    assert smooth([3.0, 4.0], 0.0) == [3.0, 4.0]


def test_the_command_line_registers_curves():
    from vlm_reward_cli import build_parser

    args = build_parser().parse_args(["curves", "some/run", "--out", "x"])
    assert args.run_dirs == ["some/run"] and callable(args.func)


def test_a_nonzero_fallback_rate_is_impossible_to_miss(run_dirs, tmp_path, capsys):
    """Run B fell back on 25% of one step's episodes: the console, the figure's title and the top
    of the page all say so, in words (and in red)."""
    out = tmp_path / "out"
    assert run_curves([str(d) for d in run_dirs] + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "WARNING: libero_10_grpo_openvlaoft_runB_qwen: 0.8% of episodes (up to 25.0% in one step)" in err
    assert "runA" not in err and "runC" not in err  # runs without fallbacks are not flagged
    page = (out / "curves.html").read_text(encoding="utf-8")
    banner = page[page.index("<body>"):page.index("<h1>")]
    assert 'class="alert" role="alert"' in banner and "runB_qwen: 0.8% of episodes" in banner
    with Image.open(out / "curves.png") as image:  # the figure's red title says it too
        assert "FALLBACK REWARDS: libero_10_grpo_openvlaoft_runB_qwen: 0.8%" in image.text["Description"]
