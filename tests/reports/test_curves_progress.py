"""`curves` with run D (reward_source: progress) beside A, B and C."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from reports.curves import DEFAULT_METRICS, NO_REFERENCE_METRIC, default_metrics, load_run  # noqa: E402
from tests.reports.test_curves import curve, make_run_dirs, run_curves, write_config, write_simple_values  # noqa: E402

RUN_D = "libero_10_grpo_openvlaoft_runD_srpo"
# run D: 10% of episodes failed without a reference in the first 10 steps, none after
NO_REFERENCE = [0.1] * 10 + [0.0] * 20


@pytest.fixture
def runs_abcd(tmp_path: Path) -> list[Path]:
    dirs = make_run_dirs(tmp_path)
    tensorboard_dir = tmp_path / "logs" / f"20260101-00:03:00-{RUN_D}" / "tensorboard"
    tensorboard_dir.mkdir(parents=True)
    write_config(tensorboard_dir, RUN_D)
    write_simple_values(tensorboard_dir, {
        "env/success_once": curve(0.2, 0.75), "env/return": curve(1.5, 4.0), "rollout/rewards": curve(0.02, 0.05),
        "env/vlm_score": curve(0.4, 0.8), "env/vlm_fallback": [0.0] * 30, "env/vlm_no_reference": NO_REFERENCE,
        "env/num_trajectories": [1024.0] * 30})
    return [*dirs, tensorboard_dir.parent]


def test_run_d_counts_its_failures_without_a_reference(runs_abcd):
    run_d = load_run(runs_abcd[3])
    assert run_d.name == RUN_D
    series = run_d.series(NO_REFERENCE_METRIC[0])
    assert series[0] == (0, pytest.approx(102.4)) and series[-1] == (29, 0.0)  # rate x trajectories
    assert run_d.rate("env/vlm_no_reference") == (pytest.approx(1 / 30), pytest.approx(0.1))
    runs = [load_run(d) for d in runs_abcd]
    assert default_metrics(runs) == [*DEFAULT_METRICS, NO_REFERENCE_METRIC]
    assert default_metrics(runs[:3]) == list(DEFAULT_METRICS)  # A/B/C alone: no such panel


def test_the_page_and_the_console_say_how_many_failures_had_no_reference(runs_abcd, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_curves([str(d) for d in runs_abcd] + ["--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert (f"note: {RUN_D}: 3.3% of episodes (up to 10.0% in one step) failed with no reference and were paid "
            "the native reward, not a progress") in captured.out
    assert RUN_D not in captured.err  # not a fallback: only run B is warned about
    assert "runB_qwen: 0.8% of episodes" in captured.err
    page = (out / "curves.html").read_text(encoding="utf-8")
    banner = page[page.index("<body>"):page.index("<h1>")]
    assert "Progress without a reference" in banner and f"{RUN_D}: 3.3% of episodes" in banner
    summary = page[page.index("<h2>Summary</h2>"):]
    assert f"<td>{NO_REFERENCE_METRIC[0]}</td><td>{RUN_D}</td>" in summary
    with Image.open(out / "curves.png") as image:
        assert RUN_D in image.text["Description"]


def test_without_run_d_there_is_no_no_reference_note(runs_abcd, tmp_path, capsys):
    out = tmp_path / "abc"
    assert run_curves([str(d) for d in runs_abcd[:3]] + ["--out", str(out)]) == 0
    assert "no reference" not in capsys.readouterr().out
    page = (out / "curves.html").read_text(encoding="utf-8")
    assert "Progress without a reference" not in page
    assert f"<td>{NO_REFERENCE_METRIC[0]}</td>" not in page
