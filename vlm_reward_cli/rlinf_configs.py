"""`vlm-reward-proxy rlinf-configs`: the RLinf config merge of rlinf_client.rlinf_configs, whose own
`python -m` entry stays for the client-only install."""

from __future__ import annotations

import argparse

from rlinf_client import rlinf_configs

__all__ = ["add_subcommand"]


def add_subcommand(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "rlinf-configs", help="merge the run overlays (configs/rlinf/*.yaml) into RLinf experiment configs",
        description=rlinf_configs.DESCRIPTION)
    rlinf_configs.add_arguments(parser)
    parser.set_defaults(func=rlinf_configs.run)
