"""The proxy's files on disk, as sections of the one config model (proxy/config/settings.py): the audit
log's rotation and queue, the frame store, and run D's reference store. Each is bounded."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from proxy.config.strict import StrictModel as _Strict

__all__ = ["AuditConfig", "FrameStoreConfig", "ReferenceStoreConfig"]


class FrameStoreConfig(_Strict):
    """The exact JPEGs sent to vLLM, kept once each by content hash (what `report` shows and
    `replay` re-scores). When it is full or the disk fails, scoring goes on and says so."""

    dir: Path
    max_mb: float = Field(10_240.0, gt=0)


class AuditConfig(_Strict):
    """How `proxy.audit_log` is written: by one thread (never on the event loop), rotated by size.
    `report` and `replay` read the rotated files and the current one as one log."""

    max_mb: float = Field(256.0, gt=0)  # past this the file becomes <file>.1, .1 becomes .2, ...
    keep: int = Field(10, ge=1, le=1000)  # rotated files kept; the oldest beyond is deleted
    # Lines waiting for the writer thread; beyond, a line is dropped and counted (/health, /metrics).
    queue_lines: int = Field(10_000, ge=1, le=10_000_000)


class ReferenceStoreConfig(_Strict):
    """Earlier successes and demonstrations per (served model, task): the references of
    POST /progress/batch beside the batch's own successes (docs/progress.md). Bounded per task."""

    dir: Path
    # Per task. Bounded: clustering costs successes² x width (docs/benchmarks.md §6).
    max_successes: int = Field(32, ge=0, le=1024)  # the oldest is evicted first
    max_demonstrations: int = Field(32, ge=1, le=1024)  # never evicted; adding beyond is an error
    # Keys (namespace, task, ...) in all, as callers name them; a new one beyond is refused (409).
    max_keys: int = Field(4096, ge=1, le=1_000_000)
