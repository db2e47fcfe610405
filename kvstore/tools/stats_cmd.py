"""``kvstore stats --target ADDR``: print a running daemon's tiers and counters.

``--watch [SECONDS]`` redraws a live view every SECONDS (default 2) until Ctrl-C, for an
operator without Prometheus: per tier its usage and its rates (blocks read, bytes read and
stored, evictions per second), the Lookup hit rate (since start and over the last
interval), which tiers served the reads, put and movement rates, and the daemon's problems.
Rates are differences of the daemon's counters between two Stats calls divided by the
time between them, so the first frame has none. On a terminal each frame replaces the last
(ANSI clear); piped, frames follow one another. ``--count N`` stops after N frames.

Errors go to stderr, exit status 1: the hint that no daemon may be running only when none
answered (StoreUnavailable); a missing or wrong ``--token`` says so, and ends a live view.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import TextIO

from kvstore.client.client import KVStoreClient
from kvstore.common.errors import KVStoreError, StoreUnavailable, Unauthenticated
from kvstore.common.units import format_size
from kvstore.tools.cliargs import MAX_WAIT_S, address, at_most, positive_float, positive_int

CLEAR = "\x1b[H\x1b[J"           # cursor home, erase to the end of the screen
DEFAULT_WATCH_S = 2.0


def cmd_stats(args: argparse.Namespace) -> int:
    if args.watch is not None:
        return watch(args.target, args.watch, count=args.count, token=args.token, timeout=args.timeout)
    try:
        with KVStoreClient(args.target, timeout=args.timeout, auth_token=args.token) as c:
            if args.wait:
                c.wait_ready(timeout=args.timeout)
            stats = c.stats()
    except KVStoreError as e:
        print(f"kvstore stats: {e}{_hint(e, args.target, args.token)}", file=sys.stderr)
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


def _hint(error: KVStoreError, target: str, token: str) -> str:
    """What to check after ``error``: whether a daemon runs only when none answered; the
    token on an authentication error; nothing otherwise."""
    if isinstance(error, StoreUnavailable):
        return f" (is `kvstore serve` running, listening on {target}?)"
    if isinstance(error, Unauthenticated):
        return " (the --token given is not the daemon's)" if token else " (the daemon needs --token)"
    return ""


# ------------------------------------------------------------------ the live view


@dataclasses.dataclass(frozen=True)
class Sample:
    """One Stats reply (:meth:`KVStoreClient.stats`) and when it came (monotonic seconds)."""

    stats: dict
    at: float


class Rates:
    """Per-second rates of the counters between two samples (None without a previous one)."""

    def __init__(self, cur: Sample, prev: Sample | None):
        self.cur = cur.stats["counters"]
        self.prev = prev.stats["counters"] if prev is not None else None
        self.seconds = cur.at - prev.at if prev is not None else 0.0

    def delta(self, name: str) -> int | None:
        """The counter's increase, or None (no previous sample, or it went back: a restart)."""
        if self.prev is None:
            return None
        d = self.cur.get(name, 0) - self.prev.get(name, 0)
        return d if d >= 0 else None

    def per_s(self, name: str) -> float | None:
        d = self.delta(name)
        return None if d is None or self.seconds <= 0 else d / self.seconds


def _ratio(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _bytes_per_s(value: float | None) -> str:
    return "-" if value is None else f"{format_size(value)}/s"


def render(target: str, cur: Sample, prev: Sample | None, *, clock: str = "") -> str:
    """One frame of the live view (text lines, no trailing newline).

    Hit rate is Lookup blocks found over blocks asked (longest stored prefix), since the
    daemon started and over the interval; *reads by tier* is each tier's share of the
    blocks served by Get since start; same-node reads in place (leased, or read from the
    shared block table with no round trip) are counted beside them. Rates are per second
    over the interval.
    """
    s, c, r = cur.stats, cur.stats["counters"], Rates(cur, prev)
    interval = f"last {r.seconds:.1f} s" if prev is not None else "rates from the next frame"
    lines = [f"kvstore at {target}  serving: {'yes' if s['serving'] else 'NO'}  {clock}  ({interval}; Ctrl-C stops)",
             f"{'tier':6s} {'policy':9s} {'capacity':>11s} {'used':>11s} {'used%':>6s} {'blocks':>9s} "
             f"{'reads/s':>8s} {'read':>13s} {'stored':>13s} {'evicted/s':>9s}"]
    for t in s["tiers"]:
        name = t["name"]
        lines.append(f"{name:6s} {t['policy']:9s} {format_size(t['capacity_bytes']):>11s} "
                     f"{format_size(t['used_bytes']):>11s} {_ratio(t['used_bytes'], t['capacity_bytes']):>6s} "
                     f"{t['blocks']:>9d} {_num(r.per_s(f'reads_{name}')):>8s} "
                     f"{_bytes_per_s(r.per_s(f'read_bytes_{name}')):>13s} "
                     f"{_bytes_per_s(r.per_s(f'stored_bytes_{name}')):>13s} "
                     f"{_num(r.per_s(f'evictions_{name}')):>9s}")
    asked, hit = c.get("lookup_blocks", 0), c.get("lookup_hit_blocks", 0)
    line = f"hit rate {_ratio(hit, asked)} since start ({hit} of {asked} blocks looked up)"
    d_asked, d_hit = r.delta("lookup_blocks"), r.delta("lookup_hit_blocks")
    if d_asked is not None and d_hit is not None:
        line += f", {_ratio(d_hit, d_asked)} over the {interval} ({d_hit} of {d_asked})"
    lines.append(line)
    reads = c.get("reads", 0)
    shares = ", ".join(f"{t['name']} {_ratio(c.get('reads_' + t['name'], 0), reads)}" for t in s["tiers"])
    lines.append(f"reads by tier since start: {shares} of {reads} blocks served by Get; same node, read in "
                 f"place: {c.get('leased_blocks', 0)} blocks leased, {c.get('table_read_blocks', 0)} read "
                 f"from the block table")
    lines.append(f"per second: lookups {_num(r.per_s('lookups'))}  blocks put {_num(r.per_s('blocks_put'))} "
                 f"({_bytes_per_s(r.per_s('bytes_put'))})  blocks read {_num(r.per_s('reads'))}  "
                 f"leased {_num(r.per_s('leased_blocks'))}  table reads {_num(r.per_s('table_read_blocks'))}  "
                 f"get misses {_num(r.per_s('get_misses'))}  "
                 f"demotions {_num(r.per_s('demotions'))}  precleaned {_num(r.per_s('precleaned'))}  "
                 f"promotions {_num(r.per_s('promotions'))}")
    trouble = {k: c.get(k, 0) for k in ("corrupt_blocks", "read_errors", "puts_rejected_full", "transfers_failed")}
    lines.append("since start: " + "  ".join(f"{k} {v}" for k, v in trouble.items()))
    lines += [f"problem: {p}" for p in s["problems"]] or ["problems: none"]
    return "\n".join(lines)


def watch(target: str, interval_s: float, *, count: int | None = None, token: str = "", timeout: float = 10.0,
          out: TextIO | None = None) -> int:
    """Redraw :func:`render` every ``interval_s`` seconds until Ctrl-C (or ``count`` frames).

    A daemon that stops answering shows as one line per frame; the view goes on and picks
    up again when it is back (another error shows the same way, without the "not
    answering"). Returns 0 (Ctrl-C or ``count`` reached), or 1 when the daemon refuses the
    token (said on stderr: waiting cannot mend it).
    """
    out = sys.stdout if out is None else out
    redraw = out.isatty()
    prev: Sample | None = None
    frames = 0
    try:
        with KVStoreClient(target, timeout=timeout, auth_token=token) as client:
            while True:
                clock = time.strftime("%H:%M:%S")
                try:
                    cur = Sample(client.stats(timeout=timeout), time.monotonic())
                    frame = render(target, cur, prev, clock=clock)
                    prev = cur
                except Unauthenticated as e:
                    print(f"kvstore stats: {e}{_hint(e, target, token)}", file=sys.stderr)
                    return 1
                except StoreUnavailable as e:
                    frame = f"kvstore at {target}  {clock}  not answering: {e}"
                    prev = None
                except KVStoreError as e:
                    frame = f"kvstore at {target}  {clock}  error: {e}"
                    prev = None
                out.write((CLEAR if redraw else "") + frame + "\n" + ("" if redraw else "\n"))
                out.flush()
                frames += 1
                if count is not None and frames >= count:
                    return 0
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="show a running daemon's tiers and counters")
    p.add_argument("--target", type=address, default="unix:kvstore-data/kvstore.sock", help="daemon address")
    p.add_argument("--token", default="", help="bearer token, when the daemon requires one")
    p.add_argument("--timeout", type=at_most(positive_float, MAX_WAIT_S), default=10.0,
                   help="per-call deadline, seconds (default 10, at most a day)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--wait", action="store_true", help="wait up to --timeout for the daemon to come up")
    p.add_argument("--watch", nargs="?", type=at_most(positive_float, MAX_WAIT_S), const=DEFAULT_WATCH_S, default=None,
                   metavar="SECONDS", help=f"redraw a live view every SECONDS (default {DEFAULT_WATCH_S:g}) "
                                           "until Ctrl-C: tiers, hit rate, rates per second")
    p.add_argument("--count", type=positive_int, default=None, metavar="N",
                   help="with --watch: stop after N frames")
    p.set_defaults(func=cmd_stats)
