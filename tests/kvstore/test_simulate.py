"""``kvstore simulate``: counting, tiers, OPT ceiling, CLI."""

from __future__ import annotations

import argparse
import json
import pathlib
import random

import pytest

from kvstore.tools import simulate, simulate_cli
from kvstore.tools.trace import Request, read_mooncake_trace

CONVERSATION_TRACE = (pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
                      / "mooncake_conversation_trace.jsonl")

POLICIES = ("lru", "arc", "s3fifo", "next_use", "opt")


def ideal_token_hit_rate(reqs: list[Request]) -> float:
    """Infinite cache, prefix semantics, computed without the simulator."""
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        hit += r.input_length if k == len(r.hash_ids) else 512 * k
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total


def synthetic(n: int = 400, seed: int = 0) -> list[Request]:
    """Conversations that grow and come back, plus one-off prompts, over a shared block 0."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1
    out = []
    for i in range(n):
        if convs and rng.random() < 0.5:
            ids = rng.choice(convs)
            ids.extend(range(next_id, next_id + rng.randint(1, 3)))
            next_id = ids[-1] + 1
        else:
            ids = [0] + list(range(next_id, next_id + rng.randint(1, 6)))
            next_id = ids[-1] + 1
            convs.append(ids)
        out.append(Request(i * 100.0, 512 * (len(ids) - 1) + rng.randint(1, 512), 10, list(ids)))
    return out


def one_tier(policy: str, blocks: int) -> list[simulate.TierSpec]:
    return [simulate.TierSpec("host", blocks * 1024, policy)]


@pytest.mark.parametrize("policy", POLICIES)
def test_unbounded_capacity_gives_the_ideal_hit_rate(policy):
    reqs = synthetic()
    r = simulate.run(reqs, one_tier(policy, 10**9), block_bytes=1024, oracle=policy == "opt")
    assert r.hit_rate == pytest.approx(ideal_token_hit_rate(reqs), abs=1e-12)
    assert r.refused_puts == 0


@pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason="../shared/data traces not present")
def test_unbounded_on_the_conversation_trace_head_is_ideal():
    reqs = read_mooncake_trace(CONVERSATION_TRACE)[:1500]
    ideal = ideal_token_hit_rate(reqs)
    for policy in ("lru", "next_use"):
        assert simulate.run(reqs, one_tier(policy, 10**9), block_bytes=1024).hit_rate == pytest.approx(ideal)


def test_opt_is_a_ceiling_for_every_online_policy():
    reqs = synthetic(600, seed=2)
    opt = simulate.opt_hit_rate(reqs, 40 * 1024, block_bytes=1024).hit_rate
    for policy in POLICIES[:-1]:
        r = simulate.run(reqs, one_tier(policy, 40), block_bytes=1024)
        assert 0 < r.hit_rate <= opt + 1e-12, policy


def test_hits_are_credited_to_the_tier_that_held_them():
    # hbm holds 2 blocks (LRU), host the rest. [1 2 3] puts 1, 2, 3 and pushes 1 to host;
    # the same request again hits 1 in host, 2 and 3 in hbm.
    reqs = [Request(0.0, 1536, 1, [1, 2, 3]), Request(1.0, 1536, 1, [1, 2, 3])]
    tiers = [simulate.TierSpec("hbm", 2 * 1024, "lru"), simulate.TierSpec("host", 100 * 1024, "lru")]
    r = simulate.run(reqs, tiers, block_bytes=1024)
    assert r.hit_tokens == {"hbm": 1024, "host": 512}
    assert r.hit_rate == 0.5
    assert r.tier_hit_rates == {"hbm": 1024 / 3072, "host": 512 / 3072}


def test_the_last_block_counts_its_real_tokens_and_a_miss_stops_the_prefix():
    reqs = [Request(0.0, 600, 1, [1, 2]), Request(1.0, 600, 1, [1, 2]),
            Request(2.0, 1100, 1, [9, 2, 3])]         # block 2 is stored but its prefix missed
    r = simulate.run(reqs, one_tier("lru", 100), block_bytes=1024)
    assert r.hit_tokens == {"host": 600}
    assert r.hit_blocks == 2 and r.blocks == 7


def test_tiers_from_config_and_overrides():
    from kvstore import config

    cfg = config.from_dict({"tiers": {"hbm": {"enabled": True, "capacity": "2MiB"}, "host": {"capacity": "8MiB"},
                                      "nvme": {"enabled": False}},
                            "policy": {"eviction": "arc"}})
    specs = simulate.tiers_from_config(cfg, first_tier_bytes=3 << 20, policy="s3fifo")
    assert [(s.name, s.capacity_bytes, s.policy) for s in specs] == [("hbm", 3 << 20, "s3fifo"),
                                                                      ("host", 8 << 20, "s3fifo")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore")
    simulate_cli.register(p.add_subparsers())
    return p


def test_cli_help_and_a_sweep_with_json(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["simulate", "--help"])
    assert e.value.code == 0
    assert "--sweep" in capsys.readouterr().out
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                         "output_length": 1, "hash_ids": r.hash_ids}) + "\n"
                             for r in synthetic(200)))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tiers.host]\ncapacity = "64MiB"\n[tiers.nvme]\nenabled = false\n')
    out = tmp_path / "r.json"
    args = _parser().parse_args(["simulate", str(trace), "--config", str(cfg), "--sweep", "10,1000",
                                 "--policies", "lru,next_use", "--json", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "host:lru" in printed and "OPT" in printed
    rows = json.loads(out.read_text())
    assert [(r["tiers"][0]["capacity_blocks"], r["tiers"][0]["policy"]) for r in rows] == \
        [(10, "lru"), (10, "next_use"), (1000, "lru"), (1000, "next_use")]
    for r in rows:
        assert r["hit_rate"] <= r["opt_hit_rate"] + 1e-12
    assert rows[2]["hit_rate"] == pytest.approx(ideal_token_hit_rate(synthetic(200)))


def test_cli_reports_a_bad_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    args = _parser().parse_args(["simulate", str(bad)])
    assert args.func(args) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    reqs = synthetic(100)
    rs = []
    for blocks in (5, 50):
        r = simulate.run(reqs, one_tier("lru", blocks), block_bytes=1024)
        r.opt_hit_rate = simulate.opt_hit_rate(reqs, blocks * 1024, block_bytes=1024).hit_rate
        rs.append(r)
    simulate_cli.plot(rs, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_one_tier_hints_and_second_half(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                         "output_length": 1, "hash_ids": r.hash_ids}) + "\n"
                             for r in synthetic(300)))
    out = tmp_path / "r.json"
    args = _parser().parse_args(["simulate", str(trace), "--one-tier", "--sweep", "20", "--policies", "next_use",
                                 "--hints", "noisy:0.05,e", "--measure", "second-half", "--json", str(out)])
    assert args.func(args) == 0
    assert "noisy:0.05,2.72" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert [t["name"] for t in row["tiers"]] == ["host"]           # the default config's NVMe tier dropped
    assert row["sessions"]["hints"] == 300 and row["measure"][0] > 0
    assert 0 < row["hit_rate"] <= row["opt_hit_rate"] + 1e-12
    bad = _parser().parse_args(["simulate", str(trace), "--hints", "noisy:7,e"])
    assert bad.func(bad) == 2 and "misjudged" in capsys.readouterr().err
    args = _parser().parse_args(["simulate", str(trace), "--one-tier", "--sweep", "20", "--policies", "next_use",
                                 "--hints", "realistic:sigma=1.5", "--no-trust", "--no-opt"])
    assert args.func(args) == 0 and "realistic:sigma=1.5" in capsys.readouterr().out


def test_measure_counts_a_window_and_eviction_events_reach_the_listener():
    reqs = synthetic(200)
    first, second = simulate.halves(reqs)
    events = []
    whole = simulate.run(reqs, one_tier("lru", 10), block_bytes=1024, on_eviction=events.append)
    a = simulate.run(reqs, one_tier("lru", 10), block_bytes=1024, measure=first)
    b = simulate.run(reqs, one_tier("lru", 10), block_bytes=1024, measure=second)
    assert a.input_tokens + b.input_tokens == whole.input_tokens
    both = simulate.run(reqs, one_tier("lru", 10), block_bytes=1024, windows={"first": first, "second": second})
    assert (both.window_rate("first"), both.window_rate("second"), both.hit_rate) == (a.hit_rate, b.hit_rate,
                                                                                   whole.hit_rate)
    assert sum(a.hit_tokens.values()) + sum(b.hit_tokens.values()) == sum(whole.hit_tokens.values())
    assert len(events) == whole.counters["evictions_host"] > 0
    assert {e.tier for e in events} == {"host"} and {e.policy for e in events} == {"lru"}


def test_every_resume_is_scored_and_an_expired_trajectory_is_not_ready():
    from kvstore.config.node import PrefetchConfig
    from kvstore.tools.agent_trace import AgentWorkload, generate
    from kvstore.tools.trace import Request

    raw, events = generate(AgentWorkload(agents=4, duration_s=300.0, seed=3, chat=None))
    reqs = [Request(float(x["timestamp"]), x["input_length"], x["output_length"], x["hash_ids"]) for x in raw]
    tiers = [simulate.TierSpec("hbm", 1 << 40, "next_use")]          # everything stays in HBM
    scored = sum(e.kind == "resume" for e in events)

    def run(max_wait_s: float, expire_factor: float) -> dict:
        pf = PrefetchConfig(enabled=True, max_wait_s=max_wait_s, expire_factor=expire_factor)
        return simulate.run(reqs, tiers, block_bytes=1 << 20, events=events, prefetch=pf).prefetch

    patient = run(3600.0, 1e9)
    assert patient["every_resume"]["resumes"] == scored and patient["every_resume"]["not_waited"] == 0
    assert patient["every_resume"]["ready_token_rate"] == patient["ready_token_rate"] == 1.0
    hasty = run(2.0, 10.0)                             # waits longer than 2 s are expired
    e = hasty["every_resume"]
    assert e["resumes"] == scored and e["not_waited"] == hasty["resumes_expired"] > 0
    assert hasty["ready_token_rate"] == 1.0 > e["ready_token_rate"]     # the scheduler left them out
    assert e["ready_rate"] == pytest.approx((scored - e["not_waited"]) / scored)
