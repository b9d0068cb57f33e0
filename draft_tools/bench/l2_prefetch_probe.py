"""Weights pulled into the L2 on a side stream while the step's small kernels run: what it saves (issue 10).

At one session a draft layer's weight GEMMs stream 30-400 MB each at close to the copy bandwidth,
but between them the GPU runs kernels that move almost nothing: norms, RoPE, attention over a few
MB of cache. The memory system idles there, and each small GEMM (Qwen3-8B's o_proj: 33.5 MB, 18 us
against an 8 us bound) pays its own ramp and tail. The L2 holds 50 MB. This probe measures, as CUDA
graph replays of five layers of a preset's shapes (distinct weights per layer, past the L2), whether
a second stream that reads a GEMM's weights into the L2 while the kernels before it run makes the
chain faster, before any product code does it:

- ``off``: the layer as the step runs it (norm, qkv GEMM, RoPE-sized elementwise work, attention
  (torch's SDPA over the session's cache, a stand-in of the same bytes), o_proj, norm, gate/up,
  SiLU, down);
- ``o_attn``: at the layer's start a side stream reads o_proj's weights (up to ``--cap-mib``) while
  qkv, RoPE and attention run;
- ``next``: before each GEMM the side stream starts on the next GEMM's weights (up to the cap), so
  every boundary has the next weights in flight.

Each mode with two readers: ``load`` (a Triton kernel that loads the bytes and folds them into one
word per program, so nothing is dead code) and ``pf`` (``prefetch.global.L2::evict_last``, which
holds no registers). The outputs of every mode equal ``off``'s bitwise (the main stream's kernels
are the same). One line per preset, rows and mode; JSON with the machine and the run's copy
bandwidth:

    python3 -m draft_tools.bench.l2_prefetch_probe --out bench/results/l2_prefetch_probe_h200.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from draft_server.models.gemm import graph_ms
from draft_tools.common import write_report

# per preset: the layer's GEMMs (name, out, in) in step order, and the attention stand-in
# (query heads, kv heads, head dim): torch's SDPA over 1,024 cached rows a session
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "hidden": 4096,
        "gemms": (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)),
        "attn": (32, 8, 128),
    },
    "k3": {
        "hidden": 7168,
        "gemms": (
            ("qkv_a", 2112, 7168),
            ("q_b", 12288, 1536),
            ("o_proj", 7168, 8192),
            ("gate_up", 28672, 7168),
            ("down", 7168, 14336),
        ),
        "attn": (64, 1, 144),  # one kv head: 0.6 MB a session, FlashMLA reads 1.2 (its latent cache)
    },
}
CTX = 1024
BLOCK = 4096  # int32 words per program and iteration (16 KB)


@triton.jit
def _load_kernel(W, SINK, n_words, per_prog, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    lo = p * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for a in tl.range(lo, lo + per_prog, BLOCK, num_stages=4):
        i = a + tl.arange(0, BLOCK)
        acc ^= tl.load(W + i, mask=(i < n_words) & (i < lo + per_prog), other=0, cache_modifier=".cg")
    tl.store(SINK + p, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _pf_kernel(W, SINK, n_lines, per_prog, BLOCK: tl.constexpr):
    """One ``prefetch.global.L2::evict_last`` per 128-byte line (32 int32 words)."""
    p = tl.program_id(0)
    lo = p * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for a in range(lo, lo + per_prog, BLOCK):
        i = a + tl.arange(0, BLOCK)
        ok = (i < n_lines) & (i < lo + per_prog)
        ptr = W + tl.where(ok, i, 0).to(tl.int64) * 32
        acc += tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.store(SINK + p, tl.sum(acc, 0))


def pull(w: torch.Tensor, nbytes: int, how: str, programs: int, sink: torch.Tensor) -> None:
    """Read the first ``nbytes`` of ``w`` into the L2 (``how``: load or pf)."""
    words = w.view(torch.int32).reshape(-1)[: nbytes // 4]
    n = words.numel()
    if how == "load":
        per = triton.cdiv(triton.cdiv(n, programs), BLOCK) * BLOCK
        _load_kernel[(triton.cdiv(n, per),)](words, sink, n, per, BLOCK=BLOCK, num_warps=8)
    else:
        lines = n // 32
        per = triton.cdiv(triton.cdiv(lines, programs), 256) * 256
        _pf_kernel[(triton.cdiv(lines, per),)](words, sink, lines, per, BLOCK=256, num_warps=8)


def rms(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def build(preset: str, sessions: int, layers: int, dev: torch.device) -> dict[str, Any]:
    spec = PRESETS[preset]
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.bfloat16, device=dev)

    _, hk, dh = spec["attn"]
    ws = [{name: randn(o, i) / i**0.5 for name, o, i in spec["gemms"]} for _ in range(layers)]
    kv = [(randn(sessions, hk, CTX, dh), randn(sessions, hk, CTX, dh)) for _ in range(layers)]
    return {"spec": spec, "ws": ws, "kv": kv, "x": randn(sessions * 7, spec["hidden"]), "sessions": sessions}


def chain(m: dict[str, Any], mode: str, how: str, cap: int, programs: int, side: torch.cuda.Stream,
          sink: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The layers on the current stream; with ``mode`` != off, weight pulls on ``side``."""
    spec, n = m["spec"], m["sessions"]
    hq, hk, dh = spec["attn"]
    main = torch.cuda.current_stream()
    names = [name for name, _, _ in spec["gemms"]]
    order = [(layer, name) for layer in range(len(m["ws"])) for name in names]

    def start_pull(layer: int, name: str) -> None:
        w = m["ws"][layer][name]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            pull(w, min(cap, w.numel() * 2), how, programs, sink)

    h = m["x"]
    for layer, ws in enumerate(m["ws"]):
        if mode == "o_attn":
            start_pull(layer, "o_proj")
        x = rms(h)
        for j, name in enumerate(names):
            k = layer * len(names) + j
            if mode == "next" and k + 1 < len(order):
                start_pull(*order[k + 1])
            w = ws[name]
            if name in ("qkv", "q_b"):
                q = F.linear(x, w)[:, : hq * dh].reshape(n, 7, hq, dh).transpose(1, 2)
                q = q * 1.0001  # RoPE's place: an elementwise pass
                k_, v_ = m["kv"][layer]
                a = F.scaled_dot_product_attention(q, k_, v_, enable_gqa=hq != hk)
                x = a.transpose(1, 2).reshape(n * 7, hq * dh)
                o_in = ws["o_proj"].shape[1]
                x = x[:, :o_in] if x.shape[1] >= o_in else F.pad(x, (0, o_in - x.shape[1]))
            elif name == "qkv_a":
                x = rms(F.linear(x, w)[:, :1536])
            elif name == "o_proj":
                h = h + F.linear(x, w)
                x = rms(h)
            elif name == "gate_up":
                gu = F.linear(x, w)
                half = gu.shape[1] // 2
                x = F.silu(gu[:, :half]) * gu[:, half:]
            elif name == "down":
                h = h + F.linear(x, w)
    if mode != "off":
        main.wait_stream(side)
    return h


def replay_ms(fn: Any, runs: int) -> tuple[float, torch.Tensor]:
    """Median ms of ``fn`` captured in one CUDA graph and replayed (``gemm.graph_ms``, no L2 flush), and
    the last replay's output."""
    box: dict[str, torch.Tensor] = {}

    def body() -> None:
        box["out"] = fn()

    ms = graph_ms(body, flush_l2=False, runs=runs)
    return ms, box["out"].clone()


def copy_bandwidth(dev: torch.device) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * a.numel() / statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="qwen3-8b,k3")
    ap.add_argument("--sessions", default="1,8")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--cap-mib", type=int, default=40)
    ap.add_argument("--programs", default="32,132")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    bw = copy_bandwidth(dev)
    report: dict[str, Any] = {
        "benchmark": "l2_prefetch_probe",
        "command": "python3 -m draft_tools.bench.l2_prefetch_probe " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "l2_bytes": torch.cuda.get_device_properties(dev).L2_cache_size,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "copy_bytes_per_s": bw,
        "runs": [],
    }
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, L2 {report['machine']['l2_bytes'] >> 20} MiB", flush=True)
    cap = args.cap_mib << 20
    for preset in args.presets.split(","):
        for n in (int(s) for s in args.sessions.split(",")):
            m = build(preset, n, args.layers, dev)
            wbytes = sum(w.numel() * 2 for ws in m["ws"] for w in ws.values())
            kvbytes = sum(k.numel() * 4 for k, _ in m["kv"])
            floor_ms = (wbytes + kvbytes) / bw * 1e3
            ref_ms, ref = replay_ms(lambda m=m: chain(m, "off", "load", cap, 1, side, sink), args.runs)
            row: dict[str, Any] = {"preset": preset, "sessions": n, "weight_bytes": wbytes, "kv_bytes": kvbytes,
                                   "floor_ms": floor_ms, "off_ms": ref_ms, "modes": {}}  # fmt: skip
            print(f"{preset:8s} B={n:2d} off {ref_ms * 1e3:8.1f} us  floor {floor_ms * 1e3:8.1f} us", flush=True)
            for mode in ("o_attn", "next"):
                for how in ("load", "pf"):
                    for programs in (int(p) for p in args.programs.split(",")):
                        try:
                            ms, out = replay_ms(
                                lambda m=m, mode=mode, how=how, p=programs: chain(m, mode, how, cap, p, side, sink),
                                args.runs,
                            )
                        except Exception as e:  # a reader that cannot build is reported, not fatal
                            row["modes"][f"{mode}/{how}/{programs}"] = {"error": repr(e)[:300]}
                            print(f"   {mode:7s} {how:4s} p={programs:3d} failed: {e!r}"[:200], flush=True)
                            continue
                        eq = bool(torch.equal(out, ref))
                        row["modes"][f"{mode}/{how}/{programs}"] = {"ms": ms, "equal_to_off": eq}
                        print(f"   {mode:7s} {how:4s} p={programs:3d} {ms * 1e3:8.1f} us  ({(ms - ref_ms) * 1e3:+7.1f})"
                              f"  equal={eq}", flush=True)  # fmt: skip
            report["runs"].append(row)
            del m
            torch.cuda.empty_cache()
            if args.out:
                write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
