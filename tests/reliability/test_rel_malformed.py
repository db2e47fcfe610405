"""Requests that are well-formed protobuf but say something impossible (an enum value
the API does not define, JSON nested past the parser's depth, a key named twice where
it can only be acted on once): each gets INVALID_ARGUMENT naming the field, never
INTERNAL, and changes nothing."""

from __future__ import annotations

import grpc
import pytest

from conftest import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.serve import start_server
from rel_support import key

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def node(tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme="16MiB"))
    ch = grpc.insecure_channel(d.address)
    yield d, pb_grpc.KVStoreStub(ch)
    ch.close()
    d.stop(0)


def refusal(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=20)
    return info.value


def test_session_hint_with_an_undefined_state_is_invalid_argument(node):
    _, stub = node
    err = refusal(stub.SessionHint, pb.SessionHintRequest(session_id="s", state=7, keys=[key(1)]))
    assert err.code() == INVALID
    assert "state" in err.details()
    # the daemon still serves a well-formed hint
    assert stub.SessionHint(pb.SessionHintRequest(session_id="s", keys=[key(1)]), timeout=20).expected_back_time > 0


def test_session_hint_with_json_nested_too_deep_is_invalid_argument(node):
    _, stub = node
    deep = "[" * 100_000 + "]" * 100_000
    err = refusal(stub.SessionHint, pb.SessionHintRequest(session_id="s", kv_hints_json=deep))
    assert err.code() == INVALID
    assert "kv_hints_json" in err.details()
