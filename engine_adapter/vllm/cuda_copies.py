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
memory once sizes repeat; staging still queued for the store counts against
``max_pinned_bytes``, beyond which a step's staging is pageable memory (the copies into it
then make the host wait, as a save did before; the bytes are the same).

With TP > 1 the ranks' heads are gathered on the host at the end of the step, so the host
waits once per step (not per layer) for that step's copies.
"""

from __future__ import annotations

import threading
import weakref

import torch

from kernels import gather_blocks
from kernels.cuda import device_ids
from kernels.reference import DeviceIds, num_blocks


MAX_PINNED_BYTES = 2 << 30
"""Pinned save staging alive at once per TP rank by default (bytes): the steps queued for the
store (the writer holds up to ``max_pending_saves``) pin no more than this."""


class CudaSaves:
    """Per-step saves of one TP rank's CUDA cache (see the module docstring).

    Args:
        device: the caches' CUDA device.
        max_pinned_bytes: pinned staging alive at once (steps still queued for the store).
    """

    def __init__(self, device: torch.device, max_pinned_bytes: int = MAX_PINNED_BYTES):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.max_pinned_bytes = max_pinned_bytes
        self.pinned_bytes = 0
        self._lock = threading.Lock()

    def ids_on(self, block_ids: list[int], view: torch.Tensor, layout: str) -> DeviceIds:
        """A step's block ids on the device, checked and copied once for all its layers, on the
        current stream (the launches that use them run on it). Raises ValueError for an id
        outside the cache."""
        return device_ids(block_ids, num_blocks(view, layout), self.device, distinct=True)

    def ids_once(self, known: dict, key, block_ids: list[int], view: torch.Tensor, layout: str) -> DeviceIds:
        """``known[key]``, made by :meth:`ids_on` on the current stream the first time (a step's
        loads: one copy of their ids for every layer)."""
        if key not in known:
            known[key] = self.ids_on(block_ids, view, layout)
        return known[key]

    def staging(self, n: int, num_layers: int, rank_heads: int, block_tokens: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
        """Host staging of a step's saves: ``(num_layers, n, 2, rank_heads, block_tokens,
        head_dim)`` of ``dtype``, pinned while the pinned staging alive stays within
        ``max_pinned_bytes`` (counted until the tensor is freed), else pageable."""
        shape = (num_layers, n, 2, rank_heads, block_tokens, head_dim)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        with self._lock:
            pin = self.pinned_bytes + nbytes <= self.max_pinned_bytes
            if pin:
                self.pinned_bytes += nbytes
        out = torch.empty(shape, dtype=dtype, pin_memory=pin)
        if pin:
            weakref.finalize(out, self._unpinned, nbytes)
        return out

    def _unpinned(self, nbytes: int) -> None:
        with self._lock:
            self.pinned_bytes -= nbytes

    def copy_layer(self, view: torch.Tensor, block_ids, layout: str, dst: torch.Tensor) -> DeviceIds:
        """Queue the copy of cache blocks ``block_ids`` (a list, or the :class:`DeviceIds` an
        earlier layer of the step returned) of one layer's kernel view ``view`` (``layout``
        ``"NHD"`` or ``"HND"``) into ``dst``, ``(n, 2, rank_heads, bs, hd)`` contiguous host
        memory, after the work queued so far on the forward's stream. Returns at once, with
        the ids on the device for the step's next layers; ``dst`` holds the bytes once
        :meth:`finish`'s event has completed. Raises ValueError for an id outside the cache."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ids = block_ids if isinstance(block_ids, DeviceIds) else self.ids_on(block_ids, view, layout)
            # allocated on the side stream: the allocator reuses it only for later work on it
            buf = gather_blocks([view], ids, layers=[0], layout=layout)
            dst.unsqueeze(1).copy_(buf, non_blocking=True)
        return ids

    def finish(self) -> torch.cuda.Event:
        """End a step's copies: returns the event after its last copy, which the forward's
        stream now waits on (the cache blocks are not reused before they are read); the
        reader of the staging calls ``event.synchronize()`` first."""
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        return done


def rows_of(staging: torch.Tensor) -> torch.Tensor:
    """Layer-major staging ``(layers, n, ...)`` as the store's rows ``(n, layers, ...)``,
    contiguous (a host copy, made by whoever stores them)."""
    return staging.transpose(0, 1).contiguous()


__all__ = ["CudaSaves", "rows_of"]
