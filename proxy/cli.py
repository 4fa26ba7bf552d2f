"""The proxy's commands: `serve` and `check-config` (the command line is vlm_reward_cli)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["SERVER_PYTHON", "add_subcommands", "require_server_python"]

# The service's code needs 3.11 (asyncio.timeout); pyproject's server extra carries the same floor.
SERVER_PYTHON = (3, 11)


def require_server_python(version: tuple[int, ...] = tuple(sys.version_info)) -> None:
    """Refuse to start the service on an older Python, naming it (not an AttributeError at the
    first upstream call)."""
    if tuple(version[:2]) < SERVER_PYTHON:
        raise SystemExit(f"error: the proxy service needs Python {'.'.join(map(str, SERVER_PYTHON))} or newer; "
                         f"this is Python {'.'.join(map(str, version[:3]))} (only the client runs on 3.10)")


def _serve(args: argparse.Namespace) -> int:
    require_server_python()
    import json
    from pathlib import Path

    from proxy.config import load_settings
    from proxy.http.serve import serve

    endpoints = json.loads(Path(args.endpoints).read_text()) if args.endpoints else None
    serve(load_settings(args.config, endpoints, only=args.only), host=args.host, port=args.port,
          log_level=args.log_level, access_log=args.access_log)
    return 0


def _check(args: argparse.Namespace) -> int:
    require_server_python()
    from proxy.config import load_settings
    from proxy.http.app import create_app

    settings = load_settings(args.config)
    create_app(settings)  # loads every prompt template too
    for warning in settings.warnings():
        print(f"warning: {warning}")
    print(f"config ok: backends {', '.join(settings.backends)}")
    return 0


def add_subcommands(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="run the scoring proxy",
        description="Run the scoring proxy (POST /score, GET /health, GET /metrics) on the "
                    "backends of a config file. The vLLM servers are started separately "
                    "(launchers/ or `vlm-reward-proxy up`).")
    serve.add_argument("--config", required=True, metavar="FILE",
                       help="YAML config with 'proxy' and 'backends' (see configs/libero.yaml)")
    serve.add_argument("--host", default=None, metavar="HOST",
                       help="address to bind; default: proxy.host from the config (127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, metavar="PORT",
                       help="port to bind; default: proxy.port from the config (18080)")
    serve.add_argument("--only", action="append", default=None, metavar="NAME",
                       help="serve only this backend of the config (name or alias; repeatable)")
    serve.add_argument("--endpoints", default=None, metavar="FILE",
                       help="JSON {backend: [url, ...]} replacing those backends' endpoints "
                            "(written by `up --ray` once Ray has placed the replicas)")
    serve.add_argument("--log-level", default="info", metavar="LEVEL",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="server log level: critical, error, warning, info or debug (default: info)")
    serve.add_argument("--access-log", action="store_true",
                       help="log one line per HTTP request (off by default: bodies hold media)")
    serve.set_defaults(func=_serve)

    check = commands.add_parser("check-config", help="validate a config file and its prompts",
                                description="Validate a config file and load its prompt templates.")
    check.add_argument("--config", required=True, metavar="FILE", help="YAML config to check")
    check.set_defaults(func=_check)
