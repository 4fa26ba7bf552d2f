"""Config: the shipped file loads; a bad key fails at start with its dotted path."""

from pathlib import Path

import pytest
import yaml

from proxy.config import load_settings, settings_from_dict
from proxy.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_shipped_libero_config_loads_with_both_backends():
    settings = load_settings(REPO / "configs" / "libero.yaml")
    assert set(settings.backends) == {"qwen2_5_vl_vllm", "PRIMO-R1"}
    assert settings.backends["PRIMO-R1"].aliases == ["primo_r1_vllm"]
    assert settings.proxy.host == "127.0.0.1" and settings.proxy.port == 18080
    # relative paths resolve against the config file, not the working directory
    assert settings.proxy.prompts_dir == (REPO / "prompts").resolve()
    primo = settings.backends["PRIMO-R1"]
    # PRIMO-R1's own evaluation (eval_interleave.py): its prompt format, decoding and budget
    assert (primo.prompt, primo.sampling.temperature, primo.sampling.top_p) == ("primo_r1_trained", 0.1, 0.001)
    assert (primo.sampling.max_tokens, primo.max_model_len, primo.frames.clamp_nframes_to) == (4096, 16384, 22)
    qwen = settings.backends["qwen2_5_vl_vllm"]
    assert (qwen.prompt, qwen.sampling.temperature, qwen.sampling.max_tokens) == ("qwen_seed", 0.0, 64)


def _minimal(**backend):
    return {"backends": {"b": {"model": "m", "endpoints": ["http://127.0.0.1:1/v1"],
                               "layout": "qwen_video", "prompt": "qwen_progress", **backend}}}


def test_defaults_are_safe():
    settings = settings_from_dict(_minimal())
    assert settings.proxy.host == "127.0.0.1"
    assert settings.proxy.allowed_media_roots == []  # no file access unless configured
    assert settings.backends["b"].request_mm_kwargs is True


@pytest.mark.parametrize(("data", "key"), [
    (_minimal(sampling={"temprature": 0.1}), "backends.b.sampling.temprature"),
    (_minimal(layout="qwen_image"), "backends.b.layout"),
    (_minimal(frames={"nframes": 0}), "backends.b.frames.nframes"),
    (_minimal(frames={"extra_view": "above"}), "backends.b.frames.extra_view"),
    (_minimal(layout="images", frames={"extra_view": "second_video"}), "second_video needs a layout with a video"),
    (_minimal(endpoints=["127.0.0.1:8001"]), "backends.b.endpoints"),
    (_minimal(retry={"backoff_s": [5, 1]}), "backends.b.retry.backoff_s"),
    (_minimal(endpoints=["http://u:p@127.0.0.1:8001/v1"], api_key_env="K"), "both set the Authorization header"),
    ({**_minimal(), "proxy": {"port": 70000}}, "proxy.port"),
    ({**_minimal(), "proxy": {"hots": "0.0.0.0"}}, "proxy.hots"),
    ({"backends": {}}, "backends"),
])
def test_bad_config_names_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        settings_from_dict(data)
    assert key in err.value.message


def test_alias_clash_between_backends_is_refused():
    data = _minimal(aliases=["x"])
    data["backends"]["c"] = {**data["backends"]["b"], "aliases": ["x"]}
    with pytest.raises(ConfigError, match="'x'"):
        settings_from_dict(data)


def test_launch_replicas_must_match_tensor_parallel_size():
    data = _minimal(launch={"model_path": "/m", "tensor_parallel_size": 2,
                            "replicas": [{"gpus": [0], "port": 8001}]})
    with pytest.raises(ConfigError, match=r"backends.b.launch"):
        settings_from_dict(data)


def test_unreadable_and_non_yaml_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(listy)


@pytest.mark.parametrize(("url", "shown", "credentials"), [
    ("http://operator:pa55@10.0.0.1:8000/v1", "http://10.0.0.1:8000/v1", ("operator", "pa55")),
    ("http://u%40x:p%3Aw@h:1/v1?q=@y", "http://h:1/v1?q=@y", ("u@x", "p:w")),  # the authority's last "@"
    ("http://h:1/v1", "http://h:1/v1", None),
    ("https://[\x7f", "https://[\x7f", None),  # what urlsplit refuses (a 500 the fuzzer found, stop 36)
])
def test_an_endpoints_credentials_are_split_from_the_url_it_is_shown_as(url, shown, credentials):
    from proxy.config import split_credentials

    assert split_credentials(url) == (shown, credentials)
