#!/usr/bin/env python3
"""How long remote-tier calls take to fail, and to recover, under cluster faults.

Starts a loopback Mooncake cluster (a master and a storage-only peer in other
processes), connects a remote tier (:class:`tiers.mooncake.MooncakeTier`) with the given
deadline, and times each call under: a killed master, the master restarted, a stalled
(SIGSTOP) master, a stalled and then killed peer, and a master that is down when the
tier starts. Prints seconds per call and what it raised or returned.

    python bench/remote_faults.py [--timeout 1.0]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiers.mooncake.client import mooncake_missing  # noqa: E402
from tiers.mooncake.local_cluster import LocalMaster, LocalSegment  # noqa: E402

MIB = 1 << 20
ROWS: list[tuple[str, str, float, str]] = []


def K(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def timed(fault: str, what: str, fn, *args) -> object:
    t0 = time.monotonic()
    try:
        result = fn(*args)
        outcome = repr(result) if not isinstance(result, (bytes, bytearray)) else f"{len(result)} bytes"
    except Exception as exc:                     # the figure is what is raised
        result, outcome = exc, f"{type(exc).__name__}: {str(exc)[:70]}"
    took = time.monotonic() - t0
    ROWS.append((fault, what, took, outcome))
    print(f"{fault:<22} {what:<34} {took:7.3f}s  {outcome}", flush=True)
    return result


def until(pred, timeout_s: float = 120.0) -> float:
    """Seconds until ``pred()`` is true (polled every 0.1 s), or -1 after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if pred():
                return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(0.1)
    return -1.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=1.0, help="the tier's timeout_s (seconds)")
    args = p.parse_args()
    reason = mooncake_missing()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from tiers.mooncake.tier import MooncakeConfig, MooncakeTier

    def tier_for(master, **kw):
        cfg = MooncakeConfig(master=master.address, metadata_server=master.metadata_server, capacity_bytes=256 * MIB,
                             staging_bytes=64 * MIB, timeout_s=args.timeout, cooldown_s=2.0, **kw)
        return MooncakeTier(cfg, name="faults", wait_connected_s=0)

    data = [(K(i), bytes([i]) * MIB) for i in range(4)]
    out = bytearray(MIB)

    master = LocalMaster(client_ttl_s=3).start()
    tier = tier_for(master)
    assert tier.wait_connected(60)
    timed("healthy", "put_many 4 x 1 MiB", tier.put_many, data)
    timed("healthy", "exists_many 4", tier.exists_many, [k for k, _ in data])
    timed("healthy", "read_into 1 MiB", tier.read_into, K(0), out)
    master.kill()
    for i in range(4):
        timed("master killed", f"get_many_into 1 MiB (call {i + 1})", tier.get_many_into, [K(0)], [out])
    timed("master killed", "exists_many", tier.exists_many, [K(0)])
    timed("master killed", "reserve", tier.reserve, K(9), MIB)
    t0 = time.monotonic()
    master.start()
    up = time.monotonic() - t0
    took = until(lambda: tier.put_many([(K(50), b"x" * MIB)]) == [True])
    ROWS.append(("master restarted", "until a put succeeds", took, f"master up in {up:.2f}s"))
    print(f"{'master restarted':<22} {'until a put succeeds':<34} {took:7.3f}s  (master up in {up:.2f}s)")
    timed("master restarted", "get_many_into an old block", tier.get_many_into, [K(0)], [out])

    timed("master restarted", "put_many 4 x 1 MiB", tier.put_many, data)
    master.pause()
    timed("master stalled", "exists_many", tier.exists_many, [K(0)])
    timed("master stalled", "read_into 1 MiB", tier.read_into, K(0), out)
    master.resume()
    took = until(lambda: tier.read_into(K(0), out) == MIB)
    ROWS.append(("master resumed", "until a read succeeds", took, "block kept"))
    print(f"{'master resumed':<22} {'until a read succeeds':<34} {took:7.3f}s")
    tier.close()

    peer = LocalSegment(master, 64 * MIB).start()
    client = tier_for(master, segment_bytes=0)
    assert client.wait_connected(60)
    timed("peer healthy", "put_many 4 x 1 MiB (on the peer)", client.put_many, data)
    peer.pause()
    timed("peer stalled", "read_into 1 MiB", client.read_into, K(1), out)
    timed("peer stalled", "get_many_into 1 MiB", client.get_many_into, [K(2)], [out])
    peer.kill()
    timed("peer killed", "get_many_into 1 MiB", client.get_many_into, [K(3)], [out])
    took = until(lambda: client.exists_many([K(3)]) == [False])
    ROWS.append(("peer killed", "until the master drops it", took, "client_ttl 3 s"))
    print(f"{'peer killed':<22} {'until the master drops it':<34} {took:7.3f}s  (client_ttl 3 s)")
    timed("peer killed", "get_many_into 1 MiB", client.get_many_into, [K(3)], [out])
    client.close()
    master.stop()

    down = LocalMaster(client_ttl_s=3)
    t0 = time.monotonic()
    tier = tier_for(down)
    print(f"{'master down at start':<22} {'constructor':<34} {time.monotonic() - t0:7.3f}s")
    timed("master down at start", "exists_many", tier.exists_many, [K(0)])
    down.start()
    took = until(lambda: tier.wait_connected(0))
    print(f"{'master started':<22} {'until connected':<34} {took:7.3f}s")
    tier.close()
    down.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
