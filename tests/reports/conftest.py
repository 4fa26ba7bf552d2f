"""A graded audit log, written by the real proxy, for the report's tests."""

from __future__ import annotations

import pytest

from tests.reports.graded import MALFORMED, GradedLog, build_graded_log


@pytest.fixture
def graded(proxy_factory, fake_vllm_factory, media_root, tmp_path) -> GradedLog:
    """42 episodes x 2 backends graded by the fakes, one media_not_found each, and three lines
    that are not audit records (what a crash mid-write or a stray tool leaves behind)."""
    log = build_graded_log(proxy_factory, fake_vllm_factory, media_root, tmp_path)
    with log.audit.open("a") as fh:
        fh.write("\n".join(MALFORMED) + "\n\n")
    return log
