"""The tiny shipped target/draft pair: plain-PyTorch DSpark math, loading, and the acceptance harness.

This file owns three things used by ``train_tiny_pair`` (which trains and writes the pair) and by
``tests/test_tiny_pair.py`` (which checks the shipped pair):

* ``TinyDSpark``: the Qwen3-backbone DSpark drafter (dspark.md §3, §4, §10) as an ``nn.Module``
  whose ``state_dict`` names are the DeepSpec checkpoint names (``fc``, ``hidden_norm``,
  ``layers.i.*``, ``norm``, ``markov_head.markov_w{1,2}``). Its embedding and lm_head are the
  frozen target's, passed in, never stored in the draft checkpoint. ``train_logits`` runs many
  anchors of one sequence at once with an attention mask (training); ``DraftCache`` runs the
  same math incrementally the way the engine does (per-layer context K/V cache, one block per
  step), and is what the acceptance harness and the cross-check against the production drafter
  use.
* Loading the pair from disk (``load_target``, ``load_draft``, ``load_tokenizer``), and
  computing the target's tap hidden states (``target_taps``) in the DeepSpec convention
  (id l = HF ``hidden_states[l + 1]``), rounded to bf16 as they travel on the wire.
* ``acceptance``: greedy acceptance length of the draft against the target's greedy
  continuation, mirroring the engine loop (prefill taps, then per step: draft k tokens from the
  anchor, accept the leading matches, ingest anchor + accepted rows, new anchor = the target's
  correction/bonus token).

transformers and tokenizers are imported lazily: the draft math itself needs torch only.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "tiny_pair"
TARGET_DIR = ASSET_DIR / "target"
DRAFT_DIR = ASSET_DIR / "draft"


@dataclass(frozen=True)
class DraftConfig:
    """The fields of the draft's config.json that the math uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> DraftConfig:
        rope = cfg.get("rope_parameters") or {}
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg["head_dim"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta,
            vocab_size=int(cfg["vocab_size"]),
            target_layer_ids=tuple(int(i) for i in cfg["target_layer_ids"]),
            block_size=int(cfg["block_size"]),
            mask_token_id=int(cfg["mask_token_id"]),
            markov_rank=int(cfg["markov_rank"]),
        )

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm (computed in float32, or float64 for float64 input; weight applied after the cast back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """HF default (NeoX rotate-half) RoPE tables for integer ``positions`` -> [..., head_dim].

    Angles are formed in float64 and cast to ``dtype`` (HF forms them in float32; the difference
    is below float32 resolution at these positions).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.to(torch.float64)[..., None] * inv.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, n, hd]; cos/sin [..., n, hd] broadcast over heads."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-3) + rot * sin.unsqueeze(-3)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.c = c
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., n, H] at ``positions`` [..., n] -> K, V [..., nkv, n, hd] (K normed and rotated)."""
        c = self.c
        k = self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(-2, -3)
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(-2, -3)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        return apply_rope(self.k_norm(k), cos, sin), v

    def forward(
        self,
        u: torch.Tensor,
        positions: torch.Tensor,
        k_ctx: torch.Tensor,
        v_ctx: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Block rows u [b, n, H] attend to context K/V [b, nkv, t, hd] and to their own K/V.

        ``mask`` [b, n, t + n] (True = may attend) or None (everything visible).
        """
        c = self.c
        q = self.q_proj(u).unflatten(-1, (c.num_attention_heads, c.head_dim)).transpose(-2, -3)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, u.dtype)
        q = apply_rope(self.q_norm(q), cos, sin)
        k_blk, v_blk = self.kv(u, positions)
        k = torch.cat([k_ctx, k_blk], dim=-2)
        v = torch.cat([v_ctx, v_blk], dim=-2)
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
        attn_mask = None if mask is None else mask.unsqueeze(-3)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(c.head_dim))
        return self.o_proj(o.transpose(-2, -3).flatten(-2))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        k_ctx: torch.Tensor,
        v_ctx: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, k_ctx, v_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """Vanilla Markov head: bias(prev) = W2 · W1[prev], W1 and W2 both [V, r]."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class TinyDSpark(nn.Module):
    """Qwen3 DSpark drafter. ``embed``/``lm_head`` are the frozen target's ([V, H] weights)."""

    def __init__(self, c: DraftConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.c = c
        self.fc = nn.Linear(c.n_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_head = MarkovHead(c.vocab_size, c.markov_rank)
        # Frozen target tensors: buffers that are not saved with the draft.
        self.register_buffer("embed_w", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head_w", lm_head.detach().clone(), persistent=False)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., n_taps * H] (concatenated in target_layer_ids order) -> c [..., H]."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer: K/V of context rows c (no input norm), K normed and rotated."""
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def block_hidden(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Block rows [b, n] at ``positions`` [b, n] -> final-normed hidden [b, n, H]."""
        h = F.embedding(block_ids, self.embed_w)
        for layer, (k_ctx, v_ctx) in zip(self.layers, kv, strict=True):
            h = layer(h, positions, k_ctx, v_ctx, mask)
        return self.norm(h)

    def base_logits(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.lm_head_w.t()

    def train_logits(
        self, taps: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, prev: torch.Tensor
    ) -> torch.Tensor:
        """Training forward, many anchors per sequence at once.

        taps [b, T, n_taps*H]; anchors [b, N] anchor positions; tokens [b, T] the sequence;
        prev [b, N, B] the Markov predecessor of each block row (teacher-forced: prev[:, :, 0]
        is the anchor token, prev[:, :, j] the label of row j-1). Returns logits [b, N, B, V]
        (base logits plus Markov bias); row j of anchor p predicts the token at p + j + 1.
        """
        c = self.c
        bsz, t_len, _ = taps.shape
        n_anc = anchors.shape[1]
        blk = c.block_size
        dev = taps.device
        ctx = self.context(taps)
        ctx_pos = torch.arange(t_len, device=dev).expand(bsz, t_len)
        kv = self.context_kv(ctx, ctx_pos)
        j = torch.arange(blk, device=dev)
        blk_pos = (anchors[:, :, None] + j).reshape(bsz, n_anc * blk)
        blk_ids = torch.full((bsz, n_anc, blk), c.mask_token_id, dtype=torch.long, device=dev)
        blk_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
        # Row (n, j) sees context t < anchors[n] and every row of its own block.
        ctx_vis = torch.arange(t_len, device=dev)[None, None, :] < anchors[:, :, None]  # [b, N, T]
        ctx_vis = ctx_vis[:, :, None, :].expand(bsz, n_anc, blk, t_len).reshape(bsz, n_anc * blk, t_len)
        same = torch.arange(n_anc, device=dev).repeat_interleave(blk)
        blk_vis = (same[:, None] == same[None, :]).expand(bsz, -1, -1)
        mask = torch.cat([ctx_vis, blk_vis], dim=-1)
        z = self.block_hidden(blk_ids.reshape(bsz, n_anc * blk), blk_pos, kv, mask)
        logits = self.base_logits(z).reshape(bsz, n_anc, blk, -1)
        return logits + self.markov_head(prev)


class DraftCache:
    """Incremental inference for one session, as the engine runs it (batch 1).

    Holds every draft layer's context K/V for positions [0, end). ``ingest`` appends or
    overwrites rows from ``pos``; ``draft`` runs the block [anchor, mask x (B-1)] at p..p+B-1
    against context positions < p, then the greedy Markov chain.
    """

    def __init__(self, model: TinyDSpark) -> None:
        self.m = model
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.end = 0

    @torch.no_grad()
    def ingest(self, taps: torch.Tensor, pos: int) -> None:
        """taps [n, n_taps*H] for positions pos..pos+n-1 (pos <= end)."""
        assert pos <= self.end, "gap in context"
        positions = torch.arange(pos, pos + taps.shape[0], device=taps.device)
        kv = self.m.context_kv(self.m.context(taps.to(self.m.fc.weight.dtype)), positions)
        if not self.k:
            self.k = [k[..., :0, :] for k, _ in kv]
            self.v = [v[..., :0, :] for _, v in kv]
        self.k = [torch.cat([old[..., :pos, :], k], dim=-2) for old, (k, _) in zip(self.k, kv, strict=True)]
        self.v = [torch.cat([old[..., :pos, :], v], dim=-2) for old, (_, v) in zip(self.v, kv, strict=True)]
        self.end = pos + taps.shape[0]

    @torch.no_grad()
    def draft_logits(self, anchor: int, p: int, k: int | None = None) -> tuple[list[int], torch.Tensor]:
        """Greedy drafts d_1..d_k after anchor ``anchor`` at position ``p`` and their logits [k, V]."""
        m, blk = self.m, self.m.c.block_size
        k = blk if k is None else k
        assert p <= self.end and 1 <= k <= blk
        dev = m.fc.weight.device
        ids = torch.full((1, blk), m.c.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor
        positions = torch.arange(p, p + blk, device=dev)[None]
        kv = [(kc[None, :, :p, :], vc[None, :, :p, :]) for kc, vc in zip(self.k, self.v, strict=True)]
        z = m.block_hidden(ids, positions, kv, None)[0]
        base = m.base_logits(z)
        drafts: list[int] = []
        rows = []
        prev = anchor
        for j in range(k):
            row = base[j] + m.markov_head(torch.tensor([prev], device=dev))[0]
            prev = int(row.argmax())
            drafts.append(prev)
            rows.append(row)
        return drafts, torch.stack(rows)

    def draft(self, anchor: int, p: int, k: int | None = None) -> list[int]:
        return self.draft_logits(anchor, p, k)[0]


# ----------------------------------------------------------------------------------------------
# Loading the pair


def load_tokenizer(target_dir: Path | None = None) -> Tokenizer:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(target_dir or TARGET_DIR) / "tokenizer.json"))


def load_target(target_dir: Path | None = None, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(target_dir or TARGET_DIR))  # no dtype kwarg: its name changed in v5
    model.to(dtype).eval()
    return model


def load_draft(
    draft_dir: Path | None = None, target: Qwen3ForCausalLM | None = None, dtype: torch.dtype = torch.float32
) -> TinyDSpark:
    """Draft from ``draft_dir`` with the frozen target embedding / lm_head taken from ``target``."""
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir or DRAFT_DIR)
    cfg = DraftConfig.from_json(json.loads((draft_dir / "config.json").read_text()))
    if target is None:
        target = load_target(draft_dir.parent / "target")
    embed = target.get_input_embeddings().weight.detach().to(dtype)
    lm_head = target.get_output_embeddings().weight.detach().to(dtype)
    model = TinyDSpark(cfg, embed, lm_head)
    state = load_file(str(draft_dir / "model.safetensors"))
    state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    model.to(dtype).eval()
    return model


@torch.no_grad()
def target_taps(
    target: Qwen3ForCausalLM, ids: torch.Tensor, layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, T] -> (taps [b, T, n_taps*H] rounded to bf16 then back to float32, logits [b, T, V]).

    DeepSpec tap id l is HF ``hidden_states[l + 1]`` = vLLM aux id l + 1 (the residual stream
    after l + 1 decoder layers). Never tap the last layer: HF applies the final norm there.
    """
    n_layers = target.config.num_hidden_layers
    assert all(0 <= i < n_layers - 1 for i in layer_ids), "tap the last layer and HF/vLLM disagree"
    out = target(input_ids=ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return taps.to(torch.bfloat16).float(), out.logits.float()


@torch.no_grad()
def greedy_generate(target: Qwen3ForCausalLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation (no EOS stop) of prompts [b, L] -> [b, L + new_tokens], KV-cached."""
    out = target(input_ids=prompt, use_cache=True)
    past = out.past_key_values
    seq = [prompt, out.logits[:, -1].argmax(-1, keepdim=True)]
    with warnings.catch_warnings():  # transformers 5 renames past_key_values to cache; 4.x has only the old name
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(new_tokens - 1):
            out = target(input_ids=seq[-1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            seq.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(seq, dim=1)


@dataclass
class AcceptStats:
    steps: int = 0
    accepted_tokens: int = 0  # sum over steps of acceptance length (accepted drafts + 1)

    @property
    def mean(self) -> float:
        return self.accepted_tokens / max(self.steps, 1)


@torch.no_grad()
def acceptance(
    target: Qwen3ForCausalLM,
    draft: TinyDSpark,
    prompt: list[int],
    new_tokens: int,
    k: int | None = None,
    stats: AcceptStats | None = None,
) -> AcceptStats:
    """Greedy acceptance of ``draft`` on one prompt, mirroring the engine loop.

    The target's greedy continuation is computed once (greedy verification makes the output
    exactly that sequence); taps come from one causal forward of prompt + continuation, which
    equals what the engine computes row by row. Steps stop once the anchor passes the end.
    """
    stats = stats if stats is not None else AcceptStats()
    k = draft.c.block_size if k is None else k
    ids = greedy_generate(target, torch.tensor([prompt]), new_tokens)
    taps, _ = target_taps(target, ids, draft.c.target_layer_ids)
    seq = ids[0].tolist()
    total = len(seq)
    cache = DraftCache(draft)
    cache.ingest(taps[0, : len(prompt)], 0)  # prefill
    p = len(prompt)  # anchor position; seq[p] is the target's first sampled token
    while p < total - 1:
        drafts = cache.draft(seq[p], p, k)
        acc = 0
        for d in drafts:
            if p + 1 + acc < total and d == seq[p + 1 + acc]:
                acc += 1
            else:
                break
        stats.steps += 1
        stats.accepted_tokens += acc + 1
        cache.ingest(taps[0, p : p + acc + 1], p)  # committed rows: anchor + accepted drafts
        p = p + acc + 1  # new anchor: the target's correction / bonus token
    return stats
