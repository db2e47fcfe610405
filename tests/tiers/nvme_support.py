"""Helpers shared by the NVMe tier tests: keys, payloads, puts, file paths. Their fixtures
(``io_mode``, ``open_nvme``) are in conftest.py."""

from __future__ import annotations

import pathlib

import numpy as np
from tiers.base import read_bytes
from tiers.nvme.tier import NVMeTier
from tiers.nvme.format import DEFAULT_CHUNK_BYTES, block_path, file_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]


def K(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def payload(key: bytes, n: int) -> bytes:
    """``n`` bytes derived from ``key``, so a wrong block (or a wrong offset) is visible."""
    seed = int.from_bytes(key[:8], "big") % 251
    return ((np.arange(n, dtype=np.int64) * 13 + seed) % 251).astype(np.uint8).tobytes()


def disk_bytes(n: int) -> int:
    """A block's file size (header + payload pages) at the default chunk size."""
    return file_bytes(n, DEFAULT_CHUNK_BYTES)


def put(tier, key: bytes, data: bytes, chunk: int | None = None) -> None:
    tier.reserve(key, len(data))
    chunk = chunk or max(len(data), 1)
    for off in range(0, len(data), chunk):
        tier.write(key, off, data[off:off + chunk])
    tier.commit(key)


def read(tier, key: bytes, ranges=None) -> bytes:
    return read_bytes(tier, key, ranges)


def block_files(root) -> list[str]:
    """Paths of all files under ``root/blocks``, relative to it."""
    base = pathlib.Path(root) / "blocks"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file() or p.is_symlink())


def file_of(tier_or_path, key: bytes) -> pathlib.Path:
    root = tier_or_path.path if isinstance(tier_or_path, NVMeTier) else tier_or_path
    return pathlib.Path(block_path(str(pathlib.Path(root) / "blocks"), key))
