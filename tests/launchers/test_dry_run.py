"""`vlm-reward-proxy up --dry-run`: commands, GPU assignment and checks, nothing started."""

from __future__ import annotations

import argparse
import sys

import pytest

from launchers.cli import add_subcommands
from tests.launchers.conftest import PRIMO_PATH, QWEN_PATH, REPO, stack_config, write_config

EXAMPLE = REPO / "configs" / "stack-4gpu.yaml"


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vlm-reward-proxy")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(autouse=True)
def model_paths(monkeypatch):
    monkeypatch.setenv("QWEN2_5_VL_MODEL_PATH", QWEN_PATH)
    monkeypatch.setenv("PRIMO_R1_MODEL_PATH", PRIMO_PATH)
    monkeypatch.delenv("VLLM_BIN", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_dry_run_of_the_shipped_config(capsys, tmp_path):
    assert cli("up", "--config", str(EXAMPLE), "--dry-run", "--runs-dir", "runs") == 0
    out = capsys.readouterr().out
    limit_primo = "'{\"image\": 2, \"video\": 1}'"
    tail = ("--max-model-len 16384 --gpu-memory-utilization 0.9 --limit-mm-per-prompt {limit} "
            "--media-io-kwargs '{{\"video\": {{\"num_frames\": -1}}}}' --trust-request-mm-kwargs "
            "--host 127.0.0.1 --port {port} --seed 0")
    expected = [
        "GPU assignment:",
        "  GPU 0: qwen2_5_vl_vllm-r0",
        "  GPU 1: qwen2_5_vl_vllm-r0",
        "  GPU 2: PRIMO-R1-r0",
        "  GPU 3: PRIMO-R1-r1",
        "vllm serve processes:",
        "  qwen2_5_vl_vllm-r0: GPUs 0,1, http://127.0.0.1:8001/v1, "
        "log runs/<timestamp>/qwen2_5_vl_vllm-r0.log",
        f"    CUDA_VISIBLE_DEVICES=0,1 vllm serve {QWEN_PATH} --served-model-name "
        "Qwen2.5-VL-7B-Instruct --tensor-parallel-size 2 "
        + tail.format(limit="'{\"video\": 1}'", port=8001),
        "  PRIMO-R1-r0: GPU 2, http://127.0.0.1:8002/v1, log runs/<timestamp>/PRIMO-R1-r0.log",
        f"    CUDA_VISIBLE_DEVICES=2 vllm serve {PRIMO_PATH} --served-model-name PRIMO-R1-7B "
        "--tensor-parallel-size 1 " + tail.format(limit=limit_primo, port=8002),
        "  PRIMO-R1-r1: GPU 3, http://127.0.0.1:8003/v1, log runs/<timestamp>/PRIMO-R1-r1.log",
        f"    CUDA_VISIBLE_DEVICES=3 vllm serve {PRIMO_PATH} --served-model-name PRIMO-R1-7B "
        "--tensor-parallel-size 1 " + tail.format(limit=limit_primo, port=8003),
        "proxy: http://127.0.0.1:18080, log runs/<timestamp>/proxy.log",
        f"    {sys.executable} -m vlm_reward_cli serve --config {EXAMPLE}",
    ]
    lines = out.splitlines()
    start = lines.index("GPU assignment:")
    assert lines[start:start + len(expected)] == expected
    assert "checks: ok (no GPU overlap, no port clash, endpoints match)" in lines
    assert not (tmp_path / "runs").exists()


def test_dry_run_reports_gpu_overlap_unless_allowed(capsys, tmp_path):
    data = stack_config(proxy_port=18080, qwen_replicas=[{"gpus": [0, 1], "port": 8001}],
                        primo_replicas=[{"gpus": [1], "port": 8002}])
    config = write_config(tmp_path / "c.yaml", data)
    assert cli("up", "--config", str(config), "--dry-run") == 2
    out = capsys.readouterr().out
    assert "  GPU 1: qwen2_5_vl_vllm-r0, PRIMO-R1-r0   <-- OVERLAP" in out
    assert "error: GPU 1 is shared by qwen2_5_vl_vllm-r0 and PRIMO-R1-r0" in out
    assert "checks: 1 error(s)" in out
    assert cli("up", "--config", str(config), "--dry-run", "--allow-gpu-overlap") == 0
    assert "warning: GPU 1 is shared" in capsys.readouterr().out


def test_dry_run_reports_port_clash_and_unset_model_path(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("PRIMO_R1_MODEL_PATH")
    data = stack_config(proxy_port=8002, qwen_replicas=[{"gpus": [0], "port": 8001}],
                        primo_replicas=[{"gpus": [1], "port": 8002}])
    config = write_config(tmp_path / "c.yaml", data)
    assert cli("up", "--config", str(config), "--dry-run") == 2
    out = capsys.readouterr().out
    assert "error: port 8002 is used by PRIMO-R1-r0 and the proxy (proxy.port)" in out
    assert "environment variable PRIMO_R1_MODEL_PATH is not set" in out
    assert "vllm serve '${PRIMO_R1_MODEL_PATH}'" in out


def test_plan_errors_stop_up_before_anything_starts(capsys, tmp_path):
    data = stack_config(proxy_port=18080, qwen_replicas=[{"gpus": [0], "port": 8001}],
                        primo_replicas=[{"gpus": [1], "port": 8002}], primo_endpoints=[8012])
    config = write_config(tmp_path / "c.yaml", data)
    assert cli("up", "--config", str(config), "--runs-dir", str(tmp_path / "runs")) == 2
    err = capsys.readouterr().err
    assert "error: backends.PRIMO-R1.launch.replicas[0] serves port 8002 but no endpoint" in err
    assert not (tmp_path / "runs").exists()


def test_invalid_config_is_reported(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("backends: {x: {model: m, endpoints: [http://h/v1], layout: qwen_video, "
                      "prompt: p, launch: {model_path: /m, tensor_parallel_size: 2, "
                      "replicas: [{gpus: [0], port: 8001}]}}}\n")
    assert cli("up", "--config", str(config), "--dry-run") == 2
    assert "replicas[0].gpus has 1 GPUs but tensor_parallel_size is 2" in capsys.readouterr().err


def test_up_and_down_are_registered_with_help(capsys):
    with pytest.raises(SystemExit):
        cli("up", "--help")
    out = capsys.readouterr().out
    for option in ["--config", "--dry-run", "--allow-gpu-overlap", "--timeout", "--grace",
                   "--runs-dir", "--pid-file", "--detach", "--no-proxy", "--logs", "--vllm"]:
        assert option in out


def test_dry_run_maps_gpus_through_the_parents_cuda_visible_devices(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert cli("up", "--config", str(EXAMPLE), "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("this process has CUDA_VISIBLE_DEVICES=4,5,6,7: replicas[].gpus are positions in "
            "that list") in lines
    assert "  GPU 1 (device 5): qwen2_5_vl_vllm-r0" in lines
    assert any(line.startswith("  qwen2_5_vl_vllm-r0: GPUs 0,1 (-> CUDA_VISIBLE_DEVICES=4,5), ")
               for line in lines)
    assert any(line.startswith("    CUDA_VISIBLE_DEVICES=7 vllm serve ") for line in lines)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert cli("up", "--config", str(EXAMPLE), "--dry-run") == 2
    out = capsys.readouterr().out
    assert "backends.PRIMO-R1.launch.replicas[0].gpus [2]: GPU position(s) [2] out of range" in out


def test_dry_run_shows_each_replicas_own_environment(capsys, tmp_path):
    data = stack_config(proxy_port=18080, qwen_replicas=[{"gpus": [0], "port": 8001}],
                        primo_replicas=[{"gpus": [1], "port": 8002, "env": {"OMP_NUM_THREADS": "2"}},
                                        {"gpus": [2], "port": 8003, "env": {"OMP_NUM_THREADS": "6"}}],
                        primo_launch={"env": {"VLLM_LOGGING_LEVEL": "DEBUG", "OMP_NUM_THREADS": "1"}})
    config = write_config(tmp_path / "c.yaml", data)
    assert cli("up", "--config", str(config), "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line.strip() for line in lines if " vllm serve " in line]
    assert commands[0].startswith(f"CUDA_VISIBLE_DEVICES=0 vllm serve {QWEN_PATH} ")
    assert commands[1].startswith("CUDA_VISIBLE_DEVICES=1 VLLM_LOGGING_LEVEL=DEBUG OMP_NUM_THREADS=2 "
                                  f"vllm serve {PRIMO_PATH} ")
    assert commands[2].startswith("CUDA_VISIBLE_DEVICES=2 VLLM_LOGGING_LEVEL=DEBUG OMP_NUM_THREADS=6 "
                                  f"vllm serve {PRIMO_PATH} ")


def test_only_starts_one_backend_of_the_shipped_config_without_the_others_model_path(capsys, monkeypatch):
    """Run B needs Qwen alone: the 4-GPU config, unedited, starts only it, with a proxy serving only it
    (PRIMO-R1's model path may be unset)."""
    monkeypatch.delenv("PRIMO_R1_MODEL_PATH")
    assert cli("up", "--config", str(EXAMPLE), "--dry-run", "--only", "qwen2_5_vl_vllm") == 0
    out = capsys.readouterr().out
    assert "  qwen2_5_vl_vllm-r0: GPUs 0,1, http://127.0.0.1:8001/v1" in out
    assert "PRIMO-R1" not in out and "GPU 2" not in out
    assert f"    {sys.executable} -m vlm_reward_cli serve --config {EXAMPLE} --only qwen2_5_vl_vllm" in out
    assert "checks: ok" in out
    # an alias names its backend; an unknown name lists the config's backends
    monkeypatch.setenv("PRIMO_R1_MODEL_PATH", PRIMO_PATH)
    assert cli("up", "--config", str(EXAMPLE), "--dry-run", "--only", "primo_r1_vllm") == 0
    out = capsys.readouterr().out
    assert "  PRIMO-R1-r1: GPU 3" in out and "qwen2_5_vl_vllm" not in out.replace("--only primo_r1_vllm", "")
    assert cli("up", "--config", str(EXAMPLE), "--dry-run", "--only", "gpt-9") == 2
    assert "backend 'gpt-9' is not in config" in capsys.readouterr().err


def test_the_proxy_serves_only_the_backends_named(tmp_path):
    from proxy.config import load_settings

    settings = load_settings(EXAMPLE, only=["qwen2_5_vl_vllm"])
    assert list(settings.backends) == ["qwen2_5_vl_vllm"]
    assert list(load_settings(EXAMPLE, only=["primo_r1_vllm", "qwen2_5_vl_vllm"]).backends) == [
        "qwen2_5_vl_vllm", "PRIMO-R1"]
