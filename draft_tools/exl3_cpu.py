"""A CPU EXL3 encoder: NOT exllamav3's quantizer (``draft-server quantize`` runs that), an independent stand-in.

Owns what CPU-only tests and the shipped tiny EXL3 drafter need to exist without a GPU:

- ``viterbi``: a tail-biting trellis search over the 2^16 states of a codebook (float32 costs,
  two passes: the second pins the wrap-around bits the first chose), written from the decode
  side of the format (``draft_server.models.exl3.decode``), not from exllamav3's kernel;
- ``pack_trellis``: states -> the stored int16 trellis (MSB-first 16-bit words, the two halves of
  each uint32 swapped, as exllamav3's ``pack_trellis_kernel`` stores them);
- ``encode_linear``: a dense weight [out, in] -> ``trellis``/``suh``/``svh``(/marker) with random
  sign flips, per-channel scales, 128-point Hadamards and a small global-scale search.
  Like ``draft-server quantize`` (exllamav3's ``quantize_exl3``, uncalibrated) there is no Hessian and
  no LDLQ error feedback; the regularisation is simpler, so at the same K the error is somewhat larger;
- ``random_linear``: a valid EXL3 linear from random trellis bits (fast fixtures for loader tests);
- ``write_exl3_checkpoint`` / ``main``: a dense DSpark checkpoint -> an EXL3 one through
  ``draft_server.models.exl3.convert.write_checkpoint`` (the layout ``draft-server quantize`` writes),
  with options to name layers or metadata in other numberings, for the loader's tests.

``python -m draft_tools.exl3_cpu --bits 4 --model BF16_DIR --out DIR [--codebook mul1]``
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

from draft_server.models.exl3.convert import DEFAULT_MODULES, write_checkpoint
from draft_server.models.exl3.decode import (
    MCG_MULT,
    MUL1_MULT,
    codebook_lut,
    decode_inner,
    had_left,
    had_right,
    tile_perm,
)
from draft_server.models.exl3.linear import pad128


def viterbi(x: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    """Tiles x [T, 256] (position order) -> the tail-biting state path [T, 256] minimising squared error."""
    lut = codebook_lut(codebook).float()
    G, B = 1 << (16 - K), 1 << K
    T = x.shape[0]
    x = x.float()

    def run(pin: torch.Tensor | None) -> torch.Tensor:
        cost = (lut[None] - x[:, :1]) ** 2
        if pin is not None:  # s_0's top 16-K bits are the stream's last bits: pin them
            cost = torch.where((torch.arange(65536) >> K)[None] == pin[:, None], cost, torch.inf)
        back = torch.empty((256, T, G), dtype=torch.uint8 if B <= 256 else torch.int16)
        for p in range(1, 256):
            m, h = cost.view(T, B, G).min(dim=1)  # best predecessor h * G + t for each overlap t
            back[p] = h
            cost = (lut[None] - x[:, p : p + 1]) ** 2 + m.repeat_interleave(B, dim=1)
        if pin is None:
            s = cost.argmin(dim=1)
        else:  # the last state's low 16-K bits must be the pinned ones
            h = cost.view(T, B, G).gather(2, pin.view(T, 1, 1).expand(T, B, 1)).squeeze(2).argmin(dim=1)
            s = h * G + pin
        path = torch.empty((T, 256), dtype=torch.int64)
        path[:, 255] = s
        for p in range(255, 0, -1):
            t = s >> K
            s = back[p].gather(1, t[:, None]).squeeze(1).to(torch.int64) * G + t
            path[:, p - 1] = s
        return path

    first = run(None)
    return run(first[:, 0] >> K)


def pack_trellis(states: torch.Tensor, K: int) -> torch.Tensor:
    """States [..., 256] -> stored trellis [..., 16K] int16 (low K bits of each state, MSB first)."""
    lead = states.shape[:-1]
    v = states & ((1 << K) - 1)
    bits = (v[..., None] >> torch.arange(K - 1, -1, -1)) & 1  # [..., 256, K] MSB first
    bits = bits.reshape(*lead, 16 * K, 16)
    u16 = (bits << torch.arange(15, -1, -1)).sum(-1)  # stream-order 16-bit words
    stored = u16.reshape(*lead, 8 * K, 2).flip(-1).reshape(*lead, 16 * K)  # uint32 halves swapped
    return stored.to(torch.int32).to(torch.int16)


def _to_tiles(wq: torch.Tensor) -> torch.Tensor:
    """Wq [k, n] -> tiles [k/16 * n/16, 256] in position order."""
    k, n = wq.shape
    rm = wq.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(-1, 256)
    return rm[:, tile_perm()]


def encode_tiles(tiles: torch.Tensor, K: int, codebook: str, batch: int = 0) -> torch.Tensor:
    """Viterbi over many tiles, in batches sized to keep the back-pointers near 64 MiB."""
    batch = batch or max(4, (64 << 20) // (256 << (16 - K)))
    return torch.cat([viterbi(tiles[i : i + batch], K, codebook) for i in range(0, tiles.shape[0], batch)])


def _marker(codebook: str) -> dict[str, torch.Tensor]:
    if codebook == "3inst":
        return {}
    mult = MCG_MULT if codebook == "mcg" else MUL1_MULT
    return {codebook: torch.tensor(mult - (1 << 32) if mult >= 1 << 31 else mult, dtype=torch.int32)}


def encode_linear(
    weight: torch.Tensor, K: int, codebook: str = "mul1", seed: int = 0, scale_search: bool = True
) -> dict[str, torch.Tensor]:
    """Dense weight [out, in] -> exllamav3's tensors for it (``trellis``, ``suh``, ``svh``, marker)."""
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = weight.shape
    k, n = pad128(in_f), pad128(out_f)
    wt = torch.zeros((k, n), dtype=torch.float64)
    wt[:in_f, :out_f] = weight.t().double()
    sign_u = torch.randint(0, 2, (k,), generator=g).double() * 2 - 1
    sign_v = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    out_rms = wt.pow(2).mean(0).sqrt()
    out_rms = torch.where(out_rms > 1e-12, out_rms / out_rms[out_rms > 1e-12].mean().clamp_min(1e-30), 1.0)
    sv = (sign_v * out_rms).half()
    a = had_right(wt / sv.double()[None])
    in_rms = a.pow(2).mean(1).sqrt()
    in_rms = torch.where(in_rms > 1e-12, in_rms, in_rms[in_rms > 1e-12].mean() if (in_rms > 1e-12).any() else 1.0)
    target = codebook_lut(codebook).double().std()
    su = sign_u * in_rms / target

    def wq_for(su16: torch.Tensor) -> torch.Tensor:
        return had_left(a / su16.double()[:, None])

    if scale_search:  # a few global scales on a sample of tiles, as exllamav3's g_scale search does
        tiles = _to_tiles(wq_for(su.half()))
        sample = tiles[torch.randperm(tiles.shape[0], generator=g)[:8]]
        lut = codebook_lut(codebook).double()
        best, best_err = 1.0, math.inf
        for c in (0.8, 0.9, 1.0, 1.1, 1.2):
            q = lut[encode_tiles(sample * c, K, codebook)] / c
            err = (q - sample).pow(2).mean().item()
            if err < best_err:
                best, best_err = c, err
        su = su / best
    suh = su.half()
    wq = wq_for(suh)
    states = encode_tiles(_to_tiles(wq), K, codebook).view(k // 16, n // 16, 256)
    return {"trellis": pack_trellis(states, K), "suh": suh, "svh": sv, **_marker(codebook)}


def random_linear(out_f: int, in_f: int, K: int, codebook: str = "mul1", seed: int = 0) -> dict[str, torch.Tensor]:
    """A valid EXL3 linear with random trellis bits, decoding to weights of std about 1/sqrt(in)."""
    g = torch.Generator().manual_seed(seed)
    k, n = pad128(in_f), pad128(out_f)
    trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32)
    sign = lambda m: torch.randint(0, 2, (m,), generator=g).double() * 2 - 1  # noqa: E731
    std = codebook_lut(codebook).double().std().item()
    suh = (sign(k) * (0.5 + torch.rand(k, generator=g, dtype=torch.float64)) / (std * in_f**0.5)).half()
    svh = (sign(n) * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))).half()
    return {"trellis": trellis.to(torch.int16), "suh": suh, "svh": svh, **_marker(codebook)}


def write_exl3_checkpoint(
    src: str,
    out: str,
    bits: int = 4,
    codebook: str = "mul1",
    modules: str = DEFAULT_MODULES,
    encoder: str = "viterbi",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    **names: Any,
) -> dict[str, Any]:
    """``convert.write_checkpoint`` with this module's CPU encoders: ``viterbi`` (``encode_linear``) or
    ``random`` (``random_linear``: valid format, random weights); ``names``: its renaming options."""

    def encode(w: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        if encoder == "random":
            return random_linear(w.shape[0], w.shape[1], bits, codebook, seed=seed)
        return encode_linear(w, bits, codebook, seed=seed)

    return write_checkpoint(src, out, encode, bits, codebook, "draft_tools.exl3_cpu", modules, seed, log=log, **names)


def write_cpu_fixtures(out: str, seed: int = 0) -> list[str]:
    """Regression fixtures for the decoder, made on the CPU (``source=draft_tools-cpu``): random trellis bits
    for every codebook and K in 1..8 at [128, 256], with the sha256 of the decoded fp16 ``Wq`` in the metadata.
    They pin this decoder against itself over time; exllamav3's own goldens come from ``exl3_golden``."""
    import hashlib

    os.makedirs(out, exist_ok=True)
    written = []
    for cb in ("3inst", "mcg", "mul1"):
        for K in range(1, 9):
            t = random_linear(256, 128, K, cb, seed=seed + K)
            inner = decode_inner(t["trellis"], cb)
            meta = {
                "source": "draft_tools-cpu",
                "codebook": cb,
                "K": str(K),
                "in": "128",
                "out": "256",
                "inner_sha256": hashlib.sha256(inner.view(torch.int16).numpy().tobytes()).hexdigest(),
            }
            path = os.path.join(out, f"cpu_{cb}_k{K}_128x256.safetensors")
            save_file({k: v.contiguous() for k, v in t.items()}, path, metadata=meta)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_tools.exl3_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="dense DSpark draft checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory for the EXL3 checkpoint")
    ap.add_argument("--bits", type=int, default=4, choices=range(1, 9), help="K, bits per weight (default 4)")
    ap.add_argument("--codebook", default="mul1", choices=["mul1", "mcg", "3inst"], help="default mul1")
    ap.add_argument("--modules", default=DEFAULT_MODULES, help="regex over module keys to quantize")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    storage = write_exl3_checkpoint(
        args.model, args.out, args.bits, args.codebook, args.modules, seed=args.seed, log=print
    )
    print(f"wrote {args.out}: {sum('quant_format' in e for e in storage.values())} EXL3 modules, K={args.bits}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
