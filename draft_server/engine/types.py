"""The units of work that cross from the I/O thread to the engine: ``Call`` (one Step message)
and ``Work`` (one admitted entry of it, queued on its session)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol import EntryResult, Sampling

SessionKey = tuple[bytes, str]  # (client routing id, session id)


@dataclass(eq=False)
class Call:
    """One Step message: answered once every entry has a result."""

    ident: bytes
    call_id: int
    recv_t: float
    deadline: float
    results: list[EntryResult | None]
    remaining: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0


@dataclass(eq=False)
class Work:
    """One admitted entry, queued on its session."""

    call: Call
    idx: int
    sid: str
    pos: int  # position of taps[0] (advances as prefill chunks are ingested)
    taps: np.ndarray | None  # rows not yet ingested
    anchor: int
    k: int  # 0 once resolved (no drafting left to do)
    sampling: Sampling
    end: int  # session end once all rows are in

    @property
    def rows(self) -> int:
        return 0 if self.taps is None else len(self.taps)
