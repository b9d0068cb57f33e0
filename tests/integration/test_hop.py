"""The hop (issue 12) against real server processes: the cheaper paths keep every guarantee.

Three clients step concurrently with staggered arrivals through a server restart (SIGKILL, a new
process on the same port): every draft the checksum drafter returns is exactly the one of the
context the reply names, before and after the restart, and every client drafts again after it.
Each reply's metric updates are in the server's exposition as soon as the reply is in the
client's hands (they are queued before the send, and a scrape applies the queue first); a
client's own queued updates reach its registry within the I/O thread's flush period even when
nothing scrapes it and no step follows.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from draft_server.drafters.checksum import expected_drafts
from target_client import ClientConfig, DraftClient, StepRequest
from target_client.metrics import metrics_for
from tests.conftest import CHECKSUM_CONTRACT, random_taps, wait_for

VOCAB = CHECKSUM_CONTRACT.vocab_size

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def make_client(endpoint: str, name: str, registry: CollectorRegistry | None = None) -> DraftClient:
    return DraftClient(
        ClientConfig(
            endpoint=endpoint,
            name=name,
            expect=CHECKSUM_CONTRACT,
            budget_ms=500.0,
            breaker_backoff_ms=100.0,
            registry=registry or CollectorRegistry(),
        )
    )


class Engine:
    """One client's stepping thread: two sessions, 1-3 new rows each per step, random k, and a
    check of every drafted reply against the rows it names ([start, end))."""

    def __init__(self, client: DraftClient, seed: int) -> None:
        self.client = client
        self.rng = np.random.default_rng(seed)
        self.rows: dict[str, dict[int, bytes]] = {"a": {}, "b": {}}
        self.end = {"a": 0, "b": 0}
        self.errors: list[str] = []
        self.ok_by_epoch: dict[str, int] = {}
        self.steps = 0
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.step()
                time.sleep(float(self.rng.uniform(0.0, 0.004)))  # staggered arrivals
        except Exception as exc:  # pragma: no cover - reported by the test
            self.errors.append(repr(exc))

    def step(self) -> None:
        reqs = [
            StepRequest(s, self.end[s], int(self.rng.integers(1, 4)), int(self.rng.integers(0, VOCAB)), int(k))
            for s, k in zip(self.rows, self.rng.integers(1, 8, size=2), strict=True)
        ]
        taps = random_taps(self.rng, sum(r.rows for r in reqs))
        off = 0
        for r in reqs:
            for i in range(r.rows):
                self.rows[r.session][r.pos + i] = taps[off + i].tobytes()
            off += r.rows
            self.end[r.session] += r.rows
        out = self.client.step(reqs, taps)
        self.steps += 1
        epoch = self.client.epoch or ""
        for r, o in zip(reqs, out, strict=True):
            if not o.tokens:
                continue
            end = r.pos + r.rows
            ctx = {p: self.rows[r.session][p] for p in range(o.start, end)}
            want = expected_drafts(ctx, o.start, end, r.anchor, r.k, VOCAB)
            if o.tokens != want:
                self.errors.append(f"{self.client.cfg.name} {r.session}@{r.pos}: {o.tokens} != {want}")
            self.ok_by_epoch[epoch] = self.ok_by_epoch.get(epoch, 0) + 1


def test_three_staggered_clients_draft_exactly_before_and_after_a_server_restart(server) -> None:
    clients = [make_client(server.endpoint, f"engine-{i}") for i in range(3)]
    engines = [Engine(c, i) for i, c in enumerate(clients)]
    threads = [threading.Thread(target=e.run) for e in engines]
    try:
        for c in clients:
            c.connect(wait=True)
        first = server.epoch
        for t in threads:
            t.start()
        assert wait_for(lambda: all(e.ok_by_epoch.get(first, 0) >= 20 for e in engines), timeout=60)
        server.restart()  # SIGKILL mid-traffic, a new process (new epoch) on the same port
        second = server.epoch
        assert second != first
        assert wait_for(lambda: all(e.ok_by_epoch.get(second, 0) >= 20 for e in engines), timeout=90), [
            e.ok_by_epoch for e in engines
        ]
        for e in engines:
            e.stop.set()
        for t in threads:
            t.join(30)
        # every reply's metrics were queued before it went: the scrape right after the last one sees them all
        met = server.metrics()
        drafted = sum(e.ok_by_epoch[second] for e in engines)
        assert met['draft_server_entries_total{status="ok"}'] >= drafted
        assert met['draft_server_messages_total{kind="step"}'] >= sum(1 for _ in engines) * 10
        assert met["draft_server_replies_dropped_total"] == 0
        for e, c in zip(engines, clients, strict=True):
            assert not e.errors, e.errors[:5]
            st = c.stats()
            assert st["bad_replies"] == 0 and st["epoch_changes"] >= 1 and st["io_thread_alive"]
    finally:
        for e in engines:
            e.stop.set()
        for c in clients:
            c.close()


def test_a_clients_queued_metrics_reach_its_registry_without_a_scrape(server) -> None:
    reg = CollectorRegistry()
    c = make_client(server.endpoint, "quiet", reg)
    try:
        c.connect(wait=True)
        rng = np.random.default_rng(3)
        for pos in range(5):
            assert c.step([StepRequest("q", pos, 1, 7, 3)], random_taps(rng, 1))[0].tokens
        m = metrics_for(reg)
        # read the values without a collection (which would apply the queue itself): the I/O
        # thread's timer applies what the last step queued although no step follows
        assert wait_for(lambda: m.steps.labels("ok")._value.get() == 5, timeout=10)
        assert wait_for(lambda: m.step_duration._sum.get() > 0 and m.drafts._value.get() == 15, timeout=10)
        assert len(m.later) == 0
    finally:
        c.close()
