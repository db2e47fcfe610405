"""The cluster level of the store (a Mooncake Store tier shared by many nodes): lookup after
a local miss, page-in to the host arena, best-effort demotion and batched publishing of
local blocks. Owns the cluster's queues and counters; built on :mod:`kvstore.store`
and :mod:`tiers`.
"""
