"""Removals from the cluster for the Mooncake remote tier, on a background thread, so that
freeing a block never waits on the network."""

from __future__ import annotations

import collections
import logging
import threading

from tiers.errors import MediaIOError
from tiers.mooncake.client import all_master_down
from tiers.mooncake.context import RemoteContext

log = logging.getLogger("kvstore.tiers.remote")


class Remover:
    """Removes objects from the cluster on a background thread, up to ``batch`` names
    per forced ``batch_remove``, so a caller holding a lock never waits on the network.
    A removal that fails (cluster unreachable) is dropped: the object is then gone
    with the master anyway, or left to the cluster's own eviction (its bytes stay
    valid under its key). ``failed`` counts names not removed."""

    def __init__(self, ctx: RemoteContext, batch: int = 256):
        self._ctx = ctx
        self._batch = batch
        self._names: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"{ctx.name}-remove", daemon=True)
        self._thread.start()

    def submit(self, name: str) -> None:
        """Queue the removal of object ``name``."""
        with self._cond:
            if not self._stopped:
                self._names.append(name)
                self._cond.notify_all()

    def _run(self) -> None:
        ctx = self._ctx
        while True:
            with self._cond:
                while not self._names and not self._stopped:
                    self._cond.wait()
                if self._stopped and not self._names:
                    return
                names = [self._names.popleft() for _ in range(min(self._batch, len(self._names)))]
                self._busy = True
            try:
                store = ctx.session()
                ctx.guard.call(store.batch_remove, names, True, judge=all_master_down)
            except MediaIOError as exc:
                self.failed += len(names)
                log.info("%s: %d remote removals dropped: %s", ctx.name, len(names), exc)
            except Exception:                          # never let the thread die
                self.failed += len(names)
                log.exception("%s: remote removal failed", ctx.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until every submitted removal was tried."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._names and not self._busy, timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Try what is queued (up to ``timeout_s`` seconds), then end the thread."""
        self.wait_idle(timeout_s)
        with self._cond:
            self._stopped = True
            self._names.clear()
            self._cond.notify_all()


__all__ = ["Remover"]
