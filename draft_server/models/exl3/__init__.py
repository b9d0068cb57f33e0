"""EXL3 (exllamav3) quantized drafters: format detection, a bit-exact pure-torch decoder, linears.

``format`` (what marks a checkpoint EXL3, ``tensor_storage`` metadata, layer-key normalisation),
``decode`` (codebooks, trellis tiles, Hadamard: bit-exact with exllamav3's CUDA ``reconstruct``),
``linear`` (``Exl3Linear`` / ``FusedLinear`` and the backend seam: CPU dequantize-then-GEMM today,
exllamav3's ``exl3_gemm`` on CUDA later), ``checkpoint`` (an EXL3 checkpoint under the dense names the
model code uses, with every start-up check).
"""

from draft_server.models.exl3.checkpoint import Exl3Checkpoint, WeightInfo, attach_linears
from draft_server.models.exl3.format import FormatInfo, detect_format
from draft_server.models.exl3.linear import DenseLinear, Exl3Linear, FusedLinear, set_backend

__all__ = [
    "DenseLinear",
    "Exl3Checkpoint",
    "Exl3Linear",
    "FormatInfo",
    "FusedLinear",
    "WeightInfo",
    "attach_linears",
    "detect_format",
    "set_backend",
]
