"""Predicted commits: a verify step's commits sent before the target samples, settled after it.

Owns ``PredictedCommits``. With early taps a step's rows are on their way before sampling; when the
caller can tell what sampling will commit (greedy rejection from the raw logits: the drafts up to
the first that differs from the argmax, then the argmax there), its taps carry a predicted request's
rows only up to the predicted end, and it sends those commits at once (``send``: one
``submit_commit`` call), so the server drafts while the target samples. After sampling, ``settle``
answers the step's real commits:

* a commit that is the predicted one (same end and anchor, greedy) takes the predicted call's
  drafts: the server drafted from exactly the context the late commit would name;
* one that accepted more rows than predicted sends the rows from the predicted end to the real one
  with it (a ``step`` entry with rows: the taps stopped at the predicted end, or the server cut the
  span there, as it cuts every commit's rejected rows);
* every other one (fewer rows, another anchor, sampled, not predicted) commits as usual.

The calls of the last two go out together, before the predicted call's reply is awaited. Works
with a ``DraftClient`` or a ``FleetClient`` (each session's commit goes to its server). Used by the
vLLM proposer and the soak's synthetic engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from protocol import GREEDY
from target_client.api import DraftReply, StepRequest
from target_client.client.regions import is_device

RowsOf = Callable[[str, int, int], Any]  # (session, first position, end position) -> the span's rows there
Client = Any  # a DraftClient or a FleetClient: submit_commit / submit_step, tickets with collect()


class PredictedCommits:
    """One step's predicted commits in flight (``send``) and their settlement (``settle``)."""

    def __init__(self, ticket: Any, requests: Sequence[StepRequest], rows_of: RowsOf) -> None:
        self.ticket = ticket
        self.predicted = {r.session: (i, r) for i, r in enumerate(requests)}
        self.rows_of = rows_of
        self.hits = 0
        self.misses = 0
        self.rows_again = 0  # misses that accepted past the prediction: their rows went with the commit
        self.missed: set[str] = set()  # sessions whose real commit was not the predicted one

    @classmethod
    def send(cls, client: Client, requests: Sequence[StepRequest], rows_of: RowsOf) -> PredictedCommits | None:
        """The predicted commits (no rows; greedy) go now; None when there are none. ``rows_of`` gives
        a request's rows at positions [lo, hi) of its span, for a commit that accepts past its
        prediction (the early taps need not have carried them)."""
        if not requests:
            return None
        return cls(client.submit_commit(list(requests)), requests, rows_of)

    def settle(self, client: Client, commits: Sequence[StepRequest]) -> list[DraftReply]:
        """Replies for the step's real commits, in order (module docstring)."""
        hit: list[tuple[int, int]] = []  # (commit, its index in the predicted call)
        plain: list[int] = []
        again: list[tuple[int, StepRequest]] = []  # (commit, the request carrying its rows again)
        for j, c in enumerate(commits):
            got = self.predicted.get(c.session)
            if got is None:  # not predicted (sampled, say)
                plain.append(j)
                continue
            i, p = got
            if c.sampling == GREEDY and (c.pos, c.anchor) == (p.pos, p.anchor):  # k may differ: advice moved
                hit.append((j, i))
                continue
            self.misses += 1
            self.missed.add(c.session)
            if c.pos > p.pos:
                again.append((j, StepRequest(c.session, p.pos, c.pos - p.pos, c.anchor, c.k, c.sampling)))
            else:
                plain.append(j)
        self.hits += len(hit)
        self.rows_again += len(again)
        tickets: list[tuple[list[int], Any]] = []
        if plain:
            tickets.append((plain, client.submit_commit([commits[j] for j in plain])))
        if again:
            reqs = [r for _, r in again]
            rows = _cat([self.rows_of(r.session, r.pos, r.pos + r.rows) for r in reqs])
            tickets.append(([j for j, _ in again], client.submit_step(reqs, rows)))
        out = [DraftReply([]) for _ in commits]
        if hit:
            replies = self.ticket.collect()
            for j, i in hit:
                out[j] = replies[i]
        for idx, ticket in tickets:
            for j, r in zip(idx, ticket.collect(), strict=True):
                out[j] = r
        return out

    def predicted_replies(self) -> dict[str, DraftReply]:
        """Every predicted commit's own reply, by session (waits for the predicted call, at most until
        its deadline): a caller that accounts for each call (the soak) sees one that failed although
        its request committed otherwise; the client acted on that failure as on any other."""
        replies = self.ticket.collect()
        return {sid: replies[i] for sid, (i, _) in self.predicted.items()}


def _cat(parts: list[Any]) -> Any:
    """Row slices as one C-contiguous array: host numpy, or a torch tensor on the device (cuda_ipc)."""
    if is_device(parts[0]):
        from target_client.cuda.ipc import cat_rows  # torch, only for a cuda_ipc caller

        return cat_rows(parts)
    return np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])
