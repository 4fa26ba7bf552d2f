"""The report commands of `vlm-reward-proxy`: curves (RLinf training curves) and report (reward
quality from the proxy's audit log)."""

from __future__ import annotations

import argparse

from reports import curves, report

__all__ = ["add_subcommands"]


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    curves.add_subcommand(subparsers)
    report.add_subcommand(subparsers)
