"""`up --ray`: each replica's GPUs reserved by a placement group on an existing Ray cluster, its
stock `vllm serve` run by a named actor there (launchers/ray_replica.py), its endpoint known once
placed, a replica that dies restarted a bounded number of times or removed, and everything
released at the end.

`up` is the Ray driver. Its actors and placement groups are not detached, so if `up` itself dies
Ray reclaims them with its job (and each server dies with its actor), and nothing is left on the
cluster either way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from launchers import ray_replica
from launchers.commands import ReplicaCommand, url_host
from launchers.supervisor import StackFailure, StopRequested
from proxy.config.launch import WILDCARD_HOSTS
from proxy.upstream.health import Readiness

__all__ = ["NAMESPACE", "RayReplica", "RayReplicas"]

NAMESPACE = "vlm-reward-proxy"
Say = Callable[[str], None]
_CALL_TIMEOUT_S = 30.0  # one actor method call
_MISSED_POLLS = 3  # unanswered polls in a row before an actor counts as gone


@dataclass
class RayReplica:
    command: ReplicaCommand
    placement_group: Any = None
    actor: Any = None
    node: dict = field(default_factory=dict)
    pid: int | None = None
    started: float = 0.0
    restarts: int = 0
    missed_polls: int = 0
    state: str = "placing"  # placing, loading, serving, restarting, removed, stopped
    first_answer: Any = None  # a new actor's pending `node()` call, until it answered
    reason: str = ""

    @property
    def name(self) -> str:
        return self.command.name

    @property
    def host(self) -> str:
        """Where the server listens: the node's address unless launch.host is a wildcard."""
        return self.command.host if self.command.host in WILDCARD_HOSTS else self.node["node_ip"]

    @property
    def url(self) -> str:
        return f"http://{url_host(self.node['node_ip'])}:{self.command.port}/v1"

    def argv(self) -> list[str]:
        argv = list(self.command.argv)
        argv[argv.index("--host") + 1] = self.host
        return argv


class RayReplicas:
    def __init__(self, commands: list[ReplicaCommand], *, address: str, run_id: str, say: Say,
                 max_restarts: int, poll_interval_s: float, stop: Callable[[], bool],
                 pause: Callable[[], None], probe_all: Callable[[list[tuple]], list[Readiness]],
                 node_resource: str | None = None) -> None:
        import ray

        self.ray, self.say, self.max_restarts = ray, say, max_restarts
        # A custom resource only the reward nodes declare (`ray start --resources`): RLinf pins its
        # workers to GPUs itself without reserving Ray's GPU resource, so only separate nodes
        # keep the two apart (docs/ray.md).
        self.pinned = {node_resource: 1} if node_resource else {}
        self.poll_interval_s, self._stop, self._pause, self._probe_all = poll_interval_s, stop, pause, probe_all
        self.run_id = run_id
        self.replicas = [RayReplica(c) for c in commands]
        ray.cloudpickle.register_pickle_by_value(ray_replica)  # the nodes need ray, not this project
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
        self._actor_class = ray.remote(ray_replica.ReplicaProcess)

    # -- placing and starting -------------------------------------------------------------
    def place(self, timeout_s: float) -> None:
        """A placement group per replica (one bundle: its GPUs and a CPU, so on one node), the
        largest first and each placed before the next is asked for: created all at once, Ray
        spread two 1-GPU replicas over two 2-GPU nodes and left no node for a TP=2 one."""
        from ray.util.placement_group import placement_group

        deadline = time.monotonic() + timeout_s
        waiting = sorted(self.replicas, key=lambda r: -len(r.command.gpus))
        while waiting:
            r = waiting[0]
            r.placement_group = placement_group([{"GPU": len(r.command.gpus), "CPU": 1, **self.pinned}],
                                                strategy="STRICT_PACK", name=f"{NAMESPACE}/{self.run_id}/{r.name}")
            while not self.ray.wait([r.placement_group.ready()], timeout=self.poll_interval_s)[0]:
                if self._stop():
                    raise StopRequested
                if time.monotonic() > deadline:
                    names = ", ".join(f"{w.name} ({len(w.command.gpus)} GPU(s) on one node"
                                      + (f" with resource {next(iter(self.pinned))}" if self.pinned else "") + ")"
                                      for w in waiting)
                    free = {k: v for k, v in self.ray.available_resources().items()
                            if "_group_" not in k and not k.startswith("node:")}
                    raise StackFailure(f"Ray could not place {names} within {timeout_s:.0f}s; free on the "
                                       f"cluster: {free}")
            waiting.pop(0)

    def start(self, timeout_s: float) -> None:
        """Every replica's actor asked for at once (each is a worker process Ray starts on its node:
        on a busy node that takes longer than one call's _CALL_TIMEOUT_S, as CI saw), their first
        answers awaited against one deadline, watched like placing; then each server started."""
        for r in self.replicas:
            self._new_actor(r)
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            while not self.ray.wait([r.first_answer], timeout=self.poll_interval_s)[0]:
                if self._stop():
                    raise StopRequested
                if time.monotonic() > deadline:
                    raise StackFailure(f"the Ray actor for {r.name} did not start on its node within {timeout_s:.0f}s")
            self._launch(r)

    def _new_actor(self, r: RayReplica) -> None:
        """The replica's actor, in its placement group; `r.first_answer` is its node's description."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r.actor = self._actor_class.options(
            name=f"{self.run_id}/{r.name}", namespace=NAMESPACE, num_cpus=1, num_gpus=len(r.command.gpus),
            resources=self.pinned, max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                r.placement_group, placement_group_bundle_index=0)).remote(r.name, self.run_id)
        r.first_answer = r.actor.node.remote()

    def _launch(self, r: RayReplica) -> None:
        """The server, on its actor (which answered): `loading` at start-up; a restart stays `restarting`."""
        if r.first_answer is not None:
            r.node, r.first_answer = self.ray.get(r.first_answer), None
        env = {k: v for k, v in r.command.full_env().items() if k != "CUDA_VISIBLE_DEVICES"}
        try:
            r.pid = self._call(r.actor.start, r.argv(), env)
        except self.ray.exceptions.RayTaskError as err:  # e.g. no `vllm` executable on that node
            raise StackFailure(f"{r.name} could not start on node {r.node['node_ip']}: {err.cause}") from err
        if r.state == "placing":
            r.started, r.state = time.monotonic(), "loading"
        self.say(f"started {r.name} on node {r.node['node_id'][:12]} ({r.node['node_ip']}), "
                 f"GPU{'s' if len(r.node['gpus']) > 1 else ''} {','.join(r.node['gpus'])}, "
                 f"pid {r.pid}, {r.url}; log on that node: {r.node['log']}")

    def _call(self, method: Any, *args: Any) -> Any:
        return self.ray.get(method.remote(*args), timeout=_CALL_TIMEOUT_S)

    # -- readiness ------------------------------------------------------------------------
    def probe(self, replicas: list[RayReplica]) -> list[bool]:
        results = self._probe_all([(r.url, r.command.model, r.command.api_key) for r in replicas])
        for r, readiness in zip(replicas, results, strict=True):
            r.reason = readiness.reason or ""
        return [readiness.ready for readiness in results]

    def exit_code(self, r: RayReplica) -> int | str | None:
        """None while its server runs; the exit code, or why the actor is gone. An actor that
        does not answer within _CALL_TIMEOUT_S counts as gone only the _MISSED_POLLS-th time in
        a row: a slow control plane must not cost a healthy replica a reload."""
        try:
            code = self._call(r.actor.poll)
        except self.ray.exceptions.GetTimeoutError as err:
            r.missed_polls += 1
            if r.missed_polls < _MISSED_POLLS:
                return None
            return self._actor_gone(r, err)
        except self.ray.exceptions.RayActorError as err:
            return self._actor_gone(r, err)
        r.missed_polls = 0
        return code

    def _actor_gone(self, r: RayReplica, err: Exception) -> str:
        # A new actor restarts it; the old one is killed first, so it cannot hold the GPUs.
        with contextlib.suppress(Exception):
            self.ray.kill(r.actor)
        r.actor = None
        return f"its actor is gone ({type(err).__name__})"

    def log_tail(self, r: RayReplica, lines: int = 20) -> str:
        if r.actor is None:
            return "(its actor is gone, and the log with it)"
        try:
            return self._call(r.actor.log_tail, lines)
        except self.ray.exceptions.RayError as err:
            return f"(log unreadable: {type(err).__name__})"

    def wait_ready(self, timeout_s: float) -> None:
        """Until every replica answers; one that exits while loading, or the timeout, fails `up`."""
        begin = time.monotonic()
        loading = [r for r in self.replicas if r.state == "loading"]
        while loading:
            for r in loading:
                code = self.exit_code(r)
                if code is not None:
                    raise StackFailure(f"{r.name} exited ({code}) while loading; last lines of its log:\n"
                                       f"{self.log_tail(r)}")
            for r, ready in zip(loading, self.probe(loading), strict=True):
                if ready:
                    r.state = "serving"
                    self.say(f"ready: {r.name} at {r.url} after {time.monotonic() - r.started:.1f}s")
            loading = [r for r in loading if r.state == "loading"]
            if loading and time.monotonic() - begin > timeout_s:
                raise StackFailure(f"timed out after {timeout_s:.0f}s waiting for "
                                   + "; ".join(f"{r.name} ({r.reason})" for r in loading))
            if loading:
                self._pause()

    def endpoints(self) -> dict[str, list[str]]:
        """Backend -> the URLs of its replicas that are serving."""
        out: dict[str, list[str]] = {}
        for r in self.replicas:
            if r.state == "serving":
                out.setdefault(r.command.backend, []).append(r.url)
        return out

    def placement(self) -> list[dict]:
        return [{"name": r.name, "backend": r.command.backend, "url": r.url, "state": r.state,
                 "restarts": r.restarts, "pid": r.pid, **r.node} for r in self.replicas if r.node]

    # -- watching -------------------------------------------------------------------------
    def check(self, restart_timeout_s: float) -> None:
        """One round of state changes: a dead server is restarted (while its budget lasts) or
        removed; a restarted one serves again once ready, or is removed after `restart_timeout_s`.
        What the proxy is told follows from `endpoints()` (ray_up reconciles it every round)."""
        for r in self.replicas:  # a restart's new actor, started without blocking the watch
            if r.state != "restarting" or r.first_answer is None:
                continue
            if self.ray.wait([r.first_answer], timeout=0)[0]:
                try:
                    self._launch(r)
                except Exception as err:  # noqa: BLE001 - one replica's failure never stops the others
                    self._remove(r, f"it could not be restarted: {type(err).__name__}: {err}")
            elif time.monotonic() - r.started > restart_timeout_s:
                self._remove(r, f"its new Ray actor did not start within {restart_timeout_s:.0f}s")
        restarting = [r for r in self.replicas if r.state == "restarting" and r.first_answer is None]
        for r, ready in zip(restarting, self.probe(restarting) if restarting else [], strict=True):
            if ready:
                r.state = "serving"
                self.say(f"ready again: {r.name} at {r.url} (restart {r.restarts} of {self.max_restarts})")
            elif time.monotonic() - r.started > restart_timeout_s:
                self._remove(r, f"not ready {restart_timeout_s:.0f}s after its restart ({r.reason})")
        for r in self.replicas:
            if r.state not in ("serving", "restarting") or r.first_answer is not None:
                continue
            code = self.exit_code(r)
            if code is None:
                continue
            self.say(f"error: {r.name} at {r.url} exited ({code}); the proxy no longer sends it "
                     f"requests; last lines of its log:\n{self.log_tail(r)}")
            if r.restarts >= self.max_restarts:
                self._remove(r, f"after {r.restarts} restart(s) (--max-restarts {self.max_restarts})")
                continue
            # Out of endpoints() from now on; one budget (restart_timeout_s) from here to serving again.
            r.restarts, r.state, r.started = r.restarts + 1, "restarting", time.monotonic()
            try:
                if r.actor is None:
                    self._new_actor(r)  # its first answer is awaited by the rounds to come
                else:
                    self._launch(r)
            except Exception as err:  # noqa: BLE001 - one replica's failure never stops the others
                self._remove(r, f"it could not be restarted: {type(err).__name__}: {err}")

    def _remove(self, r: RayReplica, why: str) -> None:
        """Out for good: its actor killed (the server dies with it), its placement group kept
        until the stop, so the report still names it."""
        r.state, r.first_answer = "removed", None
        if r.actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(r.actor)
            r.actor = None
        self.say(f"removed: {r.name} {why}")

    # -- stopping -------------------------------------------------------------------------
    def shutdown(self, grace_s: float, force: Callable[[], bool]) -> list[str]:
        """Stop every server (SIGTERM, SIGKILL after grace; at once on a second signal), kill the
        actors, free the GPUs. One deadline for all; one replica's error never skips the others."""
        from ray.util.placement_group import remove_placement_group

        stops = {r.name: r.actor.stop.remote(0.0 if force() else grace_s) for r in self.replicas if r.actor is not None}
        deadline = time.monotonic() + grace_s + 30
        pending = list(stops.values())
        while pending and time.monotonic() < deadline and not force():
            pending = self.ray.wait(pending, num_returns=len(pending), timeout=0.2)[1]
        lines = []
        for r in self.replicas:
            code: object = "never started"
            try:
                if r.name in stops:
                    ready = not self.ray.wait([stops[r.name]], timeout=0)[1]
                    code = self.ray.get(stops[r.name]) if ready else "unknown (its actor did not answer)"
                if r.actor is not None:
                    self.ray.kill(r.actor)  # the server dies with it (PR_SET_PDEATHSIG) if still up
                if r.placement_group is not None:
                    remove_placement_group(r.placement_group)
                lines.append(f"{r.name}: {r.state}, exit {code}, {r.restarts} restart(s); GPUs released")
            except Exception as err:  # noqa: BLE001 - report it, and go on with the others
                lines.append(f"{r.name}: {r.state}; error while stopping: {type(err).__name__}: {err}")
            r.state = "stopped"
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        return lines
