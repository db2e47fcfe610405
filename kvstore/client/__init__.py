"""The client library an inference worker links: :class:`KVStoreClient` (lookup, get, put,
leases, agent hints), composed of parts that own their state: the connection to one
daemon (channel, calls, message limits, the daemon's info; ``connection``), the raw-frame
gRPC path (``raw``), the same-node path through the daemon's shared host arena
(``arena``: the arena's mapping, reservations, leases, over ``arena_mapping``) with its
background lease release (``lease_releaser``), the agent-hint calls (``hints``), CUDA IPC
opening of HBM leases (``ipc``), the buffer conversions (numpy, torch, any buffer;
``buffers``) and the checks of keys before they are sent (``checks``). Imports only
:mod:`kvstore.common` and the generated stubs, never the daemon.
"""

from kvstore.client.client import KVStoreClient

__all__ = ["KVStoreClient"]
