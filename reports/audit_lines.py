"""The audit log's lines, one at a time (plain or .gz): what `report` summarises and `replay`
re-scores. A line that is not a JSON object is given back with the reason, never dropped silently.

The proxy rotates its log by size (proxy.audit: file -> file.1 -> ... -> file.<keep>), so one log
is the rotated files, oldest first, then the current one: read as one, numbered across them all.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["audit_files", "audit_records"]


def audit_files(path: Path) -> list[Path]:
    """The files that make up the log at `path`, oldest first: `path.N` ... `path.1`, `path`
    (those that exist). A `.gz` file, or a rotated file named itself, is read alone."""
    path = Path(path)
    if path.suffix == ".gz" or re.fullmatch(r"\d+", path.suffix[1:]):
        return [path] if path.is_file() else []
    numbered = re.compile(re.escape(path.name) + r"\.(\d+)")
    rotated = sorted(((int(m.group(1)), p) for p in path.parent.glob(glob.escape(path.name) + ".*")
                      if (m := numbered.fullmatch(p.name)) and p.is_file()), reverse=True)
    return [p for _, p in rotated] + ([path] if path.is_file() else [])


def audit_records(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, the record or None, why it is not one) for each non-blank line of the log
    (its rotated files first; plain or .gz). Numbers run on across the files."""
    number = 0
    for part in audit_files(path):
        opener = gzip.open if part.suffix == ".gz" else open
        with opener(part, "rb") as lines:
            for raw in lines:
                number += 1
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError:
                    yield number, None, "not JSON (a line cut short?)"
                    continue
                if isinstance(record, dict):
                    yield number, record, None
                else:
                    yield number, None, "not a JSON object"
