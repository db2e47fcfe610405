"""LeaseReleaser.close() racing the first add(): close never joins a thread not yet started."""

from __future__ import annotations

import threading
import types

from kvstore.client import lease_releaser


def test_close_while_the_release_thread_is_starting_does_not_raise(monkeypatch):
    Thread = threading.Thread                # the real class: the patch below is seen by every module
    starting, closed = threading.Event(), threading.Event()
    started: list[threading.Thread] = []

    class SlowStart(Thread):
        def start(self):                     # close() runs between the thread's creation and its start
            started.append(self)
            starting.set()
            assert closed.wait(30)
            super().start()

    monkeypatch.setattr(lease_releaser.threading, "Thread", SlowStart)
    conn = types.SimpleNamespace(timeout=5.0, stub=None, metadata=())
    r = lease_releaser.LeaseReleaser(conn)
    r._send = lambda: None                   # no daemon here: nothing to send
    adder = Thread(target=r.add, args=("lease-1",))
    adder.start()
    assert starting.wait(30)
    r.close()                                # was: RuntimeError "cannot join thread before it is started"
    closed.set()
    adder.join(30)
    started[0].join(30)
    assert not started[0].is_alive()         # it saw the stop and ended
