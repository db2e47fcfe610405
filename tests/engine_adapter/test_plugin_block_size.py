"""Every plug-in refuses, at start, a daemon configured for another block size than the
engine's (``[blocks] block_tokens``), and starts with a warning when the daemon cannot be
asked. (SGLang's page size: tests/integrations/test_sglang_backend.py, which needs SGLang.)"""

from __future__ import annotations

import logging

import pytest

import ns_support as nss
from ea_support import engine
from engine_adapter import store_io
from engine_adapter.reference.runner import Runner
from engine_adapter.reference.tp import TPGroup
from engine_adapter.vllm.scheduler import SchedulerPlanner
from engine_adapter.vllm.settings import ConnectorSettings, namespace_of
from kvstore.client.client import KVStoreClient
from support.daemon import daemon_config


@pytest.fixture
def daemon16(tmp_path):
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path, extra={"blocks": {"block_tokens": 16}}))
    yield d
    d.stop(0)


def planner(block_size: int, client) -> SchedulerPlanner:
    cfg = nss.vllm_config("no-such-org/m", block_size=block_size)
    return SchedulerPlanner(namespace_of(cfg, ConnectorSettings(target="unix:/x")), block_size, client, 30.0)


def test_vllm_scheduler_half_refuses_a_daemon_of_another_block_size(daemon16):
    with KVStoreClient(daemon16.address, timeout=30) as c:
        with pytest.raises(ValueError, match=r"vLLM block_size 32 does not match the kvstore daemon.*"
                                             r"configured for 16 \(\[blocks\] block_tokens\)"):
            planner(32, c)
        assert planner(16, c).block_size == 16


def test_reference_runner_refuses_a_daemon_of_another_block_size(daemon16):
    with KVStoreClient(daemon16.address, timeout=30) as c:
        with pytest.raises(ValueError, match=r"reference runner's block_tokens 32 does not match.*configured for 16"):
            Runner(nss.MODEL, engine(block_tokens=32), TPGroup.single(), store=c)
        Runner(nss.MODEL, engine(block_tokens=16), TPGroup.single(), store=c).close()


def test_a_daemon_without_block_tokens_accepts_any(client):
    assert store_io.check_block_tokens(client, 32, "vLLM block_size") is True


def test_an_unreachable_daemon_is_a_warning_not_a_refusal(tmp_path, caplog):
    with KVStoreClient(f"unix:{tmp_path}/absent.sock", timeout=1) as c, caplog.at_level(logging.WARNING):
        assert planner(32, c).block_size == 32
    assert any("cannot check the kvstore daemon's block size against vLLM block_size 32" in r.getMessage()
               for r in caplog.records)
