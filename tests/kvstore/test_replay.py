"""Trace replay through a real daemon, on small traces with hand-computed answers."""

import json
from types import SimpleNamespace

import pytest

from support.daemon import CONVERSATION_TRACE, daemon_config
from kvstore.client.client import KVStoreClient
from kvstore.tools.replay import block_token_counts, payload_for, replay, trace_key
from kvstore.service.startup import start_server


def R(input_length, ids):
    return SimpleNamespace(input_length=input_length, hash_ids=ids)


TRACE = [R(1000, [1, 2]), R(1536, [1, 2, 3]), R(600, [1, 4])]


def run(tmp_path, bytes_per_token=1, **caps):
    d = start_server(daemon_config(tmp_path, **caps))
    try:
        with KVStoreClient(d.address) as c:
            return replay(TRACE, c, bytes_per_token=bytes_per_token, progress=False)
    finally:
        d.stop(0)


def test_block_token_counts():
    assert block_token_counts(1000, 2) == [512, 488]
    assert block_token_counts(1024, 2) == [512, 512]
    with pytest.raises(ValueError):
        block_token_counts(1025, 2)


def test_unbounded_cache_hand_computed(tmp_path):
    rep = run(tmp_path)
    # r2 hits blocks 1,2 (1024 tokens), r3 hits block 1 (512 tokens)
    assert rep.input_tokens == 3136 and rep.hit_tokens == 1536
    assert rep.token_hit_rate == pytest.approx(1536 / 3136)
    assert rep.block_hit_rate == pytest.approx(3 / 7)
    assert rep.blocks_put == 4 and rep.blocks_got == 3
    assert rep.bytes_put == 4 * 512 and rep.bytes_got == 3 * 512
    assert rep.hits_by_tier == {"host": 1536}
    assert rep.corrupt_blocks == 0


def test_two_block_host_tier_without_nvme(tmp_path):
    # host holds 2 blocks of 512 KiB; after r2 puts block 3, LRU block 1 is dropped, so r3 misses
    rep = run(tmp_path, bytes_per_token=1024, host="1MiB", nvme=None)
    assert rep.hit_tokens == 1024
    assert rep.blocks_put == 5


def test_two_block_host_tier_with_nvme(tmp_path):
    # the same, but nothing is lost: r3 hits block 1. Usually r2's put of block 3 demoted it to
    # NVMe and r3 hits it there; when r2's reads still pin blocks 1 and 2 as that put arrives (a
    # loaded machine), the put finds no victim in the host tier and lands on NVMe, and r3 hits
    # block 1 on host. Both are right; which one happens depends on timing.
    rep = run(tmp_path, bytes_per_token=1024, host="1MiB", nvme="2MiB")
    assert rep.hit_tokens == 1536 and rep.put_failures == 0 and rep.blocks_put == 4
    assert rep.hits_by_tier in ({"host": 1024, "nvme": 512}, {"host": 1536})


def test_wrong_bytes_are_counted_as_corrupt(tmp_path):
    d = start_server(daemon_config(tmp_path))
    try:
        with KVStoreClient(d.address) as c:
            # another block's payload stored under block 1's key
            c.put([(trace_key(1, 512), payload_for(trace_key(9, 512), 512))])
            rep = replay([R(600, [1, 4])], c, bytes_per_token=1, progress=False)
    finally:
        d.stop(0)
    assert rep.corrupt_blocks == 1 and rep.hit_tokens == 0


@pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason=f"trace not found: {CONVERSATION_TRACE}")
def test_cli_replay_first_requests_of_real_trace(tmp_path, capsys):
    from kvstore.tools.cli import main

    d = start_server(daemon_config(tmp_path))
    try:
        out = tmp_path / "r.json"
        assert main(["replay", str(CONVERSATION_TRACE), "--target", d.address, "--limit", "300",
                     "--bytes-per-token", "2", "--quiet", "--json", str(out)]) == 0
    finally:
        d.stop(0)
    rep = json.loads(out.read_text())
    assert rep["requests"] == 300 and rep["corrupt_blocks"] == 0
    assert 0 < rep["token_hit_rate"] < 1
    for field in ("block_hit_rate", "hits_by_tier", "blocks_put", "blocks_got", "bytes_put", "bytes_got", "seconds"):
        assert field in rep
    assert "token hit rate" in capsys.readouterr().out


def test_replays_with_other_payload_sizes_do_not_see_each_others_blocks(tmp_path):
    d = start_server(daemon_config(tmp_path))
    try:
        with KVStoreClient(d.address) as c:
            replay(TRACE, c, bytes_per_token=1, progress=False)
            rep = replay(TRACE, c, bytes_per_token=2, progress=False)
    finally:
        d.stop(0)
    assert rep.corrupt_blocks == 0 and rep.hit_tokens == 1536   # as on an empty store


def test_daemon_lost_mid_replay_gives_a_partial_report(tmp_path):
    from kvstore.common.errors import StoreUnavailable

    d = start_server(daemon_config(tmp_path))
    try:
        with KVStoreClient(d.address) as c:
            calls = {"n": 0}
            real_lookup = c.lookup

            def lookup(keys):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise StoreUnavailable("UNAVAILABLE: connection lost")
                return real_lookup(keys)
            c.lookup = lookup
            rep = replay(TRACE, c, bytes_per_token=1, progress=False)
    finally:
        d.stop(0)
    assert rep.requests == 2 and rep.hit_tokens == 1024 and rep.input_tokens == 2536   # r1, r2 done
    assert "connection lost" in rep.error and "STOPPED EARLY" in rep.table()


def test_ctrl_c_mid_replay_prints_and_writes_the_partial_report(tmp_path, monkeypatch, capsys):
    from kvstore.tools import replay as replay_mod
    from kvstore.tools.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {t}, "input_length": {r.input_length}, "output_length": 1, '
                             f'"hash_ids": {r.hash_ids}}}\n' for t, r in enumerate(TRACE)))
    real = replay_mod.block_token_counts
    calls = {"n": 0}

    def counts(*a):
        calls["n"] += 1
        if calls["n"] == 3:             # the third request: the user presses Ctrl-C
            raise KeyboardInterrupt
        return real(*a)
    monkeypatch.setattr(replay_mod, "block_token_counts", counts)
    out = tmp_path / "r.json"
    d = start_server(daemon_config(tmp_path))
    try:
        code = main(["replay", str(trace), "--target", d.address, "--bytes-per-token", "1", "--quiet",
                     "--json", str(out)])
    finally:
        d.stop(0)
    assert code == 130
    rep = json.loads(out.read_text())
    assert rep["requests"] == 2 and rep["hit_tokens"] == 1024 and rep["error"] == replay_mod.INTERRUPTED
    assert "STOPPED EARLY" in capsys.readouterr().out


def test_cli_rejects_bad_arguments_before_replaying(tmp_path, capsys):
    from kvstore.tools.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    with pytest.raises(SystemExit):
        main(["replay", str(trace), "--bytes-per-token", "0"])
    with pytest.raises(SystemExit):
        main(["replay", str(trace), "--limit", "-1"])
    assert main(["replay", str(trace), "--json", "/proc/nope/x.json"]) == 2
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["replay", str(trace), "--target", f"unix:{tmp_path}/none.sock", "--wait", "0.2",
                 "--json", str(tmp_path / "never.json")]) == 1
    assert not (tmp_path / "never.json").exists()     # no empty report left behind
    err = capsys.readouterr().err
    assert "cannot write --json" in err and "is `kvstore serve` running" in err
