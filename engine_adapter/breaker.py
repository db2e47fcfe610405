"""The circuit breaker between an engine plug-in and the store: a store that failed is not
called again until it answers a probe, so a store that is slow, gone or restarting costs
the engine one bounded miss, never a stall (the pattern of M. Nygard, *Release It!*,
ch. 5 "Circuit Breaker").

States:

- **closed**: calls go to the store; the check is one attribute read (:meth:`StoreBreaker.allow`).
- **open**, after a call found the store unavailable (no answer within its deadline,
  connection refused): no call goes to the store. The plug-in answers at once instead
  (a lookup is a miss, a load is recomputed, a save is dropped), and the breaker counts
  it (:meth:`StoreBreaker.skipped`). A background thread probes the store (``probe``,
  e.g. :meth:`kvstore.client.KVStoreClient.ping`, with ``probe_timeout_s``): at once, then
  after waits that double from ``backoff_s`` up to ``max_backoff_s``, until it answers;
  then calls go to the store again. A call that fails again re-opens the breaker, and its
  next probe waits longer: failed calls and probes in a row set the wait.

Logging: an outage is logged once (WARNING) when a probe fails too (a single slow call
that the probe contradicts is no outage: DEBUG), or after ``report_after`` failed calls in
a row; the first call that succeeds after it logs one summary (INFO): how long it lasted,
how many lookups were answered as misses, loads recomputed, saves and blocks not stored.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from kvstore.common.errors import StoreUnavailable

log = logging.getLogger("engine_adapter.store")

LOOKUP, LOAD, SAVE = "lookup", "load", "save"
"""Kinds of store calls the breaker counts (one phrase each in the outage summary)."""

_OUTCOME = {LOOKUP: "answered as misses", LOAD: "recomputed", SAVE: "not stored"}


class StoreSkipped(StoreUnavailable):
    """The call was not made: the breaker is open (the store failed and has not answered
    a probe since). Handled like any StoreUnavailable: a miss, a recompute, a dropped save."""


@dataclass(frozen=True)
class BreakerSettings:
    """How a :class:`StoreBreaker` backs off (a plug-in setting each; seconds).

    Attributes:
        backoff_s: wait before the second probe of an outage (the first is at once).
        max_backoff_s: longest wait between probes: a store that came back is used again
            at most this long (plus one probe) after it answers.
        probe_timeout_s: deadline of one probe.
        report_after: failed calls in a row that are an outage even when probes answer.
    """

    backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    probe_timeout_s: float = 1.0
    report_after: int = 3

    def __post_init__(self) -> None:
        for name in ("backoff_s", "max_backoff_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) is below backoff_s ({self.backoff_s})")
        if not isinstance(self.report_after, int) or self.report_after < 1:
            raise ValueError(f"report_after must be a positive int, got {self.report_after!r}")


class StoreBreaker:
    """The breaker of one plug-in's store (see the module docstring).

    Args:
        probe: ``probe(timeout_s)`` returns when the store answers, raises otherwise.
        settings: back-off and reporting.
        name: the store in log lines (e.g. ``"kvstore at unix:/run/kvstore.sock"``).
        clock: monotonic seconds (the outage's duration in the summary).

    Attributes: ``outages`` (outages reported so far), ``probes`` (probes made).
    Thread-safe; the probe thread holds the breaker weakly and ends with it.
    """

    def __init__(self, probe: Callable[[float], object], settings: BreakerSettings = BreakerSettings(), *,
                 name: str = "kvstore", clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.name = name
        self._probe = probe
        self._clock = clock
        self._open = False
        self._failures = 0              # failed calls and probes in a row
        self._reported = False
        self._since = 0.0
        self._error = ""                # the first failed call of the outage
        self._probe_error = ""
        self._counts: dict[str, list[int]] = {}      # kind -> [calls, blocks] not served
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.outages = 0
        self.probes = 0

    @property
    def is_open(self) -> bool:
        """True while calls are not made (the store failed and has not answered since)."""
        return self._open

    def allow(self) -> bool:
        """Whether to call the store now (one attribute read)."""
        return not self._open

    def counts(self) -> dict[str, tuple[int, int]]:
        """``kind -> (calls, blocks)`` not served in the outage going on (empty when none)."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self._counts.items()}

    def skipped(self, kind: str, blocks: int) -> None:
        """A ``kind`` call of ``blocks`` blocks was not made (the breaker is open)."""
        with self._lock:
            self._count(kind, blocks)

    def failed(self, kind: str, blocks: int, error: BaseException) -> None:
        """A ``kind`` call of ``blocks`` blocks found the store unavailable: open the breaker
        and start probing."""
        with self._lock:
            self._count(kind, blocks)
            if not self._failures:
                self._since = self._clock()
                self._error, self._probe_error = str(error), ""
            self._failures += 1
            self._open = True
            if self._failures >= self.settings.report_after:
                self._report()
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(target=_probe_loop, args=(weakref.ref(self), self._wake),
                                                name="kvstore-breaker-probe", daemon=True)
                self._thread.start()

    def succeeded(self) -> None:
        """A call was served: an outage going on is over (its summary is logged)."""
        if not self._failures:          # the happy path: no outage going on
            return
        with self._lock:
            if not self._failures or self._open:
                return
            counts, self._counts = self._counts, {}
            self._failures = 0
            reported, self._reported = self._reported, False
            took = self._clock() - self._since
        parts = [f"{c} {kind}s ({b} blocks) {_OUTCOME.get(kind, 'not served')}" for kind, (c, b) in counts.items()]
        text = "; ".join(parts) or "no call was skipped"
        if reported:
            log.info("%s answers again after %.1f s of outage: %s", self.name, took, text)
        else:
            log.debug("%s answers again after %.2f s (a blip, not reported): %s", self.name, took, text)

    def close(self) -> None:
        """Stop probing (the plug-in shuts down)."""
        self._closing = True
        self._wake.set()

    # ------------------------------------------------------------ internals (lock held)

    def _count(self, kind: str, blocks: int) -> None:
        c = self._counts.setdefault(kind, [0, 0])
        c[0] += 1
        c[1] += blocks

    def _report(self) -> None:
        if self._reported:
            return
        self._reported = True
        self.outages += 1
        probe = f"; its probe: {self._probe_error}" if self._probe_error else ""
        log.warning("%s is unavailable (%s%s); the engine goes on without it (lookups miss, loads are recomputed, "
                    "saves are dropped) and probes it every %g s at most; one summary follows when it answers",
                    self.name, self._error, probe, self.settings.max_backoff_s)

    def _delay(self) -> float:
        """Seconds before the next probe: 0 at the start of an outage, then doubling."""
        if self._failures <= 1:
            return 0.0
        s = self.settings
        return min(s.max_backoff_s, s.backoff_s * 2 ** min(self._failures - 2, 30))

    # ------------------------------------------------------------ the probe thread's steps

    def next_probe_in(self) -> float | None:
        """Seconds the probe thread waits before its next probe; None: it stops (closing)."""
        with self._lock:
            if self._closing:
                self._thread = None
                return None
            return self._delay()

    def probe(self) -> bool:
        """One probe now; True when the probe thread is done: the store answered (the
        breaker is closed again) or the breaker is closing."""
        if self._closing:
            with self._lock:
                self._thread = None
            return True
        self.probes += 1
        try:
            self._probe(self.settings.probe_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure of the probe keeps the breaker open
            with self._lock:
                self._failures += 1
                self._probe_error = str(e)
                self._report()
            return False
        with self._lock:
            self._open = False
            self._thread = None
        return True


def _probe_loop(ref: "weakref.ref[StoreBreaker]", wake: threading.Event) -> None:
    """The probe thread: probes until the store answers, the breaker closes or is gone.
    Holds the breaker only while it asks it something, never while it waits."""
    while True:
        breaker = ref()
        delay = breaker.next_probe_in() if breaker is not None else None
        del breaker
        if delay is None or (delay and wake.wait(delay)):
            return                          # closing, gone, or woken by close()
        breaker = ref()
        if breaker is None or breaker.probe():
            return
        del breaker
