"""The ids of a probability answer's two words (proxy/answers/probability.py), as the server
that will answer numbers them: its own POST /tokenize, once per endpoint, served model and word.

Asked of the endpoint the chat call is about to use, inside that call's slot and retry policy, so a
replica that cannot tokenize fails like one that cannot answer. A word must be ONE token: the
answer is one token's probability, and "True" split in two would make P(first piece) the score.
"""

from __future__ import annotations

import asyncio
import copy
import time

from proxy.answers.probability import AnswerTokens
from proxy.errors import PromptTemplateError, ProxyError, UpstreamTimeout
from proxy.upstream.client import UpstreamClient
from proxy.upstream.pool import Endpoint

__all__ = ["AnswerTokenIds"]


class AnswerTokenIds:
    def __init__(self, upstream: UpstreamClient) -> None:
        self.upstream = upstream
        # (endpoint, served model, word) → its one token id; asked once even by concurrent first requests
        self._ids: dict[tuple[str, str, str], asyncio.Future[int]] = {}

    async def resolve(self, endpoint: Endpoint, model: str, words: tuple[str, str], *, timeout_s: float,
                      lookup_timeout_s: float, api_key: str | None) -> AnswerTokens:
        """Both ids within `timeout_s` in all (a caller waiting on another's lookup included). A
        lookup this call starts is shared, so it runs for the backend's own `lookup_timeout_s`
        (retry.timeout_s), not this caller's time: its timeout is then the replica's."""
        ends = time.monotonic() + timeout_s
        ids = [await self._one(endpoint, model, word, ends, lookup_timeout_s, api_key) for word in words]
        if ids[0] == ids[1]:
            raise PromptTemplateError(f"the probability answer's words {words[0]!r} and {words[1]!r} are the same "
                                      f"token ({ids[0]}) for model {model!r}")
        return AnswerTokens(words[0], words[1], ids[0], ids[1])

    def forget(self, endpoint: str) -> None:
        """Ask `endpoint` again next time (its ids did not name its words: another tokenizer now)."""
        for key in [key for key in self._ids if key[0] == endpoint]:
            del self._ids[key]

    async def _one(self, endpoint: Endpoint, model: str, word: str, ends: float, lookup_timeout_s: float,
                   api_key: str | None) -> int:
        key = (endpoint.base_url, model, word)
        held = self._ids.get(key)
        left = ends - time.monotonic()
        if held is None:
            held = self._ids[key] = asyncio.ensure_future(self._ask(endpoint, model, word, lookup_timeout_s, api_key))

            def uncache(done: asyncio.Future[int]) -> None:  # a failure is asked again, never cached
                if (done.cancelled() or done.exception()) and self._ids.get(key) is done:
                    del self._ids[key]  # (not a newer lookup's entry, after forget())
            held.add_done_callback(uncache)
        try:
            # One caller giving up does not cancel the others' answer (shield); each waits only
            # for its own time, not for the lookup another, more patient caller started.
            return await asyncio.wait_for(asyncio.shield(held), max(left, 0.0))
        except TimeoutError:
            raise UpstreamTimeout(f"{endpoint.base_url} did not answer /tokenize in time",
                                  endpoint=endpoint.base_url) from None
        except ProxyError as err:  # one lookup's error, each waiter its own copy (retries set its attempts)
            raise copy.copy(err) from err

    async def _ask(self, endpoint: Endpoint, model: str, word: str, timeout_s: float, api_key: str | None) -> int:
        tokens = await self.upstream.tokenize(endpoint, model, word, timeout_s=timeout_s, api_key=api_key)
        if len(tokens) != 1:
            raise PromptTemplateError(
                f"the probability answer's word {word!r} is {len(tokens)} tokens {tokens} for model {model!r} "
                f"at {endpoint.base_url}: its probability is one token's, so choose a word that is one token")
        return tokens[0]
