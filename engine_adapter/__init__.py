"""Engine plug-ins that page agent prefixes back from kvstore instead of recomputing them.

The top-level modules are shared by every plug-in: :mod:`~engine_adapter.layout` (the
stored block payload layout ``[layer][k|v][kv_head][token][head_dim]``, its byte ranges
per TP rank, and the reference runner's namespace), :mod:`~engine_adapter.engine_keys`
(store keys from an engine's block hashes or tokens, and an engine's namespace),
:mod:`~engine_adapter.model_identity` (what else names a model's KV in the namespace: the
weights' fingerprint, the attention config fields), :mod:`~engine_adapter.store_io` (the
plug-ins' one data path to the store: lookup, load, save, and the start-up block size
check, through a client behind the circuit breaker of :mod:`~engine_adapter.breaker`, so
a store that is slow or gone costs a bounded miss) and :mod:`~engine_adapter.background`
(the background job runner that puts new blocks off the engine step); agent hints:
:mod:`~engine_adapter.agent_hints` (what a request may carry: ``kv_transfer_params["kvstore"]``,
vLLM's ``kv_hints`` envelope), :mod:`~engine_adapter.trajectories` (which wait a request starts
or resumes, with a hint or without one) and :mod:`~engine_adapter.hint_sender` (those calls to
the daemon, off the scheduler thread; docs/agent_hints.md). They import only ``kvstore.common``,
``kvstore.client`` and ``kernels``.

:mod:`engine_adapter.reference` is the reference tensor-parallel runner (a Llama-style
decoder over a paged KV cache, TP over ``torch.distributed``) and its page-back adapter,
with the synthetic agent session that ``kvstore agent-demo`` plays.

:mod:`engine_adapter.vllm` is the vLLM v1 KV connector, composed of a scheduler half and
a worker half; vLLM loads :mod:`engine_adapter.vllm.connector` (also under its old path
``engine_adapter.vllm_connector``).

:mod:`engine_adapter.sglang` is the SGLang HiCache storage backend; SGLang loads
:mod:`engine_adapter.sglang.backend` (also under its old path ``engine_adapter.sglang_backend``).

Importing this package is light: torch is imported by the modules that need it, vLLM and
SGLang only by the modules those engines load. ``ModelConfig``, ``EngineConfig``,
``Runner``, ``TPGroup`` and ``launch`` of the reference runner are importable from here.
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
