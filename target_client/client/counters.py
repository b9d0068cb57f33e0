"""What one client counts: its Prometheus metric children and the plain counts behind ``stats()``.

Owns ``Counters``. Written by the caller threads (a step's outcome) and by the I/O loop
(everything else); the plain counts sit behind one lock held for a few dict updates only, never
around I/O. The Prometheus objects are thread-safe by themselves; a step's updates of them are
queued (``ClientMetrics.later``) and applied off the hop.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

from protocol import Status
from target_client.api import DraftReply
from target_client.metrics import OUTCOMES, metrics_for

# Keys stats() always reports (0 until counted); outcome_<name> keys appear once counted.
STAT_KEYS = (
    "calls",
    "ok",
    "timeouts",
    "errors",
    "fallbacks",
    "overloaded_returns",
    "drafts",
    "late_replies_dropped",
    "bad_replies",
    "resent_rows",
    "dropped_rows",
    "epoch_changes",
    "contract_changes",
    "breaker_opens",
    "send_failures",
    "hellos_sent",
    "probes_sent",
    "pongs",
    "frees_sent",
    "catching_up_entries",
    "taps_sent",
    "early_taps_declined",
)
# A step outcome's own stats key; the others (breaker_open, not_ready, closed) are fallbacks.
_OUTCOME_KEYS = {"ok": "ok", "timeout": "timeouts", "error": "errors", "overloaded": "overloaded_returns"}


class Counters:
    """Metrics and counts of one client (any thread)."""

    def __init__(self, registry: Any) -> None:
        self.m = metrics_for(registry)
        self.steps = {o: self.m.steps.labels(o) for o in OUTCOMES}
        self.entries = {s: self.m.entries.labels(s.name.lower()) for s in Status}
        self.entries_skipped = self.m.entries.labels("skipped")
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def dropped_rows(self, n: int) -> None:
        if n:
            self.m.dropped_rows.inc(n)
            self.add("dropped_rows", n)

    def bad_reply(self) -> None:
        self.m.bad_replies.inc()
        self.add("bad_replies")

    def step_done(self, seconds: float, replies: Sequence[DraftReply], outcome: str) -> None:
        """One step()/astep() call returned after ``seconds`` with ``outcome``."""
        m = self.m
        later = m.later.later
        later(m.step_duration.observe, seconds)
        later(self.steps[outcome].inc, 1)
        drafts = sum(len(r.tokens) for r in replies)
        if drafts:
            later(m.drafts.inc, drafts)
        key = _OUTCOME_KEYS.get(outcome)
        with self._lock:
            c = self._counts
            c["calls"] += 1
            c["drafts"] += drafts
            c[f"outcome_{outcome}"] += 1
            if key is not None:
                c[key] += 1
            else:  # breaker_open / not_ready / closed: returned at once without waiting
                c["fallbacks"] += 1

    def entries_answered(self, results: Sequence[Any]) -> None:
        """A reply's per-entry statuses (``protocol.EntryResult``s): one queued update per status."""
        self.m.later.count_statuses(self.entries, results)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            d: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
            d.update(self._counts)
        return d
