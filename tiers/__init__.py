"""Storage media behind one interface (:class:`tiers.base.Tier`)."""

from tiers.base import ByteRanges, Tier, TierKind, check_chunk, check_ranges

__all__ = ["ByteRanges", "Tier", "TierKind", "check_chunk", "check_ranges"]
