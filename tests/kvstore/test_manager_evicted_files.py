"""The store evicts from an NVMe tier without disk I/O under its lock (the file is parked
for the next write: tiers/nvme/parked.py), and a deleted block never comes back from a
parked file after a crash, whether the store still knew the block or not."""

import os

import pytest

from support.fake_tiers import MemTier

from kvstore.policy import make_policy
from kvstore.store.manager import TierManager
from tiers.base import TierKind
from tiers.nvme.tier import NVMeTier

BLOCK = 8 << 10


def K(i):
    return i.to_bytes(4, "big") * 8


def payload(i):
    return bytes([i % 251 + 1]) * BLOCK


@pytest.fixture
def store(tmp_path):
    made = []

    def make(host_blocks: int, write: str):
        tiers = [MemTier(TierKind.HOST, host_blocks * BLOCK), NVMeTier(tmp_path / "nvme", 64 * BLOCK, direct=False)]
        policies = [make_policy("lru", t.capacity_bytes) for t in tiers]
        m = TierManager(tiers, policies, write_policy=write, async_moves=True, watermarks=(1.0, 1.0))
        made.append(m)
        return m, tiers[1]
    yield make
    for m in made:
        m.close()


def crash_and_reopen(nvme: NVMeTier, path) -> NVMeTier:
    """The NVMe tier as a killed daemon leaves it (no close steps), opened again."""
    nvme._closed = True
    nvme._folder.close()
    return NVMeTier(path, 64 * BLOCK, direct=False)


def test_an_nvme_eviction_parks_the_file_and_the_next_write_reuses_it(store):
    m, nvme = store(host_blocks=1, write="write_through")
    m.put(K(1), payload(1))
    m.drain()
    inode = os.stat(nvme._file(K(1))).st_ino
    assert K(1) in nvme and m.demote(K(1), 1)            # out of NVMe; the host copy stays
    assert K(1) not in nvme and nvme.spare_bytes > 0     # parked: no disk I/O under the store's lock
    m.put(K(2), payload(2))                               # K(1) demoted from the host: into its own old file
    m.drain()
    assert K(1) in nvme and K(2) in nvme and nvme.spare_bytes == 0
    assert os.stat(nvme._file(K(1))).st_ino == inode
    assert bytes(m.get(K(1)).data) == payload(1) and bytes(m.get(K(2)).data) == payload(2)


def test_a_deleted_block_never_comes_back_from_a_parked_file(store, tmp_path):
    m, nvme = store(host_blocks=4, write="write_through")
    for i in (1, 2):
        m.put(K(i), payload(i))
    m.drain()
    assert m.demote(K(1), 1) and m.demote(K(2), 1)       # both parked; the host copies stay
    assert m.delete([K(1)]) == 1                          # K(2) only evicted, K(1) deleted
    again = crash_and_reopen(nvme, tmp_path / "nvme")
    try:
        assert K(1) not in again                          # deleted: gone for good
        assert K(2) in again                              # evicted: back whole after the crash
    finally:
        again.close()


def test_a_block_the_store_forgot_is_deleted_from_its_parked_file_too(store, tmp_path):
    m, nvme = store(host_blocks=1, write="write_back")
    m.put(K(1), payload(1))
    m.put(K(2), payload(2))                               # K(1) demoted: only NVMe holds it
    m.drain()
    assert K(1) in nvme and m.demote(K(1), 1)            # its last copy evicted: the store forgets it
    assert not m.get(K(1)).found
    assert m.delete([K(1)]) == 0                          # not stored, yet its parked file goes
    again = crash_and_reopen(nvme, tmp_path / "nvme")
    try:
        assert K(1) not in again
    finally:
        again.close()
