"""Programmatic dependent launch on a real GPU (``kernels/pdl.py``). Skipped without a CUDA device of
compute capability 9+ (run on the device: ``pytest -q tests/gpu``).

PDL lets each Triton kernel of a captured step start before the one before it ends; each waits for
its predecessor before touching what it wrote. If a wait were missing or misplaced, a kernel would
read a half-written input and the drafts would change. Two drafters with the same seeded weights,
one captured with PDL off and one with it on (the GEMM tuner's choices are shared, so the kernels
are the same), draft the same batches from the same rows: every token must be equal, for both
attention layouts, at several batch sizes, step after step.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("PDL needs a CUDA GPU", allow_module_level=True)

from draft_server.drafters import DraftItem, IngestItem  # noqa: E402
from draft_server.models.kernels import pdl  # noqa: E402
from draft_server.models.presets import random_drafter  # noqa: E402
from draft_server.models.tiny import K3_CONFIG, QWEN3_CONFIG  # noqa: E402
from protocol import GREEDY  # noqa: E402

if not pdl._supported(0):
    pytest.skip("this GPU or Triton has no programmatic dependent launch", allow_module_level=True)

CTX, NEW = 700, 3


def _rows(rng: np.random.Generator, n: int, w: int) -> np.ndarray:
    return (rng.standard_normal((n, w), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _drafts(cfg: dict, enabled: bool, batches: list[int], steps: int) -> list[list[list[int]]]:
    saved, pdl.ENABLED = pdl.ENABLED, enabled
    try:
        d = random_drafter(dict(cfg), torch.device("cuda"), 256 << 20, torch.bfloat16, attention="paged")
        d.prepare(16, 2048)
        rng = np.random.default_rng(3)
        W = d.contract.tap_width
        out = []
        for n in batches:
            keys = list(range(100 * n, 100 * n + n))
            end = {}
            for k in keys:
                assert d.reserve(k, 0, CTX + steps * NEW + 16)
                d.ingest([IngestItem(k, 0, 0, _rows(rng, CTX, W))])
                end[k] = CTX
            for _ in range(steps):
                items = [IngestItem(k, 0, end[k], _rows(rng, NEW, W)) for k in keys]
                for k in keys:
                    end[k] += NEW
                drafts = [DraftItem(k, 0, end[k], 5 + i, 7, GREEDY) for i, k in enumerate(keys)]
                out.append([o.tokens for o in d.step(items, drafts)])
            for k in keys:
                d.release(k)
        assert d.fast is not None and d.fast.graph_steps > 0, "the captured graphs never ran"
        d.close()
        return out
    finally:
        pdl.ENABLED = saved


@pytest.mark.parametrize("cfg", [K3_CONFIG, QWEN3_CONFIG], ids=["k3_mla", "qwen3_gqa"])
def test_pdl_drafts_equal_serial_launches(cfg: dict) -> None:
    batches, steps = [1, 3, 8, 16], 6
    serial = _drafts(cfg, False, batches, steps)
    overlapped = _drafts(cfg, True, batches, steps)
    assert overlapped == serial
