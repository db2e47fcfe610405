"""Prometheus metrics of the daemon (``/metrics``, served with ``prometheus_client``).

Names are prefixed ``kvstore:`` (as vLLM's are ``vllm:``). Counters and gauges are read
from the store at scrape time (:class:`StoreCollector`: nothing is counted twice);
request latencies are a histogram per RPC. Labels: ``tier`` (the tier's name),
``policy`` (its eviction policy), ``tenant`` (``""`` for the shared key space),
``method`` (the RPC).

==========================================  =====  ========================================
metric                                      type   what
==========================================  =====  ========================================
kvstore:lookups_total                       ctr    Lookup calls (per tenant)
kvstore:lookup_blocks_total                 ctr    blocks asked for by Lookups (per tenant)
kvstore:hit_blocks_total                    ctr    blocks found by Lookups (per tenant)
kvstore:hit_tokens_total                    ctr    hit blocks x block_tokens (per tenant)
kvstore:read_bytes_total                    ctr    bytes read from a tier to serve reads
kvstore:reads_total                         ctr    reads served from a tier
kvstore:stored_bytes_total                  ctr    bytes written into a tier (puts, moves)
kvstore:evictions_total                     ctr    blocks evicted from a tier (tier, policy)
kvstore:demotions_total / promotions_total  ctr    blocks copied down / up
kvstore:corrupt_blocks_total                ctr    copies that failed their checksum
kvstore:blocks_put_total / bytes_put_total  ctr    puts
kvstore:leased_bytes_total                  ctr    bytes pinned by same-node leases
kvstore:used_bytes / capacity_bytes         gauge  per tier (tier, policy)
kvstore:payload_bytes / blocks              gauge  per tier
kvstore:serving                             gauge  1 while puts can be stored (health)
kvstore:prefetch_ready_rate                 gauge  resumes whose prefix was in HBM in time
kvstore:prefetch_waste                      gauge  promoted bytes evicted before use / promoted
kvstore:request_seconds                     hist   latency per RPC (method, tenant)
==========================================  =====  ========================================
"""

from __future__ import annotations

import re
import threading
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.store.manager import TierManager

_PER_TIER = re.compile(r"^(reads|read_bytes|stored_bytes|evictions)_(.+)$")


class TenantTally:
    """Per-tenant Lookup counts (bounded by the configured tenants)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, list[int]] = {}

    def lookup(self, tenant: str, asked: int, hit: int) -> None:
        """Count one Lookup of ``tenant``: ``asked`` blocks, ``hit`` of them found."""
        with self._lock:
            row = self.values.setdefault(tenant, [0, 0, 0])
            row[0] += 1
            row[1] += asked
            row[2] += hit

    def rows(self) -> dict[str, tuple[int, int, int]]:
        """A snapshot: per tenant, (Lookup calls, blocks asked for, blocks found)."""
        with self._lock:
            return {t: tuple(v) for t, v in self.values.items()}


class StoreCollector:
    """Reads the store's counters and usage when Prometheus scrapes."""

    def __init__(self, manager: TierManager, block_tokens: int, tally: TenantTally,
                 serving: Callable[[], bool] | None = None, prefetch=None):
        self.manager = manager
        self.block_tokens = block_tokens
        self.tally = tally
        self.serving = serving
        self.prefetch = prefetch

    def collect(self) -> Iterator:
        m = self.manager
        counters = m.counters.snapshot()
        policy_of = {u.name: u.policy for u in m.usage()}
        per_tier: dict[str, CounterMetricFamily] = {
            "reads": CounterMetricFamily("kvstore:reads", "Reads served from a tier", labels=["tier"]),
            "read_bytes": CounterMetricFamily("kvstore:read_bytes", "Bytes read from a tier to serve reads",
                                              labels=["tier"]),
            "stored_bytes": CounterMetricFamily("kvstore:stored_bytes", "Bytes written into a tier (puts and moves)",
                                                labels=["tier"]),
            "evictions": CounterMetricFamily("kvstore:evictions", "Blocks evicted from a tier",
                                             labels=["tier", "policy"]),
        }
        for name, value in counters.items():
            match = _PER_TIER.match(name)
            if match:
                kind, tier = match.groups()
                labels = [tier, policy_of.get(tier, "")] if kind == "evictions" else [tier]
                per_tier[kind].add_metric(labels, value)
        yield from per_tier.values()
        for name, doc in (("demotions", "Blocks copied to the next tier to make room"),
                          ("promotions", "Blocks copied to a faster tier"),
                          ("corrupt_blocks", "Stored copies that failed their checksum"),
                          ("blocks_put", "Blocks stored by puts"), ("bytes_put", "Payload bytes stored by puts"),
                          ("leased_bytes", "Bytes pinned by same-node leases")):
            yield CounterMetricFamily(f"kvstore:{name}", doc, value=counters.get(name, 0))
        lookups = CounterMetricFamily("kvstore:lookups", "Lookup calls", labels=["tenant"])
        asked = CounterMetricFamily("kvstore:lookup_blocks", "Blocks asked for by Lookups", labels=["tenant"])
        hits = CounterMetricFamily("kvstore:hit_blocks", "Blocks found by Lookups", labels=["tenant"])
        tokens = CounterMetricFamily("kvstore:hit_tokens", "Hit blocks times block_tokens", labels=["tenant"])
        for tenant, (n, a, h) in self.tally.rows().items():
            lookups.add_metric([tenant], n)
            asked.add_metric([tenant], a)
            hits.add_metric([tenant], h)
            tokens.add_metric([tenant], h * self.block_tokens)
        yield from (lookups, asked, hits, tokens)
        gauges = {name: GaugeMetricFamily(f"kvstore:{name}", doc, labels=["tier", "policy"])
                  for name, doc in (("used_bytes", "Allocated bytes of a tier"),
                                    ("capacity_bytes", "Capacity of a tier"),
                                    ("payload_bytes", "Payload bytes of the blocks in a tier"),
                                    ("blocks", "Blocks in a tier"))}
        for i, u in enumerate(m.usage()):
            labels = [u.name, u.policy]
            gauges["used_bytes"].add_metric(labels, u.used_bytes)
            gauges["capacity_bytes"].add_metric(labels, u.capacity_bytes)
            gauges["payload_bytes"].add_metric(labels, m.payload_bytes(i))
            gauges["blocks"].add_metric(labels, u.blocks)
        yield from gauges.values()
        if self.serving is not None:
            yield GaugeMetricFamily("kvstore:serving", "1 while puts can be stored", value=float(self.serving()))
        if self.prefetch is not None:
            st = self.prefetch.stats
            yield GaugeMetricFamily("kvstore:prefetch_ready_rate",
                                    "Resumes whose whole prefix was in HBM in time", value=st.ready_rate)
            yield GaugeMetricFamily("kvstore:prefetch_waste",
                                    "Promoted bytes evicted before use, over promoted bytes", value=st.waste)


class Metrics:
    """The ``/metrics`` endpoint of one daemon.

    Args:
        manager: the store; block_tokens: the node's tokens per block.
        listen: ``HOST:PORT`` to serve on (port 0 picks one: see :attr:`port`).
        serving: the health verdict; prefetch: the prefetch scheduler, if running.
    Raises OSError when the address cannot be bound.
    """

    def __init__(self, manager: TierManager, block_tokens: int, listen: str,
                 serving: Callable[[], bool] | None = None, prefetch=None):
        self.registry = CollectorRegistry()
        self.tally = TenantTally()
        self.registry.register(StoreCollector(manager, block_tokens, self.tally, serving, prefetch))
        self.latency = Histogram("kvstore:request_seconds", "Latency of each RPC", ["method", "tenant"],
                                 registry=self.registry,
                                 buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                                          0.5, 1.0, 2.5, 5.0, 10.0))
        host, _, port = listen.rpartition(":")
        self._server, self._thread = start_http_server(int(port), addr=host or "127.0.0.1",
                                                       registry=self.registry)
        self.port = self._server.server_port
        self.address = f"{host or '127.0.0.1'}:{self.port}"

    def observe(self, method: str, seconds: float, tenant: str = "") -> None:
        self.latency.labels(method, tenant).observe(seconds)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
