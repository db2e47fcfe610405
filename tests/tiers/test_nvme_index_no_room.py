"""An NVMe folder on a disk with no room left (the disk-full case met by an operator: a
daemon killed while its disk was full, then restarted on it).

- A sound index whose compacted copy cannot be written is a sound index: it is opened as
  it is, never moved aside as damaged (which would throw away a good index and then need
  room to build a new one).
- When no index can be created at all (the disk refuses LMDB's files), opening the tier
  fails with :class:`~tiers.errors.MediaUnavailable` naming the cause (the daemon turns it
  into a one-line error), never an internal exception.
"""

from __future__ import annotations

import os
import types

import lmdb
import pytest

from nvme_support import K, payload, put, read
from tiers.nvme import index as nvme_index
from tiers.errors import MediaUnavailable
from tiers.nvme.tier import NVMeTier


def _no_compaction_folder(monkeypatch):
    """The child that checks the index reads it whole, but cannot write its compacted
    copy (its folder is never made, as when the disk has no room left for it)."""
    fake_os = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    real_makedirs = os.makedirs

    def makedirs(path, *args, **kwargs):
        if str(path).endswith(".compact"):
            return None
        return real_makedirs(path, *args, **kwargs)

    fake_os.makedirs = makedirs
    monkeypatch.setattr(nvme_index, "os", fake_os)


def test_a_sound_index_whose_compacted_copy_cannot_be_written_is_kept(tmp_path, monkeypatch):
    path = tmp_path / "nvme"
    t = NVMeTier(path, 64 << 20)
    for i in range(20):
        put(t, K(i), payload(K(i), 5000 + i))
    t.close()
    _no_compaction_folder(monkeypatch)
    t = NVMeTier(path, 64 << 20)
    try:
        assert t.recovery.index_damage is None
        assert t.recovery.index_moved_to is None
        assert sorted(p.name for p in path.iterdir() if p.name.startswith("index")) == ["index"]
        for i in range(20):
            assert read(t, K(i)) == payload(K(i), 5000 + i)
    finally:
        t.close()


def test_no_room_for_any_index_is_tier_unavailable(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise lmdb.DiskError("mdb_env_open: No space left on device")

    monkeypatch.setattr(nvme_index.lmdb, "open", refuse)
    with pytest.raises(MediaUnavailable, match="No space left on device"):
        NVMeTier(tmp_path / "nvme", 64 << 20)


def test_a_tier_whose_index_cannot_be_written_at_start_opens_from_its_files(tmp_path, monkeypatch):
    """Block files deleted while the index could not record it (a full disk): at the next
    start the index must drop them, but the disk still refuses the write. The tier opens
    all the same, holding exactly the blocks whose files are there (the next start that
    can write the index brings it up to date)."""
    path = tmp_path / "nvme"
    t = NVMeTier(path, 64 << 20)
    for i in range(10):
        put(t, K(i), payload(K(i), 7000 + i))
    t.close()
    for i in range(5):                      # their files are gone, the index still lists them
        os.unlink(next(path.glob(f"blocks/*/{K(i).hex()}")))

    def no_room(self, apply):
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")

    monkeypatch.setattr(nvme_index.BlockIndex, "_txn", no_room)
    t = NVMeTier(path, 64 << 20)
    try:
        assert len(t) == 5
        assert not any(K(i) in t for i in range(5))
        for i in range(5, 10):
            assert read(t, K(i)) == payload(K(i), 7000 + i)
    finally:
        t.close()
