"""mla_qproj: the Multi-head Latent Attention query path (RMSNorm -> query up-projection -> RoPE) as one fused layer,
in MXFP8, block-scaled FP8 (DeepSeek-V3) or bf16."""

from .module import FusedMLAQUpProjection
from .options import BF16, MXFP8, BF16Query, FP8Block, MXFP8Query
from .quantize import fp8_block_quantize, mxfp8_quantize
from .tensor import MXFP8Tensor

__version__ = "0.2.0"
__all__ = ["BF16", "BF16Query", "FP8Block", "FusedMLAQUpProjection", "MXFP8", "MXFP8Query", "MXFP8Tensor",
           "fp8_block_quantize", "mxfp8_quantize", "__version__"]
