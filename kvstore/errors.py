"""``kvstore.errors`` is :mod:`kvstore.common.errors` (the store's exception types); this name is kept for code written against it."""

import sys

import kvstore.common.errors as _target

sys.modules[__name__] = _target
