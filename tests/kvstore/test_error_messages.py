"""Every error message names its method once (issue 19, item 20): "PutRaw: PutRaw: ..." came
from a handler that put its own name in front of a message the handler wrapper names again."""

from __future__ import annotations

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.common.wire import META, encode
from kvstore.service.startup import start_server
from support.daemon import daemon_config

DATA = "/kvstore.v1.KVStoreData/"


@pytest.fixture
def address(tmp_path):
    d = start_server(daemon_config(tmp_path, host="4MiB", nvme=None))
    yield d.address
    d.stop(0)


def failed(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


@pytest.mark.parametrize("frame,what", [
    (b"not a frame at all", "bad frame magic"),
    (encode([(b"k" * 32, META, 0, 4, 0, b"\xff\xfe")]), "a BlockMeta record does not decode"),
])
def test_put_raw_errors_name_the_method_once(address, frame, what):
    with grpc.insecure_channel(address) as ch:
        err = failed(lambda: ch.stream_unary(DATA + "PutRaw")(iter([frame]), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("PutRaw: ") and err.details().count("PutRaw") == 1, err.details()
    assert what in err.details()


def test_get_raw_errors_name_the_method_once(address):
    with grpc.insecure_channel(address) as ch:
        err = failed(lambda: list(ch.unary_stream(DATA + "GetRaw")(b"\xff\xff\xff", timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("GetRaw: request does not decode") and err.details().count("GetRaw") == 1


def test_a_unary_error_names_its_method_once(address):
    with grpc.insecure_channel(address) as ch:
        err = failed(lambda: ch.unary_unary("/kvstore.v1.KVStore/Lookup",
                                            request_serializer=pb.LookupRequest.SerializeToString)(
            pb.LookupRequest(keys=[b"short"]), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("Lookup: ") and err.details().count("Lookup:") == 1
