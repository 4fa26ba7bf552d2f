"""`vlm-reward-proxy up` / `down` for real: subprocesses, the stand-in `vllm`, loopback ports."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path

import httpx
import pytest

from launchers.plan import plan_stack
from proxy.config import load_settings
from tests.launchers.conftest import (
    HANG_S,
    FakeVllmEnv,
    Reaper,
    alive,
    free_ports,
    stack_config,
    wait_until,
    write_config,
)

FAST = ["--poll-interval", "0.1", "--progress-interval", "0.3", "--grace", "3"]


def three_replicas(tmp_path: Path, **kwargs) -> tuple[Path, list[int]]:
    """Qwen TP=2 on GPUs 0,1; PRIMO on 2 and a second replica on 3; plus the proxy port."""
    ports = free_ports(4)
    data = stack_config(proxy_port=ports[3], qwen_replicas=[{"gpus": [0, 1], "port": ports[0]}],
                        primo_replicas=[{"gpus": [2], "port": ports[1]},
                                        {"gpus": [3], "port": ports[2]}], **kwargs)
    return write_config(tmp_path / "stack.yaml", data), ports


def running_pid_file(pid_file: Path, up=None) -> dict:
    def check():
        if up is not None and up.poll() is not None:
            raise AssertionError(f"up exited with {up.returncode}")
        try:
            data = json.loads(pid_file.read_text())
        except (OSError, ValueError):
            return None
        return data if data["state"] == "running" else None

    return wait_until(check, HANG_S, "the stack to be running")


def endpoint_health(proxy_port: int) -> dict:
    with httpx.Client(trust_env=False, timeout=5) as http:
        return http.get(f"http://127.0.0.1:{proxy_port}/health").json()


def test_up_assigns_gpus_waits_for_loading_runs_the_proxy_and_stops_everything(
        tmp_path: Path, fake_vllm_env: FakeVllmEnv, reaper: Reaper):
    config, (qwen, primo0, primo1, proxy_port) = three_replicas(
        tmp_path, qwen_launch={"env": {"FAKE_VLLM_DELAY_S": "2.0"}})
    out, pid_file = tmp_path / "up.out", tmp_path / "runs" / "stack.json"
    up = reaper.up("--config", str(config), "--runs-dir", str(tmp_path / "runs"), *FAST,
                   "--logs", "none", out=out, FAKE_VLLM_SPAWN_WORKER="1")
    state = running_pid_file(pid_file, up)
    text = out.read_text()
    # Progress while Qwen loads, then ready lines, then the proxy.
    assert "waiting for 1 server(s); ready: PRIMO-R1-r0" in text
    assert "qwen2_5_vl_vllm-r0: loading for" in text and "(connection refused (not started, or still loading))" in text
    ready = re.search(rf"ready: qwen2_5_vl_vllm-r0 at http://127.0.0.1:{qwen} after ([\d.]+)s", text)
    assert ready and float(ready.group(1)) >= 2.0
    assert f"stack is up: qwen2_5_vl_vllm-r0, PRIMO-R1-r0, PRIMO-R1-r1; proxy at " \
           f"http://127.0.0.1:{proxy_port}" in text

    # Flags and GPUs per backend and per replica, exactly as planned.
    plan = plan_stack(load_settings(config), fake_vllm_env.env)
    records = fake_vllm_env.records()
    for command in plan.commands:
        record = records[command.port]
        assert record["argv"][1:] == command.argv[1:]
        assert record["env"]["CUDA_VISIBLE_DEVICES"] == command.env["CUDA_VISIBLE_DEVICES"]
        assert record["pgid"] == record["pid"]  # its own process group
    assert [records[p]["env"]["CUDA_VISIBLE_DEVICES"] for p in (qwen, primo0, primo1)] == [
        "0,1", "2", "3"]
    assert records[qwen]["env"]["FAKE_VLLM_DELAY_S"] == "2.0"  # launch.env reaches the server
    run_dir = Path(state["run_dir"])
    assert sorted(p.name for p in run_dir.glob("*.log")) == [
        "PRIMO-R1-r0.log", "PRIMO-R1-r1.log", "proxy.log", "qwen2_5_vl_vllm-r0.log"]
    assert "model loaded" in (run_dir / "qwen2_5_vl_vllm-r0.log").read_text()

    assert endpoint_health(proxy_port)["status"] == "ok"
    # A server that dies after loading: reported by `up`, and the proxy's /health says so.
    os.kill(records[primo1]["pid"], signal.SIGKILL)

    def primo1_down():
        entries = endpoint_health(proxy_port)["backends"]["PRIMO-R1"]["endpoints"]
        return [e for e in entries if e["url"].endswith(f":{primo1}/v1") and not e["ready"]]

    wait_until(primo1_down, HANG_S, "the proxy to mark the dead endpoint")
    wait_until(lambda: "error: PRIMO-R1-r1" in out.read_text(), HANG_S, "up to report the death")
    assert endpoint_health(proxy_port)["backends"]["PRIMO-R1"]["ready"]  # r0 still serves

    proxy_pid = next(p["pid"] for p in state["processes"] if p["name"] == "proxy")
    up.send_signal(signal.SIGTERM)
    assert up.wait(30) == 0
    text = out.read_text()
    assert f"qwen2_5_vl_vllm-r0 (pid {records[qwen]['pid']}): was killed by SIGTERM" in text
    assert f"PRIMO-R1-r1 (pid {records[primo1]['pid']}): was killed by SIGKILL" in text
    assert f"proxy (pid {proxy_pid}):" in text
    for pid in [*fake_vllm_env.all_pids(), proxy_pid]:
        assert not alive(pid), pid
    assert not pid_file.exists()


def test_a_server_dying_while_loading_stops_the_rest(tmp_path, fake_vllm_env, reaper):
    config, (qwen, primo0, _, _) = three_replicas(tmp_path)
    # Qwen loads for longer than `reaper.run` waits (60 s; the stand-in's lifetime is 120 s):
    # `up` can only have returned by giving up on it when PRIMO-R1-r0 died.
    result = reaper.run("up", "--config", str(config), "--no-proxy", "--runs-dir",
                        str(tmp_path / "runs"), *FAST, **{
                            f"FAKE_VLLM_DELAY_S_{qwen}": "3600", f"FAKE_VLLM_DELAY_S_{primo0}": "0.3",
                            f"FAKE_VLLM_EXIT_CODE_{primo0}": "3", "FAKE_VLLM_SPAWN_WORKER": "1"})
    assert result.returncode == 1
    assert "PRIMO-R1-r0 (pid" in result.stderr
    assert "exited with code 3 while loading" in result.stderr
    assert "ERROR fake vllm: exiting with code 3 as asked" in result.stderr  # the log's tail
    qwen_pid = fake_vllm_env.records()[qwen]["pid"]
    assert f"qwen2_5_vl_vllm-r0 (pid {qwen_pid}): was killed by SIGTERM" in result.stdout  # stopped, and reported
    assert "ready: qwen2_5_vl_vllm-r0" not in result.stdout + result.stderr  # still loading when stopped
    for pid in fake_vllm_env.all_pids():
        assert not alive(pid), pid


def test_a_server_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, fake_vllm_env,
                                                                    reaper):
    config, (qwen, primo0, _, _) = three_replicas(tmp_path)
    pid_file = tmp_path / "stack.json"
    out = tmp_path / "up.out"
    up = reaper.up("--config", str(config), "--no-proxy", "--pid-file", str(pid_file),
                   "--runs-dir", str(tmp_path / "runs"), "--poll-interval", "0.1",
                   "--grace", "0.5", out=out, **{f"FAKE_VLLM_IGNORE_SIGTERM_{primo0}": "1",
                                                 "FAKE_VLLM_SPAWN_WORKER": "1"})
    running_pid_file(pid_file, up)
    up.send_signal(signal.SIGINT)  # what Ctrl-C sends
    assert up.wait(30) == 0
    text = out.read_text()
    pid = fake_vllm_env.records()[primo0]["pid"]
    assert f"PRIMO-R1-r0 (pid {pid}): was killed by SIGKILL (still running 0.5s after SIGTERM)" in text
    assert "qwen2_5_vl_vllm-r0 (pid" in text and "was killed by SIGTERM" in text
    assert len(fake_vllm_env.all_pids()) == 6  # three servers, three worker stand-ins
    for pid in fake_vllm_env.all_pids():
        assert not alive(pid), pid


def test_readiness_timeout_fails_and_stops_everything(tmp_path, fake_vllm_env, reaper):
    config, (qwen, *_) = three_replicas(tmp_path)
    result = reaper.run("up", "--config", str(config), "--no-proxy", "--timeout", "1",
                        "--runs-dir", str(tmp_path / "runs"), *FAST,
                        **{f"FAKE_VLLM_DELAY_S_{qwen}": "30"})
    assert result.returncode == 1
    assert ("timed out after 1s waiting for qwen2_5_vl_vllm-r0 (connection refused (not started, or still loading))"
            in result.stderr)
    assert "loading /models/Qwen2.5-VL-7B-Instruct" in result.stderr  # its log's last lines
    for pid in fake_vllm_env.all_pids():
        assert not alive(pid), pid


def test_detach_then_down(tmp_path, fake_vllm_env, reaper):
    config, ports = three_replicas(tmp_path)
    runs = tmp_path / "runs"
    result = reaper.run("up", "--config", str(config), "--detach", "--runs-dir", str(runs), *FAST)
    state = json.loads((runs / "stack.json").read_text())
    reaper.groups.add(state["up_pid"])
    assert result.returncode == 0, result.stderr
    assert "stack is up; stop it with: vlm-reward-proxy down --pid-file" in result.stdout
    assert "Ctrl-C" not in result.stdout  # the echoed log of the background `up` says `down` only
    assert f"Stop with `vlm-reward-proxy down --pid-file {runs / 'stack.json'}`" in result.stdout
    assert state["state"] == "running" and alive(state["up_pid"])
    pids = fake_vllm_env.all_pids()
    assert len(pids) == 3 and all(alive(p) for p in pids)
    # A second stack on the same pid file is refused.
    again = reaper.run("up", "--config", str(config), "--runs-dir", str(runs), *FAST)
    assert again.returncode == 2 and "a stack is already running" in again.stderr

    down = reaper.run("down", "--runs-dir", str(runs), "--grace", "3")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stack stopped" in down.stdout
    for pid in [*pids, state["up_pid"], *(p["pid"] for p in state["processes"])]:
        assert not alive(pid), pid
    assert not (runs / "stack.json").exists()
    up_log = (Path(state["run_dir"]) / "up.log").read_text()
    for process in state["processes"]:
        assert f"{process['name']} (pid {process['pid']}): " in up_log


def test_down_stops_the_servers_of_a_killed_up(tmp_path, fake_vllm_env, reaper):
    config, ports = three_replicas(tmp_path)
    pid_file = tmp_path / "my.json"
    result = reaper.run("up", "--config", str(config), "--detach", "--no-proxy", "--pid-file",
                        str(pid_file), "--runs-dir", str(tmp_path / "runs"), *FAST,
                        FAKE_VLLM_SPAWN_WORKER="1")
    assert result.returncode == 0, result.stderr
    state = json.loads(pid_file.read_text())
    reaper.groups.add(state["up_pid"])
    os.kill(state["up_pid"], signal.SIGKILL)  # no chance to clean up
    wait_until(lambda: not alive(state["up_pid"]), HANG_S, "up to die")
    pids = fake_vllm_env.all_pids()
    assert all(alive(p) for p in pids)
    down = reaper.run("down", "--pid-file", str(pid_file), "--grace", "3")
    assert down.returncode == 0, down.stdout + down.stderr
    for pid in pids:
        assert not alive(pid), pid
    assert not pid_file.exists()


def test_down_without_a_stack(tmp_path, reaper):
    result = reaper.run("down", "--pid-file", str(tmp_path / "none.json"))
    assert result.returncode == 1 and "no running stack" in result.stdout


def test_a_busy_port_is_refused_before_anything_starts(tmp_path, fake_vllm_env, reaper):
    config, (qwen, *_) = three_replicas(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", qwen))
        busy.listen()
        result = reaper.run("up", "--config", str(config), "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert f"port {qwen} on 127.0.0.1 (qwen2_5_vl_vllm-r0) is not free" in result.stderr
    assert fake_vllm_env.records() == {}


def test_a_missing_vllm_executable_is_a_clear_error(tmp_path, fake_vllm_env, reaper):
    config, _ = three_replicas(tmp_path)
    result = reaper.run("up", "--config", str(config), "--vllm", "/nonexistent/vllm",
                        "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert "vllm executable '/nonexistent/vllm' not found" in result.stderr


def failure_line(text: str, name: str) -> str:
    """The one-line summary `up` printed for `name` (the line that starts its error)."""
    return next(line for line in text.splitlines() if line.startswith(f"error: {name} (pid "))


@pytest.mark.parametrize(("setting", "described"), [
    ({"EXIT_CODE": "1", "TRACEBACK": "RuntimeError: CUDA out of memory (fake)"},
     "exited with code 1 while loading"),
    ({"EXIT_CODE": "0"}, "exited on its own (code 0) while loading"),
    ({"EXIT_SIGNAL": "SIGSEGV"}, "was killed by SIGSEGV while loading"),
])
def test_a_server_dying_while_loading_is_described_precisely(tmp_path, fake_vllm_env, reaper,
                                                              setting, described):
    config, (qwen, primo0, _, _) = three_replicas(tmp_path)
    result = reaper.run("up", "--config", str(config), "--no-proxy", "--runs-dir",
                        str(tmp_path / "runs"), *FAST, **{
                            f"FAKE_VLLM_DELAY_S_{qwen}": "30", f"FAKE_VLLM_DELAY_S_{primo0}": "0.3",
                            **{f"FAKE_VLLM_{k}_{primo0}": v for k, v in setting.items()}})
    assert result.returncode == 1
    pid = fake_vllm_env.records()[primo0]["pid"]
    summary = failure_line(result.stderr, "PRIMO-R1-r0")
    assert summary.startswith(f"error: PRIMO-R1-r0 (pid {pid}) {described}, after ")
    assert "exited with code 0" not in result.stderr + result.stdout
    if "TRACEBACK" in setting:  # the one-line summary quotes the error; the tail shows the rest
        assert (f"s; last error in its log: (APIServer pid={pid}) RuntimeError: CUDA out of memory "
                "(fake); last lines of ") in summary
        assert "EngineCore failed to start." in result.stderr
    elif "EXIT_CODE" in setting:
        assert "; last error in its log: ERROR fake vllm: exiting with code 0 as asked" in summary
    else:
        assert "last error in its log" not in summary
    assert f"PRIMO-R1-r0 (pid {pid}): {described.split(' while ')[0]} before the stop" in result.stdout
    for pid in fake_vllm_env.all_pids():
        assert not alive(pid), pid


def test_replica_env_reaches_only_its_server_and_a_code_0_exit_while_serving_is_reported(
        tmp_path, fake_vllm_env, reaper):
    ports = free_ports(4)
    crash = {"FAKE_VLLM_CRASH_AFTER_S": "1.5", "FAKE_VLLM_TRACEBACK": "RuntimeError: engine died (fake)"}
    data = stack_config(proxy_port=ports[3], qwen_replicas=[{"gpus": [0], "port": ports[0]}],
                        primo_replicas=[{"gpus": [1], "port": ports[1], "env": crash},
                                        {"gpus": [2], "port": ports[2],
                                         "env": {"OMP_NUM_THREADS": "${R1_THREADS}"}}],
                        primo_launch={"env": {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "DEBUG"}})
    config = write_config(tmp_path / "stack.yaml", data)
    out, pid_file = tmp_path / "up.out", tmp_path / "stack.json"
    up = reaper.up("--config", str(config), "--no-proxy", "--pid-file", str(pid_file),
                   "--runs-dir", str(tmp_path / "runs"), *FAST, out=out, R1_THREADS="6")
    state = running_pid_file(pid_file, up)
    records = fake_vllm_env.records()
    envs = [records[p]["env"] for p in ports[:3]]
    assert [e.get("OMP_NUM_THREADS") for e in envs] == [None, "1", "6"]
    assert [e.get("VLLM_LOGGING_LEVEL") for e in envs] == [None, "DEBUG", "DEBUG"]
    assert [e.get("FAKE_VLLM_CRASH_AFTER_S") for e in envs] == [None, "1.5", None]
    commands_sh = (Path(state["run_dir"]) / "commands.sh").read_text().splitlines()
    assert commands_sh[3].startswith("CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=1 VLLM_LOGGING_LEVEL=DEBUG "
                                     "FAKE_VLLM_CRASH_AFTER_S=1.5 "
                                     "FAKE_VLLM_TRACEBACK='RuntimeError: engine died (fake)' vllm serve ")
    assert commands_sh[5].startswith("CUDA_VISIBLE_DEVICES=2 OMP_NUM_THREADS=6 "
                                     "VLLM_LOGGING_LEVEL=DEBUG vllm serve ")

    pid = records[ports[1]]["pid"]
    wait_until(lambda: "error: PRIMO-R1-r0" in out.read_text(), HANG_S, "up to report the exit")
    summary = failure_line(out.read_text(), "PRIMO-R1-r0")
    assert summary.startswith(f"error: PRIMO-R1-r0 (pid {pid}) exited on its own (code 0) while "
                              "serving, after ")
    assert (f"; last error in its log: (APIServer pid={pid}) RuntimeError: engine died (fake); the "
            f"proxy now reports http://127.0.0.1:{ports[1]}/v1 as not ready") in summary
    up.send_signal(signal.SIGTERM)
    assert up.wait(30) == 0
    text = out.read_text()
    assert (f"PRIMO-R1-r0 (pid {pid}): exited on its own (code 0) before the stop; last error in "
            f"its log: (APIServer pid={pid}) RuntimeError: engine died (fake)") in text
    assert "exited with code 0" not in text
    assert f"PRIMO-R1-r1 (pid {records[ports[2]]['pid']}): was killed by SIGTERM" in text
