"""The report commands of `vlm-reward-proxy`: curves (and the reward-quality report)."""

from __future__ import annotations

import argparse

from reports import curves

__all__ = ["add_subcommands"]


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    curves.add_subcommand(subparsers)
