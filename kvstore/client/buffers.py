"""Client-side buffers: numpy arrays, torch tensors (CPU, pinned, CUDA), or any buffer,
as flat byte views, and the layout of many blocks in them.

``get_into`` / ``put_from`` (:mod:`kvstore.client`) take either one buffer per block or
one buffer holding every block (back to back, or at given byte offsets). torch is never
imported here: a tensor can only be passed by a program that imported it already.
"""

from __future__ import annotations

import itertools
import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvstore.common.byte_ranges import as_byte_count
from kvstore.common.errors import InvalidRequest


@dataclass
class HostView:
    """A flat uint8 view of a caller's buffer, and what to do once it is filled.

    ``finish`` copies a staging buffer back to device memory (CUDA tensors); None when
    ``array`` is the caller's own memory.
    """

    array: np.ndarray
    finish: Callable[[], None] | None = None


def _torch_tensor(x: Any):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def host_view(x: Any, writable: bool) -> HostView:
    """A flat uint8 numpy view of ``x`` (C-contiguous numpy array, torch tensor, bytes,
    bytearray, memoryview). A CUDA tensor is staged through host memory: for reading
    (``writable=False``) it is copied to the host now; for writing, ``finish`` copies
    the filled staging buffer to the device.

    Raises InvalidRequest for a non-contiguous or read-only (when ``writable``) buffer.
    """
    torch = _torch_tensor(x)
    if torch is not None:
        if not x.is_contiguous():
            raise InvalidRequest("tensors passed to the store must be contiguous")
        flat = x.detach().reshape(-1).view(torch.uint8)
        if flat.is_cuda:
            staging = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
            if not writable:
                staging.copy_(flat)
                return HostView(staging.numpy())
            return HostView(staging.numpy(), finish=lambda: flat.copy_(staging, non_blocking=False))
        return HostView(flat.numpy())
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise InvalidRequest("numpy arrays passed to the store must be C-contiguous")
        if writable and not x.flags.writeable:
            raise InvalidRequest("the output array is read-only")
        return HostView(x.reshape(-1).view(np.uint8))
    try:
        mv = memoryview(x)
    except TypeError:
        raise InvalidRequest(f"{type(x).__name__} is not a buffer, numpy array or torch tensor") from None
    if writable and mv.readonly:
        raise InvalidRequest("the output buffer is read-only")
    if not mv.c_contiguous:
        raise InvalidRequest("buffers passed to the store must be C-contiguous")
    return HostView(np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8))


def _not_a_scalar(target: Any, what: str) -> None:
    """Refuse a 0-d array or tensor (one number is not a block). Raises InvalidRequest."""
    shape = getattr(target, "shape", None)
    if shape is not None and len(shape) == 0:
        raise InvalidRequest(f"{what} is a 0-d {type(target).__name__} (one number): a block is a buffer of bytes")


def _byte_counts(values: Any, what: str, least: int) -> list[int]:
    """``values`` as a list of ints >= ``least`` (bytes). Raises InvalidRequest naming the
    first that is not one (a float, a bool, a string, a negative count)."""
    values = list(values)
    try:                                    # the common case in C: ints (a sum of ints is an int)
        if values and type(sum(values)) is int and min(values) >= least:
            return values
    except TypeError:
        pass
    out = []
    for i, v in enumerate(values):
        try:
            v = as_byte_count(v)
        except TypeError:
            raise InvalidRequest(f"{what}[{i}] is {v!r}: byte counts are integers") from None
        if v < least:
            raise InvalidRequest(f"{what}[{i}] is {v}: must be >= {least}")
        out.append(v)
    return out


class BlockBuffers:
    """Where each of ``n`` blocks goes (``get_into``) or comes from (``put_from``).

    Args:
        target: a sequence of ``n`` buffers (one per block), or one buffer.
        n: number of blocks.
        writable: filled by the store (``get_into``).
        offsets: with one buffer, the byte offset of each block; None: for ``get_into``,
            ``n`` equal slots of ``len(buffer) // n`` bytes in the order of the keys (a
            buffer shaped ``(n, block_bytes)``); for ``put_from``, back to back by ``sizes``.
            A buffer of two or more dimensions split into equal slots must have ``n`` rows
            (InvalidRequest otherwise: ``(3, B)`` is never cut into 4 blocks of ``3B/4``).
        sizes: with one buffer for ``put_from``, each block's bytes (an int: all equal).
    """

    def __init__(self, target: Any, n: int, *, writable: bool, offsets: Sequence[int] | None = None,
                 sizes: Sequence[int] | int | None = None):
        self.n = n
        self._per_block: list[HostView] | None = None
        self._one: HostView | None = None
        if isinstance(target, (list, tuple)):
            if len(target) != n:
                raise InvalidRequest(f"{len(target)} buffers for {n} keys")
            if offsets is not None:
                raise InvalidRequest("offsets apply to one buffer, not to a list of buffers")
            for i, t in enumerate(target):
                _not_a_scalar(t, f"buffer {i}")
            self._per_block = [host_view(t, writable) for t in target]
        else:
            _not_a_scalar(target, "the buffer")
            shape = getattr(target, "shape", None)
            if offsets is None and sizes is None and shape is not None and len(shape) >= 2 and shape[0] != n:
                # equal slots of a buffer shaped (rows, ...): one row per block, never a silent re-split
                raise InvalidRequest(f"a buffer of {shape[0]} rows for {n} keys: one row per block, or pass "
                                     f"offsets (get_into, put_from) or sizes (put_from)")
            self._one = host_view(target, writable)
        self.offsets = _byte_counts(offsets, "offsets", 0) if offsets is not None else None
        if self.offsets is not None and len(self.offsets) != n:
            raise InvalidRequest(f"{len(self.offsets)} offsets for {n} keys")
        if isinstance(sizes, int):
            sizes = [sizes] * n
        self.sizes = _byte_counts(sizes, "sizes", 1) if sizes is not None else None
        if self.sizes is not None and len(self.sizes) != n:
            raise InvalidRequest(f"{len(self.sizes)} sizes for {n} keys")
        self.stride = 0
        if self._one is not None and self.offsets is None:
            if self.sizes is not None:
                self.offsets = [0] * n
                for i in range(1, n):
                    self.offsets[i] = self.offsets[i - 1] + self.sizes[i - 1]
            elif n:
                self.stride = self._one.array.size // n

    def block_sizes(self) -> list[int]:
        """Each block's bytes for ``put_from``: the per-block buffers' lengths, or ``sizes``."""
        if self._per_block is not None:
            return [v.array.size for v in self._per_block]
        if self.sizes is None:
            if self.offsets is not None or not self.n or self._one.array.size % self.n:
                raise InvalidRequest("put_from with one buffer needs sizes unless it splits into equal blocks")
            return [self.stride] * self.n
        return self.sizes

    def slot(self, i: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` bytes of block ``i``. Raises InvalidRequest when they do not fit."""
        if self._per_block is not None:
            arr = self._per_block[i].array
            if arr.size < nbytes:
                raise InvalidRequest(f"buffer {i} has {arr.size} bytes, block {i} needs {nbytes}")
            return arr[:nbytes]
        arr = self._one.array
        if self.offsets is not None:
            start, end = self.offsets[i], arr.size
        else:
            start, end = i * self.stride, (i + 1) * self.stride
        if start < 0 or start + nbytes > end:
            raise InvalidRequest(f"block {i} ({nbytes} bytes at offset {start}) does not fit its "
                                 f"{end - start}-byte slot of the {arr.size}-byte buffer")
        return arr[start:start + nbytes]

    @property
    def array(self) -> np.ndarray | None:
        """The one buffer's flat uint8 view (None for a list of buffers)."""
        return self._one.array if self._one is not None else None

    def slot_offsets(self) -> list[int] | None:
        """Where each block's slot starts in :attr:`array` (bytes); None for a list of
        buffers. Each slot's fit is :meth:`slot`'s to check."""
        if self._one is None:
            return None
        if self.offsets is not None:
            return self.offsets
        return [i * self.stride for i in range(self.n)]

    def run(self, i: int, sizes: Sequence[int]) -> np.ndarray | None:
        """One view of the slots of blocks ``i``, ``i + 1``, ... when they lie back to back
        and each block fills its slot (one buffer of equal slots, every size the slot's):
        the blocks can be copied in by one call. None otherwise."""
        if self._one is None or self.offsets is not None or not self.stride:
            return None
        stride = self.stride
        if not all(map(operator.eq, sizes, itertools.repeat(stride))):
            return None
        return self._one.array[i * stride:(i + len(sizes)) * stride]

    def finish(self) -> None:
        """Copy staged data back to device tensors (``get_into`` of CUDA tensors)."""
        views = self._per_block if self._per_block is not None else [self._one]
        for v in views:
            if v is not None and v.finish is not None:
                v.finish()
