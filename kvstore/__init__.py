"""kvstore: a tiered, content-addressed KV-cache block store for LLM agent serving.

Blocks of KV (``block_tokens`` tokens of every layer) are stored under 32-byte
chained prefix keys (:mod:`kvstore.common.keys`) across HBM, host memory and NVMe
(:mod:`tiers`), placed by eviction policies (:mod:`kvstore.policy`) and served
to inference workers over gRPC (:mod:`kvstore.service.server`, :mod:`kvstore.client`).
"""

__version__ = "0.1.0"
