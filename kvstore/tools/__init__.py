"""The ``kvstore`` command line and the offline tools behind it: serve, stats, replay of a
Mooncake trace, the byte-less simulator and its hint models, explain-miss, repair-index,
and the synthetic agent-trace generator. Owns no daemon state.
"""
