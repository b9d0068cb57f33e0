"""``PinnedRows`` on a real GPU: the taps' device-to-host copy into page-locked memory. Skipped
without CUDA (run on the device: ``pytest -q tests/gpu``).

1. Rows copied from the GPU (bf16, fp8 as uint8, projected f32) equal ``.cpu()`` of the same rows,
   and lie in the page-locked buffer.
2. The copy is complete when ``host_rows`` returns, even with the rows made by kernels still
   queued on the stream (no read of half-written memory).
3. A region comes back only after every view of its rows is gone, with rows from a GPU stream
   that keeps writing new rows into the same device buffer.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("page-locked staging needs a CUDA GPU", allow_module_level=True)

from target_client.vllm.wire import PinnedRows, WireEncoder  # noqa: E402

WIDTH = 5 * 7168  # K3 taps


def _in(pool: PinnedRows, a: np.ndarray) -> bool:
    lo = pool._slab.data_ptr()
    return lo <= a.ctypes.data < lo + pool.size


def test_device_rows_land_in_page_locked_memory_equal_to_cpu() -> None:
    pool = PinnedRows(64 << 20)
    assert pool._slab.is_pinned()
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.uint8, torch.float32):
        if dtype == torch.uint8:
            rows = torch.randint(0, 256, (24, WIDTH // 2 + 4), device="cuda", dtype=torch.uint8, generator=g)
        else:
            rows = torch.randn(24, WIDTH, device="cuda", generator=g).to(dtype)
        out = pool.host_rows(rows)
        want = rows.view(torch.int16).cpu().numpy().view(np.uint16) if dtype == torch.bfloat16 else rows.cpu().numpy()
        assert _in(pool, out) and out.dtype == want.dtype and np.array_equal(out, want)
    assert pool.taken == 3 and pool.fallbacks == 0


def test_the_copy_is_complete_when_it_returns_behind_queued_kernels() -> None:
    pool = PinnedRows(64 << 20)
    a = torch.randn(4096, 4096, device="cuda")
    for i in range(8):
        rows = torch.full((192, WIDTH), float(i), device="cuda")
        for _ in range(4):  # kernels queued ahead of the copy on the same stream
            a = a @ a * 1e-3
        rows += a[0, 0] * 0  # the rows depend on them
        out = pool.host_rows(rows.to(torch.bfloat16))
        bits = torch.tensor(float(i)).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
        assert np.array_equal(out, np.full_like(out, bits))


def test_regions_come_back_only_once_no_view_lives() -> None:
    pool = PinnedRows(8 * 192 * WIDTH * 2)  # eight steps of 64 sessions x 3 rows
    dev = torch.empty(192, WIDTH, dtype=torch.bfloat16, device="cuda")
    kept: list[tuple[np.ndarray, np.ndarray]] = []  # (a slice a resend buffer keeps, what it must read)
    for i in range(40):
        dev.fill_(float(i % 250))  # the target reuses its device buffer every step
        out = pool.host_rows(dev)
        if i % 10 == 0:
            kept.append((out[5:9], out[5:9].copy()))  # held for a long time
        del out
        assert all(np.array_equal(held, want) for held, want in kept)
    assert pool.taken + pool.fallbacks == 40 and pool.taken >= 30
    kept.clear()
    gc.collect()
    assert pool.free_bytes == pool.size


def test_the_encoder_stages_gpu_taps_in_its_buffer() -> None:
    enc = WireEncoder("bf16", pinned_mib=64)
    taps = torch.randn(6, WIDTH, device="cuda")
    out = enc(taps)
    assert enc.pinned is not None and _in(enc.pinned, out)
    assert np.array_equal(out, taps.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16))


def test_rows_from_the_gpu_go_straight_into_the_page_locked_shm_ring() -> None:
    """``claim`` with ``pin_cuda``: the ring is page-locked once (torch sees it as pinned), the rows
    of every wire format land in a claimed region equal to ``.cpu()`` while kernels that made them
    are still queued, and the ring unlocks at close."""
    from protocol.shm import HEADER_BYTES
    from target_client.client.ring import ClientRing

    ring = ClientRing(64 << 20)
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        for fmt in ("bf16", "fp8"):
            enc = WireEncoder(fmt)
            for _ in range(20):
                taps = torch.randn(192, WIDTH, device="cuda", generator=g)
                taps = taps * 2 + 1  # kernels still queued when the copy starts
                want = enc.device_rows(taps).cpu()
                got = enc(taps, claim=ring.claim)
                assert ring.pin_error is None, ring.pin_error
                assert ring._base + HEADER_BYTES <= got.ctypes.data < ring._base + ring.size
                w = want.view(torch.int16).numpy().view(np.uint16) if want.dtype == torch.bfloat16 else want.numpy()
                assert np.array_equal(got, w), fmt
                at = ring.in_place(got)
                assert at is not None
                ring.cancel(at.generation)
            assert enc.claimed == 20
        probe = torch.from_numpy(np.frombuffer(ring._mm, np.uint8, 4096, HEADER_BYTES))
        assert probe.is_pinned()  # registered with CUDA: the copy ran at the bus's speed
        del probe, got
    finally:
        ring.close()
