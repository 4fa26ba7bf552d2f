"""`vlm-reward-proxy`: one command line over the packages, each registering its own commands.

    serve, check-config     proxy/cli.py       (the HTTP service)
    up, down                launchers/cli.py   (vllm serve processes + the proxy)
    curves, report          reports/cli.py     (RLinf training curves, reward quality)
    replay                  replay.py          (re-score an audit log through the proxy's pipeline)
    eval                    evaluate.py        (compare candidate rewards on episodes with known outcomes)
    sample-episode          sample_episode.py  (a synthetic episode MP4 where the proxy reads video_path)
    rlinf-configs           rlinf_configs.py   (merge the run overlays into RLinf experiment configs)

This package sits on top: it imports the others (rlinf_client for rlinf-configs only), none imports
it. Registering a command imports only argparse-level code; a command's heavy dependencies load
when it runs, and a missing one is a clear error naming the extra to install — never a command
that silently disappears.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys

from launchers import cli as launchers_cli
from proxy import cli as proxy_cli
from proxy.errors import ConfigError
from reports import cli as reports_cli
from reports.plotting import MissingDependencyError
from vlm_reward_cli import evaluate, replay, rlinf_configs, sample_episode

__all__ = ["build_parser", "main", "version"]

# Import names of the `server` extra's packages: a missing one means the proxy extra is not installed.
_SERVER_PACKAGES = {"fastapi", "uvicorn", "pydantic", "tenacity", "PIL", "cv2", "prometheus_client",
                    "starlette", "psutil", "pybase64"}


def version() -> str:
    """The installed distribution's version (pyproject's), or 'unknown' when run from a bare checkout."""
    try:
        return importlib.metadata.version("vlm-reward-proxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-reward-proxy",
        description="Score robot episodes with VLMs served by stock `vllm serve`.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for package in (proxy_cli, launchers_cli, reports_cli):
        package.add_subcommands(commands)
    replay.add_subcommand(commands)
    evaluate.add_subcommand(commands)
    sample_episode.add_subcommand(commands)
    rlinf_configs.add_subcommand(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call/probe is noise
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2
    except MissingDependencyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name in _SERVER_PACKAGES:
            print(f"error: {err.name} is missing; this command needs the server extra: "
                  "pip install 'vlm-reward-proxy[server]'", file=sys.stderr)
            return 2
        raise
