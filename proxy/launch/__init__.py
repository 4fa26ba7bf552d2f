"""Start and stop the `vllm serve` processes a config describes (`vlm-reward-proxy up` / `down`).

commands.py builds the vllm argv and environment (pure, the one place the flags live); stack.py
runs the processes; cli.py registers the subcommands. launchers/*.sh build the same flags in bash.
"""

from proxy.launch.commands import Plan, ReplicaCommand, plan_stack, replica_commands, vllm_argv

__all__ = ["Plan", "ReplicaCommand", "plan_stack", "replica_commands", "vllm_argv"]
