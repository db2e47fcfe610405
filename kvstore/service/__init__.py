"""The daemon around the store: the gRPC service (``server``: block, lease, reservation,
Stats and Info RPCs), which delegates the agent-hint RPCs to the hint handlers it holds
(``hints``); put assembly (``put_assembly``) and the streamed Get (``get_stream``); the checks
of what a client sends (``validate``); interceptors and the handler wrappers that answer
every failure with its code from :mod:`kvstore.common.status` (``interceptors``); bearer
tokens and tenants (``auth``); KV events (``events``), Prometheus metrics (``metrics``),
health (``health``) and miss explanations (``explain``); the listen address (``listen``) and
the shared-arena hand-out (``arena_server``); the building of the tiers, the manager and the
prefetch scheduler's arguments from the config (``build``, the one place concrete parts are
made from it) and the start-up that wires them together (``startup``).
"""
