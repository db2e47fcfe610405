"""The client library an inference worker links: :class:`KVStoreClient` (lookup, get, put,
hints) over gRPC, its same-node zero-copy path through the daemon's shared host arena
(and CUDA IPC of HBM leases), its raw-frame gRPC path, and the buffer conversions
(numpy, torch, any buffer). Owns the client's connection state; imports only
:mod:`kvstore.common` and the generated stubs, never the daemon.
"""

from kvstore.client.client import KVStoreClient

__all__ = ["KVStoreClient"]
