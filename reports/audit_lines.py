"""The audit log's lines, one at a time (plain or .gz): what `report` summarises and `replay`
re-scores. A line that is not a JSON object is given back with the reason, never dropped silently."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["audit_records"]


def audit_records(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, the record or None, why it is not one) for each non-blank line (plain or .gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
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
