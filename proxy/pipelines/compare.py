"""The /compare pipeline (RL-VLM-F preferences): two episodes of one task become label 0, 1 or -1.

Each episode's frames are loaded as /score loads them (proxy/pipelines/episode_frames.py) and
every call goes through the backend's one ask, so a comparison is sampled, sized, retried and
counted like a score. One query is one call. `two_step` makes it two: the first compares in words
with both episodes, the second is text only and reads the label from the first reply. `swap` asks
both orders concurrently, and when they disagree the answer is no preference. Each comparison,
labelled or failed, leaves one audit line (kind `compare`) through its envelope.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proxy.answers.preference import (
    DEFAULT_COMPARE_PROMPT,
    PROMPT_NAME,
    ComparePrompt,
    combine_orders,
    parse_compare_template,
    parse_label,
    read_description,
    swap_label,
)
from proxy.answers.reply import ChatReply
from proxy.errors import (
    MAX_REPLY_CHARS,
    InvalidRequest,
    LabelParseError,
    ProxyError,
    UpstreamTimeout,
)
from proxy.pipelines.batch import run_batch
from proxy.pipelines.envelope import COMPARE, COMPARE_ITEM, Effects, Envelope
from proxy.pipelines.episode_frames import load_episode
from proxy.pipelines.frames_scoring import count_reply
from proxy.pipelines.services import Services
from proxy.prompting.layouts import (
    build_compare_body,
    build_text_body,
    check_token_budget,
    encode_body,
    vision_token_count,
)
from proxy.prompting.request import (
    SAMPLING_FIELDS,
    ResolvedRequest,
    resolve_request,
    sampling_for_ask,
    split_backend_kwargs,
)
from proxy.prompting.templates import PromptStore
from proxy.protocol.common import PromptInfo
from proxy.protocol.compare import CompareOrder, CompareRequest, CompareResponse
from proxy.protocol.score import ScoreRequest
from proxy.upstream.backends import Backend
from proxy.upstream.pool import Endpoint
from proxy.upstream.retry import Attempt

__all__ = ["ORDERS", "Comparer"]

log = logging.getLogger(__name__)
T = TypeVar("T")
ORDERS = ([0, 1], [1, 0])


@dataclass
class _Comparison:
    """One comparison's settings and what it went through (its audit line)."""

    backend: Backend
    prompt: ComparePrompt
    values: dict[str, Any]  # the template's variables
    resolved: ResolvedRequest
    two_step: bool
    ends: float  # monotonic time by which the last call must be done
    budgeted: bool  # `ends` is the caller's budget (else the retry deadline)
    frames: list[Any] = field(default_factory=list)  # EncodedFrames per episode, the request's order
    fps: float = 0.0
    calls: int = 0
    record: dict[str, Any] = field(default_factory=dict)


class Comparer:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.prompts = PromptStore(services.prompts.directory, parser=parse_compare_template)

    async def compare(self, request: CompareRequest, *, budget_s: float | None) -> CompareResponse:
        """POST /compare: one comparison, admitted on its own."""
        return await self._compare_in(COMPARE, request, budget_s)

    async def compare_batch(self, items: list[Any], *, budget_s: float | None) -> list[dict[str, Any]]:
        """Every item compared concurrently; each gets its own result or its own error, in order."""
        return await run_batch(items, lambda item: self._compare_in(COMPARE_ITEM, CompareRequest.model_validate(item),
                                                                    budget_s), "batch comparison")

    async def _compare_in(self, effects: Effects, request: CompareRequest, budget_s: float | None) -> CompareResponse:
        started = time.perf_counter()
        record: dict[str, Any] = {
            "task_text": request.task_text,
            "metadata": [e.metadata.model_dump(exclude_none=True) if e.metadata else None for e in request.episodes],
            "two_step": request.two_step, "swap": request.swap}
        comparison: _Comparison | None = None
        envelope = Envelope(self.services, effects, request.backend)
        envelope.describe = lambda: {"kind": "compare", "backend": envelope.backend.name, **record}
        with envelope:
            backend = envelope.backend
            try:
                comparison = self._prepare(request, backend, budget_s, record)
                response = await self._compare(request, comparison, started)
            except ProxyError as err:
                if comparison is not None and err.attempts is not None:
                    err.attempts = comparison.calls  # every step and order, not only the one that failed
                raise
            envelope.done({**envelope.describe(), "model": response.model, "label": response.label,
                           "agree": response.agree,
                           "orders": [{**o.model_dump(include={"order", "raw_label", "label", "source"}),
                                       "output_text": o.output_text[:MAX_REPLY_CHARS],
                                       "description": o.description and o.description[:MAX_REPLY_CHARS]}
                                      for o in response.orders],
                           "attempts": response.attempts, "timings_ms": response.timings_ms},
                          str(response.label), seconds=response.timings_ms["total"] / 1e3)
        return response

    def _prepare(self, request: CompareRequest, backend: Backend, budget_s: float | None,
                 record: dict[str, Any]) -> _Comparison:
        cfg = backend.config
        name = DEFAULT_COMPARE_PROMPT if request.prompt is None else request.prompt  # "" names no template
        if not PROMPT_NAME.match(name) or not self.prompts.path_of(name).is_file():
            raise InvalidRequest(f"prompt {name!r} is not a comparison template; prompts_dir holds "
                                 f"{', '.join(self.prompt_names()) or 'none'}", field="prompt")
        prompt = self.prompts.get(name)
        record["prompt"] = {"name": prompt.name, "sha256": prompt.sha256}
        sampling, variables, _ = split_backend_kwargs(request.backend_kwargs, prompt)
        values: dict[str, Any] = {"task_text": request.task_text, **variables}
        first = self._episode_request(request, 0, sampling)
        resolved = resolve_request(first, cfg, self.services.prompts.get(cfg.prompt), self.services.settings.proxy)
        if cfg.layout == "shuffled_images":
            raise InvalidRequest(f"backend {backend.name!r} uses the shuffled_images layout (one value per shuffled "
                                 "frame): /compare shows two episodes in order; use a backend with another layout",
                                 field="backend")
        if resolved.answer.probability:  # its sampling is one token: a label (-1 is two) would be cut
            raise InvalidRequest(f"backend {backend.name!r} answers with a probability (prompt {cfg.prompt!r} reads "
                                 "one token's logprobs): /compare needs a reply that writes a label (-1, 0 or 1); "
                                 "use another backend", field="backend")
        if cfg.layout == "images" and 2 * resolved.limits.nframes > cfg.frames.nframes:
            raise InvalidRequest(f"backend uses the images layout, one image per frame; two episodes of "
                                 f"{resolved.limits.nframes} frames are over its frames.nframes={cfg.frames.nframes} "
                                 f"images (--limit-mm-per-prompt): ask for at most {cfg.frames.nframes // 2}",
                                 field="nframes")
        record["sampling"] = resolved.sampling.model_dump(exclude_none=True)
        seconds, budgeted = cfg.retry.deadline_s, False
        if budget_s is not None and budget_s < seconds:
            seconds, budgeted = budget_s, True
        return _Comparison(backend=backend, prompt=prompt, values=values, resolved=resolved,
                           two_step=request.two_step, ends=time.monotonic() + seconds, budgeted=budgeted,
                           record=record)

    def prompt_names(self) -> list[str]:
        return sorted(p.stem for p in self.prompts.directory.glob("compare_*.yaml") if PROMPT_NAME.match(p.stem))

    @staticmethod
    def _episode_request(request: CompareRequest, index: int, sampling: dict[str, Any]) -> ScoreRequest:
        episode = request.episodes[index]
        return ScoreRequest(task_text=request.task_text, video_path=episode.video_path, frames=episode.frames,
                            frames_npy=episode.frames_npy, fps=episode.fps, video_fps=request.video_fps,
                            nframes=request.nframes, max_pixels=request.max_pixels, backend=request.backend,
                            backend_kwargs=sampling)

    async def _compare(self, request: CompareRequest, c: _Comparison, started: float) -> CompareResponse:
        cfg, sampling = c.backend.config, {k: v for k, v in request.backend_kwargs.items() if k in SAMPLING_FIELDS}
        loaded = await asyncio.gather(*(load_episode(
            self.services, self._episode_request(request, i, sampling), cfg, c.resolved.limits,
            c.resolved.requested_nframes) for i in (0, 1)))
        c.frames, c.fps = [item.frames for item in loaded], loaded[0].fps
        infos = [item.info.model_copy(update={"fps": round(c.fps, 6)}) for item in loaded]  # one rate is sent
        c.record.update(frames=[i.model_dump(include={"count", "requested", "indices", "size", "still_size", "fps",
                                                      "vision_tokens", "sha256", "still_sha256"}) for i in infos],
                        frame_store=[item.stored for item in loaded])
        self._check_token_budget(c)
        upstream_started = time.perf_counter()
        orders = ORDERS if request.swap else ORDERS[:1]
        tasks = [asyncio.ensure_future(self._query(c, order)) for order in orders]
        try:
            answered: list[CompareOrder] = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        label, agree = ((answered[0].label, None) if len(answered) == 1
                        else combine_orders(answered[0].raw_label, answered[1].raw_label))
        finished = time.perf_counter()
        load_ms = sum(f.load_ms + f.encode_ms for f in c.frames)
        return CompareResponse(
            label=label, agree=agree, orders=answered, backend=c.backend.name, model=cfg.model,
            two_step=request.two_step, swap=request.swap, attempts=c.calls,
            prompt=PromptInfo(name=c.prompt.name, sha256=c.prompt.sha256), frames=infos,
            sampling=c.record["sampling"],
            timings_ms={"load": round(load_ms, 3), "upstream": round((finished - upstream_started) * 1e3, 3),
                        "total": round((finished - started) * 1e3, 3)})

    async def _query(self, c: _Comparison, order: list[int]) -> CompareOrder:
        """One order: one call, or two with two_step."""
        cfg, prompt = c.backend.config, c.prompt
        system = prompt.render("system", c.values)
        labels = [prompt.render("episode_label", {**c.values, "number": n}) or "" for n in (1, 2)]
        shown = [c.frames[i] for i in order]
        calls_before, description = c.calls, None
        if c.two_step:
            body = build_compare_body(cfg, c.resolved.sampling, system, labels,
                                      prompt.render("describe", c.values) or "", shown, c.fps)
            _, description, _ = await self._ask(
                c, body, lambda r: read_description(r.text, finish_reason=r.finish_reason))
            body = build_text_body(cfg, c.resolved.sampling, system,
                                   prompt.render("label", {**c.values, "description": description}) or "")
        else:
            body = build_compare_body(cfg, c.resolved.sampling, system, labels,
                                      prompt.render("query", c.values) or "", shown, c.fps)
        reply, (raw, source), asks = await self._ask(
            c, body, lambda r: parse_label(r.text, prompt, finish_reason=r.finish_reason))
        return CompareOrder(order=order, raw_label=raw, label=raw if order == [0, 1] else swap_label(raw),
                            output_text=reply.text, description=description, source=source,
                            attempts=c.calls - calls_before, asks=asks, endpoint=reply.endpoint, usage=reply.usage)

    async def _ask(self, c: _Comparison, body: dict[str, Any], parse: Callable[[ChatReply], T]
                   ) -> tuple[ChatReply, T, int]:
        """One step under the retry policy: (reply, what parse read from it, asks)."""
        cfg, backend, metrics = c.backend.config, c.backend, self.services.metrics
        first_ask, asks = encode_body(body), 0

        async def body_for(_endpoint: Endpoint, attempt: Attempt) -> bytes:
            nonlocal asks
            asks = attempt.parse_round + 1
            return first_ask if attempt.parse_round == 0 else encode_body(
                body, sampling_for_ask(cfg, c.resolved.sampling, attempt.parse_round))

        def seen(reply: ChatReply) -> None:
            c.record["output_text"] = reply.text[:MAX_REPLY_CHARS]
            c.record["finish_reason"], c.record["endpoint"] = reply.finish_reason, reply.endpoint
            count_reply(self.services, backend.name, reply)

        def read(reply: ChatReply) -> T:
            try:
                return parse(reply)
            except LabelParseError:
                metrics.parse_failures.labels(backend.name).inc()
                raise

        left = c.ends - time.monotonic()
        if left <= 0:
            raise UpstreamTimeout(f"{'the caller' if c.budgeted else 'the retry'} deadline ran out between steps",
                                  attempts=c.calls)
        try:
            budget = left if c.budgeted or left < cfg.retry.deadline_s - 1 else None  # None: the deadline's own words
            reply, parsed, calls = await backend.ask(metrics, self.services.upstream.chat, body_for, read,
                                                     budget_s=budget, on_reply=seen)
        except ProxyError as err:
            c.calls += err.attempts or 0
            raise
        c.calls += calls
        return reply, parsed, asks

    def _check_token_budget(self, c: _Comparison) -> None:
        cfg = c.backend.config
        texts = [c.prompt.texts[k] or "" for k in ("system", "query", "describe")]
        chars = sum(map(len, texts)) + 2 * len(c.prompt.texts["episode_label"] or "") + len(c.values["task_text"])
        vision = sum(vision_token_count(cfg.layout, frames) for frames in c.frames)
        check_token_budget(cfg, c.resolved.sampling.max_tokens, vision, chars,
                           f"two episodes of {c.resolved.limits.nframes} frames")
