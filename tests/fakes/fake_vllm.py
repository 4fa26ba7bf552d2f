"""A stand-in for `vllm serve`: a real HTTP/1.1 server on loopback, OpenAI chat API shaped.

Written on raw asyncio streams (not an ASGI framework) so a test can make it do what real
servers do when they break: drop the connection, send truncated or malformed bodies, stall.

Behaviour per chat request: the next scripted action if any, else the default reply. Actions:
    {"reply": "text", "finish_reason": "stop", "delay_s": 0}
    {"status": 503, "retry_after": 2, "delay_s": 0}   any HTTP status, vLLM's error shape
    {"status": 307, "location": URL}                 a redirect
    {"drop": true}                                   close the socket, no answer
    {"malformed": true}                              200 with a body that is not JSON
    {"truncated": true}                              200, Content-Length larger than the body
    {"hang_s": 30}                                   answer nothing for that long
    {"reply": "a b c", "word_delay_s": 1}            (stream: true) a pause after each word
    {"hold": threading.Event()}                      (in-process) answer once the test sets it
    {"hold": "name"}                                 answer once POST /_fake/release {"hold": "name"}
                                                     (FakeConfig.tokenize_hold: the same for /tokenize)
    {"reply": "True", "ignore_label_ids": true}      logprobs as if logprob_token_ids were not sent
Like stock vLLM it answers 401 on /v1/* without the bearer token when `api_key` is set, 404 for an
unknown model, 400 (param media_io_kwargs /
mm_processor_kwargs) for per-request media kwargs unless trust_request_mm_kwargs, 400 for a
data URL that is not strict base64, and it keeps only --media-io-kwargs num_frames (32) frames.

POST /tokenize (at the root, as vLLM) numbers words by FakeConfig.vocab; `logprob_token_ids`
answers those tokens' logprobs at the first token (FakeConfig.label_logprobs or FakeState.label_fn).
Control over HTTP (for fakes run as subprocesses): POST /_fake/script {"actions": [...]},
POST /_fake/config {...FakeConfig fields}, POST /_fake/reset, POST /_fake/release {"hold": "name"},
GET /_fake/requests.
Run standalone: python -m tests.fakes.fake_vllm --port 8001 --served-model-name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import collections
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.helpers import HANG_S

CRLF = b"\r\n"
DEFAULT_TEXT = "<answer>50</answer>"


@dataclass
class FakeConfig:
    served_model_name: str = "fake-model"
    default_text: str = DEFAULT_TEXT
    trust_request_mm_kwargs: bool = True
    healthy: bool = True
    record: bool = True
    # Continuous-batching latency model: base + per_seq * running, at most max_num_seqs at once.
    latency_base_s: float = 0.0
    latency_per_seq_s: float = 0.0
    max_num_seqs: int = 256
    # Like `vllm serve --api-key`: /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise).
    api_key: str | None = None
    # A /v1/models answer to send instead of the model list (e.g. {"data": None}: an odd server).
    models_body: Any = None
    # With `logprobs: true` in a request: the top_logprobs at the reply's first digit or yes/no
    # token (e.g. {"7": -0.2, "8": -1.9, " the": -3.0}); every other token is certain.
    answer_top_logprobs: dict[str, float] | None = None
    # POST /tokenize: a word here is that one token id; any other text, one id per piece (_FAKE_TOKENS)
    vocab: dict[str, int] = field(default_factory=lambda: {"True": 2514, "False": 4049, " True": 3007,
                                                           " False": 3557, "Yes": 9454, "No": 2753})
    # With `logprob_token_ids`: the logprob of each word at the reply's first token (others: -9999, as
    # vLLM clips); FakeState.label_fn(body) decides instead when set (answers that depend on the frames)
    label_logprobs: dict[str, float] | None = None
    # (in-process) POST /tokenize answers once the test sets it: a replica slow to tokenize
    tokenize_hold: threading.Event | None = None


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    peer: Any = None  # the caller's (host, port): which TCP connection carried the request


@dataclass
class FakeState:
    config: FakeConfig
    actions: collections.deque = field(default_factory=collections.deque)
    requests: list[RecordedRequest] = field(default_factory=list)
    reply_fn: Callable[[dict], str] | None = None
    label_fn: Callable[[dict], dict[str, float]] | None = None  # body → {word: logprob} (label_logprobs)
    running: int = 0
    max_running_seen: int = 0
    max_chats_seen: int = 0  # chat requests being answered at once, held or delayed ones included
    chat_count: int = 0
    readiness_gets: int = 0  # GET /health and GET /v1/models answered
    released: set[str] = field(default_factory=set)  # named holds the test let go (POST /_fake/release)


class FakeVLLM:
    """The server. Use `FakeVLLMThread` in tests, or `serve_forever` from the command line."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.state = FakeState(config=config or FakeConfig())
        self._seq_slots: asyncio.Semaphore | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task] = set()
        self._chat_readers: set[asyncio.StreamReader] = set()

    # -- control (thread-safe enough for tests: deque/list appends are atomic) --------------
    def script(self, *actions: dict) -> None:
        self.state.actions.extend(actions)

    def reset(self) -> None:
        self.state.actions.clear()
        self.state.requests.clear()
        self.state.chat_count = 0
        self.state.max_running_seen = 0
        self.state.max_chats_seen = 0

    @property
    def chat_requests(self) -> list[dict]:
        return [r.body for r in self.state.requests if r.path.endswith("/chat/completions")]

    @property
    def embedding_requests(self) -> list[dict]:
        return [r.body for r in self.state.requests if r.path.endswith("/embeddings")]

    @property
    def chats_in_progress(self) -> int:
        """Chat requests being answered whose caller is still connected (a caller that hung up
        has fed EOF to its reader, even while the reply is still being prepared)."""
        return sum(1 for reader in self._chat_readers if not reader.at_eof())

    # -- HTTP plumbing -------------------------------------------------------------------------
    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Called as the connection is made: the writer is known before its handler first runs, so
        stopping the fake closes it even when the handler is cancelled before it starts."""
        self._writers.add(writer)
        handler = asyncio.get_running_loop().create_task(self.handle_connection(reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._writers.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                method, path, headers, raw_body = request
                chat = path.endswith("/chat/completions")
                if chat:
                    self._chat_readers.add(reader)
                    self.state.max_chats_seen = max(self.state.max_chats_seen, len(self._chat_readers))
                try:
                    keep_open = await self._dispatch(method, path, headers, raw_body, writer)
                finally:
                    self._chat_readers.discard(reader)
                if not keep_open or headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the fake is stopping; end the handler normally (3.11's stream callback chokes on cancelled)
        finally:
            self._writers.discard(writer)
            writer.close()
            # Wait until the socket is really closed (connection_lost ran), so the loop can be
            # closed right after the handlers end without leaking a transport.
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _dispatch(self, method, path, headers, raw_body, writer) -> bool:
        cfg = self.state.config
        if path.startswith("/_fake/"):
            return await self._control(method, path, raw_body, writer)
        if method == "GET" and path in ("/health", "/v1/models"):
            self.state.readiness_gets += 1
        if method == "GET" and path == "/health":
            await _send_json(writer, 200 if cfg.healthy else 503, {} if cfg.healthy else {"error": "unhealthy"})
            return True
        if path.startswith("/v1/") and cfg.api_key and headers.get("authorization") != f"Bearer {cfg.api_key}":
            await _send_json(writer, 401, {"error": "Unauthorized"})
            return True
        if method == "GET" and path == "/v1/models":
            await _send_json(writer, 200, cfg.models_body if cfg.models_body is not None else {
                "object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "owned_by": "vllm",
                                            "root": cfg.served_model_name}]})
            return True
        if method == "POST" and path == "/v1/chat/completions":
            return await self._chat(headers, raw_body, writer)
        if method == "POST" and path == "/tokenize":  # vLLM serves it at the root, not under /v1
            body = json.loads(raw_body)
            if cfg.record:
                self.state.requests.append(RecordedRequest("POST", path, headers, body))
            while cfg.tokenize_hold is not None and not cfg.tokenize_hold.is_set():
                await asyncio.sleep(0.01)
            if body.get("model") != cfg.served_model_name:
                await _send_json(writer, 404, _error(f"The model `{body.get('model')}` does not exist.",
                                                     "NotFoundError", 404, "model"))
            else:
                await _send_json(writer, 200, {"tokens": _token_ids(str(body.get("prompt", "")), cfg)})
            return True
        if method == "POST" and path == "/v1/embeddings":
            return await self._embeddings(headers, raw_body, writer)
        await _send_json(writer, 404, _error("Not Found", "NotFoundError", 404))
        return True

    async def _control(self, method, path, raw_body, writer) -> bool:
        if path == "/_fake/script":
            self.script(*json.loads(raw_body)["actions"])
        elif path == "/_fake/config":
            for key, value in json.loads(raw_body).items():
                setattr(self.state.config, key, value)
        elif path == "/_fake/reset":
            self.reset()
        elif path == "/_fake/release":
            self.state.released.add(json.loads(raw_body)["hold"])
        elif path == "/_fake/requests":
            await _send_json(writer, 200, {
                "requests": [r.body for r in self.state.requests],
                "max_running_seen": self.state.max_running_seen,
                "chat_count": self.state.chat_count,
            })
            return True
        await _send_json(writer, 200, {"ok": True})
        return True

    async def _accept_request(self, path, headers, raw_body, writer) -> dict | None:
        """The body, recorded and checked like vLLM; None when it was answered already."""
        state, cfg = self.state, self.state.config
        try:
            body = json.loads(raw_body)
        except ValueError:
            await _send_json(writer, 400, _error("invalid JSON body", "BadRequestError", 400))
            return None
        state.chat_count += 1
        if cfg.record:
            state.requests.append(RecordedRequest("POST", path, headers, body, writer.get_extra_info("peername")))
        refusal = _validate_like_vllm(body, cfg)
        if refusal is not None:
            status, payload = refusal
            await _send_json(writer, status, payload)
            return None
        return body

    async def _fault(self, action: dict, writer, whole_reply: dict) -> bool | None:
        """Play the scripted action's fault, if it has one: keep-alive (True/False) once answered;
        None when the reply should go out normally."""
        if action.get("delay_s"):
            await asyncio.sleep(action["delay_s"])
        while "hold" in action and not self._released(action["hold"]):  # until the test lets it go
            await asyncio.sleep(0.01)
        if "hang_s" in action:
            await asyncio.sleep(action["hang_s"])
            return False
        if action.get("drop"):
            return False
        if action.get("malformed"):
            await _send_raw(writer, 200, b'{"id": "x", "choices": [ this is not json', "application/json")
            return True
        if action.get("truncated"):
            payload = json.dumps(whole_reply).encode()
            head = _head(200, len(payload) + 100, "application/json")
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            return False
        if "status" in action:
            status = int(action["status"])
            extra = {"Retry-After": str(action["retry_after"])} if "retry_after" in action else {}
            if "location" in action:  # a redirect, as a misbehaving server or a proxy in front would send
                extra["Location"] = action["location"]
            await _send_json(writer, status, _error(action.get("message", f"fake {status}"),
                                                    "ServiceUnavailableError", status), extra)
            return True
        return None

    def _released(self, hold: threading.Event | str) -> bool:
        """An event is set by an in-process test; a name, by a test driving a subprocess over HTTP."""
        return hold in self.state.released if isinstance(hold, str) else hold.is_set()

    async def _embeddings(self, headers, raw_body, writer) -> bool:
        """Like `vllm serve --runner pooling --convert embed`: one vector per conversation. The
        vector is the mean colour of the frames of its media parts, [r, g, b] / 255, and a constant
        1 (a dimension that moves no distance), at most
        num_frames frames like vLLM's loader), or the scripted {"embedding": [...]} /
        {"body": {...}} (a whole answer, e.g. a malformed one)."""
        body = await self._accept_request("/v1/embeddings", headers, raw_body, writer)
        if body is None:
            return True
        action = self.state.actions.popleft() if self.state.actions else {}
        answered = await self._fault(action, writer, {"data": []})
        if answered is not None:
            return answered
        await self._model_latency()
        if "body" in action:
            await _send_json(writer, 200, action["body"])
            return True
        vector, tokens = (action["embedding"], 1) if "embedding" in action else _mean_colour(body)
        await _send_json(writer, 200, {
            "id": f"embd-{self.state.chat_count}", "object": "list", "created": int(time.time()),
            "model": body.get("model"), "data": [{"index": 0, "object": "embedding", "embedding": vector}],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})
        return True

    async def _chat(self, headers, raw_body, writer) -> bool:
        state, cfg = self.state, self.state.config
        body = await self._accept_request("/v1/chat/completions", headers, raw_body, writer)
        if body is None:
            return True
        action = state.actions.popleft() if state.actions else {}
        answered = await self._fault(action, writer, _completion(body, cfg, "<answer>1</answer>", "stop"))
        if answered is not None:
            return answered
        text = action.get("replies", action.get("reply"))
        if text is None:
            text = state.reply_fn(body) if state.reply_fn else cfg.default_text
        await self._model_latency()
        # `n` samples: a list (from the script or reply_fn) gives one text each, a string repeats
        texts = text if isinstance(text, list) else [text] * int(body.get("n") or 1)
        completion = _completion(body, cfg, texts, action.get("finish_reason", "stop"))
        if body.get("logprob_token_ids") and not action.get("ignore_label_ids"):
            labels = state.label_fn(body) if state.label_fn else (cfg.label_logprobs or {})
            for choice in completion["choices"]:
                choice["logprobs"] = _label_logprobs(body, cfg, labels)
        if body.get("stream"):
            await _send_sse(writer, completion, action.get("word_delay_s", 0.0))
            return True
        await _send_json(writer, 200, completion)
        return True

    async def _model_latency(self) -> None:
        cfg, state = self.state.config, self.state
        if cfg.latency_base_s <= 0 and cfg.latency_per_seq_s <= 0:
            return
        if self._seq_slots is None:
            self._seq_slots = asyncio.Semaphore(cfg.max_num_seqs)
        async with self._seq_slots:
            state.running += 1
            state.max_running_seen = max(state.max_running_seen, state.running)
            try:
                await asyncio.sleep(cfg.latency_base_s + cfg.latency_per_seq_s * state.running)
            finally:
                state.running -= 1

    async def settle(self) -> None:
        """After `serve` ended: end every task left on the loop without leaving a socket open.

        A connection the kernel accepted as the server closed sits in asyncio's
        `_accept_connection2` task; cancelled before its first step (CPython 3.11), its socket is
        never wrapped in a transport and never closed: the "unclosed socket" warning a later test
        would collect. So those tasks run to their end first (each then registers its writer in
        `_accept`), and only then are the handlers cancelled and every writer closed."""
        me = asyncio.current_task()
        accepting = [t for t in asyncio.all_tasks() if t is not me and not t.done()
                     and t.get_coro().__qualname__.endswith("_accept_connection2")]
        if accepting:
            await asyncio.wait(accepting, timeout=5)
        for writer in list(self._writers):
            writer.close()
        pending = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        writers = list(self._writers)
        await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)

    async def serve(self, host: str, port: int, ready: Callable[[int], None] | None = None):
        server = await asyncio.start_server(self._accept, host, port, limit=2**26)
        bound_port = server.sockets[0].getsockname()[1]
        if ready:
            ready(bound_port)
        try:
            await asyncio.get_running_loop().create_future()  # serve until cancelled (stop)
        finally:
            await _close_listener(server)
            # Keep-alive connections outlive the listener; close them so no transport leaks,
            # and give the loop the turns it needs to really close each socket.
            writers = list(self._writers)
            for writer in writers:
                writer.close()
            await asyncio.wait_for(asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True),
                                   timeout=2)


async def _close_listener(server: asyncio.Server) -> None:
    """`server.close()`, leaking no connection accepted just before it.

    asyncio accepts a connection in one loop turn (`_accept_connection`) and wraps it in a
    transport in a task's first step (`_accept_connection2`), a turn later. If the server was
    closed in between (a stop that lands in the turn a connection arrives: `serve_forever`'s own
    close on cancel), the transport's constructor fails `Server._attach`'s assertion (CPython
    3.11), asyncio swallows the error (logged in debug mode only) and that transport is never
    closed: "unclosed transport" and "unclosed socket" when the collector finds it. So: accept
    nothing more, give the connections already accepted the turn that makes their transports while
    the server is still open (`settle` then closes them), and only then close it."""
    loop = asyncio.get_running_loop()
    for sock in server.sockets:
        loop.remove_reader(sock.fileno())  # an accept already queued in this turn is cancelled too
    try:
        await asyncio.sleep(0)  # accept tasks created up to this turn take their first step before this one resumes
    finally:
        server.close()  # even if a second stop cancels the wait


def _validate_like_vllm(body: dict, cfg: FakeConfig) -> tuple[int, dict] | None:
    if body.get("model") != cfg.served_model_name:
        return 404, _error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404, "model")
    if body.get("logprob_token_ids") and not body.get("logprobs"):
        return 400, _error("when using `logprob_token_ids`, `logprobs` must be set to true.", "BadRequestError", 400,
                           "logprob_token_ids")
    if not cfg.trust_request_mm_kwargs:
        for param in ("mm_processor_kwargs", "media_io_kwargs"):
            if body.get(param):
                return 400, _error(
                    f"Per-request {param} are disabled by default because they can change "
                    "multimodal preprocessing resource usage. Start the server with "
                    "--trust-request-mm-kwargs only when clients are trusted.",
                    "BadRequestError", 400, param)
    for message in body.get("messages", []):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            url = (part.get("image_url") or part.get("video_url") or {}).get("url", "")
            if url.startswith("data:"):
                _, _, payload = url.partition(";base64,")
                for piece in payload.split(","):
                    try:
                        base64.b64decode(piece, validate=True)
                    except (binascii.Error, ValueError):
                        return 400, _error("invalid base64 in data URL", "BadRequestError", 400)
    return None


def decode_video_part(url: str, num_frames: int = 32) -> list[bytes]:
    """The JPEG frames vLLM's loader would keep from a `data:video/jpeg;base64,...` URL."""
    _, _, payload = url.partition(";base64,")
    pieces = payload.split(",") if num_frames < 0 else payload.split(",", num_frames)[:num_frames]
    return [base64.b64decode(p, validate=True) for p in pieces]


def _mean_colour(body: dict) -> tuple[list[float], int]:
    """The mean [r, g, b] / 255 of every frame in the conversation's video parts and 1, and a token
    count (one per frame) for `usage`."""
    from io import BytesIO

    from PIL import Image

    num_frames = ((body.get("media_io_kwargs") or {}).get("video") or {}).get("num_frames", 32)
    sums, count = [0.0, 0.0, 0.0], 0
    for message in body.get("messages", []):
        for part in message.get("content") if isinstance(message.get("content"), list) else []:
            if part.get("type") == "video_url":
                for jpeg in decode_video_part(part["video_url"]["url"], num_frames):
                    with Image.open(BytesIO(jpeg)) as image:
                        means = [sum(h * i for i, h in enumerate(band.histogram())) / (image.width * image.height)
                                 for band in image.convert("RGB").split()]
                    sums = [s + m for s, m in zip(sums, means, strict=True)]
                    count += 1
    return [*(s / max(count, 1) / 255.0 for s in sums), 1.0], max(count, 1)  # never all zeros (black frames)


_FAKE_TOKENS = re.compile(r"<[^>]*>|\d|\s+|[A-Za-z]+|.", re.S)  # tags, single digits (as Qwen), words


def _logprobs(text: str, cfg: FakeConfig) -> dict:
    """vLLM's `logprobs.content` for `text`: certain tokens, but the first digit or yes/no token
    carries cfg.answer_top_logprobs."""
    content, answered = [], False
    # a character beyond ASCII comes back as one byte token per UTF-8 byte, each shown as U+FFFD
    # (as vLLM shows a byte-level token that is not a whole character): the strings no longer add
    # up to the text
    tokens = [piece for token in _FAKE_TOKENS.findall(text)
              for piece in (["\ufffd"] * len(token.encode()) if len(token) == 1 and ord(token) > 127 else [token])]
    for token in tokens:
        top = [{"token": token, "logprob": 0.0}]
        if not answered and cfg.answer_top_logprobs and (token.isdigit() or token.lower() in ("yes", "no")):
            answered = True
            top = [{"token": t, "logprob": lp} for t, lp in cfg.answer_top_logprobs.items()]
        content.append({"token": token, "logprob": top[0]["logprob"], "top_logprobs": top})
    return {"content": content}


def _token_ids(text: str, cfg: FakeConfig) -> list[int]:
    if text in cfg.vocab:
        return [cfg.vocab[text]]
    return [cfg.vocab.get(piece, 100_000 + sum(piece.encode()) % 50_000) for piece in _FAKE_TOKENS.findall(text)]


def _label_logprobs(body: dict, cfg: FakeConfig, labels: dict[str, float]) -> dict:
    """vLLM 0.32's answer to `logprob_token_ids` (with return_tokens_as_token_ids): at the first
    token, the logprob of exactly the asked ids (and of the sampled token, the likeliest word)."""
    ids = {cfg.vocab[word]: lp for word, lp in labels.items()}
    top = {token: max(ids.get(token, -9999.0), -9999.0) for token in body["logprob_token_ids"]}
    sampled = max(top, key=top.get)

    def name(token: int) -> str:
        return f"token_id:{token}" if body.get("return_tokens_as_token_ids") else \
            next((w for w, i in cfg.vocab.items() if i == token), "?")
    return {"content": [{"token": name(sampled), "logprob": top[sampled],
                         "top_logprobs": [{"token": name(t), "logprob": lp} for t, lp in top.items()]}]}


def _completion(body: dict, cfg: FakeConfig, texts: str | list[str], finish_reason: str) -> dict:
    texts = [texts] if isinstance(texts, str) else texts
    tokens = sum(max(1, len(t) // 4) for t in texts)
    return {
        "id": f"chatcmpl-fake-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": cfg.served_model_name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                     "finish_reason": finish_reason,
                     "logprobs": _logprobs(text, cfg) if body.get("logprobs") else None}
                    for i, text in enumerate(texts)],
        "usage": {"prompt_tokens": 100, "completion_tokens": tokens, "total_tokens": 100 + tokens},
    }


def _error(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


async def _read_request(reader: asyncio.StreamReader):
    try:
        head = await reader.readuntil(CRLF + CRLF)
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return method, path.split("?", 1)[0], headers, body


def _head(status: int, length: int | None, content_type: str, extra: dict | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"content-type: {content_type}"]
    if length is not None:
        lines.append(f"content-length: {length}")
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _send_raw(writer, status: int, payload: bytes, content_type: str, extra=None) -> None:
    writer.write(_head(status, len(payload), content_type, extra) + payload)
    await writer.drain()


async def _send_json(writer, status: int, obj: Any, extra: dict | None = None) -> None:
    await _send_raw(writer, status, json.dumps(obj).encode(), "application/json", extra)


async def _send_sse(writer, completion: dict, word_delay_s: float = 0.0) -> None:
    """Stream the reply word by word as vLLM does, then [DONE]; chunked and kept alive, as
    vLLM's uvicorn sends it (so a client can reuse the connection once the stream ended)."""
    writer.write(_head(200, None, "text/event-stream", {"transfer-encoding": "chunked"}))

    def chunk(data: bytes) -> bytes:
        return f"{len(data):x}".encode() + CRLF + data + CRLF

    text = completion["choices"][0]["message"]["content"]
    words = text.split(" ")
    for i, word in enumerate(words):
        delta = {"content": word + (" " if i < len(words) - 1 else "")}
        event = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
                 "model": completion["model"],
                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        writer.write(chunk(f"data: {json.dumps(event)}\n\n".encode()))
        await writer.drain()
        if word_delay_s:
            await asyncio.sleep(word_delay_s)
    final = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
             "model": completion["model"],
             "choices": [{"index": 0, "delta": {}, "finish_reason": completion["choices"][0]["finish_reason"]}]}
    writer.write(chunk(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()) + b"0" + CRLF + CRLF)
    await writer.drain()


class FakeVLLMThread:
    """Runs a FakeVLLM on its own event loop in a daemon thread; `with` starts and stops it."""

    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.fake = FakeVLLM(config)
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._task: asyncio.Task | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        def ready(port: int) -> None:
            self.port = port
            self._ready.set()

        self._task = self._loop.create_task(self.fake.serve(self.host, self.port, ready))
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.run_until_complete(self.fake.settle())
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def start(self) -> FakeVLLMThread:
        self._thread.start()
        if not self._ready.wait(HANG_S):
            raise RuntimeError("fake vLLM did not start")
        return self

    def stop(self) -> None:
        if self._task is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed between the check and the call
                self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def __enter__(self) -> FakeVLLMThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # Convenience pass-throughs so tests read naturally.
    def script(self, *actions: dict) -> None:
        self.fake.script(*actions)

    @property
    def config(self) -> FakeConfig:
        return self.fake.state.config

    @property
    def chat_requests(self) -> list[dict]:
        return self.fake.chat_requests

    @property
    def embedding_requests(self) -> list[dict]:
        return self.fake.embedding_requests


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake `vllm serve` for tests and benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="fake-model")
    parser.add_argument("--default-text", default=DEFAULT_TEXT)
    parser.add_argument("--untrusting", action="store_true",
                        help="refuse per-request media kwargs like a server without --trust-request-mm-kwargs")
    parser.add_argument("--no-record", action="store_true", help="do not keep request bodies")
    parser.add_argument("--latency-base-s", type=float, default=0.0)
    parser.add_argument("--latency-per-seq-s", type=float, default=0.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                        help="like stock vLLM: /v1/* needs this bearer token (default $VLLM_API_KEY)")
    args = parser.parse_args(argv)
    fake = FakeVLLM(FakeConfig(
        served_model_name=args.served_model_name, default_text=args.default_text,
        trust_request_mm_kwargs=not args.untrusting, record=not args.no_record,
        latency_base_s=args.latency_base_s, latency_per_seq_s=args.latency_per_seq_s,
        max_num_seqs=args.max_num_seqs, api_key=args.api_key))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(fake.serve(args.host, args.port, lambda p: print(f"fake vllm listening on {p}", flush=True)))


if __name__ == "__main__":
    main()
