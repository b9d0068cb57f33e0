"""Dense DSpark checkpoint -> EXL3 checkpoint: ``draft-server quantize``.

Owns the checkpoint writer (exllamav3's tensor names, ``config.json`` ``quantization_config``,
``quantization_config.json`` ``tensor_storage``) and the GPU encoder behind the command, which is
exllamav3's own quantizer (``quantize_exl3``, 1.6.5 signatures). The writer takes any per-linear
encoder, so the CPU stand-in of ``draft_tools.exl3_cpu`` (no GPU, used for the shipped tiny drafter
and the loader's tests) writes the same layout.

The conversion is uncalibrated: a DSpark draft's inputs are the target's tap hidden states, which a
draft checkpoint alone cannot produce, so every linear takes exllamav3's no-Hessian path (meta H:
sign flips, Hadamards, regularised scales, trellis search; no LDLQ error feedback). The quality
that costs is measured, not assumed: ``draft_tools/bench/exl3_h200.py`` (greedy agreement with BF16
per bit width) and ``make demo`` (acceptance in vLLM on the tiny pair).

    draft-server quantize --bits 4 [--codebook mul1|mcg|3inst] --model BF16_DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from draft_server.models.exl3.decode import MCG_MULT, MUL1_MULT
from draft_server.models.exl3.linear import pad128

# the draft's linears a conversion quantizes by default: every decoder-layer projection
DEFAULT_MODULES = r"^layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj(_with_mqa)?$"
CODEBOOKS = ("mul1", "mcg", "3inst")

# weight [out, in] (float), seed -> exllamav3's tensors for it (trellis, suh, svh, codebook marker)
Encoder = Callable[[torch.Tensor, int], dict[str, torch.Tensor]]


def read_dense(model_dir: str, keys_only: bool = False) -> dict[str, torch.Tensor | None]:
    """Every tensor of the checkpoint's safetensors files by name (``keys_only``: the names, no data)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor | None] = {}
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"{model_dir}: no .safetensors files")
    for name in names:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for k in f.keys():
                out[k] = None if keys_only else f.get_tensor(k)
    return out


def _rename(name: str, prefix: str, offset: int) -> str:
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if m and offset:
        name = f"layers.{int(m.group(1)) + offset}.{m.group(2)}"
    return prefix + name


def write_checkpoint(
    src: str,
    out: str,
    encode: Encoder,
    bits: int,
    codebook: str,
    version: str,
    modules: str = DEFAULT_MODULES,
    seed: int = 0,
    tensor_prefix: str = "",
    tensor_layer_offset: int = 0,
    meta_prefix: str = "",
    meta_layer_offset: int = 0,
    metadata: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert the dense DSpark checkpoint ``src`` into an EXL3 one at ``out``; returns the tensor_storage.

    ``modules``: regex over module keys (``layers.0.mlp.down_proj``) to quantize, each through
    ``encode``. The prefixes and layer offsets rename tensors / metadata keys (``model.``, the target's
    numbering: the loader's tests write the predecessor's layouts with them)."""
    from safetensors.torch import save_file

    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook {codebook!r}: expected one of {', '.join(CODEBOOKS)}")
    dense = {k: t for k, t in read_dense(src).items() if t is not None}
    pat = re.compile(modules)
    tensors: dict[str, torch.Tensor] = {}
    storage: dict[str, Any] = {}
    for i, (name, t) in enumerate(sorted(dense.items())):
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        tname = _rename(name, tensor_prefix, tensor_layer_offset)
        if mod is not None and t.dim() == 2 and pat.search(mod):
            t0 = time.monotonic()
            q = encode(t.float(), seed + i)
            tkey = _rename(mod, tensor_prefix, tensor_layer_offset)
            mname = _rename(mod, meta_prefix, meta_layer_offset)
            entry: dict[str, Any] = {"stored_tensors": {}, "quant_format": "exl3", "bits_per_weight": bits}
            if codebook != "3inst":
                entry[f"{codebook}_multiplier"] = MCG_MULT if codebook == "mcg" else MUL1_MULT
            for suffix, qt in q.items():
                tensors[f"{tkey}.{suffix}"] = qt.contiguous()
                entry["stored_tensors"][f"{mname}.{suffix}"] = {
                    "shape": list(qt.shape),
                    "n_bytes": qt.numel() * qt.element_size(),
                    "dtype": str(qt.dtype),
                }
            storage[mname] = entry
            if log:
                log(f"{mod}: {list(t.shape)} K={bits} {codebook} in {time.monotonic() - t0:.1f} s")
            continue
        tensors[tname] = t.contiguous()
        mkey = _rename(name.rpartition(".")[0], meta_prefix, meta_layer_offset)
        storage.setdefault(mkey, {"stored_tensors": {}})["stored_tensors"][
            _rename(name, meta_prefix, meta_layer_offset)
        ] = {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    qcfg = {"quant_method": "exl3", "version": version, "bits": float(bits), "codebook": codebook}
    cfg["quantization_config"] = qcfg
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if metadata:
        with open(os.path.join(out, "quantization_config.json"), "w") as f:
            json.dump({**qcfg, "tensor_storage": storage}, f, indent=2)
    for extra in os.listdir(src):  # tokenizer files and the like travel along
        if not extra.endswith(".safetensors") and extra not in ("config.json", "model.safetensors.index.json"):
            p = os.path.join(src, extra)
            if os.path.isfile(p):
                shutil.copy(p, os.path.join(out, extra))
    return storage


def exllamav3_encoder(bits: int, codebook: str, device: torch.device) -> tuple[Encoder, str]:
    """exllamav3's quantizer as an ``Encoder`` (GPU; uncalibrated), and the version string it writes."""
    from draft_server.models.exl3.cuda import load_ext

    load_ext()  # the extension first (prebuilt or JIT), registered so exllamav3 takes it as precompiled
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3
    from exllamav3.version import __version__

    def encode(weight: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        out_f, in_f = weight.shape
        k, n = pad128(in_f), pad128(out_f)
        w = torch.zeros((k, n), dtype=torch.float32, device=device)  # exllamav3 takes (in, out), 128-padded
        w[:in_f, :out_f] = weight.to(device).t()
        h_data: dict[str, Any] = {  # Linear.init_H_data(False): no calibration
            "H": torch.zeros(k, k, dtype=torch.float32, device="meta"),
            "packed": False,
            "n": k,
            "first_key": f"w{seed}",
            "count": 0,
            "finalized": False,
            "num_total": 0,
            "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
            "device": device,
        }
        args: dict[str, Any] = {"K": bits, "seed": seed, "devices": [device.index or 0], "apply_out_scales": None}
        if codebook != "3inst":
            args[codebook] = True
        _, _, q = quantize_exl3(w, h_data, args, False)
        return {name: t.cpu() for name, t in q.items()}

    return encode, f"exllamav3 {__version__} (uncalibrated)"


def quantize_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="draft-server quantize",
        description="Quantize a dense DSpark draft checkpoint to EXL3 with exllamav3's quantizer (CUDA GPU).",
    )
    ap.add_argument("--model", required=True, help="dense (BF16) DSpark draft checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory for the EXL3 checkpoint")
    ap.add_argument("--bits", type=int, required=True, choices=range(1, 9), metavar="K", help="bits per weight, 1-8")
    ap.add_argument(
        "--codebook",
        default="mul1",
        choices=CODEBOOKS,
        help="trellis codebook (default mul1; 3inst decodes faster on H100/H200: README 'EXL3 measured')",
    )
    ap.add_argument("--modules", default=DEFAULT_MODULES, help="regex over module keys to quantize")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from draft_server.models.exl3.cuda import Exl3Unavailable

    try:
        dev = torch.device(args.device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise Exl3Unavailable(f"exllamav3's quantizer needs a CUDA GPU (--device {args.device})")
        if os.path.abspath(args.out) == os.path.abspath(args.model):
            raise ValueError("--out must not be the --model directory")
        pat = re.compile(args.modules)
        names = read_dense(args.model, keys_only=True)
        if not any(n.endswith(".weight") and pat.search(n[: -len(".weight")]) for n in names):
            raise ValueError(f"{args.model}: no linear matches --modules {args.modules!r}: nothing to quantize")
        encode, version = exllamav3_encoder(args.bits, args.codebook, dev)
        t0 = time.monotonic()
        storage = write_checkpoint(
            args.model, args.out, encode, args.bits, args.codebook, version, args.modules, args.seed, log=print
        )
    except (Exl3Unavailable, ImportError, OSError, ValueError) as e:
        print(f"draft-server quantize: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    n = sum("quant_format" in e for e in storage.values())
    print(f"wrote {args.out}: {n} EXL3 linears, K={args.bits} {args.codebook}, {time.monotonic() - t0:.1f} s")
    return 0
