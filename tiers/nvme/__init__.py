"""The NVMe tier: one self-describing file per block on a local disk (:mod:`tiers.nvme.format`),
an LMDB index that a damaged file never crashes, two-phase writes through temp files, ranged
reads verified by per-chunk checksums, capacity accounting, spare files, recovery at start,
and GPUDirect Storage where a GPU is present.
"""

from tiers.nvme.tier import IO_CHOICES, NVMeTier, ReadCounters

__all__ = ["IO_CHOICES", "NVMeTier", "ReadCounters"]
