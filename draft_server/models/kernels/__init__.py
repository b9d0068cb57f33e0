"""GPU kernels for the draft models (Triton).

Owns the hand-written kernels the model code calls on CUDA: the DSpark draft-block attention over
the paged KV cache (``paged_attention``: MLA absorbed form and GQA, split-K over the context,
CUDA-graph friendly), FlashMLA's Hopper decode kernel behind our binding (``flash_mla`` and its
``flash_mla.cu``, shipped as package data and built at run time), the fused element-wise kernels,
the skinny GEMM and the EXL3 GEMM; ``prebuilt`` finds a compiled extension built earlier. Importing
this package does not import Triton; the kernel modules do.
"""
