"""The EXL3 decoder against independent readings of exllamav3's format (no GPU, no exllamav3).

- codebooks: every one of the 65,536 states, recomputed with numpy's float16 arithmetic (one
  rounding per CUDA half op), and 3INST's spread equals exllamav3's ``codebook_scale`` constant;
- the bitstream: a naive bit-string reader of the spec (little-endian uint32 words, MSB first,
  the window ending at bit (p+1)K, circular) for K = 1..8;
- tile placement: an emulation of ``reconstruct_kernel``'s warp shuffle (lanes, shfl_down by 4);
- the CPU encoder's packing round-trips through the decoder; Hadamard and legacy sign words.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_server.models.exl3.decode import (
    CODEBOOKS,
    codebook_lut,
    decode_inner,
    dense_weight,
    hadamard,
    tile_perm,
    unpack_signs,
    unpack_states,
    weight_fp16_like_exllamav3,
)
from draft_tools.exl3_cpu import pack_trellis, viterbi

CODEBOOK_SCALE = 1.24371088  # exllamav3 exl3_lib/quantize.py: the 3INST codebook's standard deviation


def _np_half(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16)


def _np_codebook(cb: str) -> np.ndarray:
    s = np.arange(65536, dtype=np.uint64)
    if cb == "mul1":
        x = (s * np.uint64(0x83DCD12D)) & np.uint64(0xFFFFFFFF)
        byte_sum = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))
        h = _np_half(np.uint64(0x6400) + byte_sum).astype(np.float64)
        inv = _np_half(np.array([0x1EEE])).astype(np.float64)
        bias = _np_half(np.array([0xC931])).astype(np.float64)
        return (h * inv + bias).astype(np.float16)  # fma: exact in float64, one rounding to half
    if cb == "3inst":
        x = (s * np.uint64(89226354) + np.uint64(64248484)) & np.uint64(0xFFFFFFFF)
    else:
        x = (s * np.uint64(0xCBAC1FED)) & np.uint64(0xFFFFFFFF)
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo, hi = _np_half(x & np.uint64(0xFFFF)), _np_half(x >> np.uint64(16))
    return lo + hi  # numpy half add: rounded once


@pytest.mark.parametrize("cb", CODEBOOKS)
def test_codebook_every_state(cb: str) -> None:
    got = codebook_lut(cb).numpy().view(np.uint16)
    want = _np_codebook(cb).view(np.uint16)
    assert np.array_equal(got, want)
    assert np.isfinite(codebook_lut(cb).numpy()).all()


def test_codebook_spread_matches_exllamav3_constant() -> None:
    assert codebook_lut("3inst").double().std().item() == pytest.approx(CODEBOOK_SCALE, abs=2e-5)
    assert codebook_lut("mul1").double().std().item() == pytest.approx(1.0, abs=2e-3)  # (sum of 4 bytes) / 147.7


def _naive_states(tile_words: np.ndarray, K: int) -> list[int]:
    """The spec read literally: a bit string, 16-bit windows ending at (p+1)K, wrapping."""
    le = tile_words.astype(np.int16).tobytes()
    words = np.frombuffer(le, dtype="<u4")
    bits = "".join(f"{int(w):032b}" for w in words)
    n = len(bits)
    assert n == 256 * K
    return [int("".join(bits[(e - 16 + i) % n] for i in range(16)), 2) for e in ((p + 1) * K for p in range(256))]


@pytest.mark.parametrize("K", range(1, 9))
def test_bitstream_matches_naive_reader(K: int) -> None:
    g = torch.Generator().manual_seed(K)
    tr = torch.randint(-(1 << 15), 1 << 15, (2, 1, 16 * K), generator=g, dtype=torch.int32).to(torch.int16)
    got = unpack_states(tr)
    for i in range(2):
        assert got[i, 0].tolist() == _naive_states(tr[i, 0].numpy(), K)


def test_tile_placement_matches_reconstruct_shuffle() -> None:
    """Emulate reconstruct_kernel: lane l decodes positions 8l..8l+7; lanes without bit 2 pair with l+4."""
    tile = [[-1] * 16 for _ in range(16)]
    for lane in range(32):
        if lane & 4:
            continue
        nb = lane + 4
        r0 = (lane % 4) * 2
        c0 = lane // 8
        slots = [(r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0)]
        slots += [(r0, c0 + 4), (r0 + 1, c0 + 4), (r0 + 8, c0 + 4), (r0 + 9, c0 + 4)]
        for j, (r, c2) in enumerate(slots):  # half2 slot c2 holds columns 2 c2 (this lane), 2 c2 + 1 (lane + 4)
            tile[r][2 * c2] = 8 * lane + j
            tile[r][2 * c2 + 1] = 8 * nb + j
    pos_at = torch.tensor(tile).flatten()  # row-major index -> position
    assert sorted(pos_at.tolist()) == list(range(256))
    assert torch.equal(tile_perm()[pos_at], torch.arange(256))


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6, 7, 8])
def test_pack_round_trip(K: int) -> None:
    g = torch.Generator().manual_seed(K)
    v = torch.randint(0, 1 << K, (3, 256), generator=g)
    bits = ((v[..., None] >> torch.arange(K - 1, -1, -1)) & 1).reshape(3, 256 * K)
    idx = (torch.arange(256)[:, None] + 1) * K - 16 + torch.arange(16)[None]
    states = (bits[:, idx % (256 * K)] << torch.arange(15, -1, -1)).sum(-1)  # consistent circular paths
    tr = pack_trellis(states.view(3, 1, 256), K)
    assert tr.shape == (3, 1, 16 * K) and tr.dtype == torch.int16
    assert torch.equal(unpack_states(tr)[:, 0], states)


@pytest.mark.parametrize("cb", CODEBOOKS)
def test_viterbi_path_decodes_to_its_values(cb: str) -> None:
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)) * codebook_lut(cb).float().std()
    states = viterbi(x, 3, cb)
    tr = pack_trellis(states.view(1, 2, 256), 3)
    assert torch.equal(unpack_states(tr).view(2, 256), states)  # the path is a valid tail-biting stream
    err = (codebook_lut(cb).float()[states] - x).pow(2).mean() / x.pow(2).mean()
    assert err < 0.05  # 3 bits per weight on a Gaussian: ~0.02-0.03


def test_decode_inner_layout() -> None:
    tr = torch.randint(-(1 << 15), 1 << 15, (2, 3, 32), dtype=torch.int32).to(torch.int16)
    w = decode_inner(tr, "mcg")
    assert w.shape == (32, 48) and w.dtype == torch.float16
    lut, st = codebook_lut("mcg"), unpack_states(tr)
    for i, j, p in ((0, 0, 0), (1, 2, 17), (0, 1, 255), (1, 0, 100)):
        r, c = divmod(int(tile_perm()[p]), 16)
        assert w[16 * i + r, 16 * j + c].view(torch.int16) == lut[st[i, j, p]].view(torch.int16)


def test_hadamard_and_signs() -> None:
    h = hadamard()
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12) and torch.equal(h, h.t())
    s = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(7):  # Sylvester recursion from [1]
        s = torch.cat([torch.cat([s, s], 1), torch.cat([s, -s], 1)], 0)
    assert torch.allclose(h * 128**0.5, s)
    words = torch.tensor([0x8005, 0xFFFF], dtype=torch.int32).to(torch.int16)  # wraps to int16 bit patterns
    signs = unpack_signs(words)
    assert signs[:3].tolist() == [-1.0, 1.0, -1.0] and signs[15].item() == -1.0 and (signs[16:] == -1).all()


def test_dense_weight_matches_exllamav3_rounding_sequence() -> None:
    g = torch.Generator().manual_seed(3)
    tr = torch.randint(-(1 << 15), 1 << 15, (8, 16, 64), generator=g, dtype=torch.int32).to(torch.int16)
    suh = ((torch.rand(128, generator=g) + 0.5) * (torch.randint(0, 2, (128,), generator=g) * 2 - 1) / 11).half()
    svh = ((torch.rand(256, generator=g) + 0.5) * (torch.randint(0, 2, (256,), generator=g) * 2 - 1)).half()
    wq = decode_inner(tr, "mul1")
    exact = dense_weight(wq, suh, svh)
    like = weight_fp16_like_exllamav3(wq, suh, svh).double()
    assert torch.allclose(like, exact, rtol=4e-3, atol=4e-4)  # a few fp16 roundings apart


def test_decode_makes_its_constants_on_the_trellis_device() -> None:
    """The loader decodes EXL3 on the GPU (``Exl3Checkpoint.load``): every constant must follow the trellis'
    device. The meta device stands in for CUDA here: a CPU constant fails the same way on both."""
    t = torch.zeros(8, 16, 16 * 4, dtype=torch.int16, device="meta")
    for cb in ("3inst", "mcg", "mul1"):
        w = decode_inner(t, cb)
        assert w.device.type == "meta" and w.shape == (128, 256) and w.dtype == torch.float16
