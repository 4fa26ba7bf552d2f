"""Issue 24's small ones: YAML merge keys, a `stream` that is not a boolean, a finished stream's
upstream connection kept for reuse, and the server extra's Python floor."""

from __future__ import annotations

import base64
import io
import json
import sys
import tomllib

import httpx
import numpy as np
import openai
import pytest
from packaging.requirements import Requirement

from proxy.cli import SERVER_PYTHON, require_server_python
from proxy.config import load_settings
from proxy.errors import ConfigError
from tests.conftest import QWEN_MODEL
from tests.helpers import PROMPTS_DIR, REPO
from vlm_protocol import strict_yaml


def _openai(proxy_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy_server.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                         http_client=httpx.Client(trust_env=False))


def _chat_peers(fake) -> list:
    return [r.peer for r in fake.fake.state.requests if r.path.endswith("/chat/completions")]


def test_a_finished_stream_returns_its_upstream_connection_to_the_pool(proxy_server, fake_qwen):
    """Two streams one after the other ride one TCP connection to vLLM (kept alive, as vLLM's
    uvicorn sends a chunked stream): the first one's connection went back to the pool."""
    fake_qwen.script({"reply": "one two"}, {"reply": "three four"})
    with _openai(proxy_server) as client:
        texts = []
        for _ in range(2):
            stream = client.chat.completions.create(model=QWEN_MODEL, messages=[{"role": "user", "content": "x"}],
                                                    stream=True)
            texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream))
    assert texts == ["one two", "three four"]
    first, second = _chat_peers(fake_qwen)
    assert first == second, "the second stream opened a new upstream connection"


# -- YAML merge keys --------------------------------------------------------------------------------
_MERGED_CONFIG = """
proxy:
  allowed_media_roots: [{media}]
  prompts_dir: {prompts}
backends:
  qwen:
    model: Qwen2.5-VL-7B-Instruct
    endpoints: [http://127.0.0.1:8001/v1]
    layout: qwen_video
    prompt: qwen_progress
    retry: &retry {{attempts: 4, parse_attempts: 2, backoff_s: [0.05, 5.0], timeout_s: 120, deadline_s: 300}}
    frames: &frames {{nframes: 16, max_pixels: 200704}}
  primo: &primo
    model: PRIMO-R1-7B
    endpoints: [http://127.0.0.1:8002/v1]
    layout: primo_interleave
    prompt: primo_r1
    retry:
      <<: *retry
      timeout_s: 300          # overrides the merged 120
    frames: {{<<: *frames, clamp_nframes_to: 22}}
  primo_b:
    <<: *primo
    endpoints: [http://127.0.0.1:8003/v1]
"""


def test_a_config_may_share_blocks_with_anchors_and_merge_keys(tmp_path):
    path = tmp_path / "merged.yaml"
    path.write_text(_MERGED_CONFIG.format(media=tmp_path, prompts=PROMPTS_DIR))
    settings = load_settings(path)
    qwen, primo, primo_b = (settings.backends[n] for n in ("qwen", "primo", "primo_b"))
    assert primo.retry.timeout_s == 300 and qwen.retry.timeout_s == 120  # explicit key wins over the merged one
    assert primo.retry.attempts == qwen.retry.attempts == 4
    assert (primo.frames.nframes, primo.frames.clamp_nframes_to) == (16, 22)
    assert primo_b.model == "PRIMO-R1-7B" and primo_b.layout == "primo_interleave"
    assert primo_b.endpoints != primo.endpoints


@pytest.mark.parametrize("text", [
    "d: &d {a: 1}\nx: {<<: *d, b: 1, b: 2}\n",  # a key twice beside a merge
    "d: &d {a: 1, a: 2}\nx: {<<: *d}\n",  # a key twice in the merged mapping
    "d: &d {a: 1}\ne: &e {b: 1}\nx:\n  <<: *d\n  <<: *e\n",  # `<<` twice: list them instead
])
def test_a_key_written_twice_is_still_refused_with_merge_keys(text):
    with pytest.raises(strict_yaml.DuplicateKeyError, match="duplicate key"):
        strict_yaml.load(text)


def test_merge_keys_resolve_as_safe_load_resolves_them():
    text = "d: &d {a: 1, b: 2}\ne: &e {a: 9, c: 3}\nx:\n  <<: [*d, *e]\n  b: 5\n"
    import yaml
    assert strict_yaml.load(text) == yaml.safe_load(text) == {
        "d": {"a": 1, "b": 2}, "e": {"a": 9, "c": 3}, "x": {"a": 1, "b": 5, "c": 3}}


def test_a_duplicated_backend_key_in_a_merged_config_names_it(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(_MERGED_CONFIG.format(media=tmp_path, prompts=PROMPTS_DIR)
                    + "    endpoints: [http://127.0.0.1:8004/v1]\n")
    with pytest.raises(ConfigError, match="duplicate key 'endpoints'"):
        load_settings(path)


# -- `stream` is a boolean --------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["false", "true", 0, 1, "no", [], {}])
def test_a_stream_that_is_not_a_boolean_is_a_422_naming_it(client, fake_qwen, value):
    """vLLM (pydantic, lax) reads "false", 0 or "no" as False: the proxy must not relay those as a
    stream. It accepts what OpenAI's API does (true, false, null) and refuses the rest, before any
    upstream call."""
    body = {"model": QWEN_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": value}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and error["field"] == "stream"
    assert fake_qwen.chat_requests == []


@pytest.mark.parametrize(("value", "streamed"), [(True, True), (False, False), (None, False)])
def test_a_boolean_or_null_stream_is_relayed_as_asked(client, fake_qwen, value, streamed):
    body = {"model": QWEN_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": value}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream" if streamed else "application/json")
    if not streamed:
        assert json.loads(answer.content)["object"] == "chat.completion"


# -- the server extra's Python floor ----------------------------------------------------------------
def test_the_server_extra_installs_only_on_the_python_the_service_needs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"  # the client's floor
    for line in project["optional-dependencies"]["server"]:
        marker = Requirement(line).marker
        assert marker is not None, f"{line!r} would install on Python 3.10"
        assert not marker.evaluate({"python_version": "3.10", "python_full_version": "3.10.14"}), line
        assert marker.evaluate({"python_version": "3.11", "python_full_version": "3.11.9"}), line


def test_serve_refuses_an_older_python_naming_both_versions():
    with pytest.raises(SystemExit, match=r"needs Python 3\.11 or newer; this is Python 3\.10\.14"):
        require_server_python((3, 10, 14))
    require_server_python(tuple(sys.version_info))  # this one runs the suite: no refusal
    assert SERVER_PYTHON == (3, 11)



# -- metadata as sent (found by the schemathesis run with every check on) ---------------------------
@pytest.mark.parametrize(("metadata", "field"), [({"task_id": False}, "task_id"), ({"group_id": True}, "group_id"),
                                                 ({"step": True}, "step"), ({"env_success": 0}, "env_success"),
                                                 ({"env_success": "no"}, "env_success")])
def test_metadata_is_read_as_sent_not_as_lax_mode_reads_it(client, fake_qwen, metadata, field):
    """The document says ids are integers or strings and env_success a boolean; lax mode would read
    `false` as task 0 (episodes of different tasks grouped) and 0 or "no" as a failure."""
    frames = io.BytesIO()
    np.save(frames, np.zeros((2, 8, 8, 3), np.uint8), allow_pickle=False)
    body = {"task_text": "t", "frames_npy": base64.b64encode(frames.getvalue()).decode(), "metadata": metadata}
    answer = client.post("/score", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"] == f"metadata.{field}"
    assert fake_qwen.chat_requests == []


@pytest.mark.parametrize(("extra", "field"), [({"video_fps": True}, "video_fps"), ({"fps": "4"}, "fps"),
                                              ({"nframes": True}, "nframes"), ({"max_pixels": "200704"}, "max_pixels")])
def test_numbers_are_json_numbers_not_what_lax_mode_reads(client, fake_qwen, extra, field):
    """The document says number/integer: `true` or "4" is refused (lax mode read them as 1 and 4;
    found by schemathesis's negative cases with every check on); 16.0 is an integer, as in JSON Schema."""
    frames = io.BytesIO()
    np.save(frames, np.zeros((2, 8, 8, 3), np.uint8), allow_pickle=False)
    body = {"task_text": "t", "frames_npy": base64.b64encode(frames.getvalue()).decode()}
    answer = client.post("/score", json={**body, **extra})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"] == field
    assert fake_qwen.chat_requests == []
    assert client.post("/score", json={**body, "nframes": 16.0}).status_code == 200
