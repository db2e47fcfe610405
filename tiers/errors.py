"""Errors raised by storage media (:mod:`tiers`).

A tier knows nothing of requests, tenants or configuration; it reports what happened
to the medium. The store core (:mod:`kvstore.store.manager`) turns these into the store's
own errors (:mod:`kvstore.common.errors`) at its boundary, so nothing here crosses to a
client.

==================  ===========================================================
error               meaning
==================  ===========================================================
NoRoom            no (contiguous) room for the reservation; evict and retry
DiskFull            the filesystem filled before the tier reached its capacity
BlockNotStored      the key is not committed (or not reserved) in this tier
BlockExists         the key is already reserved or committed in this tier
InvalidAccess       an out-of-order chunk, a byte range outside the block, a
                    commit before every byte arrived, an output buffer too small
BlockCorrupt        stored bytes fail their checksum or are truncated; never served
MediaIOError         the medium failed (I/O error, device gone, remote peer down)
MediaUnavailable     the medium cannot be opened: its folder cannot be created or
                    used, another process holds it, its index cannot be rebuilt
==================  ===========================================================
"""

from __future__ import annotations


class MediaError(Exception):
    """Base class of every medium error."""


class NoRoom(MediaError):
    """Not enough free (contiguous) space for a reservation, or a block larger than the
    largest block the tier can ever hold."""


class BlockNotStored(MediaError, KeyError):
    """The key is not committed (or, for reservation calls, not reserved) here."""

    def __str__(self) -> str:          # KeyError would quote the message
        return str(self.args[0]) if self.args else "block not stored"


class BlockExists(MediaError, ValueError):
    """A reservation of a key that this tier already holds or is writing."""


class InvalidAccess(MediaError, ValueError):
    """A call that breaks the tier protocol: an out-of-order or oversize chunk, a commit
    before every reserved byte was written, a byte range outside the block, an output
    buffer smaller than what is read."""


class BlockCorrupt(MediaError):
    """A block's stored bytes fail their checksum or are truncated. The block is never
    served; the caller drops this copy."""


class BlockMissing(BlockCorrupt):
    """The block's stored bytes are gone (its file deleted from under the tier): dropped as
    a corrupt copy is, counted apart (``copies_missing``, not ``corrupt_blocks``)."""


class MediaIOError(MediaError, OSError):
    """The medium failed: an I/O error, a timeout, a device or remote peer gone."""


class MediaUnavailable(MediaIOError):
    """A tier cannot be opened: its folder cannot be created or used, another process
    (a second daemon) holds it, or its damaged index cannot be moved aside and rebuilt.
    The message names the folder and, where one exists, the command that repairs it."""


class DiskFull(MediaIOError, NoRoom):
    """The filesystem ran out of space (ENOSPC/EDQUOT) before the tier reached its
    configured capacity. It is a NoRoom (evict and retry) and a MediaIOError."""


__all__ = ["MediaError", "NoRoom", "BlockNotStored", "BlockExists", "InvalidAccess", "BlockCorrupt",
           "BlockMissing", "MediaIOError", "MediaUnavailable", "DiskFull"]
