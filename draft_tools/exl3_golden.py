"""Golden EXL3 fixtures from exllamav3 1.6.5 itself, for the CPU decoder's bit-exact tests. GPU only.

Owns the one-off job that pins ``draft_server.models.exl3.decode`` to exllamav3, and its report. On a
CUDA machine with the ``exllamav3`` package installed (``draft_tools/exl3_gpu.sh`` installs it from
``.whl/`` and runs this), it gets ``exllamav3_ext`` through ``draft_server.models.exl3.cuda.load_ext``
(prebuilt, or only the extension JIT-built, registered so ``import exllamav3`` reuses it), then writes
``gpu_<codebook>_k<K>_<in>x<out>[_<what>].safetensors`` into ``--out``, each holding

- ``trellis`` int16, ``suh``/``svh`` fp16 and the codebook marker (``mcg``/``mul1``) as stored;
- metadata ``inner_sha256``: sha256 of ``LinearEXL3.get_inner_weight_tensor()`` (fp16 ``Wq``, CUDA
  ``reconstruct``: the bit-exact check needs no tensor), and for small shapes (k * n <= 32768)
  ``weight``: ``get_weight_tensor()``, fp16 ``(in, out)`` (the committed fixtures stay a few MB);
- ``x`` fp16 ``[7, in]``; ``y_gemm`` / ``y_gemm_fp32``: ``exllamav3_ext.exl3_gemm(x, trellis, y, suh,
  A_had, svh, -1, mcg, mul1, 0)`` with fp16 / fp32 output (``EXL3_INT8_GEMV=0``, as ``Exl3Backend``
  calls it); ``y_forward``: ``LinearEXL3.forward(x, {})`` (7 rows: the ``BC_LinearEXL3.run_alloc`` path);
- quantizer fixtures (``_quantized``, ``_calibrated``): ``quantize_exl3(weight (in, out) fp32, H_data,
  quant_args, return_weight_q=True)`` with ``H_data`` as ``Linear.init_H_data`` makes it (uncalibrated:
  meta H; calibrated: ``X^T X`` of random rows), plus ``weight_q`` (the quantizer's own dequantized
  weight, fp16);

with safetensors metadata ``source=exllamav3-gpu``, the exllamav3 version, codebook, K, in, out, device.
``--checkpoint DIR`` also dumps every EXL3 module of a checkpoint (``gpu_ckpt_<module>``). Each file is
compared with our decoder right away (``compare``) and a table is printed: ``inner`` bit-exact, the
relative max error of ``weight`` and of the GEMM outputs. ``tests/numerics/test_exl3_golden.py`` makes
the same comparison on the committed files.

    EXL3_INT8_GEMV=0 TORCH_CUDA_ARCH_LIST=9.0 python -m draft_tools.exl3_golden --out DIR [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch

from draft_server.models.exl3.decode import MCG_MULT, MUL1_MULT, dense_weight, weight_fp16_like_exllamav3
from draft_server.models.exl3.linear import Exl3Linear

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "exl3"
SHAPES = ((128, 256), (256, 128), (512, 384))
ROWS = 7
SMALL = 128 * 256  # k * n up to which get_weight_tensor() is stored
MULT = {"mcg": MCG_MULT, "mul1": MUL1_MULT}
Y_KEYS = ("y_gemm", "y_gemm_fp32", "y_forward")


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()


def compare(path: Any, meta: dict[str, str], t: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One fixture against our decoder: ``inner`` exact?, relative max errors of ``weight``, the GEMM
    outputs and (quantizer fixtures) ``weight_q``."""
    cb, k, n = meta["codebook"], int(meta["in"]), int(meta["out"])
    lin = Exl3Linear(path.stem, k, n, t["trellis"], t["suh"], t["svh"], cb)
    inner = lin.inner()
    exact = [torch.equal(inner.view(torch.int16), t["inner"].view(torch.int16))] if "inner" in t else []
    exact += [sha256(inner) == meta["inner_sha256"]] if "inner_sha256" in meta else []
    row: dict[str, Any] = {
        "name": path.stem,
        "codebook": cb,
        "K": lin.K,
        "marker": cb not in t or t[cb].view(torch.int32).item() & 0xFFFFFFFF == MULT[cb],
        "inner": ("exact" if all(exact) else "DIFF") if exact else "-",
    }
    w = dense_weight(inner, lin.suh, lin.svh)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)

    if "weight" in t:  # get_weight_tensor: fp32 Hadamards (GPU summation order) rounded to fp16
        row["weight_err"] = rel(weight_fp16_like_exllamav3(inner, lin.suh, lin.svh), t["weight"])
    if "weight_q" in t:
        row["weight_q_err"] = rel(w, t["weight_q"])
    if "x" in t:
        y = t["x"].double() @ w
        row["y_err"] = max(rel(t[key], y) for key in Y_KEYS if key in t)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_tools.exl3_golden", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT), help=f"fixture directory (default {OUT})")
    ap.add_argument("--checkpoint", default="", help="also dump every EXL3 module of this checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("exl3_golden needs a CUDA GPU (exllamav3's kernels are CUDA only)")
    from safetensors.torch import load_file, save_file

    from draft_server.models.exl3.cuda import load_ext

    ext = load_ext()  # sets EXL3_INT8_GEMV=0 before any kernel runs
    import exllamav3  # noqa: F401 - uses the registered extension (exllamav3/ext.py: "precompiled")
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3
    from exllamav3.version import __version__ as version

    dev = torch.device("cuda:0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta_base = {
        "source": "exllamav3-gpu",
        "exllamav3": str(version),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev),
    }
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    rows: list[dict[str, Any]] = []

    def marker(cb: str) -> torch.Tensor | None:
        return None if cb == "3inst" else torch.tensor(MULT[cb], dtype=torch.uint32).view(torch.int32)

    def dump(name: str, k: int, n: int, cb: str, suh, svh, trellis, **extra: torch.Tensor) -> None:
        mk = marker(cb)
        lin = LinearEXL3(
            None,
            k,
            n,
            suh=suh.to(dev),
            svh=svh.to(dev),
            trellis=trellis.to(dev),
            mcg=mk.to(dev) if cb == "mcg" else None,
            mul1=mk.to(dev) if cb == "mul1" else None,
            out_dtype=torch.half,
        )
        inner = lin.get_inner_weight_tensor()
        t = {"trellis": trellis.cpu(), "suh": suh.cpu(), "svh": svh.cpu(), **{a: v.cpu() for a, v in extra.items()}}
        if k * n <= SMALL:
            t["weight"] = lin.get_weight_tensor().cpu()
        if mk is not None:
            t[cb] = mk
        x = (torch.randn((ROWS, k), generator=g) * 0.5).half().to(dev)
        mcg, mul1 = cb == "mcg", cb == "mul1"
        for key, dtype in (("y_gemm", torch.half), ("y_gemm_fp32", torch.float)):
            y = torch.zeros((ROWS, n), dtype=dtype, device=dev)
            ext.exl3_gemm(x, lin.trellis, y, lin.suh, torch.empty_like(x), lin.svh, -1, mcg, mul1, 0)
            t[key] = y.cpu()
        t.update(x=x.cpu(), y_forward=lin.forward(x, {}).cpu())
        torch.cuda.synchronize()
        meta = {
            **meta_base,
            "codebook": cb,
            "K": str(trellis.shape[-1] // 16),
            "in": str(k),
            "out": str(n),
            "inner_sha256": sha256(inner),
        }
        path = out / f"{name}.safetensors"
        save_file({a: v.contiguous() for a, v in t.items()}, str(path), metadata=meta)
        rows.append(compare(path, meta, t))

    for cb in ("3inst", "mcg", "mul1"):
        for K in range(1, 9):
            for k, n in SHAPES:
                if K not in (2, 4) and (k, n) != SHAPES[0]:
                    continue
                trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32)
                suh = ((torch.randint(0, 2, (k,), generator=g) * 2 - 1) * (0.5 + torch.rand(k, generator=g))) / k**0.5
                svh = (torch.randint(0, 2, (n,), generator=g) * 2 - 1) * (0.5 + torch.rand(n, generator=g))
                dump(f"gpu_{cb}_k{K}_{k}x{n}", k, n, cb, suh.half(), svh.half(), trellis.to(torch.int16))

    # exllamav3's own quantizer on a random weight (internal API, 1.6.5 signatures): uncalibrated (meta H,
    # Linear.init_H_data(False)) and calibrated (X^T X of random rows: LDLQ and the scale refit)
    k, n = 256, 384
    for cb in ("mcg", "mul1"):
        for K, calibrated in ((2, False), (4, False), (4, True)):
            w = torch.randn((k, n), generator=g) / k**0.5
            h: dict[str, Any] = {
                "H": torch.zeros(k, k, dtype=torch.float32, device="meta"),
                "packed": False,
                "n": k,
                "first_key": f"golden.{cb}.{K}",
                "count": 0,
                "finalized": False,
                "num_total": 0,
                "inf_nan": torch.zeros(2, dtype=torch.long, device=dev),
                "device": dev,
            }
            if calibrated:
                xs = torch.randn((4096, k), generator=g).to(dev)
                h.update(H=xs.t() @ xs, count=xs.shape[0], num_total=xs.numel())
            q_args = {"K": K, "seed": args.seed, "devices": [0], "apply_out_scales": None, cb: True}
            weight_q, _, q = quantize_exl3(w.to(dev), h, q_args, True)
            what = "calibrated" if calibrated else "quantized"
            dump(f"gpu_{cb}_k{K}_{k}x{n}_{what}", k, n, cb, q["suh"], q["svh"], q["trellis"], weight_q=weight_q.half())

    if args.checkpoint:
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(args.checkpoint, "*.safetensors"))):
            tensors.update(load_file(f))
        for tname in sorted(a for a in tensors if a.endswith(".trellis")):
            mod = tname[: -len(".trellis")]
            tr = tensors[tname]
            cb = "mcg" if f"{mod}.mcg" in tensors else "mul1" if f"{mod}.mul1" in tensors else "3inst"
            safe = re.sub(r"[^A-Za-z0-9_]+", "_", mod)
            dump(
                f"gpu_ckpt_{safe}",
                tr.shape[0] * 16,
                tr.shape[1] * 16,
                cb,
                tensors[f"{mod}.suh"],
                tensors[f"{mod}.svh"],
                tr,
            )

    print(f"{'fixture':44s} {'cb':5s} {'K':>2s} {'inner':6s} {'weight':>9s} {'y':>9s} {'weight_q':>9s}")
    for r in rows:
        cells = [f"{r[c]:9.2e}" if c in r else f"{'-':>9s}" for c in ("weight_err", "y_err", "weight_q_err")]
        print(f"{r['name']:44s} {r['codebook']:5s} {r['K']:2d} {r['inner']:6s} {' '.join(cells)}")
    bad = [r["name"] for r in rows if r["inner"] == "DIFF" or not r["marker"]]
    print(
        f"{len(rows)} fixtures in {out}; inner bit-exact: {len(rows) - len(bad)}/{len(rows)}"
        + (f"; DIFF: {bad}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
