"""``kvstore stats --target ADDR``: print a running daemon's tiers and counters."""

from __future__ import annotations

import argparse
import json

from kvstore.client.client import KVStoreClient
from kvstore.common.errors import KVStoreError
from kvstore.common.units import format_size


def cmd_stats(args: argparse.Namespace) -> int:
    try:
        with KVStoreClient(args.target, timeout=args.timeout, auth_token=args.token) as c:
            if args.wait:
                c.wait_ready(timeout=args.timeout)
            stats = c.stats()
    except KVStoreError as e:
        print(f"kvstore stats: {e}")
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(f"{'tier':6s} {'policy':9s} {'capacity':>12s} {'used':>12s} {'blocks':>9s}")
    for t in stats["tiers"]:
        print(f"{t['name']:6s} {t['policy']:9s} {format_size(t['capacity_bytes']):>12s} "
              f"{format_size(t['used_bytes']):>12s} {t['blocks']:>9d}")
    for k, v in sorted(stats["counters"].items()):
        print(f"  {k:28s} {v}")
    print(f"serving: {'yes' if stats['serving'] else 'NO'}")
    for problem in stats["problems"]:          # e.g. "remote: not connected to the Mooncake master ..."
        print(f"  problem: {problem}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="show a running daemon's tiers and counters")
    p.add_argument("--target", default="unix:kvstore-data/kvstore.sock", help="daemon address")
    p.add_argument("--token", default="", help="bearer token, when the daemon requires one")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--wait", action="store_true", help="wait up to --timeout for the daemon to come up")
    p.set_defaults(func=cmd_stats)
