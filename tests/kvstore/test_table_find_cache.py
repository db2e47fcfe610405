"""The block-table rows a find reuses (:func:`kvstore.client.table_read.find`): an engine's
``lookup`` then ``get_into`` of the same prefix finds it in the table once, and the second
call still serves exactly what a fresh find would: a block deleted, or deleted and stored
again with other bytes, in between is never read from its old place, and a caller's key
that changed in place is looked up as it is now."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.client import KVStoreClient
from tiers.block_table import TableView, supported

from test_arena_control import BLOCK, DEADLINE_S, d, key, payloads  # noqa: F401 (d: a fixture)

pytestmark = pytest.mark.skipif(not supported(), reason="the block table is offered on x86-64 only")


def fresh_finds(monkeypatch) -> list[int]:
    """Count the table finds that are not answered from the rows kept."""
    made: list[int] = []
    real = TableView.find
    monkeypatch.setattr(TableView, "find", lambda self, keys: (made.append(len(keys)), real(self, keys))[1])
    return made


def test_lookup_then_get_into_finds_once_and_serves_the_stored_bytes(d, monkeypatch):
    data = payloads(16, seed=3)
    keys = [key(i, "fc") for i in range(16)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from(keys, data)
        made = fresh_finds(monkeypatch)
        assert c.lookup(keys).hit_blocks == 16
        out = np.zeros((16, BLOCK), np.uint8)
        assert c.get_into(keys[:12], out[:12]).found == 12      # a prefix of what the lookup found
        assert made == [16]
        assert np.array_equal(out[:12], data[:12])
        assert c.get_into(keys[4:], out[4:]).found == 12        # not a prefix: found afresh
        assert made == [16, 12] and np.array_equal(out, data)


def test_a_block_deleted_between_lookup_and_get_into_is_not_read_from_its_old_place(d, monkeypatch):
    data = payloads(8, seed=4)
    keys = [key(i, "fd") for i in range(8)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c, \
            KVStoreClient(d.address, timeout=DEADLINE_S, shared_memory=False) as other:
        c.put_from(keys, data)
        made = fresh_finds(monkeypatch)
        assert c.lookup(keys).hit_blocks == 8
        assert other.delete([keys[5]]) == 1
        out = np.zeros((8, BLOCK), np.uint8)
        got = c.get_into(keys, out)
        assert made == [8, 8]                                   # the rows kept were stale: found afresh
        assert got.found == 5 and np.array_equal(out[:5], data[:5])
        # stored again with other bytes: the new block is what is served
        new = payloads(1, seed=99)
        assert other.put([(keys[5], new[0].tobytes())]).stored == 1
        assert c.lookup(keys).hit_blocks == 8
        assert other.delete([keys[5]]) == 1
        newer = payloads(1, seed=100)
        assert other.put([(keys[5], newer[0].tobytes())]).stored == 1
        out[:] = 0
        assert c.get_into(keys, out).found == 8
        assert np.array_equal(out[5], newer[0]) and np.array_equal(np.delete(out, 5, 0), np.delete(data, 5, 0))


def test_a_key_changed_in_place_after_the_lookup_is_looked_up_as_it_is_now(d):
    data = payloads(4, seed=5)
    keys = [key(i, "fm") for i in range(4)]
    with KVStoreClient(d.address, timeout=DEADLINE_S) as c:
        c.put_from(keys, data)
        mine = [bytearray(k) for k in keys]
        assert c.lookup(mine).hit_blocks == 4
        mine[0][:] = keys[3]                                    # the caller reuses its buffer
        out = np.zeros((4, BLOCK), np.uint8)
        assert c.get_into(mine, out).found == 4
        assert np.array_equal(out[0], data[3]) and np.array_equal(out[1:], data[1:])
