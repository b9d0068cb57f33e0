"""Loading a drafter: device and dtype names, a DSpark checkpoint (``load_drafter``) and the
variant dispatch (``build_model``)."""

from __future__ import annotations

import torch

from draft_server.models.config import K3, CheckpointError, DSparkConfig, load_config
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.exl3 import Exl3Checkpoint, WeightInfo, attach_linears, detect_format, set_backend
from draft_server.models.exl3.cuda import (
    ENV_FUSED_MAX_ROWS,
    ENV_LARGE,
    Exl3Backend,
    Exl3Unavailable,
    fused_max_rows_from_env,
    large_path_from_env,
)
from draft_server.models.exl3.linear import DequantBackend
from draft_server.models.kv_cache import PagedKVCache
from draft_server.models.layers.gqa import Qwen3DSpark
from draft_server.models.layers.mla import K3DSpark
from draft_server.models.model import DSparkModel
from draft_server.models.staging import torch_projection_id
from draft_server.models.weights import Checkpoint, load_target_head, validate_draft

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on the CPU."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype '{dtype}' is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _exl3_backend(model_dir: str, dev: torch.device) -> Exl3Backend | DequantBackend:
    """CUDA: ``Exl3Backend`` (``DRAFT_EXL3_FUSED_MAX_ROWS``, ``DRAFT_EXL3_LARGE``); CPU: decode once + GEMM."""
    if dev.type != "cuda":
        return DequantBackend()
    try:
        return Exl3Backend(fused_max_rows_from_env(), large=large_path_from_env())
    except Exl3Unavailable as e:
        ours = f"{ENV_FUSED_MAX_ROWS}=0 with {ENV_LARGE}=inline (packed, our Triton kernels) or =dense runs it without"
        raise CheckpointError(f"{model_dir}: EXL3 on CUDA: {e} ({ours})") from None


def build_model(cfg: DSparkConfig, w: dict[str, torch.Tensor], dev: torch.device, dtype: torch.dtype) -> DSparkModel:
    return (K3DSpark if cfg.variant == K3 else Qwen3DSpark)(cfg, w, dev, dtype)


def load_drafter(
    model_dir: str,
    target_model_dir: str | None,
    device: str = "cpu",
    dtype: str = "bf16",
    kv_budget_bytes: int | None = None,
    *,
    page_size: int | None = None,
    sts_temperatures: list[float] | None = None,
    attention: str = "auto",
    block_width: str = "k",
) -> DSparkDrafter:
    """Load a DSpark draft checkpoint (+ the target's lm_head / embedding) as a Drafter.

    Everything is validated before any tensor is read: config flags, every tensor's name and
    shape, the target head's shape. Failures raise ``CheckpointError`` with one clear line.
    """
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype, dev)
    cfg = load_config(model_dir)
    page_bytes = PagedKVCache.bytes_per_token(cfg.num_layers, cfg.kv_token_shape, tdtype) * (page_size or 16)
    if kv_budget_bytes is not None and kv_budget_bytes < page_bytes:
        raise CheckpointError(f"kv_budget_bytes {kv_budget_bytes} is below one KV page ({page_bytes} bytes)")
    ck = Checkpoint(model_dir)
    fmt = detect_format(model_dir, ck.names())
    if fmt.exl3:  # quantized modules appear under their dense names, decoded at load
        ck = Exl3Checkpoint(ck, cfg, fmt)
    names = validate_draft(ck, cfg)
    # Which embedding / lm_head, as vLLM 0.32 does it: K3 drops the draft's frozen copies and
    # uses the target's (its weight mapper maps them to None); Qwen3 DSpark keeps the draft's own
    # when present (has_own_embed_tokens / has_own_lm_head) and takes the rest from the target.
    if cfg.variant == K3 and target_model_dir is not None:
        names = [n for n in names if n not in ("embed_tokens.weight", "lm_head.weight")]
    need_head = "lm_head.weight" not in names
    need_embed = "embed_tokens.weight" not in names
    if target_model_dir is None:
        if need_head or need_embed:
            what = "lm_head.weight" if need_head else "embed_tokens.weight"
            raise CheckpointError(f"{model_dir}: the draft has no {what}; pass the target model directory")
        target = {}
    else:  # the target head is shape-checked against the config even when the draft has its own
        target = load_target_head(target_model_dir, cfg, need_head, need_embed)
    raw = ck.load(names, dev) if isinstance(ck, Exl3Checkpoint) else ck.load(names)  # EXL3: decoded on the device
    raw.update(target)
    proj, norm = (
        ("context_proj.weight", "context_norm.weight") if cfg.variant == K3 else ("fc.weight", "hidden_norm.weight")
    )
    projection_id = torch_projection_id(raw[proj], raw[norm], cfg.rms_norm_eps)  # as stored, as clients read it
    w: dict[str, torch.Tensor] = {}
    acc = torch.float64 if tdtype == torch.float64 else torch.float32
    for name, t in raw.items():
        if name == "d2t":
            w[name] = t.to(dev, torch.int64)
        elif name.startswith("confidence_head"):
            w[name] = t.to(dev, acc)
        else:
            w[name] = t.to(dev, tdtype)
    given = dict(w)  # the model pops the sources of the projections it stacks
    model = build_model(cfg, w, dev, tdtype)
    if isinstance(ck, Exl3Checkpoint):
        attach_linears(model, ck, given)
        set_backend(_exl3_backend(model_dir, dev))
        for lin in ck.linears.values():
            lin.to(dev)
        model.route_linears()
    else:
        nbytes = sum(t.numel() * t.element_size() for t in given.values())
        model.weight_info = WeightInfo("dense", 8.0 * torch.empty((), dtype=tdtype).element_size(), nbytes, nbytes)
    return DSparkDrafter(
        model,
        kv_budget_bytes,
        page_size=page_size,
        sts_temperatures=sts_temperatures,
        attention=attention,
        projection_id=projection_id,
        block_width=block_width,
    )
