"""`vlm-reward-proxy sample-episode` writes an episode the proxy accepts, where the README's curl
reads it: into an owner-only media root, scored through the real proxy (fake vLLM upstream)."""

from __future__ import annotations

import re
import stat

import httpx
import pytest
import yaml

from proxy.config import settings_from_dict
from tests.conftest import REPO, libero_settings_dict
from vlm_reward_cli import main
from vlm_reward_cli.sample_episode import DEFAULT_MEDIA_ROOT, DEFAULT_NAME


def _readme_curl_body() -> dict:
    """The JSON body of the README's curl example (its `-d '...'`)."""
    text = (REPO / "README.md").read_text()
    body = re.search(r"curl -s localhost:18080/score .*?-d '(\{.*?\})'", text, re.S)
    assert body, "the README's curl example moved"
    return yaml.safe_load(body.group(1))


def test_the_readme_curl_reads_where_the_command_writes_in_the_shipped_configs():
    assert _readme_curl_body()["video_path"] == str(DEFAULT_MEDIA_ROOT / DEFAULT_NAME)
    for config in ("libero.yaml", "stack-4gpu.yaml"):
        roots = yaml.safe_load((REPO / "configs" / config).read_text())["proxy"]["allowed_media_roots"]
        assert roots[0] == str(DEFAULT_MEDIA_ROOT), config
    assert "vlm-reward-proxy sample-episode" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("backend", ["PRIMO-R1", "qwen2_5_vl_vllm"])
def test_the_sample_episode_is_scored_by_the_real_proxy(tmp_path, fake_qwen, fake_primo, proxy_factory, capsys,
                                                        backend):
    root = tmp_path / "vlm-reward-media"  # missing: the command creates it as the proxy would
    episode = root / DEFAULT_NAME
    assert main(["sample-episode", "--out-file", str(episode)]) == 0
    assert f"wrote {episode}" in capsys.readouterr().out
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and episode.is_file()

    proxy = proxy_factory(settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], root)))
    body = {**_readme_curl_body(), "video_path": str(episode), "backend": backend}
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        response = http.post("/score", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert 0.0 <= result["score"] <= 1.0
    assert result["frames"]["source_count"] == 160 and result["frames"]["count"] == 16, result["frames"]


def test_an_existing_file_is_kept_unless_forced_and_an_unsafe_root_is_refused(tmp_path, capsys):
    root = tmp_path / "media"
    root.mkdir(mode=0o700)
    episode = root / DEFAULT_NAME
    episode.write_bytes(b"mine")
    assert main(["sample-episode", "--out-file", str(episode), "--frames", "8"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err and episode.read_bytes() == b"mine"
    assert main(["sample-episode", "--out-file", str(episode), "--frames", "8", "--force"]) == 0
    assert episode.read_bytes()[4:8] == b"ftyp"  # an MP4, as the proxy sniffs it

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # any local user could swap the file: the proxy would refuse this root
    assert main(["sample-episode", "--out-file", str(shared / DEFAULT_NAME)]) == 2
    assert "writable by every local user" in capsys.readouterr().err
    assert not (shared / DEFAULT_NAME).exists()


def test_config_picks_its_first_media_root(tmp_path, capsys):
    root = tmp_path / "roots" / "first"
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump(libero_settings_dict(["http://127.0.0.1:9/v1"], ["http://127.0.0.1:9/v1"], root)))
    assert main(["sample-episode", "--config", str(config), "--frames", "4"]) == 0
    assert (root / DEFAULT_NAME).is_file()
