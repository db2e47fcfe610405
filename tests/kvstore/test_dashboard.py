"""The Grafana dashboard (docs/grafana/kvstore.json) against the metrics a daemon really exports.

The exported names come from the ``/metrics`` page of an in-process daemon with every
metric family alive (metrics and prefetch on; more puts than the host tier holds, so blocks
are demoted and evicted; a Lookup and a Get, so the per-tenant counters, the per-tier reads
and the RPC histogram have series), never from a list kept here. A family has no series
until its first event: a fresh daemon shows fewer names.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from support.daemon import ROOT, daemon_config

DASHBOARD = ROOT / "docs" / "grafana" / "kvstore.json"
PANEL_TYPES = {"row", "timeseries", "stat", "bargauge", "gauge", "table"}
GRID_COLUMNS = 24
# PromQL's functions and aggregations used by dashboards; an unknown name is a typo or a metric.
PROMQL_FUNCTIONS = {"sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "rate", "irate", "increase",
                    "delta", "idelta", "histogram_quantile", "absent", "clamp_min", "clamp_max", "vector", "scalar",
                    "sum_over_time", "avg_over_time", "max_over_time", "min_over_time", "label_replace"}
PROMQL_MODIFIERS = ("by", "without", "on", "ignoring", "group_left", "group_right")
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[set[str], set[str]]:
    """(sample names, family names) on the /metrics page of a daemon that has served traffic."""
    d = start_server(daemon_config(tmp_path_factory.mktemp("dash"), host="1MiB", extra={
        "metrics": {"listen": "127.0.0.1:0"}, "prefetch": {"enabled": True}, "blocks": {"block_tokens": 16}}))
    try:
        keys = [bytes([i]) * 32 for i in range(24)]            # 24 x 64 KiB over a 1 MiB host tier
        with KVStoreClient(d.address, timeout=30) as c:
            c.put_from(keys, np.ones((24, 64 << 10), np.uint8))
            c.lookup(keys)
            c.get(keys)
            deadline = time.monotonic() + 30
            while not any(k.startswith("evictions_") and v for k, v in c.stats()["counters"].items()):
                assert time.monotonic() < deadline, "no eviction from the host tier"
                time.sleep(0.05)
        text = urllib.request.urlopen(f"http://{d.metrics.address}/metrics", timeout=30).read().decode()
    finally:
        d.stop(0)
    families = list(text_string_to_metric_families(text))
    samples = {s.name for f in families for s in f.samples}
    return samples, {f.name for f in families}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[str]:
    """Every PromQL expression: panel targets and the variables' queries."""
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found = re.fullmatch(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*\w+\s*\)", q)
            assert found, f"variable {var['name']}: unexpected query {q!r}"
            out.append(found.group(1))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, modifiers and labels left out).

    Raises AssertionError for an unknown function or unbalanced brackets.
    """
    for left, right in ("()", "[]", "{}"):
        assert expr.count(left) == expr.count(right), f"unbalanced {left}{right} in {expr!r}"
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)            # label values and regexes
    e = re.sub(r"\{[^}]*\}", "", e)                           # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                          # ranges ([$__rate_interval])
    e = re.sub(rf"\b({'|'.join(PROMQL_MODIFIERS)})\s*\([^)]*\)", " ", e)   # by (tier), ignoring(tier)
    e = re.sub(rf"\b({'|'.join(PROMQL_MODIFIERS)})\b", " ", e)             # a bare group_left
    names = set()
    for found in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", e):
        word, call = found.group(1), found.group(2)
        if call:
            assert word in PROMQL_FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
        elif word not in PROMQL_WORDS:
            names.add(word)
    return names


def test_the_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource():
    dash = dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and 0 <= g["x"] and g["x"] + g["w"] <= GRID_COLUMNS
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"]
            assert 'instance=~"$instance"' in t["expr"] or t["expr"].startswith("absent("), t["expr"]


def test_every_query_names_only_metrics_the_daemon_exports(exported):
    samples, _ = exported
    for expr in queries(dashboard()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= samples, f"{expr!r} names {sorted(names - samples)}, not exported by the daemon"


def test_every_metric_the_daemon_exports_has_a_panel(exported):
    _, families = exported
    families = {f for f in families if not f.endswith("_created")}    # creation times, not metrics
    used = set().union(*(metric_names(e) for e in queries(dashboard())))
    shown = {f for f in families if any(n == f or n.startswith(f + "_") for n in used)}
    assert families - shown == set(), "metrics without a panel on docs/grafana/kvstore.json"


def test_the_dashboard_covers_what_an_operator_watches():
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for topic in ("hit rate", "hits by tier", "bytes read per tier", "bytes stored per tier", "usage", "capacity",
                  "evictions", "demotions", "prefetch readiness", "prefetch waste", "latency p99", "not serving",
                  "corrupt"):
        assert topic in titles, topic


def test_metric_names_reads_promql():
    expr = ('sum by (tier) (rate(kvstore:reads_total{instance=~"$instance"}[$__rate_interval])) / ignoring(tier) '
            'group_left sum(rate(kvstore:reads_total{instance=~"$instance"}[5m]))')
    assert metric_names(expr) == {"kvstore:reads_total"}
    assert metric_names('histogram_quantile(0.99, sum by (le, method) (rate(kvstore:request_seconds_bucket[1m])))') \
        == {"kvstore:request_seconds_bucket"}
    assert metric_names("1 - kvstore:serving") == {"kvstore:serving"}
    with pytest.raises(AssertionError, match="unknown PromQL function"):
        metric_names("rat(kvstore:reads_total[1m])")
