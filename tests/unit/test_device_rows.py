"""``DeviceRows`` slices and ``device_runs``: which of a batch's device rows (transport cuda_ipc) go to
the drafter's staging buffer as one copy. The rows here are host tensors (the slicing and joining do
not touch a device)."""

from __future__ import annotations

import torch

from draft_server.drafters.base import DeviceRows, device_runs


def _rows(n: int, ready: object = None) -> DeviceRows:
    return DeviceRows(torch.arange(n * 4, dtype=torch.int16).reshape(n, 4), ready)


def test_neighbouring_slices_of_one_steps_rows_are_one_run_holding_exactly_their_rows() -> None:
    r = _rows(10)
    parts = [r[0:3], r[3:4], r[4:9]]
    (run,) = device_runs(parts)
    assert run.base is r.t and run.lo == 0 and len(run) == 9
    assert torch.equal(run.tensor(), torch.cat([p.tensor() for p in parts]))
    later = r[2:][1:4]  # a slice of a slice still knows where it lies
    assert later.lo == 3 and torch.equal(later.tensor(), r.t[3:6])
    (tail,) = device_runs([r[5:7], r[7:10]])
    assert tail.lo == 5 and torch.equal(tail.tensor(), r.t[5:10])


def test_gaps_other_rows_other_copies_and_other_orders_stay_apart() -> None:
    r, other = _rows(10), _rows(10)
    assert [len(x) for x in device_runs([r[0:2], r[3:5]])] == [2, 2]  # a gap
    assert [len(x) for x in device_runs([r[3:5], r[0:3]])] == [2, 3]  # out of order
    assert [len(x) for x in device_runs([r[0:2], other[2:4]])] == [2, 2]  # another Step's rows
    a, b = DeviceRows(r.t, object()), DeviceRows(r.t, object())
    assert len(device_runs([a[0:2], b[2:4]])) == 2  # the same memory, written by two copies
    assert len(device_runs([r[[0, 1]], r[2:4]])) == 2  # an index list is a copy of its own, not a slice
    assert device_runs([]) == []
