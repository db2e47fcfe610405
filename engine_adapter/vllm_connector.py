"""``engine_adapter.vllm_connector`` is :mod:`engine_adapter.vllm.connector` (the vLLM KV connector, by ``kv_connector_module_path``); this name is kept for code written against it."""

import sys

import engine_adapter.vllm.connector as _target

sys.modules[__name__] = _target
