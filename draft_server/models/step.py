"""The fast draft step: paged attention kernels, the Markov chain on the device, CUDA graphs.

``FastStep`` owns static device buffers sized for the largest batch, and one pinned host buffer
that carries every per-step integer (each session's anchor, position, context span and block
width; the ragged page list) to the device in one copy. Greedy draft steps run the same body

    the block rows' ids, positions and cache slots from those (one kernel) -> plan the split-K
    work -> block forward over ``PagedContext`` -> logits -> k Markov steps
    (argmax, Markov bias, confidence) -> tokens and confidence into static outputs

either captured as a CUDA graph per session bucket (1, 2, 4, ... sessions, each with a fixed
work capacity) or, on the CPU (Triton's interpreter) and for batches whose contexts exceed the
bucket's capacity, run eagerly with the same kernels. Results come back in one device-to-host
copy into pinned memory and one wait. Context ingest has its own graphs, per wire format and row
bucket (``protocol.wire``: bf16 or fp8 taps, or projected context rows); the formats share one
pinned staging buffer and one device buffer (ingests run one at a time, in stream order). The host
describes an ingest in a few ints per item (first row, first position, page base) and the items'
pages; the graph's first kernel (``pa.ingest_rows``) makes every row's cache slot and position.

MLA in bf16 on a Hopper GPU with 64-token pages runs through FlashMLA (``kernels/flash_mla.py``):
its table, lengths and split plan are made inside the body. The kernels see each session's positions
from its first page (the cache's ``origin``: every span starts at offset 0 of a page); a draft asked
from a later start than its span's runs eagerly with the Triton kernel beside FlashMLA (``_stage``'s ``mid``).

Start-up tuning (CUDA, before any capture): every GEMM shape the buckets meet picks its fastest
form (``gemm``); the choices are fixed before the first graph is captured.

Nothing in a step reads the device from the host before its end: no ``.item()``, no
``.tolist()``, no host-built tensors. Every captured bucket is replayed once against the eager
run of the same body before the server takes traffic (``self_test``); the test suite holds the
kernel path to the eager dense path on the CPU in float32.

Padding (a bucket larger than the batch): padding sessions have ``lo > pos`` (no attention work,
zero output), their block rows and padding ingest rows write into the cache's trash page.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from draft_server.drafters.base import DeviceRows, DraftItem, IngestItem, by_format, device_runs
from draft_server.models import gemm
from draft_server.models.attention import PagedBatch, PagedContext
from draft_server.models.kernels import flash_mla as fm
from draft_server.models.kernels import fused
from draft_server.models.kernels import paged_attention as pa
from draft_server.models.kv_cache import PagedKVCache
from draft_server.models.model import DSparkModel
from draft_server.models.staging import STORAGE, context_rows
from protocol import GREEDY, WireOffer
from protocol.wire import BF16_ONLY, row_layout

GRAPH_CONTEXT = 4096  # a graph bucket's work capacity covers every session up to this context
# Split-K chunk per batch: about WORK_ITEMS chunks over all its tokens (MLA, GQA), so one session
# still spreads over the SMs and 64 of 1K need no partials at all, never below MIN_CHUNK. Graph buckets
# are planned for TYPICAL_CONTEXT. Both swept as CUDA-graph replays, the way the step runs them.
# MLA at K3 dims on one H200 (bench/results/mla_sweep_h200_v3.json): the best chunk was 128 for 1 x 1K,
# 256 for 2 x 1K and 4 x 1K, 512 for 8 x 1K, 2048 for 64 x 1K and 32K + 63 x 1K; 16 items gives 128 /
# 128 / 256 / 512 / 2048 / 2048 (2 x 1K: 0.040 ms per layer against 0.069 at the 64 that 40 items
# gave; 4 x 1K: 0.049 vs 0.072). GQA at Qwen3-8B dims, whole steps on one H100
# (bench/results/split_sweep_gqa_h100.json, 40 / 16 / 8 / 4 items): 40 was best or tied from 4
# sessions (16 sessions: 2.143 ms against 2.20 with fewer items), and at 1 and 2 sessions chunks of 128
# beat the 64 that 40 items gives there by 0.014-0.015 ms a step (rounds within 0.005): hence the 128 floor.
TYPICAL_CONTEXT, WORK_ITEMS = 1024, {True: 16, False: 40}
MIN_CHUNK, MAX_CHUNK = 128, 2048
# One MLA session: chunks of 128 (MIN_CHUNK) with the kernel's small-tile launch shape (pa.MLA_CONFIG_ONE):
# stage 1 + 2 at 1 x 1K took 0.0315 ms per layer so, against 0.0423 with 16 items (chunk 64) and
# MLA_CONFIG, and 0.039 with that shape at 64 (same run, mla_sweep_h200_v3.json). From 2 sessions
# MLA_CONFIG wins at every chunk there. In the whole K3 step: 2.426 vs 2.441 ms at one session, a
# 2-session control showing 0.03 ms of bias against it (one_session_mla_h200.json).
ONE_SESSION_MLA_CHUNK = 128
# An ingest of at least this many rows from registered host memory (a prefill chunk from the shm
# ring) copies them up on a copy stream, overlapped with the previous chunk's graph; smaller ones
# (decode steps) copy on the step's stream, with no extra device copy.
PIPELINED_ROWS = 512
SESSION_FIELDS = ("anchor", "t0", "lo", "pos", "first", "width")  # a draft's per-session step inputs, in order


_HOST_REGISTER_PORTABLE, _HOST_REGISTER_READ_ONLY = 0x01, 0x08  # cudaHostRegister flags


def _storage(rows: np.ndarray) -> np.ndarray:
    """Rows as torch can hold them: bf16 bit patterns (uint16) as int16, others as they are."""
    return rows.view(np.int16) if rows.dtype == np.uint16 else rows


def _copy_runs(dst: torch.Tensor, runs: Sequence[np.ndarray]) -> None:
    """Registered host rows, run after run, to the head of ``dst`` on the current stream (asynchronous)."""
    off = 0
    for run in runs:
        dst[off : off + len(run)].copy_(torch.from_numpy(run), non_blocking=True)
        off += len(run)


def _join(parts: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``parts`` one after another into ``out`` (exactly their total length), cast to its dtype."""
    if len(parts) == 1:
        out[:] = parts[0]
    elif parts:
        np.concatenate(parts, out=out, casting="unsafe")


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Garbage collection held off (after one collection) for the block, and restored as it was.
    For graph capture: a collection that frees an earlier object's pinned host buffer has torch's
    host allocator record and query CUDA events, which invalidates a capture in progress
    (``cudaErrorStreamCaptureInvalidated``)."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _buckets(top: int) -> list[int]:
    return sorted({min(1 << i, top) for i in range(max(1, top).bit_length() + 1)})


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class _DraftGraph:
    n: int
    batch: PagedBatch
    graph: torch.cuda.CUDAGraph | None
    chunk: int  # of its work plan
    capacity: int  # work items its plan holds


class FastStep:
    def __init__(
        self,
        model: DSparkModel,
        cache: PagedKVCache,
        *,
        max_sessions: int,
        max_rows: int,
        graphs: bool,
        sts: torch.Tensor,
        max_context: int = 1 << 20,
        offer: WireOffer = BF16_ONLY,  # the wire formats ingested
        width: Callable[[int], int] | None = None,  # block rows for k drafts (DSparkDrafter.width)
    ) -> None:
        self.m, self.cache, self.sts = model, cache, sts
        self.width = width or (lambda k: model.cfg.block_size)
        cfg = model.cfg
        self.B = cfg.block_size
        self.P = cache.page_size
        self.dev = model.device
        self.use_graphs = graphs and self.dev.type == "cuda"
        self.session_buckets = _buckets(max_sessions)
        self.row_buckets = [r for r in _buckets(max(16, max_rows)) if r >= 16]
        self.n_max, self.r_max = self.session_buckets[-1], self.row_buckets[-1]
        self.pages_cap = min(cache.num_pages + 1, max_context // self.P + 2) + self.n_max * 2
        n, B = self.n_max, self.B
        # packed int32 step inputs, per session: anchor | t0 (its first block position) | lo | pos |
        # first | width, then the count of real sessions, then the pages (ragged). The block rows'
        # ids, positions and slots are made from them on the device (``pa.stage_rows``).
        self._off: dict[str, tuple[int, int]] = {}
        for i, name in enumerate(SESSION_FIELDS):
            self._off[name] = (i * n, (i + 1) * n)
        self._count_at = len(SESSION_FIELDS) * n
        self._pages_at = self._count_at + 1
        total = self._pages_at + self.pages_cap
        pin = self.dev.type == "cuda"
        self.host = torch.empty(total, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self._fields = self.host_np[: self._count_at].reshape(len(SESSION_FIELDS), n)  # a view: [field, session]
        self.stage = torch.empty(total, dtype=torch.int32, device=self.dev)
        self.ids = torch.zeros(n, B, dtype=torch.int32, device=self.dev)
        self.positions = torch.zeros(n, B, dtype=torch.int32, device=self.dev)
        self.slots = torch.full((n, B), cache.trash_slot, dtype=torch.int32, device=self.dev)
        # outputs: tokens [n, B] int64, confidence [n, B] float32, packed for one D2H
        self.out = torch.zeros(n, 2 * B, dtype=torch.float64, device=self.dev)
        self.out_host = torch.empty(n, 2 * B, dtype=torch.float64, pin_memory=pin)
        # ingest: rows in their wire storage (one byte buffer, pinned and on the device, viewed per
        # format as [r_max, width] of its dtype: ``_rows``) + slots + positions
        self.formats: dict[str, tuple[torch.dtype, int]] = {}
        for f in offer.formats:
            dtype, width = row_layout(f, cfg.contract(), offer)
            self.formats[f] = (STORAGE[dtype], width)
        row_bytes = max(w * t.itemsize for t, w in self.formats.values())
        self._row_views: dict[tuple[int, str], torch.Tensor] = {}
        self.rows_host = torch.empty(self.r_max * row_bytes, dtype=torch.uint8, pin_memory=pin)
        self.rows = torch.zeros(self.r_max * row_bytes, dtype=torch.uint8, device=self.dev)  # see _rows_dirty
        # an ingest's description (``pa.ingest_rows``: items, rows, each item's first row, position and
        # page base, the pages) -> its rows' cache slots and positions, made by the ingest graph's first kernel
        self.spec_host = torch.empty(2 + 3 * self.r_max + self._ingest_pages_cap(), dtype=torch.int32, pin_memory=pin)
        self.spec_host_np = self.spec_host.numpy()
        self.spec = torch.zeros_like(self.spec_host, device=self.dev)
        self.ing = torch.empty(2 * self.r_max, dtype=torch.int32, device=self.dev)
        self._staging_read = torch.cuda.Event() if self.dev.type == "cuda" else None
        self._rows_read = torch.cuda.Event() if self.dev.type == "cuda" else None
        self._rows_pending = False  # copies from callers' registered rows not yet waited for
        self._staging_pending = False  # copies from rows_host / spec_host queued since the stream was last waited for
        self._unrecorded: torch.cuda.Stream | None = None  # the stream of an ingest pass that recorded no events
        # byte ranges of ``rows`` that may be non-zero (all others are zero): the head the last ingest
        # wrote, and what longer ingests before it wrote past the rows it zeroed
        self._rows_dirty: list[tuple[int, int]] = []
        # large ingests from registered rows (a prefill from the shm ring): their H2D copy runs on
        # a copy stream into one of two landing buffers while the previous chunk's graph computes
        self._landing = [torch.empty_like(self.rows) for _ in range(2 if self.dev.type == "cuda" else 0)]
        self._landing_free = [torch.cuda.Event(), torch.cuda.Event()] if self.dev.type == "cuda" else []
        self._landing_next = 0
        self._copy_stream = torch.cuda.Stream(self.dev) if self.dev.type == "cuda" else None
        self._host_ranges: list[tuple[int, int, np.ndarray]] = []  # registered host buffers: (start, end, bytes)
        self._host_lock = threading.Lock()  # (un)registrations come from the I/O thread and the ring unmapper
        H = cfg.num_heads
        v_dim = model.layout.value_dims
        self._out_shape = (B, H, v_dim)
        self._ws: pa.Workspace | None = None
        self._draft_graphs: dict[int, _DraftGraph] = {}
        self._ingest_graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # by (format, row bucket)
        dims = (model.token_shape[0], v_dim)
        kernel = fm.kernel_for(model.layout.mla, model.dtype, self.dev, dims, self.P)
        self.flash = (
            None
            if kernel is None
            else fm.FlashMLA.allocate(
                kernel, n_max=n, rows=B, heads=H, dims=dims, page=self.P, cols=self.pages_cap, causal=cfg.causal,
                scale=cfg.softmax_scale, trash_page=cache.num_pages, dtype=model.dtype, device=self.dev,
            )
        )  # fmt: skip
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.capture_s = 0.0
        self.graph_steps = 0
        self.eager_steps = 0

    def _view(self, name: str) -> torch.Tensor:
        a, b = self._off[name]
        return self.stage[a:b]

    def _pages(self) -> torch.Tensor:
        return self.stage[self._pages_at :]

    def _chunk(self, tokens: int) -> int:
        """Split-K chunk for a batch of ``tokens`` context rows in all (its sessions' spans with their
        blocks): about WORK_ITEMS chunks (a power of two, a multiple of the page, within MIN_CHUNK..MAX_CHUNK)."""
        want = max(1, tokens // WORK_ITEMS[self.m.layout.mla])
        return max(MIN_CHUNK, self.P, min(MAX_CHUNK, 1 << (want - 1).bit_length()))

    def _capacity(self, n: int) -> int:
        per = -(-(GRAPH_CONTEXT + self.B + self.P - 1) // self._chunk(n * (TYPICAL_CONTEXT + self.B)))
        return 1 << max(0, (n * per - 1).bit_length())

    # ------------------------------------------------------------------ body (captured or eager)

    def _workspace(self, capacity: int) -> pa.Workspace:
        """One split-K workspace for every bucket (graphs replay one at a time), grown on demand (a
        grown one is new: the graphs keep theirs)."""
        _, H, v = self._out_shape
        if self._ws is None or self._ws.partial_out.shape[0] < capacity:
            self._ws = pa.Workspace.allocate(capacity, self.B * H, v, self.dev)
        return self._ws

    def _batch(self, n: int, capacity: int, chunk: int) -> PagedBatch:
        B, (_, H, v) = self.B, self._out_shape
        if self.m.layout.mla:  # head-major, so the W_UV product reads it without a copy
            out = torch.empty((H, n, B, v), dtype=self.m.dtype, device=self.dev).permute(1, 2, 0, 3)
        else:
            out = torch.empty((n, B, H, v), dtype=self.m.dtype, device=self.dev)
        return PagedBatch(
            pages=self._pages().as_strided((n, self.pages_cap), (0, 1)),  # ragged: first[] carries the offsets
            first=self._view("first")[:n],
            lo=self._view("lo")[:n],
            pos=self._view("pos")[:n],
            slots=self.slots[:n].view(n * B),  # int32: the kernels writing cache rows read it as is
            width=self._view("width")[:n],
            plan=pa.WorkPlan.empty(n, capacity, rows=B, chunk=chunk, page_size=self.P, device=self.dev),
            workspace=self._workspace(capacity),
            out=out,
            config=pa.MLA_CONFIG_ONE if self._one_session_shape(n, chunk) else None,
            flash=self.flash,
        )

    def _one_session_shape(self, n: int, chunk: int) -> bool:
        """Whether an MLA batch of n sessions in chunks of ``chunk`` takes ``pa.MLA_CONFIG_ONE``."""
        return self.m.layout.mla and n == 1 and chunk <= ONE_SESSION_MLA_CHUNK and self.m.dtype.itemsize == 2

    def _block(self, n: int, batch: PagedBatch) -> torch.Tensor:
        """The block forward of the staged batch over the paged cache: z [n, B, H]."""
        m = self.m
        pa.stage_rows(
            self.stage[: self._pages_at], self._pages(), self.ids[:n], self.positions[:n], self.slots[:n],
            mask_id=m.cfg.mask_token_id, trash_slot=self.cache.trash_slot, page_size=self.P,
        )  # fmt: skip
        plan: pa.WorkPlan = batch.plan  # type: ignore[assignment]
        if self.flash is None or batch.mixed:
            pa.plan_work(batch.lo, batch.pos, rows=self.B, chunk=plan.chunk, page_size=self.P, out=plan)
        if self.flash is not None:
            self.flash.prepare(n, self._pages(), batch.first, batch.lo, batch.pos, batch.width)
        ctx = PagedContext(self.cache, batch, m.layout, m.cfg.softmax_scale, m.cfg.causal)
        return m.block(self.ids[:n], self.positions[:n], ctx)

    def _draft_body(self, n: int, batch: PagedBatch) -> None:
        z = self._block(n, batch)
        tokens, conf = greedy_chain(self.m, z, self.ids[:n, 0], self.B, self.sts)
        self.out[:n, : self.B].copy_(tokens)
        if conf is not None:
            self.out[:n, self.B :].copy_(conf)

    def _rows(self, buf: torch.Tensor, fmt: str) -> torch.Tensor:
        """``buf`` (rows_host, rows or a landing buffer) as [r_max, width] rows of ``fmt``'s wire storage
        (the views made once: the buffers live as long as this step)."""
        view = self._row_views.get((buf.data_ptr(), fmt))
        if view is None:
            dtype, width = self.formats[fmt]
            view = buf[: self.r_max * width * dtype.itemsize].view(dtype).view(self.r_max, width)
            self._row_views[buf.data_ptr(), fmt] = view
        return view

    def _ingest_body(self, fmt: str, r: int) -> None:
        m = self.m
        pa.ingest_rows(self.spec, self.ing, r, trash_slot=self.cache.trash_slot, page_size=self.P)
        c = context_rows(m, self._rows(self.rows, fmt)[:r], fmt)
        positions = self.ing[self.r_max : self.r_max + r]
        m.write_context(self.cache, self.ing[:r], c, positions)

    # ------------------------------------------------------------------ capture

    def capture(self) -> dict[str, float]:
        """Capture every bucket (largest first, sharing one memory pool); returns counts and seconds."""
        if not self.use_graphs:
            return {"graphs": 0.0, "seconds": 0.0}
        t0 = time.perf_counter()
        self._fill_padding_inputs()
        torch.cuda.synchronize(self.dev)
        s = torch.cuda.Stream(self.dev)
        s.wait_stream(torch.cuda.current_stream(self.dev))
        gemm.TUNER.tuning = True  # the warm-up runs time each new GEMM shape's strategies (never a capture)
        try:
            with no_collection():
                self._capture_all(s)
        finally:
            gemm.TUNER.tuning = False
        torch.cuda.current_stream(self.dev).wait_stream(s)
        torch.cuda.synchronize(self.dev)
        self.capture_s = time.perf_counter() - t0
        tuned = gemm.TUNER.summary()
        return {
            "graphs": float(len(self._draft_graphs) + len(self._ingest_graphs)),
            "seconds": self.capture_s,
            "gemm_shapes_padded": float(tuned["pad"]),
            "gemm_shapes_split": float(tuned["split"]),
            "gemm_shapes_skinny": float(tuned["skinny"]),
        }

    def _capture_all(self, s: torch.cuda.Stream) -> None:
        with torch.cuda.stream(s), torch.inference_mode():
            for n in reversed(self.session_buckets):
                chunk, capacity = self._chunk(n * (TYPICAL_CONTEXT + self.B)), self._capacity(n)
                batch = self._batch(n, capacity, chunk)
                for _ in range(2):  # warm: Triton compiles, cuBLAS picks its kernels
                    self._draft_body(n, batch)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool, stream=s):
                    self._draft_body(n, batch)
                self._draft_graphs[n] = _DraftGraph(n, batch, g, chunk, capacity)
            for fmt in self.formats:
                for r in reversed(self.row_buckets):
                    self._ingest_body(fmt, r)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self._pool, stream=s):
                        self._ingest_body(fmt, r)
                    self._ingest_graphs[fmt, r] = g

    def _fill_padding_inputs(self) -> None:
        """Inputs of an all-padding batch: capture and warm runs write only into the trash page."""
        h = self.host_np
        h[: self._pages_at] = 0  # no real session: every block row is padding
        self._pad(0, self.n_max)
        h[self._pages_at : self._pages_at + self.pages_cap] = self.cache.num_pages
        self.stage.copy_(self.host)
        self.spec.zero_()  # no item, no row: every row is padding
        self.rows.zero_()
        self._rows_dirty = []

    def _pad(self, a: int, b: int) -> None:
        """Sessions a..b of the pinned buffer as padding: no context, no work (lo > pos), full width."""
        self._fields[2:, a:b] = ((1,), (0,), (0,), (self.B,))  # lo, pos, first, width

    # ------------------------------------------------------------------ per step

    def ingest(self, items: Sequence[IngestItem], wait: bool = True) -> None:
        """Write the rows of several sessions (distinct keys) through the ingest graph of their
        wire format and row bucket. ``wait=False``: rows in registered host memory may still be on
        their way to the device when this returns; ``rows_done`` (or the end of the next ``draft``,
        which waits for the stream) makes them the caller's again."""
        stream = torch.cuda.current_stream(self.dev) if self.dev.type == "cuda" else None  # once: ~5 us a lookup
        try:
            groups = by_format(items)
            for g, (fmt, group) in enumerate(groups):
                counts = [len(it.taps) for it in group]
                rows = sum(counts)
                for a in range(0, rows, self.r_max):
                    b = min(rows, a + self.r_max)
                    # the last pass of a call that does not wait records no events: the draft after it
                    # waits for the whole stream (``_settle`` where anything else needs its copies done)
                    record = wait or b < rows or g + 1 < len(groups)
                    whole = a == 0 and b == rows and 0 not in counts
                    self._ingest_rows(fmt, group, a, b, stream, record, whole)
        finally:
            if wait:
                self.rows_done()

    def rows_done(self) -> None:
        """Return once every device copy from the callers' registered rows has finished."""
        self._settle()
        if self._rows_pending and self._rows_read is not None:
            self._rows_read.synchronize()
        self._rows_pending = False

    def _settle(self) -> None:
        """An ingest pass that recorded no events (``ingest(wait=False)``'s last) waited for by its whole
        stream: every copy it queued, from the callers' rows and from the staging buffers, is done."""
        if self._unrecorded is not None:
            self._unrecorded.synchronize()
            self._unrecorded = None
            self._rows_pending = self._staging_pending = False

    def _ingest_rows(
        self,
        fmt: str,
        items: Sequence[IngestItem],
        a: int,
        b: int,
        stream: torch.cuda.Stream | None,
        record: bool,
        whole: bool,
    ) -> None:
        """Rows a..b (in item order, all of wire format ``fmt``) through the ingest graph of their bucket.
        The rows' copy to the device is issued first, so it runs while the host describes the items
        (``_describe``: the graph's first kernel makes the rows' cache slots from that). ``record``: the
        events that free the callers' rows and the staging buffers are recorded (two CUDA calls); else
        the pass leaves its stream to be waited for (``_settle``). ``whole``: the pass is every row of
        every item (a decode step), none of them empty."""
        r = b - a
        rb = _bucket(max(r, 16), self.row_buckets)
        # (key, first position, rows, rows' part) of each item in the window: every item whole in a
        # decode step; rows a..b of a longer ingest (a prefill past r_max rows) cut from the items
        if whole:
            cut = [(it.key, it.pos, len(it.taps), it.taps) for it in items]
        else:
            cut, row = [], 0
            for it in items:
                lo_r, hi_r = max(a - row, 0), min(b - row, len(it.taps))
                if lo_r < hi_r:
                    cut.append((it.key, it.pos + lo_r, hi_r - lo_r, it.taps[lo_r:hi_r]))
                row += len(it.taps)
        keys, firsts, counts, parts = zip(*cut, strict=True)
        host, dev = self._rows(self.rows_host, fmt), self._rows(self.rows, fmt)
        on_device = any(isinstance(p, DeviceRows) for p in parts)
        runs = None if on_device else self._registered_runs(parts)
        landed = None
        if runs is not None and r >= PIPELINED_ROWS and self._copy_stream is not None:
            landed = self._land(fmt, runs)  # issued before waiting for the previous chunk's staging copies
        self._settle()
        if self._staging_read is not None and self._staging_pending:
            # the pinned buffers are free again once the last chunk's copies from them ran (they precede its
            # graph): the host prepares this chunk while that graph computes, and the GPU finds it queued
            self._staging_read.synchronize()
        if landed is not None:  # this chunk's rows, copied up while the previous one computed
            land, i = landed
            assert stream is not None
            stream.wait_stream(self._copy_stream)
            dev[:r].copy_(land[:r])
            self._landing_free[i].record(stream)
            self._zero_tail(dev, r, rb)
        elif on_device:  # rows already in this device's memory (transport cuda_ipc), maybe beside host rows
            self._device_parts(parts, host, dev, r)
            self._zero_tail(dev, r, rb)
        elif runs is not None:  # rows already in registered (pinned) host memory: straight to the device
            _copy_runs(dev, runs)
            if self._rows_read is not None:
                if record:
                    self._rows_read.record(stream)  # the caller may reuse its rows once these copies are done
                else:
                    self._unrecorded = stream
                self._rows_pending = True
            self._zero_tail(dev, r, rb)
        else:
            # the one host copy, socket frames -> pinned staging, on torch's intra-op threads (numpy's
            # is serial); frames are read-only buffers and torch only reads them here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.cat([torch.from_numpy(_storage(p)) for p in parts], out=host[:r])
            host[r:rb] = 0
            dev[:rb].copy_(host[:rb], non_blocking=True)
            self._zero_tail(dev, r, rb, zeroed=True)
        self._describe(keys, firsts, counts, r)
        if self._staging_read is not None:  # the staging buffers' last reads are queued: free once they ran
            if record:
                self._staging_read.record(stream)
            else:
                self._unrecorded = stream
            self._staging_pending = True
        g = self._ingest_graphs.get((fmt, rb))
        if g is not None:
            g.replay()
        else:
            self._ingest_body(fmt, rb)

    @staticmethod
    def _nbytes(rows: torch.Tensor, n: int) -> int:
        return n * rows.stride(0) * rows.element_size()

    def _zero_tail(self, dev: torch.Tensor, r: int, rb: int, zeroed: bool = False) -> None:
        """Rows r..rb of ``dev`` (a view of ``rows``; r were just written) zeroed, so the bucket's
        padding rows hold zeros; skipped (no memset launch) when no byte there may be non-zero
        (``_rows_dirty``), or when the rows' copy brought the zeros (``zeroed``). What an earlier,
        longer ingest wrote past rb stays marked, so a decode step after a prefill chunk zeroes its
        bucket once, not every step."""
        head, end = self._nbytes(dev, r), self._nbytes(dev, rb)
        if not zeroed and any(a < end and b > head for a, b in self._rows_dirty):
            dev[r:rb].zero_()
        self._rows_dirty = [(0, head)] + [(max(a, end), b) for a, b in self._rows_dirty if b > end]

    def _land(self, fmt: str, runs: list[np.ndarray]) -> tuple[torch.Tensor, int]:
        """Copy registered rows to the device on the copy stream, into the landing buffer the chunk
        before last used (once its copy into the rows buffer is done); returns (buffer, index).
        ``rows_done`` waits for these copies: then the caller's rows are its own again."""
        i = self._landing_next
        self._landing_next ^= 1
        land = self._rows(self._landing[i], fmt)
        cs = self._copy_stream
        assert cs is not None and self._rows_read is not None
        cs.wait_event(self._landing_free[i])
        with torch.cuda.stream(cs):
            _copy_runs(land, runs)
            self._rows_read.record(cs)
        self._rows_pending = True
        return land, i

    @staticmethod
    def _device_parts(parts: Sequence, host: torch.Tensor, dev: torch.Tensor, r: int) -> None:
        """Rows of which some are ``DeviceRows`` (transport cuda_ipc): host rows staged at their
        offsets and copied up as usual, then each run of neighbouring device rows (``device_runs``: a
        Step's entries cut from its rows are one) copied device to device into place, each waiting on
        the GPU for the I/O thread's copy that made it."""
        if not all(isinstance(p, DeviceRows) for p in parts):
            off = 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                for p in parts:
                    if not isinstance(p, DeviceRows):
                        host[off : off + len(p)].copy_(torch.from_numpy(_storage(p)))
                    off += len(p)
            dev[:r].copy_(host[:r], non_blocking=True)
        off = 0
        for on_device, group in itertools.groupby(parts, key=lambda p: isinstance(p, DeviceRows)):
            for d in device_runs(list(group)) if on_device else group:
                if on_device:
                    dev[off : off + len(d)].copy_(d.tensor(), non_blocking=True)
                off += len(d)

    # ------------------------------------------------------------------ registered host memory

    def register_host(self, buf: memoryview) -> bool:
        """Pin a host buffer the caller's rows will live in (e.g. a shared-memory ring), so ingest
        copies rows from it to the device with no staging copy. False if it cannot be registered."""
        arr = np.frombuffer(buf, dtype=np.uint8)
        ptr = arr.ctypes.data
        if self.dev.type == "cuda":
            flags = _HOST_REGISTER_PORTABLE | (_HOST_REGISTER_READ_ONLY if buf.readonly else 0)
            with torch.cuda.device(self.dev):  # any thread may call: the drafter's device, explicitly
                if torch.cuda.cudart().cudaHostRegister(ptr, arr.nbytes, flags) != 0:
                    return False
        with self._host_lock:
            self._host_ranges = [*self._host_ranges, (ptr, ptr + arr.nbytes, arr)]
        return True

    def unregister_host(self, buf: memoryview) -> None:
        """Undo ``register_host`` (the caller unmaps the buffer after this). Any thread: the table is
        replaced, never edited in place, so a step reading it meanwhile sees it whole."""
        ptr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        with self._host_lock:
            entry = next((r for r in self._host_ranges if r[0] == ptr), None)
            if entry is None:
                return
            self._host_ranges = [r for r in self._host_ranges if r is not entry]  # no new copy reads it
        if self.dev.type == "cuda":
            with torch.cuda.device(self.dev):
                torch.cuda.synchronize(self.dev)  # no copy may still read it
                torch.cuda.cudart().cudaHostUnregister(ptr)

    def _registered_runs(self, parts: Sequence[np.ndarray]) -> list[np.ndarray] | None:
        """``parts`` as views of registered memory, adjacent parts merged (one copy per run); None
        unless every part lies in a registered buffer."""
        if not self._host_ranges or not parts:
            return None
        runs: list[np.ndarray] = []
        start = end = -1
        whole: np.ndarray | None = None
        base = 0
        for p in parts:
            if not p.flags.c_contiguous:
                return None
            a = p.ctypes.data
            if a == end and whole is not None and a + p.nbytes <= base + whole.nbytes:
                end += p.nbytes
                continue
            if whole is not None:
                runs.append(whole[start - base : end - base].view(_storage(parts[0]).dtype))
            hit = next(((lo, arr) for lo, hi, arr in self._host_ranges if lo <= a and a + p.nbytes <= hi), None)
            if hit is None:
                return None
            base, whole = hit
            start, end = a, a + p.nbytes
        assert whole is not None
        runs.append(whole[start - base : end - base].view(_storage(parts[0]).dtype))
        width = parts[0].shape[1]
        return [run.reshape(-1, width) for run in runs]

    def _ingest_pages_cap(self) -> int:
        """Pages an ingest's description may list: each item's span, at most r_max rows in all, from
        any offset of a page (so two pages more than its rows fill), one item per row at most."""
        return self.r_max // self.P + 2 * self.r_max

    def _describe(self, keys: Sequence[int], firsts: Sequence[int], counts: Sequence[int], r: int) -> None:
        """The ingest's items into the pinned description and on to the device (``pa.ingest_rows``
        makes each row's slot and position from it inside the ingest graph): per item its first row,
        first position and page base, then the pages; a few ints and one page list per item."""
        n, P = len(keys), self.P
        origins, pages = self.cache.spans(keys, firsts, [a + c for a, c in zip(firsts, counts, strict=True)])
        row0s: list[int] = []
        bases: list[int] = []
        row0 = used = 0
        for c, origin, pg in zip(counts, origins, pages, strict=True):
            row0s.append(row0)
            bases.append(origin - used * P)
            row0 += c
            used += len(pg)
        h = self.spec_host_np
        h[0], h[1] = n, r
        h[2 : 2 + 3 * n] = [*row0s, *firsts, *bases]
        at = 2 + 3 * n
        end = at + used
        _join(pages, h[at:end])
        self.spec[:end].copy_(self.spec_host[:end], non_blocking=True)

    def draft(self, items: Sequence[DraftItem]) -> tuple[np.ndarray, np.ndarray | None]:
        """Greedy drafts [N, B] (target ids) and confidence [N, B] (or None) of a batch of sessions."""
        n, nb, lens, mixed = self._stage(items)
        B = self.B
        g = self._draft_graphs.get(nb)
        fits = g is not None and (
            self.flash is not None or pa.max_work_items(lens, rows=B, chunk=g.chunk, page_size=self.P) <= g.capacity
        )
        if g is not None and g.graph is not None and fits and not mixed:
            g.graph.replay()
            self.graph_steps += 1
        else:  # contexts past the bucket's capacity: the same kernels, planned for this batch
            self._draft_body(nb, self._eager_batch(n, nb, lens, mixed))
            self.eager_steps += 1
        self.out_host[:n].copy_(self.out[:n], non_blocking=True)
        if self.dev.type == "cuda":
            torch.cuda.current_stream(self.dev).synchronize()
            self._rows_pending = self._staging_pending = False  # the stream is idle: every earlier copy is done
            self._unrecorded = None
        res = self.out_host[:n].numpy()
        conf = res[:, B:].astype(np.float32) if self.m.conf_w is not None else None
        return res[:, :B].astype(np.int64), conf

    def hidden(self, items: Sequence[DraftItem]) -> torch.Tensor:
        """The final-normed block states z [N, B, H] of a batch through the paged kernels, eagerly:
        what sampled batches draw from (``Sampler``), at the cost of the sum of their contexts."""
        n, nb, lens, mid = self._stage(items)
        self.eager_steps += 1
        return self._block(nb, self._eager_batch(n, nb, lens, mid))[:n]

    def _eager_batch(self, n: int, nb: int, lens: list[int], mixed: bool = False) -> PagedBatch:
        chunk = self._chunk(sum(lens) + n * self.B)
        need = pa.max_work_items(lens, rows=self.B, chunk=chunk, page_size=self.P)
        batch = self._batch(nb, max(need, 1), chunk)
        batch.mixed = mixed
        return batch

    def _stage(self, items: Sequence[DraftItem]) -> tuple[int, int, list[int], bool]:
        """Fill the packed step inputs of ``items`` (padded to their session bucket) and copy them to
        the device; returns (sessions, bucket, context lengths, mid). The host writes per session
        scalars and the ragged page list only; the block rows' ids, positions and slots are made on
        the device (``_block``). ``mid``: FlashMLA serves the batch only with the Triton kernel beside
        it, because some session's context starts mid-page (FlashMLA reads a sequence from its table's
        first token). The cache starts every span on a page boundary, so only a draft asked from a
        later start than its span's (never the server's engine) does."""
        n, B, P = len(items), self.B, self.P
        nb = _bucket(n, self.session_buckets)
        origins, pages = self.cache.spans([i.key for i in items], [i.start for i in items], [i.pos + B for i in items])
        cols: list[tuple[int, ...]] = []
        lens: list[int] = []
        used, mid, width = 0, False, self.width
        for it, origin, pg in zip(items, origins, pages, strict=True):
            # the kernels see positions from each session's first page (the cache's origin): a context
            # starts at 0 there, on a page boundary, wherever it starts in the sequence
            lo = it.start - origin
            cols.append((it.anchor, it.pos, lo, it.pos - origin, -used, width(it.k)))  # first: row stride 0
            mid = mid or lo % P != 0
            lens.append(it.pos - it.start)
            used += len(pg)
        if used > self.pages_cap:
            raise RuntimeError("a batch's pages exceed the fast path's page list")
        h = self.host_np
        _join(pages, h[self._pages_at : self._pages_at + used])  # the ragged page list
        self._fields[:, :n] = np.array(cols, dtype=np.int64).T
        if nb > n:
            self._pad(n, nb)
        h[self._count_at] = n
        end = self._pages_at + max(used, 1)
        self.stage[:end].copy_(self.host[:end], non_blocking=True)
        return n, nb, lens, mid and self.flash is not None

    # ------------------------------------------------------------------ start-up check

    def self_test(self, keys: Sequence[int]) -> dict[str, float]:
        """Replay every captured bucket against the eager run of the same body on live sessions
        (``keys``, each holding context and scratch); raise on any difference."""
        checked = 0
        for n, g in sorted(self._draft_graphs.items()):
            if g.graph is None or n > len(keys):
                continue
            items = [DraftItem(k, 0, 4, 1 + (k % 5), self.B, GREEDY) for k in keys[:n]]
            graph_out = self.draft(items)
            saved, self._draft_graphs = self._draft_graphs, {}
            try:
                eager_out = self.draft(items)
            finally:
                self._draft_graphs = saved
            if not np.array_equal(graph_out[0], eager_out[0]):
                raise RuntimeError(f"CUDA graph of the {n}-session bucket drafts differently from eager")
            checked += 1
        return {"buckets_checked": float(checked)}


@torch.inference_mode()
def greedy_chain(
    m: DSparkModel, z: torch.Tensor, anchors: torch.Tensor, k: int, sts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The k greedy Markov steps for every session at once: tokens [N, k] and confidence (or None).

    ``sts``: the confidence head's per-step temperatures [block]. Each step's argmax reads the base
    logits and forms the low-rank Markov bias (W2 e, e the previous token's W1 row, gathered in the
    kernel) tile by tile (``fused.markov_argmax_lowrank``): the same float32 sums the eager sampler
    compares (the bias rounded to the model dtype first, as ``F.linear`` writes it), never written
    out, in vocab order on even steps and reversed on odd ones so each step begins where the L2 still
    holds W2; its final pass maps the draft id to the target id. The confidence of all k steps is
    one GEMV after the chain (its features, [z_j; e_j], are known by then). A
    ``logit_scale`` other than 1 takes the eager ops (a fused multiply-add would round differently)."""
    fused_argmax = m.cfg.logit_scale == 1.0 and m.dtype in (torch.bfloat16, torch.float16, torch.float32)
    base = gemm.linear(z[:, :k], m.lm_head) if fused_argmax else m.logits(z[:, :k])
    w2 = m.markov_w2
    lowrank = w2 is not None and w2.dim() == 2 and m.markov_w1 is not None and m.markov_w1.dtype == w2.dtype
    prev = anchors
    toks = []
    for j in range(k):
        if fused_argmax and lowrank:  # embedding, bias, argmax and d2t in two launches
            prev = fused.markov_argmax_lowrank(base[:, j], prev, m.markov_w1, w2, reverse=j % 2 == 1, d2t=m.d2t)
        else:
            e = m.markov_embed(prev)
            if fused_argmax:
                best = fused.markov_argmax(base[:, j], None if e is None else F.linear(e, w2))
            else:
                best = (base[:, j] if e is None else base[:, j] + m.markov_bias(e)).argmax(-1)
            prev = m.to_target_ids(best)
        toks.append(prev)
    tokens = torch.stack(toks, dim=1)
    conf = None
    if m.conf_w is not None:  # step j's Markov features: the embedding of the token before it
        e_all = m.markov_embed(torch.cat([anchors[:, None], tokens[:, : k - 1]], dim=1))  # [N, k, rank] or None
        conf = torch.sigmoid(m.confidence_logit(z[:, :k], e_all).to(m.acc) / sts[:k])
    return tokens, conf
