"""The session table: every live session of every client, in least-recently-used order.

Owns recency (the only LRU in the server), creation under ``max_sessions``, release (which
frees the drafter's KV), eviction of idle sessions, the idle TTL, per-client session counts and
the fair share they are held to, and short-lived tombstones of released sessions (so a restart
can be told by its cause).

Fairness: while the table has room anyone may open sessions. When it is full, a client's fair
share is ``max_sessions / clients with live sessions``; a new session may only take the place
of an idle session of its own client, or of an idle session of a client over its share. A
client within its share never loses an idle session to another client's new ones.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from draft_server.drafters import Drafter
from draft_server.engine.types import SessionKey, Work
from draft_server.metrics import ServerMetrics

TOMBSTONES = 1 << 16


@dataclass(eq=False, slots=True)
class Session:
    handle: int  # the drafter's key for this session
    key: SessionKey
    start: int = 0
    end: int = 0
    known: bool = False  # False until the first ingest sets [start, end)
    pending: deque[Work] = field(default_factory=deque)
    taps_call: int = 0  # call id of the latest early Taps that reached this session
    last_call: int = 0  # the newest call id of any entry that reached it (its owner's ids grow)
    rows_call: int = 0  # the call id of the latest entry with rows queued on it (0: none yet)
    last_used: float = 0.0

    @property
    def owner(self) -> bytes:
        return self.key[0]


class SessionTable:
    def __init__(self, drafter: Drafter, metrics: ServerMetrics, max_sessions: int, ttl_s: float) -> None:
        self.drafter = drafter
        self.metrics = metrics
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._by_key: OrderedDict[SessionKey, Session] = OrderedDict()  # oldest use first
        self._per_client: dict[bytes, int] = {}
        self._tombstones: OrderedDict[SessionKey, str] = OrderedDict()  # released -> why
        self._next_handle = 1

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._by_key.values())

    def get(self, key: SessionKey) -> Session | None:
        return self._by_key.get(key)

    def owners(self) -> set[bytes]:
        """Clients with live sessions (a snapshot; safe to take from the I/O thread)."""
        return set(self._per_client.copy())

    def client_sessions(self, owner: bytes) -> int:
        return self._per_client.get(owner, 0)

    def fair_share(self, owner: bytes) -> int:
        clients = len(self._per_client) + (owner not in self._per_client)
        return max(1, self.max_sessions // clients)

    def released_as(self, key: SessionKey) -> str | None:
        """Why the session ``key`` was released recently (None: it was not)."""
        return self._tombstones.get(key)

    def open(self, key: SessionKey) -> Session | None:
        """The session for ``key``, made most recently used; a new one if there is room (an idle
        session is evicted for it when the table is full, see the module docstring); None if not."""
        s = self._by_key.get(key)
        if s is None:
            if len(self._by_key) >= self.max_sessions and not self.evict_idle(key[0], protect=None):
                return None
            s = Session(handle=self._next_handle, key=key)
            self._next_handle += 1
            self._by_key[key] = s
            self._per_client[key[0]] = self._per_client.get(key[0], 0) + 1
            self.metrics.sessions.set(len(self._by_key))
        s.last_used = time.monotonic()
        self._by_key.move_to_end(key)
        return s

    def release(self, s: Session, reason: str) -> list[Work]:
        """Forget the session and free its KV; returns its queued work for the caller to answer."""
        pending = list(s.pending)
        s.pending.clear()
        if self._by_key.pop(s.key, None) is not None:
            n = self._per_client[s.owner] - 1
            if n:
                self._per_client[s.owner] = n
            else:
                del self._per_client[s.owner]
        self.drafter.release(s.handle)
        self._tombstones[s.key] = reason
        self._tombstones.move_to_end(s.key)
        if len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        self.metrics.evictions.labels(reason).inc()
        self.metrics.sessions.set(len(self._by_key))
        return pending

    def evict_idle(self, owner: bytes, protect: Session | None) -> bool:
        """Release the least recently used idle session that ``owner`` may displace (its own, or one
        of a client over its fair share while ``owner`` is within its own); False if there is none."""
        share = self.fair_share(owner)  # counting owner among the clients
        within = self.client_sessions(owner) < share
        for s in self._by_key.values():
            if s.pending or s is protect:
                continue
            if s.owner == owner or (within and self.client_sessions(s.owner) > share):
                self.release(s, "lru")
                return True
        return False

    def expire_idle(self, now: float) -> None:
        """Release every session idle for longer than the TTL."""
        for s in [s for s in self._by_key.values() if not s.pending and now - s.last_used > self.ttl_s]:
            self.release(s, "ttl")
