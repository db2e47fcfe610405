"""A damaged NVMe index never costs a block and never crashes the process (issue #9, item 8).

A store of :data:`N` blocks is written and closed cleanly; then its LMDB index is
damaged the ways an operator met it (truncated to half -> SIGBUS before, truncated to 0
bytes -> every block file deleted before, one page of garbage -> a raw
``lmdb.CorruptedError`` or an LMDB assertion that aborts the process). Each time a
fresh process opens the folder, and all N blocks must come back byte-identical, with
the damaged index kept aside and no block file deleted. The damaged folder is opened in
a child process so that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import lmdb
import pytest

from nvme_support import ROOT, K, block_files, file_of, payload, put, read
from tiers.errors import MediaUnavailable
from tiers.nvme.tier import NVMeTier
from tiers.nvme.format import PAGE
from tiers.nvme.repair import repair_index

N = 300
"""Blocks in the damaged store: sizes 0 B to ~190 KB, written whole and in pieces."""

TESTS = pathlib.Path(__file__).resolve().parent


def size_of(i: int) -> int:
    return (i * 7919) % 50_000 + (i % 3) * 70_000


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A cleanly closed store of N blocks, copied by each test."""
    path = tmp_path_factory.mktemp("pristine") / "nvme"
    t = NVMeTier(path, 1 << 30)
    for i in range(N):
        data = payload(K(i), size_of(i))
        put(t, K(i), data, chunk=None if i % 2 else 65_537)
    t.close()
    return path


@pytest.fixture
def store(pristine, tmp_path):
    path = tmp_path / "nvme"
    shutil.copytree(pristine, path)
    return path


CHECK = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
from nvme_support import payload
from tiers.base import read_bytes
from tiers.nvme import NVMeTier
t = NVMeTier({path!r}, 1 << 30)
held = t.recover()
identical = sum(1 for k, n in held if read_bytes(t, k) == payload(k, n))
r = t.recovery
print(json.dumps({{"sizes": {{k.hex(): n for k, n in held}}, "identical": identical, "damage": r.index_damage,
                  "moved": r.index_moved_to, "adopted": r.adopted, "quarantined": r.quarantined,
                  "rebuilt": r.index_rebuilt}}))
t.close()
"""


def reopen(path: pathlib.Path) -> dict:
    """Open the folder in a child process; what it found (dies -> the test fails)."""
    script = CHECK.format(root=str(ROOT), tests=str(TESTS), path=str(path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the process opening the tier died ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def expected_sizes() -> dict:
    return {K(i).hex(): size_of(i) for i in range(N)}


def assert_all_back(path: pathlib.Path, found: dict, *, rebuilt: bool) -> None:
    assert found["sizes"] == expected_sizes()
    assert found["identical"] == N                              # all 300 blocks byte-identical
    assert found["quarantined"] == 0
    assert len(block_files(path)) == N                          # no block file deleted
    if rebuilt:
        assert found["rebuilt"] and found["adopted"] == N


def data_file(path: pathlib.Path) -> pathlib.Path:
    return path / "index" / "data.mdb"


def test_index_truncated_to_half(store):
    size = data_file(store).stat().st_size
    os.truncate(data_file(store), size // 2)
    found = reopen(store)
    assert_all_back(store, found, rebuilt=True)
    assert "was truncated" in found["damage"]
    kept = pathlib.Path(found["moved"]) / "data.mdb"            # the damaged index, kept aside
    assert kept.parent.name.startswith("index.damaged-") and kept.stat().st_size == size // 2
    again = reopen(store)                                       # the rebuilt index is trusted next time
    assert again["damage"] is None and again["adopted"] == 0 and again["identical"] == N


def test_index_truncated_to_zero_bytes(store):
    os.truncate(data_file(store), 0)
    found = reopen(store)
    assert_all_back(store, found, rebuilt=True)
    assert "empty (0 bytes)" in found["damage"]


def test_index_folder_deleted(store):
    shutil.rmtree(store / "index")
    found = reopen(store)
    assert_all_back(store, found, rebuilt=True)
    assert found["damage"] is None and found["moved"] is None


@pytest.mark.parametrize("how", ["data file is a folder", "index is a file"])
def test_an_index_of_the_wrong_kind_of_file_is_moved_aside_and_rebuilt(store, how):
    """``index/data.mdb`` a folder, or ``index`` a file: the daemon refused to start and told
    the operator to run ``repair-index``, which failed the same way. Now it is damage like
    any other: moved aside, the index rebuilt, every block back."""
    if how == "data file is a folder":
        data_file(store).unlink()
        data_file(store).mkdir()
        needle = "data.mdb is not a regular file"
    else:
        shutil.rmtree(store / "index")
        (store / "index").write_text("not an index")
        needle = "index is not a folder"
    found = reopen(store)
    assert_all_back(store, found, rebuilt=True)
    assert needle in found["damage"] and pathlib.Path(found["moved"]).name.startswith("index.damaged-")
    again = reopen(store)
    assert again["damage"] is None and again["identical"] == N


def _root_page(data: bytes) -> int:
    """The main database's root page of the newer meta page (LMDB ``MDB_meta``)."""
    metas = [struct.unpack_from("<QQ", data, off + 136)[::-1] + (struct.unpack_from("<Q", data, off + 128)[0],)
             for off in (0, PAGE)]
    return max(metas)[2]


SWEEP = """
import json, shutil, sys
sys.path[:0] = [{root!r}, {tests!r}]
from nvme_support import payload
from tiers.base import read_bytes
from tiers.nvme import NVMeTier
store, clean, page_bytes = {path!r}, open({clean!r}, "rb").read(), {page}
for page in range(len(clean) // page_bytes):
    for old in __import__("glob").glob(store + "/index*"):
        shutil.rmtree(old)
    __import__("os").makedirs(store + "/index")
    garbage = bytes((page * 131 + i * 7 + 1) % 256 for i in range(page_bytes))
    with open(store + "/index/data.mdb", "wb") as f:
        f.write(clean[:page * page_bytes] + garbage + clean[(page + 1) * page_bytes:])
    print(json.dumps({{"page": page}}), flush=True)              # the page a crash would be on
    t = NVMeTier(store, 1 << 30)
    held = t.recover()
    r = t.recovery
    print(json.dumps({{"page": page, "sizes": {{k.hex(): n for k, n in held}}, "damage": r.index_damage,
                      "identical": sum(1 for k, n in held if read_bytes(t, k) == payload(k, n)),
                      "adopted": r.adopted, "quarantined": r.quarantined, "moved": r.index_moved_to}}), flush=True)
    t.close()
"""


def test_one_page_of_garbage_anywhere_in_the_index(store, tmp_path):
    """Garbage over each page of data.mdb in turn (meta pages, the root, leaves, free
    pages), each opened by the same child process: a crash on any page fails the test."""
    clean = data_file(store).read_bytes()
    (tmp_path / "clean.mdb").write_bytes(clean)
    pages = len(clean) // PAGE
    assert pages >= 4
    script = SWEEP.format(root=str(ROOT), tests=str(TESTS), path=str(store), clean=str(tmp_path / "clean.mdb"),
                          page=PAGE)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, f"died on page {lines[-1]['page'] if lines else '?'}: {done.stderr[-2000:]}"
    results = [r for r in lines if "sizes" in r]
    assert [r["page"] for r in results] == list(range(pages))
    detected = set()
    for r in results:
        assert r["sizes"] == expected_sizes(), r["page"]
        assert r["identical"] == N and r["quarantined"] == 0, r["page"]      # all 300 byte-identical
        if r["damage"] is not None:
            detected.add(r["page"])
            assert r["adopted"] == N and "index.damaged-" in r["moved"]
        else:                                                   # an unused page: the index was right
            assert r["adopted"] == 0
    assert {0, 1, _root_page(clean)} <= detected, detected
    assert len(block_files(store)) == N


def test_block_file_with_a_bad_header_is_quarantined_not_deleted(store):
    victim = file_of(store, K(7))
    raw = bytearray(victim.read_bytes())
    raw[20] ^= 0xFF                                             # a key byte in the header
    victim.write_bytes(raw)
    os.truncate(data_file(store), 0)
    found = reopen(store)
    assert found["identical"] == N - 1 and K(7).hex() not in found["sizes"]
    assert found["quarantined"] == 1
    assert (store / "quarantine" / K(7).hex()).read_bytes() == bytes(raw)
    assert len(block_files(store)) == N - 1


def test_index_of_the_old_format_is_moved_aside(tmp_path):
    path = tmp_path / "nvme"
    (path / "index").mkdir(parents=True)
    env = lmdb.open(str(path / "index"), map_size=1 << 20)     # an index as the first NVMe tier wrote it
    with env.begin(write=True) as txn:
        txn.put(K(1), struct.pack("<QQd", 5, 123, 1.0))
    env.close()
    old_file = file_of(path, K(1))                              # a headerless block file
    old_file.parent.mkdir(parents=True)
    old_file.write_bytes(b"hello")
    t = NVMeTier(path, 1 << 20)
    try:
        assert "another format" in t.recovery.index_damage and len(t) == 0
        assert (path / "quarantine" / K(1).hex()).read_bytes() == b"hello"
        put(t, K(2), b"new")
        assert read(t, K(2)) == b"new"
    finally:
        t.close()


CRASH = """
import os, sys
sys.path[:0] = [{root!r}, {tests!r}]
from nvme_support import K, payload, put
from tiers.nvme import NVMeTier
t = NVMeTier({path!r}, 1 << 30)
for i in range(50):
    put(t, K(i), payload(K(i), 10_000 + i))
if {when!r} == "after-rename":
    t._index.put = lambda key, entry, stale=(): os._exit(9)               # dies between rename and index update
else:
    os.rename = lambda src, dst: os._exit(9)                     # dies before the rename
put(t, K(50), payload(K(50), 300_001), chunk=100_000)
"""


@pytest.mark.parametrize("when", ["after-rename", "before-rename"])
def test_crash_around_the_rename(tmp_path, when):
    path = tmp_path / "nvme"
    script = CRASH.format(root=str(ROOT), tests=str(TESTS), path=str(path), when=when)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-2000:]
    t = NVMeTier(path, 1 << 30)
    try:
        held = dict(t.recover())
        if when == "after-rename":                              # the complete file is indexed from its header
            assert t.recovery.adopted == 1 and held[K(50)] == 300_001
            assert read(t, K(50)) == payload(K(50), 300_001)
        else:                                                   # the temp file never was a block
            assert t.recovery.temps_removed == 1 and K(50) not in held
        assert all(read(t, K(i)) == payload(K(i), 10_000 + i) for i in range(50))
        assert len(held) == (51 if when == "after-rename" else 50)
    finally:
        t.close()


def test_repair_index_command(store):
    t = NVMeTier(store, 1 << 30)
    with pytest.raises(MediaUnavailable, match="in use"):       # never under a running daemon
        repair_index(store)
    t.close()
    with open(data_file(store), "r+b") as f:                    # garbage over the first meta page
        f.write(b"\xa5" * PAGE)
    done = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "repair-index", str(store)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{N} blocks" in done.stdout and f"{N} indexed from their headers" in done.stdout
    assert "meta page 0" in done.stdout and "index.damaged-" in done.stdout
    found = reopen(store)                                       # the daemon then trusts the new index
    assert found["damage"] is None and found["adopted"] == 0 and found["identical"] == N
    done = subprocess.run([sys.executable, "-m", "kvstore.tools.cli", "repair-index", str(store / "nope")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "not an NVMe tier folder" in done.stdout


def test_audit_of_a_closed_folder(store):
    from tiers.nvme.repair import audit_folder
    clean = audit_folder(store)
    assert clean["indexed"] == clean["files"] == N and len(clean["keys"]) == N
    assert all(clean[k] == 0 for k in ("temp", "orphans", "missing", "bad_size", "bad_header", "bad_checksum",
                                       "misplaced", "other"))
    raw = bytearray(file_of(store, K(3)).read_bytes())
    raw[PAGE + 5] ^= 0x01                                       # a payload byte
    file_of(store, K(3)).write_bytes(raw)
    file_of(store, K(4)).unlink()
    file_of(store, K(5)).with_name(K(5).hex() + ".tmp").write_bytes(b"partial")
    found = audit_folder(store)
    assert (found["bad_checksum"], found["missing"], found["temp"], found["files"]) == (1, 1, 1, N - 1)
    assert audit_folder(store, verify_payload=False)["bad_checksum"] == 0
