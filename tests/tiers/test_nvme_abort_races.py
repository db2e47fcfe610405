"""NVMe tier: a reservation aborted on another thread while its writer is inside a write.

The abort returns its capacity at once; the writer's file descriptor and temp file stay
its own until its I/O ends (then they are removed), and the key stays busy until then, so
a late write never lands in another block's file and a late open never truncates the temp
file of the key's next reservation. Both I/O modes, as test_nvme.py.
"""

import os
import threading

import pytest

from nvme_support import K, block_files, file_of, payload, put, read
from tiers.errors import BlockExists, BlockNotStored

DEADLINE = 30.0


def paused_in(monkeypatch, name: str, path: str | None = None, owner=os):
    """Pause thread "A" at its first call of ``owner.<name>`` (on ``path``, if given) until
    ``go`` is set; ``inside`` is set once it is there."""
    inside, go = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def hooked(first, *args, **kw):
        if threading.current_thread().name == "A" and not inside.is_set() and path in (None, first):
            inside.set()
            go.wait(DEADLINE)
        return real(first, *args, **kw)
    monkeypatch.setattr(owner, name, hooked)
    return inside, go


def run_a(target, name: str = "A") -> tuple[threading.Thread, dict]:
    """``target`` on a thread named ``name`` ("A": the one :func:`paused_in` pauses); its
    result ("done" or the exception raised) in the dict returned."""
    out: dict = {}

    def body():
        try:
            target()
            out["result"] = "done"
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["result"] = e
    th = threading.Thread(target=body, name=name)
    th.start()
    return th, out


def held_until_go(target, go, a: threading.Thread, name: str = "B") -> dict:
    """Run ``target`` on thread ``name`` while thread "A" is paused: it must still be running
    a moment later (it waits for A), then ``go`` releases A and both end. Returns ``target``'s
    result dict (:func:`run_a`)."""
    b, out = run_a(target, name)
    b.join(0.3)
    assert "result" not in out, f"{name} did not wait for the paused thread: {out}"
    go.set()
    a.join(DEADLINE)
    b.join(DEADLINE)
    return out


def put_in_a(t, n: int) -> tuple[threading.Thread, dict]:
    """Thread "A" reserves, writes and commits K(1) of ``n`` bytes (:func:`run_a`)."""
    def commit_a():
        t.reserve(K(1), n)
        t.write(K(1), 0, payload(K(1), n))
        t.commit(K(1))
    return run_a(commit_a)


def test_an_abort_during_a_write_never_lets_the_write_land_in_another_blocks_file(open_nvme, monkeypatch):
    t = open_nvme()
    n = 64 << 10
    data = payload(K(1), n)
    inside, go = paused_in(monkeypatch, "pwritev")

    def write_a():
        t.reserve(K(1), n)
        t.write(K(1), 0, data[:n // 2])            # streamed: paused inside its first write
        t.write(K(1), n // 2, data[n // 2:])
    th, out = run_a(write_a)
    assert inside.wait(DEADLINE)
    t.abort(K(1))                                   # returns at once; its capacity is back
    assert t.used_bytes == 0
    put(t, K(2), payload(K(2), n))                  # a new block's file while A is still writing
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert out["result"] == "done" or isinstance(out["result"], BlockNotStored)   # into its own file
    assert read(t, K(2)) == payload(K(2), n)
    assert block_files(t.path) == [str(file_of(t, K(2)).relative_to(os.path.join(t.path, "blocks")))]
    put(t, K(1), data)                              # the key is free again once A's write ended
    assert read(t, K(1)) == data


def test_a_key_aborted_while_its_file_is_opened_stays_busy_until_the_open_ends(open_nvme, monkeypatch):
    t = open_nvme(spare_files=0)                    # a new <key>.tmp for each reservation
    n = 50_000
    inside, go = paused_in(monkeypatch, "open", str(file_of(t, K(1))) + ".tmp")

    def write_a():
        t.reserve(K(1), n)
        t.write(K(1), 0, payload(K(1), n))
    th, out = run_a(write_a)
    assert inside.wait(DEADLINE)
    t.abort(K(1))
    with pytest.raises(BlockExists):                # its temp file's name is still A's
        t.reserve(K(1), n)
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert isinstance(out["result"], BlockNotStored)
    put(t, K(1), payload(K(1), n))
    assert read(t, K(1)) == payload(K(1), n) and t.used_bytes > 0
    assert not any(f.endswith(".tmp") for f in block_files(t.path))


@pytest.mark.parametrize("at", ["close", "rename"])
def test_an_abort_during_a_commit_is_the_abort_until_the_commit_publishes(open_nvme, monkeypatch, at):
    """Aborted before the commit decides (at the close of its file): neither block nor file.
    Aborted once it publishes (at the rename to the block's name): too late, the block stays."""
    t = open_nvme()
    n = 40_000
    put(t, K(9), payload(K(9), n))
    inside, go = paused_in(monkeypatch, at)
    th, out = put_in_a(t, n)
    assert inside.wait(DEADLINE)
    t.abort(K(1))
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert read(t, K(9)) == payload(K(9), n)
    if at == "rename":
        assert out["result"] == "done" and read(t, K(1)) == payload(K(1), n)
        return
    assert isinstance(out["result"], BlockNotStored)
    assert K(1) not in t and not file_of(t, K(1)).exists()
    put(t, K(1), payload(K(1), n))
    assert read(t, K(1)) == payload(K(1), n)


def paused_in_group_commit(monkeypatch, t):
    """Pause thread "A" in its commit of K(1) after the rename, before the shared index
    transaction (``fsync = True``: the flush of its block's folder)."""
    from tiers.nvme import commit as nvme_commit
    return paused_in(monkeypatch, "fsync_folder", str(file_of(t, K(1)).parent), owner=nvme_commit)


def test_an_abort_once_a_commit_is_publishing_the_block_is_too_late(open_nvme, monkeypatch):
    t = open_nvme(fsync=True)
    n = 40_000
    inside, go = paused_in_group_commit(monkeypatch, t)
    th, out = put_in_a(t, n)
    assert inside.wait(DEADLINE)
    t.abort(K(1))                                   # too late: the block is renamed into place
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert out["result"] == "done" and read(t, K(1)) == payload(K(1), n)
    used = t.used_bytes
    assert used > 0
    t.free(K(1))
    assert t.used_bytes == 0 and block_files(t.path) == []


def test_a_tier_closed_during_a_group_commit_keeps_no_block_and_no_reservation(open_nvme, monkeypatch, tmp_path):
    from tiers.errors import MediaError
    t = open_nvme(fsync=True)
    n = 40_000
    inside, go = paused_in_group_commit(monkeypatch, t)
    th, out = put_in_a(t, n)
    assert inside.wait(DEADLINE)
    closing = threading.Thread(target=t.close)
    closing.start()
    closing.join(DEADLINE)
    assert not closing.is_alive()                   # the close does not wait on the commit
    go.set()
    th.join(DEADLINE)
    monkeypatch.undo()
    assert not th.is_alive() and isinstance(out["result"], MediaError)
    assert t._writes.pending == {} and block_files(t.path) == []
    again = open_nvme(fsync=True)
    assert dict(again.recover()) == {}
