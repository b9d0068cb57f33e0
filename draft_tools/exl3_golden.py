"""Golden EXL3 fixtures from exllamav3 itself, for the CPU decoder's bit-exact tests. GPU only.

Owns the one-off job that pins ``draft_server.models.exl3.decode`` to exllamav3: on a CUDA machine
with exllamav3 importable (its extension JIT-built, ``TORCH_CUDA_ARCH_LIST=9.0`` on an H200), it
writes ``tests/fixtures/exl3/gpu_<codebook>_k<K>_<in>x<out>[_<what>].safetensors``, each holding

- ``trellis`` int16, ``suh``/``svh`` fp16 and the codebook marker (``mcg``/``mul1``) as stored;
- ``inner``: ``LinearEXL3.get_inner_weight_tensor()`` (fp16 ``Wq``, the CUDA ``reconstruct``);
- ``weight``: ``LinearEXL3.get_weight_tensor()`` (fp16 ``(in, out)``);
- ``x`` fp16 ``[rows, in]`` and ``y_gemm``: ``exllamav3_ext.exl3_gemm`` output (fp16, ``EXL3_INT8_GEMV=0``),
  ``y_forward``: ``LinearEXL3.forward`` at the same rows (the run_alloc path);

with safetensors metadata ``source=exllamav3-gpu``, the exllamav3 version, codebook, K and device.
Two kinds of trellis: random bits (every state reachable, all codebooks, K = 1..8) and, when the
internal quantizer API is as expected, ``quantize_exl3`` of a random weight (uncalibrated fallback).
``--checkpoint DIR`` also decodes every EXL3 module of a checkpoint (e.g. the shipped tiny EXL3 drafter)
into ``gpu_ckpt_<module>.safetensors`` (``trellis``, ``suh``, ``svh``, marker, ``inner``, ``weight``).

The CPU tests (``tests/numerics/test_exl3_golden.py``) pick these files up: ``inner`` must match
bit for bit, ``weight`` and the GEMM outputs within fp16 tolerance.

    EXL3_INT8_GEMV=0 TORCH_CUDA_ARCH_LIST=9.0 python -m draft_tools.exl3_golden [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "exl3"
SHAPES = ((128, 256), (256, 128), (512, 384))
ROWS = 7
MULT = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_tools.exl3_golden", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT), help=f"fixture directory (default {OUT})")
    ap.add_argument("--checkpoint", default="", help="also decode every EXL3 module of this checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ["EXL3_INT8_GEMV"] = "0"  # before exllamav3 reads it: the int8-activation GEMV is not parity
    import torch
    from safetensors.torch import load_file, save_file

    if not torch.cuda.is_available():
        raise SystemExit("exl3_golden needs a CUDA GPU with exllamav3 (its kernels are CUDA only)")
    import exllamav3
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.quant.exl3 import LinearEXL3

    dev = torch.device("cuda:0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta_base = {
        "source": "exllamav3-gpu",
        "exllamav3": str(getattr(exllamav3, "__version__", "?")),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev),
    }
    g = torch.Generator(device="cpu").manual_seed(args.seed)

    def marker(cb: str) -> torch.Tensor | None:
        if cb == "3inst":
            return None
        return torch.tensor(MULT[cb], dtype=torch.uint32).view(torch.int32)

    def dump(name: str, k: int, n: int, cb: str, suh, svh, trellis, with_gemm: bool = True, **extra) -> None:
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
        t = {
            "trellis": trellis.cpu(),
            "suh": suh.cpu(),
            "svh": svh.cpu(),
            "inner": lin.get_inner_weight_tensor().cpu(),
            "weight": lin.get_weight_tensor().cpu(),
            **{key: v.cpu() for key, v in extra.items()},
        }
        if mk is not None:
            t[cb] = mk
        if with_gemm:
            x = (torch.randn((ROWS, k), generator=g) * 0.5).half().to(dev)
            y = torch.zeros((ROWS, n), dtype=torch.half, device=dev)
            ext.exl3_gemm(x, lin.trellis, y, lin.suh, torch.empty_like(x), lin.svh, -1, cb == "mcg", cb == "mul1", 0)
            t.update(x=x.cpu(), y_gemm=y.cpu(), y_forward=lin.forward(x, {}).cpu())
        torch.cuda.synchronize()
        meta = {**meta_base, "codebook": cb, "K": str(trellis.shape[-1] // 16), "in": str(k), "out": str(n)}
        save_file({key: v.contiguous() for key, v in t.items()}, str(out / f"{name}.safetensors"), metadata=meta)
        print(f"wrote {out / name}.safetensors")

    for cb in ("3inst", "mcg", "mul1"):
        for K in range(1, 9):
            for k, n in SHAPES:
                if K not in (2, 4) and (k, n) != SHAPES[0]:
                    continue
                trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32)
                suh = ((torch.randint(0, 2, (k,), generator=g) * 2 - 1) * (0.5 + torch.rand(k, generator=g))) / k**0.5
                svh = (torch.randint(0, 2, (n,), generator=g) * 2 - 1) * (0.5 + torch.rand(n, generator=g))
                dump(f"gpu_{cb}_k{K}_{k}x{n}", k, n, cb, suh.half(), svh.half(), trellis.to(torch.int16))

    try:  # the real quantizer on a random weight (internal API: skipped with a note if it moved)
        from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3

        for cb in ("mcg", "mul1"):
            for K in (2, 4):
                k, n = 256, 384
                w = torch.randn((k, n), generator=g) / k**0.5
                h_data = {"H": torch.empty((k, k), device="meta"), "device": dev, "L": None, "count": 0}
                q_args = {"K": K, "seed": args.seed, "devices": [0], "apply_out_scales": None, cb: True}
                _, _, q = quantize_exl3(w.to(dev), h_data, q_args, return_weight_q=False)
                dump(f"gpu_{cb}_k{K}_{k}x{n}_quantized", k, n, cb, q["suh"], q["svh"], q["trellis"], original=w)
    except Exception as e:
        print(f"quantize_exl3 fixtures skipped: {type(e).__name__}: {e}")

    if args.checkpoint:
        import glob

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(args.checkpoint, "*.safetensors"))):
            tensors.update(load_file(f))
        for tname in sorted(n for n in tensors if n.endswith(".trellis")):
            mod = tname[: -len(".trellis")]
            tr = tensors[tname]
            cb = "mcg" if f"{mod}.mcg" in tensors else "mul1" if f"{mod}.mul1" in tensors else "3inst"
            safe = re.sub(r"[^A-Za-z0-9_]+", "_", mod)
            k, n = tr.shape[0] * 16, tr.shape[1] * 16
            dump(f"gpu_ckpt_{safe}", k, n, cb, tensors[f"{mod}.suh"], tensors[f"{mod}.svh"], tr, with_gemm=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
