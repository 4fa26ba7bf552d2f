"""Reading a JSON body cheaply: a few top-level fields without parsing the rest (`peek_fields`), or
the whole body at pydantic-core's speed (`loads`, proxy/http/json_body.py says why).

The pass-through routes on `model` (and needs `stream`), but its bodies are mostly one or more
base64 data URLs of hundreds of KB. `json.loads` of a 530 KB chat body costs ~0.4 ms and a
substring search for the scoring prefix another ~0.3 ms, which was most of the relay's own CPU
(bench/profile_proxy.py --only chat). Here strings are skipped with one `bytes.find` each and
only the structure between them is walked, so the cost scales with the number of JSON tokens,
not with the bytes (tens of µs for a chat body).

What is checked: the body is one object, brackets balance, strings end, and the wanted keys
appear at most once with a value that parses. What is not: the rest of the grammar (a bad
number deep inside a message). The pass-through sends such a body on and vLLM answers 400,
relayed as is — vLLM is the judge of its own request schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pydantic_core

_STRUCTURAL = re.compile(rb'["\[\]{}]')
_NOT_SPACE = re.compile(rb"[^ \t\n\r]")
_SCALAR_END = re.compile(rb"[,}\] \t\n\r]")
_CLOSES = {ord("]"): ord("["), ord("}"): ord("{")}
_BOM = b"\xef\xbb\xbf"
_SPACE = frozenset(b" \t\n\r")
_QUOTE, _BACKSLASH, _COLON = ord('"'), ord("\\"), ord(":")


class NotJsonObject(ValueError):
    """The body is not one JSON object, or a wanted field could not be read."""


@dataclass(frozen=True)
class Field:
    value: Any  # the decoded value; for an object or array, the raw JSON text (never needed decoded)
    start: int  # the value's span in the body, for splicing in a replacement
    end: int


def _next_token(raw: bytes, pos: int) -> int:
    if pos < len(raw) and raw[pos] not in _SPACE:  # the common case: compact JSON
        return pos
    m = _NOT_SPACE.search(raw, pos)
    return m.start() if m else len(raw)


def _string_end(raw: bytes, start: int) -> int:
    """The index just past the closing quote of the string opening at raw[start]."""
    i = start + 1
    while True:
        j = raw.find(b'"', i)
        if j < 0:
            raise NotJsonObject(f"a string starting at byte {start} never ends")
        k = j - 1
        while raw[k] == _BACKSLASH:
            k -= 1
        if (j - 1 - k) % 2 == 0:  # an even run of backslashes: the quote is not escaped
            return j + 1
        i = j + 1


def _value_end(raw: bytes, start: int) -> int:
    """The end of the top-level value starting at raw[start] (a string, object, array or literal)."""
    first = raw[start] if start < len(raw) else None
    if first == _QUOTE:
        return _string_end(raw, start)
    if first in _CLOSES.values():
        return _container_end(raw, start)
    m = _SCALAR_END.search(raw, start)
    return m.start() if m else len(raw)


def _container_end(raw: bytes, start: int) -> int:
    stack = [raw[start]]
    pos = start + 1
    while stack:
        m = _STRUCTURAL.search(raw, pos)
        if m is None:
            raise NotJsonObject("brackets do not balance")
        i, c = m.start(), raw[m.start()]
        if c == _QUOTE:
            pos = _string_end(raw, i)
            continue
        if c in _CLOSES:
            if stack.pop() != _CLOSES[c]:
                raise NotJsonObject(f"a bracket at byte {i} does not match")
        else:
            stack.append(c)
        pos = i + 1
    return pos


def peek_fields(raw: bytes, wanted: frozenset[str]) -> dict[str, Field]:
    """The wanted top-level keys present in the JSON object `raw`, with their values and spans."""
    pos = _next_token(raw, len(_BOM) if raw.startswith(_BOM) else 0)  # json.loads(bytes) allows a BOM
    if pos >= len(raw) or raw[pos] != ord("{"):
        raise NotJsonObject("the body is not a JSON object")
    found: dict[str, Field] = {}
    pos = _next_token(raw, pos + 1)
    if pos < len(raw) and raw[pos] == ord("}"):
        return _ended(raw, pos + 1, found)
    while True:
        if pos >= len(raw) or raw[pos] != _QUOTE:
            raise NotJsonObject(f"expected a key at byte {pos}")
        key_end = _string_end(raw, pos)
        colon = _next_token(raw, key_end)
        if colon >= len(raw) or raw[colon] != _COLON:
            raise NotJsonObject(f"expected ':' at byte {colon}")
        start = _next_token(raw, colon + 1)
        if start >= len(raw):
            raise NotJsonObject("the body ends inside the object")
        end = _value_end(raw, start)
        key = _key(raw[pos:key_end])
        if key in wanted:
            if key in found:
                raise NotJsonObject(f"'{key}' is given twice")
            found[key] = Field(_decode(raw, key, start, end), start, end)
        pos = _next_token(raw, end)
        if pos < len(raw) and raw[pos] == ord("}"):
            return _ended(raw, pos + 1, found)
        if pos >= len(raw) or raw[pos] != ord(","):
            raise NotJsonObject(f"expected ',' or '}}' at byte {pos}")
        pos = _next_token(raw, pos + 1)


def _key(quoted: bytes) -> str:
    inner = quoted[1:-1]
    try:  # escapes are rare in keys: only then the JSON decoder
        return json.loads(quoted) if b"\\" in inner else inner.decode("utf-8")
    except ValueError as err:  # a bad escape, or bytes that are not UTF-8
        raise NotJsonObject(f"a key is not a valid JSON string ({err})") from err


def _decode(raw: bytes, key: str, start: int, end: int) -> Any:
    if raw[start] in _CLOSES.values():
        return raw[start:end]
    try:
        return json.loads(raw[start:end])
    except ValueError as err:
        raise NotJsonObject(f"'{key}' has no valid JSON value") from err


def _ended(raw: bytes, pos: int, found: dict[str, Field]) -> dict[str, Field]:
    if _next_token(raw, pos) != len(raw):
        raise NotJsonObject(f"extra data after the object at byte {pos}")
    return found


def splice(raw: bytes, field: Field, value: Any) -> bytes:
    """`raw` with one field's value replaced (JSON-encoded), every other byte as it was."""
    return raw[:field.start] + json.dumps(value).encode() + raw[field.end:]


def loads(raw: bytes) -> Any:
    """`json.loads` at pydantic-core's speed (ValueError on bad JSON, as json.loads)."""
    return pydantic_core.from_json(raw[len(_BOM):] if raw.startswith(_BOM) else raw)
