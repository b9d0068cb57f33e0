"""The tiny shipped target/draft pair: a trainable view of the production DSpark model, loading,
and the acceptance harness.

Used by ``train`` (which trains and writes the pair), the demo and the tests:

* ``TinyDSpark``: the Qwen3-backbone DSpark drafter's parameters as an ``nn.Module`` whose
  ``state_dict`` names are the checkpoint names (``fc``, ``hidden_norm``, ``layers.i.*``,
  ``norm``, ``markov_head.markov_w{1,2}``). It holds no math of its own: ``model()`` is the
  production ``draft_server.models`` network over these tensors, ``drafter()`` the production
  ``DSparkDrafter`` (paged KV, batched drafting) and ``train_logits`` runs many anchors of one
  sequence at once through the same network with a block-diagonal mask (training). Its
  embedding and lm_head are the frozen target's, passed in, never stored in the draft checkpoint.
* Loading the pair from disk (``load_target``, ``load_draft``, ``load_tokenizer``), and
  computing the target's tap hidden states (``target_taps``) in the DeepSpec convention
  (id l = HF ``hidden_states[l + 1]``), rounded to bf16 as they travel on the wire.
* ``acceptance``: greedy acceptance length of the draft against the target's greedy
  continuation, through the production drafter exactly as the engine drives it (prefill taps,
  then per step: draft k tokens from the anchor, accept the leading matches, ingest anchor +
  accepted rows, new anchor = the target's correction/bonus token), with the rows in any wire
  format (``protocol.wire``) as the client's encoder makes them (``wire_rows``).

transformers and tokenizers are imported lazily: the draft itself needs torch only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from draft_server.drafters import DraftItem, IngestItem
from draft_server.models.attention import DenseContext
from draft_server.models.config import DSparkConfig, expected_shapes, load_config
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.loader import build_model
from draft_server.models.model import DSparkModel
from protocol import GREEDY, DType
from target_client.projection import Projection
from target_client.vllm.wire import WireEncoder

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

ASSET_DIR = Path(__file__).resolve().parent / "assets"
TARGET_DIR = ASSET_DIR / "target"
DRAFT_DIR = ASSET_DIR / "draft"


class TinyDSpark(nn.Module):
    """Trainable Qwen3 DSpark draft parameters. ``embed``/``lm_head`` are the frozen target's ([V, H])."""

    def __init__(self, c: DSparkConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.c = c
        required, _ = expected_shapes(c)
        for name, shape in required.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            init = torch.ones(shape) if "norm" in leaf or name.endswith("norm.weight") else torch.zeros(shape)
            owner.register_parameter(leaf, nn.Parameter(init))
        # Frozen target tensors: buffers that are not saved with the draft.
        self.register_buffer("embed_w", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head_w", lm_head.detach().clone(), persistent=False)

    def model(self) -> DSparkModel:
        """The production network over this module's current tensors (autograd flows through it)."""
        w = dict(self.named_parameters())
        w["embed_tokens.weight"], w["lm_head.weight"] = self.embed_w, self.lm_head_w
        return build_model(self.c, w, self.embed_w.device, self.embed_w.dtype)

    def drafter(self, kv_budget_bytes: int = 16 << 20, block_width: str = "k") -> DSparkDrafter:
        """The production drafter (paged KV cache, batched drafting) over these weights."""
        return DSparkDrafter(self.model(), kv_budget_bytes, block_width=block_width)

    def train_logits(
        self, taps: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, prev: torch.Tensor
    ) -> torch.Tensor:
        """Training forward, many anchors per sequence at once.

        taps [b, T, n_taps*H]; anchors [b, N] anchor positions; tokens [b, T] the sequence;
        prev [b, N, B] the Markov predecessor of each block row (teacher-forced: prev[:, :, 0]
        is the anchor token, prev[:, :, j] the label of row j-1). Returns logits [b, N, B, V]
        (base logits plus Markov bias); row j of anchor p predicts the token at p + j + 1.
        """
        m = self.model()
        return m.logits(self.train_block(m, taps, anchors, tokens)) + m.markov_bias(m.markov_embed(prev))

    def train_block(
        self, m: DSparkModel, taps: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """The final-normed block rows z [b, N, B, H] of ``train_logits`` (same arguments)."""
        c = self.c
        bsz, t_len, _ = taps.shape
        n_anc, blk = anchors.shape[1], c.block_size
        dev = taps.device
        ctx_pos = torch.arange(t_len, device=dev).repeat(bsz)
        kv = m.context_kv(m.context(taps.reshape(bsz * t_len, -1)), ctx_pos)  # [L, b*T, *token]
        kv = kv.view(kv.shape[0], bsz, t_len, *kv.shape[2:])
        j = torch.arange(blk, device=dev)
        blk_pos = (anchors[:, :, None] + j).reshape(bsz, n_anc * blk)
        blk_ids = torch.full((bsz, n_anc, blk), c.mask_token_id, dtype=torch.long, device=dev)
        blk_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
        # Row (n, j) sees context t < anchors[n] and the rows of its own block (all, or up to j if causal).
        ctx_vis = torch.arange(t_len, device=dev)[None, None, :] < anchors[:, :, None]  # [b, N, T]
        ctx_vis = ctx_vis[:, :, None, :].expand(bsz, n_anc, blk, t_len).reshape(bsz, n_anc * blk, t_len)
        own = torch.ones(blk, blk, dtype=torch.bool, device=dev)
        own = own.tril() if c.causal else own
        blk_vis = torch.block_diag(*[own] * n_anc).expand(bsz, -1, -1)
        ctx = DenseContext(lambda layer: kv[layer], torch.cat([ctx_vis, blk_vis], dim=-1), m.layout, c.softmax_scale)
        return m.block(blk_ids.reshape(bsz, n_anc * blk), blk_pos, ctx).reshape(bsz, n_anc, blk, -1)


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """Taps as they travel on the wire: bf16 bit patterns (uint16)."""
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def wire_rows(draft: TinyDSpark, wire: str) -> Callable[[torch.Tensor], np.ndarray]:
    """taps -> rows of wire format ``wire`` as ``target_client.vllm.wire`` makes them (projected:
    with this draft's own ``fc`` / ``hidden_norm``, in the dtype its drafter asks for)."""
    proj = None
    if wire == "projected":
        w = {n: t.detach().to(torch.float32).numpy() for n, t in draft.named_parameters()}
        names = ("fc.weight", "hidden_norm.weight")
        proj = Projection(w[names[0]], w[names[1]], "F32", "F32", draft.c.rms_norm_eps, names)
    enc = WireEncoder(wire, proj)
    dtype = DType.F32 if draft.embed_w.dtype in (torch.float32, torch.float64) else DType.BF16
    return lambda taps: enc(taps, dtype)


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
    cfg = load_config(str(draft_dir))
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
    wire: str = "bf16",
    events: list[tuple[list[float], int]] | None = None,
    block_width: str = "k",
) -> AcceptStats:
    """Greedy acceptance of ``draft`` on one prompt, mirroring the engine loop.

    The target's greedy continuation is computed once (greedy verification makes the output
    exactly that sequence); taps come from one causal forward of prompt + continuation, which
    equals what the engine computes row by row. Steps stop once the anchor passes the end.
    ``events`` (when given) gets one (per-draft confidence, accepted drafts) per step.
    """
    stats = stats if stats is not None else AcceptStats()
    k = draft.c.block_size if k is None else k
    ids = greedy_generate(target, torch.tensor([prompt]), new_tokens)
    taps, _ = target_taps(target, ids, draft.c.target_layer_ids)
    seq = ids[0].tolist()
    total = len(seq)
    drafter = draft.drafter(block_width=block_width)
    session = 0
    assert drafter.reserve(session, 0, total + draft.c.block_size)
    rows = wire_rows(draft, wire)
    drafter.ingest([IngestItem(session, 0, 0, rows(taps[0, : len(prompt)]), wire)])  # prefill
    p = len(prompt)  # anchor position; seq[p] is the target's first sampled token
    while p < total - 1:
        out = drafter.draft([DraftItem(session, 0, p, seq[p], k, GREEDY)])[0]
        drafts = out.tokens
        acc = 0
        for d in drafts:
            if p + 1 + acc < total and d == seq[p + 1 + acc]:
                acc += 1
            else:
                break
        stats.steps += 1
        stats.accepted_tokens += acc + 1
        if events is not None:
            events.append((list(out.confidence), acc))
        drafter.ingest([IngestItem(session, 0, p, rows(taps[0, p : p + acc + 1]), wire)])  # anchor + accepted
        p = p + acc + 1  # new anchor: the target's correction / bonus token
    drafter.release(session)
    return stats
