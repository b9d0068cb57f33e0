"""Loading EXL3 DSpark drafts: format detection, the predecessor's loader bug, one-line failures.

The predecessor's bug (exl3.md §5, local-inference-lab PR #474): a 5-layer EXL3 draft whose
``tensor_storage`` is keyed ``layers.0..4`` was looked up as ``layers.{start+i}`` (start = the target's
layer count), found nothing, and silently ran dense BF16 weights. Here the same checkpoint loads
quantized (asserted by module type and by weight bytes) for both variants, in either numbering;
metadata that matches neither numbering, misses a quantized module, or claims one the checkpoint
stores dense fails at start-up with one line. Checkpoints use random trellis bits (fast, valid).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models import CheckpointError, DSparkDrafter, load_drafter
from draft_server.models.exl3 import DenseLinear, Exl3Linear, FusedLinear, detect_format
from draft_server.models.exl3.decode import weight_fp16_like_exllamav3
from draft_server.models.tiny import make_tiny
from draft_tools.exl3_cpu import write_exl3_checkpoint
from protocol import GREEDY

LAYERS = 5
K3_START = 93  # target_num_hidden_layers: the draft's layers are 93..97 in the target's numbering
VARIANTS = {
    "k3": {"num_hidden_layers": LAYERS, "target_num_hidden_layers": K3_START},
    # dims that are multiples of 128, so the 4-bit weight bytes can be held to the 0.4x
    "qwen3": {
        "num_hidden_layers": LAYERS,
        "layer_types": ["full_attention"] * LAYERS,
        "hidden_size": 128,
        "target_hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 256,
    },
}
START = {"k3": K3_START, "qwen3": 6}  # Qwen3 (DeepSpec): num_target_layers is the target's layer count
PROJ = {
    "k3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    "qwen3": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
FUSED = {
    "k3": ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
    "qwen3": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("dense")
    return {v: tuple(make_tiny(v, str(root / v), **ov)) for v, ov in VARIANTS.items()}


def exl3(dense_dir: str, out: str, **kw: object) -> str:
    write_exl3_checkpoint(dense_dir, out, bits=4, codebook=str(kw.pop("codebook", "mul1")), encoder="random", **kw)
    return out


def load(draft: str, target: str) -> DSparkDrafter:
    return load_drafter(draft, target, "cpu", "float32", 1 << 20)


def load_err(draft: str, target: str) -> str:
    with pytest.raises(CheckpointError) as ei:
        load(draft, target)
    msg = str(ei.value)
    assert msg and "\n" not in msg
    return msg


def edit_storage(d: str, fn: Callable[[dict], object]) -> None:
    path = os.path.join(d, "quantization_config.json")
    with open(path) as f:
        q = json.load(f)
    fn(q["tensor_storage"])
    with open(path, "w") as f:
        json.dump(q, f)


def packed_bytes(d: str) -> int:
    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
        return sum(
            f.get_tensor(n).numel() * f.get_tensor(n).element_size()
            for n in f.keys()
            if n.rsplit(".", 1)[1] in ("trellis", "suh", "svh", "mcg", "mul1")
        )


def drafts(d: DSparkDrafter, rows: torch.Tensor) -> list[int]:
    assert d.reserve(1, 0, rows.shape[0] + d.contract.block_size)
    d.ingest([IngestItem(1, 0, 0, rows.to(torch.bfloat16).view(torch.int16).numpy().view("uint16"))])
    return d.draft([DraftItem(1, 0, rows.shape[0], 5, d.contract.block_size, GREEDY)])[0].tokens


# -- format detection --------------------------------------------------------------------------------


def test_format_detection(dense, tmp_path) -> None:
    draft, _ = dense["qwen3"]
    assert detect_format(draft).format == "dense"
    q = exl3(draft, str(tmp_path / "q"))
    info = detect_format(q)
    assert (info.format, info.source, info.quant["bits"]) == ("exl3", "quantization_config.json", 4.0)
    assert info.storage["layers.0.mlp.down_proj"].exl3 and not info.storage["norm"].exl3
    os.remove(os.path.join(q, "quantization_config.json"))  # HF EXL3 repos' main branch often lacks it
    assert detect_format(q).source == "config.json"
    with open(os.path.join(q, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(q, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = ["layers.0.mlp.down_proj.trellis"]
    assert (detect_format(q).format, detect_format(q, names).source) == ("dense", "tensors")  # exllamav3's own rule
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(q, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        detect_format(q)


# -- the predecessor's bug ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_five_layer_draft_keyed_layers_0_to_4_loads_quantized(dense, tmp_path, variant) -> None:
    draft, target = dense[variant]
    q = exl3(draft, str(tmp_path / "q"))
    keys = json.load(open(os.path.join(q, "quantization_config.json")))["tensor_storage"]
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {"0", "1", "2", "3", "4"}
    d = load(q, target)
    m = d.model
    fused, parts = FUSED[variant]
    for i in range(LAYERS):  # module types: every projection of every layer is EXL3, fused ones per source
        p = f"layers.{i}."
        gu = m.linears[p + "mlp.gate_up_proj.weight"]
        assert isinstance(gu, FusedLinear) and [type(s) for s in gu.parts] == [Exl3Linear, Exl3Linear]
        assert [s.key for s in gu.parts] == [p + "mlp.gate_proj", p + "mlp.up_proj"]
        qkv = m.linears[p + f"self_attn.{fused}.weight"]
        assert isinstance(qkv, FusedLinear) and [s.key for s in qkv.parts] == [p + "self_attn." + n for n in parts]
        assert all(isinstance(s, Exl3Linear) and s.K == 4 and s.codebook == "mul1" for s in qkv.parts)
        for name in ("self_attn.o_proj", "mlp.down_proj") + (
            ("self_attn.q_b_proj", "self_attn.kv_b_proj") if variant == "k3" else ()
        ):
            assert isinstance(m.linears[p + name + ".weight"], Exl3Linear)
    n_q = LAYERS * (len(PROJ[variant]) + 3)
    info = m.weight_info
    assert (info.format, info.bits, info.quantized, info.codebooks) == ("exl3", 4.0, n_q, ("mul1",))
    # weight bytes: exactly the packed tensors on disk plus the dense tensors at the runtime dtype
    q_numel = sum(
        lin.in_features * lin.out_features for lin in m.linears.values() for lin in getattr(lin, "parts", [lin])
    )
    assert info.weight_bytes - packed_bytes(q) == info.dense_bytes - 4 * q_numel
    # and the runtime's GEMM sites read the packed modules (route_linears), no dense copy beside them
    assert all(m.w[name] is lin for name, lin in m.linears.items() if name in m.w)
    assert all(m.gate_up[i] is m.linears[f"layers.{i}.mlp.gate_up_proj.weight"] for i in range(LAYERS))
    attn, kv_all = (m.qkv_a, m.kv_a_all) if variant == "k3" else (m.qkv, m.kv_w)
    assert all(attn[i] is m.linears[f"layers.{i}.self_attn.{fused}.weight"] for i in range(LAYERS))
    per_layer = 1 if variant == "k3" else 2  # kv_a, or k and v
    assert kv_all.parts == [s for i in range(LAYERS) for s in attn[i].parts[-per_layer:]]
    if variant == "qwen3":  # all dims 128-aligned: the bound on 4-bit weight bytes
        bf16 = 2 * q_numel
        assert packed_bytes(q) <= 0.4 * bf16, (packed_bytes(q), bf16)


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_target_numbering_on_either_side(dense, tmp_path, variant) -> None:
    """Tensors named model.layers.{start+i} with metadata keyed layers.0..4, and the reverse."""
    draft, target = dense[variant]
    base = load(exl3(draft, str(tmp_path / "base")), target)
    rows = torch.randn(6, base.contract.tap_width, generator=torch.Generator().manual_seed(0))
    want = drafts(base, rows)
    a = exl3(draft, str(tmp_path / "a"), tensor_prefix="model.", tensor_layer_offset=START[variant])
    b = exl3(draft, str(tmp_path / "b"), meta_prefix="model.", meta_layer_offset=START[variant])
    for q in (a, b):
        d = load(q, target)
        assert d.model.weight_info.quantized == base.model.weight_info.quantized
        assert drafts(d, rows) == want


@pytest.mark.parametrize("variant", ["k3", "qwen3"])
def test_metadata_in_neither_numbering_fails_in_one_line(dense, tmp_path, variant) -> None:
    draft, target = dense[variant]
    q = exl3(draft, str(tmp_path / "q"), meta_layer_offset=LAYERS)  # keyed layers.5..9
    s = START[variant]
    msg = load_err(q, target)
    assert "tensor_storage keys name layers 5..9" in msg and f"0..4, or {s}..{s + 4}" in msg


def test_metadata_missing_a_quantized_module_fails(dense, tmp_path) -> None:
    draft, target = dense["k3"]
    q = exl3(draft, str(tmp_path / "q"))
    edit_storage(q, lambda ts: ts.pop("layers.3.self_attn.kv_a_proj_with_mqa"))
    msg = load_err(q, target)
    assert "no EXL3 tensor_storage entry covers 'layers.3.self_attn.kv_a_proj_with_mqa.trellis'" in msg


def test_metadata_claims_exl3_for_a_dense_module_fails(dense, tmp_path) -> None:
    draft, target = dense["qwen3"]
    q = exl3(draft, str(tmp_path / "q"), modules=r"^layers\.\d+\.(self_attn|mlp)\.(?!down)[a-z_]+_proj$")

    def claim(ts: dict) -> None:
        ts["layers.2.mlp.down_proj"].update(quant_format="exl3", bits_per_weight=4, mul1_multiplier=0x83DCD12D)

    edit_storage(q, claim)
    msg = load_err(q, target)
    assert "'layers.2.mlp.down_proj' is EXL3 but the checkpoint holds dense 'layers.2.mlp.down_proj.weight'" in msg
    assert "would run dense" in msg


def test_mixed_dense_and_quantized_fused_sources(dense, tmp_path) -> None:
    """k_proj/v_proj left dense, q_proj EXL3: qkv_proj is a FusedLinear of one EXL3 and two dense sources."""
    draft, target = dense["qwen3"]
    q = exl3(draft, str(tmp_path / "q"), modules=r"^layers\.\d+\.(mlp\.[a-z_]+|self_attn\.[qo])_proj$")
    m = load(q, target).model
    qkv = m.linears["layers.1.self_attn.qkv_proj.weight"]
    assert [type(s) for s in qkv.parts] == [Exl3Linear, DenseLinear, DenseLinear]
    assert m.w["layers.1.self_attn.qkv_proj.weight"] is qkv and m.qkv[1] is qkv
    x = torch.randn(3, 128)
    dense = torch.cat([s.weight(torch.float32) if isinstance(s, Exl3Linear) else s.w for s in qkv.parts])
    assert torch.allclose(qkv(x), F.linear(x, dense), atol=1e-5)


def test_exl3_config_without_quantized_tensors_would_run_dense(dense, tmp_path) -> None:
    draft, target = dense["qwen3"]
    q = exl3(draft, str(tmp_path / "q"), modules=r"^nothing$")
    msg = load_err(q, target)
    assert "no quantized module" in msg and "would run dense" in msg


def test_bits_codebook_and_shape_mismatches_are_named(dense, tmp_path) -> None:
    draft, target = dense["qwen3"]
    q = exl3(draft, str(tmp_path / "bits"))
    edit_storage(q, lambda ts: ts["layers.0.mlp.up_proj"].update(bits_per_weight=3))
    assert "bits_per_weight 3, but its trellis holds K=4" in load_err(q, target)
    q = exl3(draft, str(tmp_path / "cb"))
    edit_storage(q, lambda ts: ts["layers.0.mlp.up_proj"].pop("mul1_multiplier"))
    assert "says codebook 3inst, the tensors say mul1" in load_err(q, target)
    q = exl3(draft, str(tmp_path / "shape"))
    path = os.path.join(q, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        t = {n: f.get_tensor(n) for n in f.keys()}
    t["layers.0.mlp.up_proj.trellis"] = t["layers.0.mlp.up_proj.trellis"].transpose(0, 1).contiguous()
    save_file(t, path)
    msg = load_err(q, target)
    assert "'layers.0.mlp.up_proj.trellis' has shape [16, 8, 64], expected [8, 16, 64]" in msg


# -- numerics of the modules --------------------------------------------------------------------------


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_layer_outputs_within_fp16_tolerance(codebook) -> None:
    """A linear's output against exllamav3's weight tensor (its fp16 rounding sequence) and in fp16 compute."""
    from draft_tools.exl3_cpu import random_linear

    t = random_linear(200, 300, 3, codebook, seed=1)  # both dims padded (to 256 / 384)
    lin = Exl3Linear("x", 300, 200, t["trellis"], t["suh"], t["svh"], codebook)
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ lin.exact_weight().t()
    w_ex = weight_fp16_like_exllamav3(lin.inner(), lin.suh, lin.svh)[:300, :200]
    y_ex = (x.half().float() @ w_ex.float()).double()
    tol = 2e-3 * ref.abs().max().item()
    assert (lin(x).double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (y_ex - ref).abs().max() < tol  # what exllamav3's reconstruct + hgemm path would compute
    assert (lin(x.half()).double() - ref).abs().max() < tol


def test_chunked_decode_equals_whole(monkeypatch) -> None:
    import draft_server.models.exl3.linear as linear_mod
    from draft_server.models.exl3.decode import decode_inner, dense_weight
    from draft_tools.exl3_cpu import random_linear

    t = random_linear(200, 300, 2, "mul1", seed=3)
    whole = dense_weight(decode_inner(t["trellis"], "mul1"), t["suh"], t["svh"])[:300, :200].t()
    monkeypatch.setattr(linear_mod, "DECODE_ROWS", 128)
    lin = Exl3Linear("x", 300, 200, t["trellis"], t["suh"], t["svh"], "mul1")
    assert torch.equal(lin.exact_weight(), whole)


def test_exl3_drafts_equal_dense_drafts_of_the_decoded_weights(dense, tmp_path) -> None:
    """The EXL3 path changes where the weights come from, nothing else."""
    draft, target = dense["k3"]
    q = exl3(draft, str(tmp_path / "q"), codebook="mcg")
    d = load(q, target)
    decoded = {**d.model.linears}
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(draft, "model.safetensors"), framework="pt") as f:
        for n in f.keys():
            tensors[n] = f.get_tensor(n)
    for lin in decoded.values():
        for s in getattr(lin, "parts", [lin]):
            tensors[s.key + ".weight"] = s.weight(torch.float32)
    dd = str(tmp_path / "dense")
    os.makedirs(dd)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dd, "model.safetensors"))
    with open(os.path.join(draft, "config.json")) as f, open(os.path.join(dd, "config.json"), "w") as g:
        g.write(f.read())
    rows = torch.randn(9, d.contract.tap_width, generator=torch.Generator().manual_seed(4))
    assert drafts(load(dd, target), rows) == drafts(d, rows)
    assert load(dd, target).model.weight_info.format == "dense"


def test_describe_and_metrics_report_format_bits_and_bytes(dense, tmp_path) -> None:
    from draft_server.app import _checkpoint_format, describe
    from draft_server.metrics import ServerMetrics

    draft, target = dense["qwen3"]
    q = exl3(draft, str(tmp_path / "q"))
    d = describe(load(q, target))
    assert (d["format"], d["bits"], d["codebooks"]) == ("exl3", 4.0, ("mul1",))
    assert _checkpoint_format(q) == "safetensors, exl3" and _checkpoint_format(draft) == "safetensors, bf16"
    m = ServerMetrics()
    m.set_weights(d)
    text = m.render().decode()
    assert 'draft_server_model_info{bits="4",codebooks="mul1",format="exl3"} 1.0' in text
    line = next(ln for ln in text.splitlines() if ln.startswith("draft_server_model_weight_bytes "))
    assert float(line.split()[1]) == d["weight_bytes"]
    dd = describe(load(draft, target))
    assert dd["format"] == "dense" and dd["bits"] == 32.0 and dd["weight_bytes"] > d["weight_bytes"]
