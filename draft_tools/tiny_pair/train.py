"""Train and write the tiny Qwen3 target + DSpark draft pair shipped in ``draft_tools/tiny_pair/assets``.

Everything is offline and deterministic (fixed seeds, fixed step counts, sorted file lists,
CPU). The corpus is the running interpreter's standard-library sources (``sysconfig`` stdlib
path, ``*.py``, minus tests, site-packages and codec tables); files whose path hash falls in
the held-out bucket are used for evaluation only. Stages:

1. tokenizer: byte-level BPE (``tokenizers``) with specials ``<|pad|> <|bos|> <|endoftext|>
   <|mask|>`` (ids 0-3; ``<|mask|>`` is the drafter's mask token), trained on training files;
2. target: HF ``Qwen3ForCausalLM`` trained by next-token cross-entropy on random windows of
   the training stream, then rounded to bf16 (everything after uses the rounded weights);
3. draft data: the frozen target's greedy continuations of prompts cut from training files,
   with their tap hidden states (rounded to bf16, as on the wire) and the target's argmax;
4. draft: ``tiny_pair.TinyDSpark`` trained by cross-entropy of every block row (with the
   teacher-forced Markov bias) against the target's greedy token, i.e. distillation of the
   target's argmax, many anchors per sequence at once;
5. held-out greedy acceptance with ``tiny_pair.acceptance`` (the engine loop), written with
   all settings to ``train_settings.json``.

Run: ``python -m draft_tools.tiny_pair.train [--out DIR] [--threads 2]`` (about 15 min on 2
cores uncontended). ``--smoke`` runs every stage with tiny step counts (for checking the script only).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import random
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from draft_server.models.config import DSparkConfig, parse_config
from draft_tools.tiny_pair.pair import (
    ASSET_DIR,
    AcceptStats,
    TinyDSpark,
    acceptance,
    greedy_generate,
    load_draft,
    load_target,
    target_taps,
)

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|endoftext|>", "<|mask|>")
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "encodings", "__pycache__"})


@dataclasses.dataclass
class Settings:
    """Every knob of a run; written to train_settings.json next to the weights."""

    seed: int = 1234
    threads: int = 1  # 1 thread: the 2 shared cores are oversubscribed by other work (OpenMP barriers stall)
    held_out_mod: int = 10  # a file is held out when sha256(relpath) % held_out_mod == 0
    # tokenizer
    vocab_size: int = 512
    # target (Qwen3)
    t_layers: int = 6
    t_hidden: int = 128
    t_intermediate: int = 384
    t_heads: int = 4
    t_kv_heads: int = 2
    t_head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    t_seq_len: int = 256
    t_batch: int = 24
    t_steps: int = 1000
    t_lr: float = 3e-3
    t_warmup: int = 100
    t_weight_decay: float = 0.1
    t_min_lr_frac: float = 0.1
    # draft (DSpark, Qwen3 backbone)
    d_layers: int = 2
    target_layer_ids: tuple[int, ...] = (0, 2, 4)  # DeepSpec ids: HF hidden_states[id + 1]
    block_size: int = 5
    markov_rank: int = 32
    d_data_seqs: int = 3072  # greedy continuations generated for draft training
    d_seq_len: int = 160
    d_prompt_min: int = 16
    d_prompt_max: int = 96
    d_gen_batch: int = 64
    d_batch: int = 16
    d_anchors: int = 32  # anchors per sequence per step
    d_steps: int = 1500
    d_lr: float = 2e-3
    d_warmup: int = 50
    d_weight_decay: float = 0.01
    d_loss_decay: float = 4.0  # row j weighted exp(-j / d_loss_decay)
    # evaluation
    eval_prompts: int = 32
    eval_prompt_len: int = 48
    eval_new_tokens: int = 128
    shipped_prompts: int = 8  # held-out prompts written to eval_prompts.json for the test


def smoke(s: Settings) -> Settings:
    return dataclasses.replace(
        s, t_steps=6, t_batch=4, d_data_seqs=16, d_gen_batch=8, d_steps=4, d_batch=4, eval_prompts=2, eval_new_tokens=24
    )


# ----------------------------------------------------------------------------------------------
# corpus and tokenizer


def corpus_files(stdlib: Path, s: Settings) -> tuple[list[Path], list[Path]]:
    """Deterministic (train, held_out) lists of stdlib ``*.py`` files, sorted by relative path."""
    files = sorted(
        (p for p in stdlib.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(stdlib).parts)),
        key=lambda p: p.relative_to(stdlib).as_posix(),
    )
    train, held = [], []
    for p in files:
        h = int(hashlib.sha256(p.relative_to(stdlib).as_posix().encode()).hexdigest(), 16)
        (held if h % s.held_out_mod == 0 else train).append(p)
    return train, held


def read_text(p: Path) -> str:
    return p.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: Sequence[str], s: Settings) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=s.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def encode_stream(tok: Any, texts: Sequence[str]) -> np.ndarray:
    """All texts tokenized, each followed by <|endoftext|>, as one int16 stream."""
    out: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        out.extend(enc.ids)
        out.append(EOS_ID)
    return np.asarray(out, dtype=np.int16)


def write_tokenizer(tok: Any, out: Path, s: Settings) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "mask_token": "<|mask|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": s.max_position_embeddings,
        "added_tokens_decoder": added,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# target


def target_config(s: Settings) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.t_hidden,
        intermediate_size=s.t_intermediate,
        num_hidden_layers=s.t_layers,
        num_attention_heads=s.t_heads,
        num_key_value_heads=s.t_kv_heads,
        head_dim=s.t_head_dim,
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=s.rms_norm_eps,
        rope_theta=s.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_dropout=0.0,
    )


def lr_at(step: int, total: int, peak: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - length, size=n)
    return torch.from_numpy(np.stack([stream[i : i + length] for i in starts]).astype(np.int64))


@torch.no_grad()
def eval_loss(model: Any, stream: np.ndarray, s: Settings, n: int = 64) -> float:
    rng = np.random.default_rng(s.seed + 7)
    x = windows(stream, n, s.t_seq_len + 1, rng)
    losses = []
    for i in range(0, n, 16):
        b = x[i : i + 16]
        logits = model(input_ids=b[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten()).item())
    return float(np.mean(losses))


def train_target(train: np.ndarray, held: np.ndarray, s: Settings, log: dict[str, Any]) -> Any:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(s.seed)
    model = Qwen3ForCausalLM(target_config(s))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.t_weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.t_lr,
        betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(s.seed)
    t0 = time.time()
    for step in range(s.t_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.t_steps, s.t_lr, s.t_warmup, s.t_min_lr_frac)
        x = windows(train, s.t_batch, s.t_seq_len + 1, rng)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == s.t_steps - 1:
            print(f"target step {step} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)
    model.eval()
    log["target_train_s"] = round(time.time() - t0, 1)
    log["target_final_train_loss"] = round(loss.item(), 4)
    model.to(torch.bfloat16).to(torch.float32)  # everything downstream sees the shipped weights
    log["target_heldout_loss"] = round(eval_loss(model, held, s), 4)
    print(f"target held-out loss {log['target_heldout_loss']}", flush=True)
    return model


def write_target(model: Any, tok: Any, out: Path, s: Settings) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    model.to(torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    cfg["rope_theta"] = s.rope_theta  # older readers look here; newer ones at rope_parameters
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False)
    gen.save_pretrained(str(out))
    write_tokenizer(tok, out, s)


# ----------------------------------------------------------------------------------------------
# draft


def draft_json(s: Settings, target_dir: Path) -> dict[str, Any]:
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        num_hidden_layers=s.d_layers,
        layer_types=["full_attention"] * s.d_layers,
        num_target_layers=s.t_layers,
        target_layer_ids=list(s.target_layer_ids),
        block_size=s.block_size,
        mask_token_id=MASK_ID,
        num_anchors=s.d_anchors,
        markov_rank=s.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )
    return cfg


@torch.no_grad()
def make_draft_data(target: Any, stream: np.ndarray, s: Settings, log: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Greedy continuations of training prompts, their taps (bf16) and the target's argmax."""
    rng = np.random.default_rng(s.seed + 1)
    t0 = time.time()
    toks, taps, labels, plens = [], [], [], []
    for _ in range(0, s.d_data_seqs, s.d_gen_batch):
        plen = int(rng.integers(s.d_prompt_min, s.d_prompt_max + 1))
        prompt = windows(stream, s.d_gen_batch, plen, rng)
        seq = greedy_generate(target, prompt, s.d_seq_len - plen)
        tp, logits = target_taps(target, seq, s.target_layer_ids)
        toks.append(seq)
        taps.append(tp.to(torch.bfloat16))
        labels.append(logits.argmax(-1))
        plens.append(torch.full((seq.shape[0],), plen))
    data = {"tokens": torch.cat(toks), "taps": torch.cat(taps), "labels": torch.cat(labels), "plen": torch.cat(plens)}
    gen = data["tokens"][:, 1:]
    mism = ((data["labels"][:, :-1] != gen) & (torch.arange(1, s.d_seq_len) >= data["plen"][:, None])).sum().item()
    log["draft_data_s"] = round(time.time() - t0, 1)
    log["draft_data_tokens"] = int(data["tokens"].numel())
    log["draft_data_label_mismatch_in_generated"] = int(mism)
    print(f"draft data {data['tokens'].shape} in {log['draft_data_s']}s (argmax/greedy mismatches {mism})", flush=True)
    return data


def sample_batch(data: dict[str, torch.Tensor], s: Settings, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    """Sequences, anchors p in [plen-1, T-B] (context and labels all greedy-consistent), prev, labels."""
    n = data["tokens"].shape[0]
    idx = torch.from_numpy(rng.integers(0, n, size=s.d_batch))
    tokens, taps, labels, plen = (data[k][idx] for k in ("tokens", "taps", "labels", "plen"))
    lo = (plen - 1).numpy()
    hi = s.d_seq_len - s.block_size
    anchors = torch.from_numpy(np.stack([rng.integers(lo_i, hi + 1, size=s.d_anchors) for lo_i in lo]))
    j = torch.arange(s.block_size)
    rows = anchors[:, :, None] + j  # label of row j: target argmax at p + j (predicts p + j + 1)
    y = torch.gather(labels, 1, rows.flatten(1)).view_as(rows)
    prev = torch.cat([torch.gather(tokens, 1, anchors)[:, :, None], y[:, :, :-1]], dim=2)
    return taps.float(), anchors, tokens, prev, y


def train_draft(
    target: Any, data: dict[str, torch.Tensor], cfg: DSparkConfig, s: Settings, log: dict[str, Any]
) -> TinyDSpark:
    torch.manual_seed(s.seed + 2)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    model = TinyDSpark(cfg, embed, lm_head)
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.d_weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.d_lr,
        betas=(0.9, 0.95),
    )
    w = torch.exp(-torch.arange(s.block_size, dtype=torch.float32) / s.d_loss_decay)
    w = w / w.sum()
    rng = np.random.default_rng(s.seed + 3)
    t0 = time.time()
    for step in range(s.d_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.d_steps, s.d_lr, s.d_warmup, 0.1)
        taps, anchors, tokens, prev, y = sample_batch(data, s, rng)
        logits = model.train_logits(taps, anchors, tokens, prev)
        ce = F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none").view_as(y).float()
        loss = (ce.mean(dim=(0, 1)) * w).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == s.d_steps - 1:
            acc = (logits.argmax(-1) == y).float().mean(dim=(0, 1))
            accs = " ".join(f"{a:.2f}" for a in acc.tolist())
            print(f"draft step {step} loss {loss.item():.3f} row-acc [{accs}] {time.time() - t0:.0f}s", flush=True)
    model.eval()
    log["draft_train_s"] = round(time.time() - t0, 1)
    log["draft_final_loss"] = round(loss.item(), 4)
    return model


def write_draft(model: TinyDSpark, target: Any, out: Path, s: Settings, target_dir: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    # Frozen copies of the target's embedding and head, as in the DeepSpec layout (§10).
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
    state["lm_head.weight"] = target.get_output_embeddings().weight.detach().to(torch.bfloat16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft_json(s, target_dir), indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# evaluation


def held_out_prompts(tok: Any, held_texts: Sequence[str], s: Settings) -> list[dict[str, Any]]:
    """Deterministic prompts: eval_prompt_len tokens starting at a line start of a held-out file."""
    rng = random.Random(s.seed + 5)
    prompts = []
    candidates = [t for t in held_texts if len(t) > 4000]
    for i in range(s.eval_prompts):
        text = candidates[i % len(candidates)]
        lines = text.splitlines(keepends=True)
        start = rng.randrange(0, max(1, len(lines) - 60))
        chunk = "".join(lines[start : start + 60])
        ids = tok.encode(chunk).ids[: s.eval_prompt_len]
        prompts.append({"ids": ids, "text": tok.decode(ids)})
    return prompts


def evaluate(target: Any, draft: TinyDSpark, prompts: Sequence[dict[str, Any]], s: Settings) -> dict[str, Any]:
    t0 = time.time()
    stats = AcceptStats()
    per_prompt = []
    for pr in prompts:
        one = acceptance(target, draft, pr["ids"], s.eval_new_tokens)
        per_prompt.append(round(one.mean, 3))
        stats.steps += one.steps
        stats.accepted_tokens += one.accepted_tokens
    return {
        "mean_acceptance_length": round(stats.mean, 4),
        "steps": stats.steps,
        "tokens": stats.accepted_tokens,
        "prompts": len(prompts),
        "k": draft.c.block_size,
        "per_prompt": per_prompt,
        "eval_s": round(time.time() - t0, 1),
    }


# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ASSET_DIR, help="output dir (target/, draft/ inside)")
    ap.add_argument("--threads", type=int, default=Settings.threads)
    ap.add_argument("--seed", type=int, default=Settings.seed)
    ap.add_argument("--target-steps", type=int, default=Settings.t_steps)
    ap.add_argument("--draft-steps", type=int, default=Settings.d_steps)
    ap.add_argument("--draft-data-seqs", type=int, default=Settings.d_data_seqs)
    ap.add_argument("--smoke", action="store_true", help="tiny step counts: checks the script, not the model")
    ap.add_argument("--reuse-target", action="store_true", help="keep <out>/target and train only the draft")
    args = ap.parse_args(argv)

    s = Settings(
        threads=args.threads,
        seed=args.seed,
        t_steps=args.target_steps,
        d_steps=args.draft_steps,
        d_data_seqs=args.draft_data_seqs,
    )
    if args.smoke:
        s = smoke(s)
    torch.set_num_threads(s.threads)
    torch.set_flush_denormal(True)  # denormal AdamW moments slow x86 CPUs by orders of magnitude
    torch.manual_seed(s.seed)
    t_start = time.time()
    log: dict[str, Any] = {}
    out: Path = args.out
    target_dir, draft_dir = out / "target", out / "draft"

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = corpus_files(stdlib, s)
    train_texts = [read_text(p) for p in train_files]
    held_texts = [read_text(p) for p in held_files]
    corpus_hash = hashlib.sha256()
    for p, t in zip(train_files + held_files, train_texts + held_texts, strict=True):
        corpus_hash.update(p.relative_to(stdlib).as_posix().encode() + b"\0" + t.encode())
    log["corpus"] = {
        "stdlib": str(stdlib),
        "python": platform.python_version(),
        "train_files": len(train_files),
        "held_out_files": len(held_files),
        "train_bytes": sum(len(t) for t in train_texts),
        "held_out_bytes": sum(len(t) for t in held_texts),
        "sha256": corpus_hash.hexdigest(),
        "held_out_examples": [p.relative_to(stdlib).as_posix() for p in held_files[:10]],
    }
    print(json.dumps(log["corpus"], indent=1), flush=True)

    if args.reuse_target:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        target = load_target(target_dir)
        prev = json.loads((out / "train_settings.json").read_text())
        for key in ("target_train_s", "target_final_train_loss", "target_heldout_loss"):
            log[key] = prev["log"].get(key)
    else:
        tok = train_tokenizer(train_texts, s)
    train_stream = encode_stream(tok, train_texts)
    held_stream = encode_stream(tok, held_texts)
    log["train_tokens"] = len(train_stream)
    log["held_out_tokens"] = len(held_stream)
    log["bytes_per_token"] = round(log["corpus"]["train_bytes"] / len(train_stream), 3)
    print(f"stream: train {len(train_stream)} held-out {len(held_stream)} tokens", flush=True)

    if not args.reuse_target:
        target = train_target(train_stream, held_stream, s, log)
        if target_dir.exists():
            shutil.rmtree(target_dir)
        write_target(target, tok, target_dir, s)
        target = load_target(target_dir)  # exactly the shipped (bf16) weights, in float32

    data = make_draft_data(target, train_stream, s, log)
    cfg = parse_config(draft_json(s, target_dir), "tiny-draft")
    draft = train_draft(target, data, cfg, s, log)
    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    write_draft(draft, target, draft_dir, s, target_dir)
    draft = load_draft(draft_dir, target)  # the shipped bf16 weights

    prompts = held_out_prompts(tok, held_texts, s)
    log["heldout_acceptance"] = evaluate(target, draft, prompts, s)
    print(json.dumps(log["heldout_acceptance"]), flush=True)
    sample = greedy_generate(target, torch.tensor([prompts[0]["ids"]]), 96)[0].tolist()
    log["sample_prompt"] = tok.decode(prompts[0]["ids"])
    log["sample_continuation"] = tok.decode(sample[len(prompts[0]["ids"]) :])
    log["total_s"] = round(time.time() - t_start, 1)

    shipped = [{"ids": p["ids"], "text": p["text"]} for p in prompts[: s.shipped_prompts]]
    (out / "eval_prompts.json").write_text(json.dumps(shipped, indent=1) + "\n")
    settings = {
        "settings": dataclasses.asdict(s),
        "log": log,
        "command": "python -m draft_tools.tiny_pair.train " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
    }
    (out / "train_settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    print(f"done in {log['total_s']}s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
