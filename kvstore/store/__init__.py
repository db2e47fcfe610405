"""The store core: the block catalogue (entries, claims, one pin/lease mechanism, events),
copies between media, eviction and demotion, the put protocol, reads, leases and
same-node reservations, the background cleaner, and the :class:`TierManager` facade
that declares the core's verbs. Owns every block's placement; talks to media only
through :class:`tiers.base.Tier`.
"""
