"""Where each session of one engine lives among several draft servers: pure placement logic.

Owns ``Placement``: the servers one engine knows (by key, their endpoint), whether each can take
sessions now, how many of this engine's sessions each holds, and each session's server. No
sockets, no threads, no clock of its own (``now`` is passed in, ``time.monotonic()`` seconds);
``FleetClient`` holds a lock around it and acts on what the methods return (a Free to the server
a session left). The rules (DESIGN.md §6 "Several servers"):

* Order. Each session ranks the servers by rendezvous (highest random weight) hashing: the
  server with the highest ``blake2b(server key, session id)`` first. Adding a server takes new
  sessions only from its own share; removing one moves only the sessions it held, each to its
  own next server, so a dead server's sessions spread evenly over the survivors.
* Bounded loads. A new session takes the first server in its order that is usable and holds
  fewer than ``ceil((1 + load_slack) x mean)`` of this engine's sessions (Mirrokni, Thorup,
  Zadimoghaddam, "Consistent hashing with bounded loads", 2018): no server holds more than
  ``1 + load_slack`` times the mean, per engine and so for any number of engines together.
* Affinity. A session stays on its server for its lifetime while that server is usable; the
  server holds its context. When it is not (the client saw it dead, paused, refused, or it left
  DNS), the session moves to the next usable server in its own order and restarts there by
  positional semantics (the server starts an unknown session at its first row). A moved session
  never moves back: the server it moved to is its server now.
* Shedding. A session that got no answer from its server yet (``fresh``) and is answered
  ``overloaded`` moves to its next candidate, and that server takes no new session for its retry
  hint. A session the server already holds stays (and is held back by its client).
* Failing within a step. A server whose step failed at once (no connection, closed) gets its
  sessions rerouted within the same step (``fail``), and no new session for ``FAIL_HOLD_S``.
* Missing steps. A server that missed ``miss_limit`` steps in a row loses its sessions at their
  next step and takes none until its client reports it not usable (its breaker opens on as many
  misses, once its I/O thread has expired the last call) or ``FAIL_HOLD_S`` passed; from then on
  the client's breaker (probing) says when it is back.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

FAIL_HOLD_S = 0.25  # a server whose step failed at once, or that missed miss_limit steps, takes no session this long
MAX_SHED_S = 5.0  # cap on a server's retry hint, as the client's


def score(session: str, key: str) -> int:
    """The rendezvous weight of ``key`` for ``session`` (64 bits of blake2b; stable across processes)."""
    h = hashlib.blake2b(key.encode(), digest_size=8)
    h.update(b"\0")
    h.update(session.encode())
    return int.from_bytes(h.digest(), "big")


def rank(session: str, keys: Iterable[str]) -> list[str]:
    """``keys`` in ``session``'s rendezvous order, best first."""
    return sorted(keys, key=lambda k: (score(session, k), k), reverse=True)


@dataclass(slots=True)
class Server:
    key: str
    usable: bool = False  # its client sends steps and it serves the pinned contract (set by refresh)
    gone: bool = False  # left DNS: no new sessions, its sessions move
    load: int = 0  # sessions of this engine placed on it
    shed_until: float = 0.0  # answered overloaded: no new sessions before this
    hold_until: float = 0.0  # a step failed at once: no sessions before this
    misses: int = 0  # consecutive steps without an answer (timeout) or that failed
    miss_hold_until: float = 0.0  # missed miss_limit steps: no sessions before this, unless its client says so first


@dataclass(slots=True)
class Seat:
    key: str  # the session's server
    fresh: bool = True  # no answer taken from that server yet
    moves: int = 0


@dataclass(slots=True)
class Counts:
    placed: int = 0  # new sessions placed
    moves: int = 0  # sessions moved off a server that was not usable (or failed within a step)
    sheds: int = 0  # fresh sessions moved on because their server was overloaded
    stranded: int = 0  # placements that found no usable server (the session waits on its best one)


class Placement:
    """Servers, sessions and their seats of one engine. See the module docstring."""

    def __init__(self, load_slack: float = 0.1, miss_limit: int = 2) -> None:
        if not (math.isfinite(load_slack) and load_slack >= 0):
            raise ValueError(f"load_slack must be >= 0, got {load_slack}")
        if miss_limit < 1:
            raise ValueError(f"miss_limit must be >= 1, got {miss_limit}")
        self.load_slack = load_slack
        self.miss_limit = miss_limit
        self.servers: dict[str, Server] = {}
        self.seats: dict[str, Seat] = {}
        self.counts = Counts()

    # -- servers

    def add(self, key: str) -> None:
        """A server joined (or came back to DNS)."""
        s = self.servers.get(key)
        if s is None:
            self.servers[key] = Server(key)
        else:
            s.gone = False

    def remove(self, key: str) -> None:
        """A server left DNS: its sessions move at their next step; ``drop`` it once it holds none."""
        s = self.servers.get(key)
        if s is not None:
            s.gone = True

    def drop(self, key: str) -> None:
        """Forget a server (its client is closed); sessions still seated on it move at their next step."""
        self.servers.pop(key, None)

    def set_usable(self, key: str, usable: bool) -> None:
        """What the server's client says now. Not usable: its breaker governs from here on, and a
        hold for missed steps ends (so that a half-open breaker brings it back at once)."""
        s = self.servers.get(key)
        if s is not None:
            s.usable = usable
            if not usable:
                s.miss_hold_until = 0.0

    def can_serve(self, s: Server, now: float) -> bool:
        """Whether steps for ``s``'s sessions go to it now."""
        return s.usable and not s.gone and now >= max(s.hold_until, s.miss_hold_until)

    def outcome(self, key: str, outcome: str, now: float) -> None:
        """A step to ``key`` ended with ``outcome`` (``target_client.metrics.OUTCOMES``)."""
        s = self.servers.get(key)
        if s is None:
            return
        if outcome == "ok":
            s.misses = 0
        elif outcome in ("timeout", "error", "breaker_open", "not_ready", "closed"):
            s.misses += 1
            if s.misses == self.miss_limit:
                # its client's breaker opens on these misses too, but only once its I/O thread has
                # expired the last call, which a loaded host may delay past the engine's next step
                s.miss_hold_until = now + FAIL_HOLD_S

    # -- sessions

    def where(self, session: str) -> str | None:
        seat = self.seats.get(session)
        return seat.key if seat is not None else None

    def route(self, session: str, now: float) -> tuple[str | None, str | None]:
        """The server for ``session``'s entry of this step, and the server it just left (None if it
        stays). Places a new session; moves one whose server cannot serve it. None: no server at all."""
        seat = self.seats.get(session)
        if seat is None:
            key = self._choose(session, (), now)
            if key is None:
                key = self._best(session)
                if key is None:
                    return None, None
                self.counts.stranded += 1
            self.seats[session] = Seat(key)
            self.servers[key].load += 1
            self.counts.placed += 1
            return key, None
        s = self.servers.get(seat.key)
        if s is not None and self.can_serve(s, now):
            return seat.key, None
        key = self._choose(session, (seat.key,), now)
        if key is None:
            return seat.key, None  # nowhere better: it waits here (its client answers at once)
        return key, self._move(session, seat, key, shed=False)

    def fail(self, session: str, key: str, exclude: Iterable[str], now: float) -> tuple[str | None, str | None]:
        """``key`` failed ``session``'s step at once: hold it back, and move the session to its next
        server outside ``exclude`` for the rest of the step. (new server, old server) or (None, None)."""
        s = self.servers.get(key)
        if s is not None:
            s.hold_until = max(s.hold_until, now + FAIL_HOLD_S)
        seat = self.seats.get(session)
        if seat is None or seat.key != key:
            return None, None
        new = self._choose(session, (key, *exclude), now)
        if new is None:
            return None, None
        return new, self._move(session, seat, new, shed=False)

    def answered(self, session: str, key: str, overloaded: bool, retry_after_ms: float, now: float) -> str | None:
        """``key`` answered ``session`` (``overloaded`` or taken). Returns the server a shed session
        left (the caller frees it there), else None."""
        seat = self.seats.get(session)
        if seat is None or seat.key != key:
            return None
        if not overloaded:
            seat.fresh = False
            return None
        if not seat.fresh:
            return None  # the server holds its context: it stays and is held back by its client
        s = self.servers.get(key)
        if s is not None:
            s.shed_until = max(s.shed_until, now + min(max(retry_after_ms, 0.0) / 1000.0, MAX_SHED_S))
        new = self._choose(session, (key,), now)
        if new is None:
            return None
        return self._move(session, seat, new, shed=True)

    def free(self, session: str) -> str | None:
        """Forget ``session``; the server it was on, if any."""
        seat = self.seats.pop(session, None)
        if seat is None:
            return None
        s = self.servers.get(seat.key)
        if s is not None:
            s.load -= 1
        return seat.key

    # -- choosing

    def _move(self, session: str, seat: Seat, key: str, shed: bool) -> str:
        old = seat.key
        s = self.servers.get(old)
        if s is not None:
            s.load -= 1
        self.servers[key].load += 1
        seat.key, seat.fresh = key, True
        seat.moves += 1
        if shed:
            self.counts.sheds += 1
        else:
            self.counts.moves += 1
        return old

    def _best(self, session: str) -> str | None:
        keys = [k for k, s in self.servers.items() if not s.gone] or list(self.servers)
        return rank(session, keys)[0] if keys else None

    def _choose(self, session: str, exclude: Iterable[str], now: float) -> str | None:
        """The first server in ``session``'s order outside ``exclude`` that can take a new session
        and is under the load bound; the first that can take one when all are over it; else None."""
        skip = set(exclude)
        open_ = [s for s in self.servers.values() if self.can_serve(s, now)]
        cands = [s.key for s in open_ if s.key not in skip and now >= s.shed_until]
        if not cands:
            return None
        total = sum(s.load for s in self.servers.values()) + 1
        cap = math.ceil((1.0 + self.load_slack) * total / len(open_))
        order = rank(session, cands)
        for key in order:
            if self.servers[key].load < cap:
                return key
        return order[0]
