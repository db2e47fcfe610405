"""Read amplification of a page back through a real daemon (acceptance 3 of issue #10).

Setup: one daemon in this process (host 64 MiB + NVMe tiers, ``ea_support.daemon_config``);
a layout of 16 layers x 4 KV heads x 16 tokens x head dim 32, fp32 (256 KiB per block);
6 blocks stored with ``put_from``. For the NVMe cases the blocks are then demoted out of
the host tier, so only the NVMe tier holds them. A page back at TP=T is T
:class:`~engine_adapter.reference.transfer.LayerLoader` s running at once, one per rank, each with
its own client (as in the rank's process) and its rank's KV heads; every layer is waited
for and compared with the stored payload. A rank's page back is one store call
(``store_io.load_stages``: one Lease of every block, or on the gRPC path one Get of
all its layers), not one per layer or layer group.

What is counted, per page back (deltas of the daemon's ``Stats`` counters, taken after
the daemon's queued transfers drained, and the loaders' ``bytes_received``):

- **served**: the KV bytes the ranks asked for, sum over ranks of (its heads x 16 layers
  x 6 blocks x k and v x head bytes). The ranks' heads partition the block, so this is
  6 x 256 KiB = 1.5 MiB at any TP size.
- **gRPC path** (``shared_memory=False``): every byte comes from a ranged tier read
  (``read_bytes_{tier}`` counts the bytes a tier read to serve a read). Asserted:
  ``read_bytes_host + read_bytes_nvme == served`` (x1), and the loaders received exactly
  ``served``. NVMe: the first read of a block from NVMe also asks for its promotion into
  the host tier (``promote_on_get``), which copies the whole block once, a full-block
  NVMe read that is not a read served (so not in ``read_bytes_nvme``; counted in
  ``promotions``). Asserted: ``promotions == 6``, once per block for all ranks; so the NVMe medium read at most ``served + 6 x block`` (2x at any TP size),
  host and NVMe together serve ``served`` (x1).
- **Shared-memory path**: a Lease pins each block in the shared host arena and the
  client copies this rank's ranges out of it (the loader counts those bytes: the only
  reads of the arena). The daemon counts leases in ``leased_blocks`` / ``leased_bytes``
  (whole blocks pinned: it cannot see which ranges the client copies), not in
  ``reads``. Asserted: ``reads == 0`` (no block went by gRPC), every block of every rank
  leased once (for all 16 layers) or read from the block table (a block another rank's lease
  promoted before this rank's read began), bytes copied out of the arena == served (x1). NVMe: a block
  is promoted into the arena once (a full-block NVMe read, for every rank):
  ``promotions == 6``, i.e. the NVMe medium read ``6 x block == served`` (x1).
  Host case: the blocks are in the daemon's block table, so each rank copies them with no
  lease at all (``calls == 0``, ``leased_blocks == 0``); the daemon counts them afterwards
  in ``table_read_blocks`` (``tp x 6``, from the ranks' TOUCH notes).
- Host cases, both paths: ``promotions == 0`` and nothing read from NVMe.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ea_support import daemon_config, short_dir
from engine_adapter.layout import BlockLayout
from engine_adapter.reference.tp import shard_bounds
from engine_adapter.reference.transfer import LayerLoader
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from tiers.base import TierKind
from tiers.block_table import supported

LAYOUT = BlockLayout(num_layers=16, num_kv_heads=4, block_tokens=16, head_dim=32, dtype=torch.float32)
BLOCKS = 6
SERVED = BLOCKS * LAYOUT.block_bytes


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    try:
        import tiers.nvme  # noqa: F401
    except ImportError:
        pytest.skip("the NVMe tier module is not there")
    d = start_server(daemon_config(tmp_path_factory.mktemp("amp")))
    yield d
    d.stop(0)


def store_blocks(daemon, tag: str, tier: str) -> tuple[list[bytes], torch.Tensor]:
    """Store ``BLOCKS`` random blocks (all heads); with ``tier == "nvme"`` leave them on NVMe only."""
    keys = [f"{tag}-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]
    blocks = torch.randn((BLOCKS,) + LAYOUT.block_shape(), generator=torch.Generator().manual_seed(len(tag)))
    with KVStoreClient(daemon.address, shared_memory=False) as c:
        assert c.put_from(keys, blocks, sizes=LAYOUT.block_bytes).stored == BLOCKS
        if tier == "nvme":
            for k in keys:
                assert daemon.manager.demote(k, 0)
        daemon.manager.drain()
        want = TierKind.NVME if tier == "nvme" else TierKind.HOST
        assert c.lookup(keys).tiers == (want,) * BLOCKS
    return keys, blocks


def page_back(address: str, keys, blocks, tp: int, shared_memory: bool) -> list[LayerLoader]:
    """Every rank's loader at once; checks every layer of every rank, returns the loaders."""
    clients = [KVStoreClient(address, shared_memory=shared_memory, timeout=20.0) for _ in range(tp)]
    try:
        loaders = [LayerLoader(c, keys, LAYOUT, shard_bounds(LAYOUT.num_kv_heads, r, tp), 20.0)
                   for r, c in enumerate(clients)]
        errors: list[str] = []

        def rank(r: int) -> None:
            h0, h1 = loaders[r].heads
            for layer in range(LAYOUT.num_layers):
                got = loaders[r].wait(layer, time.monotonic() + 60)
                if got.valid_blocks != BLOCKS or got.problem:
                    errors.append(f"rank {r} layer {layer}: {got.valid_blocks} blocks, {got.problem}")
                elif not torch.equal(got.data[:, 0], blocks[:, layer, :, h0:h1]):
                    errors.append(f"rank {r} layer {layer}: wrong KV")

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
        for ld in loaders:
            ld.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        deadline = time.monotonic() + 60
        while any(ld.running for ld in loaders) and time.monotonic() < deadline:    # counts set as they end
            time.sleep(0.01)
        return loaders
    finally:
        for c in clients:
            c.close()


def counters(daemon) -> dict[str, int]:
    daemon.manager.drain()
    return daemon.manager.counters.snapshot()


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("path", ["grpc", "shm"])
def test_page_back_reads_each_byte_once(daemon, tier, tp, path):
    keys, blocks = store_blocks(daemon, f"amp-{tier}-{tp}-{path}", tier)
    before = counters(daemon)
    loaders = page_back(daemon.address, keys, blocks, tp, shared_memory=(path == "shm"))
    after = counters(daemon)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}

    copied = sum(ld.bytes_received for ld in loaders)
    assert copied == SERVED
    from_table = path == "shm" and tier == "host" and supported()
    # one Lease (shm) or one Get (gRPC); none for blocks the block table holds. On NVMe a rank
    # whose read starts after another rank's lease promoted blocks finds those in the table
    if from_table:
        assert all(ld.calls == 0 for ld in loaders)
    elif path == "shm" and tier == "nvme":
        assert all(ld.calls <= 1 for ld in loaders) and sum(ld.calls for ld in loaders) >= 1
    else:
        assert all(ld.calls == 1 for ld in loaders)
    assert delta.get("promotions", 0) == (BLOCKS if tier == "nvme" else 0)
    if path == "grpc":
        assert delta.get("read_bytes_host", 0) + delta.get("read_bytes_nvme", 0) == SERVED
        assert delta.get("read_bytes", 0) == SERVED
        if tier == "host":
            assert delta.get("read_bytes_nvme", 0) == 0
        assert delta.get("leased_blocks", 0) == 0
    else:
        assert delta.get("reads", 0) == delta.get("read_bytes", 0) == 0
        leased = delta.get("leased_blocks", 0)
        assert delta.get("leased_bytes", 0) == leased * LAYOUT.block_bytes
        if from_table:                      # read with no lease; the daemon told afterwards (TOUCH notes)
            assert leased == 0

        def table_reads() -> int:
            return counters(daemon).get("table_read_blocks", 0) - before.get("table_read_blocks", 0)
        deadline = time.monotonic() + 60    # every rank's every block: leased, or read from the table
        while leased + table_reads() < tp * BLOCKS:
            assert time.monotonic() < deadline, "the TOUCH notes of the table reads"
            time.sleep(0.01)
        assert leased + table_reads() == tp * BLOCKS
