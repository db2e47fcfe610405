"""The reference tensor-parallel runner and its page-back adapter.

A Llama-style decoder of one TP rank (``config``: architecture and engine settings;
``weights``: seeded or safetensors weights split per rank; ``model``; ``paged_cache``:
the per-layer paged KV cache in vLLM's layout) run by ``runner`` (prefill, decode,
greedy generation) over ``tp`` (the collectives and the process launcher). ``adapter``
pages a prompt's stored prefix back before a prefill (Lookup, MIN agreement of the TP
ranks, a per-layer gate that waits for each layer's blocks) and stores the new full
blocks; ``transfer`` moves the blocks in background threads (the layer loader, the
store writer). ``session`` plays a synthetic multi-turn agent session and ``demo`` is
the running logic of ``kvstore agent-demo`` (its arguments are in
``kvstore.tools.agent_demo_cmd``).
"""
