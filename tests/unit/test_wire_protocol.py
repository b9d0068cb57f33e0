"""The wire-format parts of the protocol and the client, without sockets (``protocol.wire``).

Row layouts and their validation per Step, the one-line refusals, compatibility with peers that
predate wire formats (a Hello, Welcome or Step without the new fields means bf16), the client's
config checks and its handshake verdict, and the client's checkpoint reader on bad input.
"""

from __future__ import annotations

import itertools
import json

import msgspec
import numpy as np
import pytest

from protocol import (
    GREEDY,
    DType,
    ErrorCode,
    Hello,
    Phase,
    ProtocolError,
    Sampling,
    ServerLimits,
    Step,
    StepEntry,
    Welcome,
    WireOffer,
    decode_reply,
    decode_request,
    encode,
    spec_for,
    validate_step,
)
from protocol.validate import check_entry
from protocol.wire import refusal, row_layout
from target_client import ClientConfig, StepRequest
from target_client.client.counters import Counters
from target_client.client.handshake import Handshake
from target_client.client.step_builder import prepare
from target_client.projection import Projection, ProjectionError
from tests.conftest import CHECKSUM_CONTRACT as C

LIMITS = ServerLimits(64, 4096, 64, 4096, 1 << 24, 1 << 20, 256, 512, 60000.0)
OFFER = WireOffer(("bf16", "projected", "fp8"), "abc123", 32, DType.F32)


def _step(wire: str, rows: np.ndarray, dtype: DType) -> tuple[Step, list]:
    e = (StepEntry("s", 0, len(rows), 1, 2),)
    return Step(1, 100.0, e, spec_for(rows, dtype, 0), wire=wire), [rows]


def test_row_layouts_and_validation() -> None:
    W = C.tap_width
    assert row_layout("bf16", C, OFFER) == (DType.BF16, W)
    assert row_layout("projected", C, OFFER) == (DType.F32, 32)
    assert row_layout("fp8", C, OFFER) == (DType.U8, W + 4)
    for wire, rows, dt in (
        ("bf16", np.zeros((3, W), np.uint16), DType.BF16),
        ("projected", np.zeros((3, 32), np.float32), DType.F32),
        ("fp8", np.zeros((3, W + 4), np.uint8), DType.U8),
    ):
        taps, errors = validate_step(*_step(wire, rows, dt), C, LIMITS, OFFER)
        assert taps is not None and taps.shape == rows.shape and errors == [None]
    with pytest.raises(ProtocolError) as e:  # fp8 rows without their scale
        validate_step(*_step("fp8", np.zeros((3, W), np.uint8), DType.U8), C, LIMITS, OFFER)
    assert e.value.code == ErrorCode.BAD_FRAMES and f"expected [3, {W + 4}]" in e.value.message
    with pytest.raises(ProtocolError) as e:  # projected rows in bf16 when the server asked for f32
        validate_step(*_step("projected", np.zeros((3, 32), np.uint16), DType.BF16), C, LIMITS, OFFER)
    assert e.value.code == ErrorCode.BAD_FRAMES and "server expects f32" in e.value.message
    with pytest.raises(ProtocolError) as e:  # a format the server does not take (default offer: bf16 only)
        validate_step(*_step("fp8", np.zeros((3, W + 4), np.uint8), DType.U8), C, LIMITS)
    assert e.value.code == ErrorCode.WIRE_FORMAT and e.value.message == "wire format 'fp8' refused: server accepts bf16"


def test_refusals_name_both_sides() -> None:
    assert refusal("bf16", "", OFFER) is None and refusal("projected", "abc123", OFFER) is None
    assert refusal("fp8", "", WireOffer(("bf16", "projected"))) == (
        "wire format 'fp8' refused: server accepts bf16, projected"
    )
    why = refusal("projected", "fff000", OFFER)
    assert why is not None and "fff000" in why and "abc123" in why and "\n" not in why
    assert "(none)" in (refusal("projected", "", OFFER) or "")


def test_peers_without_wire_formats_mean_bf16() -> None:
    old_hello = msgspec.msgpack.encode({"kind": "hello", "protocol_version": 1, "client_name": "old", "call_id": 3})
    h = decode_request(old_hello)
    assert isinstance(h, Hello) and h.wire_format == "bf16" and h.projection_id == ""
    step = msgspec.msgpack.decode(encode(_step("bf16", np.zeros((1, C.tap_width), np.uint16), DType.BF16)[0])[0])
    del step["wire"]
    s = decode_request(msgspec.msgpack.encode(step))
    assert isinstance(s, Step) and s.wire == "bf16"
    welcome = Welcome(1, 1, "e", C, C.fingerprint(), LIMITS)
    raw = msgspec.msgpack.decode(encode(welcome)[0])
    del raw["wire"]
    old = decode_reply(msgspec.msgpack.encode(raw))
    assert isinstance(old, Welcome) and old.wire == WireOffer()
    hs = Handshake(ClientConfig("tcp://127.0.0.1:1", wire_format="fp8"), Counters(None))
    message, fields = hs.check(old) or ("", ())
    assert message.endswith("wire format 'fp8' refused: server accepts bf16") and fields == ("wire_format",)
    hs = Handshake(ClientConfig("tcp://127.0.0.1:1", expect=C, wire_format="fp8"), Counters(None))
    assert hs.layout == (DType.U8, C.tap_width + 4)  # known before the Welcome from the pinned contract
    assert hs.check(msgspec.structs.replace(old, wire=WireOffer(("bf16", "fp8")))) is None


def test_client_config_checks_its_wire_format() -> None:
    with pytest.raises(ValueError, match="wire_format must be one of bf16, projected, fp8"):
        ClientConfig("tcp://127.0.0.1:1", wire_format="fp4")
    with pytest.raises(ValueError, match="'projected' needs projection_id"):
        ClientConfig("tcp://127.0.0.1:1", wire_format="projected")


def test_projection_reader_errors_are_one_line(tmp_path) -> None:
    with pytest.raises(ProjectionError, match=r"no readable config\.json"):
        Projection.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-5}))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ProjectionError, match="not a readable safetensors file"):
        Projection.load(str(tmp_path))
    header = json.dumps({"other.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ProjectionError, match="neither context_proj/context_norm nor fc/hidden_norm"):
        Projection.load(str(tmp_path))


def _entry_ok(e: StepEntry, limits: ServerLimits) -> bool:
    """An entry ``check_entry`` must accept, written out apart from it."""
    s = e.sampling
    sampling_ok = s == GREEDY or (
        s.temperature >= 0.0
        and 0 <= s.top_k <= C.vocab_size
        and 0.0 < s.top_p <= 1.0
        and (s.seed is None or 0 <= s.seed < 2**63)
        and 0 <= s.return_probs <= 1024
        and not (s.return_probs and s.temperature == 0.0)
    )
    sid = e.session.encode("utf-8", "surrogatepass")
    return (
        0 < len(sid) <= limits.max_session_id_bytes
        and e.pos >= 0
        and e.rows >= 0
        and e.pos + e.rows + e.k <= limits.max_position
        and 0 <= e.k <= C.block_size
        and 0 <= e.anchor < C.vocab_size
        and not (e.phase == Phase.TAPS and e.k)
        and sampling_ok
    )


def test_check_entry_accepts_exactly_the_valid_entries() -> None:
    """``check_entry`` takes the common case in one expression (a short id, greedy) and the rest
    by each rule; both halves agree with the rules written out, at every edge: ids of one to
    four UTF-8 bytes a character around the byte limit, positions at the limit, k and the anchor
    at their ends, early taps with drafts, sampling that is valid or not."""
    limits = msgspec.structs.replace(LIMITS, max_session_id_bytes=8, max_position=100)
    ids = [
        "",
        "a",
        "abcdefgh",
        "abcdefghi",
        "\u00e9" * 4,
        "\u00e9" * 5,
        "\u20ac" * 2,
        "\u20ac" * 3,
        "\U0001f600" * 2,
        "\ud800",
    ]
    samplings = [GREEDY, Sampling(temperature=0.7, top_k=5), Sampling(top_p=0.0), Sampling(return_probs=2)]
    seen = {True: 0, False: 0}
    for sid, pos, rows, k, anchor, phase, sampling in itertools.product(
        ids, (-1, 0, 93), (-1, 0, 3), (0, C.block_size, C.block_size + 1), (-1, 0, C.vocab_size - 1, C.vocab_size),
        (Phase.WHOLE, Phase.TAPS, Phase.COMMIT), samplings,
    ):  # fmt: skip
        e = StepEntry(sid, pos, rows, anchor, k, sampling, phase)
        ok = _entry_ok(e, limits)
        err = check_entry(e, C, limits)
        assert (err is None) == ok, (e, err)
        assert ok or (isinstance(err, str) and err)
        seen[ok] += 1
        if rows >= 0:  # (a negative row count refuses the whole Step) the server's per-Step check, whose
            # common case is inline, says the same, and names the session's second entry a duplicate
            taps = np.zeros((2 * rows, C.tap_width), np.uint16)
            step = Step(1, 100.0, (e, e), spec_for(taps, DType.BF16, 0) if rows else None)
            _, errors = validate_step(step, [taps] if rows else [], C, limits)
            assert errors[0] == err, (e, errors)
            assert errors[1] == (err or f"session {sid!r} appears twice in one step"), (e, errors)
            # and the client's own check of a caller's request (its common case inline too)
            req = StepRequest(sid, pos, rows, anchor, k, sampling)
            if ok and phase == Phase.WHOLE:
                entries, _ = prepare([req], np.zeros((rows, C.tap_width), np.uint16), C, limits, None)
                assert entries == (e,)
            elif phase == Phase.WHOLE:
                with pytest.raises(ValueError, match="requests\\[0\\]"):
                    prepare([req], np.zeros((rows, C.tap_width), np.uint16), C, limits, None)
    assert seen[True] and seen[False]
