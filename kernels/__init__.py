"""Gather/scatter between paged KV caches and the store's contiguous block buffers.

:mod:`kernels.reference` is the torch reference (CPU and GPU); CUDA kernels that must
match it bit for bit live in :mod:`kernels.cuda`.
"""
