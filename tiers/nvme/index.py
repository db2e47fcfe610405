"""The NVMe tier's LMDB index, opened so that a damaged index never crashes the process.

LMDB maps its data file and trusts it: a file shorter than its meta page says makes a
read of a missing page raise SIGBUS, and a page of garbage can trip an assertion inside
LMDB (``abort()``) or raise ``lmdb.CorruptedError``. So before this process maps the
index, :class:`BlockIndex`

1. checks ``data.mdb`` itself (:func:`check_data_file`): both meta pages (LMDB's
   ``MDB_meta``: magic 0xBEEFC0DE, version 1, page size) and a file long enough for the
   last page the newer meta page names;
2. has a child process read every entry and write a compacted copy
   (``mdb_env_copy2(MDB_CP_COMPACT)``: a fresh file holding only the pages reachable from
   the root, no free list), then swaps that copy in with one ``rename``; a child that
   fails, crashes or times out leaves this process untouched;
3. loads every entry into memory, checking each key and value.

A failure at any step is a damaged index: the index folder is moved aside to
``index.damaged-<UTC time>`` (kept, named in the log) and a fresh one is opened; the
tier then rebuilds it from the block files' headers (:mod:`tiers.nvme.recover`). An
index of the previous format (without :data:`~tiers.nvme.format.FORMAT_KEY`) is moved
aside the same way. Of the folders moved aside, the newest :data:`MOVED_INDEXES_KEPT` of
each kind (``damaged``, ``replaced``) are kept for inspection and older ones deleted each
time the index opens (:func:`prune_moved_indexes`; the log says which).

After loading, the index is only written (one transaction per commit or free, about
4 us with ``sync=False``); lookups use the in-memory copy. LMDB's own lock file is not
used (``lock=False``): the tier's flock on its folder already keeps out other processes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time

import lmdb

from tiers.nvme.format import FORMAT_KEY, FORMAT_VALUE, KEY_BYTES, IndexEntry

log = logging.getLogger("kvstore.tiers.nvme")

VERIFY_TIMEOUT_S = 600.0
"""Longest the child process may take to read and compact the index (seconds)."""

MOVED_INDEXES_KEPT = 2
"""Index folders moved aside kept per kind (``index.damaged-*``, ``index.replaced-*``),
the newest; a tier whose index keeps getting damaged does not fill its disk with them."""

_MOVED = re.compile(r"^index\.(damaged|replaced)-(\d{8}T\d{6}Z)(?:-(\d+))?$")

_MDB_MAGIC = 0xBEEFC0DE
_P_META = 0x08
_CHILD = """
import sys
sys.path.insert(0, sys.argv[4])
import lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, subdir=True, map_size=int(sys.argv[3]),
                max_dbs=0, readahead=False)
n = 0
with env.begin() as txn:
    for key, value in txn.cursor():
        n += 1
try:
    env.copy(sys.argv[2], compact=True)
except lmdb.Error as e:             # every entry read: the index is sound, the copy has no room
    sys.stderr.write(f"{type(e).__name__}: {e}\\n")
    sys.exit(3)
env.close()
print(n)
"""
_COPY_FAILED = 3
"""Exit status of the child when every entry was read but the compacted copy could not be
written (a full disk, a quota): the index is sound."""


class IndexDamaged(Exception):
    """The index cannot be trusted; the message says why."""


def check_data_file(path: str) -> None:
    """Check an LMDB data file's meta pages and length without mapping it.

    Raises IndexDamaged naming what is wrong (an empty file, bad meta pages, a file
    shorter than its last page); OSError when it cannot be read.
    """
    if not os.path.isfile(path):
        raise IndexDamaged(f"{path} is not a regular file")
    size = os.path.getsize(path)
    if size == 0:
        raise IndexDamaged(f"{path} is empty (0 bytes)")
    with open(path, "rb") as f:
        first = f.read(4096)
        if len(first) < 136 + 16:
            raise IndexDamaged(f"{path} is {size} bytes, shorter than one meta page")
        psize = struct.unpack_from("<I", first, 40)[0]
        if psize < 512 or psize > 65536 or psize & (psize - 1):
            raise IndexDamaged(f"{path}: meta page 0 gives a page size of {psize}")
        f.seek(psize)
        second = f.read(152)
    metas = []
    for n, page in enumerate((first, second)):
        if len(page) < 152:
            raise IndexDamaged(f"{path} is {size} bytes, shorter than its two meta pages")
        flags = struct.unpack_from("<H", page, 10)[0]
        magic, version = struct.unpack_from("<II", page, 16)
        if not flags & _P_META or magic != _MDB_MAGIC or version != 1:
            raise IndexDamaged(f"{path}: meta page {n} is not an LMDB meta page")
        last_page, txnid = struct.unpack_from("<QQ", page, 136)
        metas.append((txnid, last_page))
    txnid, last_page = max(metas)
    if (last_page + 1) * psize > size:
        raise IndexDamaged(f"{path} is {size} bytes but its meta page (transaction {txnid}) "
                           f"names page {last_page}: the file was truncated")


def compact_copy(index_dir: str, fsync: bool) -> int:
    """Read every entry of the index in ``index_dir`` in a child process and replace its
    data file with a compacted copy; return the number of entries read.

    Raises IndexDamaged when the child fails to read the index, crashes or times out (the
    data file is then left as it was); OSError when the compacted copy cannot be written
    (the index read back whole: it is sound) or the swap fails.
    """
    data = os.path.join(index_dir, "data.mdb")
    work = index_dir + ".compact"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, mode=0o700)
    map_size = max(os.path.getsize(data) * 2, 1 << 20)
    lmdb_parent = os.path.dirname(os.path.dirname(os.path.abspath(lmdb.__file__)))
    try:
        try:
            done = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, index_dir, work, str(map_size),
                                   lmdb_parent], capture_output=True, text=True, timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise IndexDamaged(f"reading {data} took over {VERIFY_TIMEOUT_S:.0f} s") from None
        if done.returncode == _COPY_FAILED:
            detail = (done.stderr.strip().splitlines() or [""])[-1]
            raise OSError(f"{data} reads back whole, but its compacted copy cannot be written ({detail})")
        if done.returncode != 0:
            how = (f"crashed with signal {-done.returncode}" if done.returncode < 0
                   else f"failed (exit {done.returncode})")
            detail = (done.stderr.strip().splitlines() or [""])[-1]
            raise IndexDamaged(f"reading {data} {how}" + (f": {detail}" if detail else ""))
        copy = os.path.join(work, "data.mdb")
        check_data_file(copy)
        if fsync:
            fd = os.open(copy, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(copy, data)
        return int(done.stdout.strip() or 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def move_index_aside(folder: str, why: str) -> str:
    """Rename ``folder/index`` to ``folder/index.<why>-<UTC time>``; return the new path.
    Raises OSError."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    taken = [int(m.group(3) or 1) for m in map(_MOVED.match, os.listdir(folder))
             if m and m.group(1) == why and m.group(2) == stamp]
    n = max(taken, default=0) + 1        # after every one of this second: the newest sorts last
    target = os.path.join(folder, f"index.{why}-{stamp}" + (f"-{n}" if n > 1 else ""))
    os.rename(os.path.join(folder, "index"), target)
    return target


def prune_moved_indexes(folder: str, keep: int = MOVED_INDEXES_KEPT) -> tuple[list[str], list[str]]:
    """Delete all but the newest ``keep`` index folders of each kind moved aside in
    ``folder`` (:func:`move_index_aside`). Returns ``(kept, deleted)`` paths; a folder that
    cannot be deleted is logged and kept."""
    by_kind: dict[str, list[tuple[tuple[str, int], str]]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return [], []
    for name in names:
        m = _MOVED.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            by_kind.setdefault(m.group(1), []).append(((m.group(2), int(m.group(3) or 1)), name))
    kept, deleted = [], []
    for moved in by_kind.values():
        moved.sort(reverse=True)                    # newest first: by UTC time, then by its -N
        for i, (_, name) in enumerate(moved):
            path = os.path.join(folder, name)
            if i < keep:
                kept.append(path)
                continue
            try:
                shutil.rmtree(path)
                deleted.append(path)
            except OSError as e:
                log.warning("cannot delete the old index folder %s: %s", path, e.strerror or e)
                kept.append(path)
    return sorted(kept), sorted(deleted)


class BlockIndex:
    """The tier's index: ``entries`` maps each indexed key to its :class:`IndexEntry`.

    Args:
        folder: the tier's folder; the index lives in ``folder/index``.
        fsync: LMDB flushes each transaction to the device.
        map_size: initial map size in bytes; doubled whenever a transaction fills it.

    After construction ``damage`` is None, or the reason the old index could not be used
    and ``moved_to`` the folder it was moved to; ``entries`` is then empty and the caller
    rebuilds it from the block files. ``rebuild=True`` moves a sound index aside too
    (``index.replaced-<UTC time>``). Old folders moved aside are pruned to the newest
    :data:`MOVED_INDEXES_KEPT` of each kind (``kept_aside``, ``deleted_aside``: their paths).
    Raises OSError when no index can be opened at all.
    """

    def __init__(self, folder: str, *, fsync: bool = False, map_size: int = 1 << 30, name: str = "nvme",
                 rebuild: bool = False):
        self.folder = folder
        self.dir = os.path.join(folder, "index")
        self.name = name
        self._fsync = fsync
        self._map_size = max(map_size, 1 << 16)
        self.entries: dict[bytes, IndexEntry] = {}
        self.damage: str | None = None
        self.moved_to: str | None = None
        self.absent = not os.path.exists(os.path.join(self.dir, "data.mdb"))
        self._env: lmdb.Environment | None = None
        self._writing = threading.RLock()    # one write transaction at a time (LMDB's own lock is off)
        self._open(rebuild)
        self.kept_aside, self.deleted_aside = prune_moved_indexes(folder)
        if self.deleted_aside:
            log.info("%s: deleted %d old index folders moved aside (%s); the newest %d of each kind are kept",
                     name, len(self.deleted_aside), ", ".join(os.path.basename(p) for p in self.deleted_aside),
                     MOVED_INDEXES_KEPT)
        if self.kept_aside:
            log.info("%s: index folders moved aside and kept for inspection (the newest %d of each kind): %s",
                     name, MOVED_INDEXES_KEPT, ", ".join(os.path.basename(p) for p in self.kept_aside))

    def _open(self, rebuild: bool) -> None:
        name = self.name
        try:
            if os.path.lexists(self.dir) and not os.path.isdir(self.dir):
                raise IndexDamaged(f"{self.dir} is not a folder")
            if self.absent:
                self._open_fresh()
                return
            self._open_checked()
            if rebuild:                                  # sound, but the caller wants it rebuilt
                self._close_env()
                self.moved_to = self.move_aside("replaced")
                self.entries = {}
                self._open_fresh()
        except IndexDamaged as e:
            self._close_env()
            self.damage = str(e)
            self.moved_to = self.move_aside("damaged")
            log.warning("%s: the index is damaged (%s); moved it to %s and rebuilding it from the block "
                        "files' headers", name, e, self.moved_to)
            self.entries = {}
            self._open_fresh()

    # ------------------------------------------------------------------ opening

    def _open_checked(self) -> None:
        data = os.path.join(self.dir, "data.mdb")
        check_data_file(data)
        try:
            compact_copy(self.dir, self._fsync)
        except (OSError, subprocess.SubprocessError) as e:      # no child process here: read it in-process
            log.warning("%s: the index was not checked and compacted in a child process (%s); "
                        "opening it directly", self.name, e)
        lock = os.path.join(self.dir, "lock.mdb")       # from a run that used LMDB's lock file
        if os.path.exists(lock):
            os.unlink(lock)
        self._open_env(max(self._map_size, os.path.getsize(data) * 2))
        try:
            with self._env.begin() as txn:
                marker = txn.get(FORMAT_KEY)
                if marker != FORMAT_VALUE and txn.stat()["entries"] > (marker is not None):
                    raise IndexDamaged("the index is of another format (an older kvstore's)")
                for key, value in txn.cursor():
                    if key == FORMAT_KEY:
                        continue
                    if len(key) != KEY_BYTES:
                        raise IndexDamaged(f"an index key of {len(key)} bytes")
                    try:
                        self.entries[bytes(key)] = IndexEntry.unpack(bytes(value))
                    except ValueError as e:
                        raise IndexDamaged(f"block {bytes(key).hex()[:16]}: {e}") from None
        except lmdb.Error as e:
            raise IndexDamaged(f"LMDB: {e}") from None
        if marker != FORMAT_VALUE:                      # an empty index: ours from now on
            self._txn(lambda txn: txn.put(FORMAT_KEY, FORMAT_VALUE))

    def _open_fresh(self) -> None:
        """Create an empty index. Raises OSError when it cannot be created (a full or
        read-only disk): that is the medium, not a damaged index."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        try:
            self._open_env(self._map_size)
        except IndexDamaged as e:
            raise OSError(f"cannot create an index in {self.dir}: {e}") from None
        self._txn(lambda txn: txn.put(FORMAT_KEY, FORMAT_VALUE))

    def _open_env(self, map_size: int) -> None:
        try:
            # metasync off: a commit flushes once (its pages), not twice; a power loss may then
            # undo the last transaction, whose blocks' files and names are already flushed
            # and are adopted from their headers at the next start (tiers.nvme.recover)
            self._env = lmdb.open(self.dir, map_size=map_size, subdir=True, lock=False, sync=self._fsync,
                                  metasync=False, readahead=False, meminit=False, max_dbs=0)
        except lmdb.Error as e:
            raise IndexDamaged(f"LMDB cannot open it: {e}") from None

    def _close_env(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def move_aside(self, why: str) -> str:
        """Rename the index folder aside (:func:`move_index_aside`); return the new path."""
        return move_index_aside(self.folder, why)

    # ------------------------------------------------------------------ writing

    def _txn(self, apply) -> None:
        """Run ``apply(txn)`` in one write transaction, growing the map when it is full.
        Transactions run one at a time (no other transaction of this process is open,
        as ``set_mapsize`` requires). Raises lmdb.Error."""
        with self._writing:
            self._txn_serialised(apply)

    def _txn_serialised(self, apply) -> None:
        if self._env is None:
            raise lmdb.Error(f"{self.name}: the index is closed")
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    apply(txn)
                return
            except lmdb.MapFullError:
                size = self._env.info()["map_size"] * 2
                log.info("%s: index map full; growing it to %d bytes", self.name, size)
                self._env.set_mapsize(size)

    def put(self, key: bytes, entry: IndexEntry, stale: tuple[bytes, ...] | list[bytes] = ()) -> None:
        """Index one block, dropping in the same transaction the entries of ``stale`` keys not
        indexed in memory (evicted blocks whose files were reused: :mod:`tiers.nvme.parked`).
        Raises lmdb.Error (the in-memory copy is then unchanged)."""
        self.put_many([(key, entry)], stale)

    def _drop_stale(self, txn, stale) -> None:
        for k in stale:             # under ``_writing``: a commit of that key is wholly before or after
            if k not in self.entries:
                txn.delete(k)

    def drop_stale(self, stale: list[bytes]) -> None:
        """:meth:`put`'s deletion of ``stale`` keys alone. Raises lmdb.Error."""
        with self._writing:
            self._txn(lambda txn: self._drop_stale(txn, stale))

    def put_many(self, items: list[tuple[bytes, IndexEntry]], stale: list[bytes] | tuple = ()) -> None:
        """Index several blocks in one transaction (thread-safe, like every write here), dropping
        ``stale`` keys as :meth:`put` does. Raises lmdb.Error (the in-memory copy unchanged)."""
        packed = [(k, e.pack()) for k, e in items]

        def apply(txn) -> None:
            self._drop_stale(txn, stale)
            for k, v in packed:
                txn.put(k, v)
        with self._writing:
            self._txn(apply)
            self.entries.update(items)

    def delete(self, keys: list[bytes]) -> None:
        """Drop entries (unknown keys are skipped). Raises lmdb.Error."""
        with self._writing:
            self._txn(lambda txn: [txn.delete(k) for k in keys])
            for k in keys:
                self.entries.pop(k, None)

    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def close(self) -> None:
        with self._writing:                  # a transaction in flight ends first (LMDB would hang)
            if self._env is not None:
                if self._fsync:
                    self._env.sync(True)
                self._close_env()


__all__ = ["BlockIndex", "IndexDamaged", "MOVED_INDEXES_KEPT", "VERIFY_TIMEOUT_S", "check_data_file", "compact_copy",
           "move_index_aside", "prune_moved_indexes"]
