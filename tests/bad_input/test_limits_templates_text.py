"""Oversize bodies, 10k inline frames, decompression bombs, templates and unicode task text."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import time
import zlib

import numpy as np
import pytest

from tests.bad_input.common import BASE, expect
from tests.fakes.episodes import episode_frames, images_b64, npy_b64
from tests.helpers import HANG_S, read_http_head, wait_until

TINY_PNG = images_b64(episode_frames(1, 8, 8))[0]


def _png_header(width: int, height: int) -> str:
    """A PNG whose IHDR claims width×height (no real pixel data): a decompression-bomb probe."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


def _npy_header(shape: tuple[int, ...], dtype: str = "|u1") -> str:
    header = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\x00" * 1024
    return base64.b64encode(raw).decode()


def _npy_raw(array: np.ndarray, allow_pickle: bool = False) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return base64.b64encode(buf.getvalue()).decode()


# -- size limits -----------------------------------------------------------------------------------
def test_ten_thousand_inline_frames(env):
    frames = [TINY_PNG] * 10_000
    error = expect(env.post(json={"task_text": "t", "frames": frames}, label="10k frames"),
                   422, "invalid_request", "frames")
    assert "10000" in error["message"] and "2048" in error["message"]


def test_oversize_body_declared_is_refused_before_it_is_sent(env):
    """Content-Length over proxy.max_body_mb: 413 comes back while the body is still unsent."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", env.proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000000000\r\n\r\n")
        reply = read_http_head(sock)
    env.timings.append((time.perf_counter() - started, "declared 1 GB body"))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_oversize_body_error_has_a_request_id(env):
    response = env.post(content=b"{" + b" " * (5 * 2**20) + b"}", headers={"content-type": "application/json"},
                        label="5 MiB body")
    expect(response, 413, "payload_too_large", mentions="max_body_mb")
    assert response.headers.get("x-request-id")


def test_oversize_body_streamed_without_length(env):
    def chunks():
        yield b'{"task_text": "t", "frames": ["'
        for _ in range(6):
            yield b"A" * 2**20  # 6 MiB against a 4 MiB cap

    expect(env.post(content=chunks(), headers={"content-type": "application/json"}, label="chunked 6 MiB"),
           413, "payload_too_large", mentions="max_body_mb")


def test_body_just_under_the_cap_is_parsed(env):
    pad = "x" * (4 * 2**20 - len(json.dumps(BASE)) - 1000)
    expect(env.post(json={**BASE, "padding": pad}, label="~4 MiB body"), 422, "invalid_request", "padding")


# -- inline media ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("frames", "field", "mentions", "code"), [
    (["not base64!!"], "frames[0]", "base64", "media_decode_error"),
    (["aGVsbG8="], "frames[0]", "PNG/JPEG", "media_format_refused"),  # "hello": refused by content
    (["data:image/png;base64,%%%"], "frames[0]", "base64", "media_decode_error"),
    ([TINY_PNG, "aGVsbG8="], "frames[1]", "PNG/JPEG", "media_format_refused"),
    ([_png_header(5000, 5000)], "frames[0]", "pixel cap", "media_decode_error"),
    ([_png_header(2**31 - 1, 2**31 - 1)], "frames[0]", None, "media_decode_error"),
    ([images_b64(episode_frames(1, 2, 600))[0]], "frames", "aspect ratio", "media_decode_error"),
])
def test_bad_inline_images(env, frames, field, mentions, code):
    expect(env.post(json={"task_text": "t", "frames": frames}, label=f"frames {field} {mentions}"),
           422, code, field, mentions)


@pytest.mark.parametrize(("npy", "mentions"), [
    (_npy_raw(episode_frames(2, 8, 8).astype(np.float32)), "uint8"),
    (_npy_raw(episode_frames(2, 8, 8)[0]), "T×H×W×3"),
    (_npy_raw(np.zeros((2, 8, 8, 4), np.uint8)), "T×H×W×3"),
    (_npy_raw(np.array([{"a": 1}], dtype=object), allow_pickle=True), ".npy"),
    (npy_b64(episode_frames(4, 16, 16))[:200], None),
    (_npy_header((10**6, 64, 64, 3)), None),  # 12 GB claimed, 1 KiB sent
    (_npy_header((10**9, 4096, 4096, 3)), None),
    (_npy_header((1, 5000, 5000, 3)), None),
    ("aGVsbG8=", ".npy"),
])
def test_bad_frames_npy(env, npy, mentions):
    expect(env.post(json={"task_text": "t", "frames_npy": npy}, label=f"npy {mentions}"),
           422, "media_decode_error", "frames_npy", mentions)


# -- templates -------------------------------------------------------------------------------------
def test_variable_the_template_does_not_declare(env):
    error = expect(env.post(json={**BASE, "backend_kwargs": {"hint": "x"}}), 422, "invalid_request",
                   "backend_kwargs.hint")
    assert "qwen_progress" in error["message"]  # names the template whose variables it checked


def test_required_template_variable_missing(env):
    expect(env.post(json={**BASE, "backend": "scene"}), 422, "template_variable", "backend_kwargs.scene",
           mentions="scene")


def test_template_edited_to_use_an_undeclared_variable(env, allow_upstream):
    """An operator error, not the client's: documented as 500 prompt_template_invalid, naming the
    variable, refused before anything is sent; the fixed file applies again. Templates are re-checked
    off the event loop (prompts: an edit applies within recheck_s), so each edit is waited for."""
    path = env.prompts / "editable.yaml"
    good = path.read_text()
    try:
        path.write_text("variables: {task_text: {}}\nuser: '${task_text} in ${room} <score>?</score>'\n"
        "answer: {tags: [score], scale: {min: 0, max: 100}}\n")
        def refused():
            answer = env.post(json={**BASE, "backend": "editable"}, label="template undeclared")
            return answer if answer.status_code != 200 else None

        broken = wait_until(refused, HANG_S, "the edited template to apply")
        error = expect(broken, 500, "prompt_template_invalid", mentions="room")
        assert "undeclared" in error["message"]
    finally:
        path.write_text(good + "\n")  # size changes: the store re-reads it
    wait_until(lambda: env.post(json={**BASE, "backend": "editable"}).status_code == 200, HANG_S,
               "the fixed template to apply")


# -- unicode task text -----------------------------------------------------------------------------
UNICODE_TASKS = [
    "把碗放在盘子上",
    "déposer le bol 🍜 sur l'assiette",
    "ضع الوعاء على الطبق",  # right-to-left
    "put\u202ethe bowl\u202c on the plate",  # bidi override
    "e\u0301\u0301\u0301 zalgo a\u0336\u0336",
    "zero\u200bwidth\ufeffjoiners",
    "🍜" * 4096,  # at the length cap, in code points
    "${task_text} $scene $$ {braces}",  # template syntax is literal text
    "line one\nline two\ttab",
    "null\u0000char",
]


@pytest.mark.parametrize("task", UNICODE_TASKS, ids=range(len(UNICODE_TASKS)))
def test_unicode_task_text_round_trips(env, allow_upstream, task):
    response = env.post(json={**BASE, "task_text": task}, label="unicode")
    assert response.status_code == 200, response.text
    assert task in env.qwen.chat_requests[-1]["messages"][-1]["content"][-1]["text"]


def test_task_text_over_the_cap_in_code_points(env):
    expect(env.post(json={**BASE, "task_text": "🍜" * 4097}), 422, "invalid_request", "task_text")


def test_lone_surrogate_in_task_text(env):
    """Valid JSON escapes, invalid Unicode: refused by the JSON parser (proxy/json_body.py), naming the
    body and where in it."""
    body = json.dumps(BASE)[:-1] + ', "backend_kwargs": {}}'
    body = body.replace('"put the bowl on the plate"', '"bowl \\ud800 plate"')
    response = env.post(content=body.encode(), headers={"content-type": "application/json"},
                        label="lone surrogate")
    expect(response, 422, "invalid_request", "body", mentions="line 1 column")
