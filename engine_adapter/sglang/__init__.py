"""kvstore as an SGLang HiCache storage backend (the L3 tier below SGLang's host pool).

``backend`` holds :class:`~engine_adapter.sglang.backend.KVStoreHiCacheStorage`, which
SGLang's ``dynamic`` storage factory loads by ``module_path``: it keys SGLang's pages by
their page hashes under a namespace of the model's weights and attention config, the KV
dtype, page size and host pool layout, and moves them through :mod:`engine_adapter.store_io`.
Importing it imports SGLang. ``settings`` validates the backend's extra config and builds
the namespace without importing SGLang.
"""
