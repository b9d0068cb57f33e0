"""Step tap frames land in the server's registered receive arena (``draft_server.io.arena``).

1. A tcp Step's rows reach the drafter as views of arena memory (their addresses lie in it; on
   the CPU registration is a no-op, the path is the same), and the drafts equal the same tiny
   DSpark model's in process, token for token (float64).
2. Three concurrent clients over tcp, staggered, many steps, against a 1 MiB arena and a slowed
   engine: slots are reused many times over while other steps' rows wait in them, steps that find
   no room or are larger than the arena come as ordinary frames (counted), and every draft is
   still the checksum of exactly the rows sent (a slot written again while its rows were queued
   would change them). Nothing is held once the traffic stops.
3. Malformed tap frames (short, long: cut by ``recv_into``, missing, one too many) get exactly
   the typed error a server without the arena gives, and touch no other session.
4. With the arena full (slots held), a Step's frame is received as usual and counted ``full``;
   once room is back, Steps land in the arena again.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from draft_server.app import DraftServer
from draft_server.config import ServerConfig
from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.drafters.checksum import ChecksumDrafter, drafts_from_digests, row_digest
from draft_server.models import load_drafter
from draft_server.models.tiny import make_tiny
from protocol import GREEDY, DType, Error, Step, StepEntry, StepResult, spec_for
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import CHECKSUM_CONTRACT, RawPeer, ServerProc, SessionMirror, random_taps, wait_for

VOCAB = CHECKSUM_CONTRACT.vocab_size
W = CHECKSUM_CONTRACT.tap_width


def _bits(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.timeout(240)
def test_tcp_rows_are_ingested_from_arena_memory_and_draft_as_in_process(tmp_path) -> None:
    paths = make_tiny("k3", str(tmp_path / "k3"), seed=3)
    drafter = load_drafter(paths.draft, paths.target, "cpu", "float64")
    local = load_drafter(paths.draft, paths.target, "cpu", "float64")
    seen: list[tuple[int, int]] = []  # (address, bytes) of every row block the drafter ingested
    real_ingest = drafter.ingest

    def recording(items):
        seen.extend((it.taps.ctypes.data, it.taps.nbytes) for it in items if len(it.taps))
        return real_ingest(items)

    drafter.ingest = recording  # type: ignore[method-assign]
    cfg = ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="dspark", model=paths.draft)
    srv = DraftServer(cfg, drafter)
    srv.start()
    contract = local.contract
    client = DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=30000.0, name="arena", expect=contract))
    try:
        client.connect(wait=True)
        arena = srv.router.arena
        assert arena is not None and arena.capacity == cfg.arena_mib << 20
        rng = np.random.default_rng(11)
        k, n = contract.block_size, 6
        ends = [0] * n
        compared = 0
        for step in range(6):
            reqs, taps = [], []
            for i in range(n):
                if step < i // 2:  # staggered arrivals
                    continue
                rows = int(rng.integers(8, 30)) if ends[i] == 0 else int(rng.integers(1, k + 2))
                reqs.append(StepRequest(f"s{i}", ends[i], rows, int(rng.integers(0, contract.vocab_size)), k))
                taps.append(_bits(rng, rows, contract.tap_width))
            replies = client.step(reqs, np.ascontiguousarray(np.concatenate(taps)))
            for r, t, rep in zip(reqs, taps, replies, strict=True):
                i = int(r.session[1:])
                ends[i] = r.pos + r.rows
                assert local.reserve(i, 0, ends[i] + k)
                local.ingest([IngestItem(i, 0, r.pos, t)])
                want = local.draft([DraftItem(i, 0, ends[i], r.anchor, k, GREEDY)])[0].tokens
                assert rep.tokens == want, f"step {step} {r.session}: remote != in process"
                compared += 1
        assert compared >= 25
        assert seen and all(arena.contains(a, nb) for a, nb in seen), "rows staged from outside the arena"
        m = srv.metrics
        assert m.arena_payloads._value.get() == 6
        assert sum(m.arena_fallbacks.labels(r)._value.get() for r in ("full", "too_large")) == 0
        assert wait_for(lambda: arena.held == 0, 5.0)  # every slot back once its rows are in the cache
    finally:
        client.close()
        srv.stop()


class Mirror:
    """One client's sessions (append only) with a running digest per session: checksum drafts in O(1)."""

    def __init__(self, client: DraftClient, name: str, n: int, seed: int) -> None:
        self.client, self.name = client, name
        self.rng = np.random.default_rng(seed)
        self.ends = [0] * n
        self.total = [0] * n

    def step(self, lo: int, hi: int, k: int = 4) -> None:
        reqs, parts = [], []
        for i, end in enumerate(self.ends):
            rows = int(self.rng.integers(lo, hi + 1))
            reqs.append(StepRequest(f"{self.name}-{i}", end, rows, 7 + i, k))
            parts.append(self.rng.integers(0, 1 << 15, (rows, W), dtype=np.uint16))  # finite bf16 patterns
        replies = self.client.step(reqs, np.concatenate(parts))
        for i, (req, t, rep) in enumerate(zip(reqs, parts, replies, strict=True)):
            for j in range(len(t)):
                self.total[i] = (self.total[i] + row_digest(t[j], req.pos + j)) % (1 << 64)
            self.ends[i] += len(t)
            want = drafts_from_digests([self.total[i]], 0, self.ends[i], req.anchor, k, VOCAB)
            assert rep.tokens == want, f"{req.session} at {req.pos}: drafts differ from the rows sent ({rep.status})"


@pytest.mark.timeout(180)
def test_concurrent_clients_reuse_slots_and_fall_back_without_a_wrong_draft() -> None:
    srv = ServerProc("--arena-mib", "1", "--checksum-delay-ms", "4").start()
    clients = [DraftClient(ClientConfig(endpoint=srv.endpoint, budget_ms=10000.0, name=f"c{i}")) for i in range(3)]
    errors: list[BaseException] = []
    steps = 40

    def run(i: int) -> None:
        try:
            rnd = random.Random(i)
            time.sleep(0.05 * i)  # staggered arrivals
            m = Mirror(clients[i], f"c{i}", 48, i)
            for s in range(steps):
                m.step(20, 60)  # 48 sessions x ~40 rows x 256 B: ~0.5 MB a step; two or three fill the arena
                time.sleep(rnd.random() * 0.004)
                if s % 13 == 12:
                    m.step(90, 110)  # a prefill-sized step (~1.2 MB): larger than the arena
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    try:
        for c in clients:
            c.connect(wait=True)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert not errors, errors
        met = srv.metrics()
        into = met["draft_server_arena_payloads_total"]
        full = met['draft_server_arena_fallbacks_total{reason="full"}']
        large = met['draft_server_arena_fallbacks_total{reason="too_large"}']
        assert large == 3 * (steps // 13), (into, full, large)
        # ~0.5 MB a step through a 1 MiB arena: its slots are reused dozens of times
        assert into + full + large == 3 * (steps + steps // 13) and into >= 40, (into, full, large)
        assert not any(k.startswith("draft_server_bad_messages_total{") and v for k, v in met.items())
        assert wait_for(lambda: srv.metrics()["draft_server_arena_held_bytes"] == 0, 5.0)
    finally:
        for c in clients:
            c.close()
        srv.kill()


def _malformed(peer: RawPeer, rng: np.random.Generator) -> list:
    """Replies to Steps whose tap frame is short, long, missing, or followed by an extra frame."""
    out = []
    taps = random_taps(rng, 3)
    spec = spec_for(taps, DType.BF16, 0)
    for frames in ([taps[:2]], [np.concatenate([taps, taps, taps])], [], [taps, taps[:1]]):
        peer.call_id += 1
        peer.send(Step(peer.call_id, 5000.0, (StepEntry("bad", 0, 3, 5, 4),), spec), frames)
        out.append(peer.recv())
    return out


@pytest.mark.timeout(120)
def test_malformed_tap_frames_get_the_same_typed_errors_as_without_the_arena(server_factory) -> None:
    got = {}
    for arena in ("8", "0"):
        srv = server_factory("--arena-mib", arena)
        peer = RawPeer(srv.endpoint)
        rng = np.random.default_rng(1)
        good = SessionMirror()
        t0 = random_taps(rng, 4)
        first = peer.step([StepEntry("good", 0, 4, 9, 4)], t0)
        good.apply(0, t0, None)
        assert list(first.results[0].drafts) == good.expect(9, 4)
        got[arena] = _malformed(peer, rng)
        t1 = random_taps(rng, 2)
        after = peer.step([StepEntry("good", 4, 2, 9, 4)], t1)  # the other session is untouched
        good.apply(4, t1, 4)
        assert isinstance(after, StepResult) and list(after.results[0].drafts) == good.expect(9, 4)
        met = srv.metrics()
        if arena == "8":
            assert met["draft_server_arena_payloads_total"] == 2 + 3  # two good Steps; no tap frame in one bad
            assert wait_for(lambda srv=srv: srv.metrics()["draft_server_arena_held_bytes"] == 0, 5.0)
        else:
            assert met["draft_server_arena_payloads_total"] == 0 and "draft_server_arena_capacity_bytes" not in met
        peer.close()
    for a, b in zip(got["8"], got["0"], strict=True):
        assert isinstance(a, Error) and isinstance(b, Error)
        assert (a.call_id, a.code, a.message) == (b.call_id, b.code, b.message)
    assert "holds 512 bytes" in got["8"][0].message and "holds 2304 bytes" in got["8"][1].message
    assert "0 payload frames" in got["8"][2].message or "missing" in got["8"][2].message


@pytest.mark.timeout(60)
def test_a_full_arena_falls_back_to_frames_and_comes_back() -> None:
    srv = DraftServer(
        ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum", arena_mib=1), ChecksumDrafter()
    )
    srv.start()
    peer = RawPeer(srv.endpoint)
    try:
        arena, m = srv.router.arena, srv.metrics
        assert arena is not None
        hog = arena.take(arena.capacity)  # every byte held, as by rows still queued
        assert hog is not None and arena.take(1) is None
        rng = np.random.default_rng(2)
        mirror = SessionMirror()
        pos = 0
        for i in range(4):
            if i == 2:
                del hog  # room again
            taps = random_taps(rng, 3)
            reply = peer.step([StepEntry("s", pos, 3, 5, 4)], taps)
            mirror.apply(pos, taps, pos if pos else None)
            pos += 3
            assert list(reply.results[0].drafts) == mirror.expect(5, 4)
        assert m.arena_fallbacks.labels("full")._value.get() == 2
        assert m.arena_payloads._value.get() == 2
        assert wait_for(lambda: arena.held == 0, 5.0)
    finally:
        peer.close()
        srv.stop()
