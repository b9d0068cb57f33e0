"""Histogram bucket layouts that both sides export, so a dashboard can set a client's wait beside
the server's step latency bucket by bucket (seconds; the RPC hop lives below a millisecond), and
``Deferred``, the queue both sides put their per-step metric updates in to take them off the hop."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class Deferred:
    """Metric updates queued on the hot path and applied later, by whoever has time.

    ``later(fn, value)`` queues one update (``counter.inc``, ``histogram.observe``: any call of one
    argument whose order does not matter) for a tenth of the cost of making it; ``flush`` applies
    what is queued, from any thread, each update exactly once (a deque's appends and pops are
    atomic). Each side flushes where it waits anyway (the client's caller once its Step is out, the
    server's engine once its replies are), on a timer, when more than ``bound`` are queued, and at
    every scrape: registered on a registry before the metrics it feeds (``collect`` flushes and
    yields nothing), so a scrape, or ``get_sample_value``, never sees an update still queued or still
    being applied by another flusher.
    No prometheus import: any object with ``collect``/``describe`` is a collector to a registry."""

    __slots__ = ("_flushing", "_q", "bound")

    def __init__(self, bound: int = 4096) -> None:
        self._q: deque[tuple[Callable[[Any], Any], Any]] = deque()
        self.bound = bound
        # flushes run one at a time: one that finds the queue empty has waited for the updates another
        # flusher took out and is still applying (a long one: the server's NaN sample), so a scrape's
        # flush returns only once every update queued before it is applied
        self._flushing = threading.RLock()

    def later(self, fn: Callable[[Any], Any], value: Any) -> None:
        q = self._q
        q.append((fn, value))
        if len(q) > self.bound:  # nobody flushed for a while: never grow without bound
            self.flush()

    def count_statuses(self, children: Mapping[Any, Any], results: Sequence[Any]) -> None:
        """A reply's entries by status (``EntryResult``s; ``children``: status -> counter child):
        one queued ``inc`` per status present, not one per entry."""
        statuses = [r.status for r in results]
        if not statuses:
            return
        first = statuses[0]
        if statuses.count(first) == len(statuses):  # the common case: one status (``count`` compares them
            self.later(children[first].inc, len(statuses))  # as ints; a dict would hash each enum in Python)
            return
        by: dict[Any, int] = {}
        for st in statuses:
            by[st] = by.get(st, 0) + 1
        for status, n in by.items():
            self.later(children[status].inc, n)

    def flush(self) -> None:
        q = self._q
        with self._flushing:
            while q:
                fn, value = q.popleft()  # only flushers pop, one at a time
                fn(value)

    def __len__(self) -> int:
        return len(self._q)

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.flush()
        return []
