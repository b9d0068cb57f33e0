"""The draft step on one GPU against its floor: dense eager (before) vs paged kernels + CUDA graphs (after).

One run measures, in this order, and writes one JSON (machine, command, every number):

1. the floors of this card: device-to-device copy bandwidth and the bf16 matmul rate;
2. per preset (``random:k3``, ``random:qwen3-8b``, bf16): start-up (weights, graph capture,
   self-test); the step (ingest 3 rows per session + 7 greedy drafts, 1,024 context rows) at
   B = 1, 2, 4, ..., 64, dense and fast, with its floor (weights + KV + taps bytes over the copy
   bandwidth; FLOPs over the matmul rate) and its serial floor (``step_floor``: each op's own floor,
   summed); kernels and host syncs per step (torch.profiler) at
   B = 1 and 64; the mixed batch (one 32K-context session + 63 of 1K); 32K-row prefill in
   chunks against the GEMM roofline; allocation growth over the timed steps; the
   poisoned-neighbour check (one session's taps NaN/Inf, every other session's drafts unchanged);
3. float32 exactness: greedy drafts of the graph path equal the dense eager path at every
   session bucket, on a small random model of each variant.

    python3 -m draft_tools.bench.draft_step_gpu --out bench/results/draft_step_h200.json [--quick]
    python3 -m draft_tools.bench.draft_step_gpu --skip steps,server,exact --out ...   # the prefill alone
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from draft_server.drafters import DraftItem, IngestItem
from draft_server.drafters.base import DeviceRows
from draft_server.models import gemm
from draft_server.models import step as step_mod
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.kernels import fused
from draft_server.models.presets import PRESETS, random_drafter
from draft_tools.bench.step_floor import CTX, NEW_ROWS, K, floor_ms, step_cost
from protocol import GREEDY


def log(*a: object) -> None:
    print(*a, flush=True)


def bf16_rows(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


# ------------------------------------------------------------------------------------ floors


def event_s(fn: Any, iters: int, warm: int, before: Any = None) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events around each call) over ``iters`` calls after
    ``warm`` untimed ones; ``before`` runs ahead of every call, outside the timing."""
    ts = []
    for i in range(warm + iters):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warm:
            ts.append(a.elapsed_time(b) / 1000)
    return statistics.median(ts)


def gpu_machine(dev: torch.device) -> dict[str, str]:
    """What a GPU bench's JSON says of its machine."""
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "nvidia_smi": smi,
    }


def measure_floors(dev: torch.device) -> dict[str, float]:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # 1 GiB, well past the 60 MB L2
    y = torch.empty_like(x)
    bw = 2 * x.numel() / event_s(lambda: y.copy_(x), 10, warm=3)
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    n = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    flops = 2 * 8192**3 / event_s(lambda: m @ n, 10, warm=3)
    h = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)  # taps from host memory cross PCIe
    g = torch.empty(h.shape, dtype=torch.uint8, device=dev)
    h2d = h.numel() / event_s(lambda: g.copy_(h, non_blocking=True), 6, warm=2)
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": flops, "h2d_bytes_per_s": h2d}


def markov_order(d: DSparkDrafter, dev: torch.device) -> dict[str, float]:
    """The k Markov argmax kernels of one chain with the vocab blocks launched in the same order every
    step vs alternating (what ``greedy_chain`` does), each as a CUDA graph replayed after an L2 flush
    (in the step the lm_head GEMM before the chain streams 2.35 GB through the L2)."""
    m = d.model
    w2 = m.markov_w2
    if w2 is None:
        return {}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    out: dict[str, float] = {"w2_bytes": float(w2.numel() * w2.element_size())}
    for n in (1, 64):
        base = torch.randn(n, K, w2.shape[0], dtype=m.dtype, device=dev)
        w1 = torch.randn(n, w2.shape[1], dtype=w2.dtype, device=dev)  # one Markov row per session
        prev = torch.arange(n, device=dev)
        for name, alternate in (("same_order", False), ("alternating", True)):

            def chain(
                alternate: bool = alternate, base: torch.Tensor = base, w1: torch.Tensor = w1, prev: torch.Tensor = prev
            ) -> None:
                for j in range(K):
                    fused.markov_argmax_lowrank(base[:, j], prev, w1, w2, reverse=alternate and j % 2 == 1)

            chain()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            out[f"B{n}_{name}_ms"] = event_s(g.replay, 25, warm=5, before=flush.zero_) * 1e3
            del g
    return out


# ------------------------------------------------------------------------------------ sessions


class Sessions:
    """Sessions with context on a drafter, stepped the way the engine steps them."""

    def __init__(self, d: DSparkDrafter, rng: np.random.Generator, base_key: int) -> None:
        self.d, self.rng, self.base = d, rng, base_key
        self.end: dict[int, int] = {}
        self.W = d.contract.tap_width
        self.B = d.cfg.block_size
        self.pool = [bf16_rows(rng, NEW_ROWS, self.W) for _ in range(97)]  # made once, outside any timing
        self.turn = 0
        self.registered: bytearray | None = None  # the pool's registered buffer (``share_registered``)

    def open(self, n: int, ctx: int | list[int], chunk: int = 4096) -> list[int]:
        keys = [self.base + i for i in range(n)]
        ctxs = ctx if isinstance(ctx, list) else [ctx] * n
        for key, c in zip(keys, ctxs, strict=True):
            assert self.d.reserve(key, 0, c + 64 * NEW_ROWS + self.B), "KV budget too small"
            for a in range(0, c, chunk):
                r = min(chunk, c - a)
                self.d.ingest([IngestItem(key, 0, a, bf16_rows(self.rng, r, self.W))])
            self.end[key] = c
        return keys

    def step(self, keys: list[int], taps: np.ndarray | None = None) -> list[list[int]]:
        items = []
        for i, key in enumerate(keys):
            self.turn += 1
            rows = taps[i] if taps is not None else self.pool[self.turn % len(self.pool)]
            self.d.reserve(key, 0, self.end[key] + NEW_ROWS + self.B)
            items.append(IngestItem(key, 0, self.end[key], rows))
            self.end[key] += NEW_ROWS
        drafts = [DraftItem(k, 0, self.end[k], 7 + i % 11, K, GREEDY) for i, k in enumerate(keys)]
        return [o.tokens for o in self.d.step(items, drafts)]  # one call, one wait: as the server steps

    def register(self, target: Any) -> bool:
        """Move the tap pool into one host buffer registered with ``target`` (a drafter or a FastStep:
        its ``register_host``), as the server's receive arena and shm rings hold rows: no staging copy;
        False (the pool left in ordinary memory) if it cannot be registered. The buffer is ``registered``
        (undo with ``target.unregister_host(memoryview(S.registered))``)."""
        buf = bytearray(len(self.pool) * NEW_ROWS * self.W * 2)
        if not target.register_host(memoryview(buf)):
            return False
        slab = np.frombuffer(buf, dtype=np.uint16).reshape(len(self.pool), NEW_ROWS, self.W)
        slab[:] = np.stack(self.pool)
        self.pool = list(slab)
        self.registered = buf
        return True

    def rewind(self, keys: list[int], to: int) -> None:
        for k in keys:
            self.end[k] = to

    def close(self, keys: list[int]) -> None:
        for k in keys:
            self.d.release(k)
            self.end.pop(k, None)


def share_registered(fasts: list[Any], S: Sessions) -> bool:
    """The sessions' tap pool moved into one host buffer registered with the first FastStep and
    shared by the others (CUDA pins a range once), as the receive arena's rows are; False (the pool
    left in ordinary memory) if it cannot be registered. Undo with ``fasts[0].unregister_host``."""
    if not S.register(fasts[0]):
        return False
    for f in fasts[1:]:
        f._host_ranges = list(fasts[0]._host_ranges)
    return True


def captures_interleaved(
    S: Sessions, fasts: dict[Any, Any], n: int, rounds: int, steps: int
) -> tuple[dict[Any, list[float]], dict[Any, list[list[int]]]]:
    """``interleaved`` over the captures of one drafter (``fasts``: its ``fast`` swapped in per turn)."""
    return interleaved(dict.fromkeys(fasts, S), n, rounds, steps, switch=lambda name: setattr(S.d, "fast", fasts[name]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, iters: int, warm: int = 3) -> dict[str, float]:
    for _ in range(warm):
        fn()
    _sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(ts), "p90_ms": float(np.percentile(ts, 90)), "min_ms": min(ts)}


def interleaved(
    sessions: dict[Any, Sessions], n: int, rounds: int, steps: int, switch: Any = None
) -> tuple[dict[Any, list[float]], dict[Any, list[list[int]]]]:
    """Drafters side by side in one process: per mode (a key of ``sessions``), ms per step over
    ``steps`` steps of its first n sessions at CTX context, ``rounds`` times, the order of the modes
    rotating each round so the machine's drift falls on all alike; and each mode's drafts of its first
    (untimed) step. ``switch(mode)``, when given, runs before a mode's turn (one drafter captured
    several ways: it swaps the drafter's ``fast``)."""
    names = list(sessions)
    times: dict[Any, list[float]] = {m: [] for m in names}
    drafts: dict[Any, list[list[int]]] = {}
    for r in range(rounds):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            if switch is not None:
                switch(mode)
            S, ks = sessions[mode], list(range(n))
            S.rewind(ks, CTX)
            S.turn = 0
            drafts.setdefault(mode, S.step(ks))
            _sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                S.step(ks)
            _sync()
            times[mode].append((time.perf_counter() - t0) * 1e3 / steps)
    return times, drafts


def profile_counts(fn: Any) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = syncs = launches = 0
    gpu_us = 0.0
    first, last = float("inf"), 0.0  # the GPU timeline's span: busy + the gaps between kernels
    top = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if not name.startswith(("Memcpy", "Memset")):
                kernels += 1
            gpu_us += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            first, last = min(first, e.time_range.start), max(last, e.time_range.end)
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"):
            syncs += 1
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx"):
            launches += 1
    # the harness's own torch.cuda.synchronize() after the step is one of the syncs counted
    return {
        "kernels": kernels,
        "host_syncs": syncs - 1,
        "launch_calls": launches,
        "gpu_busy_ms": gpu_us / 1e3,
        "gpu_span_ms": max(last - first, 0.0) / 1e3,
        "top": top.splitlines(),
    }


def host_profile(fn: Any, iters: int = 20) -> list[str]:
    """Where the host's time goes in a step (cProfile, by own time): the part no GPU work hides."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()][-16:]


def host_copy(width: int, sessions: int = 64) -> dict[str, float]:
    """The taps' one host copy (64 sessions x 3 rows into pinned staging): numpy vs torch's threads."""
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1 << 15, (NEW_ROWS, width), dtype=np.uint16) for _ in range(sessions)]
    for p in parts:
        p.flags.writeable = False  # as socket frames are
    dst = torch.empty(sessions * NEW_ROWS, width, dtype=torch.int16, pin_memory=True)
    dst_np = dst.numpy().view(np.uint16)

    def np_cat() -> None:
        np.concatenate(parts, out=dst_np)

    def torch_cat() -> None:
        torch.cat([torch.from_numpy(p.view(np.int16)) for p in parts], out=dst)

    out: dict[str, float] = {"bytes": float(dst.numel() * 2), "torch_threads": float(torch.get_num_threads())}
    for name, f in (("numpy_ms", np_cat), ("torch_ms", torch_cat)):
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(ts[5:])
    return out


# ------------------------------------------------------------------------------------ presets


def bench_preset(name: str, floors: dict[str, float], dev: torch.device, quick: bool, skip: set[str]) -> dict[str, Any]:
    res: dict[str, Any] = {"preset": name}
    t0 = time.perf_counter()
    d = random_drafter(PRESETS[name], dev, 24 << 30, torch.bfloat16, attention="paged")
    torch.cuda.synchronize()
    res["startup_weights_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tuned_before = set(gemm.TUNER.choice)  # the tuner is process-wide: a preset before this one filled it
    prep = d.prepare(64, 4096)
    res["startup_capture_selftest_s"] = time.perf_counter() - t0
    res["prepare"] = prep
    fast = d.fast
    assert fast is not None
    mine = [k for k in gemm.TUNER.choice if k not in tuned_before]  # this preset's shapes only
    res["gemm_tuning_ms"] = {repr(k): gemm.TUNER.timings[k] for k in mine if k in gemm.TUNER.timings}
    res["gemm_choices"] = {repr(k): gemm.TUNER.choice[k] for k in mine}
    res["markov_order"] = markov_order(d, dev)
    log(f"{name} markov order: {json.dumps({k: round(v, 4) for k, v in res['markov_order'].items()})}")
    if "steps" not in skip:
        res.update(bench_steps(d, name, floors, quick, dev))
    rng = np.random.default_rng(2)
    # 32K-row prefill in chunks: the context projection GEMMs against the matmul rate
    try:
        if "prefill" in skip:
            raise KeyboardInterrupt
        pre: dict[str, Any] = {}
        key = 5000
        W = d.contract.tap_width
        rows32k = bf16_rows(rng, 32768, W)
        gemm_flops = 0.0
        for nm, t in d.model.w.items():
            if nm in ("context_proj.weight", "fc.weight"):
                gemm_flops += 2 * 32768 * t.numel()
        kv_all = d.model.kv_a_all if d.model.layout.mla else d.model.kv_w
        gemm_flops += 2 * 32768 * kv_all.numel()
        # Where the prompt's taps lie: ordinary host memory (tcp/ipc frames past the receive arena:
        # one host copy into pinned staging, then H2D), registered host memory (a shm ring: H2D
        # only) or this GPU's memory (transport cuda_ipc: a device copy).
        pipelined = step_mod.PIPELINED_ROWS
        reg_buf = bytearray(rows32k.nbytes)
        reg = np.frombuffer(reg_buf, dtype=np.uint16).reshape(rows32k.shape)
        reg[:] = rows32k
        ready = torch.cuda.Event()
        on_dev = torch.from_numpy(rows32k.view(np.int16)).to(dev)
        ready.record()
        # device_synced: the same device rows with the host waiting for each chunk before it prepares the
        # next, as ingest did before its pinned buffers were released at their copies (not at the graph's end)
        rows_dev = DeviceRows(on_dev, ready)
        sources: dict[str, Any] = {"staged": rows32k, "device": rows_dev, "device_synced": rows_dev}
        if d.register_host(memoryview(reg_buf)):
            # registered_serial: the same rows with the copy on the step's stream (no overlap), the
            # path before PIPELINED_ROWS; registered: copied up while the previous chunk computes
            sources["registered_serial"] = sources["registered"] = reg
        pre["h2d_floor_ms"] = rows32k.nbytes / floors["h2d_bytes_per_s"] * 1e3
        same_kv = True
        for chunk in (512, 1024, 2048, 4096):
            ref = None
            for where, src in sources.items():
                assert d.reserve(key, 0, 32768 + 8)
                step_mod.PIPELINED_ROWS = 1 << 30 if where == "registered_serial" else pipelined

                def run(chunk: int = chunk, src: Any = src, sync: bool = where == "device_synced") -> None:
                    for a in range(0, 32768, chunk):
                        d.ingest([IngestItem(key, 0, a, src[a : a + chunk])])
                        if sync:
                            torch.cuda.synchronize(dev)

                r = timed(run, 3, warm=1)
                pre[f"{where}_chunk_{chunk}_ms"] = r["median_ms"]
                pre[f"{where}_chunk_{chunk}_roofline"] = (
                    gemm_flops / (r["median_ms"] / 1e3) / floors["bf16_flops_per_s"]
                )
                slots = torch.from_numpy(d.cache.slots(key, np.arange(32768))).to(dev)
                kv = d.cache._flat.index_select(1, slots)  # every layer's rows of the prompt
                if ref is None:
                    ref = kv
                same_kv = same_kv and torch.equal(kv, ref)  # bitwise, whichever way the rows came
                d.release(key)
            step_mod.PIPELINED_ROWS = pipelined
            del ref, kv
            assert d.reserve(key, 0, 32768 + 8)
            g = fast._ingest_graphs.get(("bf16", chunk))  # the GPU alone: the graph, its inputs staged
            if g is not None:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(32768 // chunk):
                    g.replay()
                b.record()
                b.synchronize()
                gpu_ms = a.elapsed_time(b)
                pre[f"chunk_{chunk}_gpu_ms"] = gpu_ms
                pre[f"chunk_{chunk}_gpu_roofline"] = gemm_flops / (gpu_ms / 1e3) / floors["bf16_flops_per_s"]
            d.release(key)
        pre["same_kv_every_source"] = same_kv
        if "registered" in sources:
            d.unregister_host(memoryview(reg_buf))
        del on_dev
        pre["gemm_tflop"] = gemm_flops / 1e12
        pre["roofline_ms"] = gemm_flops / floors["bf16_flops_per_s"] * 1e3
        res["prefill_32k"] = pre
        log(f"{name} prefill 32K: {json.dumps({k: round(v, 3) for k, v in pre.items()})}")
    except KeyboardInterrupt:
        res["prefill"] = "skipped"
    except Exception:
        res["prefill_error"] = traceback.format_exc()
        log(res["prefill_error"])
    d.close()
    d.fast = None
    torch.cuda.empty_cache()
    return res


def bench_steps(d: Any, name: str, floors: dict[str, float], quick: bool, dev: torch.device) -> dict[str, Any]:
    """The decode step at B = 1..64 against its floor, kernels and host syncs, the host's share, rows
    registered or staged, the poisoned neighbour, 256-row contexts and the mixed batch."""
    res: dict[str, Any] = {}
    fast = d.fast
    rng = np.random.default_rng(1)
    S = Sessions(d, rng, 0)
    # The step's taps lie in registered host memory, as the server's receive arena (tcp/ipc frames)
    # and shm rings hold them: no staging copy (``registered_rows`` below sets the staged copy beside).
    if S.register(d):
        res["taps_in"] = "registered host memory (as the server's receive arena holds frames)"
    else:
        res["taps_in"] = "ordinary host memory (staged copy)"
    sizes = [1, 2, 4, 8, 16, 32, 64]
    keys = S.open(64, CTX)
    rows: list[dict[str, Any]] = []
    mem0 = torch.cuda.memory_allocated(dev)
    for n in sizes:
        ks = keys[:n]
        cost = step_cost(d, n, [CTX] * n, n * NEW_ROWS)
        row: dict[str, Any] = {"sessions": n, **floor_ms(cost, floors), **cost}
        # fast first, 30 timed steps with --quick too (--quick halves the dense path's). Timed 8 times right
        # after the dense path, v14's Qwen3 rows at 16-64 sessions stood 0.7-1.0 ms above v13's with no
        # change to the model code between them, and 64 sessions 1.0 ms above the timeline bench's 30
        # steps on the same card that hour (step_timeline_h200.json): not a measurement to steer by
        for mode in ("fast", "dense"):
            d.fast = fast if mode == "fast" else None
            S.rewind(ks, CTX)
            iters = 30 if mode == "fast" else (4 if quick else 8)
            r = timed(lambda ks=ks: S.step(ks), iters)
            row[f"{mode}_ms"] = r["median_ms"]
            row[f"{mode}_p90_ms"] = r["p90_ms"]
        d.fast = fast
        row["ratio_fast_to_floor"] = row["fast_ms"] / row["floor_ms"]
        row["ratio_fast_to_serial_floor"] = row["fast_ms"] / row["serial_floor_ms"]
        row["ratio_dense_to_floor"] = row["dense_ms"] / row["floor_ms"]
        rows.append(row)
        log(
            f"{name:9s} B={n:3d} dense {row['dense_ms']:8.2f} ms  fast {row['fast_ms']:7.2f} ms  "
            f"floor {row['floor_ms']:6.2f} ms ({'mem' if row['memory_ms'] >= row['compute_ms'] else 'flop'})  "
            f"fast/floor {row['ratio_fast_to_floor']:.2f}  serial floor {row['serial_floor_ms']:6.2f} ms"
        )
    res["steps"] = rows
    res["alloc_growth_bytes_over_timed_steps"] = torch.cuda.memory_allocated(dev) - mem0
    res["graph_steps"], res["eager_kernel_steps"] = fast.graph_steps, fast.eager_steps
    # kernels and host syncs per step
    prof: dict[str, Any] = {}
    for n in (1, 64):
        for mode in ("dense", "fast"):
            d.fast = fast if mode == "fast" else None
            S.rewind(keys[:n], CTX)
            try:
                prof[f"{mode}_B{n}"] = profile_counts(lambda n=n: S.step(keys[:n]))
            except Exception as e:  # the profiler is a measurement aid, not the measurement
                prof[f"{mode}_B{n}"] = {"error": repr(e)}
    d.fast = fast
    res["profile"] = prof
    S.rewind(keys, CTX)
    res["host_profile_B64"] = host_profile(lambda: S.step(keys))
    S.rewind(keys, CTX)
    res["host_copy_B64"] = host_copy(d.contract.tap_width)
    # rows already in registered host memory (a shared-memory ring): no staging copy
    ring = bytearray(64 * NEW_ROWS * d.contract.tap_width * 2)
    if d.register_host(memoryview(ring)):
        slab = np.frombuffer(ring, dtype=np.uint16).reshape(64, NEW_ROWS, -1)
        slab[:] = S.pool[0][None]
        plain = slab.copy()  # the same rows in ordinary memory (the staged path)
        res["registered_rows"] = {}
        for n in (1, 64):
            S.rewind(keys[:n], CTX)
            reg = timed(lambda n=n: S.step(keys[:n], slab[:n]), 20)["median_ms"]
            S.rewind(keys[:n], CTX)
            stage = timed(lambda n=n: S.step(keys[:n], plain[:n]), 20)["median_ms"]
            res["registered_rows"][str(n)] = {"step_ms": reg, "staged_step_ms": stage}
        d.unregister_host(memoryview(ring))
        log(f"{name} registered rows: {json.dumps(res['registered_rows'])}")
    # rows already on this GPU (transport cuda_ipc: a Step's rows copied device to device, then cut into
    # its entries): no H2D in the step. Neighbouring entries joined into one staging copy (``device_runs``)
    # against one copy per entry (the code before 2026-12-07), same run, alternating
    try:
        src = np.stack([S.pool[i % len(S.pool)] for i in range(64)]).reshape(64 * NEW_ROWS, -1)
        ready = torch.cuda.Event()
        whole = DeviceRows(torch.from_numpy(src.view(np.int16)).to(dev), ready)
        ready.record()
        cuts = [whole[i * NEW_ROWS : (i + 1) * NEW_ROWS] for i in range(64)]
        joined = step_mod.device_runs
        res["device_rows"] = {}
        for i, n in enumerate(sizes):
            got: dict[str, list[float]] = {"joined_ms": [], "per_entry_ms": []}
            for _ in range(3):
                for how, fn in (("joined_ms", joined), ("per_entry_ms", list)):
                    step_mod.device_runs = fn
                    try:
                        S.rewind(keys[:n], CTX)
                        got[how].append(timed(lambda n=n: S.step(keys[:n], cuts[:n]), 10)["median_ms"])
                    finally:
                        step_mod.device_runs = joined
            row = {k: statistics.median(v) for k, v in got.items()}
            row["ratio_joined_to_floor"] = row["joined_ms"] / rows[i]["floor_ms"]
            res["device_rows"][str(n)] = row
        log(f"{name} device rows: {json.dumps(res['device_rows'])}")
    except Exception:  # a part of its own: its failure costs the rest of the preset nothing
        res["device_rows_error"] = traceback.format_exc()
        log(res["device_rows_error"])
    log(f"{name} host copy: {res['host_copy_B64']}")
    for line in res["host_profile_B64"]:
        log("  " + line[:150])
    log(f"{name} profile: " + json.dumps({k: {a: b for a, b in v.items() if a != "top"} for k, v in prof.items()}))
    for line in prof.get("fast_B64", {}).get("top", [])[:18]:
        log("  " + line[:150])
    # poisoned neighbour: session 3's taps hold NaN/Inf; every other session drafts as with clean taps
    ks = keys[:8]
    W = d.contract.tap_width
    clean = np.stack([bf16_rows(rng, NEW_ROWS, W) for _ in ks])
    poison = clean.copy()
    poison[3, 0, ::3] = 0x7FC0  # NaN
    poison[3, 1, ::5] = 0x7F80  # +Inf
    S.rewind(ks, CTX)
    a = S.step(ks, clean)
    S.rewind(ks, CTX)
    b = S.step(ks, poison)
    res["poisoned_neighbour_others_equal"] = all(a[i] == b[i] for i in range(8) if i != 3)
    log(f"{name} poisoned neighbour: others unchanged = {res['poisoned_neighbour_others_equal']}")
    S.close(keys)
    short = S.open(64, 256)
    res["inprocess_ctx256"] = {}
    for n in (1, 64):
        S.rewind(short[:n], 256)
        res["inprocess_ctx256"][str(n)] = timed(lambda n=n: S.step(short[:n]), 20)["median_ms"]
    S.close(short)
    # mixed batch: one 32K session + 63 of 1K
    try:
        mk = S.open(63, CTX)
        S.base = 1000
        long = S.open(1, 32768)
        S.base = 0
        allk = long + mk
        ctxs = [32768] + [CTX] * 63
        cost = step_cost(d, 64, ctxs, 64 * NEW_ROWS)
        mixed: dict[str, Any] = {**floor_ms(cost, floors), **cost}
        for mode in ("dense", "fast"):
            d.fast = fast if mode == "fast" else None
            for k, c in zip(allk, ctxs, strict=True):
                S.end[k] = c
            r = timed(lambda: S.step(allk), 5 if mode == "dense" else 20)
            mixed[f"{mode}_ms"] = r["median_ms"]
        d.fast = fast
        mixed["ratio_fast_to_floor"] = mixed["fast_ms"] / mixed["floor_ms"]
        mixed["ratio_fast_to_serial_floor"] = mixed["fast_ms"] / mixed["serial_floor_ms"]
        res["mixed_32k_plus_63x1k"] = mixed
        log(f"{name} mixed: {json.dumps({k: round(v, 3) for k, v in mixed.items() if isinstance(v, float)})}")
        S.close(allk)
    except Exception:
        res["mixed_error"] = traceback.format_exc()
        log(res["mixed_error"])
    if S.registered is not None:
        d.unregister_host(memoryview(S.registered))
    return res


K3_SERVER = ("--model", "random:k3", "--device", "cuda", "--kv-budget-mib", "16384")


def server_vs_inprocess(
    inproc: dict[str, float], steps: int = 25, server_args: Sequence[str] = K3_SERVER
) -> dict[str, Any]:
    """The same K3 step through a real draft-server process and DraftClient: client wait, server
    compute (from the reply's timing) and the in-process step, 256 context rows, B = 1 and 64.
    ``server_args``: the model and device flags (and any other, e.g. ``--arena-mib 0``). Also the
    server's receive-arena counters after the run (its frames in the arena or not)."""
    from draft_tools.common import free_port, scrape
    from target_client import ClientConfig, DraftClient, StepRequest

    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "draft_server", "serve", *server_args]
    cmd += ["--max-batch-sessions", "64", "--bind", f"tcp://127.0.0.1:{port}"]
    cmd += ["--metrics-port", str(metrics_port), "--log-level", "INFO"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict[str, Any] = {"server_args": list(server_args)}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "prepared in" in line or "warm-up" in line or "receive arena" in line:
                log("  server: " + line.strip()[-160:])
            if "receive arena" in line:
                out["arena"] = line.strip().split("receive arena: ", 1)[-1]
            if line.startswith("READY"):
                break
        else:
            raise RuntimeError("draft-server exited before READY")
        out["server_start_s"] = time.perf_counter() - t0
        import threading

        threading.Thread(target=proc.stdout.read, daemon=True).start()
        client = DraftClient(ClientConfig(endpoint=f"tcp://127.0.0.1:{port}", budget_ms=3000.0))
        w = client.connect(wait=True)
        assert w is not None
        W = w.contract.tap_width
        rng = np.random.default_rng(3)
        pool = [bf16_rows(rng, 64 * NEW_ROWS, W) for _ in range(4)]
        for n in (1, 64):
            sids = [f"s{n}-{i}" for i in range(n)]
            for i0 in range(0, n, 16):  # prefill 256 rows each, 16 sessions a call
                part = sids[i0 : i0 + 16]
                reqs = [StepRequest(sid, 0, 256, 1, 0) for sid in part]
                client.step(reqs, bf16_rows(rng, 256 * len(part), W))
            pos = 256
            waits, comp, server = [], [], []
            for it in range(steps):
                reqs = [StepRequest(sid, pos, NEW_ROWS, 5, K) for sid in sids]
                t1 = time.perf_counter()
                reps = client.step(reqs, pool[it % 4][: n * NEW_ROWS])
                waits.append((time.perf_counter() - t1) * 1e3)
                assert all(len(r.tokens) == K for r in reps), [r.status for r in reps][:3]
                tm = client.last_timing
                comp.append(tm.compute_ms if tm is not None else float("nan"))
                server.append(tm.server_ms if tm is not None else float("nan"))
                pos += NEW_ROWS
            waits, comp, server = waits[5:], comp[5:], server[5:]
            row = {
                "client_wait_ms": statistics.median(waits),
                "server_ms": statistics.median(server),
                "server_compute_ms": statistics.median(comp),
                "inprocess_ms": inproc.get(str(n), float("nan")),
            }
            row["overhead_ms"] = row["client_wait_ms"] - row["server_compute_ms"]
            row["server_over_inprocess"] = row["server_compute_ms"] / row["inprocess_ms"]
            out[str(n)] = row
            log(f"server vs in process B={n}: {json.dumps({k: round(v, 3) for k, v in row.items()})}")
            client.free(sids)
        client.close()
        met = scrape(metrics_port)
        arena = {k: v for k, v in met.items() if k.startswith("draft_server_arena_") and "_created" not in k}
        out["arena_counters"] = arena
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def exact_float32(dev: torch.device) -> dict[str, Any]:
    """Graph path == dense eager path, token for token, at every bucket, float32, small models."""
    from draft_server.models.tiny import K3_CONFIG, QWEN3_CONFIG

    out: dict[str, Any] = {}
    for name, cfg in (("k3", K3_CONFIG), ("qwen3", QWEN3_CONFIG)):
        cfg = {**cfg, "hidden_size": 256, "intermediate_size": 512, "target_hidden_size": 256}
        d = random_drafter(cfg, dev, 256 << 20, torch.float32, attention="paged")
        d.prepare(64, 1024)
        fast = d.fast
        rng = np.random.default_rng(7)
        S = Sessions(d, rng, 0)
        keys = S.open(64, [int(x) for x in rng.integers(0, 3000, 64)])
        per: dict[str, bool] = {}
        W = d.contract.tap_width
        for n in [1, 2, 3, 4, 8, 13, 16, 32, 64]:
            ks = keys[:n]
            ends = {k: S.end[k] for k in ks}
            taps = np.stack([bf16_rows(rng, NEW_ROWS, W) for _ in ks])
            a = S.step(ks, taps)
            for k in ks:
                S.end[k] = ends[k]
            d.fast = None
            b = S.step(ks, taps)
            d.fast = fast
            per[str(n)] = a == b
        out[name] = {"buckets_equal": per, "graph_steps": fast.graph_steps, "eager_kernel_steps": fast.eager_steps}
        log(f"float32 {name}: graph == dense at every bucket: {all(per.values())} {per}")
        d.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/draft_step_h200.json")
    ap.add_argument("--presets", default="k3,qwen3-8b")
    ap.add_argument("--quick", action="store_true", help="fewer timed iterations (of the slow paths)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: steps, prefill, server, exact")
    ap.add_argument("--no-skinny", action="store_true", help="the GEMM tuner without its skinny strategy (an A/B)")
    ap.add_argument(
        "--server-spin-ms",
        default="0",
        help="the server part once per value, each a server with that --idle-spin-ms (0: it sleeps when idle); "
        "the first value's result is server_vs_inprocess, the i-th after it server_vs_inprocess_<i>_spin<X>",
    )
    args = ap.parse_args()
    if args.no_skinny:
        gemm.SKINNY_ROWS = 0
    dev = torch.device("cuda")
    report: dict[str, Any] = {
        "command": "python3 -m draft_tools.bench.draft_step_gpu " + " ".join(sys.argv[1:]),
        "machine": gpu_machine(dev),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    import triton

    report["machine"]["triton"] = triton.__version__

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=float)

    skip = set(filter(None, args.skip.split(",")))
    report["floors"] = measure_floors(dev)
    log(f"floors: {report['floors']}")
    save()
    for name in args.presets.split(","):
        try:
            report[name] = bench_preset(name, report["floors"], dev, args.quick, skip)
        except Exception:
            report[f"{name}_error"] = traceback.format_exc()
            log(report[f"{name}_error"])
        save()
    if "server" not in skip and "k3" in report and "inprocess_ctx256" in report["k3"]:
        inproc = report["k3"]["inprocess_ctx256"]
        for i, spin in enumerate(args.server_spin_ms.split(",")):
            key = "server_vs_inprocess" if i == 0 else f"server_vs_inprocess_{i}_spin{spin}"
            spin_args = ("--idle-spin-ms", spin) if float(spin) else ()
            try:
                report[key] = server_vs_inprocess(inproc, server_args=(*K3_SERVER, *spin_args))
            except Exception:
                report[f"{key}_error"] = traceback.format_exc()
                log(report[f"{key}_error"])
            save()
    try:
        if "exact" not in skip:
            report["float32_exact"] = exact_float32(dev)
    except Exception:
        report["float32_exact_error"] = traceback.format_exc()
        log(report["float32_exact_error"])
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
