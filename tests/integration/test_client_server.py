"""DraftClient against a real draft server subprocess (checksum drafter, real sockets).

The checksum drafter's drafts are a hash of every context row and its position, so a draft
that equals ``expected_drafts`` over what a test sent proves the server holds exactly those
rows (appends, resends after lost replies, restarts at a gap). Timing: every step returns
within its budget + 5 ms (the only timed assertion); everything else waits on events.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from protocol import Status
from target_client import ClientConfig, ContractMismatchError, DraftClient, DraftReply, StepRequest
from tests.conftest import (
    CHECKSUM_CONTRACT,
    assert_on_time,
    random_taps,
    wait_for,
)

OK_BUDGET = 500.0  # a real server in a subprocess on a shared 2-core machine
MISS_BUDGET = 30.0
VOCAB = CHECKSUM_CONTRACT.vocab_size

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def timed_step(client: DraftClient, reqs, taps, budget_ms: float | None = None) -> list[DraftReply]:
    budget = budget_ms if budget_ms is not None else client.budget_ms
    return assert_on_time(lambda: client.step(reqs, taps, budget_ms), budget)


def make_client(endpoint: str, name: str, **kw) -> DraftClient:
    kw.setdefault("budget_ms", OK_BUDGET)
    return DraftClient(
        ClientConfig(endpoint=endpoint, name=name, expect=CHECKSUM_CONTRACT, registry=CollectorRegistry(), **kw)
    )


class Context:
    """What one session's context on the server must be: [start, end) rows by position."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.rows: dict[int, bytes] = {}

    def add(self, pos: int, taps: np.ndarray) -> None:
        for i, row in enumerate(taps):
            self.rows[pos + i] = row.tobytes()

    def restart(self, pos: int) -> None:
        self.start, self.rows = pos, {}

    def drafts(self, anchor: int, k: int) -> list[int]:
        end = self.start + len(self.rows)
        return expected_drafts(self.rows, self.start, end, anchor, k, VOCAB)


def check_step(
    ctx: dict[str, Context], end: dict[str, int], reqs: list[StepRequest], taps: np.ndarray, out: list[DraftReply]
) -> tuple[int, list[str]]:
    """Add each request's rows to its session's context; returns (replies drafted, their drafts that
    differ from ``expected_drafts``, described). A reply other than OK (EXPIRED: the server saw the
    budget would pass before drafting, e.g. its draft-time estimate just after a pause) must carry no
    drafts; a missed step (no status) none either."""
    answered, wrong, off = 0, [], 0
    for r, o in zip(reqs, out, strict=True):
        ctx[r.session].add(r.pos, taps[off : off + r.rows])
        off += r.rows
        end[r.session] += r.rows
        if o.status is not Status.OK:
            if o.tokens:
                wrong.append(f"{r.session} at {r.pos}: drafts {o.tokens} with status {o.status}")
        else:
            want = ctx[r.session].drafts(r.anchor, r.k)
            if o.tokens != want:
                wrong.append(f"{r.session} at {r.pos}: {o.tokens} != {want}")
            answered += 1
    return answered, wrong


def test_two_clients_concurrent_sessions_get_exact_drafts(server) -> None:
    # Two engines (two DraftClients, one thread each, the same session names on purpose: the
    # server keys sessions by client identity), staggered, several sessions per step.
    clients = [make_client(server.endpoint, f"engine-{i}") for i in range(2)]
    errors: list[str] = []
    served = [0, 0]
    try:
        for c in clients:
            w = c.connect(wait=True)
            assert w is not None and w.epoch == server.epoch and c.contract == CHECKSUM_CONTRACT

        def engine(ci: int) -> None:
            client = clients[ci]
            rng = np.random.default_rng(ci)
            ctx = {f"s{j}": Context() for j in range(3)}
            end = dict.fromkeys(ctx, 0)
            try:
                time.sleep(0.003 * ci)  # staggered arrivals
                for it in range(30):
                    names = [s for j, s in enumerate(ctx) if (it + j) % 4 != 0]
                    rows = [int(rng.integers(1, 4)) if it else 6 for _ in names]  # a prefill-ish first step
                    reqs = [
                        StepRequest(s, end[s], r, anchor=int(rng.integers(0, VOCAB)), k=int(rng.integers(0, 9)))
                        for s, r in zip(names, rows, strict=True)
                    ]
                    taps = random_taps(rng, sum(rows))
                    answered, wrong = check_step(ctx, end, reqs, taps, timed_step(client, reqs, taps))
                    served[ci] += answered
                    errors.extend(f"client {ci} step {it} {w}" for w in wrong)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"client {ci}: {exc!r}")

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors[:5]
        assert min(served) > 40, served  # of ~68 requests each; a timeout is legal on a loaded host, many are not
        for c in clients:
            st = c.stats()
            assert st["calls"] == 30 and st["bad_replies"] == 0 and st["epoch_changes"] == 0
    finally:
        for c in clients:
            c.close()


def test_contract_mismatch_is_refused_with_the_field_named(server) -> None:
    wrong = msgspec.structs.replace(CHECKSUM_CONTRACT, tap_layer_ids=(2, 4))
    client = DraftClient(ClientConfig(endpoint=server.endpoint, expect=wrong, registry=CollectorRegistry()))
    try:
        with pytest.raises(ContractMismatchError) as ei:
            client.connect(wait=True)
        assert "tap_layer_ids" in str(ei.value) and "tap_layer_ids" in ei.value.fields
        taps = np.zeros((1, wrong.tap_width), np.uint16)
        assert timed_step(client, [StepRequest("a", 0, 1, 1, 4)], taps)[0].tokens == []
    finally:
        client.close()


def test_paused_server_costs_a_budget_per_step_then_resend_restores_the_exact_context(server) -> None:
    client = make_client(server.endpoint, "engine", breaker_failures=3, breaker_backoff_ms=100.0)
    rng = np.random.default_rng(3)
    ctx = Context()
    pos = 0
    try:
        client.connect(wait=True)

        def step(rows: int, budget: float | None = None) -> DraftReply:
            nonlocal pos
            taps = random_taps(rng, rows)
            r = StepRequest("s", pos, rows, anchor=int(rng.integers(0, VOCAB)), k=4)
            out = timed_step(client, [r], taps, budget)[0]
            ctx.add(pos, taps)
            pos += rows
            if out.tokens:
                assert out.tokens == ctx.drafts(r.anchor, r.k)
            return out

        assert step(5).tokens
        server.pause()  # SIGSTOP: the connection stays up, nothing answers
        try:
            for _ in range(3):
                assert step(2, MISS_BUDGET).tokens == []
            assert wait_for(lambda: client.stats()["breaker_state"] == "open")
            for _ in range(2):
                assert step(1, 1000.0).tokens == []  # breaker open: at once, rows buffered
        finally:
            server.resume()
        assert wait_for(lambda: client.stats()["breaker_state"] == "closed")
        # the next step resends every unacknowledged row; the server's context is exactly all rows
        out = step(1)
        assert out.tokens, client.stats()
        st = client.stats()
        assert st["timeouts"] == 3 and st["outcome_breaker_open"] == 2 and st["resent_rows"] >= 8
        assert step(2).tokens
    finally:
        client.close()


def test_server_restart_new_epoch_sessions_restart_at_the_gap(server) -> None:
    client = make_client(server.endpoint, "engine", breaker_backoff_ms=100.0)
    rng = np.random.default_rng(5)
    try:
        client.connect(wait=True)
        first_epoch = client.epoch
        ctx = Context()
        taps = random_taps(rng, 4)
        out = timed_step(client, [StepRequest("s", 0, 4, anchor=7, k=3)], taps)
        ctx.add(0, taps)
        assert out[0].tokens == ctx.drafts(7, 3)
        server.restart()  # SIGKILL, then a new process (new epoch) on the same port
        assert wait_for(lambda: (p := client.ping(200.0)) is not None and p.epoch == server.epoch, timeout=30.0)
        assert client.epoch == server.epoch != first_epoch
        taps = random_taps(rng, 2)
        out = timed_step(client, [StepRequest("s", 4, 2, anchor=9, k=5)], taps)
        ctx.restart(4)  # the new server starts the session at the first row it gets
        ctx.add(4, taps)
        assert out[0].tokens == ctx.drafts(9, 5)
        st = client.stats()
        assert st["epoch_changes"] == 1 and st["bad_replies"] == 0
    finally:
        client.close()
