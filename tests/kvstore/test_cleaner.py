"""Background cleaning at watermarks: demotions run off the put path, so a put into a full
host tier frees a clean block instead of waiting for its victim's NVMe write."""

from __future__ import annotations

import threading
import time

from support.fake_tiers import MemTier

from kvstore.store.manager import TierManager
from kvstore.policy import make_policy
from tiers.base import TierKind

BLOCK = 100
DEADLINE = 30.0


def K(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def payload(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def make(host_blocks: int = 10, nvme_blocks: int = 100, watermarks=(0.5, 0.8)):
    host = MemTier(TierKind.HOST, host_blocks * BLOCK)
    nvme = MemTier(TierKind.NVME, nvme_blocks * BLOCK)
    nvme.gate_timeout = 60.0
    m = TierManager([host, nvme], [make_policy("lru", t.capacity_bytes) for t in (host, nvme)],
                    async_moves=True, watermarks=watermarks)
    return m, host, nvme


def test_cleaner_copies_the_coldest_blocks_down_past_the_high_watermark():
    m, host, nvme = make(host_blocks=100, nvme_blocks=200)
    try:
        for i in range(90):                                 # 90% > high watermark 80%
            m.put(K(i), payload(i))
        # free (10%) + clean must reach 1 - low = 50%: the 40 coldest blocks get a lower copy
        wait_for(lambda: m.counters["precleaned"] >= 40, "pre-cleaning")
        m.drain(DEADLINE)
        assert set(nvme.data) == {K(i) for i in range(40)}
        assert all(m.tier_of(K(i)) == TierKind.HOST for i in range(90))   # still served from host
        assert m.placement.dirty_bytes(0) == 50 * BLOCK
    finally:
        m.close()


def test_a_tier_of_a_few_blocks_keeps_blocks_clean_ahead_of_puts():
    """Above a disk, the cleaner keeps ``ahead_blocks`` blocks free or clean whatever the
    watermarks (which are less than a block apart in a tier of a few blocks), starting
    below the high watermark, and picks up blocks put while its pass runs."""
    m, host, nvme = make(host_blocks=10, nvme_blocks=100, watermarks=(0.95, 0.99))
    assert m.room.ahead_blocks == 8
    try:
        nvme.write_gate = threading.Event()                 # the first copies hang
        for i in range(3):                                  # 30%: far below the high watermark
            m.put(K(i), payload(i))
        wait_for(lambda: nvme.waiting_writes == 3, "copies to start below the high watermark")
        for i in range(3, 6):                               # put while the pass waits on the disk
            m.put(K(i), payload(i))
        wait_for(lambda: nvme.waiting_writes == 4, "the pass to pick up a new block (4 copies: its width)")
        nvme.write_gate.set()
        # free (4 blocks) + clean must reach 8 blocks: the 4 coldest (and, as copies in
        # flight count as dirty, perhaps a few more)
        wait_for(lambda: m.counters["precleaned"] >= 4, "pre-cleaning")
        m.drain(DEADLINE)
        assert {K(i) for i in range(4)} <= set(nvme.data)
        for i in range(6, 10):                              # every put keeps 8 blocks free or clean
            m.put(K(i), payload(i))
            wait_for(lambda: m.counters["precleaned"] >= i - 1, "pre-cleaning")
        m.drain(DEADLINE)
        assert m.placement.dirty_bytes(0) <= 2 * BLOCK
        assert m.counters["demotions"] == 0                 # no put waited for a demotion
    finally:
        nvme.write_gate.set()
        m.close()


def test_put_into_a_full_host_tier_does_not_wait_for_the_disk():
    m, host, nvme = make()
    try:
        for i in range(10):                                 # fill the host tier
            m.put(K(i), payload(i))
        wait_for(lambda: m.counters["precleaned"] >= 5, "pre-cleaning of the full tier")
        m.drain(DEADLINE)
        nvme.write_gate = threading.Event()                 # from now on every NVMe write hangs
        done = threading.Event()
        t = threading.Thread(target=lambda: (m.put(K(10), payload(10)), done.set()), daemon=True)
        t.start()
        # It returns well before the hung write would (60 s): it evicted a clean block.
        assert done.wait(DEADLINE), "the put waited for an NVMe write"
        assert m.tier_of(K(10)) == TierKind.HOST and m.tier_of(K(0)) == TierKind.NVME
        assert bytes(m.get(K(0)).data) == payload(0)        # the evicted block is on NVMe, intact
        assert m.counters["demotions"] == 0                 # no demotion was on the put path
    finally:
        if nvme.write_gate is not None:
            nvme.write_gate.set()
        m.close()


def test_without_a_clean_block_a_put_waits_for_the_demotion_then_succeeds():
    m, host, nvme = make(watermarks=(1.0, 1.0))             # no background cleaning
    try:
        for i in range(10):
            m.put(K(i), payload(i))
        nvme.write_gate = threading.Event()
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("stored", m.put(K(10), payload(10))), daemon=True)
        t.start()
        wait_for(lambda: nvme.waiting_writes == 1, "the put's demotion to reach the disk")
        assert "stored" not in box                          # back-pressure: the put waits
        nvme.write_gate.set()
        t.join(DEADLINE)
        assert box.get("stored") is True and m.tier_of(K(0)) == TierKind.NVME
    finally:
        if nvme.write_gate is not None:
            nvme.write_gate.set()
        m.close()


def test_cleaner_does_not_rescan_a_clean_front_for_every_block(monkeypatch):
    """Once the policy's coldest blocks are all clean, each further block is found in the
    list of dirty blocks, not by the policy looking past every clean block again."""
    import kvstore.store.room as placement_mod
    monkeypatch.setattr(placement_mod, "CLEAN_SCAN", 16)
    m, host, nvme = make(host_blocks=3000, nvme_blocks=4000)
    looked = [0]
    policy = m.placement.policies[0]
    victim = policy.victim

    def counting_victim(evictable, incoming=None, now=0.0):
        def counted(key):
            looked[0] += 1
            return evictable(key)
        return victim(counted, incoming, now)
    monkeypatch.setattr(policy, "victim", counting_victim)
    try:
        for i in range(2700):                      # 90% > 80%: free 10% + clean must reach 50%
            m.put(K(i), payload(i))
        wait_for(lambda: m.counters["precleaned"] >= 1200, "the first cleaning")
        m.drain(DEADLINE)
        looked[0] = 0
        for i in range(2700, 2850):                # 150 more: 150 more blocks to clean
            m.put(K(i), payload(i))
        wait_for(lambda: m.counters["precleaned"] >= 1350, "the second cleaning")
        m.drain(DEADLINE)
        # still least recently used first; the copies in flight when the goal was met
        # (at most the disk's width less one) end too
        width = m.mover.disk_workers
        cleaned = len(nvme.data)
        assert 1350 <= cleaned < 1350 + width
        assert set(nvme.data) == {K(i) for i in range(cleaned)}
        assert m.placement.dirty_bytes(0) == (2850 - cleaned) * BLOCK
        # 150 blocks, each: at most 17 looks by the policy (past 1200+ clean ones before)
        assert looked[0] <= 150 * 17 + 100
    finally:
        m.close()


def test_one_slow_write_does_not_hold_up_the_other_copies():
    """The cleaner replaces each copy as it ends, not in the order they began: while the
    coldest block's NVMe write hangs, the blocks behind it are still cleaned."""
    m, host, nvme = make(host_blocks=20, nvme_blocks=100)
    hung = threading.Event()
    release = threading.Event()
    write = nvme.write

    def slow_first(key, offset, data):
        if key == K(0):
            hung.set()
            assert release.wait(60), "the test never let the hung write go"
        write(key, offset, data)
    nvme.write = slow_first
    try:
        for i in range(18):                        # 90% > 80%: free 10% + clean must reach 50%
            m.put(K(i), payload(i))
        assert hung.wait(DEADLINE), "the coldest block was never demoted"
        # the 8 blocks the goal needs are cleaned while the first write still hangs
        wait_for(lambda: m.counters["precleaned"] >= 8, "cleaning past the hung write")
        assert K(0) not in nvme.data
        release.set()
        m.drain(DEADLINE)
        assert K(0) in nvme.data and m.tier_of(K(0)) == TierKind.HOST
        assert {K(i) for i in range(9)} <= set(nvme.data)
    finally:
        release.set()
        m.close()
