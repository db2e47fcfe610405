"""The daemon around the store: the gRPC service and its hint handlers, put assembly and
the streamed Get, interceptors (tokens, tenants, request checks), KV events, Prometheus
metrics, health, the listen address and the shared-arena hand-out; the building of the
tiers, the manager and the prefetch scheduler's arguments from the config (``build``, the
one place concrete parts are made from it) and the start-up that wires them together.
"""
