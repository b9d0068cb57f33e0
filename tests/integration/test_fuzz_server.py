"""Fuzz a live server with random and mutated messages, then check it still drafts correctly.

Hypothesis builds structured messages (valid shapes with hostile values) and byte-level
mutations of valid ones (flips, truncations, spliced frames, wrong frame counts). At least
10,000 messages reach the server; afterwards a clean session must get exactly the drafts the
checksum mirror predicts, and the server must still be the same process with the same epoch.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import DType, Free, Hello, Ping, Sampling, Step, StepEntry, TensorSpec, encode
from tests.conftest import CHECKSUM_CONTRACT, RawPeer, ServerProc, SessionMirror, random_taps

W = CHECKSUM_CONTRACT.tap_width
BATCH = 10
EXAMPLES = 1000  # x BATCH messages = 10,000

ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 40), st.sampled_from([0, 1, 2**31, 2**62]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-10, 100))
entries = st.builds(
    StepEntry,
    session=st.text(max_size=300),
    pos=ints,
    rows=st.integers(-2, 6),
    anchor=ints,
    k=st.integers(-2, 12),
    sampling=st.builds(Sampling, floats, st.integers(-2, 40000), floats, st.none() | ints, st.integers(-1, 2000)),
)


@st.composite
def structured(draw):
    kind = draw(st.sampled_from(["step", "step", "step", "hello", "ping", "free"]))
    cid = draw(ints)
    if kind == "hello":
        return encode(Hello(draw(st.integers(-1, 3)), draw(st.text(max_size=20)), cid))
    if kind == "ping":
        return encode(Ping(cid))
    if kind == "free":
        return encode(Free(tuple(draw(st.lists(st.text(max_size=10), max_size=5)))))
    es = tuple(draw(st.lists(entries, max_size=5)))
    total = sum(max(e.rows, 0) for e in es)
    rows = draw(st.sampled_from([total, total, max(total - 1, 0), total + 1]))
    width = draw(st.sampled_from([W, W, W - 1, 1]))
    dtype = draw(st.sampled_from([DType.BF16, DType.BF16, DType.F32, DType.I64]))
    spec = draw(st.sampled_from([TensorSpec(dtype, (rows, width), draw(st.integers(-1, 2))), None]))
    payload = np.zeros((rows, width), np.uint16)
    nframes = draw(st.sampled_from([1, 1, 0, 2]))
    return encode(Step(cid, draw(floats), es, spec), [payload] * nframes)


@st.composite
def mutated(draw):
    taps = np.arange(2 * W, dtype=np.uint16).reshape(2, W)
    frames = [
        bytes(f)
        for f in encode(Step(5, 50.0, (StepEntry("m", 0, 2, 1, 3),), TensorSpec(DType.BF16, (2, W), 0)), [taps])
    ]
    op = draw(st.sampled_from(["flip", "truncate", "splice", "drop", "dup", "random"]))
    header = bytearray(frames[0])
    if op == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(header) - 1))
            header[i] = draw(st.integers(0, 255))
        return [bytes(header), frames[1]]
    if op == "truncate":
        return [bytes(header[: draw(st.integers(0, len(header)))]), frames[1]]
    if op == "splice":
        i = draw(st.integers(0, len(header)))
        return [bytes(header[:i]) + draw(st.binary(max_size=16)) + bytes(header[i:]), frames[1]]
    if op == "drop":
        return [frames[0]]
    if op == "dup":
        return [frames[0], frames[1], frames[1]]
    return [draw(st.binary(max_size=64)) for _ in range(draw(st.integers(1, 3)))]


def test_fuzz_10k_messages_then_still_drafts_correctly():
    srv = ServerProc().start()
    fuzzer = RawPeer(srv.endpoint)
    sent = 0
    try:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(st.lists(st.one_of(structured(), mutated()), min_size=BATCH, max_size=BATCH))
        def blast(msgs):
            nonlocal sent
            for frames in msgs:
                fuzzer.send_raw([bytes(f) for f in frames])
                sent += 1
            while fuzzer.sock.poll(0):  # drain replies as they come, never wait
                fuzzer.sock.recv_multipart()

        blast()
        assert sent >= 10_000
        assert srv.proc is not None and srv.proc.poll() is None, "server died under fuzzing"
        # the same server, same epoch, drafts exactly as the mirror predicts
        clean = RawPeer(srv.endpoint)
        rng = np.random.default_rng(11)
        m = SessionMirror()
        taps = random_taps(rng, 7)
        r = clean.step([StepEntry("clean", 0, 7, 3, 5)], taps)
        m.apply(0, taps, None)
        assert list(r.results[0].drafts) == m.expect(3, 5)
        assert r.epoch == srv.epoch
        met = srv.metrics()
        answered_bad = sum(v for k, v in met.items() if k.startswith("draft_server_bad_messages_total{"))
        assert answered_bad + met["draft_server_dropped_messages_total"] > 1000
        assert met["draft_server_engine_errors_total"] == 0
        assert met["draft_server_io_errors_total"] == 0
        clean.close()
    finally:
        fuzzer.close()
        srv.kill()
