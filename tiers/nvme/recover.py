"""Reconciling the NVMe tier's index with its block files at start (the offline repair,
``kvstore repair-index PATH``, runs the same reconciliation: :mod:`tiers.nvme.repair`).

The block files are the truth; the index is a cache of their headers. At start every
file under ``blocks/`` is looked at once (``scandir`` + ``stat``; a header is read only
when the index does not vouch for the file):

==============================================  =========================================
found                                           done
==============================================  =========================================
``<hex>.tmp``                                   deleted: never renamed, so never a block
indexed file of the indexed length              kept (its checksums are checked on read)
file not indexed, or of another length, whose   indexed from its header (a crash between
header is valid and names this key              rename and index update, a lost index)
file with a bad header, a short file, a         moved to ``quarantine/`` (never deleted)
symbolic link, a key file in the wrong folder
file that cannot be opened or read (EMFILE,     left in place: its index entry kept when
EIO: no proof about the block)                  its length could not be checked, else not
                                                indexed until a start can read its header
index entry without a file                      dropped
any other name                                  left alone, with a warning
==============================================  =========================================

Before that, a folder of the earlier two-level layout (``blocks/ab/cd/<hex>``) has each
block file whose name fits it moved to its place in today's layout (``blocks/abc/<hex>``,
:func:`tiers.nvme.format.block_path`), unless a file is there already; what stays in it
is handled as above (a block file there is in the wrong folder), and the folder is
removed once empty.

So a damaged or lost index costs no block: the tier rebuilds it from the headers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import lmdb

from tiers.nvme.format import FOLDER_DIGITS, HeaderError, IndexEntry, block_path, key_of_name, read_header
from tiers.nvme.index import BlockIndex

log = logging.getLogger("kvstore.tiers.nvme")


@dataclass
class RecoveryReport:
    """What opening an NVMe tier folder found and did (counts of files and entries).

    Attributes:
        blocks: blocks indexed afterwards; ``file_bytes`` their files' bytes.
        adopted: block files indexed from their headers (not in the index before).
        corrected: index entries replaced from their file's header (another length).
        dropped: index entries without a usable file.
        quarantined: files moved to ``quarantine/`` (bad header, short, misplaced);
            ``quarantined_bytes`` their bytes (on disk, outside the tier's capacity).
        unreadable: block files that could not be opened or read (EMFILE, EIO): left
            in place, neither quarantined nor deleted.
        temps_removed: temp files of unfinished writes deleted.
        migrated: block files moved from the earlier two-level folder layout.
        trimmed: oldest blocks deleted because they exceeded the capacity.
        index_damage: why the old index could not be used (None when it could).
        index_moved_to: where the old index was moved (None when it was not).
        index_rebuilt: the index was rebuilt from the block files' headers.
    """

    blocks: int = 0
    file_bytes: int = 0
    adopted: int = 0
    corrected: int = 0
    dropped: int = 0
    quarantined: int = 0
    quarantined_bytes: int = 0
    unreadable: int = 0
    temps_removed: int = 0
    trimmed: int = 0
    migrated: int = 0
    index_damage: str | None = None
    index_moved_to: str | None = None
    index_rebuilt: bool = False
    quarantine_dir: str = field(default="", repr=False)

    def summary(self) -> str:
        parts = [f"{self.blocks} blocks ({self.file_bytes} bytes on disk)"]
        if self.index_rebuilt:
            parts.append("index rebuilt from the block files' headers")
        if self.index_damage:
            parts.append(f"old index damaged: {self.index_damage}")
        if self.index_moved_to:
            parts.append(f"old index kept in {self.index_moved_to}")
        for label, n in (("indexed from their headers", self.adopted), ("index entries corrected", self.corrected),
                         ("index entries without a file dropped", self.dropped),
                         ("temp files removed", self.temps_removed),
                         ("block files moved from the earlier folder layout", self.migrated),
                         ("block files that could not be read, left in place", self.unreadable),
                         ("oldest blocks deleted to fit the capacity", self.trimmed)):
            if n:
                parts.append(f"{n} {label}")
        if self.quarantined:
            parts.append(f"{self.quarantined} files ({self.quarantined_bytes} bytes) moved to "
                         f"{self.quarantine_dir}: bad header, short or misplaced; inspect and delete them")
        return "; ".join(parts)


class _Quarantine:
    def __init__(self, folder: str, report: RecoveryReport):
        self.folder = folder
        self.report = report
        report.quarantine_dir = folder

    def move(self, path: str, why: str) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        name = os.path.basename(path)
        target, n = os.path.join(self.folder, name), 1
        while os.path.lexists(target):
            n += 1
            target = os.path.join(self.folder, f"{name}.{n}")
        try:
            size = os.lstat(path).st_size
            os.rename(path, target)
        except OSError as e:
            log.warning("cannot move %s to %s: %s; left in place", path, self.folder, e)
            return
        self.report.quarantined += 1
        self.report.quarantined_bytes += size
        log.warning("moved %s to %s: %s", path, target, why)


def reconcile(blocks_dir: str, quarantine_dir: str, index: BlockIndex, report: RecoveryReport) -> None:
    """Make ``index`` agree with the block files under ``blocks_dir`` (see the module
    docstring); fills ``report``. Call with no write in flight. When the index cannot be
    written (a full or read-only disk), its in-memory entries are still made to agree with
    the files (the next start that can write it catches up). Raises OSError when
    ``blocks_dir`` cannot be listed."""
    quarantine = _Quarantine(quarantine_dir, report)
    kept: dict[bytes, IndexEntry] = {}
    updates: list[tuple[bytes, IndexEntry]] = []
    _migrate_two_levels(blocks_dir, index, quarantine, report)
    for top in os.scandir(blocks_dir):
        if not top.is_dir(follow_symlinks=False):
            log.warning("leaving alone an unknown file %s", top.path)
            continue
        if len(top.name) == FOLDER_DIGITS:
            for f in os.scandir(top.path):
                _classify(f, top.name, index, kept, updates, quarantine, report)
            continue
        for sub in os.scandir(top.path):    # what the earlier layout's migration left, or no block folder
            if len(top.name) == 2 and sub.is_dir(follow_symlinks=False):
                for f in os.scandir(sub.path):
                    _classify(f, None, index, kept, updates, quarantine, report)
                _remove_empty(sub.path)
            elif sub.is_dir(follow_symlinks=False):
                log.warning("leaving alone an unknown folder %s", sub.path)
            else:
                _classify(sub, None, index, kept, updates, quarantine, report)
        if len(top.name) == 2:
            _remove_empty(top.path)
    dropped = [k for k in index.entries if k not in kept]
    try:
        if dropped:
            index.delete(dropped)
        if updates:
            index.put_many(updates)
    except lmdb.Error as e:
        for k in dropped:
            index.entries.pop(k, None)
        index.entries.update(updates)
        log.warning("cannot bring the index on disk up to date with the block files (%s); serving what the "
                    "files hold (%d entries dropped, %d added or corrected in memory); the next start "
                    "catches up", e, len(dropped), len(updates))
    report.dropped += len(dropped)


def _migrate_two_levels(blocks_dir: str, index: BlockIndex, quarantine: _Quarantine,
                        report: RecoveryReport) -> None:
    """Move the block files of the earlier layout's folders (``ab/cd/<hex>``, ``abcd`` the
    key's first four hex digits) to today's (``abc/<hex>``) (:func:`reconcile` then removes
    the folders once emptied). Where both layouts hold a file of the key (a tier opened by
    an earlier build and then by this one), the file the index describes wins, else the
    later written one (:func:`_earlier_file_wins`). Fills ``report.migrated``."""
    olds = [top for top in os.scandir(blocks_dir) if len(top.name) == 2 and top.is_dir(follow_symlinks=False)]
    for top in olds:
        for sub in os.scandir(top.path):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(sub.path):
                key = key_of_name(f.name)
                if key is None or not f.name.startswith(top.name + sub.name) or not f.is_file(follow_symlinks=False):
                    continue
                target = block_path(blocks_dir, key)
                try:
                    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                    if os.path.lexists(target):
                        if not _earlier_file_wins(f.path, target, key, index):
                            continue        # left where it is: in the wrong folder then
                        quarantine.move(target, "a block file the earlier layout's copy replaces")
                        if os.path.lexists(target):
                            continue
                    os.rename(f.path, target)
                    report.migrated += 1
                except OSError as e:
                    log.warning("cannot move %s to %s: %s", f.path, target, e)
    if report.migrated:
        log.info("moved %d block files from the earlier two-level folder layout of %s",
                 report.migrated, blocks_dir)


def _earlier_file_wins(old: str, new: str, key: bytes, index: BlockIndex) -> bool:
    """Whether block file ``old`` (earlier layout) replaces ``new`` (today's) for ``key``: its
    header is valid and it is the one the index describes, or the index describes neither
    and it was written later (a valid header beats a bad one)."""
    try:
        old_header = read_header(old, key)
    except (HeaderError, OSError):
        return False
    try:
        new_header = read_header(new, key)
    except (HeaderError, OSError):
        return True
    entry = index.entries.get(key)
    old_matches, new_matches = IndexEntry.of(old_header) == entry, IndexEntry.of(new_header) == entry
    if old_matches != new_matches:
        return old_matches
    return old_header.written_at > new_header.written_at


def _remove_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:                         # not empty: something stays there
        pass


def _classify(f: os.DirEntry, prefix: str | None, index: BlockIndex, kept: dict, updates: list,
              quarantine: _Quarantine, report: RecoveryReport) -> None:
    """``f`` in a block folder named ``prefix`` (None: a folder of the earlier layout, where
    a block file is in the wrong folder)."""
    name = f.name
    if name.endswith(".tmp") and key_of_name(name[:-4]) is not None:
        try:
            os.unlink(f.path)
            report.temps_removed += 1
        except OSError as e:
            log.warning("cannot remove %s: %s", f.path, e)
        return
    key = key_of_name(name)
    if key is None:
        log.warning("leaving alone an unknown file %s", f.path)
        return
    if prefix is None or not name.startswith(prefix):
        quarantine.move(f.path, "a block file in the wrong folder")
        return
    if not f.is_file(follow_symlinks=False):
        quarantine.move(f.path, "not a regular file")
        return
    entry = index.entries.get(key)
    size = None
    try:
        size = f.stat(follow_symlinks=False).st_size
        if entry is not None and size == entry.file_bytes:
            kept[key] = entry
            return
        header = read_header(f.path, key)
    except HeaderError as e:
        quarantine.move(f.path, f"bad block header ({e})")
        return
    except OSError as e:          # EMFILE, EIO, ...: no proof; the file stays, the next start looks again
        _unreadable(f.path, key, entry if size is None else None, e, kept, report)
        return
    if size < header.header_bytes + header.size:
        quarantine.move(f.path, f"truncated: {size} of {header.file_bytes} bytes")
        return
    found = IndexEntry.of(header)
    kept[key] = found
    if entry is None:
        report.adopted += 1
        updates.append((key, found))
    elif entry != found:
        report.corrected += 1
        updates.append((key, found))


def _unreadable(path: str, key: bytes, entry: IndexEntry | None, e: OSError, kept: dict,
                report: RecoveryReport) -> None:
    """A block file that could not be looked at for a reason that proves nothing about
    it (too many open files, an I/O error). It is neither deleted nor quarantined:
    ``entry`` (an index entry the file's length could not be checked against) is kept,
    as every read verifies the bytes it serves; any other file is left out of the index
    for this run and indexed from its header at the next start."""
    report.unreadable += 1
    if entry is not None and not isinstance(e, FileNotFoundError):
        kept[key] = entry
    log.warning("cannot read %s (%s); left in place%s", path, e.strerror or e,
                "" if key in kept else ", not served until the next start indexes it")


def trim_to_capacity(index: BlockIndex, space, remove_file, name: str) -> int:
    """Delete the oldest written blocks (``remove_file(key, file bytes)``, then the index
    entries) until ``space.used`` fits ``space.configured``; return how many. For a
    folder reopened with a smaller capacity."""
    by_age = sorted(index.entries.items(), key=lambda kv: kv[1].written_at)
    victims = []
    for key, entry in by_age:
        if space.used <= space.configured:
            break
        victims.append(key)
        space.give(entry.file_bytes)
    log.warning("%s: %d stored blocks exceed the capacity of %d bytes; deleting the %d oldest",
                name, len(by_age), space.configured, len(victims))
    for key in victims:
        remove_file(key, index.entries[key].file_bytes)
    index.delete(victims)
    return len(victims)


__all__ = ["RecoveryReport", "reconcile", "trim_to_capacity"]
