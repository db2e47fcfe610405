"""Client-side buffers: numpy arrays, torch tensors (CPU, pinned, CUDA), or any buffer,
as flat byte views, and the layout of many blocks in them.

``get_into`` / ``put_from`` (:mod:`kvstore.client`) take either one buffer per block or
one buffer holding every block (back to back, or at given byte offsets); ``put`` takes a
buffer per block (:func:`payload_view`). Every buffer must be C-contiguous: a
non-contiguous one (a transposed or strided view) is refused with InvalidRequest, never
copied (``np.ascontiguousarray`` makes the copy where the caller wants one). Blocks written
by ``get_into`` never share bytes: its buffers, or slots of one buffer, must not overlap.
torch is never imported here: a tensor can only be passed by a program that imported it already.
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
    ``array`` is the caller's own memory. ``device_span``: for a staged CUDA tensor, the
    caller's memory as ``(device, address, bytes)``; None: ``array`` is that memory.
    """

    array: np.ndarray
    finish: Callable[[], None] | None = None
    device_span: tuple[str, int, int] | None = None

    def span(self) -> tuple[str, int, int]:
        """The caller's memory this view stands for: ``(space, start address, bytes)``."""
        if self.device_span is not None:
            return self.device_span
        return "host", self.array.__array_interface__["data"][0], self.array.size


def _not_contiguous(x: Any) -> str:
    """Why a non-contiguous ``x`` is refused (the same words on every call)."""
    what = "numpy arrays" if isinstance(x, np.ndarray) else "buffers"
    return (f"{what} passed to the store must be C-contiguous (a transposed or strided view is "
            f"not; np.ascontiguousarray(x) makes a contiguous copy)")


def payload_view(x: Any, what: str) -> memoryview:
    """``x`` (bytes, bytearray, memoryview, a numpy array: any buffer) as a flat memoryview
    of its bytes (format ``"B"``, one dimension; not copied): a payload of ``put``.

    Raises InvalidRequest naming ``what`` for something that is not a buffer, a 0-d
    array (one number) or a buffer that is not C-contiguous.
    """
    try:
        mv = memoryview(x)
    except TypeError:
        raise InvalidRequest(f"{what} is a {type(x).__name__}, not bytes or another buffer") from None
    if mv.ndim == 0:
        raise InvalidRequest(f"{what} is a 0-d {type(x).__name__} (one number): a block is a buffer of bytes")
    if not mv.c_contiguous:
        raise InvalidRequest(f"{what}: {_not_contiguous(x)}")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


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

    Raises InvalidRequest for a non-contiguous (never copied) or read-only (when
    ``writable``) buffer.
    """
    torch = _torch_tensor(x)
    if torch is not None:
        if not x.is_contiguous():
            raise InvalidRequest("tensors passed to the store must be contiguous (x.contiguous() makes a copy)")
        flat = x.detach().reshape(-1).view(torch.uint8)
        if flat.is_cuda:
            staging = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
            if not writable:
                staging.copy_(flat)
                return HostView(staging.numpy())
            return HostView(staging.numpy(), finish=lambda: flat.copy_(staging, non_blocking=False),
                            device_span=(str(flat.device), flat.data_ptr(), flat.numel()))
        return HostView(flat.numpy())
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise InvalidRequest(_not_contiguous(x))
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
        raise InvalidRequest(_not_contiguous(x))
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


def _check_apart(views: list[HostView]) -> None:
    """Refuse buffers that share memory (each block is written into its own). Raises
    InvalidRequest naming two that overlap."""
    spans = sorted((*v.span(), i) for i, v in enumerate(views) if v.array.size)
    last = None                                 # the span reaching furthest so far
    for space, start, size, i in spans:
        if last is not None and last[0] == space and start < last[1] + last[2]:
            a, b = sorted((last[3], i))
            raise InvalidRequest(f"buffers {a} and {b} overlap: each block is written into memory of its own")
        if last is None or last[0] != space or start + size > last[1] + last[2]:
            last = (space, start, size, i)


def _slot_ends(offsets: list[int], size: int) -> list[int]:
    """Where each block's slot of a ``size``-byte buffer ends when block ``i`` starts at
    ``offsets[i]``: at the next larger offset (slots never overlap), the last at the
    buffer's end. Raises InvalidRequest for two blocks at one offset."""
    if all(map(operator.lt, offsets, offsets[1:])):     # increasing: the usual layout
        return [min(o, size) for o in offsets[1:]] + [size] if offsets else []
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    ends = [size] * len(offsets)
    for a, b in zip(order, order[1:]):
        if offsets[a] == offsets[b]:
            i, j = sorted((a, b))
            raise InvalidRequest(f"offsets[{j}] is {offsets[j]}, as offsets[{i}]: two blocks cannot be "
                                 f"written into one slot")
        ends[a] = min(offsets[b], size)
    return ends


class BlockBuffers:
    """Where each of ``n`` blocks goes (``get_into``) or comes from (``put_from``).

    Args:
        target: a sequence of ``n`` buffers (one per block), or one buffer.
        n: number of blocks.
        writable: filled by the store (``get_into``): the blocks' memory must not overlap.
            A list of buffers that share bytes (views of one array that overlap, one buffer
            twice) and two equal ``offsets`` are refused with InvalidRequest here, before
            anything is read; with ``offsets``, block ``i``'s slot ends where the block at the
            next larger offset starts (the last at the buffer's end), so a block longer than
            its slot is refused (:meth:`slot`, :meth:`check_fit`), never written over its
            neighbour. Not ``writable`` (``put_from``): sources may overlap or repeat (the
            same bytes stored under two keys); each slot ends at the buffer's end.
        offsets: with one buffer, the byte offset of each block; None: for ``get_into``,
            ``n`` equal slots of ``len(buffer) // n`` bytes in the order of the keys (a
            buffer shaped ``(n, block_bytes)``); for ``put_from``, back to back by ``sizes``.
            A buffer of two or more dimensions split into equal slots must have ``n`` rows
            (InvalidRequest otherwise: ``(3, B)`` is never cut into 4 blocks of ``3B/4``).
        sizes: with one buffer for ``put_from``, each block's bytes (an int: all equal).
    Raises InvalidRequest for a buffer that is not C-contiguous (never copied), read-only
    when ``writable``, a 0-d array, counts that do not match ``n``, and the overlaps above.
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
            self._per_block = []
            for i, t in enumerate(target):
                _not_a_scalar(t, f"buffer {i}")
                try:
                    self._per_block.append(host_view(t, writable))
                except InvalidRequest as e:
                    raise InvalidRequest(f"buffer {i}: {e}") from None
            if writable:
                _check_apart(self._per_block)
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
        self._ends: list[int] | None = None     # with offsets, where each slot ends (None: the buffer's end)
        if self.offsets is not None and writable:
            self._ends = _slot_ends(self.offsets, self._one.array.size)
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
        """The ``nbytes`` bytes of block ``i``. Raises InvalidRequest when they do not fit
        its slot (see the class docstring for where a slot ends)."""
        if self._per_block is not None:
            arr = self._per_block[i].array
            if arr.size < nbytes:
                raise InvalidRequest(f"buffer {i} has {arr.size} bytes, block {i} needs {nbytes}")
            return arr[:nbytes]
        arr = self._one.array
        if self.offsets is not None:
            start, end = self.offsets[i], (self._ends[i] if self._ends is not None else arr.size)
        else:
            start, end = i * self.stride, (i + 1) * self.stride
        if start < 0 or start + nbytes > end:
            why = " (it ends where the block at the next offset starts)" if self._ends and end < arr.size else ""
            raise InvalidRequest(f"block {i} ({nbytes} bytes at offset {start}) does not fit its "
                                 f"{max(0, end - start)}-byte slot of the {arr.size}-byte buffer{why}")
        return arr[start:start + nbytes]

    def check_fit(self, nbytes: int) -> None:
        """Check that every block's slot holds ``nbytes`` bytes, for reads whose block size
        is known before anything is read (``get_into`` with ``ranges``, a leased read's
        stages; 0: nothing to check). Raises InvalidRequest as :meth:`slot` for the first
        block that does not fit."""
        if nbytes <= 0:
            return
        if self._per_block is not None:
            room = [v.array.size for v in self._per_block]
        elif self.offsets is None:
            room = [self.stride] if self.n else []
        else:
            ends = self._ends if self._ends is not None else itertools.repeat(self._one.array.size)
            room = list(map(operator.sub, ends, self.offsets))
        if room and min(room) < nbytes:
            self.slot(next(i for i, r in enumerate(room) if r < nbytes), nbytes)

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
