"""EXL3 checkpoint metadata: format detection, ``quantization_config(.json)`` and ``tensor_storage``.

Owns what says a checkpoint directory is EXL3 and which modules are quantized how, as exllamav3
writes it (``conversion/compile.py``, ``conversion/quant_config.py``):

- ``config.json`` ``quantization_config`` with ``quant_method: "exl3"`` (``bits``, ``head_bits``,
  ``codebook``, ...);
- ``quantization_config.json``: the same dict plus ``tensor_storage``, keyed by module key as named in
  the checkpoint; an EXL3 entry has ``quant_format: "exl3"``, ``bits_per_weight`` and
  ``mcg_multiplier`` or ``mul1_multiplier``; every entry lists its ``stored_tensors``;
- exllamav3's loader itself needs neither: a module is EXL3 when its ``.trellis``, ``.suh``/``.su`` and
  ``.svh``/``.sv`` tensors are stored (``Linear.is_exl3_storage``), so tensors alone also mark EXL3.

Also owns layer-key normalisation (``LayerKeys``): a DSpark draft's layers are ``layers.0..L-1`` in its
checkpoint, but a name may carry a ``model.`` prefix and may count layers in the target's numbering
(``layers.{start+i}``, start = the target's layer count, as vLLM names the draft's modules). Each
namespace (tensor names, metadata keys) is normalised on its own, so metadata keyed ``layers.0..4``
matches tensors at ``model.layers.{start..start+4}`` and vice versa, and anything else is one error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from draft_server.models.config import QWEN3, CheckpointError, DSparkConfig
from draft_server.models.exl3.decode import MCG_MULT, MUL1_MULT

QUANT_JSON = "quantization_config.json"
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class StorageEntry:
    """One ``tensor_storage`` entry (module key as written in the file)."""

    key: str
    stored_tensors: dict[str, dict[str, Any]]
    exl3: bool
    bits: int | None = None
    codebook: str | None = None  # from the multiplier: "mcg" / "mul1"; "3inst" when an EXL3 entry has neither


@dataclass(frozen=True)
class FormatInfo:
    """What a checkpoint directory is: ``dense`` or ``exl3``, and from which evidence."""

    format: str  # "dense" | "exl3"
    source: str  # "quantization_config.json" | "config.json" | "tensors" | "none"
    quant: dict[str, Any] = field(default_factory=dict)  # quantization_config without tensor_storage
    storage: dict[str, StorageEntry] | None = None  # None: no per-tensor metadata

    @property
    def exl3(self) -> bool:
        return self.format == "exl3"


def _codebook_of(key: str, entry: dict[str, Any]) -> str:
    mcg, mul1 = entry.get("mcg_multiplier"), entry.get("mul1_multiplier")
    if mcg and mul1:
        raise CheckpointError(f"{QUANT_JSON}: tensor_storage '{key}' has both mcg_multiplier and mul1_multiplier")
    for name, val, want in (("mcg", mcg, MCG_MULT), ("mul1", mul1, MUL1_MULT)):
        if val:
            if int(val) & 0xFFFFFFFF != want:
                raise CheckpointError(
                    f"{QUANT_JSON}: tensor_storage '{key}' {name}_multiplier {val:#x} is not {want:#x}"
                    " (unknown codebook)"
                )
            return name
    return "3inst"


def parse_storage(raw: Any) -> dict[str, StorageEntry]:
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"{QUANT_JSON}: 'tensor_storage' must be a non-empty object")
    out: dict[str, StorageEntry] = {}
    for key, e in raw.items():
        if not isinstance(e, dict) or not isinstance(e.get("stored_tensors", {}), dict):
            raise CheckpointError(f"{QUANT_JSON}: tensor_storage '{key}' is not an object with stored_tensors")
        fmt = e.get("quant_format")
        if fmt not in (None, "exl3"):
            raise CheckpointError(f"{QUANT_JSON}: tensor_storage '{key}' has quant_format '{fmt}' (only exl3)")
        bits = e.get("bits_per_weight")
        out[key] = StorageEntry(
            key=key,
            stored_tensors=dict(e.get("stored_tensors", {})),
            exl3=fmt == "exl3",
            bits=None if bits is None else int(bits),
            codebook=_codebook_of(key, e) if fmt == "exl3" else None,
        )
    return out


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def detect_format(model_dir: str, tensor_names: Iterable[str] = ()) -> FormatInfo:
    """EXL3 when ``quantization_config.json`` has ``tensor_storage``, when config.json's
    ``quantization_config`` says ``quant_method: exl3``, or when any ``*.trellis`` tensor is stored;
    dense otherwise. Another quantization method is refused in one line."""
    cfg_path = os.path.join(model_dir, "config.json")
    qcfg: dict[str, Any] = {}
    if os.path.exists(cfg_path):
        q = _read_json(cfg_path).get("quantization_config")
        if isinstance(q, dict):
            qcfg = dict(q)
    method = qcfg.get("quant_method")
    if method not in (None, "exl3"):
        raise CheckpointError(
            f"{cfg_path}: quantization_config.quant_method '{method}' is not supported (exl3 or none)"
        )
    qpath = os.path.join(model_dir, QUANT_JSON)
    if os.path.exists(qpath):
        data = _read_json(qpath)
        if "tensor_storage" in data:
            m = data.get("quant_method", "exl3")
            if m != "exl3":
                raise CheckpointError(f"{qpath}: quant_method '{m}' is not supported (exl3)")
            storage = parse_storage(data["tensor_storage"])
            quant = {k: v for k, v in data.items() if k != "tensor_storage"}
            return FormatInfo("exl3", QUANT_JSON, {**qcfg, **quant}, storage)
    if method == "exl3":
        return FormatInfo("exl3", "config.json", qcfg)
    if any(n.endswith(".trellis") for n in tensor_names):
        return FormatInfo("exl3", "tensors", qcfg)
    return FormatInfo("dense", "none", qcfg)


def target_layer_start(cfg: DSparkConfig) -> int | None:
    """The draft's first layer index in the target's numbering, when the config says so."""
    extra = cfg.extra
    n = extra.get("target_num_hidden_layers")
    if n is None and cfg.variant == QWEN3:  # DeepSpec: num_target_layers is the target's layer count
        n = extra.get("num_target_layers")
    return None if n is None else int(n)


class LayerKeys:
    """Canonical names for one namespace: no ``model.`` prefix, layers counted from 0.

    The layer offset is chosen once for the whole namespace: 0 when every index lies in
    ``0..L-1``, ``start`` when every index lies in ``start..start+L-1``, else ``CheckpointError``.
    """

    def __init__(self, names: Iterable[str], num_layers: int, start: int | None, what: str) -> None:
        idx = set()
        for n in names:
            m = _LAYER.match(self._strip(n))
            if m:
                idx.add(int(m.group(1)))
        self.offset = 0
        if idx and not idx <= set(range(num_layers)):
            if start is not None and idx <= set(range(start, start + num_layers)):
                self.offset = start
            else:
                absolute = "" if start is None else f", or {start}..{start + num_layers - 1} in the target's numbering"
                raise CheckpointError(
                    f"{what} name layers {_span(idx)}; the draft has {num_layers} layers"
                    f" (0..{num_layers - 1}{absolute})"
                )

    @staticmethod
    def _strip(name: str) -> str:
        return name[len("model.") :] if name.startswith("model.") else name

    def __call__(self, name: str) -> str:
        name = self._strip(name)
        if self.offset:
            m = _LAYER.match(name)
            if m:
                return f"layers.{int(m.group(1)) - self.offset}.{m.group(2)}"
        return name


def _span(idx: set[int]) -> str:
    lo, hi = min(idx), max(idx)
    return f"{lo}..{hi}" if len(idx) == hi - lo + 1 and lo != hi else ",".join(map(str, sorted(idx)))
