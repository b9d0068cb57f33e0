"""EXL3 on a CUDA GPU end to end: exllamav3's fused GEMM at K3 draft shapes, EXL3 drafters under CUDA graphs.

Owns the device smoke run of ``draft_server.models.exl3.cuda.Exl3Backend`` (``draft_tools/exl3_gpu.sh
smoke``; GPU only, exllamav3 installed, ``exllamav3_ext`` loaded or built through ``load_ext``):

1. ``linears``: K3 draft linear shapes with random trellis bits (mul1, K = 2 and 4). The backend's fused
   path (``exl3_gemm``) and dense path (cached decode, GEMM in bf16) against float64 ``x @ W`` (relative
   max error), and their median times (CUDA-synchronised, ms) beside a BF16 GEMM, at the rows a K3 step
   meets (8 per session: 8 .. 512) and at 1 and 2 rows.
2. ``tiny``: the shipped tiny EXL3 drafter (``draft_tools/tiny_pair/assets/draft_exl3_k4``) on CUDA in
   bf16 through the loader with ``DRAFT_EXL3_FUSED_MAX_ROWS`` 0 (dense), 16 and 2**20 (fused only):
   ``prepare`` captures the graphs and replays each against eager (raises on a difference); greedy
   drafts of 8 sessions are compared with the dense path's (token agreement; fp16 vs bf16 arithmetic,
   so not required to be exact).
3. ``k3``: the full-size random K3 drafter (``random:k3``), then the same model with its decoder-layer
   projections (kv_b_proj excepted: it is absorbed) and ``context_proj`` replaced by random EXL3 linears
   (K = 4, mul1) and routed (``route_linears``): step time at 1..64 sessions (1,024 context rows each)
   for BF16 and for each ``fused_max_rows``, GPU memory after load, draft agreement with the dense path.
   The EXL3 weights are random, so the numbers are speed and plumbing, not quality.

Writes one JSON (``--out``) and prints tables.

    python3 -m draft_tools.exl3_smoke --out /tmp/exl3_smoke.json [--parts linears,tiny,k3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import DSparkDrafter, load_drafter
from draft_server.models.exl3 import Exl3Linear, FusedLinear, set_backend
from draft_server.models.exl3.cuda import ENV_FUSED_MAX_ROWS, Exl3Backend, load_ext
from draft_server.models.presets import K3_FULL, random_drafter
from draft_tools.bench.draft_step_cuda import taps, time_steps
from draft_tools.bench.draft_step_gpu import timed
from draft_tools.tiny_pair import pair as tp
from protocol import GREEDY

K3_SHAPES = {  # (in, out) of the K3 draft's linears
    "q_a": (7168, 1536),
    "kv_a": (7168, 576),
    "q_b": (1536, 12288),
    "o": (8192, 7168),
    "gate/up": (7168, 14336),
    "down": (14336, 7168),
    "context_proj": (35840, 7168),
}
ROWS = (1, 2, 8, 16, 32, 64, 128, 512)
SETTINGS = (0, 16, 1 << 20)  # fused_max_rows: dense only, the default, fused only


def log(*a: object) -> None:
    print(*a, flush=True)


def random_exl3(key: str, k: int, n: int, K: int, dev: torch.device, g: torch.Generator) -> Exl3Linear:
    kp, np_ = -(-k // 128) * 128, -(-n // 128) * 128
    trellis = torch.randint(-(1 << 15), 1 << 15, (kp // 16, np_ // 16, 16 * K), generator=g, device=dev)
    sign = lambda m: (torch.randint(0, 2, (m,), generator=g, device=dev) * 2 - 1).half()  # noqa: E731
    return Exl3Linear(key, k, n, trellis.to(torch.int16), sign(kp) / kp**0.5, sign(np_), "mul1")


def ms(fn: Any) -> float:
    return round(timed(fn, 20)["median_ms"], 4)


def via(be: Exl3Backend, lin: Exl3Linear, x: torch.Tensor) -> torch.Tensor:
    """lin's product with x [rows, in] through ``be``, in x's dtype."""
    return be.outputs([lin], x)[0].to(x.dtype)


def linears(dev: torch.device, ext: Any) -> list[dict[str, Any]]:
    g = torch.Generator(device=dev).manual_seed(0)
    fused, dense = Exl3Backend(1 << 20, ext), Exl3Backend(0, ext)
    out = []
    log(f"{'linear':12s} K rows  fused ms  bf16 ms  ratio err fused err dense")
    for name, (k, n) in K3_SHAPES.items():
        for K in (2, 4) if name != "context_proj" else (4,):
            lin = random_exl3(name, k, n, K, dev, g)
            w = lin.weight(torch.bfloat16, dev)
            w64 = lin.exact_weight(torch.float64)
            for rows in ROWS:
                x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
                ref = x.double() @ w64.t()
                scale = ref.abs().max().item()
                r = {
                    "linear": name,
                    "in": k,
                    "out": n,
                    "K": K,
                    "rows": rows,
                    "fused_ms": ms(lambda: via(fused, lin, x)),  # noqa: B023
                    "bf16_ms": ms(lambda: F.linear(x, w)),  # noqa: B023
                    "fused_err": (via(fused, lin, x).double() - ref).abs().max().item() / scale,
                    "dense_err": (via(dense, lin, x).double() - ref).abs().max().item() / scale,
                }
                r["ratio"] = round(r["fused_ms"] / r["bf16_ms"], 3)
                out.append(r)
                log(
                    f"{name:12s} {K:1d} {rows:4d} {r['fused_ms']:9.4f} {r['bf16_ms']:8.4f} {r['ratio']:6.2f}"
                    f" {r['fused_err']:9.2e} {r['dense_err']:9.2e}"
                )
            lin.drop_cache()
    return out


def draft_tokens(d: DSparkDrafter, sessions: int, ctx: int, seed: int = 0) -> list[list[int]]:
    c = d.contract
    rng = np.random.default_rng(seed)
    for s in range(sessions):
        assert d.reserve(s, 0, ctx + c.block_size + 1)
        d.ingest([IngestItem(s, 0, 0, taps(rng, ctx, c.tap_width))])
    res = d.draft([DraftItem(s, 0, ctx, 11 + s, c.block_size, GREEDY) for s in range(sessions)])
    for s in range(sessions):
        d.release(s)
    return [list(r.tokens) for r in res]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def tiny(dev: torch.device, ext: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    toks = {}
    for rows in SETTINGS:
        os.environ[ENV_FUSED_MAX_ROWS] = str(rows)  # the loader installs the backend from it
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        d = load_drafter(str(tp.ASSET_DIR / "draft_exl3_k4"), str(tp.TARGET_DIR), "cuda", "bfloat16", 64 << 20)
        weights = (torch.cuda.memory_allocated(dev) - base - d.cache.data.nbytes) / 2**20
        rep = d.prepare(8, 64)  # capture + self test: every graph replayed against eager
        toks[rows] = draft_tokens(d, 8, 40)
        out[str(rows)] = {"prepare": rep, "weights_mib": round(weights, 3)}
        d.close()
    for rows in SETTINGS[1:]:
        out[str(rows)]["agreement_with_dense"] = agreement(toks[rows], toks[0])
    log("tiny EXL3 drafter (bf16, CUDA graphs):", json.dumps(out))
    return out


def k3_exl3(d: DSparkDrafter, dev: torch.device) -> None:
    """Random EXL3 linears (K = 4, mul1) for the quantizable GEMM sites of a K3 model, routed."""
    m, g = d.model, torch.Generator(device=dev).manual_seed(1)
    sa = "layers.{}.self_attn."
    lin: dict[str, Any] = {"context_proj.weight": random_exl3("context_proj", *K3_SHAPES["context_proj"], 4, dev, g)}
    for i in range(m.cfg.num_layers):
        p, a = f"layers.{i}.", sa.format(i)
        mk = lambda name, shape: random_exl3(name, *shape, 4, dev, g)  # noqa: E731
        lin[a + "fused_qkv_a_proj.weight"] = FusedLinear(
            a + "fused_qkv_a_proj", [mk(a + "q_a_proj", K3_SHAPES["q_a"]), mk(a + "kv_a_proj_with_mqa", (7168, 576))]
        )
        lin[a + "q_b_proj.weight"] = mk(a + "q_b_proj", K3_SHAPES["q_b"])
        lin[a + "o_proj.weight"] = mk(a + "o_proj", K3_SHAPES["o"])
        lin[p + "mlp.gate_up_proj.weight"] = FusedLinear(
            p + "mlp.gate_up_proj",
            [mk(p + "mlp.gate_proj", K3_SHAPES["gate/up"]), mk(p + "mlp.up_proj", K3_SHAPES["gate/up"])],
        )
        lin[p + "mlp.down_proj.weight"] = mk(p + "mlp.down_proj", K3_SHAPES["down"])
    m.linears = lin
    m.route_linears()


def k3(dev: torch.device, ext: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sessions = (1, 2, 4, 8, 16, 32, 64)
    kv = 2 << 30

    def run(label: str, d: DSparkDrafter, base: int) -> list[list[int]]:
        weights = (torch.cuda.memory_allocated(dev) - base - d.cache.data.nbytes) / 2**30
        d.prepare(64, 1024)
        toks = draft_tokens(d, 8, 256)
        steps = [time_steps(d, n, 1024, 20) for n in sessions]
        out[label] = {"weights_gib": round(weights, 3), "steps": steps}
        log(
            f"k3 {label:10s} weights {weights:6.2f} GiB  draft ms "
            + " ".join(f"{s['draft_ms_median']:.2f}" for s in steps)
        )
        return toks

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    dense = random_drafter(K3_FULL, dev, kv)
    bf16 = run("bf16", dense, base)
    dense.close()
    del dense
    toks = {}
    for rows in SETTINGS:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        set_backend(Exl3Backend(rows, ext))
        d = random_drafter(K3_FULL, dev, kv)
        k3_exl3(d, dev)
        torch.cuda.empty_cache()
        toks[rows] = run(f"exl3@{rows}", d, base)
        d.close()
    for rows in SETTINGS[1:]:
        out[f"exl3@{rows}"]["agreement_with_dense"] = agreement(toks[rows], toks[0])
    out["bf16_vs_exl3_dense_agreement"] = agreement(bf16, toks[0])  # different weights: only a sanity number
    log(f"k3 sessions {sessions}")
    for label, r in out.items():
        if isinstance(r, dict) and "steps" in r and label != "bf16":
            ratios = [
                s["draft_ms_median"] / b["draft_ms_median"]
                for s, b in zip(r["steps"], out["bf16"]["steps"], strict=True)
            ]
            r["ratio_vs_bf16"] = [round(x, 3) for x in ratios]
            log(f"k3 {label:10s} / bf16 " + " ".join(f"{x:.2f}" for x in ratios))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_tools.exl3_smoke", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="linears,tiny,k3")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("exl3_smoke needs a CUDA GPU")
    dev = torch.device("cuda:0")
    ext = load_ext(log)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    parts = {"linears": linears, "tiny": tiny, "k3": k3}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        with torch.inference_mode():
            try:
                res[part] = parts[part](dev, ext)
            except Exception as e:  # one part failing still leaves the others' results
                res[part] = {"error": f"{type(e).__name__}: {e}"}
                log(f"{part} FAILED: {type(e).__name__}: {e}")
        res[f"{part}_s"] = round(time.perf_counter() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if not any(isinstance(v, dict) and "error" in v for v in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
