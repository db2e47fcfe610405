"""Shared fixtures: an in-process daemon on a unix socket under tmp_path."""

from __future__ import annotations

import pathlib
import sys
import tempfile

import pytest

from kvstore import config
from kvstore.client import KVStoreClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))        # test support: `from support.fake_tiers import MemTier`
SHARED_DATA = ROOT.parent / "shared" / "data"
CONVERSATION_TRACE = SHARED_DATA / "traces" / "mooncake_conversation_trace.jsonl"


def short_socket_dir() -> pathlib.Path:
    """A short folder for unix sockets (their paths are limited to ~107 bytes)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="kvs-"))


def daemon_config(tmp_path: pathlib.Path, *, host: str | int = "64MiB", nvme: str | int | None = "256MiB",
                  extra: dict | None = None) -> config.Config:
    data: dict = {
        "server": {"listen": f"unix:{short_socket_dir()}/kvstore.sock", "workers": 4},
        "tiers": {
            "host": {"capacity": host},
            "nvme": {"enabled": nvme is not None, "path": str(tmp_path / "nvme"),
                     "capacity": nvme if nvme is not None else "1MiB"},
        },
    }
    for section, values in (extra or {}).items():
        data.setdefault(section, {}).update(values)
    return config.from_dict(data)


@pytest.fixture
def daemon(tmp_path):
    from kvstore.serve import start_server

    d = start_server(daemon_config(tmp_path))
    yield d
    d.stop(0)


@pytest.fixture
def client(daemon):
    with KVStoreClient(daemon.address, timeout=10) as c:
        yield c
