"""The media pool's default size: the cores this process may use (its affinity, within a cgroup CPU
quota), not the machine's count, which oversubscribes a proxy under taskset or a container's --cpus."""

import os

import pytest

from proxy.media import budget
from proxy.media.budget import cgroup_cpu_quota, default_media_workers, usable_cores


def _cgroups(tmp_path, own: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self").write_text(own)
    return {"root": root, "own": tmp_path / "self"}


def test_the_default_follows_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(budget, "cgroup_cpu_quota", lambda: None)
    assert usable_cores() == 1 and default_media_workers() == 1


def test_a_cpu_quota_caps_the_affinity_rounded_up_and_eight_caps_the_default(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(budget, "cgroup_cpu_quota", lambda: 2.5)
    assert usable_cores() == 3
    monkeypatch.setattr(budget, "cgroup_cpu_quota", lambda: None)
    assert usable_cores() == 32 and default_media_workers() == 8


def test_without_an_affinity_api_the_machine_count_is_used(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(budget, "cgroup_cpu_quota", lambda: None)
    assert usable_cores() == 4


def test_the_tightest_v2_quota_on_the_path_to_the_root_counts(tmp_path):
    paths = _cgroups(tmp_path, "0::/kube/pod/box\n", {
        "cpu.max": "max 100000\n",
        "kube/cpu.max": "400000 100000\n",  # a parent's quota binds its children
        "kube/pod/box/cpu.max": "max 100000\n",
    })
    assert cgroup_cpu_quota(**paths) == 4.0


def test_a_v1_cpu_controller_quota_is_read_and_minus_one_is_none(tmp_path):
    paths = _cgroups(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/job\n", {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_cpu_quota(**paths) == 1.5


@pytest.mark.parametrize("own, files", [
    (None, {}),  # no /proc/self/cgroup (not Linux)
    ("0::/\n", {"cpu.max": "max 100000\n"}),  # no quota
    ("0::/\n", {"cpu.max": "garbage\n"}),  # unreadable: ignored
    ("0::/\n", {}),  # no cpu controller enabled
    ("garbage\n", {}),
])
def test_no_quota_is_none(tmp_path, own, files):
    paths = _cgroups(tmp_path, own or "", files)
    if own is None:
        paths["own"].unlink()
    assert cgroup_cpu_quota(**paths) is None
