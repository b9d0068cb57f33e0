"""``DSparkDrafter``: the DSpark model as a ``Drafter`` backend.

Owns the glue between the scheduler's calls and the model: batched ingest into the paged cache,
batched block forward + sequential stage, and the KV budget. Ingest takes rows in every wire
format (``protocol.wire``; ``wire_offer``): bf16 and fp8 taps (dequantized on the device) go
through the context projection, projected rows (the client applied it, with the weights that
``projection_id`` names) skip it. ``draft_debug`` returns the
per-step logits as well (the numerics tests compare them with the float64 reference).

Context for a draft is exactly [DraftItem.start, DraftItem.pos): positions outside it are
masked, so stale rows of a gap restart or a rejected block can never leak in.

CUDA: runs eagerly today. Shapes are bucket-friendly for graphs later: B is fixed, the gathered
context width is page-granular (pad the page table to a bucket), N can be padded with dummy
sessions (their block rows always see themselves, so no row is fully masked).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from draft_server.drafters.base import Drafter, DraftItem, DraftOut, IngestItem, by_format
from draft_server.models.attention import DenseContext
from draft_server.models.config import CheckpointError, DSparkConfig
from draft_server.models.kv_cache import PagedKVCache
from draft_server.models.model import DSparkModel
from draft_server.models.sampling import Sampler
from draft_server.models.staging import context_rows, rows_to_device, torch_projection_id
from protocol import DType, WireOffer
from protocol.wire import FORMATS, row_layout

if TYPE_CHECKING:
    from draft_server.models.step import FastStep

log = logging.getLogger(__name__)

INGEST_CHUNK_ROWS = 4096
DEFAULT_CPU_KV_BYTES = 256 << 20
BLOCK_WIDTHS = ("k", "trained")


def default_page_size(model: DSparkModel, attention: str) -> int:
    """64-token pages where FlashMLA serves the paged attention (K3 in bf16 on a Hopper GPU with the
    kernel built), else 16."""
    from draft_server.models.kernels import flash_mla as fm

    dims = (model.token_shape[0], model.layout.value_dims)
    if attention == "paged" and fm.kernel_for(model.layout.mla, model.dtype, model.device, dims, fm.PAGE) is not None:
        return fm.PAGE
    return 16


class DSparkDrafter(Drafter):
    def __init__(
        self,
        model: DSparkModel,
        kv_budget_bytes: int | None = None,
        page_size: int | None = None,
        sts_temperatures: list[float] | None = None,
        attention: str = "auto",
        projection_id: str | None = None,
        block_width: str = "k",
    ) -> None:
        """``projection_id``: of the context projection as stored in its checkpoint (default: of
        the weights as held, the same unless a wider checkpoint dtype was narrowed at load).
        ``block_width``: "k" runs a block of the k drafts a session asks for, as vLLM's in-process
        DSpark does (the block is not causal, so its width changes the drafts); "trained" runs the
        checkpoint's block_size rows always and returns the first k. ``page_size``: tokens per KV page;
        None picks 64 where FlashMLA serves the attention (``kernels.flash_mla.kernel_for``), else 16."""
        if attention not in ("auto", "paged", "dense"):
            raise CheckpointError(f"attention '{attention}' is not one of auto, paged, dense")
        if block_width not in BLOCK_WIDTHS:
            raise CheckpointError(f"block width '{block_width}' is not one of {', '.join(BLOCK_WIDTHS)}")
        self.block_width = block_width
        self.model = model
        # paged: Triton kernels over the paged cache (CUDA graphs on a GPU) once prepare() ran;
        # dense: the eager reference (gather + masked softmax). auto: paged on CUDA.
        self.attention = ("paged" if model.device.type == "cuda" else "dense") if attention == "auto" else attention
        self.fast: FastStep | None = None
        self.cfg: DSparkConfig = model.cfg
        self.contract = self.cfg.contract()
        self.scratch_rows = self.cfg.block_size
        if page_size is None:
            page_size = default_page_size(model, self.attention)
        per_tok = PagedKVCache.bytes_per_token(self.cfg.num_layers, model.token_shape, model.dtype)
        if kv_budget_bytes is None:
            kv_budget_bytes = _default_budget(model.device)
        num_pages = kv_budget_bytes // (per_tok * page_size)
        if num_pages < 1:
            raise CheckpointError(f"kv_budget_bytes {kv_budget_bytes} is below one page ({per_tok * page_size} bytes)")
        self.cache = PagedKVCache(
            self.cfg.num_layers, model.token_shape, int(num_pages), page_size, model.dtype, model.device
        )
        self.sampler = Sampler(model, sts_temperatures)
        if projection_id is None:
            projection_id = torch_projection_id(model.ctx_proj, model.ctx_norm, self.cfg.rms_norm_eps)
        wide = model.dtype in (torch.float32, torch.float64)
        self.offer = WireOffer(
            formats=FORMATS,
            projection_id=projection_id,
            projected_width=self.cfg.hidden_size,
            projected_dtype=DType.F32 if wide else DType.BF16,
        )
        self._row_width = {f: row_layout(f, self.contract, self.offer)[1] for f in FORMATS}

    def wire_offer(self) -> WireOffer:
        return self.offer

    def width(self, k: int) -> int:
        """Block rows for a session asking for k drafts (see ``block_width``)."""
        B = self.cfg.block_size
        return B if self.block_width == "trained" else max(1, min(k, B))

    def cuda_device(self) -> object | None:
        dev = torch.device(self.model.device)
        return dev if dev.type == "cuda" else None

    # -- KV accounting (Drafter interface) --------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.cache.capacity_tokens()

    def used_tokens(self) -> int:
        return self.cache.used_tokens()

    def reserve(self, key: int, start: int, end: int) -> bool:
        return self.cache.reserve(key, start, end)

    def release(self, key: int) -> None:
        self.cache.release(key)

    # -- compute -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, max_batch_sessions: int, max_batch_rows: int) -> dict[str, float]:
        if self.attention != "paged":
            return {}
        from draft_server.models.step import FastStep

        fast = FastStep(
            self.model,
            self.cache,
            max_sessions=max_batch_sessions,
            max_rows=max_batch_rows,
            graphs=True,
            sts=self.sampler.sts,
            offer=self.offer,
            width=self.width,
        )
        report = fast.capture()
        if self.model.layout.mla:
            from draft_server.models.kernels import flash_mla as fm

            report["mla_flashmla"] = float(fast.flash is not None)
            if fast.flash is None and self.model.device.type == "cuda" and fm.why_not() != "not loaded yet":
                log.info("MLA attention: Triton kernels (FlashMLA: %s)", fm.why_not())
        self.fast = fast
        report.update(self._self_test(fast))
        return report

    def register_host(self, buf: memoryview) -> bool:
        return self.fast is not None and self.fast.register_host(buf)

    def unregister_host(self, buf: memoryview) -> None:
        if self.fast is not None:
            self.fast.unregister_host(buf)

    def _self_test(self, fast: FastStep) -> dict[str, float]:
        """Every graph bucket replayed against the eager run of the same kernels, on throwaway sessions."""
        if not fast.use_graphs:
            return {}
        rng = np.random.default_rng(0)
        keys = []
        B = self.cfg.block_size
        try:
            for i in range(fast.n_max):
                key = -(1 << 40) - i  # never a real session's handle
                if not self.reserve(key, 0, 4 + B):
                    break
                keys.append(key)
            bits = rng.standard_normal((4, self.contract.tap_width), dtype=np.float32).view(np.uint32) >> 16
            for j, key in enumerate(keys):
                fast.ingest([IngestItem(key, 0, 0, np.roll(bits, j, axis=1).astype(np.uint16))])
            return fast.self_test(keys)
        finally:
            for key in keys:
                self.release(key)

    @torch.inference_mode()
    def ingest(self, items: Sequence[IngestItem]) -> None:
        self._ingest(items, wait=True)

    @torch.inference_mode()
    def step(self, ingest: Sequence[IngestItem], drafts: Sequence[DraftItem]) -> list[DraftOut]:
        """Ingest then draft with one wait: the draft's staging on the host overlaps the rows' copy
        to the device and the ingest graph (``FastStep.ingest(wait=False)``); its end waits for the
        stream, after which the rows are the caller's again."""
        fast = self.fast
        if fast is None or not drafts:
            return super().step(ingest, drafts)
        try:
            if ingest:
                self._ingest(ingest, wait=False)
            return self.draft(drafts)
        finally:
            fast.rows_done()

    def _ingest(self, items: Sequence[IngestItem], wait: bool) -> None:
        pending = [it for it in items if len(it.taps)]
        while pending:  # a key repeated within one call is applied in order, one pass per repeat
            if len({it.key for it in pending}) == len(pending):  # distinct keys (a decode step): one pass
                batch, rest = pending, []
            else:
                batch, rest = [], []
                seen: set[int] = set()
                for it in pending:
                    (rest if it.key in seen else batch).append(it)
                    seen.add(it.key)
            if self.fast is not None:  # distinct keys: the formats' groups are independent
                self.fast.ingest(batch, wait=wait)
            else:
                for fmt, group in by_format(batch):
                    self._ingest_once(fmt, group)
            pending = rest

    def _ingest_once(self, fmt: str, items: list[IngestItem]) -> None:
        m = self.model
        pos = np.concatenate([np.arange(it.pos, it.pos + len(it.taps), dtype=np.int64) for it in items])
        slots = np.concatenate(
            [self.cache.slots(it.key, np.arange(it.pos, it.pos + len(it.taps), dtype=np.int64)) for it in items]
        )
        width = self._row_width.get(fmt)
        if width is None:
            raise ValueError(f"unknown wire format {fmt!r}")
        for it in items:
            if it.taps.ndim != 2 or it.taps.shape[1] != width:
                raise ValueError(f"session {it.key}: {fmt} rows of shape {it.taps.shape}, expected [rows, {width}]")
        rows = rows_to_device([it.taps for it in items], m.device)
        pos_t = torch.from_numpy(pos).to(m.device)
        slots_t = torch.from_numpy(slots).to(m.device)
        for a in range(0, len(pos), INGEST_CHUNK_ROWS):
            b = a + INGEST_CHUNK_ROWS
            c = context_rows(m, rows[a:b], fmt)
            m.write_context(self.cache, slots_t[a:b], c, pos_t[a:b])

    @torch.inference_mode()
    def draft(self, items: Sequence[DraftItem]) -> list[DraftOut]:
        fast = self.fast
        if fast is not None and all(it.sampling.temperature <= 0 for it in items):
            return self._draft_fast(fast, items)
        return self._draft(items, want_logits=False, paged=fast)[0]

    def _draft_fast(self, fast: FastStep, items: Sequence[DraftItem]) -> list[DraftOut]:
        """Greedy batches: paged kernels, device-side Markov chain, one copy back (CUDA graphs on a GPU)."""
        ks = [it.k for it in items]
        B = self.cfg.block_size
        top = max(ks, default=0)
        if top > B:
            it = items[ks.index(top)]
            raise ValueError(f"session {it.key}: k={it.k} exceeds block_size {B}")
        act = [n for n, k in enumerate(ks) if k > 0]
        if not act:
            return [DraftOut(tokens=[]) for _ in items]
        tokens, conf = fast.draft(items if len(act) == len(items) else [items[n] for n in act])
        rows = tokens.tolist()  # one conversion for the batch, then a slice per session
        confs = conf.tolist() if conf is not None else [[]] * len(act)
        outs = [DraftOut(tokens=rows[r][: ks[n]], confidence=confs[r][: ks[n]]) for r, n in enumerate(act)]
        if len(act) == len(items):
            return outs
        full = [DraftOut(tokens=[]) for _ in items]
        for r, n in enumerate(act):
            full[n] = outs[r]
        return full

    @torch.inference_mode()
    def draft_debug(self, items: Sequence[DraftItem]) -> tuple[list[DraftOut], list[torch.Tensor | None]]:
        """Like ``draft``, plus each session's per-step logits [k, draft_vocab] (acc dtype, on the CPU)."""
        return self._draft(items, want_logits=True)

    def _draft(
        self, items: Sequence[DraftItem], want_logits: bool, paged: FastStep | None = None
    ) -> tuple[list[DraftOut], list[torch.Tensor | None]]:
        """Drafts through the sampler (any sampling): block states from the paged kernels when
        ``paged`` is given (cost = the sum of the contexts), else from the dense reference."""
        outs = [DraftOut(tokens=[]) for _ in items]
        logits: list[torch.Tensor | None] = [None] * len(items)
        act = [n for n, it in enumerate(items) if it.k > 0]
        if not act:
            return outs, logits
        m, cfg, B = self.model, self.cfg, self.cfg.block_size
        its = [items[n] for n in act]
        for it in its:
            if it.k > B:
                raise ValueError(f"session {it.key}: k={it.k} exceeds block_size {B}")
        ids = torch.full((len(its), B), cfg.mask_token_id, dtype=torch.int64)
        ids[:, 0] = torch.tensor([it.anchor for it in its])
        if paged is not None:
            z = paged.hidden(its)
        else:
            table, ctx_mask = self.cache.gather_plan([(it.key, it.start, it.pos) for it in its])
            positions = torch.tensor([it.pos for it in its], dtype=torch.int64)[:, None] + torch.arange(B)
            ctx = DenseContext(
                lambda layer: self.cache.gather(layer, table),
                m.block_mask(ctx_mask, B, [self.width(it.k) for it in its]),
                m.layout,
                cfg.softmax_scale,
            )
            z = m.block(ids.to(m.device), positions.to(m.device), ctx)
        ks = [it.k for it in its]
        res = self.sampler.run(
            z, ids[:, 0].to(m.device), [it.pos for it in its], ks, [it.sampling for it in its], want_logits
        )
        tokens = res.tokens.cpu().tolist()
        conf = res.confidence.cpu().tolist() if res.confidence is not None else None
        for r, n in enumerate(act):
            k = ks[r]
            out = outs[n]
            out.tokens = tokens[r][:k]
            if conf is not None:
                out.confidence = conf[r][:k]
            if res.probs[r] is not None:
                out.probs, out.prob_ids = res.probs[r]
            if res.logits is not None:
                logits[n] = res.logits[r, :k].cpu()
        return outs, logits

    def close(self) -> None:
        self.fast = None  # its graphs and buffers first
        del self.cache
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return DEFAULT_CPU_KV_BYTES
