"""The client and daemon under the oldest supported protobuf / grpcio pair (pyproject floors).

scripts/test-integrations.sh runs this in ``.venv-oldest`` (protobuf 5.29.0, grpcio
1.71.2); elsewhere it skips.
"""

import google.protobuf
import grpc
import pytest

if not google.protobuf.__version__.startswith("5.29.") or grpc.__version__ != "1.71.2":
    pytest.skip(f"runs under protobuf 5.29 / grpcio 1.71.2 (.venv-oldest), not "
                f"{google.protobuf.__version__} / {grpc.__version__}", allow_module_level=True)


def test_client_round_trip_under_oldest_pins(client):
    key = bytes(range(32))
    assert client.lookup([key]).hit_blocks == 0
    client.put([(key, b"kv" * 1000)])
    assert client.lookup([key]).hit_blocks == 1
    [got] = client.get([key])
    assert got.found and got.data == b"kv" * 1000
