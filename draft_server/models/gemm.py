"""The dense weight GEMMs of the draft step, each shape computed the way that is fastest on this GPU.

cuBLAS's heuristic picks poorly for some of the row counts a draft step meets. Measured on one
H200 (``bench/results/step_anatomy_h200.json``): Kimi-K3's gate/up projection at 448 rows (64
sessions x 7 block rows) takes 0.47 ms as called and 0.28 ms with the rows padded to 512; the
lm_head at 448 rows 1.72 ms, at 2 x 224 rows 1.46 ms; at 7-56 rows cuBLAS leaves bandwidth unused
on the smaller weights (``bench/results/skinny_sweep_h200.json``: K3's down projection at 7 rows
0.056 ms, 0.051 with the Triton kernel). So every product goes through ``linear`` /
``linear_add`` here, which look its shape up in ``TUNER``:

- ``plain``: ``F.linear`` / ``addmm`` as called;
- ``pad``: the rows padded (zeros) to a multiple of 128, the first M output rows kept;
- ``split``: the rows in two halves, each a GEMM into its slice of one output;
- ``skinny`` (bf16 / fp16, at most 64 rows): ``kernels/skinny.py``, with the launch shape that
  timed fastest for this shape (its own partials and counters, kept by the tuner).

All compute the same product; only the kernel (so the summation order) differs. ``GemmTuner``
times them once per shape (out, in, rows, dtype, with or without the residual) on CUDA while
tuning is on (``FastStep.capture`` turns it on for its warm-up runs, before any graph is captured;
never while a stream captures), each as replays of its own CUDA graph after the L2 is flushed (as
the step runs it: from HBM, no Python launch), and keeps the fastest if it beats plain by 3%. On
the CPU, and for a shape never tuned, the plain op: the tests' reference paths are untouched.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

PAD = 128
MIN_GAIN = 0.03  # a strategy other than plain must be this much faster
STRATEGIES = ("plain", "pad", "split")  # shape-free ways (``_RUN``); ``skinny`` is made per shape
SKINNY_ROWS = 64  # 128 tied it at 8-32 sessions on an H100 (bench/results/skinny_rows_ab_h100.json)
# launch shapes tried for ``skinny``: the winners of the H200 sweep (skinny_sweep_h200.json)
SKINNY_SHAPES = [(bn, bk, s) for bn, bk in ((32, 128), (64, 256), (128, 128), (128, 256)) for s in (1, 2, 4)]
FLUSH_BYTES = 256 << 20  # written before each timed replay: the L2 (50 MB on an H200) holds no weight

Key = tuple[int, int, int, torch.dtype, bool]  # (out, in, rows, dtype, residual)
log = logging.getLogger(__name__)


def _plain(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w.t()) if h is None else torch.addmm(h, x, w.t())


def _pad(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    M = x.shape[0]
    extra = -M % PAD
    xp = F.pad(x, (0, 0, 0, extra))
    hp = None if h is None else F.pad(h, (0, 0, 0, extra))
    return _plain(xp, w, hp)[:M]


def _split(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    M = x.shape[0]
    a = (M // 2 + 7) // 8 * 8
    y = torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device)
    for lo, hi in ((0, a), (a, M)):
        if h is None:
            torch.mm(x[lo:hi], w.t(), out=y[lo:hi])
        else:
            torch.addmm(h[lo:hi], x[lo:hi], w.t(), out=y[lo:hi])
    return y


_RUN: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "plain": _plain,
    "pad": _pad,
    "split": _split,
}


def graph_ms(fn: Callable[[], object], flush_l2: bool = True, runs: int = 7) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed, as the step runs it (no Python
    launch in the time). ``flush_l2``: a 256 MB write before each replay, so operands come from HBM
    (it also keeps the GPU busy while the timing events and the replay are enqueued). Two eager
    runs first (Triton compiles; scratch grows outside the capture)."""
    for _ in range(2):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(FLUSH_BYTES if flush_l2 else 0, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(runs):
        if flush_l2:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


class GemmTuner:
    """Per-shape strategy table (see the module docstring)."""

    def __init__(self) -> None:
        self.choice: dict[Key, str] = {}
        self.timings: dict[Key, dict[str, float]] = {}
        self.skinny: dict[tuple[Key, torch.device], Callable[..., torch.Tensor]] = {}  # chosen kernels
        self.tuning = False

    def strategy(self, key: Key, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> str:
        s = self.choice.get(key)
        if s is not None:
            return s
        if not self.tuning or not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return "plain"
        self.choice[key] = s = self._tune(key, x, w, h)
        return s

    def _tune(self, key: Key, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> str:
        if x.shape[0] < 2:
            return "plain"
        x = torch.randn_like(x)  # timed on fresh random operands, never the caller's (maybe zero) rows
        h = None if h is None else torch.randn_like(h)
        times: dict[str, float] = {}
        M = x.shape[0]
        for name in STRATEGIES:
            if (name == "pad" and M % PAD == 0) or (name == "split" and M < 64):
                continue
            fn = _RUN[name]
            times[name] = graph_ms(lambda fn=fn: fn(x, w, h))
        from triton.runtime.errors import OutOfResources

        kernels = self._skinny_kernels(x, w, h)
        for name, k in list(kernels.items()):
            try:
                times[name] = graph_ms(lambda k=k: k(x, w, h))
            except OutOfResources as e:  # a launch shape this GPU cannot hold is not a candidate
                log.warning("GEMM %s: %s skipped (%s)", key, name, e)
                del kernels[name]
        self.timings[key] = times
        best = min(times, key=lambda n: times[n])
        if times[best] >= (1.0 - MIN_GAIN) * times["plain"]:
            return "plain"
        if best in kernels:
            self.skinny[key, x.device] = kernels[best]
            return "skinny"
        return best

    @staticmethod
    def _skinny_kernels(
        x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None
    ) -> dict[str, Callable[..., torch.Tensor]]:
        """The ``skinny`` launch shapes that can run this product, by name (none past SKINNY_ROWS rows,
        in float32, or with operands whose last dim is strided)."""
        M, K = x.shape
        if M > SKINNY_ROWS or x.dtype not in (torch.bfloat16, torch.float16) or not _unit_stride(x, w, h):
            return {}
        from draft_server.models.kernels.skinny import SkinnyConfig, SkinnyGemm

        out = {}
        for bn, bk, split in SKINNY_SHAPES:
            cfg = SkinnyConfig(block_n=bn, block_k=bk, split=split)
            if SkinnyGemm.fits(M, K, cfg):
                out[f"skinny {bn}x{bk}/{split}"] = SkinnyGemm(M, w.shape[0], K, cfg, x.device)
        return out

    def summary(self) -> dict[str, int]:
        """How many tuned shapes took each strategy."""
        out = dict.fromkeys((*STRATEGIES, "skinny"), 0)
        for s in self.choice.values():
            out[s] += 1
        return out


TUNER = GemmTuner()


def _unit_stride(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> bool:
    return x.stride(-1) == 1 and w.stride(-1) == 1 and (h is None or h.stride(-1) == 1)


def _gemm(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    h2 = None if h is None else h.reshape(-1, h.shape[-1])
    key = (int(w.shape[0]), int(w.shape[1]), int(x2.shape[0]), x.dtype, h is not None)
    s = TUNER.strategy(key, x2, w, h2)
    if s == "skinny":
        k = TUNER.skinny.get((key, x2.device))
        y = k(x2, w, h2) if k is not None and _unit_stride(x2, w, h2) else _plain(x2, w, h2)
    else:
        y = _RUN[s](x2, w, h2)
    return y.view(*lead, w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b): ``F.linear``, in the tuned way for its shape on CUDA."""
    if b is not None or not x.is_cuda or x.dim() < 2:
        return F.linear(x, w, b)
    return _gemm(x, w, None)


def linear_add(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h + x @ w.T in one GEMM (the residual add in the epilogue), in the tuned way for its shape."""
    return _gemm(x, w, h).view(h.shape)
