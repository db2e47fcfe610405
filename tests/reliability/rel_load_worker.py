"""One client process of the load test (``test_rel_load.py``).

    python rel_load_worker.py ADDRESS WORKER SECONDS MAX_OPS SEED OUT_JSON

Runs mixed operations for SECONDS seconds (but at least MIN_OPS operations, however slow
the machine) or MAX_OPS operations:
put / get / lookup / delete over keys shared by every worker (put and read, never
deleted) and keys private to this worker (put, read and deleted, so their presence is
known exactly). Every byte read is checked against its key. Writes a JSON report.
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvstore.common import errors
from kvstore.client.client import KVStoreClient
from rel_support import is_payload_of, key, payload, size_for

SHARED_KEYS = 48
PRIVATE_KEYS = 24
MIN_BLOCK, MAX_BLOCK = 4096, 192 << 10
MIN_OPS = 200          # enough puts to fill the 8 MiB host tier whatever the machine's speed


def shared_key(i: int) -> bytes:
    return key(i, "load-shared")


def private_key(worker: int, i: int) -> bytes:
    return key(i, f"load-private-{worker}")


def block(k: bytes) -> bytes:
    return payload(k, size_for(k, MIN_BLOCK, MAX_BLOCK))


def main(address: str, worker: int, seconds: float, max_ops: int, seed: int, out: str) -> None:
    rng = random.Random(seed)
    ops = {"put": 0, "get": 0, "lookup": 0, "delete": 0}
    problems: list[str] = []
    present: dict[bytes, bool] = {private_key(worker, i): False for i in range(PRIVATE_KEYS)}
    shared_put: set[int] = set()
    bytes_moved = 0
    start = time.monotonic()
    with KVStoreClient(address, timeout=30, chunk_bytes=64 << 10, max_message_bytes=4 << 20) as c:
        n = 0
        while n < max_ops and (n < MIN_OPS or time.monotonic() - start < seconds):
            n += 1
            op = rng.choices(("put", "get", "lookup", "delete"), weights=(40, 35, 15, 10))[0]
            ops[op] += 1
            try:
                if op == "put":
                    if rng.random() < 0.5:
                        i = rng.randrange(SHARED_KEYS)
                        keys = [shared_key(i)]
                        shared_put.add(i)
                    else:
                        keys = [private_key(worker, rng.randrange(PRIVATE_KEYS)) for _ in range(rng.randint(1, 3))]
                    blocks = [(k, block(k)) for k in dict.fromkeys(keys)]
                    c.put(blocks)
                    bytes_moved += sum(len(v) for _, v in blocks)
                    for k, _ in blocks:
                        if k in present:
                            present[k] = True
                elif op == "get":
                    keys = [shared_key(rng.randrange(SHARED_KEYS)) for _ in range(rng.randint(0, 2))]
                    keys += [private_key(worker, rng.randrange(PRIVATE_KEYS)) for _ in range(rng.randint(1, 2))]
                    for g in c.get(keys):
                        bytes_moved += len(g.data)
                        size = size_for(g.key, MIN_BLOCK, MAX_BLOCK)
                        if g.found and not is_payload_of(g.key, g.data, size):
                            problems.append(f"wrong bytes for {g.key.hex()[:16]} ({len(g.data)} of {size})")
                        if g.key in present and g.found != present[g.key]:
                            problems.append(f"private {g.key.hex()[:16]}: found={g.found}, expected {present[g.key]}")
                elif op == "lookup":
                    keys = [private_key(worker, i) for i in range(rng.randint(1, 6))]
                    expect = 0
                    for k in keys:
                        if not present[k]:
                            break
                        expect += 1
                    hit = c.lookup(keys).hit_blocks
                    if hit != expect:
                        problems.append(f"lookup hit {hit} blocks, expected {expect}")
                else:
                    k = private_key(worker, rng.randrange(PRIVATE_KEYS))
                    deleted = c.delete([k])
                    if deleted != int(present[k]):
                        problems.append(f"delete of {k.hex()[:16]} returned {deleted}, expected {int(present[k])}")
                    present[k] = False
            except errors.KVStoreError as e:
                problems.append(f"{op} failed: {e}")
    report = {"worker": worker, "ops": ops, "seconds": time.monotonic() - start, "bytes": bytes_moved,
              "problems": problems[:50], "num_problems": len(problems),
              "present": [k.hex() for k, v in present.items() if v], "shared_put": sorted(shared_put)}
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), float(a[2]), int(a[3]), int(a[4]), a[5])
