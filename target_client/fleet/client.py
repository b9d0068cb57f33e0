"""FleetClient: one target engine's client of several draft servers (DESIGN.md §6 "Several servers").

Owns the fan-out of an engine step over the servers and the life of the per-server clients:
one ``DraftClient`` per server (its socket, handshake, breaker, resend buffers and budget stay
exactly what they are for one server), ``placement.Placement`` for where each session lives,
``endpoints`` for which servers there are. Same calls as ``DraftClient`` (``connect``, ``step``,
``astep``, ``send_taps``, ``commit``, ``free``, ``ping``, ``stats``, ``close``, ``contract``,
``welcome``, ``epoch``), so an engine takes either (``make_client``).

One ``step()``: the requests are grouped by their session's server (placing new sessions,
moving those whose server cannot serve them; the server a session left gets a Free), each
group's taps rows are cut out (a view when the group's rows are contiguous, else one copy), one
Step per server goes out at once (``DraftClient.submit_step``, no extra thread), and the caller
waits on all of them together until the one deadline. A group whose server failed at once (no
connection after a kill, breaker open, closed) is rerouted to its sessions' next servers within
the same step while time is left. Then the answers update the placement (misses, overloaded
fresh sessions shed). ``step()`` never raises for a draft-side fault and never blocks longer than
its budget; ``ValueError`` only for caller bugs, checked on the whole step before anything is sent.

Early taps (``send_taps`` then ``commit``): when every server that welcomed this client takes
them (``early_taps``), the span's rows go to each session's server as a step's would, and the
commit goes to the same servers. A commit is never rerouted: another server lacks the rows. A
session whose server failed between its taps and its commit, or that moved, gets no drafts
that step (MISSING_ROWS, or a miss) and its next step's rows go to its server then, which
restarts it by positional semantics as after any move.

Failover cost: a killed server's sessions usually draft again in the same step (rerouted); a
paused one's after ``miss_limit`` (2) missed steps, when its client's breaker (opened after that
many misses in a fleet) says so. Servers whose client is not usable take no new session; their
clients are nudged every step so that an open breaker probes at the fast step-probe period; a
server that answers pings again (breaker half-open) takes new sessions again, and the sessions
that left it stay where they went. A server that restarted before anyone missed it (a new epoch,
seen by its client) keeps its sessions: they restart there by positional semantics, as they
would on the next server (the context is gone either way).

DNS: with a ``dns+tcp://`` item the fleet's own thread resolves the names every
``resolve_every_s`` (every second while none resolved), adds a client per new address and
retires the clients of addresses gone (their sessions move; the client is closed once it holds
none, or after ``gone_grace_s``). A failed or empty lookup keeps the servers known so far.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import ModelContract, Phase, Pong, ServerLimits, Status, Timing, Welcome
from protocol.wire import RowLayout, row_layout
from target_client.api import (
    ClientConfig,
    ConnectTimeoutError,
    ContractMismatchError,
    DraftClientError,
    DraftReply,
    StepRequest,
)
from target_client.client import DraftClient, StepTicket
from target_client.client.counters import STAT_KEYS
from target_client.client.step_builder import check_budget, prepare
from target_client.fleet import endpoints as ep
from target_client.fleet.placement import Placement
from target_client.metrics import fleet_metrics_for

log = logging.getLogger("target_client")

# Outcomes that come back at once, with time left to try another server within the same step.
_AT_ONCE = frozenset(("error", "breaker_open", "not_ready", "closed"))
_REROUTE_MIN_S = 0.001  # time that must be left in the step to reroute a failed group
_POLL_S = 0.005  # connect(wait=True) polls its members this often


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """Settings of a FleetClient beyond the per-server ``ClientConfig``."""

    resolve_every_s: float = 5.0  # DNS re-resolution period (once a name resolved)
    miss_limit: int = 2  # consecutive missed steps after which a server's sessions move
    load_slack: float = 0.1  # a new session skips servers holding more than (1 + this) x the mean
    connect_settle_s: float = 1.0  # connect(wait=True) waits this long after the first Welcome for the rest
    gone_grace_s: float = 30.0  # a server gone from DNS is closed at the latest this long after

    def __post_init__(self) -> None:
        if not (math.isfinite(self.resolve_every_s) and self.resolve_every_s > 0):
            raise ValueError(f"FleetOptions.resolve_every_s must be > 0, got {self.resolve_every_s}")
        if self.miss_limit < 1:
            raise ValueError(f"FleetOptions.miss_limit must be >= 1, got {self.miss_limit}")
        if not (math.isfinite(self.load_slack) and self.load_slack >= 0):
            raise ValueError(f"FleetOptions.load_slack must be >= 0, got {self.load_slack}")
        for name in ("connect_settle_s", "gone_grace_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"FleetOptions.{name} must be >= 0, got {v}")


def make_client(cfg: ClientConfig, options: FleetOptions | None = None) -> DraftClient | FleetClient:
    """A DraftClient for one plain endpoint, a FleetClient when ``cfg.endpoint`` names several
    servers (``tcp://a:5557,tcp://b:5557``) or a DNS name (``dns+tcp://draft-server:5557``)."""
    return FleetClient(cfg, options) if ep.is_fleet(cfg.endpoint) else DraftClient(cfg)


@dataclass(slots=True, eq=False)
class _Group:
    key: str
    index: list[int]  # request indexes
    ticket: StepTicket


class FleetTicket:
    """A step (or commit) sent over the fleet by ``submit_step`` / ``submit_commit``: ``collect()``
    waits for every server's part, at most until its deadline, reroutes as ``step()`` does and
    returns the replies in request order (once; later calls return the same)."""

    __slots__ = ("_call", "_fleet", "_pending", "replies")

    def __init__(self, fleet: FleetClient, replies: list[DraftReply | None], call: tuple | None = None) -> None:
        """``call``: what ``FleetClient._collect`` waits on (None: ``replies`` are the answers)."""
        self._fleet = fleet
        self._call = call
        self._pending = replies  # filled in as the servers answer
        self.replies: list[DraftReply] | None = None if call is not None else replies  # type: ignore[assignment]

    def collect(self) -> list[DraftReply]:
        if self.replies is None:
            assert self._call is not None
            self.replies = self._fleet._collect(self._pending, self._call)
            self._call = None
        return self.replies


class FleetClient:
    """Client of several draft servers for one engine. Thread-safe; see the module docstring."""

    def __init__(
        self,
        cfg: ClientConfig,
        options: FleetOptions | None = None,
        resolver: ep.Resolver | None = None,
    ) -> None:
        self.cfg = cfg
        self.options = options or FleetOptions()
        self._items = ep.split(cfg.endpoint)
        self._dns = any(x.startswith(ep.DNS_SCHEME) for x in self._items)
        self._resolver = resolver
        self._m = fleet_metrics_for(cfg.registry)
        self._lock = threading.Lock()  # placement and the member table; never held across I/O
        self._placement = Placement(self.options.load_slack, self.options.miss_limit)
        self._members: dict[str, DraftClient] = {}
        self._gone_at: dict[str, float] = {}
        self._pinned: ModelContract | None = cfg.expect
        self._pinned_id: str | None = None
        self._wrong_contract: set[str] = set()
        self._gauge = {"usable": 0, "down": 0}
        self._counts = {"fleet_steps": 0, "reroutes": 0, "resolves": 0, "resolve_failures": 0}
        self._seen = (0, 0)  # placement moves and sheds already in the Prometheus counters
        self._connect_requested = False
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        keys, errors = self._lookup()
        for line in errors:
            log.warning("draft fleet %s: %s", cfg.name, line)
        try:
            for key in keys:
                self._add(key)
        except Exception:
            self.close()
            raise
        if self._dns:
            self._thread = threading.Thread(target=self._run, name=f"draft-fleet-{cfg.name}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ properties

    @property
    def servers(self) -> list[str]:
        """The servers (endpoints) this client knows now, gone ones included until closed."""
        with self._lock:
            return sorted(self._members)

    def server_of(self, session: str) -> str | None:
        """The server ``session`` is placed on (None: not placed)."""
        with self._lock:
            return self._placement.where(session)

    def loads(self) -> dict[str, int]:
        """This engine's sessions per server now."""
        with self._lock:
            return {k: s.load for k, s in self._placement.servers.items()}

    def epochs(self) -> dict[str, str | None]:
        """Each server's latest epoch (None before its Welcome)."""
        with self._lock:
            members = dict(self._members)
        return {k: c.epoch for k, c in members.items()}

    @property
    def welcome(self) -> Welcome | None:
        """A verified Welcome of a server serving the pinned contract (None before one)."""
        for c in self._snapshot():
            w = c.welcome
            if w is not None and (self._pinned_id is None or w.contract_id == self._pinned_id):
                return w
        return None

    @property
    def contract(self) -> ModelContract | None:
        """The pinned contract: ``cfg.expect``, else the first one a server's Welcome verified."""
        if self._pinned is None:
            self._refresh(time.monotonic())
        return self._pinned

    @property
    def limits(self) -> ServerLimits | None:
        w = self.welcome
        return w.limits if w is not None else None

    @property
    def row_layout(self) -> RowLayout | None:
        """(dtype, width) of the rows step() takes (every server verified the same contract and
        accepted the same wire format); None until a server's Welcome."""
        w = self.welcome
        contract = self.contract
        return row_layout(self.cfg.wire_format, contract, w.wire) if w is not None and contract is not None else None

    @property
    def epoch(self) -> str | None:
        """The servers' epochs, joined (changes when any server restarts); None before any Welcome."""
        with self._lock:
            pairs = sorted((k, c.epoch) for k, c in self._members.items())
        epochs = [f"{k}={e}" for k, e in pairs if e]
        return "|".join(epochs) if epochs else None

    @property
    def advised_k(self) -> int:
        """The smallest load-aware k advice among the servers (-1: none)."""
        ks = [c.advised_k for c in self._snapshot() if c.advised_k >= 0]
        return min(ks) if ks else -1

    @property
    def breaker_open(self) -> bool:
        """True when no server takes steps now."""
        return not any(c.gate is None for c in self._snapshot())

    @property
    def last_timing(self) -> Timing | None:
        for c in self._snapshot():
            if c.last_timing is not None:
                return c.last_timing
        return None

    @property
    def budget_ms(self) -> float:
        """The default budget of a step: the largest of the servers' (fixed, or adaptive)."""
        return max((c.budget_ms for c in self._snapshot()), default=self.cfg.budget_ms)

    @property
    def early_taps(self) -> bool:
        """Whether ``send_taps``/``commit`` may be used: every server that has welcomed this client
        takes early taps (a fleet in a rolling upgrade falls back to the single message)."""
        welcomed = [c for c in self._snapshot() if c.welcome is not None]
        return bool(welcomed) and all(c.early_taps for c in welcomed)

    # ------------------------------------------------------------------ calls

    def connect(self, wait: bool = True) -> Welcome | None:
        """Hello/Welcome with every server. wait=True: returns a verified Welcome once every server
        answered, or ``connect_settle_s`` after the first Welcome; ContractMismatchError when every
        server refused; ConnectTimeoutError when none welcomed within ``connect_timeout_s`` (the
        clients keep trying in the background either way). wait=False: None at once."""
        if self._closed:
            raise DraftClientError("client is closed")
        self._connect_requested = True
        for c in self._snapshot():
            c.connect(wait=False)
        if not wait:
            return None
        t0 = time.monotonic()
        deadline = t0 + self.cfg.connect_timeout_s
        first: float | None = None
        while True:
            now = time.monotonic()
            members = self._snapshot()
            welcomed = [c for c in members if c.welcome is not None and c.gate is None]
            refused = [c for c in members if c.stats()["refused"] is not None]
            if welcomed and first is None:
                first = now
            settled = first is not None and now - first >= self.options.connect_settle_s
            if members and (len(welcomed) + len(refused) == len(members) or settled):
                self._refresh(now)
                w = self.welcome
                if w is not None:
                    return w
            if members and len(refused) == len(members):
                reasons = "; ".join(sorted({str(c.stats()["refused"]) for c in refused}))
                raise ContractMismatchError(f"every draft server refused: {reasons}")
            if now >= deadline:
                names = ", ".join(self._items)
                raise ConnectTimeoutError(
                    f"no Welcome from any draft server of {names} within {self.cfg.connect_timeout_s} s "
                    "(still trying in the background)"
                )
            time.sleep(min(_POLL_S, max(0.0, deadline - now)))

    def step(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None = None
    ) -> list[DraftReply]:
        """Drafts for one engine step over the fleet: one DraftReply per request, in order, within
        the budget. ``taps`` as for ``DraftClient.step`` (kept by reference: do not mutate it)."""
        return self._call(requests, taps, budget_ms, Phase.WHOLE)

    def send_taps(
        self,
        requests: Sequence[StepRequest],
        taps: np.ndarray | None,
        budget_ms: float | None = None,
        exact: bool = False,
        commit_follows: bool = False,
    ) -> bool:
        """Early taps over the fleet (``DraftClient.send_taps``, ``exact`` and ``commit_follows`` as
        there): each session's
        rows go to its server (new sessions are placed as by step()) without waiting. False, with
        nothing sent, when ``early_taps`` is off or any server would decline its part (then send the
        single message with step()). ValueError for a caller bug."""
        if budget_ms is not None:
            budget_ms = check_budget(budget_ms)
        _entries, taps = prepare(requests, taps, self.contract, self.limits, self.row_layout, Phase.TAPS)
        if not requests or self._closed or not self.early_taps:
            return False
        if not self._connect_requested:
            self.connect(wait=False)
        offsets = _offsets(requests)
        by_key, _replies, members = self._route(requests, time.monotonic())
        parts = [(members[key], [requests[i] for i in idx], _rows(taps, offsets, idx)) for key, idx in by_key.items()]
        if not parts or not all(c.takes_taps(rows, exact) for c, _r, rows in parts):
            return False  # no server for any session, or one would decline its part
        for c, reqs, rows in parts:
            c.send_taps(reqs, rows, budget_ms, exact, commit_follows)
        return True

    def commit(self, requests: Sequence[StepRequest], budget_ms: float | None = None) -> list[DraftReply]:
        """Drafts after early taps (``DraftClient.commit``), each session's commit to its server. A
        commit is never rerouted within the step (another server lacks its rows); a session that
        moved since its taps is answered MISSING_ROWS there, and its next step resends."""
        return self._call(requests, None, budget_ms, Phase.COMMIT)

    def submit_commit(self, requests: Sequence[StepRequest], budget_ms: float | None = None) -> FleetTicket:
        """commit() in two halves: the commits go now, ``collect()`` on the ticket waits for them
        (as ``DraftClient.submit_commit``; for ``target_client.client.predicted``)."""
        return self._begin(requests, None, budget_ms, Phase.COMMIT)

    def submit_step(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None = None
    ) -> FleetTicket:
        """step() in two halves (as ``DraftClient.submit_step``)."""
        return self._begin(requests, taps, budget_ms, Phase.WHOLE)

    def _call(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None, phase: Phase
    ) -> list[DraftReply]:
        return self._begin(requests, taps, budget_ms, phase).collect()

    def _begin(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None, phase: Phase
    ) -> FleetTicket:
        """Route and send one step (or commit) over the fleet; its ticket waits for the answers."""
        t0 = time.monotonic()
        if budget_ms is not None:
            budget_ms = check_budget(budget_ms)
        # caller bugs, before any send
        _entries, taps = prepare(requests, taps, self.contract, self.limits, self.row_layout, phase)
        n = len(requests)
        if n == 0 or self._closed:
            return FleetTicket(self, [DraftReply([]) for _ in range(n)])
        if not self._connect_requested:
            self.connect(wait=False)
        offsets = _offsets(requests)
        by_key, replies, members = self._route(requests, t0)
        groups = [
            self._submit(members, key, idx, requests, taps, offsets, budget_ms, t0, phase)
            for key, idx in by_key.items()
        ]
        return FleetTicket(self, replies, (groups, requests, taps, offsets, budget_ms, t0, members, phase))

    def _collect(self, replies: list[DraftReply | None], call: tuple) -> list[DraftReply]:
        groups, requests, taps, offsets, budget_ms, t0, members, phase = call
        finished = self._wait(groups, requests, taps, offsets, budget_ms, t0, replies, members, phase)
        self._settle(finished, requests, replies, members)
        self._m.step_duration.observe(time.monotonic() - t0)
        return [r if r is not None else DraftReply([]) for r in replies]

    def _route(
        self, requests: Sequence[StepRequest], t0: float
    ) -> tuple[dict[str, list[int]], list[DraftReply | None], dict[str, DraftClient]]:
        """Each request's server (placing new sessions, moving those whose server cannot serve
        them; the server a session left gets a Free): request indexes by server, a reply for the
        requests no server can take, and the members now. Servers with no request are nudged."""
        with self._lock:
            now = self._refresh_locked(t0)
            by_key: dict[str, list[int]] = {}
            frees: dict[str, list[str]] = {}
            replies: list[DraftReply | None] = [None] * len(requests)
            for i, r in enumerate(requests):
                key, left = self._placement.route(r.session, now)
                if left is not None:
                    frees.setdefault(left, []).append(r.session)
                if key is None:
                    replies[i] = DraftReply([], message="no draft server known")
                else:
                    by_key.setdefault(key, []).append(i)
            members = dict(self._members)
        for key, c in members.items():
            if key not in by_key:
                c.nudge()  # an open breaker keeps probing fast while this engine steps
        self._free_moved(frees, members)
        return by_key, replies, members

    async def astep(
        self, requests: Sequence[StepRequest], taps: np.ndarray | None, budget_ms: float | None = None
    ) -> list[DraftReply]:
        """step() for asyncio callers: runs in the loop's default executor, never blocks the loop."""
        return await asyncio.get_running_loop().run_in_executor(None, self.step, requests, taps, budget_ms)

    def free(self, sessions: Iterable[str]) -> None:
        """Release sessions on their servers (fire-and-forget) and forget their placement."""
        by_key: dict[str, list[str]] = {}
        with self._lock:
            for name in sessions:
                key = self._placement.free(name)
                if key is not None:
                    by_key.setdefault(key, []).append(name)
            members = dict(self._members)
        for key, names in by_key.items():
            c = members.get(key)
            if c is not None:
                c.free(names)

    def ping(self, timeout_ms: float = 100.0) -> Pong | None:
        """Ping every server that takes steps (so that Frees sent before have been read), within
        ``timeout_ms`` in all; the first Pong, or None when none answered."""
        if not (math.isfinite(timeout_ms) and timeout_ms > 0):
            raise ValueError(f"timeout_ms must be finite and > 0, got {timeout_ms}")
        deadline = time.monotonic() + timeout_ms / 1000.0
        first: Pong | None = None
        for c in self._snapshot():
            left = (deadline - time.monotonic()) * 1000.0
            if left <= 0:
                break
            if c.gate is None:
                pong = c.ping(left)
                first = first or pong
        return first

    def stats(self) -> dict[str, Any]:
        """The members' counters summed (their calls, one per server per step), plus the fleet's own."""
        with self._lock:
            self._refresh_locked(time.monotonic())
            members = dict(self._members)
            p = self._placement
            per_server = {
                k: {"load": s.load, "usable": p.can_serve(s, time.monotonic()), "gone": s.gone, "misses": s.misses}
                for k, s in p.servers.items()
            }
            counts = dataclasses.asdict(p.counts)
            sessions = len(p.seats)
        d: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
        for key, c in members.items():
            st = c.stats()
            for k, v in st.items():
                if isinstance(v, int) and not isinstance(v, bool) and k in d:
                    d[k] += v
            per_server.setdefault(key, {}).update(gate=st["gate"], epoch=st["epoch"], sessions_tracked=st["sessions"])
        d.update(self._counts)
        d.update(counts)
        d.update(
            servers=len(members),
            servers_usable=sum(1 for s in per_server.values() if s.get("usable")),
            sessions=sessions,
            breaker_state="open" if self.breaker_open else "closed",
            epoch=self.epoch,
            contract_id=self._pinned_id,
            budget_ms=self.budget_ms,
            per_server=per_server,
        )
        return d

    def close(self) -> None:
        """Stop the DNS thread and close every server's client. Idempotent; each close is bounded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            members = list(self._members.values())
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.cfg.close_timeout_s)
        for c in members:
            c.close()
        for state, v in self._gauge.items():
            self._m.servers.labels(state).dec(v)
            self._gauge[state] = 0

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the step, in parts

    def _submit(
        self,
        members: dict[str, DraftClient],
        key: str,
        index: list[int],
        requests: Sequence[StepRequest],
        taps: np.ndarray | None,
        offsets: np.ndarray,
        budget_ms: float | None,
        t0: float,
        phase: Phase,
    ) -> _Group:
        reqs = [requests[i] for i in index]
        c = members[key]
        if phase == Phase.COMMIT:
            return _Group(key, index, c.submit_commit(reqs, budget_ms, t0))
        return _Group(key, index, c.submit_step(reqs, _rows(taps, offsets, index), budget_ms, t0))

    def _wait(
        self,
        groups: list[_Group],
        requests: Sequence[StepRequest],
        taps: np.ndarray | None,
        offsets: np.ndarray,
        budget_ms: float | None,
        t0: float,
        replies: list[DraftReply | None],
        members: dict[str, DraftClient],
        phase: Phase,
    ) -> list[_Group]:
        """Wait for every group until its deadline; reroute groups of rows that failed at once (not
        commits). Fills ``replies``; returns every group that ended (rerouted ones included, for
        the misses)."""
        finished: list[_Group] = []
        failed: set[str] = set()
        live = {g.ticket.future: g for g in groups if g.ticket.future is not None}
        ready = [g for g in groups if g.ticket.future is None]
        while ready or live:
            for g in ready:
                out = g.ticket.collect()
                finished.append(g)
                at_once = g.ticket.outcome in _AT_ONCE and phase != Phase.COMMIT
                redo = self._reroute(g, failed, requests) if at_once else {}
                moved = {i for idx in redo.values() for i in idx}
                for i, rep in zip(g.index, out, strict=True):
                    if i not in moved:
                        replies[i] = rep
                for key, idx in redo.items():
                    ng = self._submit(members, key, idx, requests, taps, offsets, budget_ms, t0, phase)
                    if ng.ticket.future is None:
                        ready.append(ng)
                    else:
                        live[ng.ticket.future] = ng
            ready = []
            if not live:
                break
            left = max(g.ticket.deadline for g in live.values()) - time.monotonic()
            done = cf.wait(list(live), timeout=left, return_when=cf.FIRST_COMPLETED)[0] if left > 0 else set()
            if not done:  # the deadline passed: collect() gives up on each
                done = set(live)
            ready = [live.pop(f) for f in done]
        return finished

    def _reroute(self, g: _Group, failed: set[str], requests: Sequence[StepRequest]) -> dict[str, list[int]]:
        """The sessions of a group whose server failed at once, by their next server (when time is
        left); the server they left gets a Free."""
        failed.add(g.key)
        if g.ticket.deadline - time.monotonic() < _REROUTE_MIN_S:
            return {}
        out: dict[str, list[int]] = {}
        left: list[str] = []
        with self._lock:
            now = self._refresh_locked(time.monotonic())
            for i in g.index:
                new, _old = self._placement.fail(requests[i].session, g.key, failed, now)
                if new is not None:
                    out.setdefault(new, []).append(i)
                    left.append(requests[i].session)
            members = dict(self._members)
        if out:
            with self._lock:
                self._counts["reroutes"] += 1
            self._free_moved({g.key: left}, members)
        return {k: v for k, v in out.items() if k in members}  # one closed meanwhile: no drafts this step

    def _settle(
        self,
        finished: list[_Group],
        requests: Sequence[StepRequest],
        replies: list[DraftReply | None],
        members: dict[str, DraftClient],
    ) -> None:
        """The answers update the placement: misses, and fresh sessions answered overloaded shed."""
        frees: dict[str, list[str]] = {}
        with self._lock:
            self._counts["fleet_steps"] += 1
            now = time.monotonic()
            p = self._placement
            for g in finished:
                p.outcome(g.key, g.ticket.outcome, now)
                for i, rep in zip(g.index, g.ticket.replies or (), strict=False):
                    if replies[i] is not rep or rep.status is None:
                        continue
                    over = rep.status == Status.OVERLOADED
                    left = p.answered(requests[i].session, g.key, over, rep.retry_after_ms, now)
                    if left is not None:
                        frees.setdefault(left, []).append(requests[i].session)
        self._free_moved(frees, members)

    def _free_moved(self, frees: dict[str, list[str]], members: dict[str, DraftClient]) -> None:
        """Free sessions on the servers they left (queued there if the server is paused; gone with a
        dead one) and count the moves."""
        for key, names in frees.items():
            c = members.get(key)
            if c is not None:
                c.free(names)
        self._sync_counters()

    # ------------------------------------------------------------------ members and their state

    def _snapshot(self) -> list[DraftClient]:
        with self._lock:
            return [self._members[k] for k in sorted(self._members)]

    def _refresh(self, now: float) -> None:
        with self._lock:
            self._refresh_locked(now)

    def _refresh_locked(self, now: float) -> float:
        """Each server's usability from its client (welcomed, breaker closed, pinned contract)."""
        usable = down = 0
        for key, c in self._members.items():
            ok = c.gate is None
            if ok and self._pinned is None:
                w = c.welcome
                if w is not None:
                    self._pinned, self._pinned_id = w.contract, w.contract_id
                    log.info("draft fleet %s: contract %s pinned from %s", self.cfg.name, w.contract_id, key)
            if ok and self._pinned_id is None and self._pinned is not None and c.welcome is not None:
                if not self._pinned.mismatches(c.welcome.contract):
                    self._pinned_id = c.welcome.contract_id
            if ok and self._pinned_id is not None:
                w = c.welcome
                if w is not None and w.contract_id != self._pinned_id:
                    ok = False
                    if key not in self._wrong_contract:
                        self._wrong_contract.add(key)
                        log.error(
                            "draft fleet %s: %s serves contract %s, the fleet pinned %s: no sessions go there",
                            self.cfg.name,
                            key,
                            w.contract_id,
                            self._pinned_id,
                        )
            self._placement.set_usable(key, ok)
            usable += ok
            down += not ok
        for state, v in (("usable", usable), ("down", down)):
            if v != self._gauge[state]:
                self._m.servers.labels(state).inc(v - self._gauge[state])
                self._gauge[state] = v
        return now

    def _member_cfg(self, key: str) -> ClientConfig:
        c = self.cfg
        return dataclasses.replace(
            c,
            endpoint=key,
            name=f"{c.name}@{key.split('://', 1)[-1]}",
            breaker_failures=min(c.breaker_failures, self.options.miss_limit),
            expect=c.expect or self._pinned,
        )

    def _add(self, key: str) -> None:
        """A client for a new server (made outside the lock: it starts a thread)."""
        client = DraftClient(self._member_cfg(key))
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._members[key] = client
                self._placement.add(key)
                self._gone_at.pop(key, None)
        if closed:
            client.close()
            return
        if self._connect_requested:
            client.connect(wait=False)
        log.info("draft fleet %s: server %s added", self.cfg.name, key)

    def _lookup(self) -> tuple[list[str], list[str]]:
        if self._resolver is None:
            return ep.resolve(self._items)
        return ep.resolve(self._items, self._resolver)

    def resolve_now(self) -> None:
        """Resolve the DNS names now and apply the changes (the fleet's thread does this periodically)."""
        keys, errors = self._lookup()
        with self._lock:
            self._counts["resolves"] += 1
            self._counts["resolve_failures"] += len(errors)
        if errors:
            self._m.resolve_failures.inc(len(errors))
            for line in errors:
                log.warning("draft fleet %s: %s", self.cfg.name, line)
        now = time.monotonic()
        with self._lock:
            known = set(self._members)
            gone_at = dict(self._gone_at)
        if keys:  # an empty or failed lookup keeps what is known
            for key in sorted(set(keys) - known):
                self._add(key)
            with self._lock:
                for key in known - set(keys):
                    if key not in self._gone_at:
                        self._gone_at[key] = now
                        self._placement.remove(key)
                        log.info("draft fleet %s: server %s left DNS; its sessions move", self.cfg.name, key)
                for key in set(keys) & set(self._gone_at):
                    del self._gone_at[key]
                    self._placement.add(key)
                gone_at = dict(self._gone_at)
        retire: list[DraftClient] = []
        with self._lock:
            for key, since in gone_at.items():
                s = self._placement.servers.get(key)
                if s is None or s.load <= 0 or now - since >= self.options.gone_grace_s:
                    c = self._members.pop(key, None)
                    self._gone_at.pop(key, None)
                    self._placement.drop(key)
                    if c is not None:
                        retire.append(c)
        for c in retire:
            c.close()

    def _run(self) -> None:
        """The DNS thread: re-resolve every ``resolve_every_s`` (every second while none resolved)."""
        while not self._stop.is_set():
            with self._lock:
                empty = not self._members
            period = min(1.0, self.options.resolve_every_s) if empty else self.options.resolve_every_s
            if self._stop.wait(period):
                return
            try:
                self.resolve_now()
            except Exception:  # one bad round must not end the thread
                log.exception("draft fleet %s: DNS round failed", self.cfg.name)

    def _sync_counters(self) -> None:
        """Move the placement's move/shed counts into the Prometheus counters."""
        with self._lock:
            c = self._placement.counts
            dm, ds = c.moves - self._seen[0], c.sheds - self._seen[1]
            self._seen = (c.moves, c.sheds)
        if dm > 0:
            self._m.moves.inc(dm)
        if ds > 0:
            self._m.sheds.inc(ds)


def _offsets(requests: Sequence[StepRequest]) -> np.ndarray:
    """Each request's first row in the step's taps (and the total at the end)."""
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum([r.rows for r in requests], out=offsets[1:])
    return offsets


def _rows(taps: np.ndarray | None, offsets: np.ndarray, index: list[int]) -> np.ndarray | None:
    """The taps rows of the requests ``index`` (in order): a view when they are contiguous, else one copy."""
    if taps is None:
        return None
    a, b = int(offsets[index[0]]), int(offsets[index[-1] + 1])
    if index[-1] - index[0] + 1 == len(index):
        return taps[a:b] if b > a else None
    parts = [taps[int(offsets[i]) : int(offsets[i + 1])] for i in index]
    total = sum(len(x) for x in parts)
    return np.concatenate(parts, axis=0) if total else None
