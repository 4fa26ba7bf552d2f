"""The binary body: a request's frames as raw parts of a multipart/form-data body (RFC 7578),
so megabytes of frames travel as bytes instead of base64 inside JSON.

    part "request"   application/json   the usual JSON request, where a frame field holds
                                        "part:<name>" instead of base64 (any frames or
                                        frames_npy field, batch items included)
    part <name>      application/x-npy or image/jpeg / image/png: the raw bytes it names

Any route that takes frames takes this body; the answer is the same as for the JSON request with
the frames inline. Standard library only: the client and the proxy both import it.
"""

from __future__ import annotations

import re
import secrets

__all__ = ["PART_PREFIX", "REQUEST_PART", "FormError", "decode_form", "encode_form", "is_form"]

PART_PREFIX = "part:"
REQUEST_PART = "request"
_NAME = re.compile(rb'\bname="([^"\r\n]*)"', re.IGNORECASE)
_BOUNDARY = re.compile(r'(?:^|;)\s*boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)


class FormError(ValueError):
    """A multipart body that is not what this format says."""


def is_form(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "multipart/form-data"


def encode_form(request_json: bytes, parts: dict[str, tuple[str, bytes]]) -> tuple[str, bytes]:
    """(Content-Type, body): the JSON request first, then each named raw part."""
    boundary = secrets.token_hex(16)
    delimiter = b"--" + boundary.encode()
    chunks = [delimiter, b'\r\nContent-Disposition: form-data; name="request"\r\n'
              b"Content-Type: application/json\r\n\r\n", request_json, b"\r\n"]
    for name, (content_type, data) in parts.items():
        if not name or any(c in name for c in '"\r\n'):
            raise FormError(f"part name {name!r} cannot be sent")
        chunks += [delimiter, f'\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
                              f"Content-Type: {content_type}\r\n\r\n".encode(), data, b"\r\n"]
    chunks += [delimiter, b"--\r\n"]
    return f"multipart/form-data; boundary={boundary}", b"".join(chunks)


def decode_form(body: bytes, content_type: str, *, max_parts: int) -> tuple[bytes, dict[str, bytes]]:
    """(the JSON request, {name: raw bytes}); FormError for anything malformed."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise FormError("multipart/form-data without a boundary")
    delimiter = b"--" + (found.group(1) or found.group(2)).encode("latin-1")
    if not body.startswith(delimiter):
        raise FormError("the body does not start with its boundary")
    parts: dict[str, bytes] = {}
    position = len(delimiter)
    while True:
        if body.startswith(b"--", position):
            break  # the closing delimiter
        if not body.startswith(b"\r\n", position):
            raise FormError("a boundary is not followed by a line break")
        head_end = body.find(b"\r\n\r\n", position + 2)
        end = body.find(b"\r\n" + delimiter, head_end + 4) if head_end >= 0 else -1
        if head_end < 0 or end < 0:
            raise FormError("a part is cut short (no closing boundary)")
        name = _NAME.search(body, position, head_end)
        if name is None:
            raise FormError("a part has no name (Content-Disposition: form-data; name=...)")
        key = name.group(1).decode("utf-8", "replace")
        if key in parts:
            raise FormError(f"part {key!r} appears twice")
        if len(parts) >= max_parts:
            raise FormError(f"more than {max_parts} parts")
        parts[key] = body[head_end + 4:end]
        position = end + 2 + len(delimiter)
    request = parts.pop(REQUEST_PART, None)
    if request is None:
        raise FormError(f"no {REQUEST_PART!r} part (the JSON request)")
    return request, parts
