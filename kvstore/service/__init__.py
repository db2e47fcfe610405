"""The daemon around the store: the gRPC service and its hint handlers, put assembly and
the streamed Get, interceptors (tokens, tenants, request checks), KV events, Prometheus
metrics, health, the listen address and the shared-arena hand-out, and the start-up that
builds tiers from the config (the one place concrete tiers are wired).
"""
