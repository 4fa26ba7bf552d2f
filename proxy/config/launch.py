"""A backend's `launch` section — how `vlm-reward-proxy up` starts its `vllm serve` processes —
and where a server bound to a host can be reached (shared by the proxy's own bind check)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from proxy.config.strict import PositiveInt, StrictModel

__all__ = ["WILDCARD_HOSTS", "LaunchConfig", "ReplicaLaunch", "connect_host", "is_loopback"]

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: only this machine can connect."""
    return host in ("localhost", "::1") or host.startswith("127.")


def connect_host(host: str) -> str:
    """Where to connect to reach a server bound to `host` (a wildcard is reachable on loopback)."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


class ReplicaLaunch(StrictModel):
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)  # none for launch.device cpu
    port: int = Field(ge=1, le=65535)
    # More environment for this replica only, over the backend's launch.env (e.g. a CPU server's
    # VLLM_CPU_OMP_THREADS_BIND, so two replicas on one machine use different cores).
    env: dict[str, str] = Field(default_factory=dict)


class LaunchConfig(StrictModel):
    """How `vlm-reward-proxy up` starts this backend's `vllm serve` processes."""

    model_path: str
    replicas: list[ReplicaLaunch] = Field(min_length=1)
    # cpu: a CPU build of vLLM (the tiny test model, configs/cpu-tiny.yaml); the launcher adds the
    # CPU flags (launchers/commands.py CPU_ARGS) and no CUDA_VISIBLE_DEVICES.
    device: Literal["gpu", "cpu"] = "gpu"
    tensor_parallel_size: PositiveInt = 1
    host: str = "127.0.0.1"
    max_model_len: PositiveInt = 16384  # the seed's, and PRIMO-R1's evaluation's
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    limit_mm_per_prompt: dict[str, int] | None = None  # None = derived from the layout
    seed: int = 0
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _gpus_match_tp(self) -> LaunchConfig:
        if self.device == "cpu":
            if self.tensor_parallel_size != 1:
                raise ValueError("device cpu runs one process per replica: tensor_parallel_size must be 1")
            listed = [i for i, replica in enumerate(self.replicas) if replica.gpus]
            if listed:
                raise ValueError(f"device cpu uses no GPU, but replicas{listed} list gpus: remove them")
            return self
        for i, replica in enumerate(self.replicas):
            if len(replica.gpus) != self.tensor_parallel_size:
                raise ValueError(f"replicas[{i}].gpus has {len(replica.gpus)} GPUs but "
                                 f"tensor_parallel_size is {self.tensor_parallel_size}")
        return self
