"""Renamed config keys: a file written with the old name loads as before and says, in one log line,
what the key is called now; the new name loads silently; both spellings give the same settings."""

from __future__ import annotations

import logging
import re

import pytest

from proxy.config import settings_from_dict
from proxy.config.settings import FramesConfig, ProxySettings
from proxy.errors import ConfigError
from tests.helpers import REPO

# The table of docs/configuration.md ("Renamed keys"): (section, old key, new key, a value).
RENAMED = [
    ("proxy", "max_nframes", "nframes_limit", 64),
    ("frames", "max_nframes", "clamp_nframes_to", 22),
    ("frames", "min_pixels", "video_min_pixels", 50_176),
    ("frames", "total_pixels", "video_total_pixels", 45_158_400),
]


def _config(section: str, key: str, value: object) -> dict:
    backend = {"model": "m", "endpoints": ["http://127.0.0.1:1/v1"], "layout": "qwen_video", "prompt": "qwen_seed"}
    if section == "frames":
        backend["frames"] = {key: value}
    config: dict = {"backends": {"b": backend}}
    if section == "proxy":
        config["proxy"] = {key: value}
    return config


def _renamed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "proxy.config" and "is now called" in r.getMessage()]


@pytest.mark.parametrize(("section", "old", "new", "value"), RENAMED, ids=[f"{s}.{o}" for s, o, _, _ in RENAMED])
def test_the_old_key_loads_as_the_new_one_and_says_so_once(caplog, section, old, new, value):
    caplog.set_level(logging.INFO, logger="proxy.config")
    with_old = settings_from_dict(_config(section, old, value))
    assert _renamed_lines(caplog) == [f"config: {section}.{old} is now called {section}.{new} "
                                      "(read as such; rename it in the file)"]
    caplog.clear()
    with_new = settings_from_dict(_config(section, new, value))
    assert _renamed_lines(caplog) == []
    assert with_old == with_new
    model = with_new.proxy if section == "proxy" else with_new.backends["b"].frames
    assert getattr(model, new) == value and old not in type(model).model_fields


@pytest.mark.parametrize(("section", "old", "new", "value"), RENAMED, ids=[f"{s}.{o}" for s, o, _, _ in RENAMED])
def test_both_spellings_at_once_are_refused(section, old, new, value):
    config = _config(section, old, value)
    (config["proxy"] if section == "proxy" else config["backends"]["b"]["frames"])[new] = value
    with pytest.raises(ConfigError, match=f"{old} and {new} are one setting"):
        settings_from_dict(config)


def test_the_table_is_every_rename_the_models_declare():
    declared = {("proxy", old, new) for old, new in ProxySettings.renamed.items()}
    declared |= {("frames", old, new) for old, new in FramesConfig.renamed.items()}
    assert declared == {(section, old, new) for section, old, new, _ in RENAMED}



def test_the_docs_table_lists_every_rename():
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text[text.index("## Renamed keys"):text.index("## `proxy`")]
    rows = re.findall(r"^\| `([\w.<>]+)`[^|]*\| `([\w.]+)` \|", section, flags=re.MULTILINE)
    documented = {(old.split(".")[-2], old.split(".")[-1], new.split(".")[-1]) for old, new in rows
                  if not old.startswith("reward_model.")}
    assert documented == {(section, old, new) for section, old, new, _ in RENAMED}
