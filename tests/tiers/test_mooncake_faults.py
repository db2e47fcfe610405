"""Faults of the Mooncake cluster seen through the remote tier: a master killed, stalled
or down at start, and a peer killed. Each costs remote hits only: calls raise
MediaIOError within their deadline (plus a generous allowance for a loaded machine),
never hang, never return wrong bytes, and the tier recovers when the cluster does.

Without the tier's guard these calls block ~4.4 s (killed master), 30 s (stalled
master or peer) or ~90 s (setup against a master that is down): see docs/remote_tier.md.
"""

import threading
import time

import numpy as np
import pytest

from tiers.errors import BlockNotStored, MediaIOError
from tiers.mooncake.guard import RemoteState, RemoteUnavailable

pytestmark = pytest.mark.slow

ALLOWANCE_S = 2.5          # scheduling delay allowed beyond a deadline on a loaded 2-core machine
MIB = 1 << 20


def K(i):
    return i.to_bytes(4, "big") * 8


def block(i, n=MIB):
    return np.full(n, i % 251, np.uint8).tobytes()


def timed(fn, *args):
    t0 = time.monotonic()
    try:
        return fn(*args), time.monotonic() - t0
    except MediaIOError as exc:
        return exc, time.monotonic() - t0


def wait_until(pred, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def own_master(mooncake_master):          # mooncake_master: skips when Mooncake is absent
    from tiers.mooncake.local_cluster import LocalMaster

    master = LocalMaster(client_ttl_s=3).start()
    yield master
    master.stop()


def works(tier, i):
    """True when a put and a verified get of a fresh block both succeed now."""
    try:
        if tier.put_many([(K(i), block(i))]) != [True]:
            return False
        out = bytearray(MIB)
        return tier.get_many_into([K(i)], [out]) == [MIB] and bytes(out) == block(i)
    except MediaIOError:
        return False


def test_master_killed_mid_operation_then_restarted(own_master, make_tier):
    tier = make_tier(master=own_master, timeout_s=0.5, failure_threshold=3, cooldown_s=1.0)
    assert tier.put_many([(K(i), block(i)) for i in range(4)]) == [True] * 4
    deadline = tier.config.deadline_s(4 * MIB) + ALLOWANCE_S
    failures, wrong = [], []
    stop = threading.Event()

    def reader():
        outs = [bytearray(MIB) for _ in range(4)]
        while not stop.is_set():
            got, took = timed(tier.get_many_into, [K(i) for i in range(4)], outs)
            if isinstance(got, MediaIOError):
                failures.append((type(got).__name__, took))
            else:
                wrong.extend(i for i, n in enumerate(got) if n is not None and bytes(outs[i]) != block(i))

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.3)
    own_master.kill()
    assert wait_until(lambda: len(failures) >= 5)
    stop.set()
    t.join(60)
    assert not t.is_alive() and wrong == []
    assert all(took < deadline for _, took in failures), failures
    assert tier.health.state in (RemoteState.OPEN, RemoteState.HALF_OPEN)
    assert "RemoteUnavailable" in {name for name, _ in failures}      # the breaker refused calls
    with pytest.raises(MediaIOError):
        tier.exists_many([K(0)])

    own_master.start()                                                # a new, empty master
    assert wait_until(lambda: works(tier, 100)), tier.health
    assert tier.health.state is RemoteState.HEALTHY
    outs = [bytearray(MIB) for _ in range(4)]
    assert tier.get_many_into([K(i) for i in range(4)], outs) == [None] * 4   # lost with the master
    assert tier.exists_many([K(0)]) == [False] and K(0) not in tier


def test_master_stalled_then_resumed(own_master, make_tier):
    tier = make_tier(master=own_master, timeout_s=0.5, failure_threshold=2, cooldown_s=0.5)
    assert tier.put_many([(K(1), block(1))]) == [True]
    own_master.pause()
    try:
        for call in (lambda: tier.exists_many([K(1)]), lambda: tier.read_into(K(1), bytearray(MIB)),
                     lambda: tier.put_many([(K(2), block(2))])):
            got, took = timed(call)
            assert isinstance(got, MediaIOError), got
            assert took < tier.config.deadline_s(MIB) + ALLOWANCE_S
    finally:
        own_master.resume()
    out = bytearray(MIB)

    def read_back():
        try:
            return tier.read_into(K(1), out) == MIB
        except MediaIOError:
            return False

    assert wait_until(read_back)                                      # same master: the block survived
    assert bytes(out) == block(1)


def test_master_down_at_start_connects_later(make_tier, mooncake_master):
    from tiers.mooncake.local_cluster import LocalMaster

    master = LocalMaster(client_ttl_s=3)                              # ports chosen, not started
    try:
        t0 = time.monotonic()
        tier = make_tier(master=master, wait=False)
        assert time.monotonic() - t0 < 30                             # the constructor does not wait
        assert tier.health.state is RemoteState.CONNECTING
        for call in (lambda: tier.exists_many([K(1)]), lambda: tier.reserve(K(1), 10),
                     lambda: tier.get_many_into([K(1)], [bytearray(10)])):
            with pytest.raises(RemoteUnavailable, match="not connected"):
                call()
        assert tier.fits(10)                                          # room is not what is missing
        master.start()
        assert tier.wait_connected(60), tier.health
        assert works(tier, 1)
    finally:
        master.stop()


def test_peer_killed_costs_only_remote_hits(own_master, make_tier):
    from tiers.mooncake.local_cluster import LocalSegment

    peer = LocalSegment(own_master, 64 * MIB).start()
    try:
        client = make_tier(master=own_master, segment_bytes=0)        # holds nothing itself
        assert client.put_many([(K(i), block(i)) for i in range(3)]) == [True] * 3   # all on the peer
        peer.pause()                                                  # a peer that stops answering
        got, took = timed(client.read_into, K(0), bytearray(MIB))
        assert isinstance(got, MediaIOError) and took < client.config.deadline_s(MIB) + ALLOWANCE_S
        peer.kill()
        outs = [bytearray(MIB) for _ in range(3)]
        got, took = timed(client.get_many_into, [K(i) for i in range(3)], outs)
        assert took < client.config.deadline_s(3 * MIB) + ALLOWANCE_S
        assert isinstance(got, MediaIOError) or got == [None] * 3      # misses, never bytes
        # The master drops the dead peer's segment after its client TTL (3 s): plain misses.
        assert wait_until(lambda: client.exists_many([K(0)]) == [False])
        with pytest.raises(BlockNotStored):
            client.read_into(K(1), bytearray(MIB))
        assert client.health.state is RemoteState.HEALTHY             # a peer is not the master
        make_tier(master=own_master)                                  # a new node brings a segment
        assert wait_until(lambda: works(client, 9))
    finally:
        peer.kill()
