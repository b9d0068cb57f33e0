"""DSpark draft models for the draft server (PyTorch; CPU for tests, CUDA for real).

Files: ``config`` (config.json parsing, flags, contract, expected tensor shapes), ``weights``
(safetensors checkpoints, validation, target head), ``kv_cache`` (paged draft KV),
``ops`` (norm, RoPE, attention), ``model`` (shared backbone), ``qwen3`` (GQA attention),
``k3_mla`` (MLA attention), ``sampling`` (Markov / confidence heads, seeded sampling),
``backend`` (``DSparkDrafter``, ``load_drafter``), ``tiny`` (``make_tiny``).
"""

from draft_server.models.backend import DSparkDrafter, load_drafter
from draft_server.models.config import CheckpointError, DSparkConfig, load_config, parse_config

__all__ = ["CheckpointError", "DSparkConfig", "DSparkDrafter", "load_config", "load_drafter", "parse_config"]
