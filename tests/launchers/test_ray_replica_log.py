"""A Ray replica's log on its node (launchers/ray_replica.py): in a directory nobody could have
planted first, in a file that is never a link. Found by review: the log went to the fixed
$TMPDIR/vlm-reward-proxy-ray/<run id>/<name>.log, which another local user could pre-create with
a link to any file the launching user may write."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import ray

from launchers.ray_replica import ReplicaProcess


def test_each_replica_logs_in_a_new_owner_only_directory():
    replicas = [ReplicaProcess("qwen-0", "20261127-080000") for _ in range(2)]  # one run, one name
    try:
        for replica in replicas:
            folder = replica.log_path.parent
            info = folder.lstat()
            assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
            assert info.st_uid == os.getuid() and folder.parent == Path(tempfile.gettempdir())
        assert replicas[0].log_path.parent != replicas[1].log_path.parent
    finally:
        for replica in replicas:
            shutil.rmtree(replica.log_path.parent)


def test_a_log_that_became_a_link_is_not_written_through(tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])  # not in a Ray actor here
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    replica = ReplicaProcess("qwen-0", "run")
    try:
        replica.log_path.symlink_to(victim)
        with pytest.raises(OSError):
            replica.start([sys.executable, "-c", "print('vllm output')"], {})
        assert victim.read_text() == "mine\n" and replica.popen is None
    finally:
        shutil.rmtree(replica.log_path.parent)
