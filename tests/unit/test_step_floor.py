"""The step's two floors (``draft_tools.bench.step_floor``): issue 10's max(memory, compute) over the
whole step, and the serial floor, each op's own floor summed, on full-size presets built on the meta
device (shapes only)."""

from __future__ import annotations

import math

import pytest

from draft_tools.bench.step_floor import floor_ms, meta_model, model_cost, step_ops

H100 = {"copy_bytes_per_s": 2.99e12, "bf16_flops_per_s": 775e12}


@pytest.fixture(scope="module")
def qwen3() -> object:
    return meta_model("qwen3-8b")


def test_ops_count_what_the_step_must_move(qwen3) -> None:
    n, ctx = 64, 1024
    ops = step_ops(qwen3, 20480, n, [ctx] * n, 3 * n)
    B = 7
    assert ops["lm_head"] == [151936 * 4096 * 2, 2 * n * B * 151936 * 4096]
    assert ops["markov_w2"][0] == 7 * 151936 * 256 * 2  # one read per Markov step
    assert ops["layers.mlp.gate_up_proj"][1] == 5 * 2 * n * B * 24576 * 4096  # every layer's copy
    assert ops["attention"][0] == 5 * n * (ctx + B) * 2 * 8 * 128 * 2  # K and V of 8 heads per token
    assert ops["taps"] == [3 * n * 20480 * 2, 0.0]
    assert "embed_tokens" not in ops and "markov_head.markov_w1" not in ops  # rows gathered only


def test_serial_floor_is_each_ops_own_floor_summed(qwen3) -> None:
    cost = model_cost(qwen3, 20480, 64, [1024] * 64, 192)
    f = floor_ms(cost, H100)
    assert f["floor_ms"] == max(f["memory_ms"], f["compute_ms"])
    by_hand = sum(max(b / 2.99e12, fl / 775e12) for b, fl in cost["ops"].values()) * 1e3
    assert math.isclose(f["serial_floor_ms"], by_hand)
    # 64 sessions: the GEMMs are compute-bound and the KV and Markov reads memory-bound, so a serial
    # step cannot reach issue 10's floor: the serial floor stands well above it
    assert f["serial_floor_ms"] > 1.2 * f["floor_ms"]
    # one side unlimited: every op bound by the other, and the two floors agree
    for fast in (
        {"copy_bytes_per_s": 1e30, "bf16_flops_per_s": 775e12},
        {"copy_bytes_per_s": 2.99e12, "bf16_flops_per_s": 1e30},
    ):
        g = floor_ms(cost, fast)
        assert math.isclose(g["serial_floor_ms"], g["floor_ms"], rel_tol=1e-12)


def test_one_session_is_memory_bound_on_both_floors(qwen3) -> None:
    f = floor_ms(model_cost(qwen3, 20480, 1, [1024], 3), H100)
    assert f["memory_ms"] > 10 * f["compute_ms"]
    assert math.isclose(f["serial_floor_ms"], f["floor_ms"], rel_tol=0.01)


def test_k3_mla_attention_counts_the_latent() -> None:
    k3 = meta_model("k3")
    ops = step_ops(k3, 35840, 2, [100, 300], 6)
    tok = 576 * 2  # kv_lora_rank + rope dims, bf16
    assert ops["attention"][0] == 5 * (107 + 307) * tok
    assert ops["attention"][1] == 5 * sum(7 * 64 * (c + 7) * (576 + 512) * 2 for c in (100, 300))


def test_cli_recomputes_both_floors_of_a_report(tmp_path, qwen3) -> None:
    import json

    from draft_tools.bench import step_floor

    f64 = floor_ms(model_cost(qwen3, 20480, 64, [1024] * 64, 192), H100)
    rep = {
        "machine": {"gpu": "test"},
        "floors": H100,
        "qwen3-8b": {"steps": [{"sessions": 64, "fast_ms": 3.0, "floor_ms": f64["floor_ms"]}]},
        "k3_error": "a preset that failed leaves no steps: skipped",
    }
    src, out = tmp_path / "rep.json", tmp_path / "out.json"
    src.write_text(json.dumps(rep))
    step_floor.main([str(src), "--out", str(out)])
    rows = json.loads(out.read_text())[str(src)]["qwen3-8b"]
    assert len(rows) == 1 and rows[0]["sessions"] == 64
    assert math.isclose(rows[0]["serial_floor_ms"], f64["serial_floor_ms"])
    assert math.isclose(rows[0]["fast_over_serial_floor"], 3.0 / f64["serial_floor_ms"])
    assert math.isclose(rows[0]["goal_1_3x_floor_over_serial_floor"], 1.3 * f64["floor_ms"] / f64["serial_floor_ms"])
