"""``kvstore.keys`` is :mod:`kvstore.common.keys` (block keys: chained prefix hashes under a namespace); this name is kept for code written against it."""

import sys

import kvstore.common.keys as _target

sys.modules[__name__] = _target
