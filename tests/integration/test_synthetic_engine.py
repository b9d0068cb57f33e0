"""The synthetic target engine's step modes (``draft_tools.synthetic``, what the early-taps benches
drive) against a real checksum server: every mode drafts every session, and the early taps carry
what the mode says: the whole verified span (k + 1 rows a decode step), only the committed rows
(predicted commits), or nothing (the single message)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from draft_tools.synthetic import SyntheticTarget
from target_client import ClientConfig, DraftClient
from tests.conftest import CHECKSUM_CONTRACT

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

K = 4
SESSIONS = 3


def _run(server, steps: int = 12, transport: str = "frames", **kw) -> tuple[DraftClient, SyntheticTarget]:
    """A client of ``server`` and a synthetic engine of SESSIONS sessions that has stepped ``steps`` times
    (``kw``: its mode); the caller closes the client."""
    cfg = ClientConfig(
        endpoint=server.endpoint,
        budget_ms=500.0,
        expect=CHECKSUM_CONTRACT,
        registry=CollectorRegistry(),
        transport=transport,
        shm_ring_mib=4,
    )
    client = DraftClient(cfg)
    try:
        welcome = client.connect(wait=True)
        assert welcome is not None
        eng = SyntheticTarget(
            client,
            welcome.contract,
            sessions=SESSIONS,
            k=K,
            prefill_rows=(8, 8),
            decode_steps=(50, 50),
            stagger_steps=0,
            **kw,
        )
        for n in range(steps):
            eng.step(n, 0.0)
    except BaseException:
        client.close()
        raise
    return client, eng


@pytest.mark.parametrize(
    ("early", "predicted", "whole", "one"),
    [
        (True, False, True, False),
        (True, True, True, False),
        (True, True, False, False),
        (True, True, False, True),
        (False, False, True, False),
    ],
    ids=["early_taps", "predicted_whole_span", "predicted_commit", "predicted_one_message", "single_message"],
)
def test_each_mode_drafts_every_session_and_sends_what_it_says(
    server, early: bool, predicted: bool, whole: bool, one: bool
) -> None:
    client, eng = _run(server, early_taps=early, predicted=predicted, whole_spans=whole, one_message=one)
    try:
        decode = eng.records[1:]  # after the prefill step
        assert all(r.drafted == r.wanted == SESSIONS and r.bad_tokens == 0 for r in decode), decode
        for r in decode:
            if not early:
                assert r.early_rows == 0
            elif predicted and not whole:
                assert r.early_rows == r.rows  # the committed rows, no rejected draft's row
                assert r.commit_lead_ms == r.commit_lead_ms, r  # when its drafting call went out: recorded
            else:
                assert r.early_rows == SESSIONS * (K + 1) >= r.rows
        assert client.stats()["early_taps_declined"] == 0
    finally:
        client.close()


@pytest.mark.parametrize("encode", ["host", "ring"])
def test_encoded_taps_go_through_the_ring_copied_or_in_place(server, encode: str) -> None:
    """``encode``: the taps go through the vLLM proposer's encoder, over transport shm; "ring" writes
    them into regions the client claims, sent where they lie; "host" has the I/O thread copy them in."""
    client, eng = _run(server, transport="shm", early_taps=True, predicted=True, encode=encode)
    try:
        assert all(r.drafted == r.wanted == SESSIONS and r.bad_tokens == 0 for r in eng.records[1:])
        in_place = client.stats()["rows_in_place"]
        assert (in_place >= 11) if encode == "ring" else (in_place == 0)
    finally:
        client.close()
