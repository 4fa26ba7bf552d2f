"""Start and stop the `vllm serve` processes a config describes (`vlm-reward-proxy up` / `down`).

The shell scripts here (serve_qwen2_5_vl.sh, serve_primo_r1.sh, _serve_vllm.sh) start one server
by hand; the Python modules run a whole stack from a config:

  commands.py    the `vllm serve` argv and environment of each replica (pure; the one place the
                 flags live, which the scripts mirror in bash)
  plan.py        the stack's plan and its checks: GPU overlap, port clashes, endpoints, busy ports
  processes.py   processes and process groups through psutil; how a process ended
  logs.py        log tails and the last error line of a log
  supervisor.py  start, wait for readiness (proxy.upstream.health.probe), watch, stop (Stack)
  pidfile.py     the pid file `up` writes and `down`, which stops what it records
  detach.py      `up --detach`
  cli.py         `add_subcommands(subparsers)`: the `up` and `down` commands

Dependencies go one way: launchers imports proxy.config / proxy.upstream.health, never the reverse.
"""

from launchers.commands import ReplicaCommand, replica_commands, vllm_argv
from launchers.plan import Plan, plan_stack

__all__ = ["Plan", "ReplicaCommand", "plan_stack", "replica_commands", "vllm_argv"]
