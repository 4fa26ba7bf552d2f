"""`up --ray` on a real local Ray cluster: two Ray nodes on this machine, each declaring 2 GPUs,
the stand-in `vllm` as the server. Placement (no GPU shared, a TP=2 replica on one node), the
proxy serving through the placed replicas with their keys, a killed replica restarted and taking
traffic again (or removed once its restarts are spent), and a stop that leaves no actor,
placement group or process behind."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from launchers.ray_stack import NAMESPACE
from tests.fakes.episodes import episode_frames, npy_b64
from tests.launchers.conftest import (
    FAKE_BIN,
    HANG_S,
    FakeVllmEnv,
    Reaper,
    alive,
    free_ports,
    stack_config,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow

KEYS = {"QWEN_KEY": "qwen-secret", "PRIMO_KEY": "primo-secret", "PROXY_KEY": "proxy-secret",
        "PROXY_ADMIN_KEY": "proxy-admin-secret"}  # `up --ray` registers replicas with the admin key
EPISODE = {"task_text": "put the bowl on the plate", "frames_npy": npy_b64(episode_frames(4, 64, 64)), "fps": 4.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and a worker node, 2 GPUs and 4 CPUs each (declared: Ray hands out their ids)."""
    small = {"num_cpus": 4, "num_gpus": 2, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    cluster.add_node(**small, resources={"reward_node": 4})  # the node kept for reward servers
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def ray_config(tmp_path: Path, fake: FakeVllmEnv, *, qwen_tp: int = 2, primo_tp: int = 1,
               primo_replicas: int = 2) -> tuple[Path, int]:
    """Qwen at TP=2 and two PRIMO-R1 replicas (whose <answer> the stand-in's replies carry)."""
    proxy_port, q1, p1, p2 = free_ports(4)
    node_env = {"PATH": os.pathsep.join([str(FAKE_BIN), str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
                "FAKE_VLLM_RECORD_DIR": str(fake.record_dir), "FAKE_VLLM_LIFETIME_S": "600", "PYTHONUNBUFFERED": "1"}
    data = stack_config(proxy_port=proxy_port, media_root=str(tmp_path),
                        qwen_replicas=[{"gpus": list(range(qwen_tp)), "port": q1}],
                        primo_replicas=[{"gpus": list(range(primo_tp)), "port": p} for p in (p1, p2)[:primo_replicas]],
                        qwen_launch={"env": node_env}, primo_launch={"env": node_env})
    data["proxy"]["api_key_env"] = "PROXY_KEY"
    data["proxy"]["admin_api_key_env"] = "PROXY_ADMIN_KEY"
    data["backends"]["qwen2_5_vl_vllm"]["api_key_env"] = "QWEN_KEY"
    data["backends"]["PRIMO-R1"]["api_key_env"] = "PRIMO_KEY"
    return write_config(tmp_path / "stack.yaml", data), proxy_port


def up_ray(reaper: Reaper, cluster: Cluster, config: Path, tmp_path: Path, *extra: str):
    out = tmp_path / "up.out"
    popen = reaper.up("--config", str(config), "--ray", cluster.address, "--runs-dir", str(tmp_path / "runs"),
                      "--poll-interval", "0.3", "--grace", "5", "--timeout", "60", *extra, out=out, **KEYS)
    return popen, out


def wait_for_line(out: Path, popen, text: str, timeout_s: float = 120) -> str:
    def seen():
        body = out.read_text(errors="replace")
        if text in body:
            return body
        assert popen.poll() is None, f"`up` exited {popen.returncode} before {text!r}:\n{body}"
        return None

    return wait_until(seen, timeout_s, f"{text!r} in the output of `up --ray`")


def placement_file(tmp_path: Path) -> Path:
    return next((tmp_path / "runs").glob("*/placement.json"))


def placement(tmp_path: Path) -> list[dict]:
    return json.loads(placement_file(tmp_path).read_text())


def kill_actor(cluster: Cluster, name: str) -> None:
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    finally:
        ray.shutdown()


def score(http: httpx.Client, backend: str = "PRIMO-R1") -> httpx.Response:
    # A new group each call: affinity routing sends one group to one home replica.
    return http.post("/score", json={**EPISODE, "backend": backend, "metadata": {"group_id": os.urandom(8).hex()}})


def calls_to(http: httpx.Client, url: str) -> float:
    prefix = f'vlm_proxy_upstream_calls_total{{backend="PRIMO-R1",endpoint="{url}",result="ok"}} '
    return sum(float(line[len(prefix):]) for line in http.get("/metrics").text.splitlines() if line.startswith(prefix))


def admin_urls(http: httpx.Client, backend: str) -> list[str]:
    return [e["url"] for e in http.get("/admin/endpoints").json()["backends"][backend]]


def leftovers(cluster: Cluster, fake: FakeVllmEnv) -> list[str]:
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        left = [f"actor {a}" for a in ray.util.list_named_actors(all_namespaces=True)]
        left += [f"placement group {pg['name']} ({pg['state']})" for pg in ray.util.placement_group_table().values()
                 if pg["state"] != "REMOVED"]
        if ray.available_resources().get("GPU") != 4.0:
            left.append(f"GPUs still held: {ray.available_resources().get('GPU')} of 4 free")
    finally:
        ray.shutdown()
    return left + [f"server pid {pid}" for pid in fake.all_pids() if alive(pid)]


def assert_nothing_left(cluster: Cluster, fake: FakeVllmEnv) -> None:
    # Ray's resource view catches up with removed placement groups a moment later
    wait_until(lambda: not leftovers(cluster, fake), HANG_S, "nothing left on the cluster")


def test_up_ray_places_serves_restarts_and_leaves_nothing(cluster, reaper, fake_vllm_env, tmp_path):
    config, proxy_port = ray_config(tmp_path, fake_vllm_env)
    popen, out = up_ray(reaper, cluster, config, tmp_path)
    wait_for_line(out, popen, "stack is up")
    placed = placement(tmp_path)
    assert len(placed) == 3 and all(p["state"] == "serving" for p in placed)
    gpus = [(p["node_id"], g) for p in placed for g in p["gpus"]]
    assert len(gpus) == len(set(gpus)) == 4  # every declared GPU used once: none shared
    qwen = next(p for p in placed if p["backend"] == "qwen2_5_vl_vllm")
    assert len(qwen["gpus"]) == 2  # TP=2: both on the one node its bundle packed
    records = fake_vllm_env.records()
    for p in placed:  # the stock command line, on the node's address, with Ray's GPUs and the key
        record = records[int(p["url"].rsplit(":", 1)[1].split("/")[0])]
        argv = record["argv"]
        assert argv[argv.index("--host") + 1] == p["node_ip"] and "--trust-request-mm-kwargs" in argv
        assert record["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(p["gpus"])
        assert record["env"]["VLLM_API_KEY"] == KEYS["PRIMO_KEY" if p["backend"] == "PRIMO-R1" else "QWEN_KEY"]

    primo = [p for p in placed if p["backend"] == "PRIMO-R1"]
    with httpx.Client(base_url=f"http://127.0.0.1:{proxy_port}", timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {KEYS['PROXY_ADMIN_KEY']}"}) as http:
        assert sorted(admin_urls(http, "PRIMO-R1")) == sorted(p["url"] for p in primo)
        assert admin_urls(http, "qwen2_5_vl_vllm") == [qwen["url"]]
        first = score(http)
        assert first.status_code == 200, first.text
        victim = primo[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for_line(out, popen, f"error: {victim['name']} at {victim['url']} exited")
        for _ in range(4):  # the other replica carries the backend meanwhile
            assert score(http).status_code == 200
        wait_for_line(out, popen, f"ready again: {victim['name']}")  # said before the proxy is told
        wait_until(lambda: victim["url"] in admin_urls(http, "PRIMO-R1"), HANG_S, "the proxy to take it back")
        restarted = next(p for p in placement(tmp_path) if p["name"] == victim["name"])
        assert restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
        before = calls_to(http, victim["url"])
        wait_until(lambda: score(http).status_code == 200 and calls_to(http, victim["url"]) > before, HANG_S,
                   "the restarted replica to take traffic")

        # The other one's actor killed (its worker or node lost): the server dies with it, and a new
        # actor, started across the watch's rounds, serves the replica again.
        other = primo[1]
        kill_actor(cluster, f"{placement_file(tmp_path).parent.name}/{other['name']}")
        wait_for_line(out, popen, f"error: {other['name']} at {other['url']} exited (its actor is gone")
        wait_for_line(out, popen, f"ready again: {other['name']}")
        wait_until(lambda: other["url"] in admin_urls(http, "PRIMO-R1"), HANG_S, "the proxy to take it back")
        again = next(p for p in placement(tmp_path) if p["name"] == other["name"])
        assert again["restarts"] == 1 and again["pid"] != other["pid"] and not alive(other["pid"])

    popen.send_signal(signal.SIGTERM)
    assert popen.wait(60) == 0, out.read_text()
    assert "GPUs released" in out.read_text()
    assert_nothing_left(cluster, fake_vllm_env)


def test_a_replica_past_its_restarts_leaves_the_proxy(cluster, reaper, fake_vllm_env, tmp_path):
    config, proxy_port = ray_config(tmp_path, fake_vllm_env)
    popen, out = up_ray(reaper, cluster, config, tmp_path, "--max-restarts", "0")
    wait_for_line(out, popen, "stack is up")
    victim = next(p for p in placement(tmp_path) if p["backend"] == "PRIMO-R1")
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for_line(out, popen, f"removed: {victim['name']} after 0 restart(s)")
    with httpx.Client(base_url=f"http://127.0.0.1:{proxy_port}", timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {KEYS['PROXY_ADMIN_KEY']}"}) as http:
        # removal is asked at once; the endpoint leaves once its calls in flight drained
        wait_until(lambda: victim["url"] not in admin_urls(http, "PRIMO-R1"), HANG_S, "the proxy to drop it")
        assert score(http).status_code == 200
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(60) == 0, out.read_text()
    assert_nothing_left(cluster, fake_vllm_env)


def test_a_replica_that_cannot_restart_is_removed_and_the_rest_serve(cluster, reaper, fake_vllm_env, tmp_path):
    link = tmp_path / "bin" / "vllm"
    link.parent.mkdir()
    link.symlink_to(FAKE_BIN / "vllm")
    config, proxy_port = ray_config(tmp_path, fake_vllm_env)
    popen, out = up_ray(reaper, cluster, config, tmp_path, "--vllm", str(link))
    wait_for_line(out, popen, "stack is up")
    victim = next(p for p in placement(tmp_path) if p["backend"] == "PRIMO-R1")
    link.unlink()  # from now on the node cannot start `vllm`
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for_line(out, popen, f"removed: {victim['name']}")
    with httpx.Client(base_url=f"http://127.0.0.1:{proxy_port}", timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {KEYS['PROXY_ADMIN_KEY']}"}) as http:
        wait_until(lambda: victim["url"] not in admin_urls(http, "PRIMO-R1"), HANG_S, "the proxy to drop it")
        assert all(score(http).status_code == 200 for _ in range(3))
    assert popen.poll() is None  # one replica's failure never stops the stack
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(60) == 0, out.read_text()
    assert_nothing_left(cluster, fake_vllm_env)


def test_a_replica_no_node_can_hold_fails_up_and_leaves_nothing(cluster, reaper, fake_vllm_env, tmp_path):
    config, _ = ray_config(tmp_path, fake_vllm_env, qwen_tp=4)  # 4 GPUs on one node: no node has them
    popen, out = up_ray(reaper, cluster, config, tmp_path, "--timeout", "5")
    assert popen.wait(120) == 1
    text = out.read_text()
    assert "Ray could not place qwen2_5_vl_vllm-r0 (4 GPU(s) on one node)" in text, text
    assert_nothing_left(cluster, fake_vllm_env)


def test_a_node_resource_keeps_replicas_on_the_nodes_that_declare_it(cluster, reaper, fake_vllm_env, tmp_path):
    config, _ = ray_config(tmp_path, fake_vllm_env, qwen_tp=1, primo_replicas=1)
    popen, out = up_ray(reaper, cluster, config, tmp_path, "--ray-resource", "reward_node", "--no-proxy")
    wait_for_line(out, popen, "stack is up")
    reward_node = cluster.list_all_nodes()[1].node_id
    assert {p["node_id"] for p in placement(tmp_path)} == {reward_node}  # the head has free GPUs too
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(60) == 0, out.read_text()
    assert_nothing_left(cluster, fake_vllm_env)


def test_a_killed_up_leaves_nothing_on_the_cluster(cluster, reaper, fake_vllm_env, tmp_path):
    # SIGKILL: no clean stop. Ray ends the driver's job (its actors and groups), and each server
    # dies with its actor. The local proxy is `down`'s business (reaped here by the fixture).
    config, _ = ray_config(tmp_path, fake_vllm_env)
    popen, out = up_ray(reaper, cluster, config, tmp_path, "--no-proxy")
    wait_for_line(out, popen, "stack is up")
    assert fake_vllm_env.all_pids()
    popen.kill()
    popen.wait(30)
    wait_until(lambda: not leftovers(cluster, fake_vllm_env), HANG_S, "Ray to reclaim the killed driver's replicas")


def test_up_ray_refuses_servers_without_keys(reaper, fake_vllm_env, tmp_path):
    config, _ = ray_config(tmp_path, fake_vllm_env)
    data = yaml.safe_load(config.read_text())
    del data["backends"]["PRIMO-R1"]["api_key_env"]
    del data["proxy"]["admin_api_key_env"]
    write_config(config, data)
    done = reaper.run("up", "--config", str(config), "--ray", "127.0.0.1:1", **KEYS)
    assert done.returncode == 2
    assert "backend PRIMO-R1: servers placed by Ray listen beyond loopback" in done.stderr
    assert "admin route, which needs the admin key" in done.stderr  # refused before contacting Ray
