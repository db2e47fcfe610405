"""Fixtures of the tier tests: the NVMe tier in both I/O modes."""

from __future__ import annotations

import pytest

from tiers.nvme import NVMeTier
from tiers.nvme_io import probe_direct


@pytest.fixture(params=["direct", "buffered"])
def io_mode(request, tmp_path):
    if request.param == "direct" and not probe_direct(str(tmp_path)):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    return request.param


@pytest.fixture
def open_nvme(tmp_path, io_mode):
    """Open (or reopen) an NVMe tier in ``tmp_path/nvme`` in the test's I/O mode."""
    opened = []

    def make(capacity=1 << 30, **kw):
        kw.setdefault("direct", None if io_mode == "direct" else False)
        t = NVMeTier(tmp_path / "nvme", capacity, **kw)
        opened.append(t)
        return t

    yield make
    for t in opened:
        t.close()
