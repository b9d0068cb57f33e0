"""The sequential stage: Markov head, confidence head and draft sampling, batched over sessions.

Step j (0-based) for every session at once, with prev_0 = anchor::

    e_j      = W1[prev_j]                       (Markov embedding, target-vocab row)
    l_j      = logit_scale * (lm_head z_j + W2 e_j)  (draft vocab)
    d_{j+1}  = argmax l_j  |  sample(softmax(topk/topp(l_j / T)))
    conf_j   = sigmoid((w . [z_j; e_j] + b) / T_sts[j])
    prev_{j+1} = d2t(d_{j+1})                   (target id)

Sampling is Gumbel-max with noise from a counter-based hash of (seed, position of the row
that predicts, vocab index): reruns with the same seed agree exactly, on any device and in any
batch. The position keyed is the predicting row's (p + j), vLLM's ``sample_pos - 1``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from draft_server.models.model import DSparkModel
from protocol import Sampling

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(keys), vocab] float64 uniforms in (0, 1), a pure function of (key, vocab index)."""
    k = torch.tensor([[key & _M32, key >> 32] for key in keys], dtype=torch.int64, device=device)
    v = torch.arange(vocab, dtype=torch.int64, device=device)
    hi = _hash32(_hash32(v[None, :] ^ k[:, :1]) ^ k[:, 1:])
    lo = _hash32(hi ^ k[:, :1] ^ 0x85EBCA6B) >> 11
    return ((hi << 21) + lo).to(torch.float64).add_(0.5).mul_(2.0**-53)


def noise_key(seed: int, position: int) -> int:
    return _splitmix64(seed ^ _splitmix64(position & _M64))


@dataclass
class StepOut:
    tokens: torch.Tensor  # [N, k] target ids
    confidence: torch.Tensor | None  # [N, k] float
    probs: list[tuple[np.ndarray, np.ndarray] | None]  # per session (probs [k, n], ids [k, n])
    logits: torch.Tensor | None  # [N, k, Vd] processed-before-temperature logits (debug)


def _filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    srt, idx = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)
    keep = rank[None, :] < torch.where(top_k > 0, top_k, x.shape[-1])[:, None]
    srt = srt.masked_fill(~keep, float("-inf"))
    p = torch.softmax(srt, dim=-1)
    keep &= (p.cumsum(-1) - p) < top_p[:, None]
    keep[:, 0] = True
    return x.masked_fill(~torch.zeros_like(keep).scatter(-1, idx, keep), float("-inf"))


class Sampler:
    """Runs the k sequential steps for a batch of sessions."""

    def __init__(self, model: DSparkModel, sts_temperatures: list[float] | None = None) -> None:
        self.m = model
        B = model.cfg.block_size
        temps = list(sts_temperatures or []) + [1.0] * B
        self.sts = torch.tensor(temps[:B], dtype=model.acc, device=model.device)
        self._rng = random.Random()

    def run(
        self,
        z: torch.Tensor,
        anchors: torch.Tensor,
        positions: list[int],
        ks: list[int],
        samplings: list[Sampling],
        want_logits: bool = False,
    ) -> StepOut:
        m, dev = self.m, self.m.device
        N, kmax = len(ks), max(ks)
        base = m.logits(z[:, :kmax])  # [N, kmax, Vd]
        Vd = base.shape[-1]
        temps = torch.tensor([s.temperature for s in samplings], dtype=base.dtype, device=dev)
        sampled = [s.temperature > 0 for s in samplings]
        any_sampled = any(sampled)
        filt = any(s.top_k > 0 or s.top_p < 1.0 for s in samplings)
        if filt:
            top_k = torch.tensor([s.top_k for s in samplings], device=dev)
            top_p = torch.tensor([s.top_p for s in samplings], dtype=base.dtype, device=dev)
        nprob = max((s.return_probs for s, on in zip(samplings, sampled, strict=True) if on), default=0)
        seeds = [s.seed if s.seed is not None else self._rng.getrandbits(63) for s in samplings]
        is_sampled = torch.tensor(sampled, device=dev)
        prev = anchors
        toks, confs, logits_out = [], [], []
        probs_v, probs_i = [], []
        for j in range(kmax):
            e = m.markov_embed(prev)
            lj = base[:, j] if e is None else base[:, j] + m.markov_bias(e)
            if want_logits:
                logits_out.append(lj)
            if m.conf_w is not None:
                s = m.confidence_logit(z[:, j], e).to(base.dtype)
                confs.append(torch.sigmoid(s / self.sts[j]))
            d = lj.argmax(-1)
            if any_sampled:
                x = lj / torch.where(temps > 0, temps, 1.0)[:, None]
                if filt:
                    x = _filter(x, top_k, top_p)
                keys = [noise_key(seed, pos + j) for seed, pos in zip(seeds, positions, strict=True)]
                g = -torch.log(-torch.log(uniform_noise(keys, Vd, dev)))
                d = torch.where(is_sampled, (x + g.to(x.dtype)).argmax(-1), d)
                if nprob:
                    pv, pi = torch.softmax(x, dim=-1).topk(min(nprob, Vd), dim=-1)
                    probs_v.append(pv.float())
                    probs_i.append(m.to_target_ids(pi))
            prev = m.to_target_ids(d)
            toks.append(prev)
        tokens = torch.stack(toks, dim=1)
        conf = torch.stack(confs, dim=1) if confs else None
        probs: list[tuple[np.ndarray, np.ndarray] | None] = [None] * N
        if nprob:
            pv = torch.stack(probs_v, dim=1).cpu().numpy()
            pi = torch.stack(probs_i, dim=1).to(torch.int32).cpu().numpy()
            for n, (s, on) in enumerate(zip(samplings, sampled, strict=True)):
                if on and s.return_probs:
                    probs[n] = (pv[n, : ks[n], : s.return_probs], pi[n, : ks[n], : s.return_probs])
        return StepOut(tokens, conf, probs, torch.stack(logits_out, dim=1) if want_logits else None)
