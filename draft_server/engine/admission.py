"""Admission: what the server takes on, and the one place that answers ``overloaded``.

Owns the queued-row counters (rows admitted by the I/O thread and not yet ingested: the only
state both threads touch, under a lock), in total and per client, the retry hint, and KV room
for a session (the drafter's reservation, evicting idle sessions the session table allows).

Load-aware k (DESIGN §5): every reply advises a k (``StepResult.advised_k``) once the queue is
more than ``ADVISE_FROM`` full, shrinking linearly from the block size to 0 at a full queue (0:
ingest only, no draft forward at all); below that, -1 (no advice).

A client may hold at most its share of the queue: ``max_queue_rows / clients`` (clients with
rows queued or live sessions, itself counted), so one client's row flood is answered
``overloaded`` to that client and room stays for every other client's rows.
"""

from __future__ import annotations

import threading

from draft_server.drafters import Drafter
from draft_server.engine.sessions import Session, SessionTable
from draft_server.metrics import ServerMetrics
from protocol import EntryResult, Status

ADVISE_FROM = 0.25  # queue fill above which replies advise a smaller k


class Admission:
    def __init__(
        self, drafter: Drafter, sessions: SessionTable, metrics: ServerMetrics, max_queue_rows: int, max_batch_rows: int
    ) -> None:
        self.drafter = drafter
        self.sessions = sessions
        self.metrics = metrics
        self.max_queue_rows = max_queue_rows
        self.max_batch_rows = max_batch_rows
        self._lock = threading.Lock()
        self._queued_rows = 0
        self._by_client: dict[bytes, int] = {}
        self.iter_ewma_s = 0.001  # recent engine iteration time (the engine updates it)
        metrics.queue_rows.set_function(lambda: self._queued_rows)  # read at scrape time

    # -- queued rows (I/O thread admits, engine thread retires) ------------------------------
    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def try_admit_rows(self, owner: bytes, rows: int) -> bool:
        return self.admit_rows(owner, [rows])[0]

    def admit_rows(self, owner: bytes, rows: list[int]) -> list[bool]:
        """Admit one Step's entries' rows in order (0: nothing to queue, always admitted): whether each
        fits the row queue and, with other clients about, ``owner``'s fair share of it."""
        out = [True] * len(rows)
        if not any(rows):
            return out
        with self._lock:
            mine = self._by_client.get(owner, 0)
            clients = len(self._by_client.keys() | self.sessions.owners() | {owner})
            share = self.max_queue_rows // clients
            queued = self._queued_rows
            for i, n in enumerate(rows):
                if not n:
                    continue
                if queued + n > self.max_queue_rows or (clients > 1 and mine + n > share):
                    out[i] = False
                    continue
                queued += n
                mine += n
            self._queued_rows = queued
            if mine:
                self._by_client[owner] = mine
        return out

    def retire_rows(self, owner: bytes, rows: int) -> None:
        """Rows that left the queue: ingested, or dropped with their entry."""
        if not rows:
            return
        with self._lock:
            self._queued_rows -= rows
            left = self._by_client.get(owner, 0) - rows
            if left > 0:
                self._by_client[owner] = left
            else:
                self._by_client.pop(owner, None)

    # -- replies -----------------------------------------------------------------------------
    def retry_hint_ms(self) -> float:
        """How long until the current queue has likely drained."""
        iters = self._queued_rows / max(1, self.max_batch_rows) + 1
        return round(max(1.0, iters * self.iter_ewma_s * 1000.0), 3)

    def advised_k(self, block_size: int) -> int:
        """-1 (no advice) up to ``ADVISE_FROM`` queue fill, then block_size .. 0 as the queue fills."""
        fill = self._queued_rows / max(1, self.max_queue_rows)
        if fill <= ADVISE_FROM:
            return -1
        return max(0, int(block_size * (1.0 - fill) / (1.0 - ADVISE_FROM)))

    def overloaded(self, why: str) -> EntryResult:
        return EntryResult(Status.OVERLOADED, retry_after_ms=self.retry_hint_ms(), message=why)

    # -- KV room (engine thread) -------------------------------------------------------------
    def reserve(self, s: Session, start: int, end: int) -> bool:
        """Make ``s`` hold KV for [start, end), evicting idle sessions the table allows if needed."""
        if self.drafter.reserve(s.handle, start, end):
            return True
        while self.sessions.evict_idle(s.owner, protect=s):
            if self.drafter.reserve(s.handle, start, end):
                return True
        return False
