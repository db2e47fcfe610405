"""The store core: the block catalogue (entries, claims, one pin/lease mechanism, events),
the per-tier placement bookkeeping, the one room-making object that chooses eviction
victims (``room``), two-phase copies between tiers (``transfers``, bytes by the ``mover``'s
registry of copy plans per medium pair), promotion and write-through (``moves``), the put
protocol, reads, leases and same-node reservations, the background cleaner, the port the
cluster level is given (``cluster_port``), and the :class:`TierManager` facade that declares
the core's verbs. Owns every block's placement; talks to media only through
:mod:`kvstore.store.media`, the one place media errors become store errors.
"""
