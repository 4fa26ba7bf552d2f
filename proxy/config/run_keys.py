"""proxy.run_keys: scoring keys limited to some runs (docs/security.md, "Runs are kept apart").

Each entry names the environment variable holding one key and the runs that key may write: exact
names (`runs`) and name prefixes (`run_prefixes`, so identities generated per job fit). A run is
the episode's `metadata.run`, the monitor's key and the reference namespace. An episode without a
run belongs to no run a limited key holds: such a key always names its run.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from proxy.config.strict import StrictModel

__all__ = ["RunKeyConfig", "RunScope"]

RunName = Annotated[str, Field(min_length=1, max_length=256)]


class RunScope(StrictModel):
    """The runs one key may write: exact names and prefixes."""

    runs: list[RunName] = Field(default_factory=list)
    run_prefixes: list[RunName] = Field(default_factory=list)

    def allows(self, run: object) -> bool:
        """True for a run name the scope holds; anything that is not a name (None, a number) is not."""
        return isinstance(run, str) and (run in self.runs or any(run.startswith(p) for p in self.run_prefixes))

    def describe(self) -> str:
        names = [repr(r) for r in self.runs] + [f"{p!r}…" for p in self.run_prefixes]
        return ", ".join(names)


class RunKeyConfig(RunScope):
    section = "proxy.run_keys[]."

    key_env: str = Field(min_length=1)  # the env var holding the key, as proxy.api_key_env

    @model_validator(mode="after")
    def _names_some_run(self) -> RunKeyConfig:
        if not self.runs and not self.run_prefixes:
            raise ValueError("a run key needs runs or run_prefixes (an unlimited key is proxy.api_key_env)")
        return self

    @property
    def scope(self) -> RunScope:
        return RunScope(runs=self.runs, run_prefixes=self.run_prefixes)
