"""kvstore as an SGLang HiCache storage backend (:mod:`engine_adapter.sglang.backend`)."""
