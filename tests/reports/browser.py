"""Debian's chromium, headless, started by the test: a screenshot of a page and its DOM as the
browser built it. Skips when chromium is absent, unless VLM_REQUIRE_BROWSER=1 or CI=true (then fails).

Each run gets its own throwaway profile and process group; whatever happens (a hang included:
the timeout only bounds it) the whole group is killed before the call returns."""

from __future__ import annotations

import contextlib
import html.parser
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser")
HANG_GUARD_S = 120


def chromium() -> str:
    """The browser's path; skips (or fails under VLM_REQUIRE_BROWSER=1 or CI=true) when there is none."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    message = "chromium is not installed (Debian: apt-get install chromium)"
    if os.environ.get("VLM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"VLM_REQUIRE_BROWSER=1 but {message}")
    if os.environ.get("CI", "").lower() in ("1", "true"):  # CI never skips the page check
        pytest.fail(f"CI={os.environ['CI']} but {message}")
    pytest.skip(message)


def _run(args: list[str]) -> str:
    """Run chromium headless on `args`; its stdout. The process group is killed on the way out."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                   env={**os.environ, "HOME": profile})
        try:
            out, err = process.communicate(timeout=HANG_GUARD_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its helpers (zygote, crashpad) too
            if process.returncode is None:
                process.communicate()  # reap it after the kill; closes the pipes
        assert process.returncode == 0, f"chromium exited {process.returncode}: {err.decode(errors='replace')[-2000:]}"
        return out.decode("utf-8", errors="replace")


def screenshot(page: Path, out: Path, width: int = 1280, height: int = 2000) -> Path:
    _run([f"--screenshot={out}", f"--window-size={width},{height}", page.resolve().as_uri()])
    assert out.is_file(), "chromium wrote no screenshot"
    return out


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def dom_text(page: Path) -> str:
    """The visible text of the DOM chromium built from the page (--dump-dom)."""
    parser = _Text()
    parser.feed(_run(["--dump-dom", page.resolve().as_uri()]))
    parser.close()
    return " ".join(" ".join(parser.parts).split())


def assert_not_blank(png: Path, *, min_colours: int = 8, min_stddev: float = 10.0) -> dict:
    """A real render: many distinct colours and a spread of brightness (not one flat colour)."""
    from PIL import Image, ImageStat

    with Image.open(png) as image:
        rgb = image.convert("RGB")
    colours = rgb.getcolors(maxcolors=1 << 20)
    distinct = len(colours) if colours is not None else 1 << 20
    stddev = max(ImageStat.Stat(rgb).stddev)
    assert distinct >= min_colours and stddev >= min_stddev, (distinct, stddev)
    return {"size": rgb.size, "colours": distinct, "stddev": stddev}
