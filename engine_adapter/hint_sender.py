"""Agent hints sent to the daemon off the engine's scheduler thread.

:class:`HintSender` queues each hint call (``ToolCallStart``, ``Resume``, ``SessionHint``)
and makes it on one background thread (:class:`engine_adapter.background.BackgroundJobs`),
in order, so a tool call's start always reaches the daemon before its resume. The
scheduler never waits on it:

- the queue is bounded (``max_pending`` calls); a hint that finds it full is dropped and
  counted (``dropped_full``);
- it sits behind the plug-in's circuit breaker (the :class:`~engine_adapter.store_io.GuardedStore`'s
  :class:`~engine_adapter.breaker.StoreBreaker`): while the store is down a hint is dropped
  at once and counted (``dropped_store_down``), and a hint call that finds the store
  unavailable opens the breaker like any store call (kind ``hint``);
- a call the daemon refuses (``InvalidRequest``: a malformed envelope, a name too long) is
  logged once and counted (``refused``); a daemon that takes no tool-call hints
  (``FeatureDisabled``: ``[prefetch]`` off and no ``next_use`` policy) is logged once at INFO
  and that kind of call is not made again for :data:`DISABLED_RETRY_S` seconds
  (``dropped_disabled``).

Hints are advice: none of this ever fails a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Sequence

from kvstore.common.errors import FeatureDisabled, InvalidRequest, KVStoreError, StoreUnavailable
from kvstore.common.hint_limits import MAX_HINT_KEYS

from engine_adapter.background import BackgroundJobs

log = logging.getLogger("engine_adapter.hints")

HINT = "hint"
"""The breaker's kind for hint calls (its outage summary counts them as not served)."""

TOOL_CALL_START, RESUME, SESSION_HINT = "tool_call_start", "resume", "session_hint"

DISABLED_RETRY_S = 60.0
"""After the daemon said a kind of hint is off, seconds before that kind is tried again."""


class HintSender:
    """Queues hint calls to the daemon and makes them on a background thread.

    Args:
        store: the plug-in's :class:`~engine_adapter.store_io.GuardedStore` (its ``store``,
            the client, makes the calls: ``tool_call_start``, ``resume``, ``session_hint``;
            its ``breaker`` guards them).
        max_pending: hint calls queued at most (memory bound; more are dropped).
        timeout_s: deadline of one hint call, seconds.
        clock: monotonic seconds (when a kind the daemon refused is tried again).

    Attributes:
        counts: ``sent``, ``dropped_full``, ``dropped_store_down``, ``dropped_disabled``,
            ``refused``, ``failed`` (calls), read with :meth:`stats`.
    """

    def __init__(self, store, *, max_pending: int = 1024, timeout_s: float = 1.0, clock=time.monotonic):
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.client = store.store
        self.breaker = store.breaker
        self.timeout_s = timeout_s
        self.clock = clock
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._disabled_until: dict[str, float] = {}
        self._logged: set[str] = set()
        self._jobs = BackgroundJobs(self._send, "kvstore-hints", max_pending)

    # ------------------------------------------------------------ what the scheduler calls

    def tool_call_start(self, trajectory_id: str, tool: str, keys: Sequence[bytes], start_time: float) -> bool:
        """Queue ``ToolCallStart`` (``start_time``: unix seconds; of a prefix longer than
        ``MAX_HINT_KEYS`` blocks, its first ones are named). False when dropped."""
        keys = list(keys[:MAX_HINT_KEYS])
        return self._submit(TOOL_CALL_START, len(keys), trajectory_id, tool, keys, start_time)

    def resume(self, trajectory_id: str, at: float) -> bool:
        """Queue ``Resume`` (``at``: unix seconds). False when dropped."""
        return self._submit(RESUME, 0, trajectory_id, at)

    def session_hint(self, session_id: str, state: str, keys: Sequence[bytes], at: float, *,
                     expected_back_s: float | None = None, ttl_s: float | None = None,
                     kv_hints: dict | None = None) -> bool:
        """Queue ``SessionHint`` (``state``: continues / finished / abandoned; or a vLLM
        ``kv_hints`` envelope; ``at``: unix seconds; of a prefix longer than ``MAX_HINT_KEYS``
        blocks, its first ones are named). False when dropped."""
        keys = list(keys[:MAX_HINT_KEYS])
        return self._submit(SESSION_HINT, len(keys), session_id, state, keys, at, expected_back_s, ttl_s, kv_hints)

    def stats(self) -> dict[str, int]:
        """Counts of hint calls by outcome (see the class docstring)."""
        with self._lock:
            return dict(self._counts)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued hint was sent or dropped; False if ``timeout_s`` passed."""
        return self._jobs.flush(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``) and stop the thread."""
        self._jobs.close(timeout_s)

    # ------------------------------------------------------------ internals

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def _once(self, what: str, level: int, msg: str, *args) -> None:
        """Log ``msg`` the first time ``what`` happens; DEBUG afterwards."""
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        log.log(level if first else logging.DEBUG, msg, *args)

    def _skip(self, kind: str, blocks: int) -> bool:
        """Whether to drop a ``kind`` hint now (store down, or the kind is off); counted."""
        if not self.breaker.allow():
            self.breaker.skipped(HINT, blocks)
            self._count("dropped_store_down")
            return True
        until = self._disabled_until.get(kind)
        if until is not None and self.clock() < until:
            self._count("dropped_disabled")
            return True
        return False

    def _submit(self, kind: str, blocks: int, *args) -> bool:
        if self._skip(kind, blocks):
            return False
        if not self._jobs.submit(kind, blocks, args, block=False):
            self._count("dropped_full")
            self._once("full", logging.WARNING, "kvstore hint queue full (%d calls): hints are dropped until the "
                       "daemon catches up", self._jobs.max_pending)
            return False
        return True

    def _send(self, kind: str, blocks: int, args: tuple) -> None:
        if self._skip(kind, blocks):
            return
        c, t = self.client, self.timeout_s
        try:
            if kind == TOOL_CALL_START:
                tid, tool, keys, start = args
                c.tool_call_start(tid, tool, keys, start_time=start, timeout=t)
            elif kind == RESUME:
                tid, at = args
                c.resume(tid, at=at, timeout=t)
            else:
                sid, state, keys, at, back, ttl, env = args
                c.session_hint(sid, state, keys, expected_back_s=back, ttl_s=ttl, at=at, kv_hints=env, timeout=t)
        except StoreUnavailable as e:
            self.breaker.failed(HINT, blocks, e)
            self._count("dropped_store_down")
            return
        except FeatureDisabled as e:
            self._disabled_until[kind] = self.clock() + DISABLED_RETRY_S
            self._count("dropped_disabled")
            self._once(f"off:{kind}", logging.INFO, "the kvstore daemon takes no %s hints (%s); not sent for %g s",
                       kind, e, DISABLED_RETRY_S)
            return
        except InvalidRequest as e:
            self._count("refused")
            self._once(f"refused:{kind}", logging.WARNING, "the kvstore daemon refused a %s hint (%s); such hints "
                       "are ignored, requests are served as without them", kind, e)
            return
        except KVStoreError as e:
            self._count("failed")
            self._once(f"failed:{kind}", logging.WARNING, "a %s hint to the kvstore daemon failed (%s)", kind, e)
            return
        self.breaker.succeeded()
        self._count("sent")
