"""Ingest on a real GPU: large ingests from registered host memory (a prefill from the shm ring)
copy their rows up on a copy stream while the previous chunk's graph computes (``step.
PIPELINED_ROWS``). Skipped without CUDA (run on the device: ``pytest -q tests/gpu``).

1. The KV rows a prompt leaves are bitwise the same whether its taps came from ordinary host memory
   (staged), from registered memory (pipelined, or not) or from the GPU's memory.
2. The caller may overwrite its registered rows as soon as ``ingest`` returns: the rows the cache
   holds are the ones it passed, not what it wrote afterwards.
3. Decode steps between prefill chunks draft exactly as with the prefill staged.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("the pipelined ingest needs a CUDA GPU", allow_module_level=True)

from draft_server.drafters import DraftItem, IngestItem  # noqa: E402
from draft_server.drafters.base import DeviceRows  # noqa: E402
from draft_server.models import step as step_mod  # noqa: E402
from draft_server.models.presets import random_drafter  # noqa: E402
from draft_server.models.tiny import K3_CONFIG  # noqa: E402
from protocol import GREEDY  # noqa: E402

ROWS, CHUNK = 6144, 1024


@pytest.fixture(scope="module")
def drafter():
    d = random_drafter(dict(K3_CONFIG), torch.device("cuda"), 64 << 20, torch.bfloat16, attention="paged")
    d.prepare(4, 2048)
    yield d
    d.close()


def _rows(rng: np.random.Generator, n: int, w: int) -> np.ndarray:
    return (rng.standard_normal((n, w), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _kv(d, key: int, rows: int = ROWS) -> torch.Tensor:
    slots = torch.from_numpy(d.cache.slots(key, np.arange(rows))).cuda()
    return d.cache._flat.index_select(1, slots).clone()


def _prefill(d, key: int, src, clobber: np.ndarray | None = None) -> list[list[int]]:
    """Prefill ``key`` chunk by chunk, a decode step of session 1 between chunks; returns its drafts."""
    assert d.reserve(key, 0, ROWS + 8)
    drafts = []
    for a in range(0, ROWS, CHUNK):
        d.ingest([IngestItem(key, 0, a, src[a : a + CHUNK])])
        if clobber is not None:
            clobber[a : a + CHUNK] = 0x7FC0  # NaN bits where the rows just were: must not reach the cache
        drafts.append(d.step([], [DraftItem(1, 0, 64, 5, 7, GREEDY)])[0].tokens)
    return drafts


def test_every_way_rows_arrive_leaves_the_same_kv(drafter) -> None:
    d = drafter
    rng = np.random.default_rng(3)
    w = d.contract.tap_width
    assert d.reserve(1, 0, 72)
    d.ingest([IngestItem(1, 0, 0, _rows(rng, 64, w))])
    prompt = _rows(rng, ROWS, w)
    want_drafts = _prefill(d, 10, prompt)
    want = _kv(d, 10)
    d.release(10)

    buf = bytearray(prompt.nbytes)
    reg = np.frombuffer(buf, dtype=np.uint16).reshape(prompt.shape)
    assert d.register_host(memoryview(buf))
    default = step_mod.PIPELINED_ROWS
    assert CHUNK >= default
    try:
        for pipelined in (default, 1 << 30):
            step_mod.PIPELINED_ROWS = pipelined
            reg[:] = prompt
            assert _prefill(d, 11, reg, clobber=reg) == want_drafts
            assert torch.equal(_kv(d, 11), want), f"registered rows, PIPELINED_ROWS={pipelined}"
            d.release(11)
    finally:
        step_mod.PIPELINED_ROWS = default
        d.unregister_host(memoryview(buf))
    ready = torch.cuda.Event()
    on_dev = torch.from_numpy(prompt.view(np.int16)).cuda()
    ready.record()
    assert _prefill(d, 12, DeviceRows(on_dev, ready)) == want_drafts
    assert torch.equal(_kv(d, 12), want)
    d.release(12)


def test_a_step_gives_its_rows_back_copied(drafter) -> None:
    """``Drafter.step`` records no ingest events (its draft waits for the stream): the registered rows are
    the caller's again when it returns, also when the draft raises and with a session repeated in the
    step (a second ingest pass, which must wait for the first's staging copies)."""
    d = drafter
    rng = np.random.default_rng(5)
    w, B = d.contract.tap_width, d.cfg.block_size
    rows = _rows(rng, 8, w)
    buf = bytearray(rows.nbytes)
    reg = np.frombuffer(buf, dtype=np.uint16).reshape(rows.shape)
    assert d.register_host(memoryview(buf))
    try:
        cases = {  # key -> the step's ingest items over rows [0, 8) of the session, in passes
            30: lambda src: [IngestItem(30, 0, 0, src[:8])],
            31: lambda src: [IngestItem(31, 0, 0, src[:5]), IngestItem(31, 0, 5, src[5:8])],
        }
        for key, items in cases.items():
            assert d.reserve(key + 10, 0, 1 + B)
            d.ingest([IngestItem(key + 10, 0, 0, rows[:1])])  # the session drafting beside them
            assert d.reserve(key, 0, 8 + B)
            d.ingest(items(rows))  # the reference: ordinary memory, staged, waited for
            ref = _kv(d, key, 8)
            for k in (7, B + 1):  # B + 1: the draft raises after the rows' copies were queued
                d.release(key)
                assert d.reserve(key, 0, 8 + B)
                reg[:] = rows
                if k <= B:
                    assert len(d.step(items(reg), [DraftItem(key + 10, 0, 1, 5, k, GREEDY)])[0].tokens) == k
                else:
                    with pytest.raises(ValueError, match="exceeds block_size"):
                        d.step(items(reg), [DraftItem(key + 10, 0, 1, 5, k, GREEDY)])
                reg[:] = 0x7FC0  # NaN bits where the rows were: must not reach the cache
                assert torch.equal(_kv(d, key, 8), ref), f"session {key}, k={k}"
            d.release(key)
            d.release(key + 10)
    finally:
        d.unregister_host(memoryview(buf))
