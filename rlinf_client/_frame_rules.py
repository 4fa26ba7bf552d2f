"""The proxy's frame rules for this client's backend (GET /frame-rules), so episodes can go as
JPEGs already at the size the proxy sends (`frame_encoding: auto`): asked once, asked again after
the proxy says they changed (409 frame_rules_changed), never asked of a proxy that lacks the route.

Any doubt means raw frames, never frames of a guessed size: no OpenCV here, a proxy without the
route (404/405), an answer of another format, a backend it does not list, or a failed request
(asked again after FRAME_RULES_RETRY_S).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from rlinf_client import _constants as C
from rlinf_client._base_client import TransportCore, response_json
from vlm_protocol import frame_codec
from vlm_protocol.frame_rules import FrameRules

log = logging.getLogger("rlinf_client")

__all__ = ["FrameRulesCache"]


class FrameRulesCache:
    def __init__(self, core: TransportCore) -> None:
        self.core = core
        cfg = core.cfg
        # Only picked frames can be made ready (a curve's prefixes each pick their own); a path is an MP4.
        self.wanted = (cfg.frame_encoding == "auto" and cfg.client_sampling and not cfg.dense_points
                       and cfg.transport != "path")
        self.rules: FrameRules | None = None
        self._unsupported = False  # the proxy has no /frame-rules: raw frames for good
        self._retry_at = 0.0  # after a failed fetch: not before this (time.monotonic)
        self._said: set[str] = set()
        self._lock = asyncio.Lock()

    async def get(self) -> FrameRules | None:
        """The rules to encode this episode for, or None: send it raw."""
        if not self.wanted or self._unsupported:
            return None
        if not frame_codec.available():
            self._once("opencv", "OpenCV is not installed here: frames go raw and the proxy resizes and encodes "
                                 "them (pip install opencv-python-headless to do it in the env workers)")
            self._unsupported = True
            return None
        if self.rules is None and time.monotonic() >= self._retry_at:
            async with self._lock:
                if self.rules is None and time.monotonic() >= self._retry_at:
                    await self._fetch()
        return self.rules

    def changed(self, rules_id: str | None) -> None:
        """The proxy refused frames encoded for `rules_id` (409): forget them, ask again next time."""
        if self.rules is not None and self.rules.rules_id == rules_id:
            log.warning("the proxy's frame rules for backend %s changed: this episode goes again as raw "
                        "frames, and the rules are fetched again", self.rules.backend)
            self.rules = None

    async def _fetch(self) -> None:
        cfg = self.core.cfg
        try:
            response = await self.core.http.get(cfg.frame_rules_url, timeout=cfg.connect_timeout * 2)
        except httpx.TransportError as err:
            return self._failed(f"{type(err).__name__}: {err}")
        self.core.stats.requests += 1
        if response.status_code in (404, 405):
            self._unsupported = True
            self._once("route", f"the proxy at {cfg.base_url} has no {C.FRAME_RULES_PATH}: frames go raw")
            return None
        body = response_json(response)
        if response.status_code != 200 or not isinstance(body, dict) or not isinstance(body.get("backends"), dict):
            return self._failed(f"HTTP {response.status_code}: {str(body)[:300]}")
        entries = body["backends"]
        name = body.get("default") if cfg.backend is None else next(
            (n for n, e in entries.items() if isinstance(e, dict) and cfg.backend in (e.get("labels") or ())), None)
        if name not in entries:
            return self._failed(f"backend {cfg.backend or 'default'!r} is not among its chat backends")
        try:
            self.rules = FrameRules.from_dict(entries[name])
        except ValueError as err:
            self._unsupported = True  # another format: this proxy will not change it while it runs
            self._once("format", f"the proxy's frame rules are not this client's format ({err}): frames go raw")
        return None

    def _failed(self, why: str) -> None:
        self._retry_at = time.monotonic() + C.FRAME_RULES_RETRY_S
        log.warning("cannot read the proxy's frame rules (%s): frames go raw, asked again in %gs",
                    why, C.FRAME_RULES_RETRY_S)

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.info(message)
