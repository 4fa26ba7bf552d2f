"""`vlm-reward-proxy up` and `down`: the stack of `vllm serve` processes plus the proxy.

`add_subcommands(subparsers)` registers both (vlm_reward_cli assembles the command line);
`run_up_command` checks the plan, then hands the processes to supervisor.Stack.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from launchers.commands import shell_line, url_host
from launchers.detach import run_detached
from launchers.lifecycle import StopSignals, run_until_stopped
from launchers.pidfile import how_to_stop, read_pid_file, stop_from_pid_file, up_is_running
from launchers.plan import Plan, gpu_assignment, plan_stack, ports_in_use
from launchers.ray_up import ray_plan_errors, run_up_ray
from launchers.supervisor import Stack
from proxy.config import Settings, load_settings
from proxy.config.launch import connect_host
from proxy.errors import ConfigError

__all__ = ["add_subcommands", "run_down_command", "run_up_command"]

DEFAULT_TIMEOUT_S = 1800.0  # a cold 7B load (weights from disk, compile, CUDA graphs) fits easily
DEFAULT_GRACE_S = 20.0
PID_FILE_NAME = "stack.json"


def say(line: str) -> None:
    print(line, flush=True)


def warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up", help="start every `vllm serve` of a config, wait until ready, then the proxy",
        description="Start one `vllm serve` per replica of each backend's `launch` section (GPUs "
                    "via CUDA_VISIBLE_DEVICES, each in its own process group, output in "
                    "RUNS_DIR/<timestamp>/<backend>-r<i>.log), wait until each answers /health "
                    "and lists its model in /v1/models, then run the proxy. Ctrl-C or SIGTERM "
                    "stops everything (SIGTERM, then SIGKILL after --grace) and reports exit "
                    "codes. A server that dies while loading stops the whole stack.")
    up.add_argument("--config", required=True, metavar="FILE", help="proxy YAML with launch sections")
    up.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="start only this backend of the config, and a proxy serving it alone (name or alias; "
                         "repeatable), e.g. --only qwen2_5_vl_vllm for run B")
    up.add_argument("--dry-run", action="store_true",
                    help="print the commands, GPU assignment and checks; start nothing")
    up.add_argument("--allow-gpu-overlap", action="store_true",
                    help="allow two replicas on one GPU (an error otherwise)")
    up.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help=f"seconds to wait for all servers to be ready (default {DEFAULT_TIMEOUT_S:g})")
    up.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                    help=f"seconds between SIGTERM and SIGKILL at shutdown (default {DEFAULT_GRACE_S:g})")
    up.add_argument("--poll-interval", type=float, default=1.0, metavar="SECONDS",
                    help="seconds between readiness probes and liveness checks (default 1)")
    up.add_argument("--progress-interval", type=float, default=15.0, metavar="SECONDS",
                    help="seconds between 'still loading' lines (default 15)")
    up.add_argument("--runs-dir", default="runs", metavar="DIR",
                    help="where run directories and the pid file go (default ./runs)")
    up.add_argument("--run-dir", default=None, metavar="DIR",
                    help="log directory of this run (default RUNS_DIR/<timestamp>)")
    up.add_argument("--pid-file", default=None, metavar="FILE",
                    help=f"JSON pid file for `down` (default RUNS_DIR/{PID_FILE_NAME})")
    up.add_argument("--vllm", default=None, metavar="EXE",
                    help="the vllm executable (default $VLLM_BIN, else `vllm` on PATH)")
    up.add_argument("--no-proxy", action="store_true", help="start the vLLM servers only")
    up.add_argument("--logs", choices=["none", "proxy", "all"], default="proxy", metavar="WHICH",
                    help="child logs echoed to the console with a [name] prefix: none, proxy or all (default proxy); "
                         "every log is always written to the run directory")
    up.add_argument("--ray", default=None, metavar="ADDRESS",
                    help="place the replicas on this Ray cluster (e.g. auto, or HEAD_IP:6379): a placement "
                         "group per replica, its `vllm serve` in a named actor on the node Ray chose, with "
                         "the GPUs Ray assigned; needs the [ray] extra and api keys (docs/ray.md)")
    up.add_argument("--ray-resource", default=None, metavar="NAME",
                    help="with --ray: place replicas only on nodes declaring this custom resource (one "
                         "unit per replica), e.g. nodes kept apart from RLinf's (docs/ray.md)")
    up.add_argument("--max-restarts", type=_count, default=2, metavar="N",
                    help="with --ray: restart a replica that dies at most N times, then remove it (default 2)")
    up.add_argument("--detach", action="store_true",
                    help="run the stack in the background; return once it is ready (0) or "
                         "failed (non-zero); stop it with `down`")
    # Set by --detach on the `up` it starts in the background, whose output the user reads.
    up.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(func=run_up_command)

    down = subparsers.add_parser(
        "down", help="stop a stack started by `up` (e.g. with --detach)",
        description="Stop the stack recorded in a pid file: SIGTERM to `up` (which stops its "
                    "children), then SIGTERM/SIGKILL to any process group still alive.")
    down.add_argument("--runs-dir", default="runs", metavar="DIR", help="default ./runs")
    down.add_argument("--pid-file", default=None, metavar="FILE",
                      help=f"the pid file `up` wrote (default RUNS_DIR/{PID_FILE_NAME})")
    down.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                      help=f"seconds between SIGTERM and SIGKILL (default {DEFAULT_GRACE_S:g})")
    down.set_defaults(func=run_down_command)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _pid_file(args: argparse.Namespace) -> Path:
    return Path(args.pid_file or Path(args.runs_dir) / PID_FILE_NAME).absolute()


def proxy_argv(config_path: Path, only: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "vlm_reward_cli", "serve", "--config", str(config_path),
            *(arg for name in only or [] for arg in ("--only", name))]


def _proxy_url(settings: Settings) -> str:
    return f"http://{url_host(connect_host(settings.proxy.host))}:{settings.proxy.port}"


def _new_run_dir(runs_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, n = runs_dir / stamp, 1
    while run_dir.exists():
        n += 1
        run_dir = runs_dir / f"{stamp}-{n}"
    return run_dir


def run_up_command(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    config_path = Path(args.config).absolute()
    vllm = args.vllm or os.environ.get("VLLM_BIN") or "vllm"
    try:
        settings = load_settings(config_path, only=args.only)
        plan = plan_stack(settings, os.environ, allow_gpu_overlap=args.allow_gpu_overlap,
                          vllm=vllm, strict=False, placed_by_ray=bool(args.ray))
    except ConfigError as err:
        warn(f"error: {err.message}")
        return 2
    endpoints = [] if args.ray else [(c.host, c.port, c.name) for c in plan.commands]  # Ray's are on its nodes
    if args.ray:
        plan.errors += ray_plan_errors(plan, settings, os.environ, with_proxy=not args.no_proxy)
    if not args.no_proxy:
        endpoints.append((settings.proxy.host, settings.proxy.port, "proxy"))
    if args.dry_run:
        print_plan(plan, settings, config_path, Path(args.runs_dir), not args.no_proxy, ray=args.ray, only=args.only)
        for error in ports_in_use(endpoints):
            say(f"note: {error}")
        return 2 if plan.errors else 0
    errors = list(plan.errors)
    if not errors:
        errors += ports_in_use(endpoints)
        if shutil.which(vllm) is None and not args.ray:  # under Ray, it must be on the nodes' PATH
            errors.append(f"vllm executable {vllm!r} not found (activate the vLLM environment, "
                          "or pass --vllm /path/to/vllm or set VLLM_BIN)")
    pid_file = _pid_file(args)
    running = read_pid_file(pid_file)
    if running is not None and up_is_running(running):
        errors.append(f"a stack is already running (`up` pid {running['up_pid']}, pid file "
                      f"{pid_file}); stop it with `vlm-reward-proxy down` or use --pid-file")
    for line in plan.warnings:
        warn(f"warning: {line}")
    if errors:
        for line in errors:
            warn(f"error: {line}")
        return 2
    run_dir = Path(args.run_dir).absolute() if args.run_dir else _new_run_dir(Path(args.runs_dir).absolute())
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "commands.sh").write_text(
        "".join(f"# {c.name}\n{c.shell_line()}\n" for c in plan.commands))
    if args.detach:
        return _detach(args, config_path, run_dir, pid_file, vllm)
    if args.ray:
        return run_up_ray(plan, settings, config_path, run_dir, pid_file, args, say=say, warn=warn,
                          proxy_argv=proxy_argv(config_path, args.only), proxy_url=_proxy_url(settings))
    return run_up(plan, settings, config_path, run_dir, pid_file, args)


def run_up(plan: Plan, settings: Settings, config_path: Path, run_dir: Path, pid_file: Path,
           args: argparse.Namespace) -> int:
    stack = Stack(run_dir, say=say, pid_file=pid_file, config_path=config_path,
                  poll_interval_s=args.poll_interval, progress_interval_s=args.progress_interval,
                  grace_s=args.grace, echo=args.logs)
    signals = StopSignals(stack)
    signals.catch()
    say(f"run directory: {run_dir}")

    def run() -> None:
        replicas = [stack.start_replica(command) for command in plan.commands]
        stack.wait_ready(replicas, args.timeout)
        if not args.no_proxy:
            argv = proxy_argv(config_path, args.only)
            say(f"starting the proxy (log {run_dir / 'proxy.log'}):\n  {shell_line(argv)}")
            proxy = stack.start("proxy", argv, {}, _proxy_url(settings), None)
            stack.wait_ready([proxy], min(args.timeout, 120.0))
        # said before the pid file says "running": whoever waits on the file finds the line written
        say(f"stack is up: {', '.join(c.name for c in replicas)}"
            + ("" if args.no_proxy else f"; proxy at {_proxy_url(settings)}")
            + f". {how_to_stop(pid_file, detached=args.detached)}")
        stack.write_pid_file("running")
        stack.monitor()

    try:
        return run_until_stopped(run, say=say, warn=warn)
    finally:
        say("stopping: SIGTERM to every process group"
            + (f", SIGKILL after {args.grace:g}s" if stack.children else ""))
        for line in stack.shutdown():
            say(f"  {line}")
        stack.close()
        signals.restore()


def print_plan(plan: Plan, settings: Settings, config_path: Path, runs_dir: Path,
               with_proxy: bool, ray: str | None = None, only: list[str] | None = None) -> None:
    log_dir = runs_dir / "<timestamp>"
    say(f"dry run of {config_path}: nothing is started")
    if ray:
        say(f"placed by the Ray cluster at {ray}: a placement group per replica, its GPUs on one node; "
            "each line below runs there with --host set to the node's address and CUDA_VISIBLE_DEVICES "
            "to the GPUs Ray assigns")
    parent_visible = next((c.parent_visible for c in plan.commands if c.parent_visible), None)
    visible = [d.strip() for d in parent_visible.split(",")] if parent_visible else []
    if parent_visible:
        say(f"this process has CUDA_VISIBLE_DEVICES={parent_visible}: replicas[].gpus are "
            "positions in that list")
    on_cpu = bool(plan.commands) and all(c.cpu for c in plan.commands)
    say("GPU assignment: by Ray" if ray else "GPU assignment: none (launch.device cpu)" if on_cpu
        else "GPU assignment:")
    for gpu, names in {} if ray else gpu_assignment(plan.commands).items():
        where = f" (device {visible[gpu]})" if gpu < len(visible) else ""
        say(f"  GPU {gpu}{where}: {', '.join(names)}"
            + ("   <-- OVERLAP" if len(names) > 1 else ""))
    say("vllm serve processes:")
    for c in plan.commands:
        mapped = (f" (-> CUDA_VISIBLE_DEVICES={c.env['CUDA_VISIBLE_DEVICES']})"
                  if c.parent_visible else "")
        where = "CPU" if c.cpu else f"GPU{'s' if len(c.gpus) > 1 else ''} {','.join(map(str, c.gpus))}"
        say(f"  {c.name}: {where}{mapped}, {c.base_url}/v1, "
            f"log {log_dir / (c.name + '.log')}")
        say(f"    {c.shell_line()}")
    if with_proxy:
        say(f"proxy: {_proxy_url(settings)}, log {log_dir / 'proxy.log'}")
        say(f"    {shell_line(proxy_argv(config_path, only))}")
    for name in plan.not_launched:
        say(f"not launched (no launch section; its endpoints must already be up): {name}")
    for line in plan.warnings:
        say(f"warning: {line}")
    for line in plan.errors:
        say(f"error: {line}")
    ok = "keys set, no port clash" if ray else "no GPU overlap, no port clash, endpoints match"
    say(f"checks: ok ({ok})" if not plan.errors
        else f"checks: {len(plan.errors)} error(s)")


def _detach(args: argparse.Namespace, config_path: Path, run_dir: Path, pid_file: Path,
            vllm: str) -> int:
    """Run this same `up` in the background (launchers/detach.py); wait until running or failed."""
    argv = [sys.executable, "-m", "vlm_reward_cli", "up", "--detached", "--config", str(config_path),
            "--run-dir", str(run_dir), "--pid-file", str(pid_file), "--vllm", vllm,
            "--timeout", str(args.timeout), "--grace", str(args.grace),
            "--poll-interval", str(args.poll_interval),
            "--progress-interval", str(args.progress_interval), "--logs", args.logs,
            *(["--no-proxy"] if args.no_proxy else []),
            *(arg for name in args.only or [] for arg in ("--only", name)),
            *(["--ray", args.ray, "--max-restarts", str(args.max_restarts)] if args.ray else []),
            *(["--ray-resource", args.ray_resource] if args.ray_resource else []),
            *(["--allow-gpu-overlap"] if args.allow_gpu_overlap else [])]
    return run_detached(argv, run_dir=run_dir, pid_file=pid_file,
                        poll_interval_s=args.poll_interval, say=say, warn=warn)


def run_down_command(args: argparse.Namespace) -> int:
    return stop_from_pid_file(_pid_file(args), grace_s=args.grace, say=say)

