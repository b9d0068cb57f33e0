"""``DSparkDrafter``: the DSpark model as a ``Drafter`` backend, and ``load_drafter``.

Owns the glue between the scheduler's calls and the model: tap decoding (bf16 bit patterns ->
compute dtype, one host copy for the whole batch), batched ingest into the paged cache,
batched block forward + sequential stage, and the KV budget. ``draft_debug`` returns the
per-step logits as well (the numerics tests compare them with the float64 reference).

Context for a draft is exactly [DraftItem.start, DraftItem.pos): positions outside it are
masked, so stale rows of a gap restart or a rejected block can never leak in.

CUDA: runs eagerly today. Shapes are bucket-friendly for graphs later: B is fixed, the gathered
context width is page-granular (pad the page table to a bucket), N can be padded with dummy
sessions (their block rows always see themselves, so no row is fully masked).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from draft_server.drafter import Drafter, DraftItem, DraftOut, IngestItem
from draft_server.models.config import K3, CheckpointError, DSparkConfig, load_config
from draft_server.models.k3_mla import K3DSpark
from draft_server.models.kv_cache import PagedKVCache
from draft_server.models.model import DSparkModel
from draft_server.models.qwen3 import Qwen3DSpark
from draft_server.models.sampling import Sampler
from draft_server.models.weights import Checkpoint, load_target_head, validate_draft

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}
INGEST_CHUNK_ROWS = 4096
DEFAULT_CPU_KV_BYTES = 256 << 20


def taps_to_tensor(arrays: Sequence[np.ndarray], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Concatenate tap rows (uint16 bf16 bit patterns, or f16/f32) and move them to the device."""
    host = arrays[0] if len(arrays) == 1 and arrays[0].flags.writeable else np.concatenate(arrays)
    if host.dtype == np.uint16:
        t = torch.from_numpy(np.ascontiguousarray(host).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(host))
    return t.to(device, non_blocking=True).to(dtype)


class DSparkDrafter(Drafter):
    def __init__(
        self,
        model: DSparkModel,
        kv_budget_bytes: int | None = None,
        page_size: int = 16,
        sts_temperatures: list[float] | None = None,
    ) -> None:
        self.model = model
        self.cfg: DSparkConfig = model.cfg
        self.contract = self.cfg.contract()
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

    def lru_keys(self) -> list[int]:
        """Sessions least recently used first: the order to evict in when room runs out."""
        return self.cache.lru_keys()

    def evict_lru(self, need_tokens: int, protect: Collection[int] = ()) -> list[int]:
        """Release least recently used sessions (never those in ``protect``) until ``need_tokens``
        are free or nothing is left to evict; return the released keys (the server forgets them)."""
        out = []
        for key in self.cache.lru_keys():
            if self.capacity_tokens() - self.used_tokens() >= need_tokens:
                break
            if key not in protect:
                self.cache.release(key)
                out.append(key)
        return out

    # -- compute -----------------------------------------------------------------------------
    @torch.inference_mode()
    def ingest(self, items: Sequence[IngestItem]) -> None:
        pending = [it for it in items if len(it.taps)]
        while pending:  # a key repeated within one call is applied in order, one pass per repeat
            batch: list[IngestItem] = []
            rest: list[IngestItem] = []
            seen: set[int] = set()
            for it in pending:
                (rest if it.key in seen else batch).append(it)
                seen.add(it.key)
            self._ingest_once(batch)
            pending = rest

    def _ingest_once(self, items: list[IngestItem]) -> None:
        m = self.model
        pos = np.concatenate([np.arange(it.pos, it.pos + len(it.taps), dtype=np.int64) for it in items])
        slots = np.concatenate(
            [self.cache.slots(it.key, np.arange(it.pos, it.pos + len(it.taps), dtype=np.int64)) for it in items]
        )
        width = self.contract.tap_width
        for it in items:
            if it.taps.ndim != 2 or it.taps.shape[1] != width:
                raise ValueError(f"session {it.key}: taps of shape {it.taps.shape}, expected [rows, {width}]")
            self.cache.touch(it.key)
        taps = taps_to_tensor([it.taps for it in items], m.device, m.dtype)
        pos_t = torch.from_numpy(pos).to(m.device)
        slots_t = torch.from_numpy(slots).to(m.device)
        for a in range(0, len(pos), INGEST_CHUNK_ROWS):
            b = a + INGEST_CHUNK_ROWS
            c = m.context(taps[a:b])
            self.cache.write(slots_t[a:b], m.context_kv(c, pos_t[a:b]))

    @torch.inference_mode()
    def draft(self, items: Sequence[DraftItem]) -> list[DraftOut]:
        return self._draft(items, want_logits=False)[0]

    @torch.inference_mode()
    def draft_debug(self, items: Sequence[DraftItem]) -> tuple[list[DraftOut], list[torch.Tensor | None]]:
        """Like ``draft``, plus each session's per-step logits [k, draft_vocab] (acc dtype, on the CPU)."""
        return self._draft(items, want_logits=True)

    def _draft(self, items: Sequence[DraftItem], want_logits: bool) -> tuple[list[DraftOut], list[torch.Tensor | None]]:
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
            self.cache.touch(it.key)
        table, ctx_mask = self.cache.gather_plan([(it.key, it.start, it.pos) for it in its])
        ids = torch.full((len(its), B), cfg.mask_token_id, dtype=torch.int64)
        ids[:, 0] = torch.tensor([it.anchor for it in its])
        positions = torch.tensor([it.pos for it in its], dtype=torch.int64)[:, None] + torch.arange(B)
        z = m.block(ids.to(m.device), positions.to(m.device), self.cache, table, ctx_mask)
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
        del self.cache
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return DEFAULT_CPU_KV_BYTES


def load_drafter(
    model_dir: str,
    target_model_dir: str | None,
    device: str = "cpu",
    dtype: str = "bf16",
    kv_budget_bytes: int | None = None,
    *,
    page_size: int = 16,
    sts_temperatures: list[float] | None = None,
) -> DSparkDrafter:
    """Load a DSpark draft checkpoint (+ the target's lm_head / embedding) as a Drafter.

    Everything is validated before any tensor is read: config flags, every tensor's name and
    shape, the target head's shape. Failures raise ``CheckpointError`` with one clear line.
    """
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype '{dtype}' is not one of {sorted(DTYPES)}")
    tdtype = DTYPES[dtype]
    dev = torch.device(device)
    cfg = load_config(model_dir)
    page_bytes = PagedKVCache.bytes_per_token(cfg.num_layers, cfg.kv_token_shape, tdtype) * page_size
    if kv_budget_bytes is not None and kv_budget_bytes < page_bytes:
        raise CheckpointError(f"kv_budget_bytes {kv_budget_bytes} is below one KV page ({page_bytes} bytes)")
    ck = Checkpoint(model_dir)
    names = validate_draft(ck, cfg)
    # Which embedding / lm_head, as vLLM 0.32 does it: K3 drops the draft's frozen copies and
    # uses the target's (its weight mapper maps them to None); Qwen3 DSpark keeps the draft's own
    # when present (has_own_embed_tokens / has_own_lm_head) and takes the rest from the target.
    if cfg.variant == K3 and target_model_dir is not None:
        names = [n for n in names if n not in ("embed_tokens.weight", "lm_head.weight")]
    need_head = "lm_head.weight" not in names
    need_embed = "embed_tokens.weight" not in names
    if target_model_dir is None:
        if need_head or need_embed:
            what = "lm_head.weight" if need_head else "embed_tokens.weight"
            raise CheckpointError(f"{model_dir}: the draft has no {what}; pass the target model directory")
        target = {}
    else:  # the target head is shape-checked against the config even when the draft has its own
        target = load_target_head(target_model_dir, cfg, need_head, need_embed)
    raw = ck.load(names)
    raw.update(target)
    w: dict[str, torch.Tensor] = {}
    acc = torch.float64 if tdtype == torch.float64 else torch.float32
    for name, t in raw.items():
        if name == "d2t":
            w[name] = t.to(dev, torch.int64)
        elif name.startswith("confidence_head"):
            w[name] = t.to(dev, acc)
        else:
            w[name] = t.to(dev, tdtype)
    model = (K3DSpark if cfg.variant == K3 else Qwen3DSpark)(cfg, w, dev, tdtype)
    return DSparkDrafter(model, kv_budget_bytes, page_size=page_size, sts_temperatures=sts_temperatures)
