"""What the route modules share: the app's services as a typed dependency, the caller's budget header, and
the error statuses every route but /health can answer."""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Depends, Request

from proxy.errors import InvalidRequest
from proxy.pipelines.services import Services
from vlm_protocol.wire import BUDGET_HEADER

__all__ = ["ALWAYS", "ServicesDep", "budget_of"]

ALWAYS = (401, 500, 503)  # any route but /health: auth, a bug, shutting down


async def _services(request: Request) -> Services:  # async: no threadpool hop per request
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(_services)]


def budget_of(request: Request) -> float | None:
    """The caller's remaining budget in seconds (BUDGET_HEADER, milliseconds), if it sent one."""
    raw = request.headers.get(BUDGET_HEADER)
    if raw is None:
        return None
    try:
        budget_ms = float(raw)
    except ValueError:
        budget_ms = math.nan
    if not math.isfinite(budget_ms) or budget_ms <= 0:
        raise InvalidRequest(f"header {BUDGET_HEADER} must be a positive number of milliseconds, got {raw!r}",
                             field=BUDGET_HEADER)
    return budget_ms / 1e3
