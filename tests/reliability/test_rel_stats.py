"""Stats mean what they say (issue 9, item 11): every counter the code increments is
declared once (kvstore/store/counters.py) with its unit, listed in the README table and in the
proto comments; a block streamed in several pieces is one read.
"""

from __future__ import annotations

import re
import time

import pytest

from support.daemon import ROOT, daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.store.counters import COUNTERS, Counters, declared, unit_of
from kvstore.service.startup import start_server
from rel_support import key

SOURCES = [p for folder in ("kvstore", "tiers", "engine_adapter") for p in (ROOT / folder).rglob("*.py")
           if "_proto" not in p.parts]


def incremented_names() -> set[str]:
    """Counter names in ``.inc(...)`` calls, ``{...}`` placeholders as ``{tier}``."""
    names = set()
    for p in SOURCES:
        for line in p.read_text().splitlines():
            if ".inc(" not in line or "def inc" in line:
                continue
            call = line[line.index(".inc(") + 5:]
            for lit in re.findall(r'f?"([a-z_{}.\[\]]+)"', call.split(",")[0]):   # the name: first argument
                names.add(re.sub(r"\{[^}]*\}", "{tier}", lit))
    return names


def reported_names() -> set[str]:
    """Counters reported as a snapshot of the cluster store's own counts (the keys of
    ``call_counters()`` in tiers/mooncake/tier.py, reported as ``remote_<name>``)."""
    text = (ROOT / "tiers" / "mooncake" / "tier.py").read_text()
    body = text[text.index("def call_counters"):]
    body = body[:body.index("\n    def ", 1)]
    return {f"remote_{n}" for n in re.findall(r'"([a-z_]+)":', body)}


def test_every_incremented_counter_is_declared_and_every_declared_one_is_incremented():
    used = incremented_names() | reported_names()
    assert used, "no .inc( calls found: the scan is broken"
    assert {n for n in used if declared(n.replace("{tier}", "host")) is None} == set()
    assert set(COUNTERS) - used == set(), "declared counters that nothing increments"
    with pytest.raises(KeyError, match="not declared"):
        Counters().inc("hits_host")


def test_readme_and_proto_document_every_counter_with_its_unit():
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_{}]+)` \| ([a-z ]+) \|", readme, flags=re.M))
    assert rows == {n: unit_of(n) for n in COUNTERS}
    proto = (ROOT / "proto" / "kvstore.proto").read_text()
    for n in COUNTERS:
        assert f"//   {n} [{unit_of(n)}]: " in proto, n


def test_a_block_read_in_pieces_is_one_read(tmp_path, monkeypatch):
    d = start_server(daemon_config(tmp_path, host="32MiB", nvme=None))
    try:
        big = bytes(range(256)) * (3 * 4096 + 16)           # 3 MiB + 4 KiB: four 1 MiB pieces
        with KVStoreClient(d.address, shared_memory=False, chunk_bytes=1 << 20, timeout=30) as c:
            c.put([(key(1), big), (key(2), b"small")])
            base = c.stats()["counters"]
            assert c.get([key(1)])[0].data == big
            got = c.get([key(1), key(2)], ranges=[(0, 2), (3, 1)])          # a TP rank's slices
            assert [g.data for g in got] == [big[:2] + big[3:4], b"sml"]
            c.get([key(9), key(8)])
            after = c.stats()["counters"]
        delta = {k: after.get(k, 0) - base.get(k, 0) for k in ("reads", "reads_host", "read_bytes",
                                                               "read_bytes_host", "get_misses")}
        assert delta == {"reads": 3, "reads_host": 3, "read_bytes": len(big) + 6, "read_bytes_host": len(big) + 6,
                         "get_misses": 2}
        for table in ("0", "1"):
            monkeypatch.setenv("KVSTORE_BLOCK_TABLE", table)
            with KVStoreClient(d.address, shared_memory=True, timeout=30) as c:
                out = bytearray(len(big))
                assert c.get_into([key(1)], [out]).found == 1 and bytes(out) == big
            # a lease pins the whole block, or the client finds it in the block table, and
            # copies what it needs: counted as a lease or a table read (the daemon cannot see
            # the bytes copied), not as a read
            counter = "table_read_blocks" if table == "1" else "leased_blocks"
            deadline = time.monotonic() + 60              # the table's note is a frame nobody waits for
            while d.manager.counters.get(counter, 0) != after.get(counter, 0) + 1:
                assert time.monotonic() < deadline, f"{counter} did not count the read"
                time.sleep(0.02)
            assert d.manager.counters["reads"] == after["reads"]
    finally:
        d.stop(0)
