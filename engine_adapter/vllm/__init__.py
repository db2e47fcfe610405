"""kvstore as a vLLM v1 KV connector: the scheduler half (what to load and store per engine
step), the worker half (pages blocks into vLLM's paged cache and saves new ones), its
settings and namespace, and views of vLLM's KV cache layouts. vLLM loads
:mod:`engine_adapter.vllm.connector`; nothing here imports vLLM at package import.
"""
