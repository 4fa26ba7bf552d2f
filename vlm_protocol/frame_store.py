"""Where the frame store keeps a JPEG: the proxy writes there, the report and replay read there.

A frame is stored once, by the sha256 of its bytes (the hash the audit log records), under a
two-character fan-out directory so no directory grows past a few thousand entries."""

from __future__ import annotations

from pathlib import Path

__all__ = ["frame_path"]


def frame_path(root: Path, sha256: str) -> Path:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return root / sha256[:2] / f"{sha256}.jpg"
