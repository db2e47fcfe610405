"""Requests that are well-formed protobuf but say something impossible (an enum value
the API does not define, JSON nested past the parser's depth, a key named twice where
it can only be acted on once): each gets INVALID_ARGUMENT naming the field, never
INTERNAL, and changes nothing."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from support.daemon import daemon_config
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVStoreClient
from kvstore.service.startup import start_server
from rel_support import key, payload

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def node(tmp_path):
    d = start_server(daemon_config(tmp_path, host="8MiB", nvme="16MiB"))
    ch = grpc.insecure_channel(d.address)
    yield d, pb_grpc.KVStoreStub(ch)
    ch.close()
    d.stop(0)


def refusal(call, request, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=20, **kw)
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


def test_commit_naming_a_key_twice_is_invalid_argument_and_commits_nothing(node):
    d, stub = node
    k = key(1)
    with KVStoreClient(d.address, shared_memory=True) as c:
        meta = c.arena().metadata                       # the client's arena and session
        reply = stub.Reserve(pb.ReserveRequest(keys=[k], sizes=[4096]), timeout=20, metadata=meta)
        assert list(reply.status) == [pb.RESERVED]
        c.arena().array[reply.offsets[0]:reply.offsets[0] + 4096] = np.frombuffer(payload(k, 4096), np.uint8)
        err = refusal(stub.Commit, pb.CommitRequest(keys=[k, k]), metadata=meta)
        assert err.code() == INVALID
        assert "keys[1]" in err.details()
        assert stub.Lookup(pb.LookupRequest(keys=[k]), timeout=20).hit_blocks == 0   # nothing committed
        # the reservation is still open: the well-formed Commit stores the block
        assert stub.Commit(pb.CommitRequest(keys=[k]), timeout=20, metadata=meta).committed == 1
        assert c.get([k])[0].data == payload(k, 4096)
