"""``kvstore replay``: drive a running daemon with a Mooncake-format trace.

Per request, in timestamp order (as fast as possible): Lookup the request's block
ids, Get the hit prefix (checking every byte), Put the missed blocks. Given several
daemons (a cluster), request ``i`` goes to daemon ``i mod n`` (round robin). Each trace
``hash_id`` becomes a 32-byte key (:func:`trace_key`); each block's payload is
``block_tokens * bytes_per_token`` bytes derived from its key (:func:`payload_for`),
so a Get that returns another block's bytes is caught and counted in
``corrupt_blocks``.

Hit rates use prefix semantics: a block counts only when every earlier block of the
same request hit too; block ``i`` counts ``block_tokens`` tokens except the last,
which counts ``input_length - block_tokens * (n - 1)``. On the conversation trace
an infinite cache reaches a token hit rate of 0.3736 (``../shared/data/README.md``);
more than that means a counting bug.

A block the daemon does not store (no tier has room for it, no admission policy wants it,
its key is stored with another size) is one put failure, counted with its reason. The
command refuses blocks larger than the largest tier of a daemon before it starts, and
exits 1 when no block at all could be put.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tiers.base import TierKind

from kvstore.tools.cliargs import (MAX_BLOCK_BYTES, MAX_WAIT_S, address, at_most, non_empty_path, non_negative_float, non_negative_int, output_error,
                                   positive_float, positive_int)
from kvstore.client.client import KVStoreClient
from kvstore.tools.trace import TRACE_BLOCK_TOKENS, block_key
from kvstore.common.errors import (InvalidRequest, KVStoreError, SizeConflict, StoreUnavailable, TierFull,
                                   Unauthenticated)
from kvstore.common.units import format_size



MAX_REPLAY_BLOCK_BYTES = MAX_BLOCK_BYTES
"""Largest block payload a replay makes (bytes): 2 MiB per token, six times a 70B model's KV.
The replay's own limit; a daemon's tiers may hold less (:func:`largest_tier`)."""

MAX_FAILURE_REASONS = 10
"""Distinct put-failure reasons a report keeps; more are counted under :data:`OTHER_REASONS`."""

OTHER_REASONS = "(other reasons)"
NOT_ADMITTED = "not admitted: no tier's admission policy wanted the block"
SIZE_CONFLICT = "size conflict: the key is stored with another size"

INTERRUPTED = "interrupted (Ctrl-C)"
"""``ReplayReport.error`` of a replay stopped by KeyboardInterrupt."""


def trace_key(hash_id: int, block_bytes: int = 0) -> bytes:
    """The 32-byte store key of a trace block id for payloads of ``block_bytes`` bytes
    (:func:`kvstore.tools.trace.block_key`; 0: the simulator's size-less key)."""
    return block_key(hash_id, f"{block_bytes}B".encode() if block_bytes else b"")


def payload_for(key: bytes, nbytes: int) -> bytes:
    """Deterministic ``nbytes``-byte payload of a key: the key repeated."""
    reps = nbytes // len(key) + 1
    return (key * reps)[:nbytes]


def block_token_counts(input_length: int, num_blocks: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Tokens covered by each block of a request: full blocks, then the remainder.

    Raises ValueError when the request's block count does not match its length.
    """
    if num_blocks == 0:
        return []
    last = input_length - block_tokens * (num_blocks - 1)
    if not 0 < last <= block_tokens:
        raise ValueError(f"{num_blocks} blocks of {block_tokens} tokens cannot hold {input_length} tokens")
    return [block_tokens] * (num_blocks - 1) + [last]


@dataclass
class ReplayReport:
    """Totals of one replay. Token and byte counts are sums over requests."""

    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    total_blocks: int = 0
    hit_blocks: int = 0
    token_hit_rate: float = 0.0
    block_hit_rate: float = 0.0
    hits_by_tier: dict[str, int] = field(default_factory=dict)   # tokens served per tier
    blocks_put: int = 0
    blocks_already_present: int = 0
    blocks_got: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    corrupt_blocks: int = 0
    lookup_get_disagreements: int = 0   # blocks looked up as hits that the Get then missed
    put_failures: int = 0               # blocks the daemon did not store, one each
    put_failure_reasons: dict[str, int] = field(default_factory=dict)   # why (error text or kind) -> blocks
    error: str = ""                     # why the replay stopped early ("" when it finished)
    seconds: float = 0.0
    bytes_per_token: int = 0
    block_tokens: int = TRACE_BLOCK_TOKENS

    def count_put_failures(self, reason: str, blocks: int = 1) -> None:
        """Count ``blocks`` blocks not stored, for ``reason`` (at most
        :data:`MAX_FAILURE_REASONS` distinct reasons are kept)."""
        if blocks <= 0:
            return
        reasons = self.put_failure_reasons
        if reason not in reasons and len(reasons) >= MAX_FAILURE_REASONS:
            reason = OTHER_REASONS
        self.put_failures += blocks
        reasons[reason] = reasons.get(reason, 0) + blocks

    def finish(self) -> "ReplayReport":
        self.token_hit_rate = self.hit_tokens / self.input_tokens if self.input_tokens else 0.0
        self.block_hit_rate = self.hit_blocks / self.total_blocks if self.total_blocks else 0.0
        return self

    def table(self) -> str:
        secs = max(self.seconds, 1e-9)
        rows = [
            ("requests", f"{self.requests}"),
            ("input tokens", f"{self.input_tokens}"),
            ("token hit rate", f"{self.token_hit_rate:.4f}"),
            ("block hit rate", f"{self.block_hit_rate:.4f}"),
        ]
        for tier, tokens in sorted(self.hits_by_tier.items()):
            share = tokens / self.hit_tokens if self.hit_tokens else 0.0
            rows.append((f"  hit tokens from {tier}", f"{tokens} ({share:.1%} of hits)"))
        rows += [
            ("blocks put", f"{self.blocks_put} ({format_size(self.bytes_put)}, "
                           f"{self.bytes_put / secs / 1e9:.2f} GB/s over the run)"),
            ("blocks got", f"{self.blocks_got} ({format_size(self.bytes_got)}, "
                           f"{self.bytes_got / secs / 1e9:.2f} GB/s over the run)"),
            ("corrupt blocks", f"{self.corrupt_blocks}"),
            ("put failures", f"{self.put_failures}"),
        ]
        rows += [(f"  {n} refused", reason)
                 for reason, n in sorted(self.put_failure_reasons.items(), key=lambda kv: -kv[1])]
        rows.append(("seconds", f"{self.seconds:.1f} ({self.requests / secs:.0f} requests/s)"))
        if self.error:
            rows.append(("STOPPED EARLY", self.error))
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def replay(requests: Sequence, client: KVStoreClient | Sequence[KVStoreClient], *, bytes_per_token: int = 16,
           block_tokens: int = TRACE_BLOCK_TOKENS, progress: bool = True) -> ReplayReport:
    """Replay ``requests`` (objects with ``input_length`` and ``hash_ids``) through ``client``
    (or clients of several daemons, round robin).

    Returns the :class:`ReplayReport`; when the daemon fails mid-way or the replay is
    interrupted (Ctrl-C), the report of the requests done so far with ``error`` set. Raises ValueError for a request whose block
    count does not match its length, InvalidRequest (before anything is sent) when the
    node's ``[blocks] block_tokens`` is set to another block size.
    A block the daemon does not store (a Put refused with RESOURCE_EXHAUSTED, or not
    admitted, or a size conflict) is counted in ``put_failures`` with its reason in
    ``put_failure_reasons``, not raised; after a refused Put of several blocks they are
    put one at a time to count each (a block the refused Put stored then counts as
    already present).
    """
    from tqdm import tqdm

    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be > 0")
    clients = list(client) if isinstance(client, (list, tuple)) else [client]
    for c in clients:
        c.check_block_tokens(block_tokens)
    block_bytes = block_tokens * bytes_per_token
    rep = ReplayReport(bytes_per_token=bytes_per_token, block_tokens=block_tokens)
    by_tier: Counter[str] = Counter()
    t0 = time.perf_counter()
    bar = tqdm(requests, desc="replay", unit="req", disable=not progress, mininterval=1.0,
               file=sys.stderr, dynamic_ncols=True)
    try:
        _replay_requests(bar, clients, rep, by_tier, block_bytes, block_tokens, progress)
    except KVStoreError as e:
        rep.error = str(e)            # the daemon went away: report what was done
    except KeyboardInterrupt:
        rep.error = INTERRUPTED       # Ctrl-C: report what was done
    bar.close()
    rep.seconds = time.perf_counter() - t0
    rep.hits_by_tier = dict(by_tier)
    return rep.finish()


def _replay_requests(bar, clients: list[KVStoreClient], rep: ReplayReport, by_tier: Counter,
                     block_bytes: int, block_tokens: int, progress: bool) -> None:
    for n, req in enumerate(bar):
        client = clients[n % len(clients)]
        keys = [trace_key(h, block_bytes) for h in req.hash_ids]
        tokens = block_token_counts(req.input_length, len(keys), block_tokens)
        hit = client.lookup(keys).hit_blocks if keys else 0
        rep.requests += 1            # counted once its lookup was answered
        rep.input_tokens += req.input_length
        rep.total_blocks += len(keys)
        served = 0
        if hit:
            for i, res in enumerate(client.get(keys[:hit], stop_at_miss=True)):
                if not res.found:
                    rep.lookup_get_disagreements += hit - i
                    break
                rep.blocks_got += 1
                rep.bytes_got += len(res.data)
                if res.data != payload_for(keys[i], block_bytes):
                    rep.corrupt_blocks += 1
                    break
                served += 1
                by_tier[TierKind(res.tier).name.lower()] += tokens[i]
        rep.hit_blocks += served
        rep.hit_tokens += sum(tokens[:served])
        missing = keys[served:]
        if missing:
            _put_blocks(client, missing, block_bytes, rep)
        if progress and rep.requests % 200 == 0:
            bar.set_postfix(hit=f"{rep.hit_tokens / max(rep.input_tokens, 1):.3f}")


def _put_blocks(client: KVStoreClient, keys: list[bytes], block_bytes: int, rep: ReplayReport) -> None:
    """Put ``keys`` (their :func:`payload_for` payloads) and count the outcome per block in
    ``rep``; a refused Put of several blocks is done again block by block."""
    results = []
    try:
        results.append(client.put([(k, payload_for(k, block_bytes)) for k in keys]))
    except SizeConflict as e:
        _count_size_conflict(e, len(keys), results, rep)
    except TierFull as e:
        if len(keys) == 1:
            rep.count_put_failures(str(e))
            return
        for k in keys:
            try:
                results.append(client.put([(k, payload_for(k, block_bytes))]))
            except SizeConflict as one:
                _count_size_conflict(one, 1, results, rep)
            except TierFull as one:
                rep.count_put_failures(str(one))
    for res in results:
        rep.blocks_put += res.stored
        rep.blocks_already_present += res.already_present
        rep.bytes_put += res.bytes_stored
        rep.count_put_failures(NOT_ADMITTED, res.not_admitted)
        rep.count_put_failures(SIZE_CONFLICT, res.size_conflicts)


def _count_size_conflict(error: SizeConflict, blocks: int, results: list, rep: ReplayReport) -> None:
    """A Put of ``blocks`` blocks refused with a size conflict: its ``.result`` (what the
    other blocks did, its ``size_conflicts`` included) joins ``results``; without one, every
    block counts as a size conflict."""
    result = getattr(error, "result", None)
    if result is None:
        rep.count_put_failures(SIZE_CONFLICT, blocks)
    else:
        results.append(result)


def largest_tier(client: KVStoreClient) -> tuple[str, int] | None:
    """The name and capacity (bytes) of the daemon's largest tier that takes a put's first
    copy (a remote tier does not), from its Stats: no block larger than that capacity can
    be stored. None when it has no such tier. Raises as :meth:`KVStoreClient.stats`."""
    tiers = [(t["capacity_bytes"], t["name"]) for t in client.stats()["tiers"] if t["tier"] != "remote"]
    if not tiers:
        return None
    capacity, name = max(tiers)
    return name, capacity


def _too_large_for(client: KVStoreClient, block_bytes: int, bytes_per_token: int) -> str | None:
    """Why ``block_bytes``-byte blocks cannot be stored on ``client``'s daemon, or None."""
    largest = largest_tier(client)
    if largest is None or block_bytes <= largest[1]:
        return None
    name, capacity = largest
    return (f"--bytes-per-token {bytes_per_token} makes {TRACE_BLOCK_TOKENS}-token blocks of "
            f"{format_size(block_bytes)}, larger than the largest tier of the daemon at {client.target} "
            f"({name}, {format_size(capacity)} in all): give a smaller --bytes-per-token")


def _hint(error: KVStoreError, targets: list[str], token: str) -> str:
    """What to check after ``error`` reaching the daemons: whether one runs only when none
    answered; the token on an authentication error."""
    if isinstance(error, StoreUnavailable):
        return f" (is `kvstore serve` running on {', '.join(targets)}?)"
    if isinstance(error, Unauthenticated):
        return " (the --token given is not the daemon's)" if token else " (the daemon needs --token)"
    return ""


def cmd_replay(args: argparse.Namespace) -> int:
    from kvstore.tools.trace import read_mooncake_trace

    if args.bytes_per_token * TRACE_BLOCK_TOKENS > MAX_REPLAY_BLOCK_BYTES:
        print(f"kvstore replay: --bytes-per-token {args.bytes_per_token} makes {TRACE_BLOCK_TOKENS}-token blocks of "
              f"{format_size(args.bytes_per_token * TRACE_BLOCK_TOKENS)}; a replay makes blocks of at most "
              f"{format_size(MAX_REPLAY_BLOCK_BYTES)} (--bytes-per-token "
              f"{MAX_REPLAY_BLOCK_BYTES // TRACE_BLOCK_TOKENS}), and the daemon's tiers may hold less",
              file=sys.stderr)
        return 2
    why = output_error(args.json) if args.json else None   # now, not after a long replay (no empty file left)
    if why:
        print(f"kvstore replay: cannot write --json {args.json}: {why}", file=sys.stderr)
        return 2
    try:
        requests = read_mooncake_trace(args.trace)
    except (OSError, ValueError) as e:
        print(f"kvstore replay: {e}", file=sys.stderr)
        return 2
    if args.limit:
        requests = requests[:args.limit]
    if not requests:
        print(f"kvstore replay: {args.trace} holds no requests", file=sys.stderr)
        return 2
    targets = args.target or ["unix:kvstore-data/kvstore.sock"]
    clients: list[KVStoreClient] = []
    try:
        for target in targets:
            clients.append(KVStoreClient(target, timeout=args.timeout, auth_token=args.token))
            clients[-1].wait_ready(timeout=args.wait)
            too_large = _too_large_for(clients[-1], args.bytes_per_token * TRACE_BLOCK_TOKENS, args.bytes_per_token)
            if too_large:
                print(f"kvstore replay: {too_large}", file=sys.stderr)
                return 2
        report = replay(requests, clients, bytes_per_token=args.bytes_per_token, progress=not args.quiet)
    except InvalidRequest as e:       # the node is configured for another block size
        print(f"kvstore replay: {e}", file=sys.stderr)
        return 2
    except KVStoreError as e:
        print(f"kvstore replay: {e}{_hint(e, targets, args.token)}", file=sys.stderr)
        return 1
    finally:
        for c in clients:
            c.close()
    print(report.table())
    if args.json:
        try:
            pathlib.Path(args.json).write_text(json.dumps(asdict(report), indent=2, sort_keys=True) + "\n")
        except OSError as e:       # checked before the replay; gone since (a folder removed, a full disk)
            print(f"kvstore replay: cannot write --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    if report.error == INTERRUPTED:
        return 130
    if report.error:
        return 1
    if report.put_failures and not report.blocks_put:
        reason = max(report.put_failure_reasons.items(), key=lambda kv: kv[1])[0]
        print(f"kvstore replay: no block could be put ({report.put_failures} refused; most often: {reason})",
              file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a Mooncake-format trace through a running daemon",
                       description="Replay a Mooncake-format JSONL trace (timestamp, input_length, "
                                   "output_length, hash_ids per 512-token block) through a daemon, "
                                   "in timestamp order, as fast as possible.")
    p.add_argument("trace", type=pathlib.Path, help="trace file, e.g. ../shared/data/traces/mooncake_conversation_trace.jsonl")
    p.add_argument("--target", type=address, action="append", default=None,
                   help="daemon address (default unix:kvstore-data/kvstore.sock); give it again for more "
                        "daemons of one cluster: requests go to them round robin")
    p.add_argument("--bytes-per-token", type=positive_int, default=16,
                   help="payload bytes per token (block payload = 512 x this); default 16")
    p.add_argument("--limit", type=non_negative_int, default=0,
                   help="replay only the first N requests (0: all)")
    p.add_argument("--json", type=non_empty_path, default=None,
                   help="write the report as JSON to this file (the folder must exist)")
    p.add_argument("--token", default="", help="bearer token, when the daemon requires one")
    p.add_argument("--timeout", type=at_most(positive_float, MAX_WAIT_S), default=60.0, help="per-call deadline, seconds (at most a day)")
    p.add_argument("--wait", type=at_most(non_negative_float, MAX_WAIT_S), default=10.0, help="how long to wait for the daemon to answer, seconds (at most a day)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_replay)
