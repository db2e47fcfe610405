"""Saves out of a CUDA paged cache that never make vLLM's forward wait for the GPU.

``WorkerTransfers.save_layer`` runs on the forward's thread after each layer's attention.
Copying that layer's blocks to the host with a plain ``.cpu()`` makes the host wait until
the GPU has run everything queued so far, once per layer: the host stops queueing the next
layers' kernels ahead of the GPU, and every step that saves pays the copy and the lost
overlap. :class:`CudaSaves` instead queues, per layer, on a side stream that first waits for
the forward's stream (so it sees the layer's KV):

- the gather of the layer's blocks (``kernels.gather_blocks``, into a device buffer), then
- its copy into pinned host staging laid out ``(layers, n, 2, rank_heads, bs, hd)``, so
  that each layer's copy lands in one contiguous slice (a copy into a strided host slice
  would go through a pageable temporary and wait);

and :meth:`CudaSaves.finish` records one event after the step's last copy. The forward's
stream waits on that event (on the GPU, the host does not), so no later kernel (the next
step reusing a cache block) writes a block before its copy has read it; the thread that
stores the payload waits on the event before it reads the staging. The staging comes from
torch's pinned host allocator, which caches freed buffers, so a step allocates no pinned
memory once sizes repeat.
"""

from __future__ import annotations

import torch

from kernels import gather_blocks
from kernels.cuda import device_ids
from kernels.reference import DeviceIds, num_blocks


class CudaSaves:
    """Per-step saves of one TP rank's CUDA cache (see the module docstring).

    Args:
        device: the caches' CUDA device.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._ids: DeviceIds | None = None     # the step's block ids on the device, copied once

    def ids_on(self, block_ids: list[int], view: torch.Tensor, layout: str) -> DeviceIds:
        """A step's block ids on the device, checked and copied once for all its layers, on the
        current stream (the launches that use them run on it). Raises ValueError for an id
        outside the cache."""
        return device_ids(block_ids, num_blocks(view, layout), self.device, distinct=True)

    def staging(self, n: int, num_layers: int, rank_heads: int, block_tokens: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
        """Pinned host staging of a step's saves: ``(num_layers, n, 2, rank_heads, block_tokens,
        head_dim)`` of ``dtype``."""
        return torch.empty((num_layers, n, 2, rank_heads, block_tokens, head_dim), dtype=dtype, pin_memory=True)

    def copy_layer(self, view: torch.Tensor, block_ids: list[int], layout: str, dst: torch.Tensor) -> None:
        """Queue the copy of cache blocks ``block_ids`` of one layer's kernel view ``view``
        (``layout`` ``"NHD"`` or ``"HND"``) into ``dst``, ``(n, 2, rank_heads, bs, hd)``
        pinned and contiguous, after the work queued so far on the forward's stream. Returns
        at once; ``dst`` holds the bytes once :meth:`finish`'s event has completed."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self._ids is None:
                self._ids = self.ids_on(block_ids, view, layout)
            # allocated on the side stream: the allocator reuses it only for later work on it
            buf = gather_blocks([view], self._ids, layers=[0], layout=layout)
            dst.unsqueeze(1).copy_(buf, non_blocking=True)

    def finish(self) -> torch.cuda.Event:
        """End a step's copies: returns the event after its last copy, which the forward's
        stream now waits on (the cache blocks are not reused before they are read); the
        reader of the staging calls ``event.synchronize()`` first."""
        self._ids = None
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        return done


def rows_of(staging: torch.Tensor) -> torch.Tensor:
    """Layer-major staging ``(layers, n, ...)`` as the store's rows ``(n, layers, ...)``,
    contiguous (a host copy, made by whoever stores them)."""
    return staging.transpose(0, 1).contiguous()


__all__ = ["CudaSaves", "rows_of"]
