"""An EXL3 DSpark checkpoint seen through the dense layout the model code expects.

Owns the mapping from what exllamav3 stores (``<module>.trellis``/``.suh``/``.svh``/``.mcg``|``.mul1``,
dense tensors for unquantized modules, ``tensor_storage`` metadata) to the canonical dense names of
``config.expected_shapes`` (``layers.{i}.mlp.down_proj.weight`` ...), and every check that makes a
bad checkpoint fail at start-up in one line instead of running dense or wrong:

- tensors: a trellis needs its suh/su and svh/sv, one codebook marker at most, no dense ``.weight``
  beside it, and a shape that is the config's ``(out, in)`` padded to 128;
- metadata (when ``quantization_config.json`` has ``tensor_storage``): every quantized module has an
  EXL3 entry with the same bits, codebook and stored tensors, and every EXL3 entry is a quantized
  module of this draft (the predecessor's bug: entries keyed ``layers.0..4``, looked up as
  ``layers.{start+i}``, silently ran dense). Keys are normalised by ``format.LayerKeys``;
- an EXL3 checkpoint with no quantized module would run dense: refused.

``Exl3Checkpoint`` is a drop-in ``weights.Checkpoint`` for ``validate_draft`` and ``load``: each
quantized module appears as a virtual ``<module>.weight`` whose ``load`` is the decoded dense weight
(float32), and ``linears`` holds the ``Exl3Linear`` objects (packed tensors) for the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from draft_server.models.config import CheckpointError, DSparkConfig, expected_shapes
from draft_server.models.exl3.format import EXL3_SUFFIXES, QUANT_JSON, FormatInfo, LayerKeys, target_layer_start
from draft_server.models.exl3.linear import DenseLinear, Exl3Linear, FusedLinear, pad128
from draft_server.models.weights import Checkpoint


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


class Exl3Checkpoint(Checkpoint):
    """The tensors of an EXL3 draft checkpoint under canonical dense names (quantized ones virtual)."""

    def __init__(self, ck: Checkpoint, cfg: DSparkConfig, info: FormatInfo) -> None:
        self.dir, self.inner, self.cfg, self.info = ck.dir, ck, cfg, info
        self.files = {}  # unused: every lookup goes through self.inner
        self._shapes = {}
        start = target_layer_start(cfg)
        keys = LayerKeys(ck.names(), cfg.num_layers, start, f"{ck.dir}: checkpoint tensors")
        self.actual: dict[str, str] = {}  # canonical dense name -> stored name
        self.groups: dict[str, dict[str, str]] = {}  # module key -> EXL3 suffix -> stored name
        for name in ck.names():
            c = keys(name)
            mod, _, suffix = c.rpartition(".")
            if suffix in EXL3_SUFFIXES:
                self.groups.setdefault(mod, {})[suffix] = name
            elif c in self.actual:
                raise CheckpointError(f"{ck.dir}: tensors '{self.actual[c]}' and '{name}' are both '{c}'")
            else:
                self.actual[c] = name
        for mod, g in self.groups.items():
            if "trellis" not in g:
                raise CheckpointError(f"{ck.dir}: EXL3 tensors {sorted(g.values())} without '{mod}.trellis'")
            for alts in (("suh", "su"), ("svh", "sv")):
                if not any(a in g for a in alts):
                    raise CheckpointError(f"{ck.dir}: '{g['trellis']}' has no '{mod}.{alts[0]}' (or legacy .{alts[1]})")
            if "mcg" in g and "mul1" in g:
                raise CheckpointError(f"{ck.dir}: '{mod}' carries both .mcg and .mul1 codebook markers")
            if mod + ".weight" in self.actual:
                raise CheckpointError(f"{ck.dir}: '{mod}' is stored both dense (.weight) and EXL3 (.trellis)")
        if not self.groups:
            raise CheckpointError(
                f"{ck.dir}: EXL3 checkpoint ({info.source}) has no quantized module (no *.trellis): it would run dense"
            )
        req, opt = expected_shapes(cfg)
        self.expected = {**opt, **req}
        self.virtual = {mod + ".weight": mod for mod in self.groups}
        for w, mod in self.virtual.items():
            self._check_shape(w, mod)
        if info.storage is not None:
            self._check_storage(start)
        self.linears: dict[str, Exl3Linear] = {}

    # -- validation ----------------------------------------------------------------------------
    def codebook(self, mod: str) -> str:
        g = self.groups[mod]
        return "mcg" if "mcg" in g else "mul1" if "mul1" in g else "3inst"

    def bits(self, mod: str) -> int:
        last = self.inner.shape(self.groups[mod]["trellis"])[-1]
        if last % 16 or not 1 <= last // 16 <= 8:
            raise CheckpointError(
                f"{self.dir}: '{self.groups[mod]['trellis']}' last dim {last} is not 16 * K, K in 1..8"
                + (" (fractional mul1 bitrates are not supported)" if last % 16 == 8 else "")
            )
        return last // 16

    def _check_shape(self, w: str, mod: str) -> None:
        t = self.groups[mod]["trellis"]
        got = self.inner.shape(t)
        want = self.expected.get(w)
        if want is None or len(want) != 2:
            raise CheckpointError(
                f"{self.dir}: unexpected EXL3 module '{mod}' ({t} {_fmt(got)}) for {self.cfg.variant} DSpark"
            )
        out_f, in_f = want
        K = self.bits(mod)
        exp = (pad128(in_f) // 16, pad128(out_f) // 16, 16 * K)
        if len(got) != 3 or tuple(got) != exp:
            raise CheckpointError(
                f"{self.dir}: tensor '{t}' has shape {_fmt(got)}, expected {_fmt(exp)}"
                f" ({w} is [{out_f}, {in_f}]: in x out padded to 128, 16 * K={K})"
            )
        for suffix, n in (
            ("suh", pad128(in_f)),
            ("svh", pad128(out_f)),
            ("su", pad128(in_f) // 16),
            ("sv", pad128(out_f) // 16),
        ):
            name = self.groups[mod].get(suffix)
            if name is not None and tuple(self.inner.shape(name)) != (n,):
                raise CheckpointError(
                    f"{self.dir}: tensor '{name}' has shape {_fmt(self.inner.shape(name))}, expected [{n}]"
                )

    def _check_storage(self, start: int | None) -> None:
        storage = self.info.storage or {}
        where = f"{self.dir}/{QUANT_JSON}"
        mkeys = LayerKeys(storage, self.cfg.num_layers, start, f"{where}: tensor_storage keys")
        meta = {}
        for key, e in storage.items():
            meta.setdefault(mkeys(key), e)
        covered = sorted(k for k, e in meta.items() if e.exl3)
        for mod in self.groups:
            e = meta.get(mod)
            if e is None or not e.exl3:
                raise CheckpointError(
                    f"{where}: no EXL3 tensor_storage entry covers '{self.groups[mod]['trellis']}'"
                    f" (module '{mod}'; EXL3 entries: {_names(covered)})"
                )
            if e.bits is not None and e.bits != self.bits(mod):
                raise CheckpointError(
                    f"{where}: '{e.key}' bits_per_weight {e.bits}, but its trellis holds K={self.bits(mod)}"
                )
            if e.codebook != self.codebook(mod):
                raise CheckpointError(
                    f"{where}: '{e.key}' says codebook {e.codebook}, the tensors say {self.codebook(mod)}"
                )
            for name, spec in e.stored_tensors.items():
                suffix = mkeys(name).rpartition(".")[2]
                stored = self.groups[mod].get(suffix) or self.actual.get(f"{mod}.{suffix}")
                if stored is None:
                    raise CheckpointError(f"{where}: '{e.key}' lists '{name}', which the checkpoint lacks")
                shape = spec.get("shape") if isinstance(spec, dict) else None
                if shape is not None and tuple(shape) != tuple(self.inner.shape(stored)):
                    raise CheckpointError(
                        f"{where}: '{name}' listed as {_fmt(shape)}, stored as {_fmt(self.inner.shape(stored))}"
                    )
        for key, e in meta.items():
            if e.exl3 and key not in self.groups:
                dense = key + ".weight" in self.actual
                raise CheckpointError(
                    f"{where}: tensor_storage says '{e.key}' is EXL3 but the checkpoint holds "
                    + (f"dense '{self.actual[key + '.weight']}' (it would run dense)" if dense else "no tensors for it")
                )

    # -- the Checkpoint interface ----------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.virtual or name in self.actual

    def names(self) -> list[str]:
        return list(self.actual) + list(self.virtual)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.virtual:
            return tuple(self.expected[name])
        return self.inner.shape(self.actual[name])

    def load(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Dense tensors as stored; quantized modules decoded to float32 [out, in] on ``device`` (their packed
        tensors move there first)."""
        names = list(names)
        dense = [n for n in names if n not in self.virtual]
        raw = self.inner.load([self.actual[n] for n in dense], device)
        out = {n: raw[self.actual[n]] for n in dense}
        for n in names:
            if n in self.virtual:
                out[n] = self.linear(n).to(device).exact_weight(torch.float32)
        return out

    def linear(self, weight_name: str) -> Exl3Linear:
        """The packed module behind a virtual ``<module>.weight`` (read once)."""
        if weight_name not in self.linears:
            mod = self.virtual[weight_name]
            g = self.groups[mod]
            t = self.inner.load(list(g.values()))
            bias_name = self.actual.get(mod + ".bias")
            bias = self.inner.load([bias_name])[bias_name] if bias_name else None
            out_f, in_f = self.expected[weight_name]
            try:
                self.linears[weight_name] = Exl3Linear(
                    mod,
                    in_f,
                    out_f,
                    t[g["trellis"]],
                    t[g.get("suh") or g["su"]],
                    t[g.get("svh") or g["sv"]],
                    self.codebook(mod),
                    bias,
                )
            except ValueError as e:
                raise CheckpointError(f"{self.dir}: {e}") from None
        return self.linears[weight_name]


def _names(keys: list[str], n: int = 4) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


@dataclass(frozen=True)
class WeightInfo:
    """What the Welcome line and metrics report about the loaded weights."""

    format: str  # "exl3" | "dense"
    bits: float  # EXL3: average bits per quantized weight (config's ``bits`` when given); dense: dtype bits
    weight_bytes: int  # as the format holds them: EXL3 packed tensors + every dense tensor at runtime dtype
    dense_bytes: int  # the same weights all in the runtime dtype (what a dense checkpoint would hold)
    quantized: int = 0  # EXL3 modules
    codebooks: tuple[str, ...] = ()


def attach_linears(model: object, ck: Exl3Checkpoint, loaded: dict[str, torch.Tensor]) -> WeightInfo:
    """Give ``model`` its ``linears`` (runtime weight name -> module) and ``weight_info``.

    ``model.stacked`` (fused name -> source names, from ``DSparkModel._stack``) makes a fused
    projection whose sources are EXL3 a ``FusedLinear`` over its own sources (dense sources as
    ``DenseLinear``), so no trellis is concatenated. ``loaded``: the tensors given to the model
    (runtime dtype), to count the dense bytes.
    """
    linears: dict[str, Exl3Linear | DenseLinear | FusedLinear] = dict(ck.linears)
    w: dict[str, torch.Tensor] = getattr(model, "w", {})
    for fused, parts in getattr(model, "stacked", {}).items():
        if any(p in ck.linears for p in parts):
            srcs: list[Exl3Linear | DenseLinear] = []
            row = 0
            for p in parts:
                n = loaded[p].shape[0]
                srcs.append(ck.linears.get(p) or DenseLinear(p, w[fused][row : row + n]))
                row += n
            linears[fused] = FusedLinear(fused, srcs)
            for p in parts:
                linears.pop(p, None)
    model.linears = linears  # type: ignore[attr-defined]
    q = list(ck.linears.values())
    qnames = set(ck.linears)
    dense = sum(t.numel() * t.element_size() for n, t in loaded.items() if n not in qnames)
    esize = next((t.element_size() for n, t in loaded.items() if n in qnames), 2)
    numel = sum(lin.in_features * lin.out_features for lin in q)
    bits = ck.info.quant.get("bits")
    info = WeightInfo(
        format="exl3",
        bits=float(bits)
        if isinstance(bits, int | float)
        else sum(lin.K * lin.in_features * lin.out_features for lin in q) / numel,
        weight_bytes=dense + sum(lin.stored_bytes() for lin in q),
        dense_bytes=dense + numel * esize,
        quantized=len(q),
        codebooks=tuple(sorted({lin.codebook for lin in q})),
    )
    model.weight_info = info  # type: ignore[attr-defined]
    return info
