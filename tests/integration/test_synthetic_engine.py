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


@pytest.mark.parametrize(
    ("early", "predicted", "whole"),
    [(True, False, True), (True, True, True), (True, True, False), (False, False, True)],
    ids=["early_taps", "predicted_whole_span", "predicted_commit", "single_message"],
)
def test_each_mode_drafts_every_session_and_sends_what_it_says(
    server, early: bool, predicted: bool, whole: bool
) -> None:
    cfg = ClientConfig(
        endpoint=server.endpoint, budget_ms=500.0, expect=CHECKSUM_CONTRACT, registry=CollectorRegistry()
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
            early_taps=early,
            predicted=predicted,
            whole_spans=whole,
        )
        for n in range(12):
            eng.step(n, 0.0)
        decode = eng.records[1:]  # after the prefill step
        assert all(r.drafted == r.wanted == SESSIONS and r.bad_tokens == 0 for r in decode), decode
        for r in decode:
            if not early:
                assert r.early_rows == 0
            elif predicted and not whole:
                assert r.early_rows == r.rows  # the committed rows, no rejected draft's row
            else:
                assert r.early_rows == SESSIONS * (K + 1) >= r.rows
        assert client.stats()["early_taps_declined"] == 0
    finally:
        client.close()
