"""A whole stack's plan and its checks: every replica command, GPU and port use, endpoints.

`plan_stack` is pure (config + environment in, commands, errors and warnings out); `ports_in_use`
is the one check that looks at the machine (a port an earlier server still holds).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from launchers.commands import ReplicaCommand, cpu_kv_cache_bytes, default_limit_mm, replica_commands, url_host
from proxy.config import BackendConfig, Settings, split_credentials
from proxy.config.launch import WILDCARD_HOSTS, LaunchConfig, connect_host, is_loopback

__all__ = ["Plan", "cpu_memory_warnings", "gpu_assignment", "gpu_overlaps", "machine_memory", "plan_stack",
           "ports_in_use"]


@dataclass
class Plan:
    commands: list[ReplicaCommand] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    not_launched: list[str] = field(default_factory=list)  # backends without a launch section


def plan_stack(settings: Settings, env: Mapping[str, str], *, allow_gpu_overlap: bool = False,
               vllm: str = "vllm", strict: bool = True, placed_by_ray: bool = False,
               total_memory: int | None = None) -> Plan:
    """Every launched replica, plus the errors that must stop `up` and the warnings it prints.

    placed_by_ray: Ray chooses each replica's node and GPUs (replicas[].gpus gives only how many)
    and its endpoint is known once placed, so GPU overlaps and endpoint matches are not checked.
    total_memory: this machine's memory in bytes, for the CPU replicas' KV caches (None: read it)."""
    plan = Plan()
    for name, backend in settings.backends.items():
        if backend.launch is None:
            plan.not_launched.append(name)
            continue
        commands, errors = replica_commands(name, backend, env, vllm=vllm, strict=strict)
        plan.commands += commands
        plan.errors += errors
        if not placed_by_ray:
            plan.errors += _endpoint_errors(name, backend, backend.launch)
        plan.warnings += _backend_warnings(name, backend, backend.launch, placed_by_ray)
    if not plan.commands:
        plan.errors.append("no backend has a launch section: nothing to start")
    if not placed_by_ray:
        plan.warnings += _shared_server_warnings(settings, plan)
        if any(c.cpu for c in plan.commands):
            plan.warnings += cpu_memory_warnings(plan.commands, env, total_memory or machine_memory())
    plan.errors += _port_clashes(plan.commands, settings)
    overlaps = [] if placed_by_ray else gpu_overlaps(plan.commands)
    if allow_gpu_overlap:
        plan.warnings += [f"{o} (allowed by --allow-gpu-overlap)" for o in overlaps]
    else:
        plan.errors += [f"{o} (pass --allow-gpu-overlap if that is intended)" for o in overlaps]
    return plan


def machine_memory() -> int:
    """This machine's memory in bytes (Linux)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_memory_warnings(commands: list[ReplicaCommand], env: Mapping[str, str], total_memory: int) -> list[str]:
    """One line when the CPU replicas' KV caches would take half the machine's memory or more: each
    server also holds its model and ~1-2 GB of runtime, so such a stack swaps, or the kernel (or
    Ray) kills something else."""
    sizes = [(c.name, *cpu_kv_cache_bytes(c, env, total_memory)) for c in commands if c.cpu]
    total_kv = sum(size for _name, size, _why in sizes)
    if total_kv * 2 < total_memory:
        return []
    each = "; ".join(f"{name} {size / 2**30:.1f} GiB ({why})" for name, size, why in sizes)
    return [f"the CPU replicas' KV caches take {total_kv / 2**30:.1f} GiB of this machine's "
            f"{total_memory / 2**30:.1f} GiB: {each}. Lower --kv-cache-memory-bytes in launch.extra_args "
            f"(the CPU default is 128M), or unset VLLM_CPU_KVCACHE_SPACE, which overrides it"]


def gpu_assignment(commands: list[ReplicaCommand]) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for command in commands:
        for gpu in command.gpus:
            owners.setdefault(gpu, []).append(command.name)
    return dict(sorted(owners.items()))


def gpu_overlaps(commands: list[ReplicaCommand]) -> list[str]:
    return [f"GPU {gpu} is shared by {' and '.join(names)}"
            for gpu, names in gpu_assignment(commands).items() if len(names) > 1]


def ports_in_use(endpoints: list[tuple[str, int, str]]) -> list[str]:
    """Errors for (host, port, who) that cannot be bound now: an old server still listening."""
    errors = []
    for host, port, who in endpoints:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as err:
                errors.append(f"port {port} on {host} ({who}) is not free: {err.strerror} "
                              "(a server from an earlier run? `vlm-reward-proxy down` stops one)")
    return errors


def _port_clashes(commands: list[ReplicaCommand], settings: Settings) -> list[str]:
    users: dict[int, list[str]] = {}
    for command in commands:
        users.setdefault(command.port, []).append(command.name)
    users.setdefault(settings.proxy.port, []).append("the proxy (proxy.port)")
    return [f"port {port} is used by {' and '.join(names)}"
            for port, names in sorted(users.items()) if len(names) > 1]


def _reachable_as(bind_host: str, endpoint_host: str | None) -> bool:
    """A server bound to `bind_host` answers an endpoint naming `endpoint_host` (same machine)."""
    if endpoint_host is None:
        return False
    if endpoint_host == bind_host or bind_host in WILDCARD_HOSTS:
        return endpoint_host == bind_host or is_loopback(endpoint_host)
    # A loopback bind answers its own address and the name localhost (not another 127.x).
    return is_loopback(bind_host) and (endpoint_host == "localhost"
                                       or (bind_host == "localhost" and is_loopback(endpoint_host)))


def _endpoint_errors(name: str, backend: BackendConfig, launch: LaunchConfig) -> list[str]:
    """Each launched replica must be one of the backend's endpoints, or the proxy never uses it."""
    endpoints = [urlsplit(url) for url in backend.endpoints]
    errors = []
    for index, replica in enumerate(launch.replicas):
        if not any(e.scheme == "http" and e.port == replica.port
                   and _reachable_as(launch.host, e.hostname)
                   and e.path.rstrip("/") == "/v1" for e in endpoints):
            errors.append(
                f"backends.{name}.launch.replicas[{index}] serves port {replica.port} but no "
                f"endpoint matches it: add http://{url_host(connect_host(launch.host))}:"
                f"{replica.port}/v1 to backends.{name}.endpoints (now "
                f"{[split_credentials(e)[0] for e in backend.endpoints]})")
    return errors


def _backend_warnings(name: str, backend: BackendConfig, launch: LaunchConfig, placed_by_ray: bool) -> list[str]:
    warnings = []
    launched_ports = {r.port for r in launch.replicas}
    for url in [] if placed_by_ray else backend.endpoints:  # under Ray, the placed replicas replace them
        if urlsplit(url).port not in launched_ports:
            warnings.append(f"backend {name}: endpoint {split_credentials(url)[0]} is not started by `up` "
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


def _shared_server_warnings(settings: Settings, plan: Plan) -> list[str]:
    """A backend without a launch section on another backend's replicas sends what its OWN layout
    sends (GVL's shuffled_images: an image per frame): the servers must take it, or vLLM refuses
    each request with a 400."""
    warnings = []
    by_port = {command.port: command for command in plan.commands}
    for name in plan.not_launched:
        backend = settings.backends[name]
        needed = default_limit_mm(backend)
        for url in backend.endpoints:
            command = by_port.get(urlsplit(url).port)
            if command is None or not _reachable_as(command.host, urlsplit(url).hostname):
                continue
            owner = settings.backends[command.backend]
            served = (owner.launch.limit_mm_per_prompt if owner.launch and owner.launch.limit_mm_per_prompt
                      else default_limit_mm(owner))
            short = {k: v for k, v in needed.items() if served.get(k, 0) < v}
            if short:
                warnings.append(
                    f"backend {name} (layout {backend.layout}) sends {needed} per request to "
                    f"{split_credentials(url)[0]}, served by "
                    f"{command.backend}'s replica with --limit-mm-per-prompt {served}: vLLM will refuse those "
                    f"requests with a 400; set backends.{command.backend}.launch.limit_mm_per_prompt to "
                    f"{ {**served, **short} }")
                break
    return warnings
