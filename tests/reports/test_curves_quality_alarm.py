"""`curves` with env/vlm_quality_alarm: the alarmed steps shaded and listed."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from reports.curves import alarm_periods, load_run, shade_alarms  # noqa: E402
from reports.plotting import pyplot  # noqa: E402
from tests.reports.test_curves import NAMES, curve, make_run_dirs, run_curves, write_config, write_simple_values  # noqa: E402

RUN_B2 = "libero_10_grpo_openvlaoft_runB2_qwen"
# alarmed at steps 5-7 (up to half of one step's episodes) and 18, as RLinf logs the mean over episodes
ALARM = [0.0] * 5 + [0.25, 0.5, 0.125] + [0.0] * 10 + [0.0625] + [0.0] * 11
LINE = f"{RUN_B2}: reward-quality alarm at steps 5-7, 18 (up to 50.0% of one step's episodes)"


def write_run(tmp_path: Path, alarm: list[float] | None) -> Path:
    tensorboard_dir = tmp_path / "logs" / f"20260101-00:04:00-{RUN_B2}" / "tensorboard"
    tensorboard_dir.mkdir(parents=True)
    write_config(tensorboard_dir, RUN_B2)
    scalars = {"env/success_once": curve(0.2, 0.4), "env/return": curve(1.0, 4.5), "rollout/rewards": curve(0.01, 0.05),
               "env/vlm_fallback": [0.0] * 30, "env/num_trajectories": [1024.0] * 30}
    write_simple_values(tensorboard_dir, {**scalars, **({"env/vlm_quality_alarm": alarm} if alarm else {})})
    return tensorboard_dir.parent


@pytest.fixture
def run_a_and_b2(tmp_path: Path) -> list[Path]:
    return [make_run_dirs(tmp_path)[0], write_run(tmp_path, ALARM)]


def test_alarm_periods_are_the_stretches_of_steps_with_alarms(run_a_and_b2):
    run_a, run_b2 = (load_run(d) for d in run_a_and_b2)
    assert alarm_periods(run_b2) == [(5, 7), (18, 18)]
    assert alarm_periods(run_a) == []


def test_each_runs_alarmed_steps_are_shaded_in_its_colour(run_a_and_b2):
    plt = pyplot()
    runs = [load_run(d) for d in run_a_and_b2]
    figure, axis = plt.subplots()
    try:
        shade_alarms(axis, runs, ["tab:blue", "tab:orange"])
        spans = [(p.get_x(), p.get_x() + p.get_width(), p.get_facecolor()) for p in axis.patches]
        labels = axis.get_legend_handles_labels()[1]
    finally:
        plt.close(figure)
    orange = (*plt.matplotlib.colors.to_rgb("tab:orange"), 0.15)
    assert spans == [(4.5, 7.5, pytest.approx(orange)), (17.5, 18.5, pytest.approx(orange))]
    assert labels == [f"{RUN_B2}: quality alarm"]  # once per run, not per stretch


def shaded_pixels(png: Path, colour: str) -> int:
    """Pixels of `colour` at the shading's alpha over the white background."""
    rgb = np.array(pyplot().matplotlib.colors.to_rgb(colour)) * 255
    expected = 0.15 * rgb + 0.85 * 255
    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=float)
    return int((np.abs(pixels - expected).max(axis=-1) <= 2).sum())


def test_the_figure_page_and_console_show_the_alarms(run_a_and_b2, tmp_path, capsys):
    out, quiet = tmp_path / "out", tmp_path / "quiet"
    assert run_curves([str(d) for d in run_a_and_b2] + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"WARNING: {LINE}" in err and NAMES[0] not in err  # run A logs no alarms
    page = (out / "curves.html").read_text(encoding="utf-8")
    banner = page[page.index("<body>"):page.index("<h1>")]
    assert "Reward-quality alarms:" in banner and html.escape(LINE) in banner
    with Image.open(out / "curves.png") as image:
        assert f"QUALITY ALARMS: {LINE}" in image.text["Description"]
    # The same runs without the tag: no shading in run B2's colour, no warning.
    assert run_curves([str(run_a_and_b2[0]), str(write_run(tmp_path / "no_alarm", None)), "--out", str(quiet)]) == 0
    assert "reward-quality alarm" not in capsys.readouterr().err
    orange = pyplot().rcParams["axes.prop_cycle"].by_key()["color"][1]  # the second run's colour
    shaded, unshaded = shaded_pixels(out / "curves.png", orange), shaded_pixels(quiet / "curves.png", orange)
    assert shaded > 2000 and shaded > 20 * unshaded, (shaded, unshaded)
