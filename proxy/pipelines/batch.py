"""One batch shape for /score/batch and /compare/batch: every item runs concurrently and gets its
own result or its own error, in request order; one broken item never sinks the batch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from proxy.errors import InvalidRequest, ProxyError
from proxy.protocol.common import validation_error

__all__ = ["check_batch_size", "run_batch"]

log = logging.getLogger(__name__)


def check_batch_size(count: int, cap: int) -> None:
    if count > cap:
        raise InvalidRequest(f"{count} items is over the batch cap of {cap} (proxy.max_batch_items)", field="items")


async def run_batch(items: list[Any], run_one: Callable[[Any], Awaitable[BaseModel]], what: str
                    ) -> list[dict[str, Any]]:
    """`run_one` validates and runs one raw item (a ValidationError is that item's 422)."""

    async def one(index: int, item: Any) -> dict[str, Any]:
        try:
            result = await run_one(item)
        except ValidationError as err:
            failure: ProxyError = validation_error(err.errors())
        except ProxyError as err:
            failure = err
        except Exception as err:  # noqa: BLE001 - one broken item must not sink the batch
            log.exception("%s %d failed unexpectedly", what, index)
            failure = ProxyError(f"internal error: {type(err).__name__}")
        else:
            return {"index": index, "ok": True, "status": 200, "result": result.model_dump(mode="json")}
        return {"index": index, "ok": False, "status": failure.status_code, "error": failure.to_dict()}

    return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))
