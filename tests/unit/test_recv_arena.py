"""The receive arena's slots (``draft_server.io.arena``): first fit, held while referenced, merged
when given back out of order, never handed out twice; registered with a paged drafter so rows in
it go to the device with no staging copy, unregistered at close."""

from __future__ import annotations

import gc

import numpy as np

from draft_server.io.arena import ALIGN, Arena


def test_slots_are_first_fit_held_while_referenced_and_merge_when_given_back() -> None:
    a = Arena(64 << 10)
    assert a.capacity == 64 << 10 and not a.registered
    s1, s2, s3 = a.take(1000), a.take(ALIGN), a.take(20 << 10)
    assert s1 is not None and s2 is not None and s3 is not None
    assert [a.contains(s.ctypes.data, s.nbytes) for s in (s1, s2, s3)] == [True] * 3
    assert s2.ctypes.data - s1.ctypes.data == 1024 and s3.ctypes.data - s2.ctypes.data == ALIGN  # aligned, packed
    assert a.held == 1024 + ALIGN + (20 << 10)
    assert a.take(a.capacity) is None and a.take(a.capacity + 1) is None and a.take(0) is None
    assert a.fits(a.capacity) and not a.fits(a.capacity + 1)
    s1[:] = 1
    view = s1[100:200].view(np.uint16)  # a view keeps its slot
    del s1
    gc.collect()
    assert a.held == 1024 + ALIGN + (20 << 10)
    s4 = a.take(1000)
    assert s4 is not None and not np.shares_memory(s4, view) and (view == 0x0101).all()
    del view
    assert a.held == 2 * 1024 + ALIGN + (20 << 10) - 1024
    del s3, s2  # out of order: merged with each other and with s1's old slot
    assert a.held == 1024
    first = a.take(1024 + ALIGN + (20 << 10))
    assert first is not None and first.ctypes.data == a.base  # one extent again, first fit
    del first, s4
    assert a.held == 0 and a.take(a.capacity) is not None  # the whole arena in one piece
    a.close()


def test_the_arena_is_registered_with_a_paged_drafter_and_its_rows_skip_staging(tmp_path) -> None:
    from draft_server.models import load_drafter
    from draft_server.models.tiny import make_tiny

    p = make_tiny("k3", str(tmp_path / "k3"), seed=3)
    d = load_drafter(p.draft, p.target, "cpu", "float32", 16 << 20, page_size=4, attention="paged")
    assert not Arena(1 << 20, d.register_host, d.unregister_host).registered  # nothing to register with yet
    d.prepare(max_batch_sessions=4, max_batch_rows=32)
    fast = d.fast
    assert fast is not None
    arena = Arena(1 << 20, d.register_host, d.unregister_host)
    assert arena.registered and len(fast._host_ranges) == 1
    W = d.contract.tap_width
    slot = arena.take(12 * W * 2)
    assert slot is not None
    rows = slot.view(np.uint16).reshape(12, W)
    assert fast._registered_runs([rows[:5], rows[5:]]) is not None  # straight to the device, one copy
    arena.close()
    assert fast._host_ranges == [] and fast._registered_runs([rows[:5]]) is None
    del rows, slot
