"""The committed gRPC stubs must match proto/kvstore.proto."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_generated_stubs_match_proto(tmp_path):
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_proto import generate
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    for name in ("kvstore_pb2.py", "kvstore_pb2_grpc.py", "__init__.py"):
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "kvstore" / "_proto" / name).read_text()
        assert fresh == committed, f"kvstore/_proto/{name} is stale: run python scripts/gen_proto.py"
