"""The run overlays, the integration's key table and the client's config say the same thing.

integrations/rlinf/README.md promises every `reward_model` key with its default; the overlays in
configs/rlinf/ show only what a run must set or what departs from a default, and say which on each
line, so no run silently takes another path than the documented one.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from pathlib import Path

import pytest
import yaml

from rlinf_client import RewardModelConfig, RewardModelOptions

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted((REPO / "configs" / "rlinf").glob("*.yaml"))
TABLE_DOC = REPO / "integrations" / "rlinf" / "README.md"
# Keys a run states whatever their value: whether the reward model is on, where the proxy is
# (each cluster's own), and which of the proxy's backends scores (null would be whichever it lists first).
MUST_SET = {"enable", "endpoint", "backend"}
KEY_LINE = re.compile(r"^      (\w+): (.*?)\s+# (.*)$")


def _real_defaults() -> dict[str, object]:
    defaults = {}
    for field in dataclasses.fields(RewardModelConfig):
        defaults[field.name] = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    defaults["fail_on_request_error"] = inspect.signature(RewardModelConfig).parameters["fail_on_request_error"].default
    return defaults


def _table() -> dict[str, str]:
    """Key -> its default as the table writes it (YAML text)."""
    text = TABLE_DOC.read_text()
    section = text[text.index("## Config\n"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 2:
            continue
        keys = [k.strip().strip("`") for k in cells[0].split(",")]
        defaults = [d.strip().strip("`") for d in cells[1].split(", ")]
        assert len(keys) == len(defaults), line
        for key, default in zip(keys, defaults, strict=True):
            assert key not in rows, f"{key} is in the table twice"
            rows[key] = default
    return rows


def _overlay_lines(path: Path) -> dict[str, tuple[str, str]]:
    """env.train.reward_model's keys in an overlay -> (value text, the comment on its line)."""
    lines = path.read_text().splitlines()
    start = lines.index("    reward_model:") + 1
    found = {}
    for line in lines[start:]:
        if line and not line.startswith("      "):
            break
        if match := KEY_LINE.match(line):
            found[match[1]] = (match[2], match[3])
        elif line.strip() and not line.strip().startswith("#"):
            pytest.fail(f"{path.name}: a reward_model key without a comment saying why it is set: {line!r}")
    return found


def test_the_table_has_every_key_with_its_real_default():
    table, real = _table(), _real_defaults()
    assert set(table) == set(real) == set(RewardModelOptions.__annotations__)
    for key, written in table.items():
        assert yaml.safe_load(written) == real[key], f"{key}: the table says {written}, the client {real[key]!r}"


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.stem)
def test_an_overlay_sets_only_what_a_run_must_and_says_so(path, caplog):
    caplog.set_level(logging.INFO, logger="rlinf_client")
    block = yaml.safe_load(path.read_text())["env"]["train"]["reward_model"]
    RewardModelConfig.from_mapping(block)
    assert caplog.records == [], "an overlay uses a renamed key"
    table, real = _table(), _real_defaults()
    lines = _overlay_lines(path)
    assert set(lines) == set(block), path.name
    for key, value in block.items():
        assert key in real, f"{path.name}: {key} is no reward_model key"
        comment = lines[key][1]
        if key in MUST_SET:
            assert comment.startswith("must set: "), f"{path.name}: {key} must say that a run must set it"
        else:
            assert value != real[key], f"{path.name}: {key}: {value!r} is the default; leave it out"
            assert comment.startswith(f"default {table[key]}"), \
                f"{path.name}: {key} must name the default it departs from ({table[key]})"


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.stem)
def test_an_overlays_references_exist(path):
    text = path.read_text()
    assert "defaults shown" not in text
    headings = {
        "docs/rlinf.md": {h.lstrip("# ").strip() for h in (REPO / "docs" / "rlinf.md").read_text().splitlines()
                          if h.startswith("## ")},
        "docs/configuration.md": {h.lstrip("# ").strip() for h in
                                  (REPO / "docs" / "configuration.md").read_text().splitlines() if h.startswith("## ")},
    }
    cited = re.findall(r"(docs/[\w.]+) \(((?:\"[^\"]+\"(?:, )?)+)\)", " ".join(
        line.lstrip("# ") for line in text.splitlines() if line.startswith("#")))
    assert {doc for doc, _ in cited} == set(headings), cited
    for doc, names in cited:
        for name in re.findall(r"\"([^\"]+)\"", names):
            assert name in headings[doc], f"{path.name} cites {doc} ({name!r}), which has no such section"
