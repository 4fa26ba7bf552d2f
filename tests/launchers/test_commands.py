"""The vllm argv, environment and plan checks built from a config (pure, no processes)."""

from __future__ import annotations

import json

import pytest

from launchers.commands import MEDIA_IO_KWARGS, replica_commands, shell_line
from launchers.plan import plan_stack
from proxy.config import load_settings, settings_from_dict
from proxy.errors import ConfigError
from tests.launchers.conftest import PRIMO_PATH, QWEN_PATH, REPO, stack_config

ENV = {"QWEN2_5_VL_MODEL_PATH": QWEN_PATH, "PRIMO_R1_MODEL_PATH": PRIMO_PATH}


def four_gpu(**kwargs) -> dict:
    return stack_config(proxy_port=18080, qwen_replicas=[{"gpus": [0, 1], "port": 8001}],
                        primo_replicas=[{"gpus": [2], "port": 8002}, {"gpus": [3], "port": 8003}],
                        **kwargs)


def plan_of(data: dict, env: dict | None = None, **kwargs):
    return plan_stack(settings_from_dict(data), ENV if env is None else env, **kwargs)


def common_flags(model_path: str, name: str, tp: int, limit: str, port: int) -> list[str]:
    return ["vllm", "serve", model_path, "--served-model-name", name,
            "--tensor-parallel-size", str(tp), "--max-model-len", "16384",
            "--gpu-memory-utilization", "0.9", "--limit-mm-per-prompt", limit,
            "--media-io-kwargs", '{"video": {"num_frames": -1}}', "--trust-request-mm-kwargs",
            "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]


def test_shipped_example_config_gives_the_4gpu_layout():
    settings = load_settings(REPO / "configs" / "stack-4gpu.yaml")
    plan = plan_stack(settings, ENV)
    assert plan.errors == [] and plan.warnings == []
    got = {c.name: (c.argv, c.env) for c in plan.commands}
    assert got == {
        "qwen2_5_vl_vllm-r0": (common_flags(QWEN_PATH, "Qwen2.5-VL-7B-Instruct", 2,
                                            '{"video": 1}', 8001), {"CUDA_VISIBLE_DEVICES": "0,1"}),
        "PRIMO-R1-r0": (common_flags(PRIMO_PATH, "PRIMO-R1-7B", 1, '{"image": 2, "video": 1}',
                                     8002), {"CUDA_VISIBLE_DEVICES": "2"}),
        "PRIMO-R1-r1": (common_flags(PRIMO_PATH, "PRIMO-R1-7B", 1, '{"image": 2, "video": 1}',
                                     8003), {"CUDA_VISIBLE_DEVICES": "3"}),
    }
    assert json.loads(MEDIA_IO_KWARGS) == {"video": {"num_frames": -1}}


def test_shipped_srpo_config_serves_the_embedding_backend_as_a_pooling_model():
    plan = plan_stack(load_settings(REPO / "configs" / "srpo.yaml"), {"EMBED_MODEL_PATH": "/models/embed"})
    assert plan.errors == []
    got = {c.name: (c.argv, c.env) for c in plan.commands}
    assert got == {f"embed-r{i}": ([*common_flags("/models/embed", "Qwen2.5-VL-embed", 1, '{"video": 1}', port),
                                    "--runner", "pooling", "--convert", "embed"], {"CUDA_VISIBLE_DEVICES": str(i)})
                   for i, port in ((0, 8011), (1, 8012))}


@pytest.mark.parametrize("flag", ["--runner", "--convert=embed"])
def test_the_pooling_flags_belong_to_the_backend_kind(flag):
    plan = plan_of(four_gpu(primo_launch={"extra_args": [flag, "pooling"]}))
    assert any(f"extra_args sets {flag.split('=')[0]}" in e and "backends.<name>.kind" in e for e in plan.errors)


def test_launch_fields_become_flags_and_extra_args_come_last():
    data = four_gpu(primo_launch={"max_model_len": 8192, "gpu_memory_utilization": 0.55,
                                  "seed": 7, "host": "0.0.0.0",
                                  "extra_args": ["--enforce-eager", "--max-num-seqs", "8"],
                                  "env": {"HF_HOME": "${CACHE_ROOT}/hf", "VLLM_LOGGING_LEVEL": "DEBUG"}})
    plan = plan_of(data, {**ENV, "CACHE_ROOT": "/scratch"})
    assert plan.errors == []
    primo = [c for c in plan.commands if c.backend == "PRIMO-R1"]
    argv = primo[1].argv
    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--max-model-len") == "8192" and value("--gpu-memory-utilization") == "0.55"
    assert value("--seed") == "7" and value("--host") == "0.0.0.0"
    assert value("--tensor-parallel-size") == "1" and value("--port") == "8003"
    assert argv[-3:] == ["--enforce-eager", "--max-num-seqs", "8"]
    assert primo[1].env == {"CUDA_VISIBLE_DEVICES": "3", "HF_HOME": "/scratch/hf",
                            "VLLM_LOGGING_LEVEL": "DEBUG"}
    assert primo[1].base_url == "http://127.0.0.1:8003"  # a wildcard bind is probed on loopback


@pytest.mark.parametrize(("layout", "explicit", "expected", "extra_view"), [
    ("qwen_video", None, {"video": 1}, None),
    ("primo_interleave", None, {"image": 2, "video": 1}, None),
    ("qwen_video", None, {"video": 2}, "second_video"),  # a second camera's own video
    ("primo_interleave", None, {"image": 2, "video": 2}, "second_video"),
    ("qwen_video", None, {"video": 1}, "side_by_side"),  # both cameras in each frame of one video
    ("images", None, {"image": 8}, None),
    ("shuffled_images", None, {"image": 8}, None),  # GVL: the reference frame and 7 shown frames
    ("qwen_video", {"video": 2, "image": 1}, {"video": 2, "image": 1}, None),
])
def test_limit_mm_per_prompt_follows_the_layout(layout, explicit, expected, extra_view):
    data = four_gpu(qwen_launch={"limit_mm_per_prompt": explicit} if explicit else None)
    data["backends"]["qwen2_5_vl_vllm"].update(layout=layout, frames={"nframes": 8, "extra_view": extra_view})
    (qwen, *_), _ = replica_commands("qwen2_5_vl_vllm", settings_from_dict(data).backends[
        "qwen2_5_vl_vllm"], ENV)
    assert json.loads(qwen.argv[qwen.argv.index("--limit-mm-per-prompt") + 1]) == expected


def test_unset_model_path_variable_is_a_clear_error():
    settings = settings_from_dict(four_gpu())
    with pytest.raises(ConfigError, match=r"model_path uses \$\{PRIMO_R1_MODEL_PATH\}.*not set"):
        plan_stack(settings, {"QWEN2_5_VL_MODEL_PATH": QWEN_PATH})
    plan = plan_stack(settings, {"QWEN2_5_VL_MODEL_PATH": QWEN_PATH}, strict=False)
    assert any("PRIMO_R1_MODEL_PATH" in e for e in plan.errors)
    assert plan.commands[1].argv[2] == "${PRIMO_R1_MODEL_PATH}"  # dry runs show the placeholder


@pytest.mark.parametrize("extra", [["--port", "9"], ["--port=9"], ["-tp", "2"],
                                   ["--media-io-kwargs", "{}"], ["--served-model-name", "x"]])
def test_extra_args_may_not_override_the_launcher_flags(extra):
    plan = plan_of(four_gpu(qwen_launch={"extra_args": extra}))
    assert any(f"extra_args sets {extra[0].split('=')[0]}" in e for e in plan.errors)


def test_cuda_visible_devices_in_env_is_refused():
    plan = plan_of(four_gpu(qwen_launch={"env": {"CUDA_VISIBLE_DEVICES": "5"}}))
    assert any("CUDA_VISIBLE_DEVICES" in e and "replicas[].gpus" in e for e in plan.errors)


def test_gpu_overlap_between_backends_is_an_error_unless_allowed():
    data = stack_config(proxy_port=18080, qwen_replicas=[{"gpus": [0, 1], "port": 8001}],
                        primo_replicas=[{"gpus": [1], "port": 8002}, {"gpus": [3], "port": 8003}])
    plan = plan_of(data)
    assert plan.errors == ["GPU 1 is shared by qwen2_5_vl_vllm-r0 and PRIMO-R1-r0 "
                           "(pass --allow-gpu-overlap if that is intended)"]
    allowed = plan_of(data, allow_gpu_overlap=True)
    assert allowed.errors == [] and any("GPU 1 is shared" in w for w in allowed.warnings)


def test_gpu_overlap_between_replicas_of_one_backend_is_an_error():
    data = stack_config(proxy_port=18080, qwen_replicas=[{"gpus": [0, 1], "port": 8001}],
                        primo_replicas=[{"gpus": [2], "port": 8002}, {"gpus": [2], "port": 8003}])
    assert any("GPU 2 is shared by PRIMO-R1-r0 and PRIMO-R1-r1" in e for e in plan_of(data).errors)


def test_port_clashes_between_replicas_and_with_the_proxy():
    data = stack_config(proxy_port=8003, qwen_replicas=[{"gpus": [0, 1], "port": 8002}],
                        primo_replicas=[{"gpus": [2], "port": 8002}, {"gpus": [3], "port": 8003}])
    errors = plan_of(data).errors
    assert "port 8002 is used by qwen2_5_vl_vllm-r0 and PRIMO-R1-r0" in errors
    assert "port 8003 is used by PRIMO-R1-r1 and the proxy (proxy.port)" in errors


def test_a_launch_port_without_a_matching_endpoint_is_an_error():
    data = four_gpu(primo_endpoints=[8002, 9003])
    errors = plan_of(data).errors
    assert len(errors) == 1
    assert "PRIMO-R1.launch.replicas[1] serves port 8003 but no endpoint matches" in errors[0]
    assert "add http://127.0.0.1:8003/v1" in errors[0]
    warnings = plan_of(data).warnings
    assert any("http://127.0.0.1:9003/v1 is not started by `up`" in w for w in warnings)


def test_backends_without_launch_are_listed_not_started():
    data = four_gpu()
    del data["backends"]["PRIMO-R1"]["launch"]
    plan = plan_of(data)
    assert plan.not_launched == ["PRIMO-R1"] and [c.name for c in plan.commands] == [
        "qwen2_5_vl_vllm-r0"]


def test_mismatched_budgets_and_short_mm_limits_warn():
    data = four_gpu(primo_launch={"max_model_len": 16384, "limit_mm_per_prompt": {"video": 1}})
    data["backends"]["PRIMO-R1"]["max_model_len"] = 32768
    warnings = plan_of(data).warnings
    assert any("max_model_len 32768" in w and "16384" in w for w in warnings)
    assert any("below what layout primo_interleave sends" in w for w in warnings)


def test_a_backend_on_another_backends_replicas_is_checked_against_their_mm_limit():
    """GVL's backend (an image per frame) with no launch of its own, on the Qwen video replicas."""
    data = four_gpu()
    qwen = data["backends"]["qwen2_5_vl_vllm"]
    gvl = {k: v for k, v in qwen.items() if k != "launch"}
    data["backends"]["gvl"] = {**gvl, "layout": "shuffled_images", "prompt": "gvl", "frames": {"nframes": 9}}
    warnings = [w for w in plan_of(data).warnings if w.startswith("backend gvl")]
    assert len(warnings) == 1 and "served by qwen2_5_vl_vllm's replica with --limit-mm-per-prompt {'video': 1}" \
        in warnings[0] and "limit_mm_per_prompt to {'video': 1, 'image': 9}" in warnings[0], warnings
    qwen["launch"]["limit_mm_per_prompt"] = {"video": 1, "image": 9}
    assert not [w for w in plan_of(data).warnings if w.startswith("backend gvl")]


def test_a_two_camera_backend_on_one_video_replicas_is_warned_about():
    """A second camera as its own video (frames.extra_view: second_video) on replicas started for one."""
    data = four_gpu()
    qwen = data["backends"]["qwen2_5_vl_vllm"]
    two = {k: v for k, v in qwen.items() if k != "launch"}
    data["backends"]["two_cameras"] = {**two, "frames": {"extra_view": "second_video"}}
    warnings = [w for w in plan_of(data).warnings if w.startswith("backend two_cameras")]
    assert len(warnings) == 1 and "limit_mm_per_prompt to {'video': 2}" in warnings[0], warnings
    data["backends"]["two_cameras"]["frames"]["extra_view"] = "side_by_side"  # one video: nothing to warn of
    assert not [w for w in plan_of(data).warnings if w.startswith("backend two_cameras")]


def test_shell_line_quotes_like_a_shell_would_read_it():
    line = shell_line(["vllm", "serve", "/m/it's", "--limit-mm-per-prompt", '{"video": 1}'],
                      {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert line == ("CUDA_VISIBLE_DEVICES=0,1 vllm serve '/m/it'\"'\"'s' "
                    "--limit-mm-per-prompt '{\"video\": 1}'")


def test_api_key_goes_to_the_server_environment_and_is_never_printed():
    data = four_gpu()
    data["backends"]["PRIMO-R1"]["api_key_env"] = "PRIMO_TOKEN"
    plan = plan_of(data, {**ENV, "PRIMO_TOKEN": "s3cret"})
    primo = plan.commands[1]
    assert primo.full_env() == {"CUDA_VISIBLE_DEVICES": "2", "VLLM_API_KEY": "s3cret"}
    assert "s3cret" not in primo.shell_line() and "s3cret" not in " ".join(primo.argv)
    assert primo.shell_line().startswith('VLLM_API_KEY="$PRIMO_TOKEN" CUDA_VISIBLE_DEVICES=2 ')
    assert any("api_key_env names PRIMO_TOKEN, which is not set" in e
               for e in plan_of(data).errors)


def test_gpus_are_positions_in_the_parents_cuda_visible_devices():
    plan = plan_of(four_gpu(), {**ENV, "CUDA_VISIBLE_DEVICES": "4, 5,6,GPU-abc"})
    assert plan.errors == []
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in plan.commands] == ["4,5", "6", "GPU-abc"]
    assert [c.gpus for c in plan.commands] == [(0, 1), (2,), (3,)]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in plan_of(four_gpu(), {
        **ENV, "CUDA_VISIBLE_DEVICES": ""}).commands] == ["0,1", "2", "3"]  # empty: not limited


def test_gpu_position_outside_the_parents_cuda_visible_devices_is_a_plan_error():
    plan = plan_of(four_gpu(), {**ENV, "CUDA_VISIBLE_DEVICES": "4,5"})
    assert plan.errors == [
        "backends.PRIMO-R1.launch.replicas[0].gpus [2]: GPU position(s) [2] out of range; this "
        "process has CUDA_VISIBLE_DEVICES=4,5 (2 GPU(s), positions 0-1)",
        "backends.PRIMO-R1.launch.replicas[1].gpus [3]: GPU position(s) [3] out of range; this "
        "process has CUDA_VISIBLE_DEVICES=4,5 (2 GPU(s), positions 0-1)"]


def test_replica_env_goes_over_the_backend_env_for_that_replica_only():
    data = four_gpu(primo_launch={"env": {"HF_HOME": "${CACHE_ROOT}/hf", "OMP_NUM_THREADS": "4"}})
    data["backends"]["PRIMO-R1"]["launch"]["replicas"][1]["env"] = {
        "OMP_NUM_THREADS": "8", "VLLM_CPU_OMP_THREADS_BIND": "${CORES_R1}"}
    plan = plan_of(data, {**ENV, "CACHE_ROOT": "/scratch", "CORES_R1": "8-15"})
    assert plan.errors == []
    r0, r1 = (c for c in plan.commands if c.backend == "PRIMO-R1")
    assert r0.env == {"CUDA_VISIBLE_DEVICES": "2", "HF_HOME": "/scratch/hf", "OMP_NUM_THREADS": "4"}
    assert r1.env == {"CUDA_VISIBLE_DEVICES": "3", "HF_HOME": "/scratch/hf", "OMP_NUM_THREADS": "8",
                      "VLLM_CPU_OMP_THREADS_BIND": "8-15"}
    assert r1.shell_line().startswith("CUDA_VISIBLE_DEVICES=3 HF_HOME=/scratch/hf "
                                      "OMP_NUM_THREADS=8 VLLM_CPU_OMP_THREADS_BIND=8-15 vllm serve ")
    assert ["8003" if a == "8002" else a for a in r0.argv] == r1.argv  # the env is all that differs


def test_replica_env_variables_must_be_set():
    data = four_gpu()
    data["backends"]["qwen2_5_vl_vllm"]["launch"]["replicas"][0]["env"] = {"BIND": "${CORES}"}
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.env\.BIND uses \$\{CORES\}.*not set"):
        plan_of(data)
    plan = plan_of(data, strict=False)
    assert [e for e in plan.errors if "CORES" in e] == [
        "backends.qwen2_5_vl_vllm.launch.replicas[0].env.BIND uses ${CORES} but the environment "
        "variable CORES is not set or empty (export it, e.g. the local path of the weights)"]
    assert plan.commands[0].env["BIND"] == "${CORES}"  # dry runs show the placeholder


def test_cuda_visible_devices_in_a_replica_env_is_refused():
    data = four_gpu()
    data["backends"]["PRIMO-R1"]["launch"]["replicas"][1]["env"] = {"CUDA_VISIBLE_DEVICES": "0"}
    plan = plan_of(data)
    assert plan.errors == ["backends.PRIMO-R1.launch.replicas[1].env sets CUDA_VISIBLE_DEVICES; "
                           "choose GPUs with replicas[].gpus"]
    assert plan.commands[2].env["CUDA_VISIBLE_DEVICES"] == "3"  # the plan's GPUs, never the override
