"""The base of every config model: unknown keys refused (a typo names its dotted path), frozen.

A model may list keys it has renamed (`renamed`: old key to new key). Configs written before the
rename keep loading: the old key is read as the new one, and the load logs one line naming the
new key, so the file can be updated at leisure. Giving both spellings is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["PositiveInt", "StrictModel"]

log = logging.getLogger("proxy.config")

PositiveInt = Annotated[int, Field(gt=0)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Old key -> new key, and where the model sits in a config file (for the log line).
    renamed: ClassVar[Mapping[str, str]] = {}
    section: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _read_renamed_keys(cls, data: Any) -> Any:
        if not cls.renamed or not isinstance(data, Mapping) or not set(data) & set(cls.renamed):
            return data
        data = dict(data)
        for old, new in cls.renamed.items():
            if old not in data:
                continue
            if new in data:
                raise ValueError(f"{old} and {new} are one setting ({old} is its old name): give only {new}")
            data[new] = data.pop(old)
            log.warning("config: %s%s is now called %s%s (read as such; rename it in the file)",
                     cls.section, old, cls.section, new)
        return data
