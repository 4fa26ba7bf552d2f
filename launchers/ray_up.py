"""The `up --ray ADDRESS` run: replicas placed on the Ray cluster (ray_stack.py), then the proxy
on this machine with their endpoints, then a watch that keeps the proxy's endpoint set equal to
the replicas that serve (through its admin route), until a stop; then everything is released."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from launchers.commands import shell_line
from launchers.lifecycle import StopSignals, run_until_stopped
from launchers.pidfile import how_to_stop, write_json_atomically
from launchers.plan import Plan
from launchers.ray_stack import RayReplicas
from launchers.supervisor import Stack, StackFailure, StopRequested
from proxy.config import Settings

__all__ = ["ray_plan_errors", "run_up_ray"]

Say = Callable[[str], None]


def ray_plan_errors(plan: Plan, settings: Settings, env: Mapping[str, str], *, with_proxy: bool) -> list[str]:
    """Servers placed by Ray listen on their node's address, and the proxy learns about restarts
    through its admin route: both need keys (the admin route only takes the admin key)."""
    errors = [f"backend {name}: servers placed by Ray listen beyond loopback: set backends.{name}.api_key_env"
              for name in dict.fromkeys(c.backend for c in plan.commands) if not settings.backends[name].api_key_env]
    errors += [f"backend {name}: launch.device cpu is for one machine; up --ray places GPU replicas only"
               for name in dict.fromkeys(c.backend for c in plan.commands if c.cpu)]
    admin_env = settings.proxy.admin_api_key_env
    if with_proxy and not (admin_env and env.get(admin_env)):
        errors.append("up --ray tells the proxy about replicas through its admin route, which needs the "
                      "admin key: set proxy.admin_api_key_env to a variable holding one (not the scoring key)")
    elif with_proxy and settings.proxy.api_key_env and env.get(admin_env) == env.get(settings.proxy.api_key_env):
        errors.append(f"proxy.admin_api_key_env ({admin_env}) holds the same key as proxy.api_key_env: every "
                      "scoring client would be an admin; give the admin its own key")
    return errors


class ProxyEndpoints:
    """Keeps the proxy's endpoint set of each Ray-placed backend equal to its serving replicas.
    Reconciled every round against what the proxy reports (GET, then one POST per backend that
    differs), so a change the proxy missed (unreachable, restarting) is made on a later round."""

    def __init__(self, proxy_url: str, key: str | None, say: Say) -> None:
        self.say, self._warned = say, False
        self.http = httpx.Client(base_url=proxy_url, trust_env=False, timeout=10.0,
                                 headers={"authorization": f"Bearer {key}"} if key else {})

    def reconcile(self, wanted: dict[str, list[str]], backends: list[str]) -> None:
        try:
            listed = self.http.get("/admin/endpoints").raise_for_status().json()["backends"]
            for backend in backends:
                now = {e["url"] for e in listed.get(backend, []) if not e["draining"]}
                add, remove = sorted(set(wanted.get(backend, [])) - now), sorted(now - set(wanted.get(backend, [])))
                if add or remove:
                    self.http.post("/admin/endpoints", json={"backend": backend, "add": add, "remove": remove}
                                   ).raise_for_status()
            self._warned = False
        except (httpx.HTTPError, KeyError, ValueError) as err:  # tried again next round
            if not self._warned:
                self.say(f"warning: could not update the proxy's endpoints (tried again each round): {err}")
            self._warned = True

    def close(self) -> None:
        self.http.close()


def run_up_ray(plan: Plan, settings: Settings, config_path: Path, run_dir: Path, pid_file: Path,
               args: argparse.Namespace, *, say: Say, warn: Say, proxy_argv: list[str], proxy_url: str) -> int:
    stack = Stack(run_dir, say=say, pid_file=pid_file, config_path=config_path, poll_interval_s=args.poll_interval,
                  progress_interval_s=args.progress_interval, grace_s=args.grace, echo=args.logs)
    signals = StopSignals(stack)
    signals.catch()
    say(f"run directory: {run_dir}; connecting to the Ray cluster at {args.ray}")
    placed: list[RayReplicas] = []
    proxy: list[ProxyEndpoints] = []

    def run() -> None:
        try:
            serve()
        except (StackFailure, StopRequested):
            raise
        except Exception as err:  # Ray's own: no cluster at the address, a version mismatch, a lost node
            raise StackFailure(f"{type(err).__name__} from the Ray cluster at {args.ray}: {err}") from err

    def serve() -> None:
        replicas = RayReplicas(plan.commands, address=args.ray, run_id=run_dir.name, say=say,
                               max_restarts=args.max_restarts, poll_interval_s=args.poll_interval,
                               stop=stack.stop_requested.is_set, pause=stack.pause, probe_all=stack.probe_all,
                               node_resource=args.ray_resource)
        placed.append(replicas)
        signals.catch()  # ray.init sets its own SIGTERM handler (sys.exit), which would skip the clean stop
        replicas.place(args.timeout)
        replicas.start(args.timeout)
        replicas.wait_ready(args.timeout)
        placement_file = run_dir / "placement.json"
        write_json_atomically(placement_file, replicas.placement())
        if not args.no_proxy:
            endpoints_file = run_dir / "endpoints.json"
            write_json_atomically(endpoints_file, replicas.endpoints())
            argv = [*proxy_argv, "--endpoints", str(endpoints_file)]
            say(f"starting the proxy (log {run_dir / 'proxy.log'}):\n  {shell_line(argv)}")
            stack.wait_ready([stack.start("proxy", argv, {}, proxy_url, None)], min(args.timeout, 120.0))
            proxy.append(ProxyEndpoints(proxy_url, settings.proxy_admin_key(), say))  # the admin route's key
        say(f"stack is up: {', '.join(r.name for r in replicas.replicas)} placed by Ray"
            + ("" if args.no_proxy else f"; proxy at {proxy_url}")
            + f". {how_to_stop(pid_file, detached=args.detached)}")
        stack.write_pid_file("running")
        launched = list(dict.fromkeys(c.backend for c in plan.commands))
        while True:
            stack.echo_logs()
            stack.check_proxy()
            replicas.check(restart_timeout_s=args.timeout)
            for p in proxy:
                p.reconcile(replicas.endpoints(), launched)
            write_json_atomically(placement_file, replicas.placement())
            stack.pause()

    try:
        return run_until_stopped(run, say=say, warn=warn)
    finally:
        say("stopping: the proxy, then every replica (SIGTERM, SIGKILL after "
            f"{args.grace:g}s), its actor and its placement group")
        for line in stack.shutdown():
            say(f"  {line}")
        for replicas in placed:
            for line in replicas.shutdown(args.grace, force=stack.force.is_set):
                say(f"  {line}")
        for p in proxy:
            p.close()
        stack.close()
        signals.restore()
