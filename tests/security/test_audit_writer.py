"""The audit log stays off the event loop and bounded (issue 24, items 5 and 6).

- One writer thread with a bounded queue: while the disk keeps up no line is lost; when it cannot
  (here: the log is a FIFO nobody reads yet, so the writer's open() blocks as on a stalled disk)
  every score is still answered, the lines that found the queue full are counted in /health and
  /metrics, and a clean stop writes every line still queued.
- Rotation by size (proxy.audit.max_mb, keep): `report` and `replay` read the rotated files and
  the current one as one log, oldest line first.

Each proxy here is its own: its audit settings (a FIFO, a tiny rotation size) are the test.
"""

from __future__ import annotations

import asyncio
import os
import threading

import httpx

from proxy.audit import AuditLog
from proxy.config import settings_from_dict
from proxy.metrics import Metrics
from reports.audit import read_audit_log
from reports.audit_lines import audit_files
from tests.fakes.processes import metric_sum, metrics
from tests.faults.common import EPISODE, one_backend
from vlm_reward_cli.replay import ReplayTally, _audit_lines


async def test_every_line_queued_on_the_loop_is_written_in_order_while_the_disk_keeps_up(tmp_path):
    path = tmp_path / "logs" / "audit.jsonl"
    log = AuditLog(path, queue_lines=5000, metrics=Metrics())
    for i in range(5000):  # from the loop, as the routes do: write() only queues
        log.write({"i": i})
    await asyncio.to_thread(log.close)
    lines = path.read_text().splitlines()
    assert [int(line.split('"i":')[1].rstrip("}")) for line in lines] == list(range(5000))
    assert log.status()["dropped"] == 0 and log.status()["written"] == 5000


def test_a_stalled_disk_never_holds_a_score_and_every_lost_line_is_counted(
        proxy_factory, fake_qwen, media_root, tmp_path):
    fifo = tmp_path / "audit.jsonl"
    os.mkfifo(fifo)  # opening it to write blocks until a reader comes: a disk that does not keep up
    proxy = proxy_factory(settings_from_dict(one_backend(
        [fake_qwen.base_url], media_root, audit_log=str(fifo), audit={"queue_lines": 1})))
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_bytes()))
    try:
        with httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as http:
            answers = [http.post("/score", json={**EPISODE, "task_text": f"episode {i}"}) for i in range(8)]
            assert [a.status_code for a in answers] == [200] * 8  # scored, the audit log stuck or not
            audit = http.get("/health").json()["audit"]
            # the writer holds its first batch (one line, as the requests come one by one), the queue one more
            assert audit["dropped"] >= 1 and audit["dropped_by_reason"] == {"queue_full": audit["dropped"]}
            assert audit["path"] == str(fifo)
            values = metrics(http, proxy.url)
            assert metric_sum(values, "vlm_proxy_audit_dropped_total", reason="queue_full") == audit["dropped"]
    finally:
        reader.start()  # the disk comes back: the writer drains into the reader
        proxy.stop()  # a clean stop writes what is still queued, then ends the writer
        reader.join(15)
    written = read[0].decode().splitlines()
    assert len(written) + audit["dropped"] == 8  # each line written or counted, none silently lost
    assert len(written) >= 1


def test_the_log_rotates_by_size_and_report_and_replay_read_it_as_one(proxy_factory, fake_qwen, media_root,
                                                                      tmp_path):
    path = tmp_path / "audit.jsonl"
    max_mb = 0.004  # a few lines per file
    proxy = proxy_factory(settings_from_dict(one_backend(
        [fake_qwen.base_url], media_root, audit_log=str(path), audit={"max_mb": max_mb, "keep": 3})))
    count = 40
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        for i in range(count):
            assert http.post("/score", json={**EPISODE, "task_text": f"episode {i}"}).status_code == 200
    proxy.flush_audit()
    files = audit_files(path)
    assert [f.name for f in files] == ["audit.jsonl.3", "audit.jsonl.2", "audit.jsonl.1", "audit.jsonl"]
    for part in files:
        lines = part.read_text().splitlines()
        assert part.stat().st_size <= max_mb * 2**20 or len(lines) == 1  # rotated before it grew past
    summary = read_audit_log(path)  # report: one log, the rotated files first
    kept = sum(len(f.read_text().splitlines()) for f in files)
    assert summary.lines == summary.records == kept < count  # the oldest beyond `keep` were deleted
    tally = ReplayTally()
    tasks = [line["task_text"] for _, line in _audit_lines(path, tally, None)]  # replay's reading
    assert tasks == [f"episode {i}" for i in range(count - kept, count)]  # in order, the newest kept
    assert not tally.skipped


def test_the_old_audit_log_key_alone_still_configures_the_log(tmp_path, media_root, fake_qwen):
    settings = settings_from_dict(one_backend([fake_qwen.base_url], media_root, audit_log=str(tmp_path / "a.jsonl")))
    assert settings.proxy.audit_log == tmp_path / "a.jsonl"
    assert (settings.proxy.audit.max_mb, settings.proxy.audit.keep) == (256.0, 10)
