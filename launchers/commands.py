"""The one place the `vllm serve` flags and each replica's environment are built.

Pure: a backend config (and an environment mapping for `${VAR}` expansion) in, argv lists,
environment additions and error strings out. `launchers/_serve_vllm.sh` builds the same flags in
bash; the tests run both and compare. The checks on a whole stack live in plan.py.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.config import BackendConfig
from proxy.config.launch import connect_host
from proxy.errors import ConfigError

__all__ = ["CPU_ARGS", "CPU_KV_CACHE_ENV", "MANAGED_FLAGS", "MEDIA_IO_KWARGS", "ReplicaCommand",
           "cpu_kv_cache_bytes", "default_limit_mm", "expand_vars", "managed_flag_errors",
           "replica_commands", "shell_line", "url_host", "vllm_argv"]

# Safety net for the 32-frame truncation trap: the server keeps every frame of a video even for
# a request that sends no media_io_kwargs (see docs vllm-facts "READ FIRST").
MEDIA_IO_KWARGS = json.dumps({"video": {"num_frames": -1}})

# What a replica of `launch.device: cpu` adds before its extra_args (which may override any of them:
# vLLM keeps a flag's last value). Eager: nothing to compile. A step of 16384 tokens holds a
# 100-frame prompt: the CPU's default step crashed seeded prompts longer than itself. float32: the
# tiny test model's dtype. A KV cache sized in bytes: without it vLLM on the CPU takes most of the
# machine's memory, even for a model of a few MB (docs/stack.md "On a CPU").
CPU_ARGS = ("--enforce-eager", "--max-num-batched-tokens", "16384", "--dtype", "float32",
            "--kv-cache-memory-bytes", "128M")
# vLLM on the CPU reads this (whole GiB) over --kv-cache-memory-bytes.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"

# Flags the launcher owns; setting them again in extra_args would silently override the plan
# (vLLM's argparse keeps the last value), so they are refused with the config field to use.
MANAGED_FLAGS = {
    "--served-model-name": "backends.<name>.model",
    "--tensor-parallel-size": "launch.tensor_parallel_size",
    "-tp": "launch.tensor_parallel_size",
    "--max-model-len": "launch.max_model_len",
    "--gpu-memory-utilization": "launch.gpu_memory_utilization",
    "--limit-mm-per-prompt": "launch.limit_mm_per_prompt",
    "--media-io-kwargs": "nothing: the launcher always sends num_frames -1",
    "--trust-request-mm-kwargs": "nothing: the launcher always sets it",
    "--host": "launch.host",
    "--port": "launch.replicas[].port",
    "--seed": "launch.seed",
    "--runner": "backends.<name>.kind (embedding: --runner pooling --convert embed)",
    "--convert": "backends.<name>.kind (embedding: --runner pooling --convert embed)",
    "--api-key": "backends.<name>.api_key_env (passed to vLLM as VLLM_API_KEY)",
}

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_GPUS_VAR = "CUDA_VISIBLE_DEVICES"


def expand_vars(text: str, env: Mapping[str, str], *, what: str) -> str:
    """Expand `${NAME}`; an unset or empty variable is a ConfigError naming it and `what`."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        value = env.get(name)
        if not value:
            raise ConfigError(f"{what} uses ${{{name}}} but the environment variable {name} is "
                              "not set or empty (export it, e.g. the local path of the weights)")
        return value

    return _VAR.sub(sub, text)


def default_limit_mm(backend: BackendConfig) -> dict[str, int]:
    """What one request of this layout carries (qwen: 1 video; primo: 2 images + 1 video; a second
    camera as its own video, frames.extra_view second_video: one video more)."""
    videos = 2 if backend.frames.extra_view == "second_video" else 1
    if backend.layout == "qwen_video":
        return {"video": videos}
    if backend.layout == "primo_interleave":
        return {"image": 2, "video": videos}
    return {"image": backend.frames.nframes}


def vllm_argv(*, model_path: str, served_model_name: str, tensor_parallel_size: int,
              max_model_len: int, gpu_memory_utilization: float, limit_mm: Mapping[str, int],
              host: str, port: int, seed: int, extra_args: list[str] | tuple[str, ...] = (),
              vllm: str = "vllm", embedding: bool = False, cpu: bool = False) -> list[str]:
    """`vllm serve MODEL ...`, flags in a fixed order (docs/stack.md shows the lines), then extra_args.
    `embedding`: served as a pooling model answering /v1/embeddings (a backend of kind embedding);
    `cpu`: a CPU build of vLLM (CPU_ARGS)."""
    return [
        vllm, "serve", model_path,
        "--served-model-name", served_model_name,
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--limit-mm-per-prompt", json.dumps(dict(limit_mm)),
        "--media-io-kwargs", MEDIA_IO_KWARGS,
        "--trust-request-mm-kwargs",
        "--host", host,
        "--port", str(port),
        "--seed", str(seed),
        *(("--runner", "pooling", "--convert", "embed") if embedding else ()),
        *(CPU_ARGS if cpu else ()),
        *extra_args,
    ]


def managed_flag_errors(extra_args: list[str], *, where: str) -> list[str]:
    errors = []
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            errors.append(f"{where}: extra_args sets {flag}, which the launcher sets itself "
                          f"(use {MANAGED_FLAGS[flag]})")
    return errors


def shell_line(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable command line: `K=V ... argv`, quoted like shlex.quote."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join([*prefix, *(shlex.quote(a) for a in argv)])


def url_host(host: str) -> str:
    """A host as it goes in a URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class ReplicaCommand:
    """One `vllm serve` process of the plan."""

    backend: str
    index: int
    model: str  # served-model-name
    gpus: tuple[int, ...]
    host: str
    port: int
    argv: list[str]
    # Additions to the parent's environment: CUDA_VISIBLE_DEVICES first, then the backend's
    # launch.env, then this replica's replicas[].env over it.
    env: dict[str, str]
    # backends.<name>.api_key_env: its value goes to the server as VLLM_API_KEY (never printed,
    # never on the command line) and authorises the readiness probes of /v1/models.
    api_key_env: str | None = None
    api_key: str | None = None
    # The parent's own CUDA_VISIBLE_DEVICES (SLURM, containers), when set: `gpus` are positions
    # in it and the child's CUDA_VISIBLE_DEVICES names the devices at those positions.
    parent_visible: str | None = None

    cpu: bool = False  # launch.device cpu: no GPU, no CUDA_VISIBLE_DEVICES

    @property
    def name(self) -> str:
        return f"{self.backend}-r{self.index}"

    @property
    def probe_host(self) -> str:
        return connect_host(self.host)

    @property
    def base_url(self) -> str:
        return f"http://{url_host(self.probe_host)}:{self.port}"

    def shell_line(self) -> str:
        line = shell_line(self.argv, self.env)
        return f'VLLM_API_KEY="${self.api_key_env}" {line}' if self.api_key_env else line

    def full_env(self) -> dict[str, str]:
        return {**self.env, **({"VLLM_API_KEY": self.api_key} if self.api_key else {})}


def _expand_env(values: Mapping[str, str], env: Mapping[str, str], *, where: str, strict: bool,
                errors: list[str]) -> dict[str, str]:
    """`${VAR}` in each value; CUDA_VISIBLE_DEVICES is refused (GPUs come from replicas[].gpus).

    strict=False keeps an unexpandable value as written and records the error instead.
    """
    if _GPUS_VAR in values:
        errors.append(f"{where} sets {_GPUS_VAR}; choose GPUs with replicas[].gpus")
    expanded = {}
    for key, value in values.items():
        try:
            expanded[key] = expand_vars(value, env, what=f"{where}.{key}")
        except ConfigError as err:
            if strict:
                raise
            errors.append(err.message)
            expanded[key] = value
    return expanded


def _visible_devices(gpus: list[int], visible: list[str] | None, parent_visible: str | None, *,
                     where: str, errors: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a replica: its indices, or the parent's devices at those positions."""
    if visible is None:
        return ",".join(str(g) for g in gpus)
    outside = [g for g in gpus if g >= len(visible)]
    if outside:
        errors.append(
            f"{where}.gpus {list(gpus)}: GPU position(s) {outside} out of range; this process has "
            f"CUDA_VISIBLE_DEVICES={parent_visible} ({len(visible)} GPU(s), positions "
            f"0-{len(visible) - 1})")
    return ",".join(visible[g] if g < len(visible) else str(g) for g in gpus)


def replica_commands(name: str, backend: BackendConfig, env: Mapping[str, str], *,
                     vllm: str = "vllm", strict: bool = True) -> tuple[list[ReplicaCommand], list[str]]:
    """The commands of one backend's launch section, and the errors found building them.

    strict=False keeps going after an unset `${VAR}` (dry runs print `${VAR}` literally).
    """
    launch = backend.launch
    if launch is None:
        return [], []
    where = f"backends.{name}.launch"
    errors = managed_flag_errors(launch.extra_args, where=where)
    model_path = launch.model_path
    try:
        model_path = expand_vars(launch.model_path, env, what=f"{where}.model_path")
    except ConfigError as err:
        if strict:
            raise
        errors.append(err.message)
    backend_env = _expand_env(launch.env, env, where=f"{where}.env", strict=strict, errors=errors)
    api_key = None
    if backend.api_key_env:
        api_key = env.get(backend.api_key_env)
        if not api_key:
            errors.append(f"backends.{name}.api_key_env names {backend.api_key_env}, which is not "
                          "set: the server would refuse the proxy (and the readiness probe)")
    limit_mm = launch.limit_mm_per_prompt or default_limit_mm(backend)
    cpu = launch.device == "cpu"
    parent_visible = None if cpu else (env.get(_GPUS_VAR) or "").strip() or None
    visible = [d.strip() for d in parent_visible.split(",")] if parent_visible else None
    commands = []
    for index, replica in enumerate(launch.replicas):
        replica_where = f"{where}.replicas[{index}]"
        argv = vllm_argv(
            model_path=model_path, served_model_name=backend.model,
            tensor_parallel_size=launch.tensor_parallel_size, max_model_len=launch.max_model_len,
            gpu_memory_utilization=launch.gpu_memory_utilization, limit_mm=limit_mm,
            host=launch.host, port=replica.port, seed=launch.seed, extra_args=launch.extra_args,
            vllm=vllm, embedding=backend.kind == "embedding", cpu=cpu)
        own_env = _expand_env(replica.env, env, where=f"{replica_where}.env", strict=strict,
                              errors=errors)
        merged = {k: v for k, v in {**backend_env, **own_env}.items() if k != _GPUS_VAR}
        if not cpu:
            merged = {_GPUS_VAR: _visible_devices(replica.gpus, visible, parent_visible,
                                                  where=replica_where, errors=errors), **merged}
        commands.append(ReplicaCommand(backend=name, index=index, model=backend.model,
                                       gpus=tuple(replica.gpus), host=launch.host,
                                       port=replica.port, argv=argv, env=merged,
                                       api_key_env=backend.api_key_env, api_key=api_key,
                                       parent_visible=parent_visible, cpu=cpu))
    return commands, errors


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size_bytes(text: str) -> int | None:
    """vLLM's human-readable sizes: 128M is 2**27 bytes, 128m 128e6; None when unreadable."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        return None
    number, suffix = match.groups()
    return int(float(number) * (_DECIMAL.get(suffix) or _BINARY.get(suffix) or 1))


def cpu_kv_cache_bytes(command: ReplicaCommand, parent_env: Mapping[str, str],
                       total_memory: int) -> tuple[int, str]:
    """The KV cache a CPU replica will allocate, and where that size comes from: CPU_KV_CACHE_ENV
    (the replica's own env, else the one it inherits) wins over the last --kv-cache-memory-bytes;
    with neither, vLLM takes --gpu-memory-utilization of the machine's memory."""
    space = command.env.get(CPU_KV_CACHE_ENV, parent_env.get(CPU_KV_CACHE_ENV, ""))
    if space.strip().isdigit():
        return int(space) * 2**30, f"{CPU_KV_CACHE_ENV}={space.strip()}"
    size = None
    for i, arg in enumerate(command.argv):  # the last one counts, in either spelling
        if arg == "--kv-cache-memory-bytes" and i + 1 < len(command.argv):
            size = command.argv[i + 1]
        elif arg.startswith("--kv-cache-memory-bytes="):
            size = arg.split("=", 1)[1]
    parsed = _size_bytes(size) if size is not None else None
    if parsed is not None:
        return parsed, f"--kv-cache-memory-bytes {size}"
    fraction = float(command.argv[command.argv.index("--gpu-memory-utilization") + 1])
    return int(fraction * total_memory), f"no KV cache size: vLLM takes --gpu-memory-utilization {fraction:g}"
