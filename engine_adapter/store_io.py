"""Every block data-path call of the engine plugins (vLLM connector, SGLang backend), and the
start-up check of the node's block size that every plug-in makes (:func:`check_block_tokens`).

One place on purpose: the plugins never call the client's data methods themselves. The
data moves with the batch-first ``get_into(keys, out)`` / ``put_from(keys, src)``: one
copy straight between the caller's buffer and the daemon's shared arena on the same node,
raw gRPC frames otherwise.

Buffers are *row per block*: ``out`` / ``src`` are host (CPU) numpy arrays or torch
tensors, C-contiguous, whose first axis has one row per key; row ``i`` holds block
``i``'s payload (or, with ``ranges``, the requested byte ranges of block ``i``,
concatenated). Any element dtype; sizes are checked in bytes.

Errors: the :mod:`kvstore.common.errors` exceptions of the client (``StoreUnavailable`` when the
daemon cannot be reached or does not answer in time, ``InvalidRequest``, ``TierFull``)
propagate; a miss is a normal result (``False`` in the returned mask, or a shorter hit).

An engine step's load is one call, :func:`load_stages`: every block read from the daemon's
block table or leased, once, and copied
stage by stage (a stage: one layer's K and V of the rank's heads) as each is due, not one
``get_into`` per layer (:mod:`kvstore.client.leased_read`).

The plug-ins call these functions with a :class:`GuardedStore`: the client behind the
circuit breaker of :mod:`engine_adapter.breaker`, so a store that failed is not called
again (``StoreSkipped``, a ``StoreUnavailable``, at once) until it answers a probe, and an
outage is logged once with one summary at its end. A plug-in treats any
``StoreUnavailable`` as a miss, a recompute or a dropped save, and logs nothing itself.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvstore.client.buffers import BlockBuffers
from kvstore.client.client import GetIntoResult, KVStoreClient
from kvstore.client.leased_read import Publish, ReadStage
from kvstore.common.errors import InvalidRequest, KVStoreError, StoreUnavailable
from kvstore.common.host_copy import copy
from kvstore.common.types import BlockMeta, LookupResult, PutResult

from engine_adapter.breaker import LOAD, LOOKUP, SAVE, BreakerSettings, StoreBreaker, StoreSkipped

log = logging.getLogger("engine_adapter.store_io")


@dataclass(frozen=True)
class StagesLoaded:
    """Outcome of :func:`load_stages`: ``calls``, the store round trips it made (Lease,
    Release between parts, gRPC Get; or ``get_into`` calls); ``bytes_copied`` into the stages."""

    calls: int
    bytes_copied: int


@dataclass(frozen=True)
class SaveResult:
    """Outcome of :func:`save_blocks` (block counts)."""

    stored: int
    already_present: int
    not_admitted: int


class GuardedStore:
    """A store client behind a :class:`~engine_adapter.breaker.StoreBreaker`: what the
    engine plug-ins call for lookups, loads and saves.

    Args:
        store: the client (:class:`KVStoreClient`, or any object with its ``lookup``,
            ``get_into``, ``put_from``, ``check_block_tokens`` and ``ping``).
        settings: the breaker's back-off.
        name: the store in log lines (default ``"kvstore at <target>"``).

    ``lookup``, ``get_into`` and ``put_from`` take the client's arguments and return its
    results; while the breaker is open they raise
    :class:`~engine_adapter.breaker.StoreSkipped` at once (no call is made), and a call that
    raises StoreUnavailable opens it. Other errors (InvalidRequest, TierFull, ...) pass
    through and leave it closed. The happy path adds one attribute read per call.
    """

    def __init__(self, store, settings: BreakerSettings = BreakerSettings(), name: str | None = None):
        self.store = store
        target = getattr(store, "target", "")
        name = name or (f"kvstore at {target}" if target else "kvstore")
        self.breaker = StoreBreaker(store.ping, settings, name=name)

    def _call(self, kind: str, blocks: int, method, *args, **kwargs):
        breaker = self.breaker
        if not breaker.allow():
            breaker.skipped(kind, blocks)
            raise StoreSkipped(f"{breaker.name} is not called: it failed and has not answered a probe since")
        try:
            result = method(*args, **kwargs)
        except StoreUnavailable as e:
            breaker.failed(kind, blocks, e)
            raise
        breaker.succeeded()
        return result

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> LookupResult:
        """:meth:`KVStoreClient.lookup` behind the breaker."""
        return self._call(LOOKUP, len(keys), self.store.lookup, keys, timeout=timeout)

    def get_into(self, keys: Sequence[bytes], out, **kwargs) -> GetIntoResult:
        """:meth:`KVStoreClient.get_into` behind the breaker."""
        return self._call(LOAD, len(keys), self.store.get_into, keys, out, **kwargs)

    def load_stages(self, keys: Sequence[bytes], stages: Sequence[ReadStage], timeout_s: float | None,
                    publish: Publish | None, cancelled: Callable[[], bool] | None,
                    write_lock=None) -> StagesLoaded:
        """:func:`load_stages` of the store behind the breaker (one breaker call for the whole read)."""
        return self._call(LOAD, len(keys), _load_stages, self.store, keys, stages, timeout_s, publish, cancelled,
                          write_lock)

    def put_from(self, keys: Sequence[bytes], src, **kwargs) -> PutResult:
        """:meth:`KVStoreClient.put_from` behind the breaker."""
        return self._call(SAVE, len(keys), self.store.put_from, keys, src, **kwargs)

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """:meth:`KVStoreClient.delete` (not behind the breaker: not on the engine's path)."""
        return self.store.delete(keys, timeout=timeout)

    def check_block_tokens(self, block_tokens: int) -> None:
        """:meth:`KVStoreClient.check_block_tokens` (at start-up; not behind the breaker)."""
        self.store.check_block_tokens(block_tokens)

    def ping(self, timeout: float = 1.0):
        """:meth:`KVStoreClient.ping` (the breaker's probe)."""
        return self.store.ping(timeout)

    def close(self) -> None:
        """Stop the breaker's probe. The store is the caller's to close."""
        self.breaker.close()


def connect(target: str, *, timeout_s: float = 10.0, auth_token: str = "") -> KVStoreClient:
    """A client of the daemon at ``target`` (e.g. ``"unix:/run/kvstore.sock"``).

    Connecting is lazy: an unreachable daemon shows up as ``StoreUnavailable`` on the
    first call, not here.
    """
    return KVStoreClient(target, timeout=timeout_s, auth_token=auth_token)


def check_block_tokens(client, block_tokens: int, engine: str) -> bool:
    """Refuse to serve an engine whose block size is not the node's ``[blocks] block_tokens``.

    Called once at start by every plug-in (vLLM's ``block_size``, SGLang's page size, the
    reference runner's ``block_tokens``). A node that publishes no block size accepts any.

    Args:
        client: the daemon's client (its ``check_block_tokens``: one cached Info call).
        block_tokens: the engine's tokens per block.
        engine: the engine's name in the error, e.g. ``"vLLM block_size"``.
    Returns:
        True when checked; False when the daemon could not be asked (logged as a warning:
        the engine starts, and recomputes every prefix until the daemon answers).
    Raises:
        ValueError: the node is configured for another block size (its message names both).
    """
    try:
        client.check_block_tokens(block_tokens)
    except InvalidRequest as e:
        raise ValueError(f"{engine} {block_tokens} does not match the kvstore daemon ({e}): serve with a "
                         f"block size equal to the daemon's [blocks] block_tokens, or change that") from None
    except KVStoreError as e:
        log.warning("cannot check the kvstore daemon's block size against %s %d (%s); going on", engine,
                    block_tokens, e)
        return False
    return True


def _byte_rows(buf, n: int, *, writable: bool) -> np.ndarray:
    """``(n, row_bytes)`` uint8 numpy view of the first ``n`` rows of ``buf`` (no copy)."""
    if hasattr(buf, "detach"):                          # a torch tensor
        if buf.device.type != "cpu":
            raise ValueError(f"block buffers must be host (CPU) memory, got a {buf.device} tensor")
        if not buf.is_contiguous():
            raise ValueError("block buffers must be contiguous")
        import torch
        arr = buf.detach().reshape(buf.shape[0] if buf.dim() else 1, -1).view(torch.uint8).numpy()
    else:
        arr = np.asarray(buf)
        if not arr.flags["C_CONTIGUOUS"]:
            raise ValueError("block buffers must be C-contiguous")
        arr = arr.reshape(arr.shape[0] if arr.ndim else 1, -1).view(np.uint8)
    if arr.shape[0] < n:
        raise ValueError(f"buffer has {arr.shape[0]} rows for {n} blocks")
    if writable and not arr.flags["WRITEABLE"]:
        raise ValueError("the destination buffer is read-only")
    return arr[:n]


def lookup_prefix(client: KVStoreClient | GuardedStore, keys: Sequence[bytes], timeout_s: float | None = None) -> int:
    """How many leading ``keys`` are stored (the daemon's Lookup; prefix semantics).

    Returns an int in ``[0, len(keys)]``; 0 for no keys (no call is made).
    """
    if not keys:
        return 0
    return client.lookup(list(keys), timeout=timeout_s).hit_blocks


def load_blocks(client: KVStoreClient | GuardedStore, keys: Sequence[bytes], out, *,
                ranges: Sequence[tuple[int, int]] | None = None,
                timeout_s: float | None = None) -> list[bool]:
    """Copy the stored blocks ``keys`` into the rows of ``out``.

    Args:
        keys: 32-byte block keys, one per row of ``out``.
        out: host buffer of at least ``len(keys)`` rows, each exactly the size of one
            block's payload (or of ``ranges`` summed).
        ranges: ``(offset, length)`` byte ranges of each block to fetch, concatenated
            per row (e.g. one TP rank's KV heads of one layer); ``None`` for whole blocks.
    Returns:
        One flag per key: ``True`` when row ``i`` now holds block ``i``'s bytes, ``False``
        for a miss or a reply of the wrong size (that row's bytes are then unspecified).
    Raises:
        ValueError: ``out`` is not a host, contiguous, writable buffer with enough rows.
        kvstore.common.errors.KVStoreError: the store failed (e.g. ``StoreUnavailable``).

    One batch call (:meth:`KVStoreClient.get_into`: through the shared arena on the
    same node, else raw gRPC frames); a block too short for ``ranges`` is a miss.
    """
    if not keys:
        return []
    rows = _byte_rows(out, len(keys), writable=True)
    res = client.get_into(list(keys), rows, ranges=list(ranges) if ranges else None, stop_at_miss=False,
                          timeout=timeout_s)
    return [size == rows.shape[1] for size in res.sizes]


def offers_leased_read(client) -> bool:
    """Whether ``client`` (or the store behind a :class:`GuardedStore`) reads with leases
    (:meth:`KVStoreClient.leased_read`): :func:`load_stages` then leases each block once."""
    store = client.store if isinstance(client, GuardedStore) else client
    return hasattr(store, "leased_read")


def load_stages(client: KVStoreClient | GuardedStore, keys: Sequence[bytes], stages: Sequence[ReadStage], *,
                timeout_s: float | None = None, publish: Publish | None = None,
                cancelled: Callable[[], bool] | None = None, write_lock=None) -> StagesLoaded:
    """Copy each stage's byte ranges of the blocks ``keys`` into its buffer: an engine step's load.

    Args:
        keys: 32-byte block keys.
        stages: :class:`~kvstore.client.leased_read.ReadStage` s (``ranges`` of each block,
            concatenated into its slot of ``out``; e.g. one per layer with
            :meth:`engine_adapter.layout.BlockLayout.layer_ranges`), in the order they are due.
        publish: ``publish(stage, sizes)``, once per stage in order, when that stage of every
            block is in place; ``sizes[i]`` is the stage's bytes, or 0 for a miss (not found,
            too short, not the bytes asked for). Called from this thread.
        cancelled: asked between store calls and stages; when true the load stops and the
            stages not published are never published.
        write_lock: a ``threading.Lock`` held around every write into the stages' buffers,
            each made only after ``cancelled()`` was asked under it: make ``cancelled()``
            true, then take the lock and let go, and no byte lands in the buffers afterwards
            (buffers that are an engine's own KV cache can be given back at once, even with
            a store call out).
    Returns the round trips made and the bytes copied.
    Raises:
        kvstore.common.errors.KVStoreError: the store failed (``StoreUnavailable``,
            ``StoreSkipped`` while the breaker is open); stages published before stay valid.

    A client that leases (:func:`offers_leased_read`) leases every block once
    (:class:`kvstore.client.leased_read.LeasedRead`: one round trip, or one per part of a
    load larger than one lease may hold), whatever the number of stages; another store
    (anything with ``get_into``) is asked once for every stage's ranges.
    """
    if isinstance(client, GuardedStore):
        return client.load_stages(keys, stages, timeout_s, publish, cancelled, write_lock)
    return _load_stages(client, keys, stages, timeout_s, publish, cancelled, write_lock)


def _load_stages(store, keys, stages, timeout_s, publish, cancelled, write_lock=None) -> StagesLoaded:
    keys = list(keys)
    publish = publish or (lambda stage, sizes: None)
    cancelled = cancelled or (lambda: False)
    if hasattr(store, "leased_read"):
        read = store.leased_read(keys, stages, timeout=timeout_s)
        read.run(publish, cancelled, write_lock=write_lock)
        return StagesLoaded(read.calls, read.bytes_copied)
    n = len(keys)                          # one get_into of every stage's ranges, then split
    ranges = [r for stage in stages for r in stage.ranges]
    wants = [sum(m for _, m in stage.ranges) for stage in stages]
    scratch = np.empty((n, sum(wants)), dtype=np.uint8)
    if cancelled():
        return StagesLoaded(0, 0)
    got = store.get_into(keys, scratch, ranges=ranges, stop_at_miss=False, timeout=timeout_s).sizes if n else []
    copied, pos = 0, 0
    lock = write_lock if write_lock is not None else contextlib.nullcontext()
    for s, (stage, want) in enumerate(zip(stages, wants)):
        bufs = BlockBuffers(stage.out, n, writable=True, offsets=stage.offsets)
        sizes = [0] * n
        with lock:
            if cancelled():
                break
            for i in range(n):
                if got[i] == scratch.shape[1]:
                    copy(bufs.slot(i, want), scratch[i, pos:pos + want])
                    sizes[i] = want
                    copied += want
            bufs.finish()
        pos += want
        publish(s, sizes)
    return StagesLoaded(1 if n else 0, copied)


def save_blocks(client: KVStoreClient | GuardedStore, keys: Sequence[bytes], src, *,
                meta: Sequence[BlockMeta | None] | None = None, timeout_s: float | None = None) -> SaveResult:
    """Store the rows of ``src`` as the blocks ``keys`` (whole payloads; idempotent).

    Args:
        keys: 32-byte block keys, one per row.
        src: host buffer of at least ``len(keys)`` rows; row ``i`` is block ``i``'s
            complete payload. The bytes are copied before this returns.
        meta: per block, what routers index it by (the engine's block hash, its parent's
            hash, its token ids), published with the daemon's KV events; None: the
            events name the blocks by their store keys.
    Returns:
        Counts of blocks stored now, already stored, and refused by admission.
    Raises:
        ValueError: ``src`` is not a host, contiguous buffer with enough rows.
        kvstore.common.errors.KVStoreError: the store failed (``TierFull``, ``StoreUnavailable``;
            ``InvalidRequest`` for a ``meta`` list of another length than ``keys``).
    """
    if not keys:
        return SaveResult(0, 0, 0)
    rows = _byte_rows(src, len(keys), writable=False)
    reply = client.put_from([bytes(k) for k in keys], rows, meta=meta, timeout=timeout_s)
    return SaveResult(reply.stored, reply.already_present, reply.not_admitted)
