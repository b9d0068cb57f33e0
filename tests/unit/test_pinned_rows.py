"""``PinnedRows`` (``target_client.vllm.wire``): the host memory GPU taps' rows land in, reused once the
client lets go of them. On the CPU the buffer is plain memory (``pin=False``); the bookkeeping is the
same. What must hold: rows come out equal, a region is never handed out again while any view of
its rows lives (a slice in a resend buffer, a memoryview in a ZeroMQ frame), it is reused once none
does, and rows that do not fit take a fresh array instead of waiting.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import torch

from target_client.vllm.wire import PinnedRows, WireEncoder

WIDTH = 128  # bf16 values per row


def bf16(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def in_buffer(pool: PinnedRows, a: np.ndarray) -> bool:
    lo = pool._slab.data_ptr()
    return lo <= a.ctypes.data < lo + pool._slab.numel()


def test_rows_come_out_equal_in_wire_storage_and_in_the_buffer() -> None:
    pool = PinnedRows(1 << 16, pin=False)
    t = bf16(5, 0)
    out = pool.host_rows(t)
    assert out.dtype == np.uint16 and out.shape == (5, WIDTH) and out.flags.c_contiguous
    assert np.array_equal(out, bits(t)) and in_buffer(pool, out)
    fp8_like = torch.arange(5 * 36, dtype=torch.uint8).view(5, 36)  # fp8 rows travel as uint8
    out8 = pool.host_rows(fp8_like)
    assert out8.dtype == np.uint8 and np.array_equal(out8, fp8_like.numpy()) and in_buffer(pool, out8)
    assert pool.taken == 2 and pool.fallbacks == 0


def test_a_region_is_never_reused_while_a_view_of_its_rows_lives() -> None:
    pool = PinnedRows(8 * 1024, pin=False)  # room for four 2-row steps (512 bytes each, 256-aligned)
    first = pool.host_rows(bf16(2, 1))
    want = first.copy()
    kept = first[1:]  # what a resend buffer keeps of a step: a slice
    frame = memoryview(first)  # what a ZeroMQ frame in flight holds
    del first
    later = []
    for i in range(40):  # many steps through a small buffer: the other regions are reused
        rows = pool.host_rows(bf16(2, 100 + i))
        assert np.array_equal(kept, want[1:]) and np.array_equal(np.asarray(frame), want)
        later.append(rows)
        if len(later) > 2:
            later.pop(0)  # the client lets go of older steps
    assert pool.taken == 41 and pool.fallbacks == 0  # the held region is stepped around
    del frame
    assert np.array_equal(kept, want[1:])
    del kept, later, rows
    gc.collect()
    assert pool.free_bytes == 8 * 1024  # every region back once nothing views it


def test_regions_are_reused_once_let_go() -> None:
    pool = PinnedRows(4 * 1024, pin=False)
    addrs = set()
    for i in range(50):
        out = pool.host_rows(bf16(3, i))
        assert np.array_equal(out, bits(bf16(3, i)))
        addrs.add(out.ctypes.data)
        del out
    assert pool.taken == 50 and pool.fallbacks == 0 and len(addrs) <= 4  # the same few regions, over and over
    assert pool.free_bytes == 4 * 1024


def test_rows_that_do_not_fit_take_a_fresh_array() -> None:
    pool = PinnedRows(4 * 1024, pin=False)
    big = bf16(9, 2)  # 2,304 bytes: more than half the buffer
    out = pool.host_rows(big)
    assert np.array_equal(out, bits(big)) and not in_buffer(pool, out)
    held = [pool.host_rows(bf16(4, i)) for i in range(4)]  # 1 KiB each: the buffer is full
    assert all(in_buffer(pool, a) for a in held) and pool.fallbacks == 1
    extra = pool.host_rows(bf16(4, 9))
    assert not in_buffer(pool, extra) and np.array_equal(extra, bits(bf16(4, 9)))
    assert pool.fallbacks >= 2 and pool.host_rows(torch.empty(0, WIDTH, dtype=torch.bfloat16)).shape == (0, WIDTH)


def test_rows_let_go_on_other_threads_free_their_regions() -> None:
    pool = PinnedRows(64 * 1024, pin=False)
    handed: list[np.ndarray] = []
    lock = threading.Lock()
    errors: list[str] = []

    def consumer(seed: int) -> None:  # an I/O thread dropping rows once "acknowledged"
        rng = np.random.default_rng(seed)
        for _ in range(300):
            with lock:
                if handed:
                    a = handed.pop(int(rng.integers(0, len(handed))))
                else:
                    continue
            if not np.array_equal(a, np.full_like(a, a[0, 0])):
                errors.append("rows changed while held")
            del a

    threads = [threading.Thread(target=consumer, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for i in range(300):
        out = pool.host_rows(torch.full((2, WIDTH), i % 30000, dtype=torch.int16))
        with lock:
            handed.append(out)
        del out
    for t in threads:
        t.join(30)
    assert not errors
    handed.clear()
    gc.collect()
    assert pool.free_bytes == 64 * 1024 and pool.taken + pool.fallbacks == 300


def test_the_encoder_keeps_rows_of_host_taps_where_they_are() -> None:
    enc = WireEncoder("bf16", pinned_mib=1)
    t = bf16(3, 4)
    out = enc(t)
    assert np.array_equal(out, bits(t)) and enc.pinned is None  # CPU taps: no device copy, no buffer


def test_the_encoder_writes_rows_into_a_claimed_ring_region_equal_to_its_own() -> None:
    """``claim`` (``DraftClient.claim_rows``): every wire format's rows land in a region of the
    client's shm ring, equal to what the encoder makes without it; the ring sends them where they
    lie. No region: the rows come out as before."""
    from protocol.shm import HEADER_BYTES
    from target_client.client.ring import ClientRing
    from target_client.projection import Projection

    hidden = 32
    g = torch.Generator().manual_seed(9)
    proj = Projection(
        proj=(torch.randn(hidden, WIDTH, generator=g) * 0.1).numpy(),
        norm=(1 + 0.1 * torch.randn(hidden, generator=g)).numpy(),
        proj_dtype="F32",
        norm_dtype="F32",
        eps=1e-6,
        names=("context_proj.weight", "context_norm.weight"),
    )
    taps = torch.randn(6, WIDTH, generator=g)  # float32 taps: the bf16 format rounds them on the way in
    ring = ClientRing(1 << 20)
    try:
        lo = ring._base
        for fmt in ("bf16", "fp8", "projected"):
            enc = WireEncoder(fmt, projection=proj if fmt == "projected" else None)
            want = enc(taps)
            got = enc(taps, claim=ring.claim)
            assert got.dtype == want.dtype and np.array_equal(got, want), fmt
            assert lo + HEADER_BYTES <= got.ctypes.data < lo + ring.size and enc.claimed == 1, fmt
            at = ring.in_place(got)
            assert at is not None and at.nbytes == want.nbytes, fmt
        enc = WireEncoder("bf16")
        assert np.array_equal(enc(taps, claim=lambda n, pin: None), bits(taps.to(torch.bfloat16)))
        assert enc.claimed == 0
    finally:
        ring.close()
