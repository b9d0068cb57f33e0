"""The draft's context projection as a client that sends ``projected`` rows loads it.

Owns ``Projection``: ``context_proj`` + ``context_norm`` (K3 names; Qwen3 DSpark: ``fc`` +
``hidden_norm``) and ``rms_norm_eps``, read from the draft checkpoint directory (config.json plus
safetensors, sharded with ``model.safetensors.index.json`` or not) by a few lines of its own:
the client imports no server or model code and needs no torch here. Only these two tensors are
read, as stored (bf16 / f16 / f32 bytes, numpy). ``id`` is ``protocol.wire.projection_id`` of
them, the id the server's Welcome names for its own weights. The math itself (on the target's
device, with torch) is ``target_client.vllm.wire``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from protocol.wire import projection_id

INDEX = "model.safetensors.index.json"
NAMES = (("context_proj.weight", "context_norm.weight"), ("fc.weight", "hidden_norm.weight"))  # K3, Qwen3
_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}


class ProjectionError(ValueError):
    """The draft checkpoint directory has no usable context projection (one line saying why)."""


@dataclass(frozen=True)
class Projection:
    """A context projection as stored: ``proj`` [hidden, n_taps * target_hidden] and ``norm``
    [hidden] in their checkpoint dtypes (safetensors names: BF16 as uint16 bit patterns, F16,
    F32, F64)."""

    proj: np.ndarray
    norm: np.ndarray
    proj_dtype: str
    norm_dtype: str
    eps: float
    names: tuple[str, str]
    source: str = ""

    @property
    def hidden_size(self) -> int:
        return int(self.proj.shape[0])

    @property
    def tap_width(self) -> int:
        return int(self.proj.shape[1])

    @property
    def id(self) -> str:
        weights = [
            (a.shape, _f32_blocks(a, d)) for a, d in ((self.proj, self.proj_dtype), (self.norm, self.norm_dtype))
        ]
        return projection_id(weights, self.eps)

    @classmethod
    def load(cls, model_dir: str) -> Projection:
        """Read the projection of the draft checkpoint in ``model_dir`` (ProjectionError if none)."""
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ProjectionError(f"{model_dir}: no readable config.json ({e})") from None
        files = _tensor_files(model_dir)
        names = next((n for n in NAMES if n[0] in files and n[1] in files), None)
        if names is None:
            raise ProjectionError(
                f"{model_dir}: the draft checkpoint has neither context_proj/context_norm nor fc/hidden_norm weights"
            )
        proj, pdt = _read(files[names[0]], names[0])
        norm, ndt = _read(files[names[1]], names[1])
        if proj.ndim != 2 or norm.shape != (proj.shape[0],):
            raise ProjectionError(
                f"{model_dir}: {names[0]} {list(proj.shape)} and {names[1]} {list(norm.shape)} disagree"
            )
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        return cls(proj, norm, pdt, ndt, eps, names, model_dir)


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as float32 (bf16 bit patterns widened exactly)."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _f32_blocks(a: np.ndarray, dtype: str, rows: int = 1024) -> Iterator[np.ndarray]:
    """The values of ``a`` as float32, ``rows`` rows at a time (no float32 copy of the whole)."""
    for i in range(0, a.shape[0], rows):
        yield to_f32(a[i : i + rows], dtype)


def _tensor_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or from the shards' headers."""
    index = os.path.join(model_dir, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                return {n: os.path.join(model_dir, fn) for n, fn in json.load(f)["weight_map"].items()}
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ProjectionError(f"{index}: unreadable index ({e!r})") from None
    out: dict[str, str] = {}
    try:
        shards = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    except OSError as e:
        raise ProjectionError(f"{model_dir}: not a readable directory ({e.strerror or e})") from None
    for name in shards:
        path = os.path.join(model_dir, name)
        out.update(dict.fromkeys(_header(path)[0], path))
    return out


def _header(path: str) -> tuple[dict, int]:
    """A safetensors file's header (8-byte little-endian length, then JSON) and where its data starts."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ProjectionError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _read(path: str, name: str) -> tuple[np.ndarray, str]:
    """One tensor as stored (numpy) and its safetensors dtype name."""
    header, base = _header(path)
    meta = header.get(name)
    if not isinstance(meta, dict) or meta.get("dtype") not in _DTYPES:
        raise ProjectionError(f"{path}: tensor {name!r} missing or of an unsupported dtype ({meta})")
    dt = _DTYPES[meta["dtype"]]
    start, end = meta["data_offsets"]
    shape = tuple(int(d) for d in meta["shape"])
    if end - start != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ProjectionError(f"{path}: tensor {name!r} holds {end - start} bytes for {meta['dtype']}{list(shape)}")
    with open(path, "rb") as f:
        f.seek(base + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=dt).reshape(shape), meta["dtype"]
