"""The raw parts of this request's binary body (vlm_protocol.multipart), for the frame fields
that name them ("part:<name>"). Set by proxy/http/binary_body.py for the request's task; batch items
and worker threads inherit it, and no other request can see it."""

from __future__ import annotations

from contextvars import ContextVar

from proxy.errors import MediaDecodeError
from vlm_protocol.multipart import PART_PREFIX

__all__ = ["PARTS", "part_bytes"]

PARTS: ContextVar[dict[str, bytes] | None] = ContextVar("vlm_binary_parts", default=None)


def part_bytes(reference: str, field: str) -> bytes:
    """The raw bytes a "part:<name>" field names, in this request's binary body."""
    parts = PARTS.get()
    name = reference[len(PART_PREFIX):]
    if parts is None or name not in parts:
        raise MediaDecodeError(f"{field} names part {name!r}, which this request's body does not hold "
                               "(a multipart/form-data body carries the parts it names)", field=field)
    return parts[name]
