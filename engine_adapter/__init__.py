"""Reference tensor-parallel runner and the adapter that pages agent prefixes back from kvstore.

Modules, one responsibility each:

==============  =============================================================
``config``      :class:`ModelConfig` (architecture), :class:`EngineConfig`
``weights``     seeded or safetensors weights, Megatron split per TP rank
``model``       Llama decoder of one TP rank over a paged KV cache
``paged_cache`` per-layer paged KV cache (vLLM layout), block table, allocator
``layout``      stored block payload layout and the store namespace
``transfer``    background page back (get_into per layer group) and background store
``adapter``     Lookup, MIN agreement of TP ranks, per-layer gate, store of new blocks
``runner``      prefill / decode / greedy generation of one TP rank
``tp``          TP collectives and the process launcher
``session``     synthetic multi-turn agent session
``demo``        ``kvstore agent-demo``
``store_io``    the engine plugins' one data path to the store (lookup/load/save)
``engine_keys`` store keys from an engine's block hashes or tokens, namespaces
``vllm_*``      the vLLM KV connector (``vllm_connector``: loaded by vLLM;
                ``vllm_plan``: scheduler side; ``vllm_worker``: worker side;
                ``vllm_kv_views``: vLLM's cache layouts; ``vllm_settings``)
``sglang_backend`` the SGLang HiCache storage backend
==============  =============================================================

Importing this package is light; torch is imported by the modules that need it, and
vLLM / SGLang only by ``vllm_connector`` / ``sglang_backend`` (loaded by the engines).
"""

__all__ = ["ModelConfig", "EngineConfig", "Runner", "TPGroup", "launch"]


def __getattr__(name: str):
    if name in ("ModelConfig", "EngineConfig"):
        from engine_adapter.reference import config
        return getattr(config, name)
    if name == "Runner":
        from engine_adapter.reference.runner import Runner
        return Runner
    if name in ("TPGroup", "launch"):
        from engine_adapter.reference import tp
        return getattr(tp, name)
    raise AttributeError(name)
