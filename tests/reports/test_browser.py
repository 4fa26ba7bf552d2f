"""The report and the curves page, opened in headless Chromium as a person would: the page
renders (not blank), the key numbers are in the DOM the browser built, the alert box is on top."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from tests.reports.browser import assert_not_blank, chromium, dom_text, screenshot  # noqa: E402
from tests.reports.expected import auc_by_pairs, correct_at  # noqa: E402
from tests.reports.graded import BACKENDS  # noqa: E402

ALERT_BACKGROUND = (255, 221, 221)  # .alert in reports/plotting.py: #fdd


def _alert_rows(png) -> int:
    """How many of the top 400 pixel rows show the alert box's background."""
    with Image.open(png) as image:
        rgb = image.convert("RGB")
    return sum(any(rgb.getpixel((x, y)) == ALERT_BACKGROUND for x in range(0, rgb.width, 16)) for y in range(400))


@pytest.fixture
def browser() -> str:
    return chromium()  # skips (or fails under VLM_REQUIRE_BROWSER=1) before anything is built


def test_the_report_reads_in_a_browser(browser, graded, tmp_path):
    from vlm_reward_cli import main

    out = tmp_path / "report"
    assert main(["report", str(graded.audit), "--out", str(out), "--frame-store", str(graded.store),
                 "--worst", "2"]) == 0
    shot = screenshot(out / "report.html", tmp_path / "report.png")
    seen = assert_not_blank(shot)
    assert seen["size"] == (1280, 2000) and _alert_rows(shot) > 40, seen
    text = dom_text(out / "report.html")
    assert "Reward quality: audit.jsonl" in text and "Look at this first:" in text
    for backend in BACKENDS:
        scores, truth = graded.graded(backend)
        correct = correct_at(scores, truth, 0.5)
        assert f"{auc_by_pairs(scores, truth):.3f}" in text
        assert f"{correct / len(scores):.1%} ({correct}/{len(scores)})" in text
        assert f"{backend} #1: episode" in text


def test_the_curves_page_reads_in_a_browser(browser, tmp_path):
    pytest.importorskip("tensorboard")
    from tests.reports.test_curves import NAMES, make_run_dirs, run_curves

    out = tmp_path / "curves"
    assert run_curves([str(d) for d in make_run_dirs(tmp_path)] + ["--out", str(out)]) == 0
    shot = screenshot(out / "curves.html", tmp_path / "curves.png")
    assert_not_blank(shot)
    assert _alert_rows(shot) > 40  # run B's fallback rewards, in red, on top
    text = dom_text(out / "curves.html")
    assert all(name in text for name in NAMES)
    assert "runB_qwen: 0.8% of episodes (up to 25.0% in one step)" in text and "env/success_once" in text


def test_no_browser_skips_unless_it_is_required(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find there
    monkeypatch.delenv("VLM_REQUIRE_BROWSER", raising=False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium is not installed"):
        chromium()
    monkeypatch.setenv("VLM_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="VLM_REQUIRE_BROWSER=1 but chromium is not installed"):
        chromium()


def test_no_browser_fails_in_ci(monkeypatch, tmp_path):
    """CI (`CI=true`, as GitHub Actions and .ci/run set it) never skips the page check."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("VLM_REQUIRE_BROWSER", raising=False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but chromium is not installed"):
        chromium()
