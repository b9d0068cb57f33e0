"""BF16 vs EXL3 drafters on one GPU, all in one run: issue 13's must-show 3 (GPU only, exllamav3 installed).

Owns the K3-size comparison and the GPU side of ``draft-server quantize``:

1. ``tiny``: ``draft-server quantize --bits 4`` (exllamav3's quantizer) on the shipped tiny drafter,
   written to ``--tiny-out`` (a tarball under ``$OUT`` when run by ``draft_tools/exl3_gpu.sh``); the
   quantized drafter loaded through the normal loader on CUDA, greedy drafts against BF16 (agreement).
2. ``k3``: the full-size random K3 drafter (``random:k3``, seeded) in BF16, then for each ``--bits``
   its decoder-layer linears (``convert.DEFAULT_MODULES``, what ``quantize`` converts) quantized by
   exllamav3 (uncalibrated) and attached as the loader attaches them (``attach_linears``,
   ``route_linears``), for each large-batch path (``recon``: decode into a scratch per call;
   ``inline``: the Triton decode-GEMM, packed bytes only; ``dense``: decoded once and cached; tuned
   settings time fused, recon and inline per shape and rows, ``path_ms``). Per setting: quantization
   time, weight bytes held (the draft's own; K3 takes embedding and lm_head from the target, so they
   are left out on both sides), CUDA-graph step time at B = 1..64 (1,024 context rows, 3 new rows +
   a block per step, graphs captured after the autotuner has seen every bucket: ``prepare``), greedy
   agreement with BF16 on
   8 sessions, and the step-time ratio to BF16. ``--tie-layers`` (default): layers 1.. hold copies of layer
   0's random values, so a bit width quantizes one layer and copies its tensors (the step's shapes, bytes
   and time are those of five distinct layers; quantization takes a third of the time).

Writes one JSON (``--out``) as it goes and prints tables.

    python3 -m draft_tools.bench.exl3_h200 --out /tmp/exl3_h200.json [--bits 2,3,4,5] [--parts tiny,k3]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import tarfile
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.config import parse_config
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.exl3 import Exl3Linear, set_backend
from draft_server.models.exl3.checkpoint import attach_linears
from draft_server.models.exl3.convert import DEFAULT_MODULES, exllamav3_encoder, quantize_main
from draft_server.models.exl3.cuda import LARGE_PATHS, Exl3Backend, load_ext
from draft_server.models.exl3.linear import DequantBackend
from draft_server.models.loader import build_model
from draft_server.models.presets import K3_FULL, random_weights
from draft_tools.bench.draft_step_cuda import taps, time_steps
from draft_tools.bench.draft_step_gpu import profile_counts
from draft_tools.exl3_smoke import agreement, draft_tokens
from draft_tools.tiny_pair import pair as tp
from protocol import GREEDY

SESSIONS = (1, 2, 4, 8, 16, 32, 64)
CTX = 1024
KV = 2 << 30
SHARED = ("embed_tokens.weight", "lm_head.weight")  # K3: the target's, not the draft's
TIED = re.compile(r"^layers\.\d+\.")


def log(*a: object) -> None:
    print(*a, flush=True)


def nbytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def tiny(dev: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    src, out = str(tp.ASSET_DIR / "draft"), "/tmp/draft_exl3_k4_exllamav3"
    t0 = time.perf_counter()
    rc = quantize_main(["--bits", "4", "--model", src, "--out", out, "--device", str(dev)])
    res: dict[str, Any] = {"quantize_rc": rc, "quantize_s": round(time.perf_counter() - t0, 1)}
    if rc:
        return res
    if args.tiny_out:
        with tarfile.open(args.tiny_out, "w:gz") as tar:
            tar.add(out, arcname="draft_exl3_k4_exllamav3")
    toks = {}
    for name, d_dir in (("bf16", src), ("exl3_k4", out), ("exl3_k4_cpu_encoder", str(tp.ASSET_DIR / "draft_exl3_k4"))):
        d = load_drafter(d_dir, str(tp.TARGET_DIR), "cuda", "bfloat16", 64 << 20)
        res[f"{name}_weights"] = dataclasses.asdict(d.model.weight_info)
        d.prepare(8, 64)
        toks[name] = draft_tokens(d, 8, 40)
        d.close()
        set_backend(DequantBackend())
    res["agreement_exl3_k4_vs_bf16"] = agreement(toks["exl3_k4"], toks["bf16"])
    res["agreement_cpu_encoder_vs_bf16"] = agreement(toks["exl3_k4_cpu_encoder"], toks["bf16"])
    log("tiny:", json.dumps(res, default=str))
    return res


def draft_profile(d: DSparkDrafter, sessions: int) -> dict[str, Any]:
    """Kernels, host syncs and GPU-busy ms of one CUDA-graph draft step of ``sessions`` x CTX rows."""
    c = d.contract
    chunk = taps(np.random.default_rng(1), 512, c.tap_width)
    for s in range(sessions):
        assert d.reserve(s, 0, CTX + c.block_size + 1)
        for a in range(0, CTX, 512):
            d.ingest([IngestItem(s, 0, a, chunk)])
    items = [DraftItem(s, 0, CTX, 11, c.block_size, GREEDY) for s in range(sessions)]
    rows = [IngestItem(s, 0, CTX - 3, chunk[:3]) for s in range(sessions)]  # rewrites the last 3 rows
    try:
        return {"draft": profile_counts(lambda: d.draft(items)), "ingest": profile_counts(lambda: d.ingest(rows))}
    except Exception as e:  # the profiler is a measurement aid, not the measurement
        return {"error": repr(e)}
    finally:
        for s in range(sessions):
            d.release(s)


def paths_by_rows(be: Exl3Backend) -> dict[str, dict[str, int]]:
    """Tuned backend: per row count, how many linear shapes took each path."""
    out: dict[str, dict[str, int]] = {}
    for key, path in sorted(be.choice.items(), key=lambda kv: kv[0][4]):
        row = out.setdefault(str(key[4]), {})
        row[path] = row.get(path, 0) + 1
    return out


def path_ms(be: Exl3Backend) -> dict[str, dict[str, float]]:
    """Tuned backend: each (in x out, K, rows)'s timed ms per path, and the paths that failed."""
    out: dict[str, dict[str, float]] = {
        f"{k[0]}x{k[1]}_K{k[2]}_r{k[4]}": {p: round(v, 4) for p, v in t.items()} for k, t in sorted(be.timings.items())
    }
    return {**out, **({"failed": be.failed} if be.failed else {})}


def k3(dev: torch.device, args: argparse.Namespace, res: dict[str, Any], save: Any) -> dict[str, Any]:
    ext = load_ext(log)
    out: dict[str, Any] = res.setdefault("k3", {"sessions": list(SESSIONS), "context_rows": CTX})
    cfg = parse_config(K3_FULL, "random")
    w = random_weights(K3_FULL, dev)
    if args.tie_layers:  # every layer holds layer 0's values (separate copies): one layer to quantize per K
        for n in [n for n in w if TIED.match(n) and not n.startswith("layers.0.")]:
            w[n] = w[TIED.sub("layers.0.", n)].clone()
    out["tie_layers"] = args.tie_layers
    own = {n: t for n, t in w.items() if n not in SHARED}
    out["bf16_weight_bytes"] = nbytes(own.values())

    def run(label: str, model: Any, keep: bool = False) -> tuple[list[list[int]], DSparkDrafter | None]:
        t0 = time.perf_counter()
        d = DSparkDrafter(model, kv_budget_bytes=KV)
        # every bucket eagerly (tunes exl3_gemm and the per-shape path, sizes the recon scratch), then capture
        prep = d.prepare(64, CTX)
        toks = draft_tokens(d, 8, 256)
        steps = [time_steps(d, n, CTX, 10, warmup=3) for n in SESSIONS]
        out[label] = {
            **out.get(label, {}),
            "prepare": prep,
            "run_s": round(time.perf_counter() - t0, 1),
            "steps": steps,
            "profile": {f"B{n}": draft_profile(d, n) for n in (1, 16, 64)},
            "gpu_mem_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        }
        log(
            f"k3 {label:20s} draft ms "
            + " ".join(f"{s['draft_ms_median']:7.3f}" for s in steps)
            + f"  ({time.perf_counter() - t0:.0f} s)"
        )
        if keep:
            return toks, d
        d.close()
        return toks, None

    # 1. quantize every bit width (GPU-heavy minutes), so that all timing below runs back to back
    pat = re.compile(args.modules)
    names = [n for n in sorted(own) if n.endswith(".weight") and own[n].dim() == 2 and pat.search(n[: -len(".weight")])]
    packed: dict[tuple[int, str], dict[str, Exl3Linear]] = {}
    meta: dict[tuple[int, str], dict[str, Any]] = {}
    for bits, cb in itertools.product([int(b) for b in args.bits.split(",")], args.codebook.split(",")):
        encode, version = exllamav3_encoder(bits, cb, dev)
        t0 = time.perf_counter()
        lins: dict[str, Exl3Linear] = {}
        for i, n in enumerate(names):
            src = TIED.sub("layers.0.", n) if args.tie_layers else n
            if src != n and src in lins:  # the same values as layer 0: its quantized tensors, copied
                q = {t: getattr(lins[src], t).clone() for t in ("trellis", "suh", "svh")}
            else:
                q = encode(own[n].float(), i)
            o, k = own[n].shape
            lins[n] = Exl3Linear(
                n[: -len(".weight")], k, o, q["trellis"].to(dev), q["suh"].to(dev), q["svh"].to(dev), cb
            )
        quant_s = time.perf_counter() - t0
        dense = {n: t for n, t in own.items() if n not in lins}
        stored = nbytes(dense.values()) + sum(lin.stored_bytes() for lin in lins.values())
        packed[bits, cb] = lins
        meta[bits, cb] = {
            "bits": bits,
            "codebook": cb,
            "quantize_s": round(quant_s, 1),
            "version": version,
            "weight_bytes": stored,
            "weight_ratio_vs_bf16": round(stored / out["bf16_weight_bytes"], 4),
        }
        log(
            f"k3 K={bits} {cb}: {len(lins)} linears quantized in {quant_s:.1f} s; weights {stored / 2**30:.2f} GiB"
            f" ({stored / out['bf16_weight_bytes']:.3f} x BF16)"
        )

    # 2. BF16, every EXL3 setting, BF16 again (the bracket shows any drift of the GPU's clocks over the run)
    bf16, keep = run("bf16", build_model(cfg, dict(w), dev, torch.bfloat16), keep=True)
    save()
    for (bits, cb), lins in packed.items():
        given = {**w, **{n: lin.exact_weight(torch.bfloat16) for n, lin in lins.items()}}  # kv_b is absorbed dense
        for rows in args.fused_max_rows.split(","):
            larges = LARGE_PATHS if str(bits) in args.both_paths.split(",") else ("recon",)
            for large in args.large.split(",") if args.large else larges:
                if rows == "tuned" and large == "inline":  # tuned recon already times inline
                    continue
                label = f"exl3_k{bits}{'' if cb == 'mul1' else '_' + cb}_{large}" + (
                    "" if rows == "tuned" else f"_f{rows}"
                )
                out[label] = {**meta[bits, cb], "fused_max_rows": rows, "large": large}
                be = Exl3Backend(None if rows == "tuned" else int(rows), ext, large)
                set_backend(be)
                model = build_model(cfg, dict(given), dev, torch.bfloat16)
                info = SimpleNamespace(linears=lins, info=SimpleNamespace(quant={"bits": bits}))
                attach_linears(model, info, given)
                model.route_linears()
                toks, _ = run(label, model)
                del model
                for lin in lins.values():
                    lin.drop_cache()
                r = out[label]
                r["paths_by_rows"] = paths_by_rows(be)
                r["path_ms"] = path_ms(be)
                r["agreement_with_bf16"] = round(agreement(toks, bf16), 4)
                r["ratio_vs_bf16"] = [
                    round(s["draft_ms_median"] / b["draft_ms_median"], 3)
                    for s, b in zip(r["steps"], out["bf16"]["steps"], strict=True)
                ]
                log(
                    f"k3 {label:20s} / bf16  "
                    + " ".join(f"{x:7.3f}" for x in r["ratio_vs_bf16"])
                    + f"  agreement {r['agreement_with_bf16']:.3f}"
                )
                save()
        del given
        torch.cuda.empty_cache()
    assert keep is not None
    out["bf16_end"] = {"steps": [time_steps(keep, n, CTX, 10, warmup=3) for n in SESSIONS]}
    again = " ".join(f"{s['draft_ms_median']:7.3f}" for s in out["bf16_end"]["steps"])
    log(f"k3 {'bf16 (again, last)':20s} draft ms {again}")
    keep.close()
    set_backend(DequantBackend())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_tools.bench.exl3_h200", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="tiny,k3")
    ap.add_argument("--bits", default="4,2,3,5")
    ap.add_argument("--both-paths", default="4", help="bit widths also timed with the cached dense large path")
    ap.add_argument(
        "--tie-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="layers 1.. copy layer 0's random values, so each bit width quantizes one layer (timing is unchanged)",
    )
    ap.add_argument("--codebook", default="mul1", help="EXL3 codebooks to quantize with (comma list)")
    ap.add_argument("--large", default="", help="large paths to time (comma list), instead of --both-paths' choice")
    ap.add_argument(
        "--fused-max-rows", default="tuned", help="settings to time: 'tuned' (per shape and rows), fixed thresholds"
    )
    ap.add_argument("--modules", default=DEFAULT_MODULES)
    ap.add_argument("--tiny-out", default=os.path.join(os.environ.get("OUT", "/tmp"), "tiny_exl3_k4.tar.gz"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("exl3_h200 needs a CUDA GPU")
    dev = torch.device("cuda:0")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "command": "python3 -m draft_tools.bench.exl3_h200 " + " ".join(argv if argv is not None else sys.argv[1:]),
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    rc = 0
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                if part == "tiny":
                    res["tiny"] = tiny(dev, args)
                else:
                    k3(dev, args, res, save)
        except Exception as e:  # one part failing leaves the other's results
            import traceback

            traceback.print_exc()
            res[f"{part}_error"] = f"{type(e).__name__}: {e}"
            rc = 1
        res[f"{part}_s"] = round(time.perf_counter() - t0, 1)
        save()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
