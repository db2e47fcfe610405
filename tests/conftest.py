"""Shared fixtures: an in-process daemon on a unix socket under tmp_path (helpers in
tests/support/daemon.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # `from support... import ...`

from kvstore.client.client import KVStoreClient  # noqa: E402
from support.daemon import CONVERSATION_TRACE, ROOT, daemon_config, short_socket_dir  # noqa: E402,F401


@pytest.fixture
def daemon(tmp_path):
    from kvstore.service.startup import start_server

    d = start_server(daemon_config(tmp_path))
    yield d
    d.stop(0)


@pytest.fixture
def client(daemon):
    with KVStoreClient(daemon.address, timeout=10) as c:
        yield c
