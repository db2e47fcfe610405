"""Index folders moved aside do not pile up (issue 19, item 20): every damaged index was
moved to ``index.damaged-<time>`` and kept forever. The newest
:data:`~tiers.nvme.index.MOVED_INDEXES_KEPT` of each kind are kept, older ones deleted when
the tier opens, and the log says which."""

from __future__ import annotations

import logging
import os

from tiers.nvme import NVMeTier
from tiers.nvme.index import MOVED_INDEXES_KEPT
from rel_support import key, payload


def moved(path, kind: str = "damaged") -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(f"index.{kind}-"))


def put(t: NVMeTier, k: bytes, data: bytes) -> None:
    t.reserve(k, len(data))
    t.write(k, 0, data)
    t.commit(k)


def test_only_the_newest_damaged_indexes_are_kept(tmp_path, caplog):
    path = tmp_path / "nvme"
    t = NVMeTier(path, 64 << 20)
    blocks = {key(i, "aside"): payload(key(i, "aside"), 5000) for i in range(3)}
    for k, v in blocks.items():
        put(t, k, v)
    t.close()
    latest = []
    for _ in range(MOVED_INDEXES_KEPT + 3):              # the index damaged again and again
        os.truncate(path / "index" / "data.mdb", 0)
        with caplog.at_level(logging.INFO, logger="kvstore.tiers.nvme"):
            t = NVMeTier(path, 64 << 20)
        assert dict(t.recover()) == {k: len(v) for k, v in blocks.items()}       # no block lost
        latest.append(os.path.basename(t.recovery.index_moved_to))
        t.close()
    assert moved(path) == sorted(latest[-MOVED_INDEXES_KEPT:])                    # the newest ones
    assert "deleted 1 old index folders moved aside" in caplog.text
    assert "kept for inspection" in caplog.text


def test_older_folders_moved_aside_are_pruned_at_start_per_kind(tmp_path):
    path = tmp_path / "nvme"
    NVMeTier(path, 64 << 20).close()
    for name in ["index.damaged-20240101T000000Z", "index.damaged-20240102T000000Z",
                 "index.damaged-20240102T000000Z-2", "index.damaged-20240102T000000Z-10",
                 "index.replaced-20230101T000000Z", "index.replaced-20250101T000000Z",
                 "index.replaced-20240101T000000Z", "index.damaged-notes"]:
        (path / name).mkdir()
    t = NVMeTier(path, 64 << 20)
    try:
        assert t.recovery.index_damage is None
    finally:
        t.close()
    # the newest two damaged (by time, then -N: -10 after -2); a folder not named by the tier is left alone
    assert moved(path) == sorted(["index.damaged-20240102T000000Z-10", "index.damaged-20240102T000000Z-2",
                                  "index.damaged-notes"])
    assert moved(path, "replaced") == ["index.replaced-20240101T000000Z", "index.replaced-20250101T000000Z"]
