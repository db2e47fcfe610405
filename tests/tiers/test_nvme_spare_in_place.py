"""NVMe tier: a new block is written into a spare file where it lies and renamed once, at
commit, to its name (one rename where renaming the spare to ``<hex>.tmp`` cost two); it
carries no block's name until it holds a whole block. Both I/O modes, as test_nvme.py.
"""

import os
import pathlib

from nvme_support import K, block_files, disk_bytes, file_of, payload, put, read


def spare_dir(t) -> pathlib.Path:
    return pathlib.Path(t.path) / "spare"


def test_a_spare_file_is_written_where_it_lies_and_renamed_once(open_nvme, monkeypatch):
    t = open_nvme()
    put(t, K(1), payload(K(1), 60_000))
    t.free(K(1))                                        # a free moves the file to the spare files
    (spare,) = spare_dir(t).iterdir()
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((a, b)), real_rename(a, b))[1])
    t.reserve(K(2), 60_000)
    t.write(K(2), 0, payload(K(2), 60_000))
    assert renames == [] and not file_of(t, K(2)).exists()     # no block's name while it is written
    t.commit(K(2))
    monkeypatch.undo()
    assert renames == [(str(spare), str(file_of(t, K(2))))]
    assert read(t, K(2)) == payload(K(2), 60_000) and list(spare_dir(t).iterdir()) == []


def test_a_spare_file_left_half_written_by_a_crash_is_a_spare_file_again(open_nvme):
    t = open_nvme()
    put(t, K(1), payload(K(1), 60_000))
    t.free(K(1))
    t.reserve(K(2), 60_000)
    t.write(K(2), 0, payload(K(2), 60_000))             # written, never committed: the process dies
    t._folder.close()                                   # (its folder lock released as by the kill)
    t._closed = True
    t2 = open_nvme()
    assert dict(t2.recover()) == {} and t2.recovery.quarantined == 0
    assert t2.spare_bytes == disk_bytes(60_000) and block_files(t2.path) == []
    put(t2, K(3), payload(K(3), 60_000))
    assert read(t2, K(3)) == payload(K(3), 60_000)
