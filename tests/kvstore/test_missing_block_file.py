"""A block file deleted from under the NVMe tier is a copy the tier no longer holds: the
read is a miss, the copy is dropped and counted in ``copies_missing`` (it was counted in
``corrupt_blocks``, which the README keeps for bytes that fail their checks); a corrupt
file still counts as corrupt."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvstore.service.build import build_manager
from support.daemon import daemon_config

MiB = 1 << 20


def key(i: int, tag: str) -> bytes:
    return hashlib.sha256(f"{tag}:{i}".encode()).digest()


@pytest.fixture
def store(tmp_path):
    m = build_manager(daemon_config(tmp_path, host="4MiB", nvme="64MiB",
                                    extra={"policy": {"promote_on_get": False}}))
    yield m
    m.close()


def nvme_only(m, keys):
    """A key whose only copy is on the NVMe tier, and that tier's index."""
    nvme = next(i for i, t in enumerate(m.tiers) if t.name == "nvme")
    m.drain()
    with m.lock:
        for k in keys:
            entry = m.catalogue.raw(k)
            if entry is not None and list(entry.tiers) == [nvme]:
                return k, nvme
    raise AssertionError("no block is on NVMe alone")


@pytest.mark.parametrize("damage, counter", [("delete", "copies_missing"), ("flip", "corrupt_blocks")])
def test_a_block_file_gone_is_a_missing_copy_and_a_damaged_one_corrupt(store, damage, counter):
    m = store
    keys = [key(i, "gone") for i in range(12)]
    for i, k in enumerate(keys):
        assert m.put(k, bytes([i]) * MiB)
    k, nvme = nvme_only(m, keys)
    path = m.tiers[nvme]._file(k)
    if damage == "delete":
        os.unlink(path)
    else:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 10)
            f.write(b"\xff" * 10)
    before = dict(m.counters.snapshot())
    assert m.read_into(k, bytearray(MiB)) is None                 # a miss, never wrong bytes
    after = dict(m.counters.snapshot())
    other = {"copies_missing": "corrupt_blocks", "corrupt_blocks": "copies_missing"}[counter]
    assert after.get(counter, 0) == before.get(counter, 0) + 1
    assert after.get(other, 0) == before.get(other, 0)
    assert m.lookup([k]).hit_blocks == 0                          # the copy is dropped
