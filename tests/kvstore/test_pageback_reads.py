"""A page-back from NVMe (a lease of blocks only on disk) reads several blocks at once
(:meth:`kvstore.store.moves.Moves.promote_ahead`, the mover's NVMe-to-host workers):
every byte served is right and verified, each block is read once even when the load is
larger than the arena, a corrupt block among them is refused and dropped alone, and a
read that fails on the medium is a miss for that block alone (kept, served afterwards).
"""

from __future__ import annotations

import hashlib
import pathlib
import threading

import pytest

from kvstore.policy import make_policy
from kvstore.store.manager import TierManager
from tiers.base import TierKind
from tiers.errors import MediaIOError
from tiers.host import HostTier
from tiers.nvme.format import DEFAULT_CHUNK_BYTES, block_path, header_bytes
from tiers.nvme.tier import NVMeTier

BLOCK = 64 << 10
N = 40                                  # 2.5 MiB: more than the 1 MiB arena
WAIT_S = 60.0


def K(i: int) -> bytes:
    return hashlib.sha256(b"pageback:%d" % i).digest()


def payload(k: bytes) -> bytes:
    return hashlib.shake_128(k).digest(BLOCK)


def open_manager(path: pathlib.Path) -> TierManager:
    tiers = [HostTier(1 << 20, name="host", shared=True), NVMeTier(path, 64 << 20, name="nvme", direct=False)]
    return TierManager(tiers, [make_policy("lru", t.capacity_bytes) for t in tiers], async_moves=True)


@pytest.fixture
def on_nvme(tmp_path):
    """A manager (host arena over NVMe, copies on queues as in the daemon) whose N blocks
    are on NVMe only: put, persisted, then the manager reopened over the same folder."""
    m = open_manager(tmp_path / "nvme")
    for i in range(N):
        m.put(K(i), payload(K(i)))
    m.persist()
    m.close()
    m = open_manager(tmp_path / "nvme")
    assert all(m.tier_of(K(i)) == TierKind.NVME for i in range(N))
    yield m
    m.close()


def lease_all(m: TierManager, keys: list[bytes], prefix: bool = True) -> dict[bytes, bytes | None]:
    """What a same-node client's ``get_into`` does: Lease, copy from the arena, release the
    previous lease with the next call; returns each key's bytes (None: a miss)."""
    host = m.tiers[0]
    got: dict[bytes, bytes | None] = {}
    start, previous = 0, ""
    while start < len(keys):
        grant = m.lease(keys[start:], 30.0, prefix=prefix)
        if previous:
            m.release(previous)
        for b in grant.blocks:
            got[b.key] = bytes(host.view(b.key)) if b.found else None
        previous = grant.lease_id
        if grant.resume_at is None:
            break
        start += grant.resume_at
    if previous:
        m.release(previous)
    return got


class InFlight:
    """The NVMe tier's ``read_into`` wrapped: counts reads in flight; the first read
    waits (up to a minute) until another one has started, so more than one in flight is
    seen whatever the machine's speed; ``fail`` keys raise MediaIOError (EIO)."""

    def __init__(self, tier: NVMeTier, monkeypatch, fail: set[bytes] = frozenset()):
        self.now = self.most = self.calls = 0
        self.fail = set(fail)
        self._lock = threading.Lock()
        self._second = threading.Event()
        real = tier.read_into

        def read_into(key, out, ranges=None):
            with self._lock:
                self.calls += 1
                self.now += 1
                self.most = max(self.most, self.now)
                first = self.calls == 1
                if self.calls == 2:
                    self._second.set()
            try:
                if first:
                    self._second.wait(WAIT_S)
                if key in self.fail:
                    raise MediaIOError("nvme: injected EIO")
                return real(key, out, ranges)
            finally:
                with self._lock:
                    self.now -= 1
        monkeypatch.setattr(tier, "read_into", read_into)


def test_a_page_back_reads_several_blocks_at_once_and_each_once(on_nvme, monkeypatch):
    m = on_nvme
    reads = InFlight(m.tiers[1], monkeypatch)
    keys = [K(i) for i in range(N)]
    got = lease_all(m, keys)
    assert got == {k: payload(k) for k in keys}
    assert reads.most >= 2                                  # several NVMe reads in flight
    assert reads.calls == N and m.counters["promotions"] == N   # each block read once, arena or not
    assert m.counters.get("corrupt_blocks") == 0 and m.counters.get("read_errors") == 0
    m.drain()
    assert m.catalogue.num_leases == 0 and all(e.pins == 0 for e in m.catalogue.entries())


def flip_a_payload_byte(m: TierManager, k: bytes) -> None:
    path = pathlib.Path(block_path(str(pathlib.Path(m.tiers[1].path) / "blocks"), k))
    with open(path, "r+b") as f:
        f.seek(header_bytes(BLOCK, DEFAULT_CHUNK_BYTES) + 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "every-key"])
def test_a_corrupt_block_among_them_is_refused_and_only_it(on_nvme, monkeypatch, prefix):
    m = on_nvme
    bad = K(5)
    flip_a_payload_byte(m, bad)
    reads = InFlight(m.tiers[1], monkeypatch)
    keys = [K(i) for i in range(N)]
    got = lease_all(m, keys, prefix=prefix)
    served = keys[:5] if prefix else [k for k in keys if k != bad]
    assert {k: v for k, v in got.items() if v is not None} == {k: payload(k) for k in served}
    assert bad in got and got[bad] is None                  # a miss, never wrong bytes
    assert reads.most >= 2
    assert m.counters["corrupt_blocks"] == 1 and m.counters.get("read_errors") == 0
    assert m.lookup([bad]).hit_blocks == 0 and bad not in m.tiers[1]   # dropped, file and all
    assert all(m.lookup([k]).hit_blocks == 1 for k in keys if k != bad)
    assert lease_all(m, [k for k in keys if k != bad], prefix=False) == \
        {k: payload(k) for k in keys if k != bad}


def test_a_failed_read_in_a_batch_is_a_miss_for_that_block_only(on_nvme, monkeypatch):
    """K(1) is in the first grant (4 blocks: a quarter of the arena), read with the others
    of that call: its failure is that call's miss, not retried in it."""
    m = on_nvme
    bad = K(1)
    reads = InFlight(m.tiers[1], monkeypatch, fail={bad})
    keys = [K(i) for i in range(N)]
    got = lease_all(m, keys, prefix=False)
    assert got[bad] is None
    assert {k: v for k, v in got.items() if k != bad} == {k: payload(k) for k in keys if k != bad}
    assert reads.most >= 2
    assert m.counters["read_errors"] == 1 and m.counters.get("corrupt_blocks") == 0
    assert reads.calls == N                                  # every block read once, the failed one too
    assert m.lookup([bad]).hit_blocks == 1 and bad in m.tiers[1]       # kept: EIO proves nothing
    reads.fail.clear()
    assert lease_all(m, [bad]) == {bad: payload(bad)}


def test_a_lease_listing_blocks_twice_pages_them_back_once_and_leaves_no_pin(on_nvme, monkeypatch):
    m = on_nvme
    reads = InFlight(m.tiers[1], monkeypatch)
    keys = [K(0), K(0), K(1), K(1)]                           # one grant: a quarter of the arena
    grant = m.lease(keys, 30.0)
    assert [b.found for b in grant.blocks] == [True] * len(keys) and grant.resume_at is None
    assert all(bytes(m.tiers[0].view(b.key)) == payload(b.key) for b in grant.blocks)
    assert reads.calls == 2 and m.counters["promotions"] == 2
    m.release(grant.lease_id)
    m.drain()
    assert all(e.pins == 0 for e in m.catalogue.entries())
