"""The NVMe tier (:class:`NVMeTier`, in :mod:`tiers.nvme.tier`): blocks that survive restarts,
one self-describing file per block on a local disk in the format of :mod:`tiers.nvme.format`
(header with per-chunk xxh3_64 checksums, then the page-aligned payload); an LMDB index that
caches the headers and is rebuilt from them when lost or damaged; the folder opened, locked
and reconciled with its files at start (:mod:`tiers.nvme.folder`, :mod:`tiers.nvme.recover`);
two-phase writes through temp files (:mod:`tiers.nvme.commit`, :mod:`tiers.nvme.write`;
with fsync, commits in flight share their flushes: :mod:`tiers.nvme.group`);
ranged reads that verify every chunk they serve (:mod:`tiers.nvme.read`); capacity and
disk-full accounting, spare files, file I/O primitives; the offline repair and audit
(:mod:`tiers.nvme.repair`); and GPUDirect Storage between files and device memory
(:mod:`tiers.nvme.device`).
"""

from tiers.nvme.tier import IO_CHOICES, NVMeTier, ReadCounters

__all__ = ["IO_CHOICES", "NVMeTier", "ReadCounters"]
