"""A response stream that gRPC never ends still ends at the client's deadline.

grpcio 1.85 left a ``GetRaw`` stream waiting for ever after a daemon stopped in the same
process: the call had its UNAVAILABLE status, but its message operation never completed,
and ``next()`` waits for that (10 of 400 repeats, CPUs saturated, of the leased-read test
whose daemon stops mid-read; one hung a whole-suite run). These tests stand a call that never ends in for
grpcio's, as that one behaved: its iteration blocks and a cancel does not wake it; the
call that had its error status raises it at once.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvstore.client.client import KVStoreClient
from kvstore.client.streams import GRACE_S, READ_AHEAD, StreamEnded, StreamReaders
from kvstore.common.errors import StoreUnavailable

WAIT_S = 60.0        # generous: the verdict never depends on speed


def wait_until(predicate) -> None:
    """Wait (at most :data:`WAIT_S`) until ``predicate()``; the caller asserts it after."""
    deadline = time.monotonic() + WAIT_S
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


class StuckCall:
    """A response stream that yields ``messages`` and then waits for ever (a cancel
    is recorded but wakes nothing), as grpcio's call did."""

    def __init__(self, messages=(), fail: grpc.RpcError | None = None, stuck: bool = True,
                 status: grpc.StatusCode | None = None):
        self.messages = list(messages)
        self.fail = fail
        self.stuck = stuck
        self.status = status                   # the status gRPC already has (None: none yet)
        self.cancelled = threading.Event()
        self.released = threading.Event()      # set by the test's cleanup only

    def add_done_callback(self, fn) -> None:
        if self.status is not None:            # grpcio calls it at once on an ended call
            fn(self)

    def code(self):
        return self.status

    def __iter__(self):
        yield from self.messages
        if self.fail is not None:
            raise self.fail
        if self.stuck:
            self.released.wait()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "gone"


def read_in_thread(readers: StreamReaders, call, timeout: float):
    """Read ``call`` on a thread; returns (done event, result dict: messages, error)."""
    done, out = threading.Event(), {"messages": [], "error": None}

    def run():
        try:
            for m in readers.read(call, timeout):
                out["messages"].append(m)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e
        finally:
            done.set()
    threading.Thread(target=run, daemon=True).start()
    return done, out


def test_a_stream_that_never_ends_raises_at_its_deadline_and_is_cancelled():
    readers = StreamReaders()
    call = StuckCall([b"a", b"b"])
    try:
        done, out = read_in_thread(readers, call, 0.2)
        assert done.wait(WAIT_S), "the read waited for ever on a stream gRPC never ended"
        assert out["messages"] == [b"a", b"b"]                 # what came is handed on, in order
        assert isinstance(out["error"], StreamEnded)
        assert call.cancelled.is_set()
    finally:
        call.released.set()
        readers.close()


class EndedCall(StuckCall, grpc.RpcError):
    """The call as grpcio left it: UNAVAILABLE status, the message still awaited."""


def test_a_stream_whose_error_status_came_raises_it_without_waiting_for_the_message():
    readers = StreamReaders()
    call = EndedCall([b"a"], status=grpc.StatusCode.UNAVAILABLE)
    try:
        done, out = read_in_thread(readers, call, 30.0)
        assert done.wait(WAIT_S)
        assert out["error"] is call                  # its status, not the deadline's StreamEnded
        assert not call.cancelled.is_set()           # it had ended
    finally:
        call.released.set()
        readers.close()


def test_lost_readers_do_not_stop_the_next_stream():
    readers = StreamReaders(grace_s=0.01)
    stuck = [StuckCall() for _ in range(40)]
    try:
        for call in stuck:                                    # forty readers left waiting
            with pytest.raises(StreamEnded):
                list(readers.read(call, 0.01))
        assert list(readers.read(StuckCall([b"x", b"y"], stuck=False), 5.0)) == [b"x", b"y"]
    finally:
        for call in stuck:
            call.released.set()
        readers.close()


def test_a_process_with_a_reader_left_on_a_stream_still_exits():
    """Readers are daemon threads: a pool that joined its threads at exit waited for ever."""
    code = ("import sys; sys.path[:0] = ['tests', 'tests/kvstore']\n"
            "from test_stream_deadline import StuckCall\n"
            "from kvstore.client.streams import StreamEnded, StreamReaders\n"
            "r = StreamReaders(grace_s=0.01)\n"
            "try:\n    list(r.read(StuckCall(), 0.01))\nexcept StreamEnded:\n    print('ended')\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=WAIT_S * 2,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert (out.returncode, out.stdout.strip()) == (0, "ended"), out.stderr[-2000:]


def test_a_reader_takes_at_most_read_ahead_messages_before_its_caller():
    pulled = []

    def messages():
        for i in range(100):
            pulled.append(i)
            yield bytes([i])

    class Call(StuckCall):
        def __iter__(self):
            return messages()
    readers = StreamReaders()
    it = readers.read(Call(), 30.0)
    assert next(it) == b"\x00"
    wait_until(lambda: len(pulled) >= READ_AHEAD + 1)
    time.sleep(0.2)                                         # room to overrun, were there any
    assert len(pulled) == READ_AHEAD + 1                    # one handed on, READ_AHEAD waiting
    assert list(it) == [bytes([i]) for i in range(1, 100)]
    readers.close()


def test_idle_readers_end_when_the_client_closes():
    def readers_alive():
        return sum(1 for t in threading.enumerate() if t.name.startswith("kvstore-stream-test"))
    readers = StreamReaders(name="kvstore-stream-test")
    for _ in range(3):
        assert list(readers.read(StuckCall([b"a"], stuck=False), 5.0)) == [b"a"]
    assert readers_alive() >= 1
    readers.close()
    wait_until(lambda: readers_alive() == 0)
    assert readers_alive() == 0


def test_a_failed_stream_raises_its_own_error_and_is_not_cancelled():
    readers = StreamReaders()
    call = StuckCall([b"a"], fail=Unavailable())
    got = []
    with pytest.raises(Unavailable):
        for m in readers.read(call, 5.0):
            got.append(m)
    assert got == [b"a"] and not call.cancelled.is_set()
    readers.close()


def test_a_read_stopped_early_cancels_its_call():
    readers = StreamReaders()
    call = StuckCall([b"a", b"b", b"c"])
    it = readers.read(call, 30.0)
    assert next(it) == b"a"
    it.close()
    assert call.cancelled.is_set()
    call.released.set()
    readers.close()


def test_a_closed_client_s_readers_take_no_stream():
    readers = StreamReaders()
    readers.close()
    with pytest.raises(ValueError):
        list(readers.read(StuckCall(stuck=False), 1.0))


def test_a_get_whose_stream_never_ends_is_a_bounded_store_unavailable(daemon):
    keys = [bytes([i]) * 32 for i in range(4)]
    with KVStoreClient(daemon.address, timeout=0.3, shared_memory=False) as c:
        c.put([(k, b"v" * 1024) for k in keys])
        calls: list[StuckCall] = []

        def stuck_get_raw(request, timeout=None, metadata=None):
            calls.append(StuckCall())
            return calls[-1]
        conn = c._connection
        real, conn.get_raw = conn.get_raw, stuck_get_raw
        before = conn.unavailable
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="DEADLINE_EXCEEDED"):
                c.get(keys)
            took = time.monotonic() - t0
            assert calls and all(call.cancelled.is_set() for call in calls)
            assert conn.unavailable == before + 1
            assert took < WAIT_S                 # bounded; about 0.3 + GRACE_S s
        finally:
            for call in calls:
                call.released.set()
            conn.get_raw = real
        assert [r.found for r in c.get(keys)] == [True] * 4     # the client goes on
        print(f"\na get on a stream that never ended raised after {took:.2f} s (deadline 0.3 s + {GRACE_S:g} s)")


def test_a_forked_child_reads_streams_with_readers_of_its_own():
    """The pool's idle threads stay behind in the parent: a child that took them for its
    own would wait for a reader until its deadline."""
    readers = StreamReaders()
    assert list(readers.read(StuckCall([b"p"], stuck=False), 5.0)) == [b"p"]     # a reader, idle now
    assert child_reads(readers, [b"c1", b"c2"]) == 0
    with readers._lock:                             # a fork while another thread holds the lock
        assert child_reads(readers, [b"c3"]) == 0
    readers.close()


def child_reads(readers: StreamReaders, messages: list[bytes]) -> int:
    """Fork a child that reads a stream of ``messages`` with ``readers``; its exit code
    (0: read right; a child that waits for ever ends by its alarm, nonzero)."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        try:
            ok = list(readers.read(StuckCall(messages, stuck=False), 2.0)) == messages
        except BaseException:  # noqa: BLE001 - the exit status says it
            ok = False
        os._exit(0 if ok else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_call_that_cannot_be_iterated_raises_its_error_and_the_reader_goes_on():
    class Broken(StuckCall):
        def __iter__(self):
            raise TypeError("not iterable")
    readers = StreamReaders(grace_s=30.0)
    with pytest.raises(TypeError, match="not iterable"):      # its own error, not the deadline's
        list(readers.read(Broken(), 30.0))
    assert list(readers.read(StuckCall([b"ok"], stuck=False), 30.0)) == [b"ok"]
    readers.close()


def test_a_reader_that_cannot_start_leaves_no_job_behind(monkeypatch):
    """Out of threads: the read fails at once with the call cancelled, and the next read
    (a thread now starts) is served; no job was left queued for a reader that never came."""
    start, failed = threading.Thread.start, []

    def start_once_failing(self):
        if self.name.startswith("kvstore-stream-nothread") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        return start(self)
    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    readers = StreamReaders(name="kvstore-stream-nothread", grace_s=30.0)
    call = StuckCall([b"x"], stuck=False)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        list(readers.read(call, 30.0))
    assert failed and call.cancelled.is_set()
    for _ in range(3):
        assert list(readers.read(StuckCall([b"a", b"b"], stuck=False), 30.0)) == [b"a", b"b"]
    readers.close()
