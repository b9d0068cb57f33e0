"""DSpark draft models for the draft server (PyTorch; CPU for tests, CUDA for real).

``config`` (config.json, flags, contract, tensor shapes), ``weights`` (safetensors, validation,
target head), ``loader`` (checkpoint / random preset -> ``DSparkDrafter``), ``presets``
(full-size random configs), ``tiny`` (``make_tiny`` test checkpoints), ``drafter`` (the
``Drafter`` adapter), ``staging`` (wire rows to the device, per wire format), ``model`` (the shared backbone),
``layers/`` (``ops``, ``mla`` for K3, ``gqa`` for Qwen3), ``kv_cache`` (paged draft KV),
``sampling`` (Markov and confidence heads, seeded sampling).
"""

from draft_server.models.config import CheckpointError, DSparkConfig, load_config, parse_config
from draft_server.models.drafter import DSparkDrafter
from draft_server.models.loader import load_drafter
from draft_server.models.presets import load_preset

__all__ = [
    "CheckpointError",
    "DSparkConfig",
    "DSparkDrafter",
    "load_config",
    "load_drafter",
    "load_preset",
    "parse_config",
]
