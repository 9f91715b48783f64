"""mla_qproj: fused RMSNorm + MXFP8 query up-projection + RoPE for Multi-head Latent Attention."""

from .module import FusedMLAQUpProjection
from .quantize import mxfp8_quantize
from .tensor import MXFP8Tensor

__version__ = "0.1.0"
__all__ = ["FusedMLAQUpProjection", "MXFP8Tensor", "mxfp8_quantize", "__version__"]
