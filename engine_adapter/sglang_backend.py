"""``engine_adapter.sglang_backend`` is :mod:`engine_adapter.sglang.backend` (the SGLang HiCache storage backend, by ``module_path``); this name is kept for code written against it."""

import sys

import engine_adapter.sglang.backend as _target

sys.modules[__name__] = _target
