"""The `up --ray ADDRESS` run: replicas placed on the Ray cluster (ray_stack.py), then the proxy
on this machine with their endpoints, then a watch that keeps the proxy's endpoint set equal to
the replicas that serve (through its admin route), until a stop; then everything is released."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from launchers.commands import shell_line
from launchers.plan import Plan
from launchers.ray_stack import RayReplicas
from launchers.supervisor import Stack, StackFailure, StopRequested
from proxy.config import Settings

__all__ = ["ray_plan_errors", "run_up_ray"]

Say = Callable[[str], None]


def ray_plan_errors(plan: Plan, settings: Settings, env: Mapping[str, str], *, with_proxy: bool) -> list[str]:
    """Servers placed by Ray listen on their node's address, and the proxy learns about restarts
    through its admin route: both need keys."""
    errors = [f"backend {name}: servers placed by Ray listen beyond loopback: set backends.{name}.api_key_env"
              for name in dict.fromkeys(c.backend for c in plan.commands) if not settings.backends[name].api_key_env]
    if with_proxy and not (settings.proxy.api_key_env and env.get(settings.proxy.api_key_env)):
        errors.append("up --ray tells the proxy about replicas through its admin route, which needs a "
                      "bearer token: set proxy.api_key_env to a variable holding one")
    return errors


def _admin(proxy_url: str, key: str | None, say: Say) -> Callable[[str, list[str], list[str]], None]:
    def set_endpoints(backend: str, add: list[str], remove: list[str]) -> None:
        try:
            with httpx.Client(trust_env=False, timeout=10.0) as http:
                answer = http.post(f"{proxy_url}/admin/endpoints",
                                   json={"backend": backend, "add": add, "remove": remove},
                                   headers={"authorization": f"Bearer {key}"} if key else {})
            if answer.status_code != 200:
                say(f"warning: the proxy refused the endpoint change of {backend} (+{add} -{remove}): "
                    f"{answer.status_code} {answer.text[:300]}")
        except httpx.HTTPError as err:  # its probes still find a dead endpoint; a new one waits for the next change
            say(f"warning: could not tell the proxy about {backend} (+{add} -{remove}): {err}")

    return set_endpoints


def run_up_ray(plan: Plan, settings: Settings, config_path: Path, run_dir: Path, pid_file: Path,
               args: argparse.Namespace, *, say: Say, warn: Say, proxy_argv: list[str], proxy_url: str) -> int:
    stack = Stack(run_dir, say=say, pid_file=pid_file, config_path=config_path, poll_interval_s=args.poll_interval,
                  progress_interval_s=args.progress_interval, grace_s=args.grace, echo=args.logs)
    previous: dict[int, Any] = {}

    def catch_signals() -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old = signal.signal(signum, stack.on_signal)
                previous.setdefault(signum, old)

    catch_signals()
    say(f"run directory: {run_dir}; connecting to the Ray cluster at {args.ray}")
    code, replicas = 0, None
    try:
        replicas = RayReplicas(plan.commands, address=args.ray, run_id=run_dir.name, say=say,
                               max_restarts=args.max_restarts, poll_interval_s=args.poll_interval,
                               stop=stack.stop_requested.is_set, node_resource=args.ray_resource)
        catch_signals()  # ray.init sets its own SIGTERM handler (sys.exit), which would skip the clean stop
        replicas.place(args.timeout)
        replicas.start()
        replicas.wait_ready(args.timeout)
        placement_file = run_dir / "placement.json"
        placement_file.write_text(json.dumps(replicas.placement(), indent=1))
        set_endpoints = _admin(proxy_url, settings.proxy_api_key(), say)
        if not args.no_proxy:
            endpoints_file = run_dir / "endpoints.json"
            endpoints_file.write_text(json.dumps(replicas.endpoints(), indent=1))
            argv = [*proxy_argv, "--endpoints", str(endpoints_file)]
            say(f"starting the proxy (log {run_dir / 'proxy.log'}):\n  {shell_line(argv)}")
            stack.wait_ready([stack.start("proxy", argv, {}, proxy_url, None)], min(args.timeout, 120.0))
        say(f"stack is up: {', '.join(r.name for r in replicas.replicas)} placed by Ray"
            + ("" if args.no_proxy else f"; proxy at {proxy_url}")
            + f". Stop with Ctrl-C or `vlm-reward-proxy down --pid-file {pid_file}`")
        stack.write_pid_file("running")
        while True:
            stack.echo_logs()
            for child in stack.children:
                exited = child.popen.poll()
                if exited is not None:
                    raise StackFailure(f"the {child.exit_summary(exited, 'serving')}; {child.log_tail()}")
            replicas.check(set_endpoints if not args.no_proxy else lambda *_: None)
            placement_file.write_text(json.dumps(replicas.placement(), indent=1))
            stack._sleep()
    except StopRequested:
        say("stop requested")
    except StackFailure as failure:
        warn(f"error: {failure}")
        code = 1
    except Exception as err:  # noqa: BLE001 - Ray's own errors (no cluster at the address, ...)
        warn(f"error: {type(err).__name__}: {err}")
        code = 1
    finally:
        say("stopping: the proxy, then every replica (SIGTERM, SIGKILL after "
            f"{args.grace:g}s), its actor and its placement group")
        for line in stack.shutdown():
            say(f"  {line}")
        if replicas is not None:
            for line in replicas.shutdown(args.grace):
                say(f"  {line}")
        stack.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code
