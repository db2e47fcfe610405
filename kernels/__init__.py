"""Gather/scatter between paged KV caches and the store's contiguous block buffers.

:mod:`kernels.reference` is the torch reference (CPU and GPU); CUDA kernels that must
match it bit for bit live in :mod:`kernels.cuda`.

:func:`gather_blocks` and :func:`scatter_blocks` here dispatch: caches that are CUDA
tensors go to the CUDA kernels when CuPy is installed, everything else (CPU tensors,
or a CUDA machine without CuPy) to the reference. A CUDA tensor already proves a GPU,
so no separate detection is needed here. Signatures, results and errors are those
of :mod:`kernels.reference`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels import reference

__all__ = ["gather_blocks", "scatter_blocks", "implementation"]


def implementation(caches: Sequence[torch.Tensor]):
    """The module that serves ``caches``: :mod:`kernels.cuda` or :mod:`kernels.reference`."""
    if caches and caches[0].is_cuda:
        from kernels import cuda
        if cuda.available():
            return cuda
    return reference


def gather_blocks(caches: Sequence[torch.Tensor], block_ids, *, heads: tuple[int, int] | None = None,
                  layers: Sequence[int] | None = None, layout: str = "NHD",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks of a paged cache in the store's layout: see :func:`kernels.reference.gather_blocks`."""
    return implementation(caches).gather_blocks(caches, block_ids, heads=heads, layers=layers,
                                                layout=layout, out=out)


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids, src: torch.Tensor, *,
                   heads: tuple[int, int] | None = None, layers: Sequence[int] | None = None,
                   layout: str = "NHD") -> None:
    """Block buffers into a paged cache: see :func:`kernels.reference.scatter_blocks`."""
    implementation(caches).scatter_blocks(caches, block_ids, src, heads=heads, layers=layers,
                                          layout=layout)
