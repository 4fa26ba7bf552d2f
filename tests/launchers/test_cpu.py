"""`launch.device: cpu` (configs/cpu-tiny.yaml, `serve_*.sh --cpu`): the CPU flags, no GPU, and the
warning when the CPU replicas' KV caches would take most of the machine's memory."""

from __future__ import annotations

import subprocess

import pytest

from launchers.commands import CPU_ARGS, replica_commands
from launchers.plan import cpu_memory_warnings, plan_stack
from proxy.config import BackendConfig, load_settings
from proxy.errors import ConfigError
from tests.launchers.conftest import LAUNCHERS, QWEN_MODEL, REPO, FakeVllmEnv
from tests.launchers.test_dry_run import cli

GiB = 2**30
CPU_CONFIG = REPO / "configs" / "cpu-tiny.yaml"


def cpu_backend(replicas: list[dict] | None = None, **launch: object) -> BackendConfig:
    replicas = replicas or [{"port": 9123}]
    return BackendConfig.model_validate({
        "model": QWEN_MODEL, "layout": "qwen_video", "prompt": "p",
        "endpoints": [f"http://127.0.0.1:{r['port']}/v1" for r in replicas],
        "launch": {"model_path": "/m", "device": "cpu", "replicas": replicas, **launch}})


def test_a_cpu_replica_gets_the_cpu_flags_before_its_extra_args_and_no_gpu():
    (command,), errors = replica_commands("q", cpu_backend(extra_args=["--max-num-seqs", "4"]),
                                          {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert errors == []
    assert command.argv[-len(CPU_ARGS) - 2:] == [*CPU_ARGS, "--max-num-seqs", "4"]
    assert "CUDA_VISIBLE_DEVICES" not in command.env and command.cpu and command.gpus == ()
    assert command.shell_line().startswith("vllm serve /m ")


@pytest.mark.parametrize(("launch", "message"), [
    ({"replicas": [{"gpus": [0], "port": 9123}]}, "device cpu uses no GPU"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
])
def test_a_cpu_launch_lists_no_gpus(launch, message):
    with pytest.raises(ValueError, match=message):
        cpu_backend(**launch)


def test_the_shell_launcher_with_cpu_builds_the_same_command(fake_vllm_env: FakeVllmEnv):
    env = {k: v for k, v in fake_vllm_env.env.items() if k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run(["bash", str(LAUNCHERS / "serve_qwen2_5_vl.sh"), "/m", "--cpu", "--port", "9123",
                             "--served-model-name", QWEN_MODEL, "--", "--max-num-seqs", "4"],
                            capture_output=True, text=True, env={**env, "FAKE_VLLM_EXIT_CODE": "0"}, timeout=30)
    assert result.returncode == 0, result.stderr
    (command,), _ = replica_commands("q", cpu_backend(extra_args=["--max-num-seqs", "4"]), {})
    record = fake_vllm_env.record(9123)
    assert record["argv"][1:] == command.argv[1:]
    assert "CUDA_VISIBLE_DEVICES" not in record["env"]
    assert result.stdout.splitlines()[0] == command.shell_line()


@pytest.mark.parametrize("args", [["--cpu", "--gpus", "0"], ["--cpu", "-tp", "2"]])
def test_the_shell_launcher_refuses_gpus_with_cpu(fake_vllm_env: FakeVllmEnv, args):
    result = subprocess.run(["bash", str(LAUNCHERS / "serve_qwen2_5_vl.sh"), "/m", *args, "--dry-run"],
                            capture_output=True, text=True, env=fake_vllm_env.env, timeout=30)
    assert result.returncode == 2 and "--cpu" in result.stderr


def _warnings(backend: BackendConfig, env: dict[str, str], total: int) -> list[str]:
    commands, _ = replica_commands("q", backend, env)
    return cpu_memory_warnings(commands, env, total)


def test_the_cpu_default_kv_cache_is_no_warning_even_on_a_small_machine():
    assert _warnings(cpu_backend(), {}, 2 * GiB) == []


@pytest.mark.parametrize(("backend", "env", "named"), [
    # VLLM_CPU_KVCACHE_SPACE (whole GiB) overrides the flag, from up's environment or the replica's own
    (cpu_backend(), {"VLLM_CPU_KVCACHE_SPACE": "20"}, "VLLM_CPU_KVCACHE_SPACE=20"),
    (cpu_backend([{"port": 9123, "env": {"VLLM_CPU_KVCACHE_SPACE": "13"}}]), {}, "VLLM_CPU_KVCACHE_SPACE=13"),
    # the last --kv-cache-memory-bytes counts, in either spelling, in vLLM's size units
    (cpu_backend(extra_args=["--kv-cache-memory-bytes=16G"]), {}, "--kv-cache-memory-bytes 16G"),
    (cpu_backend(extra_args=["--kv-cache-memory-bytes", "13g"]), {}, "--kv-cache-memory-bytes 13g"),
    # two replicas of 7 GiB: neither alone, both together
    (cpu_backend([{"port": 9123}, {"port": 9124}], extra_args=["--kv-cache-memory-bytes", "7G"]), {},
     "q-r1 7.0 GiB"),
])
def test_kv_caches_of_half_the_machine_or_more_warn_in_one_line(backend, env, named):
    (line,) = _warnings(backend, env, 24 * GiB)
    assert "of this machine's 24.0 GiB" in line and named in line
    assert "VLLM_CPU_KVCACHE_SPACE" in line and "\n" not in line


def test_an_empty_vllm_cpu_kvcache_space_is_unset():
    assert _warnings(cpu_backend(), {"VLLM_CPU_KVCACHE_SPACE": ""}, 24 * GiB) == []


def test_a_small_kv_cache_from_the_environment_is_no_warning():
    assert _warnings(cpu_backend(), {"VLLM_CPU_KVCACHE_SPACE": "1"}, 24 * GiB) == []


def test_the_shipped_cpu_config_plans_one_cpu_replica_on_the_tiny_model():
    settings = load_settings(CPU_CONFIG)
    plan = plan_stack(settings, {}, total_memory=24 * GiB)
    assert plan.errors == [] and plan.warnings == []
    (command,) = plan.commands
    # a path written as relative is relative to the config file, like the proxy's own paths
    assert command.argv[2] == str(REPO / "models" / "tiny-qwen2.5-vl") and command.cpu
    assert command.argv[-len(CPU_ARGS):] == list(CPU_ARGS)
    assert plan_stack(settings, {"VLLM_CPU_KVCACHE_SPACE": "16"}, total_memory=24 * GiB).warnings


def test_up_warns_in_one_log_line_and_still_plans(capsys, monkeypatch):
    monkeypatch.setattr("launchers.plan.machine_memory", lambda: 24 * GiB)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "20")
    assert cli("up", "--config", str(CPU_CONFIG), "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    warned = [line for line in lines if line.startswith("warning: the CPU replicas' KV caches take 20.0 GiB")]
    assert len(warned) == 1, lines
    assert "GPU assignment: none (launch.device cpu)" in lines
    assert any(line.startswith("  qwen2_5_vl_vllm-r0: CPU, http://127.0.0.1:8001/v1") for line in lines)


def test_a_repo_id_as_model_path_is_not_made_a_path(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CPU_CONFIG.read_text().replace("../models/tiny-qwen2.5-vl", "Qwen/Qwen2.5-VL-7B-Instruct")
                      .replace("../prompts", str(REPO / "prompts")))
    (command,) = plan_stack(load_settings(config), {}, total_memory=24 * GiB).commands
    assert command.argv[2] == "Qwen/Qwen2.5-VL-7B-Instruct"


def test_up_ray_refuses_a_cpu_backend():
    from launchers.ray_up import ray_plan_errors

    settings = load_settings(CPU_CONFIG)
    plan = plan_stack(settings, {}, placed_by_ray=True)
    assert any("launch.device cpu" in e for e in ray_plan_errors(plan, settings, {}, with_proxy=False))


def test_config_error_type_is_what_a_bad_cpu_launch_raises(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CPU_CONFIG.read_text().replace("replicas: [{port: 8001}]", "replicas: [{port: 8001, gpus: [0]}]")
                      .replace("../prompts", str(REPO / "prompts")))
    with pytest.raises(ConfigError, match="device cpu uses no GPU"):
        load_settings(config)
