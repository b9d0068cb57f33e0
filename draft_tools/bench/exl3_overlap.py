"""EXL3 at draft-batch row counts: decode-once tiles, and the scratch decode overlapped with the GEMM.

Owns one measurement (issue 13 from 8 sessions up, where the packed step is 1.4-1.8x BF16): a Kimi-K3
drafter layer's seven linears (q_a, kv_a, q_b, o, gate, up, down), twice, as one CUDA graph, per row
count, by

- ``bf16``: ``F.linear`` with BF16 weights (what EXL3 must come close to);
- ``serial``: per linear ``exl3_decode`` of Wq.T into one scratch, then the fp16 ``F.linear`` on it
  (the backend's ``decode`` path without its rotations);
- ``overlap``: the same with linear i+1 decoded on a second stream into the other of two scratch
  buffers while linear i's GEMM runs (events order each buffer's reuse after the GEMM that read it);
- ``inline_<shape>``: ``exl3_matmul`` (the decode inside the GEMM) per linear at a launch shape,
  ``block_m`` up to 512 rows so that 224 and 448 rows decode every weight once (the default stops at
  128: four decodes of every weight at 448 rows); ``inline_best``: each linear at its fastest shape;

and per linear at 448 rows the same paths, plus ``chunked_<c>``: the weight decoded ``c`` output
rows at a time into two small buffers that stay in L2, each chunk's GEMM overlapping the next
chunk's decode. Every variant is checked against ``A @ decode_inner`` before it is timed. Floors
(copy bandwidth, bf16 TFLOP/s) from the same run. Prints a table; JSON to ``--out``.

    python -m draft_tools.bench.exl3_overlap --out /tmp/exl3_overlap.json   # needs no exllamav3
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from draft_server.models.exl3.decode import decode_inner
from draft_server.models.kernels.exl3_gemm import KernelConfig, exl3_decode, exl3_matmul
from draft_tools.bench.ab import this_tree
from draft_tools.bench.exl3_kernel import bench, floors

LAYER = ((7168, 1536), (7168, 576), (1536, 12288), (8192, 7168), (7168, 14336), (7168, 14336), (14336, 7168))
ROWS = (7, 56, 112, 224, 448)
WARPS = {64: (4, 8), 128: (4, 8), 256: (8, 16), 512: (8, 16)}
# (block_m, block_n, block_k, warps, per_sm)
SHAPES = [(bm, bn, 64, w, 8) for bm, ws in WARPS.items() for bn in (32, 64, 128) for w in ws]
CHUNKS = (256, 512, 1024)


class Linear:
    """One random K3-shaped linear: its trellis, the fp16 Wq.T it decodes to, a BF16 weight of its shape."""

    def __init__(self, i: int, o: int, bits: int, codebook: str, g: torch.Generator) -> None:
        dev = torch.device("cuda")
        self.k, self.n, self.codebook = i, o, codebook
        self.trellis = torch.randint(-(1 << 15), 1 << 15, (i // 16, o // 16, 16 * bits), dtype=torch.int16,
                                     device=dev, generator=g)  # fmt: skip
        self.wq = decode_inner(self.trellis, codebook)  # [k, n] fp16
        self.wb = torch.randn(o, i, dtype=torch.bfloat16, device=dev, generator=g)

    def decode(self, buf: torch.Tensor) -> torch.Tensor:
        return exl3_decode(self.trellis, self.codebook, out=buf[: self.n * self.k].view(self.n, self.k), trans=True)


def chain_serial(lins: list[Linear], xs: list[torch.Tensor], buf: torch.Tensor) -> list[torch.Tensor]:
    return [F.linear(x, lin.decode(buf)) for lin, x in zip(lins, xs, strict=True)]


def chain_overlap(
    lins: list[Linear], xs: list[torch.Tensor], bufs: list[torch.Tensor], side: torch.cuda.Stream
) -> list[torch.Tensor]:
    """Linear i+1's decode on ``side`` into bufs[(i+1) % 2] while linear i's GEMM runs on the current stream."""
    cur = torch.cuda.current_stream()
    n = len(lins)
    dec = [torch.cuda.Event() for _ in range(n)]
    used = [torch.cuda.Event() for _ in range(n)]
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        lins[0].decode(bufs[0])
        dec[0].record(side)
    outs = []
    for i in range(n):
        if i + 1 < n:
            with torch.cuda.stream(side):
                if i >= 1:
                    side.wait_event(used[i - 1])  # the GEMM that read this buffer last
                lins[i + 1].decode(bufs[(i + 1) % 2])
                dec[i + 1].record(side)
        cur.wait_event(dec[i])
        w = bufs[i % 2][: lins[i].n * lins[i].k].view(lins[i].n, lins[i].k)
        outs.append(F.linear(xs[i], w))
        used[i].record(cur)
    cur.wait_stream(side)
    return outs


def split(lin: Linear, c: int) -> list[tuple[int, int, torch.Tensor]]:
    """lin's trellis cut into chunks of ``c`` output columns (contiguous copies, made before any capture)."""
    return [(j, min(j + c, lin.n), lin.trellis[:, j // 16 : min(j + c, lin.n) // 16].contiguous())
            for j in range(0, lin.n, c)]  # fmt: skip


def chunked(lin: Linear, x: torch.Tensor, bufs: list[torch.Tensor], side: torch.cuda.Stream,
            chunks: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
    """Wq.T decoded one chunk of output rows at a time (``split``) into two small buffers; chunk j's GEMM
    (into rows of C.T) overlaps chunk j+1's decode. Returns C [rows, n]."""
    cur = torch.cuda.current_stream()
    n, k = lin.n, lin.k
    ct = torch.empty((n, x.shape[0]), dtype=torch.float16, device=x.device)
    dec = [torch.cuda.Event() for _ in chunks]
    used = [torch.cuda.Event() for _ in chunks]

    def decode(j: int) -> None:
        a, b, t = chunks[j]
        exl3_decode(t, lin.codebook, out=bufs[j % 2][: (b - a) * k].view(b - a, k), trans=True)

    side.wait_stream(cur)
    with torch.cuda.stream(side):
        decode(0)
        dec[0].record(side)
    xt = x.t()
    for j, (a, b, _) in enumerate(chunks):
        if j + 1 < len(chunks):
            with torch.cuda.stream(side):
                if j >= 1:
                    side.wait_event(used[j - 1])
                decode(j + 1)
                dec[j + 1].record(side)
        cur.wait_event(dec[j])
        torch.mm(bufs[j % 2][: (b - a) * k].view(b - a, k), xt, out=ct[a:b])
        used[j].record(cur)
    cur.wait_stream(side)
    return ct.t()


def shape_name(s: tuple[int, ...]) -> str:
    return "bm{}_bn{}_bk{}_w{}_p{}".format(*s)


def inline(lin: Linear, a: torch.Tensor, s: tuple[int, ...]) -> torch.Tensor:
    bm, bn, bk, w, p = s
    return exl3_matmul(a, lin.trellis, lin.codebook, block_m=bm, config=KernelConfig(bn, bk, w, 1, p))


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return (got.float() - want).abs().max().item() <= rel * want.abs().max().item()


class Run:
    """The linears, their scratch buffers and the side stream, shared by every row count."""

    def __init__(self, args: argparse.Namespace, g: torch.Generator, t0: float) -> None:
        dev = torch.device("cuda")
        lins = [Linear(i, o, args.bits, args.codebook, g) for i, o in LAYER]
        self.lins = lins + lins  # two layers' worth: the pipeline's steady state
        big = max(lin.n * lin.k for lin in self.lins)
        self.bufs = [torch.empty(big, dtype=torch.float16, device=dev) for _ in range(2)]
        self.small = [torch.empty(max(CHUNKS) * 14336, dtype=torch.float16, device=dev) for _ in range(2)]
        self.side = torch.cuda.Stream()
        self.g, self.args, self.t0 = g, args, t0

    def chain(self, rows: int) -> dict[str, Any]:
        lins, bufs, side = self.lins, self.bufs, self.side
        xs = [torch.randn(rows, lin.k, dtype=torch.float16, device="cuda", generator=self.g) for lin in lins]
        xb = [x.to(torch.bfloat16) for x in xs]
        want = [x.float() @ lin.wq.float() for x, lin in zip(xs, lins, strict=True)]
        for name, got in (
            ("serial", chain_serial(lins, xs, bufs[0])),
            ("overlap", chain_overlap(lins, xs, bufs, side)),
        ):
            torch.cuda.synchronize()
            assert all(close(a, w, 1e-2) for a, w in zip(got, want, strict=True)), f"{name} chain wrong at {rows} rows"
        row: dict[str, Any] = {
            "bf16": bench(lambda: [F.linear(x, lin.wb) for x, lin in zip(xb, lins, strict=True)]),
            "serial": bench(lambda: chain_serial(lins, xs, bufs[0])),
            "overlap": bench(lambda: chain_overlap(lins, xs, bufs, side)),
            "weights": sum(lin.n * lin.k for lin in lins),
        }
        if rows < 56:
            return row
        per: dict[str, dict[str, float]] = {}  # per distinct linear: the launch shapes that fit these rows
        for lin, x, w in zip(lins[: len(LAYER)], xs, want, strict=False):
            name = f"{lin.k}x{lin.n}"
            if name not in per:
                per[name] = self.shapes(lin, x, w, rows)
        best = {
            n_: min(ok, key=lambda k_, t=t: t[k_])
            for n_, t in per.items()
            if (ok := [k_ for k_, v in t.items() if v == v])
        }
        row["inline_per_linear"], row["inline_best_shape"] = per, best
        if len(best) == len(per):
            by_name = {shape_name(s): s for s in SHAPES}
            sh = [by_name[best[f"{lin.k}x{lin.n}"]] for lin in lins]
            row["inline_best"] = bench(lambda: [inline(lin, x, s) for lin, x, s in zip(lins, xs, sh, strict=True)])
        if rows == 448:
            row["linear"] = {
                f"{lin.k}x{lin.n}": self.chunks(lin, x, w)
                for lin, x, w in zip(lins[3:5], xs[3:5], want[3:5], strict=True)
            }
            row["linear"][f"{lins[6].k}x{lins[6].n}"] = self.chunks(lins[6], xs[6], want[6])
        return row

    def shapes(self, lin: Linear, x: torch.Tensor, w: torch.Tensor, rows: int) -> dict[str, float]:
        times: dict[str, float] = {}
        for s in SHAPES:
            if not pow2(rows) // 4 <= s[0] <= max(64, pow2(rows)) or time.monotonic() - self.t0 > self.args.deadline_s:
                continue
            try:
                ok = close(inline(lin, x, s), w, 1e-3)
                times[shape_name(s)] = bench(lambda s=s: inline(lin, x, s)) if ok else float("nan")
            except Exception as e:  # a shape that does not compile or fit shared memory
                print(f"  {lin.k}x{lin.n} r{rows} {shape_name(s)}: {type(e).__name__}", flush=True)
        return times

    def chunks(self, lin: Linear, x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
        """One big linear alone at these rows: BF16, decode then GEMM, and decode through L2 in chunks."""
        xb = x.to(torch.bfloat16)
        r = {
            "bf16": bench(lambda: F.linear(xb, lin.wb)),
            "serial": bench(lambda: F.linear(x, lin.decode(self.bufs[0]))),
        }
        for c in CHUNKS:
            parts = split(lin, c)
            got = chunked(lin, x, self.small, self.side, parts)
            torch.cuda.synchronize()
            ok = close(got, w, 1e-2)
            r[f"chunked_{c}"] = bench(lambda p=parts: chunked(lin, x, self.small, self.side, p)) if ok else float("nan")
        print(f"  {lin.k}x{lin.n} " + "  ".join(f"{k_} {v:6.3f}" for k_, v in r.items()), flush=True)
        return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebook", default="3inst")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--deadline-s", type=float, default=400.0, help="stop sweeping launch shapes after this")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    dev = torch.device("cuda")
    fl = floors(dev)
    print(f"{torch.cuda.get_device_name()}: copy {fl['copy_gb_s']:.0f} GB/s, bf16 {fl['bf16_tflops']:.0f} TFLOP/s",
          flush=True)  # fmt: skip
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "machine": platform.node(),
        "tree": this_tree(),
        "command": "python -m draft_tools.bench.exl3_overlap " + " ".join(argv if argv is not None else sys.argv[1:]),
        "bits": args.bits,
        "codebook": args.codebook,
        "floors": fl,
        "chain": {},
    }
    run = Run(args, torch.Generator(device=dev).manual_seed(0), t0)
    for rows in map(int, args.rows.split(",")):
        row = out["chain"][str(rows)] = run.chain(rows)
        print(
            f"r{rows:<4} bf16 {row['bf16']:6.3f}  serial {row['serial']:6.3f}  overlap {row['overlap']:6.3f}"
            f"  inline_best {row.get('inline_best', float('nan')):6.3f}  ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        with open(args.out, "w") as f:  # after every row count: a timeout keeps what was measured
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
