"""exllamav3's CUDA kernels for EXL3 linears: getting ``exllamav3_ext`` into the process, and ``Exl3Backend``.

Owns two things (nothing here runs without a CUDA GPU; importing this module needs neither exllamav3
nor a GPU):

- ``load_ext``: the ``exllamav3_ext`` extension. A prebuilt top-level ``exllamav3_ext`` (GitHub release
  wheels) is used when importable; otherwise only the extension is JIT-built from the installed
  ``exllamav3`` package's sources (found, never imported: the Python package pulls pydantic & co.),
  with the package's own flags (``util/cuda_flags.py``, ``util/arch_list.py``, loaded by path) and
  the same name, so ``TORCH_EXTENSIONS_DIR`` holds one build that ``import exllamav3`` reuses too.
  The module is registered as top-level ``exllamav3_ext``, which ``exllamav3/ext.py`` then takes as
  "precompiled". ``EXL3_INT8_GEMV`` is forced to 0 before the first kernel call: the int8-activation
  GEMV (1.6.5's default for mul1 at K <= 6 on Hopper) is not fp16 parity and not capture-safe.
- ``Exl3Backend``: the products of ``Exl3Linear`` parts that read one input (``outputs``: the input is
  converted to fp16 and zero-padded to the 128-multiple once for all of them; ``half_input`` tells the
  norm or SwiGLU that makes it to store fp16 itself where every part reads that copy). Per call a path:
  ``fused`` runs ``exl3_gemm`` (input Hadamard and suh, in-register trellis decode, mma, output
  Hadamard and svh, all in one kernel; fp32 out, trimmed, bias added; the caller rounds it once, where
  it adds the residual, concatenates or activates). On an H200 the fused kernel matches BF16 at 1-8
  rows and is 1.5-3.7x slower from 28 rows (exl3.md §7, §8), so there is a ``large`` path:
  ``recon`` (default) decodes the weight into one shared fp16 scratch buffer per call
  (exllamav3's ``reconstruct``, rotated basis), runs a cuBLAS GEMM on the Hadamard-rotated input
  and rotates the output back (``had_r_128`` with suh / svh), so no dense copy is ever kept;
  ``inline`` is ``recon`` without the scratch: a Triton GEMM that decodes Wq tile by tile in
  registers from the trellis (``kernels/exl3_gemm.py``), so only the packed bytes are read;
  ``decode`` is ``recon`` with our Triton decoder (``exl3_decode``, K in 1, 2, 4: each lane's two
  words read once for its eight weights) writing Wq.T, so the GEMM takes the weight in the same
  orientation as the BF16 drafter's ``F.linear``, in the form ``gemm.TUNER`` times fastest for its shape
  and rows (as the BF16 drafter's GEMMs: e.g. rows padded to 512); both rotate with our ``hadamard_128``
  (Triton), which reads the caller's rows as they are (bf16) and writes the padded fp16 input in one
  pass, so neither makes an fp16 copy first nor calls exllamav3;
  where a product feeds a residual add (``product_add``) or gate and up feed SwiGLU (``swiglu``), our
  paths' output rotations run inside that op (``hadamard_128(add=)``, ``hadamard_swiglu``), and
  ``inline``'s k-split partials are summed there too;
  ``dense`` multiplies by the dense weight decoded once and cached (``Exl3Linear.weight``):
  BF16 speed for BF16 memory. Which one: per (in, out, K, codebook, rows), the fastest of fused,
  recon, inline and decode (of fused and dense when dense weights are kept),
  timed once while ``gemm.TUNER.tuning`` is on (``FastStep.capture``'s warm-up runs every bucket with
  its own row counts before capturing it, so each graph bakes in the tuned path); untuned calls take
  fused up to ``FUSED_MAX_ROWS`` rows. ``DRAFT_EXL3_FUSED_MAX_ROWS=N`` fixes the threshold instead
  (``0`` with ``DRAFT_EXL3_LARGE=dense`` or ``inline`` never calls exllamav3).

CUDA graphs: the fused GEMM tunes its tile shape on the first call per (row bucket, k, n, K), and the
dense path decodes on its first call; both must happen before capture. ``FastStep.capture`` runs every
bucket's body eagerly twice before capturing it (and every ingest bucket once), with the bucket's own
row counts, which does both.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from draft_server.models import gemm
from draft_server.models.exl3.linear import DenseLinear, Exl3Linear, add_rounded, pad128
from draft_server.models.kernels.exl3_gemm import LANE_BITS, exl3_decode, exl3_matmul, hadamard_128, hadamard_swiglu
from draft_server.models.kernels.prebuilt import find_extension
from draft_server.models.layers import ops

EXT = "exllamav3_ext"
FUSED_MAX_ROWS = 16  # rows up to which exl3_gemm is used (H200: equal to BF16 at 1-8 rows, 1.5x at 28)
ENV_FUSED_MAX_ROWS = "DRAFT_EXL3_FUSED_MAX_ROWS"
ENV_LARGE = "DRAFT_EXL3_LARGE"  # the path above fused_max_rows: recon (default), inline, decode or dense
LARGE_PATHS = ("recon", "inline", "decode", "dense")
TuneKey = tuple[int, int, int, str, int]  # (in, out, K, codebook, rows)


class Exl3Unavailable(RuntimeError):
    """exllamav3's kernels cannot be had here (one line, for the start-up error)."""


def _by_path(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise Exl3Unavailable(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def package_root() -> str:
    """The installed exllamav3 package directory (found, not imported)."""
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or not spec.submodule_search_locations:
        raise Exl3Unavailable("exllamav3 is not installed (pip install 'draft-service[gpu]', see README 'EXL3')")
    return str(next(iter(spec.submodule_search_locations)))


def build_args(root: str) -> dict[str, Any]:
    """``torch.utils.cpp_extension.load`` arguments of exllamav3's own JIT build (``exllamav3/ext.py``, CUDA,
    not Windows), so both share one build in ``TORCH_EXTENSIONS_DIR``."""
    from torch.utils import cpp_extension

    flags = _by_path("_exl3_cuda_flags", os.path.join(root, "util", "cuda_flags.py"))
    src = os.path.join(root, EXT)
    cuda_cflags = flags.cuda_cflags(cuda_home=cpp_extension.CUDA_HOME, debug=False, hip=False)
    if host_cxx := os.environ.get("CUDAHOSTCXX"):
        cuda_cflags += ["-ccbin", host_cxx]
    return {
        "name": EXT,
        "sources": flags.extension_sources(src, hip=False),
        "extra_include_paths": [src],
        "verbose": False,
        "extra_ldflags": [],
        "extra_cuda_cflags": cuda_cflags,
        "extra_cflags": ["-Ofast"],
    }


def load_ext(log: Any = print) -> ModuleType:
    """``exllamav3_ext``, prebuilt or JIT-built (minutes the first time; cached in TORCH_EXTENSIONS_DIR)."""
    os.environ["EXL3_INT8_GEMV"] = "0"  # read by the extension at its first GEMM
    mod = sys.modules.get(EXT) or find_extension(EXT)
    if mod is None:
        if not torch.cuda.is_available() or torch.version.cuda is None:
            raise Exl3Unavailable("exllamav3's kernels need a CUDA build of torch and a visible GPU")
        root = package_root()
        from torch.utils import cpp_extension

        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            _by_path("_exl3_arch_list", os.path.join(root, "util", "arch_list.py")).maybe_set_arch_list_env()
        args = build_args(root)
        where = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        log(
            f"exllamav3_ext: loading or JIT-building {len(args['sources'])} sources from {root}"
            f" (arch {os.environ.get('TORCH_CUDA_ARCH_LIST')}, MAX_JOBS {os.environ.get('MAX_JOBS', 'all')}) in {where}"
        )
        t0 = time.perf_counter()
        try:
            mod = cpp_extension.load(**args)
        except Exception as e:
            last = (str(e).strip().splitlines() or [""])[-1]
            raise Exl3Unavailable(f"building exllamav3_ext failed: {type(e).__name__}: {last}") from e
        log(f"exllamav3_ext ready in {time.perf_counter() - t0:.1f} s")
    sys.modules[EXT] = mod  # exllamav3/ext.py takes it as precompiled: no second build
    return mod


def fused_max_rows_from_env(default: int | None = None) -> int | None:
    """The fixed fused/large threshold an operator set, or ``default`` (None: tuned per shape and rows)."""
    raw = os.environ.get(ENV_FUSED_MAX_ROWS, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise Exl3Unavailable(f"{ENV_FUSED_MAX_ROWS}={raw!r} is not an integer") from None
    if value < 0:
        raise Exl3Unavailable(f"{ENV_FUSED_MAX_ROWS}={raw!r} is negative")
    return value


def large_path_from_env(default: str = "recon") -> str:
    raw = os.environ.get(ENV_LARGE, "").strip() or default
    if raw not in LARGE_PATHS:
        raise Exl3Unavailable(f"{ENV_LARGE}={raw!r}: expected one of {', '.join(LARGE_PATHS)}")
    return raw


class Exl3Backend:
    """exllamav3's fused GEMM or the ``large`` path, per (linear shape, K, codebook, rows) (module docstring)."""

    def __init__(self, fused_max_rows: int | None = None, ext: ModuleType | None = None, large: str = "recon") -> None:
        if large not in LARGE_PATHS:
            raise ValueError(f"large path {large!r}: expected one of {', '.join(LARGE_PATHS)}")
        self.fused_max_rows, self.large = fused_max_rows, large
        # exllamav3 runs fused, recon, and decode's fallback for K outside LANE_BITS; inline and dense are ours
        needs_ext = fused_max_rows is None or fused_max_rows > 0 or large in ("recon", "decode")
        self.ext = ext if ext is not None or not needs_ext else load_ext()
        # per path, counted in Python (capture: once per graph)
        self.calls = {"fused": 0, "recon": 0, "inline": 0, "decode": 0, "dense": 0}
        self.choice: dict[TuneKey, str] = {}  # tuned: the faster path per shape and row count
        self.timings: dict[TuneKey, dict[str, float]] = {}
        self.failed: dict[str, str] = {}  # path -> why it could not run while tuning
        self._scratch: dict[torch.device, torch.Tensor] = {}  # recon: one fp16 weight buffer per device

    def path(self, lin: Exl3Linear, rows: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """``fused_max_rows`` set: fused up to it. Unset: the path timed fastest for this shape, K, codebook
        and row count while ``gemm.TUNER.tuning`` is on (``FastStep.capture``'s warm-up, never a capture);
        before that, fused up to ``FUSED_MAX_ROWS``."""
        if self.fused_max_rows is not None:
            return "fused" if rows <= self.fused_max_rows else self._large(lin)
        key = (lin.in_features, lin.out_features, lin.K, lin.codebook, rows)
        p = self.choice.get(key)
        if p is not None:
            return p
        if gemm.TUNER.tuning and self._can_time(lin):
            self.choice[key] = p = self._tune(key, lin, rows, dtype)
            return p
        return "fused" if rows <= FUSED_MAX_ROWS else self._large(lin)

    def _large(self, lin: Exl3Linear) -> str:
        """The large path for lin: ``decode`` needs K in ``LANE_BITS``; other K take ``recon``."""
        return "recon" if self.large == "decode" and lin.K not in LANE_BITS else self.large

    def _can_time(self, lin: Exl3Linear) -> bool:
        return lin.trellis.is_cuda and not torch.cuda.is_current_stream_capturing()

    def candidates(self, lin: Exl3Linear) -> tuple[str, ...]:
        """The paths the tuner times: fused and dense when dense weights are kept, else fused and the
        packed-only large paths (``decode`` where lin's K allows)."""
        if self.large == "dense":
            return ("fused", "dense")
        return ("fused", "recon", "inline") + (("decode",) if lin.K in LANE_BITS else ())

    def _tune(self, key: TuneKey, lin: Exl3Linear, rows: int, dtype: torch.dtype) -> str:
        """Each candidate on fresh random rows of the caller's dtype (never its values), 2 warm-up runs,
        then 7 replays of its CUDA graph; the fastest. A path that fails here (a Triton build error) is
        not a candidate."""
        x = torch.randn((rows, lin.in_features), dtype=dtype, device=lin.trellis.device)
        times: dict[str, float] = {}
        for name in self.candidates(lin):
            try:
                times[name] = self._time(lambda name=name: self._exl3(lin, x, None, name))
            except Exception as e:
                if name == "fused":
                    raise
                self.failed[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
        self.timings[key] = times
        return min(times, key=lambda n: times[n])

    @staticmethod
    def _time(fn: Callable[[], object]) -> float:
        """Median ms of ``fn`` as CUDA-graph replays, as the step runs it: timed eagerly, the Triton
        path paid its Python launch (tens of microseconds) and lost to fused and recon at 7-56 rows
        where its kernel is faster."""
        return gemm.graph_ms(fn, flush_l2=False)

    def outputs(self, parts: Sequence[Exl3Linear | DenseLinear], x2: torch.Tensor) -> list[torch.Tensor]:
        rows = x2.shape[0]
        a: torch.Tensor | None = None  # x2 as fp16 padded to the 128-multiple (fused, recon): made once for all
        outs = []
        for p in parts:
            if isinstance(p, DenseLinear):
                outs.append(p.forward(x2))
                continue
            path = self.path(p, rows, x2.dtype)
            if path in ("fused", "recon") and a is None:
                a = self._half(x2, pad128(p.in_features))
            outs.append(self._exl3(p, x2, a, path))
        return outs

    @staticmethod
    def _half(x2: torch.Tensor, k: int) -> torch.Tensor:
        a = x2.to(torch.float16)
        return F.pad(a, (0, k - x2.shape[1])) if k != x2.shape[1] else a.contiguous()

    def _exl3(self, lin: Exl3Linear, x2: torch.Tensor, a: torch.Tensor | None, path: str) -> torch.Tensor:
        """lin's product [rows, out] by ``path``: float32 or fp16 (exllamav3's and our paths) or x2's dtype
        (dense), bias added. ``a``: x2 as padded fp16 where the caller made it (fused and recon read it)."""
        self.calls[path] += 1
        if path == "dense":
            return F.linear(x2, lin.weight(x2.dtype, x2.device), lin.bias_as(x2))
        k, n = pad128(lin.in_features), pad128(lin.out_features)
        mcg, mul1 = lin.codebook == "mcg", lin.codebook == "mul1"
        if path in ("fused", "recon"):
            assert self.ext is not None
            if a is None:
                a = self._half(x2, k)
        if path == "fused":
            c = torch.empty((a.shape[0], n), dtype=torch.float32, device=a.device)
            self.ext.exl3_gemm(a, lin.trellis, c, lin.suh, torch.empty_like(a), lin.svh, -1, mcg, mul1, 0)
        elif path == "recon":  # x H(suh) @ Wq, Wq decoded into the shared scratch, then H(svh) on the output
            ah = torch.empty_like(a)
            self.ext.had_r_128(a, ah, lin.suh, None, 1.0)
            w = self.scratch(k * n, a.device)[: k * n].view(k, n)
            self.ext.reconstruct(w, lin.trellis, lin.K, mcg, mul1)
            c = torch.mm(ah, w)
            self.ext.had_r_128(c, c, None, lin.svh, 1.0)
        else:  # our kernels, then the output rotation (in place, or summing inline's k-split partials)
            c = self._ours(lin, x2, path)
            c = hadamard_128(c, post=lin.svh, out=c if c.dim() == 2 else None)
        y = c if n == lin.out_features else c[:, : lin.out_features]
        return y if lin.bias is None else y + lin.bias

    def _ours(self, lin: Exl3Linear, x2: torch.Tensor, path: str) -> torch.Tensor:
        """``inline`` / ``decode``'s product before its output rotation, [rows, pad128(out)] (``inline``: its
        k split's float32 partials [splits, rows, pad128(out)], which the rotation sums): x2 converted, padded
        and rotated in one pass, then the decode inside the GEMM or into the scratch."""
        k, n = pad128(lin.in_features), pad128(lin.out_features)
        ah = hadamard_128(x2 if x2.stride(-1) == 1 else x2.contiguous(), lin.suh, dtype=torch.float16)
        if path == "decode":  # the GEMM in its tuned form for this shape (gemm.linear), as BF16's
            w = self.scratch(k * n, x2.device)[: k * n].view(n, k)
            return gemm.linear(ah, exl3_decode(lin.trellis, lin.codebook, out=w, trans=True))
        return exl3_matmul(ah, lin.trellis, lin.codebook, partials=True)

    def _rotates_out(self, lin: Exl3Linear | DenseLinear, rows: int, dtype: torch.dtype) -> str | None:
        """lin's path where its output rotation can be fused into what follows (our paths, no bias, no
        padded output columns), else None."""
        if not isinstance(lin, Exl3Linear) or lin.bias is not None or pad128(lin.out_features) != lin.out_features:
            return None
        path = self.path(lin, rows, dtype)
        return path if path in ("inline", "decode") else None

    def product_add(self, lin: Exl3Linear | DenseLinear, x2: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        """h2 + lin's product in h2's dtype; on our paths the output rotation and the add are one kernel."""
        path = self._rotates_out(lin, x2.shape[0], x2.dtype)
        if path is None or h2.stride(-1) != 1:
            return add_rounded(h2, self.outputs([lin], x2)[0])
        assert isinstance(lin, Exl3Linear)
        self.calls[path] += 1
        return hadamard_128(self._ours(lin, x2, path), post=lin.svh, add=h2, dtype=h2.dtype)

    def swiglu(
        self,
        gate: Exl3Linear | DenseLinear,
        up: Exl3Linear | DenseLinear,
        x2: torch.Tensor,
        dtype: torch.dtype,
        store: torch.dtype | None = None,
    ) -> torch.Tensor:
        """silu(gate) * up in ``dtype`` (stored as ``store``); where both take our paths, their output
        rotations and the activation are one kernel."""
        rows = x2.shape[0]
        pg, pu = self._rotates_out(gate, rows, dtype), self._rotates_out(up, rows, dtype)
        if pg is None or pu is None or gate.out_features != up.out_features:
            return ops.swiglu_parts(*self.outputs([gate, up], x2), dtype, store)
        assert isinstance(gate, Exl3Linear) and isinstance(up, Exl3Linear)
        self.calls[pg] += 1
        cg = self._ours(gate, x2, pg)
        self.calls[pu] += 1
        y = hadamard_swiglu(cg, self._ours(up, x2, pu), gate.svh, up.svh, dtype)
        return y if store is None else y.to(store)

    def half_input(self, parts: Sequence[Exl3Linear | DenseLinear], rows: int, dtype: torch.dtype) -> bool:
        """True where every part is packed and takes exllamav3's ``fused`` or ``recon`` path, which read an
        fp16 copy of the input (``_half``); our paths convert inside their rotation, dense ones not at all."""
        return all(isinstance(p, Exl3Linear) and self.path(p, rows, dtype) in ("fused", "recon") for p in parts)

    def scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        """The recon path's fp16 weight buffer, grown to the largest linear seen (before any graph capture:
        ``FastStep.capture`` runs every bucket eagerly first, so capture never grows it)."""
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[device] = torch.empty(numel, dtype=torch.float16, device=device)
        return buf
