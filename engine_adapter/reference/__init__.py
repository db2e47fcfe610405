"""The reference tensor-parallel attention runner (Llama-style decoder, paged KV cache, TP
over torch.distributed) and its page-back adapter: Lookup, MIN agreement of the TP ranks,
layer-by-layer loads that overlap compute, and the store of new blocks.
"""
