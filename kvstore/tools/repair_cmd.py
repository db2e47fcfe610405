"""``kvstore repair-index PATH``: rebuild an NVMe tier folder's index from its block files.

Run it while no daemon uses the folder (the tier's folder lock refuses otherwise). The
old index is moved aside, not deleted; files with a bad header are moved to
``PATH/quarantine``; no block is deleted (:func:`tiers.nvme.repair.repair_index`).
A daemon rebuilds a damaged index by itself at start; this command is for an operator
who wants to rebuild one offline or check what a folder holds.
"""

from __future__ import annotations

import argparse

from tiers.errors import MediaIOError
from tiers.nvme.repair import repair_index

from kvstore.tools.cliargs import non_empty_path


def cmd_repair_index(args: argparse.Namespace) -> int:
    try:
        report = repair_index(args.path)
    except MediaIOError as e:
        print(f"kvstore repair-index: {e}")
        return 1
    print(f"kvstore repair-index: {args.path}: {report.summary()}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repair-index", help="rebuild an NVMe tier's index from its block files (daemon stopped)")
    p.add_argument("path", type=non_empty_path, help="the NVMe tier folder ([tiers.nvme] path in the config)")
    p.set_defaults(func=cmd_repair_index)
