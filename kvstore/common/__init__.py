"""What every part of kvstore shares and owns nothing else: the store's error types, result
types, block keys (chained prefix hashes under a namespace), the raw-frame wire format,
gRPC transport settings and the error <-> status-code table, size units, and the
same-node arena hand-out protocol. Imports nothing of kvstore (only :mod:`tiers.base`'s
tier kinds), so the client, the core and the service all build on it.
"""
