"""`vlm-reward-proxy` command line: serve (and the stack / curves commands when present)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from proxy.errors import ConfigError

_SERVER_PACKAGES = {"fastapi", "uvicorn", "pydantic", "tenacity", "PIL", "cv2", "prometheus_client", "starlette"}


def _serve(args: argparse.Namespace) -> int:
    from proxy.config import load_settings
    from proxy.serve import serve

    serve(load_settings(args.config), host=args.host, port=args.port, log_level=args.log_level,
          access_log=args.access_log)
    return 0


def _check(args: argparse.Namespace) -> int:
    from proxy.app import create_app
    from proxy.config import load_settings

    settings = load_settings(args.config)
    create_app(settings)  # loads every prompt template too
    for warning in settings.warnings():
        print(f"warning: {warning}")
    print(f"config ok: backends {', '.join(settings.backends)}")
    return 0


def _optional_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Commands that live in other modules (launchers, RLinf curves), registered if installed."""
    registrars = []
    try:
        from launchers.cli import add_subcommands as add_stack
        registrars.append(add_stack)
    except ImportError:
        pass
    try:
        from rlinf_client.curves import add_subcommand as add_curves
        registrars.append(add_curves)
    except ImportError:
        pass
    return registrars


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-reward-proxy",
        description="Score robot episodes with VLMs served by stock `vllm serve`.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the scoring proxy",
        description="Run the scoring proxy (POST /score, GET /health, GET /metrics) on the "
                    "backends of a config file. The vLLM servers are started separately "
                    "(launchers/ or `vlm-reward-proxy up`).")
    serve.add_argument("--config", required=True, metavar="FILE",
                       help="YAML config with 'proxy' and 'backends' (see configs/libero.yaml)")
    serve.add_argument("--host", default=None,
                       help="address to bind; default: proxy.host from the config (127.0.0.1)")
    serve.add_argument("--port", type=int, default=None,
                       help="port to bind; default: proxy.port from the config (18080)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="server log level (default: info)")
    serve.add_argument("--access-log", action="store_true",
                       help="log one line per HTTP request (off by default: bodies hold media)")
    serve.set_defaults(func=_serve)

    check = commands.add_parser("check-config", help="validate a config file and its prompts",
                                description="Validate a config file and load its prompt templates.")
    check.add_argument("--config", required=True, metavar="FILE", help="YAML config to check")
    check.set_defaults(func=_check)

    for register in _optional_commands():
        register(commands)
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
    except ModuleNotFoundError as err:
        if err.name in _SERVER_PACKAGES:
            print(f"error: {err.name} is missing; the proxy needs the server extra: "
                  "pip install 'vlm-reward-proxy[server]'", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
