"""An independent float64 reference of the DSpark draft math, for the numerics tests.

Written plainly from dspark.md §3-§4 and §10: one session at a time, no batching, no cache, no
weight fusion, no MLA absorption; every call recomputes the whole context from the raw taps.
It reads config.json and the safetensors files itself and shares no code with
``draft_server.models``.
"""

from __future__ import annotations

import glob
import json
import math
import os

import torch
from safetensors.torch import load_file

F64 = torch.float64


def _load_dir(d: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(path))
    return out


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps) * w


def _yarn_m(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class RefRope:
    """Per-position rotation of a dim-wide vector, GPT-J (interleaved) or NeoX pairing."""

    def __init__(self, dim: int, theta: float, interleaved: bool, yarn: dict | None, deepseek: bool) -> None:
        self.dim, self.interleaved = dim, interleaved
        freqs = []
        self.mul = 1.0
        for i in range(dim // 2):
            base_f = 1.0 / theta ** (2 * i / dim)
            if yarn is None:
                freqs.append(base_f)
                continue
            s, orig = float(yarn["factor"]), float(yarn["original_max_position_embeddings"])
            bf, bs = float(yarn.get("beta_fast", 32)), float(yarn.get("beta_slow", 1))

            lo = max(math.floor(dim * math.log(orig / (bf * 2 * math.pi)) / (2 * math.log(theta))), 0)
            hi = min(math.ceil(dim * math.log(orig / (bs * 2 * math.pi)) / (2 * math.log(theta))), dim - 1)
            if lo == hi:
                hi += 0.001
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0 -> extrapolate (keep), 1 -> interpolate
            freqs.append(base_f / s * ramp + base_f * (1 - ramp))
        if yarn is not None:
            s = float(yarn["factor"])
            if deepseek:
                self.mul = _yarn_m(s, float(yarn.get("mscale", 1))) / _yarn_m(s, float(yarn.get("mscale_all_dim", 0)))
            else:
                self.mul = _yarn_m(s, 1.0)
        self.freqs = freqs

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate each pair (a_i, b_i) of x by angle pos * freq_i."""
        half = self.dim // 2
        c = torch.tensor([math.cos(pos * f) * self.mul for f in self.freqs], dtype=F64)
        s = torch.tensor([math.sin(pos * f) * self.mul for f in self.freqs], dtype=F64)
        a = [2 * i if self.interleaved else i for i in range(half)]
        b = [2 * i + 1 if self.interleaved else i + half for i in range(half)]
        out = x.clone()
        out[a] = x[a] * c - x[b] * s
        out[b] = x[b] * c + x[a] * s
        return out


class Reference:
    def __init__(self, draft_dir: str, target_dir: str) -> None:
        with open(os.path.join(draft_dir, "config.json")) as f:
            self.c = c = json.load(f)
        w = {k: v.to(F64) if v.is_floating_point() else v for k, v in _load_dir(draft_dir).items()}
        tgt = _load_dir(target_dir)
        if "lm_head.weight" not in w:
            w["lm_head.weight"] = tgt["lm_head.weight"].to(F64)
        if "embed_tokens.weight" not in w:
            w["embed_tokens.weight"] = tgt["model.embed_tokens.weight"].to(F64)
        self.w = w
        self.k3 = c["model_type"] == "k3_dspark"
        self.eps = float(c["rms_norm_eps"])
        self.B = int(c.get("block_size") or 7)
        self.mask = int(c["mask_token_id"])
        self.L = int(c["num_hidden_layers"])
        self.nh = int(c["num_attention_heads"])
        self.causal = bool(c.get("is_causal", False))
        rp = c.get("rope_parameters") or {}
        yarn = rp if rp.get("rope_type", "default") != "default" else None
        theta = float(rp.get("rope_theta", c.get("rope_theta")))
        if self.k3:
            self.nope, self.rd, self.vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            self.lat = c["kv_lora_rank"]
            self.rope = RefRope(self.rd, theta, True, yarn, deepseek=True)
            self.scale = 1.0 / math.sqrt(self.nope + self.rd)
            if yarn is not None:
                m = _yarn_m(float(yarn["factor"]), float(yarn.get("mscale_all_dim", 0)))
                self.scale *= m * m
        else:
            self.hd, self.nkv = c["head_dim"], c["num_key_value_heads"]
            self.rope = RefRope(self.hd, theta, False, yarn, deepseek=False)
            self.scale = 1.0 / math.sqrt(self.hd)
        self.conf = bool(c.get("enable_confidence_head"))
        self.conf_markov = bool(c.get("confidence_head_with_markov"))

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = self.w[name + ".weight"] @ x
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    # -- per-token key/value of one layer, for context rows and block rows alike ----------------
    def keys_values(self, i: int, x: torch.Tensor, pos: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per query head: (key, value) vectors of this token in layer i."""
        p = f"layers.{i}.self_attn."
        if self.k3:
            kv = self.lin(p + "kv_a_proj_with_mqa", x)
            ckv = rms(kv[: self.lat], self.w[p + "kv_a_layernorm.weight"], self.eps)
            kpe = self.rope(kv[self.lat :], pos)
            up = self.w[p + "kv_b_proj.weight"] @ ckv  # heads x (nope + v), not absorbed
            ks, vs = [], []
            for h in range(self.nh):
                blk = up[h * (self.nope + self.vd) : (h + 1) * (self.nope + self.vd)]
                ks.append(torch.cat([blk[: self.nope], kpe]))
                vs.append(blk[self.nope :])
            return ks, vs
        k = self.lin(p + "k_proj", x)
        v = self.lin(p + "v_proj", x)
        group = self.nh // self.nkv
        ks, vs = [], []
        for h in range(self.nh):
            g = h // group
            kh = rms(k[g * self.hd : (g + 1) * self.hd], self.w[p + "k_norm.weight"], self.eps)
            ks.append(self.rope(kh, pos))
            vs.append(v[g * self.hd : (g + 1) * self.hd])
        return ks, vs

    def queries(self, i: int, u: torch.Tensor, pos: int) -> list[torch.Tensor]:
        p = f"layers.{i}.self_attn."
        out = []
        if self.k3:
            qa = rms(self.lin(p + "q_a_proj", u), self.w[p + "q_a_layernorm.weight"], self.eps)
            q = self.lin(p + "q_b_proj", qa)
            d = self.nope + self.rd
            for h in range(self.nh):
                qh = q[h * d : (h + 1) * d]
                out.append(torch.cat([qh[: self.nope], self.rope(qh[self.nope :], pos)]))
            return out
        q = self.lin(p + "q_proj", u)
        for h in range(self.nh):
            qh = rms(q[h * self.hd : (h + 1) * self.hd], self.w[p + "q_norm.weight"], self.eps)
            out.append(self.rope(qh, pos))
        return out

    # -- one draft ----------------------------------------------------------------------------
    def draft(
        self,
        ctx: dict[int, torch.Tensor],
        start: int,
        pos: int,
        anchor: int,
        k: int,
        forced: list[int] | None = None,
        sts: list[float] | None = None,
        width: int | None = None,
    ) -> tuple[list[int], torch.Tensor, list[float]]:
        """Drafts, per-step logits [k, draft_vocab] and confidences for context [start, pos), from
        a block of ``width`` rows (vLLM runs k for k drafts; None: the trained block_size)."""
        w, eps = self.w, self.eps
        proj, norm = ("context_proj", "context_norm") if self.k3 else ("fc", "hidden_norm")
        cpos = list(range(start, pos))
        c = {t: rms(w[proj + ".weight"] @ ctx[t].to(F64), w[norm + ".weight"], eps) for t in cpos}
        nb = self.B if width is None else width
        ids = [anchor] + [self.mask] * (nb - 1)
        h = [w["embed_tokens.weight"][t].clone() for t in ids]
        for i in range(self.L):
            p = f"layers.{i}."
            ctx_kv = [self.keys_values(i, c[t], t) for t in cpos]
            u = [rms(x, w[p + "input_layernorm.weight"], eps) for x in h]
            blk_kv = [self.keys_values(i, u[j], pos + j) for j in range(nb)]
            new_h = []
            for j in range(nb):
                q = self.queries(i, u[j], pos + j)
                visible = ctx_kv + [blk_kv[jj] for jj in range(nb) if not self.causal or jj <= j]
                heads = []
                for hh in range(self.nh):
                    scores = torch.stack([q[hh] @ kv[0][hh] for kv in visible]) * self.scale
                    a = torch.softmax(scores, dim=0)
                    heads.append(sum(a[n] * visible[n][1][hh] for n in range(len(visible))))
                x = h[j] + self.lin(p + "self_attn.o_proj", torch.cat(heads))
                m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
                gate = self.lin(p + "mlp.gate_proj", m)
                mlp = self.lin(p + "mlp.down_proj", gate * torch.sigmoid(gate) * self.lin(p + "mlp.up_proj", m))
                new_h.append(x + mlp)
            h = new_h
        fnorm = "final_norm.weight" if self.k3 else "norm.weight"
        z = [rms(x, w[fnorm], eps) for x in h]
        scale = float(self.c.get("logit_scale", 1.0))
        d2t = w.get("d2t")
        prev = anchor
        toks, logits, confs = [], [], []
        for j in range(k):
            base = w["lm_head.weight"] @ z[j]
            e = w["markov_head.markov_w1.weight"][prev] if "markov_head.markov_w1.weight" in w else None
            lj = (base + (w["markov_head.markov_w2.weight"] @ e if e is not None else 0)) * scale
            logits.append(lj)
            if self.conf:
                feat = torch.cat([z[j], e]) if self.conf_markov else z[j]
                s = w["confidence_head.proj.weight"][0] @ feat + w["confidence_head.proj.bias"][0]
                t = (sts or [1.0] * self.B)[j]
                confs.append(float(torch.sigmoid(s / t)))
            d = int(torch.argmax(lj)) if forced is None else forced[j]
            if forced is None and d2t is not None:
                d = d + int(d2t[d])
            toks.append(d)
            prev = d
        return toks, torch.stack(logits), confs


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(top-k / top-p filtered logits / T), plainly, for one step [V]."""
    x = logits / temperature
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    keep = set(order[:top_k] if top_k > 0 else order)
    kept = [i for i in order if i in keep]
    p = torch.softmax(torch.stack([x[i] for i in kept]), dim=0)
    nucleus, acc = [], 0.0
    for i, pi in zip(kept, p.tolist(), strict=True):
        if acc >= top_p:
            break
        nucleus.append(i)
        acc += pi
    out = torch.full_like(x, float("-inf"))
    for i in nucleus:
        out[i] = x[i]
    return torch.softmax(out, dim=0)
