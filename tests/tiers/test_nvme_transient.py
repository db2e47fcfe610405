"""A transient fault is not corruption (issue 19, item 12): an open or a read of a block
file that fails with EMFILE, ENFILE, EIO, ENOSPC or EAGAIN raises MediaIOError, never
BlockCorrupt; the file stays and reads right once the fault is gone. At start, a header
that cannot be read for such a reason neither deletes nor quarantines the file. Only a
failed checksum or a malformed header is BlockCorrupt.

Faults are injected by replacing the ``os`` module one NVMe module sees (the tier's file
open, the vectored read, the header read at start) with one whose call fails.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest

import tiers.nvme.files
import tiers.nvme.format
import tiers.nvme.recover
import tiers.nvme.tier
from nvme_support import K, file_of, payload, put, read
from tiers.errors import BlockCorrupt, MediaIOError

TRANSIENT = [errno.EMFILE, errno.ENFILE, errno.EIO, errno.ENOSPC, errno.EAGAIN]


class FailingOs:
    """The ``os`` module, except that ``name`` raises OSError(``err``) while ``on``."""

    def __init__(self, name: str, err: int):
        self._name, self._err, self.on, self.calls = name, err, True, 0

    def __getattr__(self, attr: str):
        real = getattr(os, attr)
        if attr != self._name:
            return real

        def call(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            self.calls += 1
            raise OSError(self._err, os.strerror(self._err))
        return call


def three_blocks(tier) -> dict[bytes, bytes]:
    blocks = {K(i): payload(K(i), 5000 + 70_000 * i) for i in range(3)}
    for k, v in blocks.items():
        put(tier, k, v)
    return blocks


@pytest.mark.parametrize("err", TRANSIENT, ids=errno.errorcode.get)
def test_a_failing_open_is_a_media_error_and_the_block_stays(open_nvme, monkeypatch, err):
    t = open_nvme()
    blocks = three_blocks(t)
    fault = FailingOs("open", err)
    monkeypatch.setattr(tiers.nvme.tier, "os", fault)
    for k in blocks:
        with pytest.raises(MediaIOError, match=os.strerror(err)) as exc:
            read(t, k)
        assert not isinstance(exc.value, BlockCorrupt)
        assert file_of(t, k).exists() and k in t
    assert fault.calls == 3
    fault.on = False                                        # the fault is gone: every block reads right
    assert {k: read(t, k) for k in blocks} == blocks


@pytest.mark.parametrize("err", [errno.EIO, errno.EAGAIN], ids=errno.errorcode.get)
def test_a_failing_read_is_a_media_error_and_the_block_stays(open_nvme, monkeypatch, err):
    t = open_nvme()
    blocks = three_blocks(t)
    fault = FailingOs("preadv", err)
    monkeypatch.setattr(tiers.nvme.files, "os", fault)
    for k, v in blocks.items():
        for ranges in (None, [(100, 3000)]):                 # whole block and a TP rank's range
            with pytest.raises(MediaIOError):
                read(t, k, ranges)
        assert file_of(t, k).exists()
    fault.on = False
    assert {k: read(t, k) for k in blocks} == blocks
    assert read(t, K(1), [(100, 3000)]) == blocks[K(1)][100:3100]


def test_a_flipped_byte_is_still_corrupt(open_nvme):
    t = open_nvme()
    blocks = three_blocks(t)
    path = file_of(t, K(2))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4096 - 17)          # a payload byte
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(BlockCorrupt, match="checksum"):
        read(t, K(2))
    assert read(t, K(0)) == blocks[K(0)]


def test_a_header_that_cannot_be_read_at_start_deletes_nothing(tmp_path, open_nvme, monkeypatch):
    """With the index lost, opening the folder reads every header; EMFILE while it does
    leaves the files in place (neither deleted nor quarantined) and the next start
    indexes them. A file with a bad header is still quarantined meanwhile."""
    t = open_nvme()
    blocks = three_blocks(t)
    t.close()
    shutil.rmtree(tmp_path / "nvme" / "index")                # the index is lost: headers must be read
    fault = FailingOs("open", errno.EMFILE)
    monkeypatch.setattr(tiers.nvme.format, "os", fault)
    t = open_nvme()
    rep = t.recovery
    assert (rep.unreadable, rep.quarantined, rep.adopted, len(t)) == (3, 0, 0, 0)
    assert all(file_of(t, k).exists() for k in blocks)
    assert not (tmp_path / "nvme" / "quarantine").exists()
    t.close()
    fault.on = False
    t = open_nvme()
    assert (t.recovery.adopted, t.recovery.unreadable, t.recovery.quarantined) == (3, 0, 0)
    assert {k: read(t, k) for k in blocks} == blocks


def test_an_indexed_file_whose_length_cannot_be_read_keeps_its_entry(tmp_path, open_nvme, monkeypatch):
    t = open_nvme()
    blocks = three_blocks(t)
    t.close()
    real_scandir = os.scandir

    class Entry:
        """A directory entry whose ``stat`` fails (EIO)."""

        def __init__(self, e):
            self._e = e

        def __getattr__(self, a):
            return getattr(self._e, a)

        def stat(self, **kw):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    class Os:
        """The ``os`` module, except that block files' entries fail their ``stat``."""

        def __getattr__(self, a):
            return getattr(os, a)

        @staticmethod
        def scandir(path):
            return [Entry(e) if len(e.name) == 64 else e for e in real_scandir(path)]

    monkeypatch.setattr(tiers.nvme.recover, "os", Os())
    t = open_nvme()
    monkeypatch.undo()
    assert (t.recovery.unreadable, t.recovery.dropped, t.recovery.quarantined, len(t)) == (3, 0, 0, 3)
    assert {k: read(t, k) for k in blocks} == blocks
