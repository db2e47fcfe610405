"""The client's connection to one daemon: the gRPC channel, how a call is made on it, the
message limits, and what the daemon says about itself.

:class:`Connection` is built by :class:`kvstore.client.KVStoreClient` and handed to its
parts (the arena path, the raw path, the lease releaser) through their constructors:
they make their calls with :meth:`Connection.call` (or the raw-frame callables), split
requests with :meth:`Connection.per_request`, and read the daemon's offer from
:meth:`Connection.info`. A failed call raises the :mod:`kvstore.common.errors` exception
of its status code (:meth:`Connection.error`, which also counts the calls that found the
daemon unavailable: the arena path re-checks the daemon's offer after one).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvstore.common import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.common.status import error_for
from kvstore.client.streams import StreamReaders
from kvstore.common.transport import (FRAMING_BYTES, KEY_FIELD_BYTES, MAX_KEYS_PER_REQUEST, client_channel_options,
                                      keys_per_request)

_DATA = "/kvstore.v1.KVStoreData/"


@dataclass(frozen=True)
class NodeInfo:
    """What the daemon says about itself (``Info``)."""

    version: str
    block_tokens: int
    key_hash: str
    max_message_bytes: int
    shm_socket: str
    shm_arena_bytes: int
    shm_refused: str


class Connection:
    """A gRPC channel to one daemon and its call settings.

    Args:
        target: gRPC target, e.g. ``"unix:/run/kvstore.sock"`` or ``"127.0.0.1:50051"``.
        timeout: per-call deadline in seconds, when a call gives none.
        auth_token: bearer token sent as ``authorization: Bearer <token>`` metadata ("": none).
        chunk_bytes: largest payload piece per data message (bytes).
        max_message_bytes: gRPC message size limit of both sides (bytes).
        root_certificates: PEM bytes to connect with TLS (TCP targets only), or None.
    Raises ValueError when ``chunk_bytes`` leaves less than
    :data:`~kvstore.common.transport.FRAMING_BYTES` of a message for framing.

    Attributes: ``target``, ``timeout``, ``auth_token``, ``chunk_bytes``,
    ``max_message_bytes`` as given; ``max_keys_per_request`` (the daemon's cap,
    :data:`~kvstore.common.transport.MAX_KEYS_PER_REQUEST`); ``unavailable`` (calls that
    failed with StoreUnavailable so far); ``metadata`` (sent with every call), ``channel``,
    ``stub`` (:class:`~kvstore._proto.kvstore_pb2_grpc.KVStoreStub`), and ``get_raw`` /
    ``put_raw``, the raw-frame methods of ``KVStoreData`` (serialized ``GetRequest`` in,
    frames out; frames in, a ``PutReply`` out); ``readers``
    (:class:`~kvstore.client.streams.StreamReaders`: read a response stream within the
    call's deadline even where grpcio's deadline does not end it).
    """

    def __init__(self, target: str, *, timeout: float, auth_token: str, chunk_bytes: int,
                 max_message_bytes: int, root_certificates: bytes | None):
        if chunk_bytes <= 0 or chunk_bytes > max_message_bytes - FRAMING_BYTES:
            raise ValueError(f"chunk_bytes must be > 0 and at least {FRAMING_BYTES} bytes below max_message_bytes")
        self.target = target
        self.timeout = timeout
        self.auth_token = auth_token
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.max_keys_per_request = MAX_KEYS_PER_REQUEST
        self.unavailable = 0
        self.metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        opts = client_channel_options(max_message_bytes)
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(target, options=opts)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.get_raw = self.channel.unary_stream(_DATA + "GetRaw", request_serializer=pb.GetRequest.SerializeToString)
        self.put_raw = self.channel.stream_unary(_DATA + "PutRaw", response_deserializer=pb.PutReply.FromString)
        self.readers = StreamReaders()
        self._info: NodeInfo | None = None
        self.closed = False

    def error(self, e: grpc.RpcError) -> errors.KVStoreError:
        """The store error of a failed call (:func:`~kvstore.common.status.error_for`);
        counts it in :attr:`unavailable` when it is StoreUnavailable."""
        error = error_for(e)
        if isinstance(error, errors.StoreUnavailable):
            self.unavailable += 1
        return error

    def call(self, method, request, timeout: float | None = None, *, wait_for_ready: bool = False):
        """``method(request)`` with the deadline (``timeout`` s, else :attr:`timeout`) and
        the metadata; with ``wait_for_ready`` the call waits (within its deadline) for the
        channel to connect instead of failing at once while it cannot. Raises the store
        error of a failed call's status code."""
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata,
                          wait_for_ready=wait_for_ready or None)
        except grpc.RpcError as e:
            raise self.error(e) from None
        except ValueError:                      # grpc's "closed channel"
            if self.closed:
                raise self.closed_error() from None
            raise

    def closed_error(self) -> errors.StoreUnavailable:
        """The error of a call made after :meth:`close` (grpc raises a bare ValueError)."""
        return errors.StoreUnavailable(f"this client of {self.target} is closed: make a new KVStoreClient")

    def per_request(self, per_key: int = KEY_FIELD_BYTES, extra: int = 0) -> int:
        """Most keys one request may list (``per_key`` wire bytes each, ``extra`` bytes of
        other fields) under the message limit and the daemon's key cap
        (:func:`kvstore.common.transport.keys_per_request`)."""
        return keys_per_request(self.max_message_bytes, per_key, extra, self.max_keys_per_request)

    def info(self, timeout: float | None = None, *, fresh: bool = False, wait_for_ready: bool = False) -> NodeInfo:
        """The node's block size, key hash and data-path offer (asked once, then cached
        until :meth:`forget_info`; ``fresh`` asks again). Raises StoreUnavailable when the
        daemon does not answer within ``timeout`` seconds."""
        if self._info is None or fresh:
            r = self.call(self.stub.Info, pb.InfoRequest(), timeout, wait_for_ready=wait_for_ready)
            self._info = NodeInfo(r.version, r.block_tokens, r.key_hash, r.max_message_bytes, r.shm_socket,
                                  r.shm_arena_bytes, r.shm_refused)
        return self._info

    def forget_info(self) -> None:
        """Drop the cached :meth:`info` (the daemon restarted: its offer may differ)."""
        self._info = None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the daemon answers. Raises StoreUnavailable after ``timeout`` s."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.StoreUnavailable(f"kvstore daemon at {self.target} not ready after {timeout}s") from None

    def close(self) -> None:
        """Close the channel (calls in flight fail; later calls raise StoreUnavailable)."""
        self.closed = True
        self.channel.close()
        self.readers.close()
