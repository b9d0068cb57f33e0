"""What a draft step must cost: its bytes and FLOPs, and the two floors they give on a measured card.

Issue 10's floor is ``max(bytes / copy bandwidth, FLOPs / bf16 rate)`` over the whole step, as if every
byte moved while every FLOP ran. The step is a chain of dependent ops (each GEMM, attention and Markov
read waits for the one before), so a step that runs them one after another cannot go under the sum of
each op's own floor, ``sum(max(bytes_op / bandwidth, FLOPs_op / rate))``: the serial floor. Where some
ops are bound by memory and others by compute (many sessions: the GEMMs compute-bound, the KV cache's and
the Markov head's reads memory-bound) the serial floor lies above issue 10's; where it does, the issue's
ratio to its floor cannot reach 1.0, and ``serial_over_floor`` says by how much.

The bench modules (``draft_step_gpu`` and the A/B scripts beside it) take ``step_cost`` and ``floor_ms``
from here. ``python -m draft_tools.bench.step_floor FILE...`` recomputes both floors for the rows of a
``draft_step_*.json`` without a GPU (each preset's model built on the meta device, the file's measured
bandwidth and rate) and prints each row's ratio to each.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import torch

CTX, NEW_ROWS, K = 1024, 3, 7  # the step benches' context rows, new rows and drafts per session

_LAYER = re.compile(r"^layers\.\d+\.")


def step_ops(model: Any, tap_width: int, n: int, contexts: list[int], rows_in: int) -> dict[str, list[float]]:
    """[bytes, FLOPs] of each kind of op one step must run (``n`` sessions drafting, their context
    lengths, ``rows_in`` new context rows): weights once (W2 once per Markov step), KV, taps. Ops of one
    kind (a weight's copies over the layers, the K Markov reads, the layers' attention) share their
    ratio of FLOPs to bytes, so each kind's floor is its sum's."""
    m, cfg = model, model.cfg
    B = cfg.block_size
    blk = n * B
    ops: dict[str, list[float]] = {}

    def add(kind: str, by: float, fl: float) -> None:
        o = ops.setdefault(kind, [0.0, 0.0])
        o[0] += by
        o[1] += fl

    for name, t in m.w.items():
        if t.dim() != 2:
            continue
        size = t.numel() * t.element_size()
        if name in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
            continue  # gathered rows only
        kind = _LAYER.sub("layers.", name).removesuffix(".weight")
        if name == "markov_head.markov_w2.weight":
            add("markov_w2", K * size, 2 * n * K * t.numel())
        elif name in ("context_proj.weight", "fc.weight"):
            add(kind, size, 2 * rows_in * t.numel())
        elif name == "lm_head.weight":
            add(kind, size, 2 * n * K * t.numel())
        else:
            add(kind, size, 2 * blk * t.numel())
    kv_all = m.kv_a_all if m.layout.mla else m.kv_w  # every layer's context K/V (or latent) projection
    add("context_kv", kv_all.numel() * kv_all.element_size(), 2 * rows_in * kv_all.numel())
    add("taps", rows_in * tap_width * 2, 0.0)
    tok_bytes = int(torch.Size(m.token_shape).numel()) * m.dtype.itemsize
    H = cfg.num_heads
    per_tok = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank if m.layout.mla else 2 * cfg.head_dim
    add(
        "attention",
        cfg.num_layers * sum(c + B for c in contexts) * tok_bytes,
        cfg.num_layers * sum(B * H * (c + B) * per_tok * 2 for c in contexts),
    )
    return ops


def model_cost(model: Any, tap_width: int, n: int, contexts: list[int], rows_in: int) -> dict[str, Any]:
    """Bytes and FLOPs of a model's step (``step_ops`` summed), with the ops by kind."""
    ops = step_ops(model, tap_width, n, contexts, rows_in)
    return {"bytes": sum(o[0] for o in ops.values()), "flops": sum(o[1] for o in ops.values()), "ops": ops}


def step_cost(d: Any, n: int, contexts: list[int], rows_in: int) -> dict[str, Any]:
    """``model_cost`` of a drafter's step."""
    return model_cost(d.model, d.contract.tap_width, n, contexts, rows_in)


def floor_ms(cost: dict[str, Any], floors: dict[str, float]) -> dict[str, float]:
    """Issue 10's floor (the larger of the whole step's memory and compute times) and the serial floor
    (each kind of op's larger time, summed), in ms, on a card's measured bandwidth and bf16 rate."""
    bw, rate = floors["copy_bytes_per_s"], floors["bf16_flops_per_s"]
    mem = cost["bytes"] / bw * 1e3
    comp = cost["flops"] / rate * 1e3
    floor = max(mem, comp)
    serial = sum(max(by / bw, fl / rate) for by, fl in cost["ops"].values()) * 1e3
    return {
        "memory_ms": mem,
        "compute_ms": comp,
        "floor_ms": floor,
        "serial_floor_ms": serial,
        "serial_over_floor": serial / floor,
    }


def meta_model(preset: str) -> Any:
    """A preset's model on the meta device: its weights' shapes, no memory."""
    from draft_server.models.config import expected_shapes, parse_config
    from draft_server.models.loader import build_model
    from draft_server.models.presets import PRESETS

    cfg = parse_config(PRESETS[preset], "random")
    shapes, _ = expected_shapes(cfg)
    shapes["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    shapes["lm_head.weight"] = (cfg.draft_vocab_size, cfg.hidden_size)
    w = {name: torch.empty(s, dtype=torch.bfloat16, device="meta") for name, s in shapes.items()}
    return build_model(cfg, w, torch.device("meta"), torch.bfloat16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="draft_step_*.json files (their floors and step rows)")
    ap.add_argument("--context", type=int, default=CTX)
    ap.add_argument("--new-rows", type=int, default=NEW_ROWS)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    models: dict[str, Any] = {}
    out: dict[str, Any] = {"command": "python -m draft_tools.bench.step_floor " + " ".join(argv or sys.argv[1:])}
    for path in args.files:
        rep = json.load(open(path))
        floors = rep["floors"]
        mine = out.setdefault(path, {"machine": rep.get("machine"), "floors": floors})
        print(f"{path}: {floors['copy_bytes_per_s'] / 1e12:.2f} TB/s, {floors['bf16_flops_per_s'] / 1e12:.0f} TF/s")
        for preset in ("k3", "qwen3-8b"):
            res = rep.get(preset)
            if not isinstance(res, dict) or "steps" not in res:
                continue
            m = models.setdefault(preset, meta_model(preset))
            tap_width = m.ctx_proj.shape[1]
            for row in res["steps"]:
                n = row["sessions"]
                f = floor_ms(model_cost(m, tap_width, n, [args.context] * n, n * args.new_rows), floors)
                r = {
                    "sessions": n,
                    "fast_ms": row["fast_ms"],
                    **f,
                    "fast_over_floor": row["fast_ms"] / f["floor_ms"],
                    "fast_over_serial_floor": row["fast_ms"] / f["serial_floor_ms"],
                    "goal_1_3x_floor_over_serial_floor": 1.3 / f["serial_over_floor"],
                }
                mine.setdefault(preset, []).append(r)
                print(
                    f"  {preset:9s} B={n:3d} fast {r['fast_ms']:6.2f} ms  floor {r['floor_ms']:5.2f} "
                    f"(file {row['floor_ms']:5.2f})  serial {r['serial_floor_ms']:5.2f}  "
                    f"fast/floor {r['fast_over_floor']:.2f}  fast/serial {r['fast_over_serial_floor']:.2f}  "
                    f"1.3x floor / serial {r['goal_1_3x_floor_over_serial_floor']:.2f}"
                )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
