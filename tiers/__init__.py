"""Storage media behind one interface: the :class:`~tiers.base.Tier` every medium implements
(:mod:`tiers.base`, with its typed capabilities in :mod:`tiers.capabilities` and the checks
on byte ranges and buffers in :mod:`tiers.buffers`) and the errors media raise
(:mod:`tiers.errors`); the media: GPU memory (:mod:`tiers.hbm`, over the slabs of
:mod:`tiers.slab`), the host arena (:mod:`tiers.host`), files on NVMe (:mod:`tiers.nvme`),
a Mooncake Store cluster (:mod:`tiers.mooncake`) and the byte-less tier of the simulator
(:mod:`tiers.null`); and what they share: the extent allocators (:mod:`tiers.allocator`),
host buffers (:mod:`tiers.memory`), GPU detection and pinned memory (:mod:`tiers.gpu`) and
GPUDirect Storage file I/O (:mod:`tiers.gds`). A tier knows nothing of requests, policies
or the store, and never evicts on its own.
"""

from tiers.base import ByteRanges, Tier, TierKind, check_chunk, check_ranges

__all__ = ["ByteRanges", "Tier", "TierKind", "check_chunk", "check_ranges"]
