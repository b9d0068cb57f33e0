"""ChecksumDrafter: a deterministic stand-in model that proves which rows arrived.

Each context row is reduced to a digest of its bytes and its absolute position; drafts are a
hash of the session's whole context digest, the anchor, its position and the draft index.
A test that keeps what it sent computes the same drafts with ``expected_drafts`` and so
proves the server holds exactly those rows at exactly those positions (appends, overwrites
and gap restarts included). ``delay_ms`` makes each draft call slow on purpose.

Wire formats: bf16 and fp8. A row's digest is over its bytes as they arrived (fp8: the e4m3 codes
and the scale), so the proof is the same in either; projected rows are not taken (the checksum
drafter has no context projection for a client to match).

``device`` (``--drafter checksum --device cuda``): the drafter declares a CUDA device, so clients
may send rows over transport cuda_ipc; such rows arrive in device memory and are copied to the
host for their digests (tests and ``draft-bench`` of the transport; the digests stay the same).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from draft_server.drafters.base import DeviceRows, Drafter, DraftItem, DraftOut, IngestItem
from protocol import DType, ModelContract, WireFormat, WireOffer

_M64 = (1 << 64) - 1


def row_digest(row: np.ndarray | bytes, pos: int) -> int:
    """Digest of one context row at absolute position ``pos``."""
    crc = zlib.crc32(memoryview(row).cast("B") if isinstance(row, np.ndarray) else row)
    return _mix((crc << 32) ^ (pos * 0x9E3779B97F4A7C15 & _M64))


def _mix(x: int) -> int:
    """splitmix64 finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def drafts_from_digests(digests: Iterable[int], start: int, pos: int, anchor: int, k: int, vocab: int) -> list[int]:
    total = 0
    for d in digests:
        total = (total + d) & _M64
    seed = _mix(total ^ _mix(start) ^ _mix(pos << 20 ^ anchor))
    return [_mix(seed + j) % vocab for j in range(k)]


def expected_drafts(rows: dict[int, bytes], start: int, pos: int, anchor: int, k: int, vocab: int) -> list[int]:
    """What the server must answer if it holds ``rows`` (position -> row bytes) as [start, pos)."""
    assert sorted(rows) == list(range(start, pos)), "context must be exactly [start, pos)"
    return drafts_from_digests((row_digest(rows[p], p) for p in range(start, pos)), start, pos, anchor, k, vocab)


class ChecksumDrafter(Drafter):
    def __init__(
        self,
        contract: ModelContract | None = None,
        capacity_tokens: int = 1 << 22,
        delay_ms: float = 0.0,
        device: str | None = None,
    ) -> None:
        self.contract = contract or ModelContract(
            model_name="checksum",
            tap_layer_ids=(1, 3),
            target_hidden_size=64,
            vocab_size=32000,
            block_size=8,
            mask_token_id=31999,
            tap_dtype=DType.BF16,
        )
        self._capacity = capacity_tokens
        self._delay_s = delay_ms / 1000.0
        # per session: (start, list of digests for positions start..)
        self._sessions: dict[int, tuple[int, list[int]]] = {}
        self._reserved: dict[int, int] = {}
        self._used = 0  # sum of _reserved
        self._device: object | None = None
        if device is not None:
            import torch

            self._device = torch.device(device if ":" in device else f"{device}:{torch.cuda.current_device()}")

    def cuda_device(self) -> object | None:
        return self._device

    def wire_offer(self) -> WireOffer:
        return WireOffer(formats=(WireFormat.BF16.value, WireFormat.FP8.value))

    def capacity_tokens(self) -> int:
        return self._capacity

    def used_tokens(self) -> int:
        return self._used

    def reserve(self, key: int, start: int, end: int) -> bool:
        need = max(0, end - start)
        have = self._reserved.get(key, 0)
        if self._used - have + need > self._capacity:
            return False
        self._reserved[key] = need
        self._used += need - have  # a running total: reserve is per entry, a sum over sessions was O(n^2) a batch
        return True

    def release(self, key: int) -> None:
        self._sessions.pop(key, None)
        self._used -= self._reserved.pop(key, 0)

    def ingest(self, items: Sequence[IngestItem]) -> None:
        for it in items:
            start, digests = self._sessions.get(it.key, (it.start, []))
            if start != it.start:  # gap restart
                start, digests = it.start, []
            del digests[it.pos - start :]
            if len(digests) != it.pos - start:
                raise AssertionError(f"ingest at {it.pos} leaves a hole after {start + len(digests)}")
            taps = it.taps.host() if isinstance(it.taps, DeviceRows) else it.taps
            digests.extend(row_digest(taps[i], it.pos + i) for i in range(len(taps)))
            self._sessions[it.key] = (start, digests)

    def draft(self, items: Sequence[DraftItem]) -> list[DraftOut]:
        if self._delay_s:
            time.sleep(self._delay_s)
        out = []
        for it in items:
            start, digests = self._sessions.get(it.key, (it.start, []))
            if start != it.start or len(digests) < it.pos - start:
                raise AssertionError(f"draft for key {it.key} at {it.pos}: context is not [{it.start}, {it.pos})")
            tokens = drafts_from_digests(
                digests[: it.pos - start], start, it.pos, it.anchor, it.k, self.contract.vocab_size
            )
            out.append(DraftOut(tokens=tokens))
        return out
