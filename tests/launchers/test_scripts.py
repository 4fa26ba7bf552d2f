"""launchers/serve_*.sh: argument handling, and the same flags as launchers/commands.py.

Each script runs for real with the stand-in `vllm` first on PATH (FAKE_VLLM_EXIT_CODE=0 makes it
record its argv and environment, then exit instead of serving)."""

from __future__ import annotations

import subprocess

import pytest

from launchers.commands import replica_commands, shell_line, vllm_argv
from proxy.config import BackendConfig
from tests.launchers.conftest import LAUNCHERS, PRIMO_MODEL, QWEN_MODEL, FakeVllmEnv

SCRIPTS = {
    "qwen": ("serve_qwen2_5_vl.sh", "QWEN2_5_VL_MODEL_PATH", QWEN_MODEL, 8001, "qwen_video"),
    "primo": ("serve_primo_r1.sh", "PRIMO_R1_MODEL_PATH", PRIMO_MODEL, 8002, "primo_interleave"),
}


@pytest.fixture
def run_script(fake_vllm_env: FakeVllmEnv):
    def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {**fake_vllm_env.env, "FAKE_VLLM_EXIT_CODE": "0", **env}
        return subprocess.run(["bash", str(LAUNCHERS / script), *args], capture_output=True,
                              text=True, env=full_env, timeout=30)

    return run


@pytest.mark.parametrize("which", SCRIPTS)
def test_help_documents_every_option(run_script, which):
    script, env_var, model, port, _ = SCRIPTS[which]
    result = run_script(script, "--help")
    assert result.returncode == 0, result.stderr
    for needle in ["--gpus", "CUDA_VISIBLE_DEVICES", "--tensor-parallel-size", "--port", "--host",
                   "127.0.0.1", "--served-model-name", "--max-model-len",
                   "--gpu-memory-utilization", "--limit-mm-per-prompt", "--media-io-kwargs",
                   '{"video": {"num_frames": -1}}', "--trust-request-mm-kwargs", "--seed",
                   "--dry-run", "MODEL_PATH", env_var, "VLLM_BIN", model, str(port)]:
        assert needle in result.stdout, needle


@pytest.mark.parametrize("which", SCRIPTS)
def test_script_and_python_build_the_same_command(run_script, fake_vllm_env, which):
    script, _, model, _, layout = SCRIPTS[which]
    result = run_script(script, "/models/it's here", "--gpus", "2,3", "--port", "9123",
                        "--max-model-len", "4096", "--gpu-memory-utilization", "0.55",
                        "--seed", "3", "--enforce-eager", "--", "--max-num-seqs", "8")
    assert result.returncode == 0, result.stderr
    backend = BackendConfig.model_validate({
        "model": model, "endpoints": ["http://127.0.0.1:9123/v1"], "layout": layout,
        "prompt": "p", "launch": {"model_path": "/models/it's here", "tensor_parallel_size": 2,
                                  "replicas": [{"gpus": [2, 3], "port": 9123}],
                                  "max_model_len": 4096, "gpu_memory_utilization": 0.55,
                                  "seed": 3, "extra_args": ["--enforce-eager", "--max-num-seqs", "8"]}})
    (command,), errors = replica_commands(which, backend, {})
    assert errors == []
    record = fake_vllm_env.record(9123)
    assert record["argv"][1:] == command.argv[1:]
    assert record["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    # The printed line is the one `vlm-reward-proxy up --dry-run` prints.
    assert result.stdout.splitlines()[0] == command.shell_line()


@pytest.mark.parametrize("which", SCRIPTS)
def test_defaults_agree_with_the_launch_config_defaults(run_script, fake_vllm_env, which):
    script, env_var, model, port, layout = SCRIPTS[which]
    result = run_script(script, "--gpus", "0", **{env_var: "/weights"})
    assert result.returncode == 0, result.stderr
    backend = BackendConfig.model_validate({
        "model": model, "endpoints": [f"http://127.0.0.1:{port}/v1"], "layout": layout,
        "prompt": "p", "launch": {"model_path": "/weights", "replicas": [{"gpus": [0], "port": port}]}})
    (command,), _ = replica_commands(which, backend, {})
    assert fake_vllm_env.record(port)["argv"][1:] == command.argv[1:]


def test_model_path_as_option_with_equals_and_tp_from_gpu_count(run_script, fake_vllm_env):
    result = run_script("serve_qwen2_5_vl.sh", "--model-path=/w/qwen", "--gpus=0,1", "--port=9200")
    assert result.returncode == 0, result.stderr
    argv = fake_vllm_env.record(9200)["argv"]
    assert argv[1:3] == ["serve", "/w/qwen"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "0"], "no model path: give MODEL_PATH or --model-path, or set PRIMO_R1_MODEL_PATH"),
    (["/m"], "--gpus is required"),
    (["/m", "--gpus", "a,b"], "--gpus must be comma-separated GPU indices"),
    (["/m", "--gpus", "1,1"], "lists a GPU twice"),
    (["/m", "--gpus", "0", "-tp", "2"], "--tensor-parallel-size 2 but --gpus 0 lists 1 GPU(s)"),
    (["/m", "--gpus", "0", "--port", "70000"], "--port must be 1-65535"),
    (["/m", "--gpus", "0", "--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization must be"),
    (["/m", "--gpus", "0", "--max-model-len", "0"], "--max-model-len must be a positive integer"),
    (["/m", "--gpus", "0", "--seed"], "--seed needs a value"),
    (["/m", "--gpus", "0", "--media-io-kwargs", "{}"], "--media-io-kwargs is always set"),
    (["/m", "--gpus", "0", "--", "--port=1"], "--port among the extra vllm flags"),
])
def test_bad_arguments_fail_before_vllm_starts(run_script, fake_vllm_env, args, message):
    result = run_script("serve_primo_r1.sh", *args, PRIMO_R1_MODEL_PATH="")
    assert result.returncode == 2
    assert message in result.stderr
    assert fake_vllm_env.records() == {}


@pytest.mark.parametrize("port", ["00", "08", "099999"])
def test_port_with_leading_zero_is_read_as_decimal(run_script, fake_vllm_env, port):
    result = run_script("serve_primo_r1.sh", "/m", "--gpus", "0", "--port", port, "--dry-run",
                        PRIMO_R1_MODEL_PATH="")
    assert "base" not in result.stderr and "value too great" not in result.stderr
    if port == "08":  # decimal 8: a valid port
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode == 2
        assert "--port must be 1-65535" in result.stderr
    assert fake_vllm_env.records() == {}


def test_dry_run_prints_without_running(run_script, fake_vllm_env):
    result = run_script("serve_primo_r1.sh", "/m", "--gpus", "2", "--dry-run")
    assert result.returncode == 0
    expected = vllm_argv(model_path="/m", served_model_name=PRIMO_MODEL, tensor_parallel_size=1,
                         max_model_len=16384, gpu_memory_utilization=0.9,
                         limit_mm={"image": 2, "video": 1}, host="127.0.0.1", port=8002, seed=0)
    assert result.stdout == shell_line(expected, {"CUDA_VISIBLE_DEVICES": "2"}) + "\n"
    assert fake_vllm_env.records() == {}


def test_missing_vllm_is_a_clear_error(run_script):
    result = run_script("serve_qwen2_5_vl.sh", "/m", "--gpus", "0", VLLM_BIN="/nonexistent/vllm")
    assert result.returncode == 2
    assert "'/nonexistent/vllm' not found" in result.stderr and "VLLM_BIN" in result.stderr


def test_vllm_exit_code_is_the_scripts_exit_code(run_script):
    result = run_script("serve_qwen2_5_vl.sh", "/m", "--gpus", "0", "--port", "9300",
                        FAKE_VLLM_EXIT_CODE="7")
    assert result.returncode == 7
    assert "exiting with code 7" in result.stdout
