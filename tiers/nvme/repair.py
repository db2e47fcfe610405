"""Offline tools for a closed NVMe tier folder: the index repair (``kvstore repair-index
PATH``: the index rebuilt from the block files' headers, as at start) and the audit (the
index compared with the files, changing nothing; for tests and operators).
"""

from __future__ import annotations

import os

import lmdb
import xxhash

from tiers.errors import MediaUnavailable
from tiers.nvme.format import FOLDER_DIGITS, FORMAT_KEY, HeaderError, IndexEntry, key_of_name, read_header
from tiers.nvme.index import check_data_file
from tiers.nvme.recover import RecoveryReport
from tiers.nvme.tier import NVMeTier


def audit_folder(path: str | os.PathLike, verify_payload: bool = True) -> dict:
    """Compare a closed NVMe tier folder's index with its block files, changing nothing
    (for tests and operators). Reads the index read-only after :func:`check_data_file`.

    Returns counts: ``indexed``, ``files`` (block files), ``temp`` (``*.tmp``), ``orphans``
    (block files without an index entry; the next start indexes them from their header
    when it is valid), ``missing`` (entries without a file), ``bad_size`` (file length
    not the entry's), ``bad_header``, ``bad_checksum`` (a payload chunk fails, when
    ``verify_payload``), ``misplaced`` (not under ``abc/`` of their name), ``other``
    (any other file under ``blocks/``), and ``keys`` (the indexed keys, a set).
    Raises IndexDamaged for an index that fails the check.
    """
    folder = os.path.abspath(os.fspath(path))
    out = dict(indexed=0, files=0, temp=0, orphans=0, missing=0, bad_size=0, bad_header=0, bad_checksum=0,
               misplaced=0, other=0, keys=set())
    index: dict[bytes, IndexEntry] = {}
    if os.path.exists(os.path.join(folder, "index", "data.mdb")):
        check_data_file(os.path.join(folder, "index", "data.mdb"))
        env = lmdb.open(os.path.join(folder, "index"), readonly=True, lock=False, subdir=True)
        try:
            with env.begin() as txn:
                index = {bytes(k): IndexEntry.unpack(bytes(v)) for k, v in txn.cursor() if k != FORMAT_KEY}
        finally:
            env.close()
    out["indexed"], out["keys"] = len(index), set(index)
    seen = set()
    for root, _, names in os.walk(os.path.join(folder, "blocks")):
        for name in names:
            f = os.path.join(root, name)
            if name.endswith(".tmp"):
                out["temp"] += 1
                continue
            key = key_of_name(name)
            if key is None:
                out["other"] += 1
                continue
            out["files"] += 1
            if os.path.relpath(root, os.path.join(folder, "blocks")) != name[:FOLDER_DIGITS]:
                out["misplaced"] += 1
            entry = index.get(key)
            if entry is None:
                out["orphans"] += 1
                continue
            seen.add(key)
            if os.lstat(f).st_size != entry.file_bytes:
                out["bad_size"] += 1
                continue
            try:
                header = read_header(f, key)
            except HeaderError:
                out["bad_header"] += 1
                continue
            if verify_payload:
                with open(f, "rb") as fh:
                    fh.seek(header.header_bytes)
                    data = memoryview(fh.read(header.size))
                c = header.chunk_bytes
                if [xxhash.xxh3_64_intdigest(data[i:i + c]) for i in range(0, header.size, c)] != list(header.sums):
                    out["bad_checksum"] += 1
    out["missing"] = len(set(index) - seen)
    return out


def repair_index(path: str | os.PathLike) -> RecoveryReport:
    """Rebuild the index of an NVMe tier folder from its block files' headers, offline.

    The current index (damaged or not) is moved aside to ``index.replaced-<UTC time>``
    (or ``index.damaged-...``) and kept; files are handled as at start (:mod:`tiers.nvme.recover`), no block is deleted for capacity. Needs the folder's lock: no daemon may
    be using the folder.

    Returns the :class:`RecoveryReport`. Raises :class:`tiers.errors.MediaUnavailable`
    (folder missing, in use, or unusable).
    """
    folder = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.join(folder, "blocks")):
        raise MediaUnavailable(f"{folder} is not an NVMe tier folder (it has no blocks/ folder)")
    tier = NVMeTier(folder, 1 << 62, direct=False, spare_files=0, rebuild_index=True)
    try:
        return tier.recovery
    finally:
        tier.close()


__all__ = ["audit_folder", "repair_index"]
