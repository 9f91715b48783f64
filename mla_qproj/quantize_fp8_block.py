"""`fp8_block_quantize`: the public block-scaled FP8 quantizer (SPEC §5)."""

from __future__ import annotations

import math

import torch

from . import backend as _backend
from ._config import BACKENDS, validate_choice
from .reference import fp8_block as ref

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_block_quantize(t: torch.Tensor, block_shape: tuple[int, int] = (1, 128), block_scale: str = "pow2",
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `t` to block-scaled FP8 (E4M3 elements, one fp32 scale per block of 128; SPEC §5).

    Per block: amax = max |x| (NaN ignored; a partial edge block's amax is over the elements that exist);
    scale = fp32(448 / amax) (1.0 for amax 0, NaN or inf; FLT_MAX on overflow), rounded down to a power of two for
    block_scale="pow2"; code = E4M3(x * scale) (round to nearest even, saturated to ±448, NaN sign and the sign of
    zero kept); scale_inv = 1 / scale, so that the decoded value is code * scale_inv.

    Args:
        t: float32 / bfloat16 / float16 tensor [..., N] (at least 1-D, any strides), viewed as the 2-D
            [M, N] = t.reshape(-1, N).
        block_shape: (1, 128) (1x128 along N), (128, 1) (128x1 along M) or (128, 128) (tiles).
        block_scale: "pow2" (default; TransformerEngine's default on Hopper) or "fp32" (DeepSeek-V3's original).
        backend: "auto" (Triton on CUDA tensors and under TRITON_INTERPRET=1, else PyTorch) | "triton" | "torch".
    Returns:
        (data, scale_inv): float8_e4m3fn [M, N] and float32 [ceil(M / bm), ceil(N / bn)], contiguous; the two
        backends give the same bytes.
    Raises:
        TypeError: t is not a tensor, or its dtype is not float32 / bfloat16 / float16.
        ValueError: unknown block_shape, block_scale or backend; t is 0-dim; backend="triton" without CUDA tensors
            or TRITON_INTERPRET=1.
    Example:
        >>> data, scale_inv = fp8_block_quantize(torch.randn(4, 300), block_shape=(1, 128))
        >>> data.shape, data.dtype, scale_inv.shape
        (torch.Size([4, 300]), torch.float8_e4m3fn, torch.Size([4, 3]))
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _IN_DTYPES:
        raise TypeError(f"t dtype must be one of {_IN_DTYPES}, got {t.dtype}")
    bm, bn = ref.check_block_shape(block_shape)
    ref.check_block_scale(block_scale)
    validate_choice("backend", backend, BACKENDS)
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension")
    x2d = t.detach().reshape(math.prod(t.shape[:-1]), t.shape[-1])  # = reshape(-1, N), also for N == 0
    if _backend.resolve_backend(backend, t.device):
        from .kernels.fp8_block_quant import fp8_block_quantize_op

        return fp8_block_quantize_op(x2d, bm, bn, block_scale)
    return ref.quantize_blocks(x2d, (bm, bn), block_scale)
