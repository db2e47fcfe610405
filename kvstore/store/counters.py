"""The daemon's counters, declared once: every name, its unit and what it counts.

``Stats`` returns them (``StatsReply.counters``), the README lists them, and
:class:`Counters` refuses a name that is not declared here, so a counter cannot be
misspelt into existence. Names with ``{tier}`` exist once per configured tier (its
name: ``hbm``, ``host``, ``nvme``, ``remote``).

Units: *blocks* count whole blocks, *reads* count blocks served (a ranged read of part
of a block, e.g. one TP rank's KV heads, is one read; a large block streamed in several
pieces too), *bytes* count payload bytes, everything else counts calls or events as
named. ``used_bytes`` of a tier (Stats ``TierStats``) is its allocation, rounded up to
the allocator's units; ``payload_bytes`` the payload of the blocks it holds.
"""

from __future__ import annotations

import re
import threading
from typing import Iterator

COUNTERS: dict[str, str] = {
    # lookups and reads
    "lookups": "Lookup calls",
    "lookup_blocks": "blocks asked for by Lookup calls",
    "lookup_hit_blocks": "blocks found by Lookup calls (longest stored prefix)",
    "reads": "blocks served by Get: one per block per call, whole or byte ranges, in any number of pieces",
    "read_bytes": "payload bytes served by reads",
    "reads_{tier}": "blocks served from this tier (the tier of the block's first piece)",
    "read_bytes_{tier}": "payload bytes read from this tier to serve reads",
    "get_misses": "blocks asked for by reads that were not stored",
    # puts
    "blocks_put": "blocks stored by puts",
    "bytes_put": "payload bytes stored by puts",
    "puts_already_present": "blocks put again with the same size (no-op)",
    "puts_size_conflict": "blocks refused: the key is stored with another size",
    "puts_not_admitted": "blocks no tier's admission policy wanted (not stored)",
    "puts_rejected_full": "blocks refused: no tier could make room",
    "puts_too_large": "blocks refused: larger than the largest block any tier can hold",
    "puts_aborted": "puts abandoned before their last byte (stream ended, client gone)",
    "reservations_expired": "zero-copy reservations reclaimed after their TTL",
    "reservations_reclaimed": "zero-copy reservations aborted because their client's session ended",
    # movement between tiers
    "evictions_{tier}": "blocks removed from this tier to make room",
    "stored_bytes_{tier}": "payload bytes written into this tier (puts, demotions, promotions)",
    "demotions": "blocks copied to the next tier to make room",
    "demotions_failed": "demotions that failed (the block stayed or was dropped)",
    "precleaned": "blocks copied to the next tier ahead of need (background, write-back)",
    "promotions": "blocks copied to a faster tier (after a read, or by prefetch)",
    "promotions_deduplicated": "promotion requests for a block already moving there",
    "promotions_skipped": "promotions given up (no room without evicting pinned blocks)",
    "blocks_dropped": "blocks deleted from the store by eviction from the last tier",
    "write_through_copies": "copies made to lower tiers by write-through",
    "write_through_failed": "write-through copies that failed",
    "transfers_failed": "tier-to-tier copies that failed",
    "transfers_timed_out": "tier-to-tier copies abandoned after the transfer timeout",
    # integrity and life cycle
    "corrupt_blocks": "stored copies that failed their checksum (dropped, never served)",
    "read_errors": "reads of a block's copy that failed on its medium (EMFILE, EIO, a timeout; once per block, call and tier): another copy or a miss, the copy is kept",
    "copies_missing": "stored copies their tier no longer held when read (dropped from the catalogue)",
    "blocks_deleted": "blocks deleted by Delete calls",
    "blocks_recovered": "blocks found on persistent tiers at start",
    "blocks_persisted": "blocks copied from memory to NVMe on a graceful stop",
    # leases
    "leases_granted": "leases granted",
    "leased_blocks": "blocks pinned by leases (clients read them in place)",
    "leased_bytes": "payload bytes of the blocks pinned by leases",
    "leases_expired": "leases that ended by their TTL (not released)",
    "leases_reclaimed": "leases released because their client's session ended (its process is gone)",
    "leases_refused": "Lease calls that granted nothing: MAX_LEASES leases were alive",
    "table_read_blocks": "blocks same-node clients read from the shared block table (no lease)",
    # KV events for routers
    "events_published": "KV events sent to subscribers ([events])",
    "events_dropped": "KV events dropped because the publisher's queue was full (a snapshot replaces them)",
    "events_snapshots": "snapshots of every block held sent to subscribers (start, joins, overflows, replay gaps)",
    # streaming calls (Get, GetRaw, Put, PutRaw)
    "streams_timed_out": "streaming calls ended for running longer than [server] stream_timeout_s",
    "streams_idle_cancelled": "streaming calls cancelled: the client sent or read nothing for stream_idle_timeout_s",
    # the cluster (a remote tier, kvstore/cluster/cluster.py)
    "remote_lookups": "Lookups that asked the cluster about blocks not held here (one call each)",
    "remote_lookup_hit_blocks": "blocks Lookup found in the cluster only",
    "remote_lookup_failures": "cluster existence checks that failed or passed their deadline (misses)",
    "remote_pulled_blocks": "blocks paged in from the cluster into the host arena",
    "remote_pulled_bytes": "payload bytes paged in from the cluster",
    "remote_pull_misses": "blocks the cluster listed that were not paged in (gone, corrupt, peer down, no room)",
    "remote_pull_failures": "page-in calls that failed as a whole (cluster unreachable or too slow)",
    "remote_published": "blocks copied to the cluster in the background (publish = \"all\")",
    "remote_publish_failed": "background copies to the cluster that failed or were skipped",
    # the remote tier's own call counters (Stats only, from tiers.mooncake.guard)
    "remote_calls": "calls into the cluster client library",
    "remote_call_failures": "of which failed (deadline passed, error, cluster unreachable)",
    "remote_call_timeouts": "of which were abandoned at their deadline",
    "remote_calls_refused": "calls refused at once while the cluster was unreachable (circuit open)",
    "remote_corrupt_copies": "cluster copies that failed verification (a miss, dropped from the cluster)",
    "remote_peer_errors": "reads a peer did not serve (a miss)",
}

EVENTS = {"lookups", "puts_aborted", "reservations_expired", "reservations_reclaimed", "leases_reclaimed", "demotions_failed", "promotions_deduplicated",
          "promotions_skipped", "write_through_failed", "transfers_failed", "transfers_timed_out", "read_errors",
          "leases_granted", "leases_expired", "leases_refused", "events_published", "events_dropped",
          "events_snapshots", "streams_timed_out", "streams_idle_cancelled",
          "remote_lookups", "remote_lookup_failures", "remote_pull_failures", "remote_calls",
          "remote_call_failures", "remote_call_timeouts", "remote_calls_refused", "remote_peer_errors"}


def unit_of(name: str) -> str:
    """The unit of a declared counter: ``bytes``, ``blocks`` (``reads``: blocks served) or
    ``events`` (calls, failures, leases)."""
    decl = declared(name) or name
    if "bytes" in decl:
        return "bytes"
    if decl in EVENTS:
        return "events"
    return "blocks served" if decl.startswith("reads") else "blocks"


_PATTERNS = [(re.compile("^" + re.escape(name).replace(re.escape("{tier}"), "[a-z0-9_]+") + "$"), name)
             for name in COUNTERS if "{tier}" in name]


def declared(name: str) -> str | None:
    """The declaration ``name`` matches (itself, or a ``{tier}`` pattern), else None."""
    if name in COUNTERS:
        return name
    for pattern, decl in _PATTERNS:
        if pattern.match(name):
            return decl
    return None


class Counters:
    """Monotonic counters restricted to :data:`COUNTERS`.

    Increments are cheap and lock-free: each thread adds into its own dict (registered
    once), and a read sums the threads' dicts. A counter name is checked against the
    declarations on its first use; an undeclared name raises KeyError.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._shards: list[dict[str, int]] = []
        self._lock = threading.Lock()
        self._known: dict[str, bool] = {}

    def _shard(self) -> dict[str, int]:
        shard = self._local.__dict__.get("d")
        if shard is None:
            shard = self._local.d = {}
            with self._lock:
                self._shards.append(shard)
        return shard

    def inc(self, name: str, n: int = 1) -> None:
        if name not in self._known:
            if declared(name) is None:
                raise KeyError(f"counter {name!r} is not declared in kvstore/store/counters.py")
            self._known[name] = True
        shard = self._local.__dict__.get("d") or self._shard()
        shard[name] = shard.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            shards = list(self._shards)
        total: dict[str, int] = {}
        for shard in shards:
            for name, v in list(shard.items()):
                total[name] = total.get(name, 0) + v
        return total

    def __getitem__(self, name: str) -> int:
        return self.snapshot().get(name, 0)

    def get(self, name: str, default: int = 0) -> int:
        return self.snapshot().get(name, default)

    def items(self) -> Iterator[tuple[str, int]]:
        return iter(self.snapshot().items())

    def keys(self) -> list[str]:
        return list(self.snapshot())
