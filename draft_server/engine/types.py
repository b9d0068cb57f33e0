"""The units of work that cross from the I/O thread to the engine: ``Call`` (one Step message)
and ``Work`` (one admitted entry of it, queued on its session)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocol import EntryResult, Phase, Sampling, WireFormat

SessionKey = tuple[bytes, str]  # (owner, session id)


@dataclass(eq=False, slots=True)
class Call:
    """One Step message: answered once every entry has a result.

    ``ident`` is the ROUTER routing id replies go to; ``owner`` is who its sessions belong to: the
    connection's routing id, bound to the client's CurveZMQ public key when Curve is on.
    """

    ident: bytes
    call_id: int
    recv_t: float
    deadline: float
    results: list[EntryResult | None]
    owner: bytes = b""
    remaining: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0
    payloads: list[bytes] = field(default_factory=list)  # reply frames (draft probabilities)
    commit_follows: bool = False  # early taps whose commits follow at once (``Step.commit_follows``)

    def __post_init__(self) -> None:
        self.owner = self.owner or self.ident


@dataclass(eq=False, slots=True)
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
    fmt: str = WireFormat.BF16.value  # the wire format of ``taps`` (the Step's)
    # TAPS: early rows, ingested after waiting commits; COMMIT: drafts only if the session holds the
    # rows below ``pos`` (else MISSING_ROWS); WHOLE: today's single message (a gap restarts)
    phase: Phase = Phase.WHOLE
    # COMMIT: the call id of the Taps that must be its session's latest; an entry with rows: of the
    # call whose rows must have reached its session last (a client catching up). 0: any
    after: int = 0
    restart: bool = False  # start the session at ``pos`` (the sender gave up unacknowledged rows below it)
    late: str = ""  # read past its budget (a pause): acknowledged EXPIRED with this message, not OK

    @property
    def rows(self) -> int:
        return 0 if self.taps is None else len(self.taps)
