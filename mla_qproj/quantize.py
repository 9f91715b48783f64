"""The public quantizers: `mxfp8_quantize` (MXFP8, SPEC §2, §4) and `fp8_block_quantize` (block-scaled FP8,
SPEC §5)."""

from __future__ import annotations

import math

import torch

from . import backend as _backend
from ._config import BACKENDS, SCALE_MODES, validate_choice
from ._constants import FLOAT_DTYPES, MX_BLOCK
from .reference import fp8_block as ref8
from .reference import mxfp8 as ref
from .tensor import MXFP8Tensor

_IN_DTYPES = FLOAT_DTYPES


class _QuantizeSTE(torch.autograd.Function):
    """Straight-through: the gradient of the quantized tensor passes to the input unchanged."""

    @staticmethod
    def forward(ctx, t, rowwise, columnwise, scale_mode, kernels):
        x2d = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
        if kernels:
            from .kernels.triton.mxfp8_quant import mxfp8_quantize_2d_op

            rd, rs, cd, cs = mxfp8_quantize_2d_op(x2d, rowwise, columnwise, scale_mode)
        else:
            rd, rs = ref.quantize_rowwise(x2d, scale_mode) if rowwise else (None, None)
            cd, cs = ref.quantize_columnwise(x2d, scale_mode) if columnwise else (None, None)
        shape = t.shape
        return MXFP8Tensor(
            shape=shape, dtype=t.dtype, scale_mode=scale_mode,
            rowwise_data=rd.view(shape) if rowwise else None,
            rowwise_scale=rs.view(shape[:-1] + (shape[-1] // MX_BLOCK,)) if rowwise else None,
            columnwise_data=cd.view(shape) if columnwise else None,
            columnwise_scale=cs if columnwise else None,
        )

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, MXFP8Tensor):
            grad = grad.dequantize()
        return grad, None, None, None, None


def mxfp8_quantize(t: torch.Tensor, rowwise: bool = True, columnwise: bool = False, scale_mode: str = "rceil",
                   backend: str = "auto") -> MXFP8Tensor:
    """Quantize `t` to MXFP8 (E4M3 elements, one E8M0 byte per 32-block; SPEC §2).

    Args:
        t: float32 / bfloat16 / float16 tensor [..., N]; its 2-D view is t.reshape(-1, N) ([T, N]).
        rowwise: 32-blocks along the last dim (N must be a multiple of 32).
        columnwise: 32-blocks along T; the last block may be partial.
        scale_mode: "rceil" (default, TransformerEngine-compatible) or "floor" (OCP v1.0).
        backend: "auto" | "triton" | "torch" (see FusedMLAQUpProjection).
    Returns:
        MXFP8Tensor with `rowwise_data/rowwise_scale` ([..., N // 32]) and/or `columnwise_data/columnwise_scale`
        ([ceil(T / 32), N]); gradients pass straight through to `t`.
    Raises:
        TypeError for a non-tensor or unsupported dtype; ValueError for bad arguments or N % 32 != 0 (rowwise).
    Example:
        >>> q = mxfp8_quantize(torch.randn(64, 128), columnwise=True)
        >>> q.rowwise_scale.shape, q.columnwise_scale.shape
        (torch.Size([64, 4]), torch.Size([2, 128]))
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _IN_DTYPES:
        raise TypeError(f"t dtype must be one of {_IN_DTYPES}, got {t.dtype}")
    validate_choice("scale_mode", scale_mode, SCALE_MODES)
    validate_choice("backend", backend, BACKENDS)
    if not isinstance(rowwise, bool) or not isinstance(columnwise, bool):
        raise TypeError("rowwise and columnwise must be bools")
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise / columnwise must be True")
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension")
    if rowwise and t.shape[-1] % MX_BLOCK:
        raise ValueError(f"rowwise quantization needs the last dimension of t to be a multiple of {MX_BLOCK}, "
                         f"got {t.shape[-1]}")
    kernels = _backend.resolve_backend(backend, t.device)
    return _QuantizeSTE.apply(t, rowwise, columnwise, scale_mode, kernels)


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
        block_scale: "pow2" (default; TransformerEngine's default on Hopper), "fp32" (TransformerEngine's rule
            without power-of-two rounding) or "deepseek" (DeepSeek-V3's kernels: scale_inv = fp32(amax / 448)).
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
    bm, bn = ref8.check_block_shape(block_shape)
    ref8.check_block_scale(block_scale)
    validate_choice("backend", backend, BACKENDS)
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension")
    x2d = t.detach().reshape(math.prod(t.shape[:-1]), t.shape[-1])  # = reshape(-1, N), also for N == 0
    if _backend.resolve_backend(backend, t.device):
        from .kernels.triton.fp8_block_quant import fp8_block_quantize_op

        return fp8_block_quantize_op(x2d, bm, bn, block_scale)
    return ref8.quantize_blocks(x2d, (bm, bn), block_scale)
