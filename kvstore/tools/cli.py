"""The ``kvstore`` command line.

Subcommands live in their own modules; each exposes ``register(subparsers)`` that
adds its parser and sets ``func`` (a callable taking the parsed args, returning an
exit code). This file lists the modules and runs the chosen one.

Exit status: what the command returns (0 done, 1 failed, 2 bad input); 130 after Ctrl-C;
141 (128 + SIGPIPE, as a shell reports a program a closed pipe killed) when the reader of
the output went away, e.g. ``kvstore stats | head -1``: the rest of the output is
dropped, with no traceback. (``--help`` prints through argparse, which exits 0 itself
before any of this: ``kvstore --help | head -0`` exits 0.)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

COMMAND_MODULES = (
    "kvstore.tools.serve_cmd",      # kvstore serve
    "kvstore.tools.replay",         # kvstore replay
    "kvstore.tools.stats_cmd",      # kvstore stats
    "kvstore.tools.repair_cmd",     # kvstore repair-index
    "kvstore.tools.simulate_cli",   # kvstore simulate
    "kvstore.tools.agent_trace_cmd",  # kvstore gen-agent-trace
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


BROKEN_PIPE = 141
"""Exit status when the output's reader closed the pipe (128 + SIGPIPE)."""


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the command; returns the
    exit status (see the module docstring)."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        level = logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        try:
            code = int(args.func(args) or 0)
        except KeyboardInterrupt:
            code = 130
        sys.stdout.flush()      # here, not at exit, where a closed pipe is only a warning
        return code
    except BrokenPipeError:
        _drop_output()
        return BROKEN_PIPE


def _drop_output() -> None:
    """Point stdout at /dev/null: what is still buffered for a closed pipe goes nowhere, and
    the interpreter's flush at exit cannot fail again. stderr is kept: errors still show."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout,):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):    # no file descriptor (a test's capture)
            pass
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
