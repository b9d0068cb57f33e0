"""Safetensors checkpoints: find tensors by name (index.json aware), validate shapes, load.

Owns ``Checkpoint`` (name -> file map over a directory, shapes read from headers without
loading data), ``validate_draft`` (every tensor the config implies, with the expected shape)
and ``load_target_head`` (only ``lm_head.weight`` / the embedding from the target checkpoint).
Every failure is a ``CheckpointError`` whose one line names the tensor and expected shape.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable

import torch
from safetensors import safe_open

from draft_server.models.config import CheckpointError, DSparkConfig, expected_shapes

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The tensors of one safetensors checkpoint directory (sharded with an index, or not)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: not a directory")
        self.files: dict[str, str] = {}  # tensor name -> file path
        index_path = os.path.join(directory, INDEX)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: unreadable index ({e!r})") from None
            for name, fname in weight_map.items():
                path = os.path.join(directory, fname)
                if not os.path.exists(path):
                    raise CheckpointError(f"{index_path}: tensor '{name}' points at missing shard {fname}")
                self.files[name] = path
        else:
            shards = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
            if not shards:
                raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX}")
            for path in shards:
                for name in self._keys(path):
                    self.files[name] = path
        self._shapes: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def _keys(path: str) -> list[str]:
        try:
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            self._read_shapes(self.files[name])
        return self._shapes[name]

    def _read_shapes(self, path: str) -> None:
        try:
            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    self._shapes[k] = tuple(f.get_slice(k).get_shape())
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None

    def load(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Read exactly these tensors (grouped by shard), as stored."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for path, ns in by_file.items():
            with safe_open(path, framework="pt", device=str(device)) as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("*" if d < 0 else str(d) for d in shape) + "]"


def _shape_ok(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return len(got) == len(want) and all(w < 0 or g == w for g, w in zip(got, want, strict=True))


def validate_draft(ck: Checkpoint, cfg: DSparkConfig) -> list[str]:
    """Check names and shapes against the config; return the tensor names to load."""
    req, opt = expected_shapes(cfg)
    for name, want in req.items():
        if name not in ck:
            raise CheckpointError(f"{ck.dir}: missing tensor '{name}' (expected shape {_fmt(want)})")
    for name in ck.names():
        want = req.get(name, opt.get(name))
        if want is None:
            raise CheckpointError(
                f"{ck.dir}: unexpected tensor '{name}' {_fmt(ck.shape(name))} for {cfg.variant} DSpark"
            )
        got = ck.shape(name)
        if not _shape_ok(got, want):
            hint = ""
            if name in ("context_proj.weight", "fc.weight") and len(got) == 2 and got[0] == want[0]:
                hint = (
                    f" ({cfg.n_taps} taps x target_hidden_size {cfg.target_hidden_size} from config;"
                    f" the tensor is {got[1]} wide)"
                )
            raise CheckpointError(f"{ck.dir}: tensor '{name}' has shape {_fmt(got)}, expected {_fmt(want)}{hint}")
    names = list(req)
    if cfg.confidence is False:
        names = [n for n in names if not n.startswith("confidence_head")]
    for n in ("embed_tokens.weight", "lm_head.weight"):
        if n in ck and n not in names:
            names.append(n)
    return names


_LM_HEAD = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")
_EMBED = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)


def _target_tied(target_dir: str) -> bool:
    path = os.path.join(target_dir, "config.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        tcfg = json.load(f)
    text = tcfg.get("text_config") if isinstance(tcfg.get("text_config"), dict) else {}
    return bool(tcfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def load_target_head(
    target_dir: str, cfg: DSparkConfig, need_lm_head: bool, need_embed: bool
) -> dict[str, torch.Tensor]:
    """Read only the target's lm_head / embedding (validated against the draft config)."""
    ck = Checkpoint(target_dir)
    want = (cfg.vocab_size, cfg.hidden_size)
    found: dict[str, str] = {}
    embed = next((n for n in _EMBED if n in ck), None)
    head = next((n for n in _LM_HEAD if n in ck), None)
    if head is None and _target_tied(target_dir):
        head = embed
    for role, name, needed in (("lm_head.weight", head, True), ("model.embed_tokens.weight", embed, need_embed)):
        if name is None:
            if needed and (role != "lm_head.weight" or need_lm_head):
                raise CheckpointError(f"{target_dir}: target checkpoint has no '{role}' (expected shape {_fmt(want)})")
            continue
        got = ck.shape(name)
        if got != want:
            what = "vocab" if len(got) == 2 and got[1] == want[1] else "shape"
            raise CheckpointError(
                f"{target_dir}: target tensor '{name}' has shape {_fmt(got)}, expected {_fmt(want)}"
                f" (draft vocab_size {cfg.vocab_size}, hidden_size {cfg.hidden_size}; {what} mismatch)"
            )
        found[role] = name
    load = []
    if need_lm_head:
        load.append(found["lm_head.weight"])
    if need_embed:
        load.append(found["model.embed_tokens.weight"])
    tensors = ck.load(dict.fromkeys(load))
    out = {}
    if need_lm_head:
        out["lm_head.weight"] = tensors[found["lm_head.weight"]]
    if need_embed:
        out["embed_tokens.weight"] = tensors[found["model.embed_tokens.weight"]]
    return out
