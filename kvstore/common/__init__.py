"""What every part of kvstore shares, holding no state of its own: the store's error types
(``errors``) and result types (``types``), block keys (``keys``: chained prefix hashes under
a namespace; ``trajectory_keys``: an agent's successive prompts reusing the previous
turn's chain), the raw-frame wire format (``wire``), gRPC transport settings and message
limits (``transport``), the one table between store errors and gRPC status codes, used by
the service and the client alike (``status``), size units (``units``), and the same-node
arena hand-out protocol (``arena``). Imports nothing else of kvstore (only
:mod:`tiers.base`'s tier kinds), so the client, the store core and the service all build on it.
"""
