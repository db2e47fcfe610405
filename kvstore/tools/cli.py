"""The ``kvstore`` command line.

Subcommands live in their own modules; each exposes ``register(subparsers)`` that
adds its parser and sets ``func`` (a callable taking the parsed args, returning an
exit code). This file only lists the modules.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = (
    "kvstore.tools.serve_cmd",      # kvstore serve
    "kvstore.tools.replay",         # kvstore replay
    "kvstore.tools.stats_cmd",      # kvstore stats
    "kvstore.tools.repair_cmd",     # kvstore repair-index
    "kvstore.tools.simulate_cli",   # kvstore simulate
    "kvstore.tools.agent_trace",    # kvstore gen-agent-trace
    "kvstore.tools.explain_cli",    # kvstore explain
    "kvstore.tools.agent_demo_cmd",  # kvstore agent-demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="Tiered KV-cache block store for LLM agent serving.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
