"""The Triton EXL3 decode-GEMM and decode (``kernels/exl3_gemm.py``) under Triton's interpreter, against the decoder.

``exl3.decode.decode_inner`` is bit-exact with exllamav3's ``reconstruct`` on every GPU golden
(``test_exl3_golden``). Here the kernel's in-register decode must give the same fp16 weights bit for
bit (an identity input makes ``C = Wq`` exactly: one fp16 product per output, accumulated in fp32),
on every golden's trellis (all three codebooks, K = 1..8, several shapes) and on random trellises,
and its products on real inputs must equal ``A @ Wq`` up to the fp32 summation order; so must the
lane-order decode into a scratch (``exl3_decode``, K in 1, 2, 4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from draft_server.models.exl3.decode import CODEBOOKS, decode_inner, had_right
from draft_server.models.kernels.exl3_gemm import LANE_BITS, exl3_decode, exl3_matmul, hadamard_128, hadamard_swiglu
from draft_server.models.kernels.fused import silu_mul_parts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exl3"
GOLDENS = sorted(FIXTURES.glob("gpu_*.safetensors"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (tests/conftest.py)


def _golden(path: Path) -> tuple[torch.Tensor, str]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return f.get_tensor("trellis"), meta["codebook"]


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_in_register_decode_is_bit_exact_on_every_golden(path: Path) -> None:
    trellis, codebook = _golden(path)
    k = trellis.shape[0] * 16
    t = trellis.contiguous().to(DEV)
    wq = decode_inner(trellis, codebook)
    w = exl3_matmul(torch.eye(k, dtype=torch.float16, device=DEV), t, codebook)
    assert torch.equal(w.cpu(), wq.float())
    if trellis.shape[2] // 16 in LANE_BITS and k % 64 == 0 and trellis.shape[1] % 4 == 0:
        assert torch.equal(exl3_decode(t, codebook, trans=True).cpu(), wq.t())


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_random_trellis_products(codebook: str, bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    trellis = torch.randint(-(1 << 15), 1 << 15, (16, 8, 16 * bits), dtype=torch.int16, generator=g)
    wq = decode_inner(trellis, codebook)
    t = trellis.to(DEV)
    assert torch.equal(exl3_matmul(torch.eye(256, dtype=torch.float16, device=DEV), t, codebook).cpu(), wq.float())
    for rows in (1, 7, 33):  # one block, a partial block, two blocks of rows
        a = torch.randn(rows, 256, generator=g).half()
        want = a.double() @ wq.double()
        got = exl3_matmul(a.to(DEV), t, codebook).cpu()
        assert got.shape == (rows, 128) and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    if bits in LANE_BITS:  # into a scratch, both orientations, any block that divides the weight
        scratch = torch.full((128, 256), float("nan"), dtype=torch.float16, device=DEV)
        assert exl3_decode(t, codebook, out=scratch, trans=True) is scratch
        assert torch.equal(scratch.cpu(), wq.t())
        assert torch.equal(exl3_decode(t, codebook, block=32).cpu(), wq)
    else:
        with pytest.raises(ValueError, match="decode kernel"):
            exl3_decode(t, codebook)


@pytest.mark.parametrize("block_m, split_k", [(16, 2), (32, 4), (128, 1)])
def test_k_splits_and_row_blocks_give_the_same_products(block_m: int, split_k: int) -> None:
    """Splits of k sum their float32 partials in a fixed order: deterministic, and equal to one
    program's walk up to the summation order; every row block decodes the same weights."""
    g = torch.Generator().manual_seed(block_m + split_k)
    trellis = torch.randint(-(1 << 15), 1 << 15, (32, 8, 64), dtype=torch.int16, generator=g).to(DEV)
    a = torch.randn(40, 512, generator=g).half().to(DEV)
    one = exl3_matmul(a, trellis, "mcg", block_m=16, split_k=1)
    got = exl3_matmul(a, trellis, "mcg", block_m=block_m, split_k=split_k)
    assert torch.equal(got, exl3_matmul(a, trellis, "mcg", block_m=block_m, split_k=split_k))
    torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5 * one.abs().max().item())
    with pytest.raises(ValueError, match="split_k"):
        exl3_matmul(a, trellis, "mcg", split_k=3)


def test_bad_arguments_are_refused() -> None:
    t = torch.zeros(8, 8, 64, dtype=torch.int16)
    a = torch.zeros(2, 128, dtype=torch.float16)
    for bad_a, bad_t, cb, match in (
        (a.float(), t, "mcg", "fp16"),
        (a, t.int(), "mcg", "int16"),
        (a, t[..., :40].contiguous(), "mcg", "16 \\* K"),
        (torch.zeros(2, 64, dtype=torch.float16), t, "mcg", "columns"),
        (a, t, "nope", "codebook"),
    ):
        with pytest.raises(ValueError, match=match):
            exl3_matmul(bad_a, bad_t, cb)
    assert exl3_matmul(a[:0], t, "3inst").shape == (0, 128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 40, 70])
def test_hadamard_rotation_equals_the_exact_one(dtype: torch.dtype, rows: int) -> None:
    """``hadamard_128``: y = H128(x * pre) * post per 128-column block (exllamav3's ``had_r_128``): fp32 in and
    out within 1e-6 of float64 (two fp16 products with the +-1 matrix keep about 22 bits), fp16 within its
    rounding; in place equals out of place; without scales, the bare rotation."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 384, generator=g) * 3).to(dtype)
    pre = torch.where(torch.rand(384, generator=g) < 0.5, -1.5, 1.5).half()
    post = (torch.rand(384, generator=g) + 0.5).half()
    want = had_right(x.double() * pre.double()) * post.double()
    y = hadamard_128(x.to(DEV), pre.to(DEV), post.to(DEV)).cpu()
    assert y.dtype == dtype
    rel = 1e-6 if dtype == torch.float32 else 2**-11
    assert (y.double() - want).abs().max() <= rel * want.abs().max()
    inplace = x.clone().to(DEV)
    assert hadamard_128(inplace, pre.to(DEV), post.to(DEV), out=inplace) is inplace
    assert torch.equal(inplace.cpu(), y)
    bare = hadamard_128(x.to(DEV)).cpu().double()
    assert (bare - had_right(x.double())).abs().max() <= rel * 4 * x.double().abs().max()
    with pytest.raises(ValueError, match="scale vectors"):
        hadamard_128(x.to(DEV), pre[:128].to(DEV))


@pytest.mark.parametrize("width", [384, 300])
def test_hadamard_reads_bf16_and_writes_the_padded_fp16_input(width: int) -> None:
    """The EXL3 input in one pass: bf16 rows of any width, zero-extended to the 128-multiple, rotated with
    suh and stored as fp16: the same bits as converting to fp16, padding, then rotating."""
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(9, width, generator=g) * 3).to(torch.bfloat16)
    pre = torch.where(torch.rand(384, generator=g) < 0.5, -1.0, 1.0).half()
    y = hadamard_128(x.to(DEV), pre.to(DEV), dtype=torch.float16).cpu()
    assert y.shape == (9, 384) and y.dtype == torch.float16
    padded = torch.nn.functional.pad(x.half(), (0, 384 - width))
    assert torch.equal(y, hadamard_128(padded.to(DEV), pre.to(DEV)).cpu())
    want = had_right(padded.double() * pre.double())
    assert (y.double() - want).abs().max() <= 2**-11 * want.abs().max()
    with pytest.raises(ValueError, match="out must be"):
        hadamard_128(x.to(DEV), out=torch.empty(9, width + 1, dtype=torch.float16, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_output_rotation_with_the_residual_add_rounds_once(dtype: torch.dtype) -> None:
    """``add``: h + H128(c) * post in float32, rounded once into h's dtype: the same bits as the fp32 rotation
    added to h in float32 and rounded; within bf16's rounding of the float64 sum."""
    g = torch.Generator().manual_seed(5)
    c = (torch.randn(11, 256, generator=g) * 4).to(dtype)
    h = torch.randn(11, 256, generator=g).to(torch.bfloat16)
    post = (torch.rand(256, generator=g) + 0.5).half()
    y = hadamard_128(c.to(DEV), post=post.to(DEV), add=h.to(DEV), dtype=torch.bfloat16).cpu()
    rotated = hadamard_128(c.float().to(DEV), post=post.to(DEV)).cpu()
    total = rotated + h.float()  # float32, as the kernel sums before its one rounding
    assert y.dtype == torch.bfloat16
    if DEV == "cuda":
        assert torch.equal(y, total.to(torch.bfloat16))
    else:  # the interpreter's cast to bf16 truncates: one bf16 step of the float32 sum, toward zero
        assert ((y.float() - total).abs() <= total.abs() * 2**-7).all() and (y.float().abs() <= total.abs()).all()
    want = had_right(c.double()) * post.double() + h.double()
    assert (y.double() - want).abs().max() <= 2**-7 * want.abs().max()
    with pytest.raises(ValueError, match="add must be"):
        hadamard_128(c.to(DEV), add=h[:, :128].contiguous().to(DEV))


@pytest.mark.parametrize("rows", [3, 40])
def test_rotated_swiglu_equals_rotating_then_the_activation(rows: int) -> None:
    """``hadamard_swiglu``: both output rotations and silu(gate) * up in one pass, bit for bit what rotating
    each product (float32) and then ``silu_mul_parts`` give (each rounded to bf16 first)."""
    g = torch.Generator().manual_seed(rows)
    gate, up = ((torch.randn(rows, 384, generator=g) * 3).to(DEV) for _ in range(2))
    pg, pu = ((torch.rand(384, generator=g) + 0.5).half().to(DEV) for _ in range(2))
    y = hadamard_swiglu(gate, up, pg, pu, torch.bfloat16).cpu()
    want = silu_mul_parts(hadamard_128(gate, post=pg), hadamard_128(up, post=pu), torch.bfloat16).cpu()
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    exact = (
        F.silu(had_right(gate.cpu().double()) * pg.cpu().double()) * had_right(up.cpu().double()) * pu.cpu().double()
    )
    assert (y.double() - exact).abs().max() <= 2**-5 * exact.abs().max()  # three bf16 roundings
    with pytest.raises(ValueError, match="gate and up"):
        hadamard_swiglu(gate, up[:, :256].contiguous(), pg, pu, torch.bfloat16)


def test_rotations_sum_k_split_partials_in_order() -> None:
    """[S, R, w] partials (``exl3_matmul(partials=True)``): the rotations read their in-order float32 sum, so
    they give the bits of rotating that sum (no reduction kernel); gate and up may have different S."""
    g = torch.Generator().manual_seed(6)
    parts = (torch.randn(3, 5, 256, generator=g) * 2).to(DEV)
    total = parts[0] + parts[1] + parts[2]
    post = (torch.rand(256, generator=g) + 0.5).half().to(DEV)
    assert torch.equal(hadamard_128(parts, post=post), hadamard_128(total, post=post))
    h = torch.randn(5, 256, generator=g).to(torch.bfloat16).to(DEV)
    assert torch.equal(hadamard_128(parts, post=post, add=h, dtype=torch.bfloat16),
                       hadamard_128(total, post=post, add=h, dtype=torch.bfloat16))  # fmt: skip
    up = (torch.randn(2, 5, 256, generator=g) * 2).to(DEV)
    assert torch.equal(hadamard_swiglu(parts, up, post, post, torch.bfloat16),
                       hadamard_swiglu(total, up[0] + up[1], post, post, torch.bfloat16))  # fmt: skip
    a = torch.randn(5, 256, generator=g).half().to(DEV)
    trellis = torch.randint(-(1 << 15), 1 << 15, (16, 16, 64), dtype=torch.int16, generator=g).to(DEV)
    split = exl3_matmul(a, trellis, "3inst", split_k=2, partials=True)
    assert split.shape == (2, 5, 256)
    assert torch.equal(hadamard_128(split), hadamard_128(split[0] + split[1]))
    with pytest.raises(ValueError, match="gate and up"):
        hadamard_swiglu(parts, up[:, :4], post, post, torch.bfloat16)


def test_hadamard_over_many_column_blocks_per_program() -> None:
    """Wide rows (k >= 16384) take four 128-column blocks a program; a last program with fewer is masked."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 128 * 130, generator=g)
    post = (torch.rand(128 * 130, generator=g) + 0.5).half()
    want = had_right(x.double()) * post.double()
    y = hadamard_128(x.to(DEV), post=post.to(DEV)).cpu()
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
