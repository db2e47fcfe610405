"""``kvstore.trajectory_keys`` is :mod:`kvstore.common.trajectory_keys` (an agent trajectory's block keys, turn after turn); this name is kept for code written against it."""

import sys

import kvstore.common.trajectory_keys as _target

sys.modules[__name__] = _target
