"""The one place the `vllm serve` flags are built, and the checks on a whole stack's plan.

Pure: a config (and an environment mapping for `${VAR}` expansion) in, argv lists, env additions
and error/warning strings out. `launchers/_serve_vllm.sh` builds the same flags in bash; the
tests run both and compare.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from proxy.config import BackendConfig, LaunchConfig, Settings
from proxy.errors import ConfigError

# Safety net for the 32-frame truncation trap: the server keeps every frame of a video even for
# a request that sends no media_io_kwargs (see docs vllm-facts "READ FIRST").
MEDIA_IO_KWARGS = json.dumps({"video": {"num_frames": -1}})
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

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
    "--api-key": "backends.<name>.api_key_env (passed to vLLM as VLLM_API_KEY)",
}

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


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
    """What one request of this layout carries (qwen: 1 video; primo: 2 images + 1 video)."""
    if backend.layout == "qwen_video":
        return {"video": 1}
    if backend.layout == "primo_interleave":
        return {"image": 2, "video": 1}
    return {"image": backend.frames.nframes}


def vllm_argv(*, model_path: str, served_model_name: str, tensor_parallel_size: int,
              max_model_len: int, gpu_memory_utilization: float, limit_mm: Mapping[str, int],
              host: str, port: int, seed: int, extra_args: list[str] | tuple[str, ...] = (),
              vllm: str = "vllm") -> list[str]:
    """`vllm serve MODEL ...`, flags in the order of docs/vllm-facts.md, then extra_args."""
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
    env: dict[str, str]  # additions to the parent's environment, CUDA_VISIBLE_DEVICES included
    # backends.<name>.api_key_env: its value goes to the server as VLLM_API_KEY (never printed,
    # never on the command line) and authorises the readiness probes of /v1/models.
    api_key_env: str | None = None
    api_key: str | None = None
    # The parent's own CUDA_VISIBLE_DEVICES (SLURM, containers), when set: `gpus` are positions
    # in it and the child's CUDA_VISIBLE_DEVICES names the devices at those positions.
    parent_visible: str | None = None

    @property
    def name(self) -> str:
        return f"{self.backend}-r{self.index}"

    @property
    def probe_host(self) -> str:
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host

    @property
    def base_url(self) -> str:
        return f"http://{_url_host(self.probe_host)}:{self.port}"

    def shell_line(self) -> str:
        line = shell_line(self.argv, self.env)
        return f'VLLM_API_KEY="${self.api_key_env}" {line}' if self.api_key_env else line

    def full_env(self) -> dict[str, str]:
        return {**self.env, **({"VLLM_API_KEY": self.api_key} if self.api_key else {})}


@dataclass
class Plan:
    commands: list[ReplicaCommand] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    not_launched: list[str] = field(default_factory=list)  # backends without a launch section


def shell_line(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable command line: `K=V ... argv`, quoted like shlex.quote."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join([*prefix, *(shlex.quote(a) for a in argv)])


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
    if "CUDA_VISIBLE_DEVICES" in launch.env:
        errors.append(f"{where}.env sets CUDA_VISIBLE_DEVICES; choose GPUs with replicas[].gpus")
    model_path, child_env = launch.model_path, dict(launch.env)
    try:
        model_path = expand_vars(launch.model_path, env, what=f"{where}.model_path")
        child_env = {k: expand_vars(v, env, what=f"{where}.env.{k}") for k, v in launch.env.items()}
    except ConfigError as err:
        if strict:
            raise
        errors.append(err.message)
    api_key = None
    if backend.api_key_env:
        api_key = env.get(backend.api_key_env)
        if not api_key:
            errors.append(f"backends.{name}.api_key_env names {backend.api_key_env}, which is not "
                          "set: the server would refuse the proxy (and the readiness probe)")
    limit_mm = launch.limit_mm_per_prompt or default_limit_mm(backend)
    parent_visible = (env.get("CUDA_VISIBLE_DEVICES") or "").strip() or None
    visible = [d.strip() for d in parent_visible.split(",")] if parent_visible else None
    commands = []
    for index, replica in enumerate(launch.replicas):
        argv = vllm_argv(
            model_path=model_path, served_model_name=backend.model,
            tensor_parallel_size=launch.tensor_parallel_size, max_model_len=launch.max_model_len,
            gpu_memory_utilization=launch.gpu_memory_utilization, limit_mm=limit_mm,
            host=launch.host, port=replica.port, seed=launch.seed, extra_args=launch.extra_args,
            vllm=vllm)
        devices = [str(g) for g in replica.gpus]
        if visible is not None:  # replicas[].gpus are positions in the parent's own list
            outside = [g for g in replica.gpus if g >= len(visible)]
            if outside:
                errors.append(
                    f"{where}.replicas[{index}].gpus {list(replica.gpus)}: GPU position(s) "
                    f"{outside} out of range; this process has CUDA_VISIBLE_DEVICES="
                    f"{parent_visible} ({len(visible)} GPU(s), positions 0-{len(visible) - 1})")
            devices = [visible[g] if g < len(visible) else str(g) for g in replica.gpus]
        replica_env = {"CUDA_VISIBLE_DEVICES": ",".join(devices), **child_env}
        commands.append(ReplicaCommand(backend=name, index=index, model=backend.model,
                                       gpus=tuple(replica.gpus), host=launch.host,
                                       port=replica.port, argv=argv, env=replica_env,
                                       api_key_env=backend.api_key_env, api_key=api_key,
                                       parent_visible=parent_visible))
    return commands, errors


def plan_stack(settings: Settings, env: Mapping[str, str], *, allow_gpu_overlap: bool = False,
               vllm: str = "vllm", strict: bool = True) -> Plan:
    """Every launched replica, plus the errors that must stop `up` and the warnings it prints."""
    plan = Plan()
    for name, backend in settings.backends.items():
        if backend.launch is None:
            plan.not_launched.append(name)
            continue
        commands, errors = replica_commands(name, backend, env, vllm=vllm, strict=strict)
        plan.commands += commands
        plan.errors += errors
        plan.errors += _endpoint_errors(name, backend, backend.launch)
        plan.warnings += _backend_warnings(name, backend, backend.launch)
    if not plan.commands:
        plan.errors.append("no backend has a launch section: nothing to start")
    plan.errors += _port_clashes(plan.commands, settings)
    overlaps = gpu_overlaps(plan.commands)
    if allow_gpu_overlap:
        plan.warnings += [f"{o} (allowed by --allow-gpu-overlap)" for o in overlaps]
    else:
        plan.errors += [f"{o} (pass --allow-gpu-overlap if that is intended)" for o in overlaps]
    return plan


def gpu_assignment(commands: list[ReplicaCommand]) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for command in commands:
        for gpu in command.gpus:
            owners.setdefault(gpu, []).append(command.name)
    return dict(sorted(owners.items()))


def gpu_overlaps(commands: list[ReplicaCommand]) -> list[str]:
    return [f"GPU {gpu} is shared by {' and '.join(names)}"
            for gpu, names in gpu_assignment(commands).items() if len(names) > 1]


def _port_clashes(commands: list[ReplicaCommand], settings: Settings) -> list[str]:
    users: dict[int, list[str]] = {}
    for command in commands:
        users.setdefault(command.port, []).append(command.name)
    users.setdefault(settings.proxy.port, []).append("the proxy (proxy.port)")
    return [f"port {port} is used by {' and '.join(names)}"
            for port, names in sorted(users.items()) if len(names) > 1]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _endpoint_errors(name: str, backend: BackendConfig, launch: LaunchConfig) -> list[str]:
    """Each launched replica must be one of the backend's endpoints, or the proxy never uses it."""
    endpoints = [urlsplit(url) for url in backend.endpoints]
    acceptable_hosts = {launch.host} | (set(LOOPBACK_HOSTS) if launch.host in WILDCARD_HOSTS
                                        or launch.host in LOOPBACK_HOSTS else set())
    errors = []
    for index, replica in enumerate(launch.replicas):
        if not any(e.scheme == "http" and e.port == replica.port and e.hostname in acceptable_hosts
                   and e.path.rstrip("/") == "/v1" for e in endpoints):
            host = "127.0.0.1" if launch.host in WILDCARD_HOSTS else launch.host
            errors.append(
                f"backends.{name}.launch.replicas[{index}] serves port {replica.port} but no "
                f"endpoint matches it: add http://{_url_host(host)}:{replica.port}/v1 to "
                f"backends.{name}.endpoints (now {backend.endpoints})")
    return errors


def _backend_warnings(name: str, backend: BackendConfig, launch: LaunchConfig) -> list[str]:
    warnings = []
    launched_ports = {r.port for r in launch.replicas}
    for url in backend.endpoints:
        if urlsplit(url).port not in launched_ports:
            warnings.append(f"backend {name}: endpoint {url} is not started by `up` "
                            "(it must be served by something else)")
    if backend.max_model_len is not None and backend.max_model_len != launch.max_model_len:
        warnings.append(f"backend {name}: max_model_len {backend.max_model_len} (the proxy's token "
                        f"budget) differs from launch.max_model_len {launch.max_model_len}")
    needed = default_limit_mm(backend)
    if launch.limit_mm_per_prompt is not None:
        short = {k: v for k, v in needed.items() if launch.limit_mm_per_prompt.get(k, 0) < v}
        if short:
            warnings.append(f"backend {name}: launch.limit_mm_per_prompt "
                            f"{launch.limit_mm_per_prompt} is below what layout {backend.layout} "
                            f"sends ({needed}); vLLM will refuse those requests with a 400")
    return warnings
