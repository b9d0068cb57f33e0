"""The fast step's FlashMLA path on the CPU: the binding's contract played by its torch oracle.

FlashMLA itself runs only on a Hopper GPU (``tests/gpu`` holds it to the Triton kernel there). What
is ours is checked here: the device-side table and lengths (a Triton kernel, under the interpreter),
the per-step plan inside the step body, the routing of batches with a session that starts mid-page
to the Triton kernel's rows, and the drafts of the whole step against the dense reference.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from draft_server.drafters import DraftItem, IngestItem
from draft_server.models import load_drafter
from draft_server.models.kernels import flash_mla as fm
from draft_server.models.kernels import paged_attention as pa
from draft_server.models.tiny import make_tiny
from protocol import GREEDY

DEV = "cuda" if torch.cuda.is_available() else "cpu"
P = 4


def _bits(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return (rng.standard_normal((rows, width), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("causal", [True, False])
def test_the_table_kernel_lays_out_each_sessions_pages_from_its_first_page(causal: bool) -> None:
    rows, trash = 3, 99
    # sessions: [lo, pos, width]; the ragged list holds each one's pages from the page of lo
    spans = [(0, 9, 3), (8, 13, 2), (1, 0, 3), (4, 4, 1)]  # the third is padding (lo > pos)
    flat, first, used = [], [], 0
    for lo, pos, w in spans:
        lp0 = lo // P
        n = -(-(pos + (rows if causal else w)) // P) - lp0 if lo <= pos else 0
        flat += [100 + 10 * len(first) + j for j in range(n)]
        first.append(lp0 - used)
        used += n
    i32 = {"dtype": torch.int32, "device": DEV}
    flash = fm.FlashMLA.allocate(
        fm.ReferenceKernel, n_max=4, rows=rows, heads=2, dims=(6, 4), page=P, cols=8, causal=causal, scale=1.0,
        trash_page=trash, dtype=torch.float32, device=torch.device(DEV),
    )  # fmt: skip
    flash.table.fill_(-7)
    lo, pos, wid = (torch.tensor([s[i] for s in spans], **i32) for i in range(3))
    flash.prepare(4, torch.tensor(flat + [0] * 4, **i32), torch.tensor(first, **i32), lo, pos, wid)
    table, seq = flash.table.cpu().numpy(), flash.seqlens.cpu().tolist()
    for i, (lo_i, pos_i, w) in enumerate(spans):
        if lo_i > pos_i:
            assert seq[i] == rows and table[i, 0] == trash and (table[i, 1:] == -7).all()
            continue
        end = pos_i + (rows if causal else w)
        lp0 = lo_i // P
        n = -(-end // P) - lp0
        assert seq[i] == end - lp0 * P
        assert table[i, :n].tolist() == [100 + 10 * i + j for j in range(n)]
        assert (table[i, n:] == -7).all()  # nothing past a session's pages is written


def _drafters(tmp_path, monkeypatch, flash: bool, **over):
    if flash:
        monkeypatch.setattr(fm, "kernel_for", lambda mla, *a: fm.ReferenceKernel if mla else None)
    p = make_tiny("k3", str(tmp_path / "k3"), seed=3, **over)
    dense = load_drafter(p.draft, p.target, DEV, "float32", 16 << 20, page_size=P, attention="dense")
    fast = load_drafter(p.draft, p.target, DEV, "float32", 16 << 20, page_size=P, attention="paged")
    fast.prepare(max_batch_sessions=8, max_batch_rows=64)
    assert fast.fast is not None and (fast.fast.flash is not None) == flash
    return dense, fast


def _count(monkeypatch, obj, name: str) -> list[int]:
    calls = [0]
    real = getattr(obj, name)

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("over", [{}, {"is_causal": True}])
@pytest.mark.parametrize("later_start", [False, True])
def test_the_flash_path_drafts_what_the_dense_reference_drafts(tmp_path, monkeypatch, over, later_start) -> None:
    """Sessions of several lengths (one empty, two starting mid-sequence, at 5 and 9) drafted over 3
    steps through the FlashMLA path equal the dense reference token for token; the cache starts
    every span on a page boundary, so FlashMLA alone serves every layer. A draft asked from a later
    start than its span's (``later_start``: session 1 drafts from 6 over a span made at 5) takes the
    eager body with the Triton kernel beside FlashMLA."""
    dense, fast = _drafters(tmp_path, monkeypatch, True, **over)
    flash_calls = _count(monkeypatch, fm.ReferenceKernel, "attend")
    triton_calls = _count(monkeypatch, pa, "mla_paged_attention")
    spans = [(0, 3), (5, 37), (4, 4), (0, 1), (9, 70)]
    draft_from = {k: a for k, (a, _) in enumerate(spans)}
    if later_start:
        draft_from[1] = 6
    rng = np.random.default_rng(0)
    W, B = dense.contract.tap_width, dense.cfg.block_size
    ends = {}
    for key, (start, end) in enumerate(spans):
        taps = _bits(rng, end - start, W)
        for d in (dense, fast):
            assert d.reserve(key, start, end + 9 + B)
            if end > start:
                d.ingest([IngestItem(key, start, start, taps)])
        ends[key] = end
    for _ in range(3):
        new = {k: _bits(rng, 1 + k % 3, W) for k in ends}
        outs = []
        for d in (dense, fast):
            d.ingest([IngestItem(k, spans[k][0], ends[k], new[k]) for k in ends])
            outs.append(
                d.draft([DraftItem(k, draft_from[k], ends[k] + len(new[k]), 3 + k, B - k % 2, GREEDY) for k in ends])
            )
        for k in ends:
            ends[k] += len(new[k])
        assert [o.tokens for o in outs[1]] == [o.tokens for o in outs[0]]
    layers = dense.cfg.num_layers
    assert flash_calls[0] == 3 * layers
    assert triton_calls[0] == (3 * layers if later_start else 0)


def test_a_poisoned_session_never_reaches_its_neighbours_through_flash(tmp_path, monkeypatch) -> None:
    """NaN/Inf taps in one session: every other session drafts what it drafts when they are clean
    (the poisoned session's pages are later reused by nobody here; its tail rows are NaN too)."""
    rng = np.random.default_rng(5)
    rows = {0: 41, 1: 20, 2: 9, 3: 20}
    base: dict[int, np.ndarray] = {}
    clean: list = []
    for poison in (False, True):
        _, fast = _drafters(tmp_path / str(poison), monkeypatch, True)
        W, B = fast.contract.tap_width, fast.cfg.block_size
        base = base or {k: _bits(rng, rows[k], W) for k in range(4)}
        taps = {k: v.copy() for k, v in base.items()}
        if poison:
            taps[0][3, ::3] = 0x7FC0  # NaN
            taps[0][40, ::5] = 0x7F80  # +Inf, in the session's last page
        for k in range(4):
            assert fast.reserve(k, 0, rows[k] + B)
            fast.ingest([IngestItem(k, 0, 0, taps[k])])
        got = [o.tokens for o in fast.draft([DraftItem(k, 0, rows[k], 1, B, GREEDY) for k in range(4)])]
        if not poison:
            clean = got
        else:
            assert got[1:] == clean[1:]


def test_sampled_batches_go_through_the_flash_path_too(tmp_path, monkeypatch) -> None:
    """A batch with sampled sessions (the eager block forward of ``FastStep.hidden``) reads its context
    through FlashMLA as well, one session starting mid-sequence among them, and draws what the dense
    reference draws."""
    from protocol import Sampling

    dense, fast = _drafters(tmp_path, monkeypatch, True)
    flash_calls = _count(monkeypatch, fm.ReferenceKernel, "attend")
    W, B = dense.contract.tap_width, dense.cfg.block_size
    rng = np.random.default_rng(4)
    spans = {0: (0, 40), 1: (0, 9), 2: (6, 70)}
    for key, (a, b) in spans.items():
        taps = _bits(rng, b - a, W)
        for d in (dense, fast):
            assert d.reserve(key, a, b + B)
            d.ingest([IngestItem(key, a, a, taps)])
    hot = Sampling(temperature=0.8, top_p=0.95, seed=11, return_probs=3)
    items = [DraftItem(k, a, b, 3 + k, B, GREEDY if k == 1 else hot) for k, (a, b) in spans.items()]
    got, want = fast.draft(items), dense.draft(items)
    assert flash_calls[0] == dense.cfg.num_layers
    assert [o.tokens for o in got] == [o.tokens for o in want]
    for a, b in zip(got, want, strict=True):
        if a.probs is not None:
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-4, atol=1e-6)


def test_a_prebuilt_extension_on_the_path_is_taken_and_anything_else_left_for_a_build(
    tmp_path, monkeypatch, caplog
) -> None:
    """``_prebuilt``: a ``draft_flash_mla`` extension module on ``sys.path`` is imported instead of a build;
    a plain Python module of that name is not one, and an extension that does not import (another torch's
    build) is logged and left for a fresh build."""
    import importlib
    import shutil
    import sys

    assert fm._prebuilt() is None  # nothing of that name anywhere
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / f"{fm.EXT}.py").write_text("raise AssertionError('a .py must not be imported')\n")
    importlib.invalidate_caches()
    assert fm._prebuilt() is None
    (tmp_path / f"{fm.EXT}.py").unlink()
    # a real extension module under the wrong name: it has no PyInit_draft_flash_mla, so it does not import
    import _json
    from pathlib import Path

    ext = getattr(_json, "__file__", None) or str(next(Path(np.__file__).parent.rglob("*.so")))
    shutil.copy(ext, tmp_path / f"{fm.EXT}.so")
    importlib.invalidate_caches()
    with caplog.at_level("WARNING", logger=fm.__name__):
        assert fm._prebuilt() is None
    assert "does not import" in caplog.text and fm.EXT not in sys.modules
    sentinel = object()
    monkeypatch.setattr(importlib, "import_module", lambda name: sentinel if name == fm.EXT else None)
    assert fm._prebuilt() is sentinel  # an extension that imports is what load() returns
