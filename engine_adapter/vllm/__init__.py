"""kvstore as a vLLM v1 KV connector, a package of composed halves.

``connector`` is what vLLM loads (``kv_connector_module_path``): a
``KVConnectorBase_V1`` that only adapts vLLM's hooks to the two halves. ``scheduler`` is
the scheduler half (per request a Lookup of the stored prefix; per engine step the plan
of what to load and store); ``worker`` is the worker half of one TP rank (loads the
planned blocks layer by layer into vLLM's paged cache, copies new full blocks out and
puts them in the background); ``plan`` holds the step plan the one ships to the other.
``settings`` validates ``kv_connector_extra_config`` and builds the store namespace;
``kv_views`` views vLLM's KV cache layouts in the shape the ``kernels`` copy. Only
``connector`` and ``settings`` import vLLM, ``connector`` at import, ``settings`` inside
the function that needs it.
"""
