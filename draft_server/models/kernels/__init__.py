"""GPU kernels for the draft models (Triton).

Owns the hand-written kernels the model code calls on CUDA: today the DSpark draft-block attention
over the paged KV cache (``paged_attention``: MLA absorbed form and GQA, split-K over the context,
CUDA-graph friendly). Importing this package does not import Triton; the kernel module does.
"""
