"""The cluster level of the store (a Mooncake Store tier shared by many nodes): lookup after
a local miss, page-in to the host arena, best-effort demotion and batched publishing of
local blocks. Owns the cluster's queues and counters; it sits below the store core, which
composes it, and reaches this node's store only through the port it declares
(:class:`kvstore.cluster.port.LocalStore`); built on :mod:`kvstore.common` and :mod:`tiers`.
"""
