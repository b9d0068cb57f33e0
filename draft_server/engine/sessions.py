"""The session table: every live session of every client, in least-recently-used order.

Owns recency (the only LRU in the server), creation under ``max_sessions``, release (which
frees the drafter's KV), eviction of idle sessions and the idle TTL. A session is idle when it
has no queued work; only idle sessions are ever evicted.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from draft_server.drafters import Drafter
from draft_server.engine.types import SessionKey, Work
from draft_server.metrics import ServerMetrics


@dataclass(eq=False)
class Session:
    handle: int  # the drafter's key for this session
    key: SessionKey
    start: int = 0
    end: int = 0
    known: bool = False  # False until the first ingest sets [start, end)
    pending: deque[Work] = field(default_factory=deque)
    last_used: float = 0.0


class SessionTable:
    def __init__(self, drafter: Drafter, metrics: ServerMetrics, max_sessions: int, ttl_s: float) -> None:
        self.drafter = drafter
        self.metrics = metrics
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._by_key: OrderedDict[SessionKey, Session] = OrderedDict()  # oldest use first
        self._next_handle = 1

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._by_key.values())

    def get(self, key: SessionKey) -> Session | None:
        return self._by_key.get(key)

    def open(self, key: SessionKey) -> Session | None:
        """The session for ``key``, made most recently used; a new one if there is room (an idle
        session is evicted for it when the table is full); None when there is none."""
        s = self._by_key.get(key)
        if s is None:
            if len(self._by_key) >= self.max_sessions and not self.evict_idle(protect=None):
                return None
            s = Session(handle=self._next_handle, key=key)
            self._next_handle += 1
            self._by_key[key] = s
            self.metrics.sessions.set(len(self._by_key))
        s.last_used = time.monotonic()
        self._by_key.move_to_end(key)
        return s

    def release(self, s: Session, reason: str) -> list[Work]:
        """Forget the session and free its KV; returns its queued work for the caller to answer."""
        pending = list(s.pending)
        s.pending.clear()
        self._by_key.pop(s.key, None)
        self.drafter.release(s.handle)
        self.metrics.evictions.labels(reason).inc()
        self.metrics.sessions.set(len(self._by_key))
        return pending

    def evict_idle(self, protect: Session | None) -> bool:
        """Release the least recently used idle session (never ``protect``); False if none is idle."""
        for s in self._by_key.values():
            if not s.pending and s is not protect:
                self.release(s, "lru")
                return True
        return False

    def expire_idle(self, now: float) -> None:
        """Release every session idle for longer than the TTL."""
        for s in [s for s in self._by_key.values() if not s.pending and now - s.last_used > self.ttl_s]:
            self.release(s, "ttl")
