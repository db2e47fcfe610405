"""Deadlines and a circuit breaker for calls into a cluster store's client library.

A cluster client library (Mooncake Store's) makes blocking calls that can take far
longer than a cache may wait: on this team's machine a get or put against a killed
master returns RPC_FAIL only after ~4.4 s, a ``setup`` against a master that is down
after ~90 s, a get from a stopped peer after 30 s (see ``docs/remote_tier.md``). A
cache must turn those into fast misses, so every call goes through :class:`CallGuard`:

- **Deadline.** The call runs on one of a few daemon worker threads; the caller waits
  at most its deadline, then gets :class:`RemoteTimeout` (a MediaIOError). A call
  cannot be cancelled once running: it is *abandoned*, keeps its worker until the
  library returns, and ``on_abandon`` runs then, so buffers it uses are reused only
  after it is really done. At most ``max_in_flight`` calls (running or abandoned) exist
  at once; beyond that calls are refused at once.
- **Circuit breaker** (the pattern of Nygard, *Release It!*, 2007). After
  ``failure_threshold`` consecutive failures (timeouts, exceptions, or results the
  caller judges to mean "remote unavailable") the breaker *opens*: calls fail at once
  for ``cooldown_s`` seconds, without touching the library. Then it is *half open*: one
  call goes through as a probe; success closes the breaker, failure opens it again.

Nothing here knows Mooncake; :mod:`tiers.mooncake` supplies the calls and judges.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from tiers.errors import MediaIOError

log = logging.getLogger("kvstore.tiers.remote")


class RemoteTimeout(MediaIOError):
    """A remote call did not finish by its deadline; it was abandoned, not cancelled."""


class RemoteUnavailable(MediaIOError):
    """Refused without calling: the breaker is open, the client is not connected, or too
    many calls are in flight."""


class RemoteState(str, enum.Enum):
    """Health of a remote tier, as exposed to metrics (``value`` is the label)."""

    CONNECTING = "connecting"    # no session with the cluster yet (or it is being re-made)
    HEALTHY = "healthy"          # breaker closed: calls go through
    OPEN = "open"                # breaker open: calls refused until the cooldown ends
    HALF_OPEN = "half_open"      # one probe call allowed
    CLOSED = "closed"            # the tier was closed


@dataclass(frozen=True)
class GuardStats:
    """Counters of a :class:`CallGuard` since it was made.

    Attributes:
        calls: calls admitted (run on a worker).
        failures: admitted calls that failed (timeouts included).
        timeouts: calls abandoned at their deadline.
        rejected: calls refused without running (breaker open, saturation).
        in_flight: calls running now, abandoned ones included.
        abandoned_in_flight: abandoned calls still running in the library.
        consecutive_failures: failures since the last success.
        last_error: text of the last failure ('' if none).
        open_for_s: seconds until the breaker lets a probe through (0 unless open).
        breaker: "closed", "open" or "half_open".
    """

    calls: int
    failures: int
    timeouts: int
    rejected: int
    in_flight: int
    abandoned_in_flight: int
    consecutive_failures: int
    last_error: str
    open_for_s: float
    breaker: str


@dataclass(frozen=True)
class RemoteHealth:
    """The remote tier's state for health checks and metrics.

    Attributes:
        state: connecting, healthy, open, half_open or closed.
        master: the master's address.
        last_error: the last connection or call failure ('' if none).
        blocks: blocks this node put and still tracks.
        used_bytes: their object bytes plus open reservations.
        staging_used_bytes: bytes of the staging buffer lent now.
        corrupt_blocks: remote copies that failed verification (since start).
        peer_errors: reads that a peer did not serve (TRANSFER_FAIL and the like).
        oversize_reads: batch reads whose object exceeded the caller's buffer.
        guard: call counters and breaker state.
    """

    state: RemoteState
    master: str
    last_error: str
    blocks: int
    used_bytes: int
    staging_used_bytes: int
    corrupt_blocks: int
    peer_errors: int
    oversize_reads: int
    guard: GuardStats


class _Workers:
    """A fixed set of daemon threads running submitted calls (daemon, unlike
    ThreadPoolExecutor's, so a call stuck in the library never holds up exit)."""

    def __init__(self, count: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()
        self._count = count

    def submit(self, fn: Callable[..., Any], args: tuple) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:        # handed to the waiting caller
                fut.set_exception(exc)

    def shutdown(self) -> None:
        """Let idle workers exit; running calls finish first (nobody waits for them)."""
        for _ in range(self._count):
            self._jobs.put(None)


class CallGuard:
    """Runs blocking remote calls with a deadline, behind a circuit breaker.

    Args:
        name: label for threads, logs and errors.
        timeout_s: default deadline of a call in seconds (> 0).
        failure_threshold: consecutive failures that open the breaker (>= 1).
        cooldown_s: seconds the breaker stays open before a probe (>= 0).
        max_in_flight: worker threads, and the most calls (abandoned ones included)
            that may exist at once (>= 1).
        clock: monotonic clock in seconds (tests inject one).

    Thread-safe.
    """

    def __init__(self, name: str, *, timeout_s: float, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 max_in_flight: int = 8, clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0 or failure_threshold < 1 or cooldown_s < 0 or max_in_flight < 1:
            raise ValueError(f"bad guard settings: timeout_s={timeout_s}, failure_threshold={failure_threshold}, "
                             f"cooldown_s={cooldown_s}, max_in_flight={max_in_flight}")
        self.name = name
        self.timeout_s = float(timeout_s)
        self.failure_threshold = int(failure_threshold)
        self.cooldown_s = float(cooldown_s)
        self.max_in_flight = int(max_in_flight)
        self._clock = clock
        self._lock = threading.Lock()
        self._workers = _Workers(self.max_in_flight, name)
        self._breaker = "closed"
        self._open_until = 0.0
        self._probe = False
        self._consecutive = 0
        self._last_error = ""
        self._calls = self._failures = self._timeouts = self._rejected = 0
        self._in_flight = self._abandoned = 0

    # ------------------------------------------------------------------ breaker

    def check(self) -> None:
        """Raise RemoteUnavailable when a call would be refused now (breaker open and
        cooling down, or saturated); otherwise return. Does not admit a probe."""
        with self._lock:
            reason = self._refusal(self._clock())
        if reason:
            raise RemoteUnavailable(reason)

    def _refusal(self, now: float) -> str:
        if self._breaker == "open" and now < self._open_until:
            return (f"{self.name}: remote unavailable for another {self._open_until - now:.1f}s "
                    f"after {self._consecutive} failures (last: {self._last_error})")
        if self._breaker == "half_open" and self._probe:
            return f"{self.name}: remote unavailable, a probe call is in progress (last: {self._last_error})"
        if self._in_flight >= self.max_in_flight:
            return f"{self.name}: all {self.max_in_flight} remote calls busy ({self._abandoned} abandoned)"
        return ""

    def _admit(self) -> bool:
        """Admit one call or raise RemoteUnavailable; True when the call is the probe."""
        with self._lock:
            now = self._clock()
            if self._breaker == "open" and now >= self._open_until:
                self._breaker = "half_open"
                self._probe = False
            reason = self._refusal(now)
            if reason:
                self._rejected += 1
                raise RemoteUnavailable(reason)
            probe = self._breaker == "half_open"
            self._probe = self._probe or probe
            self._in_flight += 1
            self._calls += 1
            return probe

    def record_failure(self, error: str) -> None:
        """Count a failure (also for failures seen outside :meth:`call`)."""
        with self._lock:
            self._fail_locked(error)

    def _fail_locked(self, error: str) -> None:
        self._failures += 1
        self._consecutive += 1
        self._last_error = error
        if self._breaker == "half_open" or self._consecutive >= self.failure_threshold:
            if self._breaker != "open":
                log.warning("%s: circuit opened for %.1fs after %d failures: %s", self.name, self.cooldown_s,
                            self._consecutive, error)
            self._breaker = "open"
            self._open_until = self._clock() + self.cooldown_s
            self._probe = False

    def _succeed(self) -> None:
        with self._lock:
            if self._breaker != "closed":
                log.info("%s: remote reachable again, circuit closed", self.name)
            self._breaker = "closed"
            self._consecutive = 0
            self._probe = False

    def reset(self) -> None:
        """Close the breaker and forget consecutive failures (after a new session)."""
        self._succeed()

    # ------------------------------------------------------------------ calls

    def call(self, fn: Callable[..., Any], *args: Any, deadline_s: float | None = None,
             judge: Callable[[Any], str | None] | None = None,
             on_abandon: Callable[[], None] | None = None) -> Any:
        """Run ``fn(*args)`` on a worker and return its result within the deadline.

        Args:
            deadline_s: seconds to wait (default :attr:`timeout_s`).
            judge: maps the result to an error text when it means "remote unavailable"
                (counted as a failure, raised as MediaIOError), or None when it is a
                usable answer (a success for the breaker).
            on_abandon: called once the call has finished (from its worker thread, or
                at once when it never started) after its deadline passed. After a
                RemoteTimeout the caller must not reuse buffers the call touches; this
                callback is where they are released.

        Raises:
            RemoteUnavailable: refused without running (breaker open, saturated).
            RemoteTimeout: not finished by the deadline.
            MediaIOError: ``fn`` raised, or ``judge`` rejected the result.
        """
        self._admit()
        deadline = self.timeout_s if deadline_s is None else deadline_s
        fut = self._workers.submit(fn, args)
        fut.add_done_callback(self._finished)
        try:
            result = fut.result(timeout=deadline)
        except FutureTimeout:
            with self._lock:
                self._timeouts += 1
                self._abandoned += 1
                self._fail_locked(f"no answer within {deadline:.1f}s")
            fut.cancel()
            fut.add_done_callback(lambda _f: self._abandon_done(on_abandon))
            raise RemoteTimeout(f"{self.name}: no answer within {deadline:.1f}s") from None
        except Exception as exc:
            self.record_failure(f"{type(exc).__name__}: {exc}")
            raise MediaIOError(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        error = judge(result) if judge is not None else None
        if error:
            self.record_failure(error)
            raise MediaIOError(f"{self.name}: {error}")
        self._succeed()
        return result

    def _finished(self, _fut: Future) -> None:
        with self._lock:
            self._in_flight -= 1

    def _abandon_done(self, on_abandon: Callable[[], None] | None) -> None:
        with self._lock:
            self._abandoned -= 1
        if on_abandon is not None:
            try:
                on_abandon()
            except Exception:                       # never let a callback kill a worker
                log.exception("%s: cleanup after an abandoned call failed", self.name)

    # ------------------------------------------------------------------ state

    @property
    def breaker(self) -> str:
        """"closed", "open" or "half_open" (an open breaker past its cooldown reads half_open)."""
        with self._lock:
            if self._breaker == "open" and self._clock() >= self._open_until:
                return "half_open"
            return self._breaker

    def stats(self) -> GuardStats:
        with self._lock:
            now = self._clock()
            open_for = max(0.0, self._open_until - now) if self._breaker == "open" else 0.0
            breaker = "half_open" if self._breaker == "open" and open_for == 0.0 else self._breaker
            return GuardStats(self._calls, self._failures, self._timeouts, self._rejected, self._in_flight,
                              self._abandoned, self._consecutive, self._last_error, open_for, breaker)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until no call (abandoned ones included) runs;
        True when none does."""
        deadline = self._clock() + timeout_s
        while True:
            with self._lock:
                if self._in_flight == 0:
                    return True
            if self._clock() >= deadline:
                return False
            time.sleep(0.02)

    def close(self) -> None:
        """Stop idle workers; calls still running finish in the background."""
        self._workers.shutdown()


__all__ = ["CallGuard", "GuardStats", "RemoteHealth", "RemoteState", "RemoteTimeout", "RemoteUnavailable"]
