"""Parts of the remote tier that need no cluster: the block object format, the staging
buffer, and the deadline + circuit breaker guard."""

import threading
import time

import pytest

from tiers.errors import BlockCorrupt, InvalidAccess, MediaIOError
from tiers.mooncake.object_format import HEADER_BYTES, encode_into, object_bytes, object_name, verify
from tiers.mooncake.guard import CallGuard, RemoteTimeout, RemoteUnavailable
from tiers.mooncake.staging import ALIGN, StagingArena, StagingBusy

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def encoded(key=KEY, payload=b"kv" * 500):
    buf = bytearray(object_bytes(len(payload)))
    n = encode_into(memoryview(buf), key, memoryview(payload))
    assert n == len(buf) == HEADER_BYTES + len(payload)
    return buf


# ---------------------------------------------------------------- object format


def test_format_round_trip_and_name():
    payload = bytes(range(256)) * 7
    obj = encoded(payload=payload)
    assert bytes(verify(memoryview(obj), KEY)) == payload
    assert bytes(verify(memoryview(obj), KEY, len(payload))) == payload
    assert object_name("kvstore/", KEY) == "kvstore/" + KEY.hex()
    assert bytes(verify(memoryview(encoded(payload=b"")), KEY)) == b""


@pytest.mark.parametrize("damage", ["payload_bit", "truncated", "padded", "magic", "short", "size_claim"])
def test_format_detects_damage(damage):
    obj = encoded()
    if damage == "payload_bit":
        obj[HEADER_BYTES + 17] ^= 0x01
    elif damage == "truncated":
        del obj[-1]
    elif damage == "padded":
        obj += b"\0"
    elif damage == "magic":
        obj[0] ^= 0xFF
    elif damage == "short":
        obj = obj[:HEADER_BYTES - 1]
    elif damage == "size_claim":
        obj[8] ^= 0x01                         # payload size field
    with pytest.raises(BlockCorrupt):
        verify(memoryview(obj), KEY)


def test_format_detects_other_key_and_size_disagreement():
    with pytest.raises(BlockCorrupt, match="holds block"):
        verify(memoryview(encoded(key=OTHER)), KEY)
    with pytest.raises(BlockCorrupt, match="were stored"):
        verify(memoryview(encoded()), KEY, expect_nbytes=999)


def test_format_rejects_bad_keys():
    for bad in (b"", b"x" * 31, b"x" * 33, "k" * 32):
        with pytest.raises(InvalidAccess):
            object_name("p/", bad)


# ---------------------------------------------------------------- staging


def test_staging_leases_are_aligned_disjoint_and_coalesce():
    s = StagingArena(16 * ALIGN)
    a, b, c = s.lease(1), s.lease(ALIGN + 1), s.lease(ALIGN)
    assert (a.offset, b.offset, c.offset) == (0, ALIGN, 3 * ALIGN)
    assert a.address == s.address and c.address == s.address + 3 * ALIGN
    assert s.used_bytes == 4 * ALIGN and b.view.nbytes == ALIGN + 1
    b.view[:] = b"\xab" * (ALIGN + 1)
    assert bytes(a.view) == b"\0" and bytes(c.view[:1]) == b"\0"
    a.release(); c.release(); b.release(); b.release()   # double release is a no-op
    assert s.used_bytes == 0
    whole = s.lease(16 * ALIGN)                      # the pieces merged back into one
    assert whole.offset == 0
    whole.release()
    with pytest.raises(InvalidAccess):
        s.lease(16 * ALIGN + 1)


def test_staging_busy_then_waits_for_release():
    s = StagingArena(4 * ALIGN)
    held = s.lease(3 * ALIGN)
    assert not s.can_lease(2 * ALIGN)
    with pytest.raises(StagingBusy):
        s.lease(2 * ALIGN)
    assert issubclass(StagingBusy, MediaIOError)
    threading.Timer(0.2, held.release).start()
    got = s.lease(2 * ALIGN, wait_s=30)             # released by the timer well before
    assert got.offset == 0
    got.release()


# ---------------------------------------------------------------- guard


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_guard_returns_results_and_judges_them():
    g = CallGuard("t", timeout_s=30)
    assert g.call(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(MediaIOError, match="bad code"):
        g.call(lambda: -900, judge=lambda rc: "bad code" if rc < 0 else None)
    with pytest.raises(MediaIOError, match="ZeroDivisionError"):
        g.call(lambda: 1 / 0)
    st = g.stats()
    assert (st.calls, st.failures, st.consecutive_failures, st.breaker) == (3, 2, 2, "closed")
    g.close()


def test_guard_deadline_abandons_and_cleans_up_after_the_call_ends():
    g = CallGuard("t", timeout_s=0.2, failure_threshold=10)
    release = threading.Event()
    cleaned = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(RemoteTimeout):
        g.call(release.wait, 60, on_abandon=cleaned.set)
    assert time.monotonic() - t0 < 30                  # bounded by the deadline, not the call
    assert not cleaned.is_set()                        # the call still runs: its buffers stay lent
    assert g.stats().abandoned_in_flight == 1 and g.stats().timeouts == 1
    release.set()
    assert cleaned.wait(30)
    deadline = time.monotonic() + 30
    while g.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.stats().in_flight == 0 and g.stats().abandoned_in_flight == 0
    g.close()


def test_guard_refuses_when_all_workers_are_stuck():
    g = CallGuard("t", timeout_s=0.1, failure_threshold=100, max_in_flight=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(RemoteTimeout):
            g.call(release.wait, 60)
    with pytest.raises(RemoteUnavailable, match="busy"):
        g.call(lambda: 1)
    release.set()
    deadline = time.monotonic() + 30
    while g.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.call(lambda: 7) == 7
    g.close()


def test_breaker_opens_fails_fast_probes_and_closes():
    clock = FakeClock()
    g = CallGuard("t", timeout_s=30, failure_threshold=2, cooldown_s=5, clock=clock)
    down = lambda: -900                                # noqa: E731
    judge = lambda rc: "down" if rc < 0 else None      # noqa: E731
    calls = []

    def counted():
        calls.append(1)
        return 0

    for _ in range(2):
        with pytest.raises(MediaIOError):
            g.call(down, judge=judge)
    assert g.breaker == "open"
    with pytest.raises(RemoteUnavailable, match="unavailable"):
        g.call(counted)
    with pytest.raises(RemoteUnavailable):
        g.check()
    assert calls == [] and g.stats().rejected == 1
    clock.now = 5.0                                    # cooldown over: one probe
    assert g.breaker == "half_open"
    with pytest.raises(MediaIOError):
        g.call(down, judge=judge)                      # the probe fails: open again
    assert g.breaker == "open"
    clock.now = 10.0
    assert g.call(counted) == 0                        # the probe succeeds: closed
    assert g.breaker == "closed" and g.stats().consecutive_failures == 0
    assert g.call(counted) == 0 and len(calls) == 2
    g.close()


# ---------------------------------------------------------------- settings and loading


def test_mooncake_missing_names_the_missing_package(monkeypatch):
    import builtins
    import importlib.util

    from tiers.mooncake import client as mooncake_client

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install mooncake-transfer-engine-non-cuda" in mooncake_client.mooncake_missing()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    real_import = builtins.__import__

    def no_ibverbs(name, *args, **kwargs):
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ibverbs)
    assert "apt-get install -y libibverbs1" in mooncake_client.mooncake_missing()
    with pytest.raises(mooncake_client.MooncakeUnavailable, match="libibverbs1"):
        mooncake_client.store_class()


def test_mooncake_config_validates_and_sizes_deadlines():
    from tiers.mooncake.client import MooncakeConfig

    cfg = MooncakeConfig(master="127.0.0.1:50051", metadata_server="http://127.0.0.1:8080/metadata",
                         capacity_bytes=1 << 30, timeout_s=2.0, min_throughput=1 << 30)
    assert cfg.deadline_s(1 << 30) == 3.0
    args = cfg.setup_args()
    assert args["global_segment_size"] == 1 << 30 and args["master_server_addr"] == "127.0.0.1:50051"
    assert MooncakeConfig(master="h:1", metadata_server="P2PHANDSHAKE", segment_bytes=0).setup_args()[
        "global_segment_size"] == 0
    for bad in (dict(master="nohost"), dict(protocol="udp"), dict(segment_bytes=1 << 20), dict(capacity_bytes=0),
                dict(timeout_s=0), dict(replicas=0), dict(staging_bytes=4096)):
        values = dict(master="127.0.0.1:50051", metadata_server="http://127.0.0.1:8080/metadata")
        values.update(bad)
        with pytest.raises(ValueError, match="bad remote tier settings"):
            MooncakeConfig(**values)
