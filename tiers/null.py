"""A tier that accounts bytes but stores none: the simulator's stand-in for any medium."""

from __future__ import annotations

from tiers.base import Tier, TierKind
from tiers.buffers import ByteRanges, check_ranges
from tiers.errors import BlockExists, BlockNotStored, NoRoom


class NullTier(Tier):
    """Capacity accounting only; :meth:`read_into` reports the bytes it would copy and
    leaves the output buffer as it is.

    Used by ``kvstore simulate`` to run the manager's placement logic on a trace
    with virtual time and no data.
    """

    def __init__(self, kind: TierKind, capacity_bytes: int, name: str | None = None, *,
                 volatile: bool | None = None):
        self.kind = kind
        self.name = name or kind.name.lower()
        self.volatile = kind in (TierKind.HBM, TierKind.HOST) if volatile is None else volatile
        self._capacity = int(capacity_bytes)
        self._used = 0
        self._sizes: dict[bytes, int] = {}
        self._reserved: dict[bytes, int] = {}

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def fits(self, nbytes: int) -> bool:
        return self._used + nbytes <= self._capacity

    def size_of(self, key: bytes) -> int:
        try:
            return self._sizes[key]
        except KeyError:
            raise BlockNotStored(f"block {key.hex()[:16]} is not stored in {self.name}") from None

    def reserve(self, key: bytes, nbytes: int) -> None:
        if key in self._sizes or key in self._reserved:
            raise BlockExists(f"block {key.hex()[:16]} already present in {self.name}")
        if not self.fits(nbytes):
            raise NoRoom(f"{self.name}: {nbytes} bytes do not fit ({self._used}/{self._capacity} used)")
        self._reserved[key] = nbytes
        self._used += nbytes

    def write(self, key: bytes, offset: int, data) -> None:
        if key not in self._reserved:
            raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}")

    def commit(self, key: bytes) -> None:
        try:
            self._sizes[key] = self._reserved.pop(key)
        except KeyError:
            raise BlockNotStored(f"block {key.hex()[:16]} is not reserved in {self.name}") from None

    def abort(self, key: bytes) -> None:
        nbytes = self._reserved.pop(key, None)
        if nbytes is not None:
            self._used -= nbytes

    def read_into(self, key: bytes, out, ranges: ByteRanges | None = None) -> int:
        return check_ranges(ranges, self.size_of(key))

    def free(self, key: bytes) -> None:
        self._used -= self.size_of(key)
        del self._sizes[key]
