"""The Triton launches registered as `torch.library` custom ops (with fake implementations), so that the
layer can be traced by `torch.compile(fullgraph=True)` and captured in CUDA graphs: no host syncs, output
shapes depend on input shapes only. Absent outputs are empty tensors (custom ops return no None)."""

from __future__ import annotations

import torch

from ._constants import MX_BLOCK
from .kernels._common import cdiv
from .kernels.mxfp8_quant import dequantize_columnwise_bf16, mxfp8_quant_2d
from .kernels.qproj_gemm import qproj_gemm_fp8_fwd_op, qproj_gemm_fwd_op  # noqa: F401  (registered there)
from .kernels.rmsnorm_bwd import rmsnorm_bwd
from .kernels.rmsnorm_quant import rmsnorm_quant_fwd
from .kernels.rope_quant import rope_quant

Tensor = torch.Tensor


def _eager_fast(op, impl, eager=None):
    """Call the registered op while torch.compile traces, the launcher directly in eager mode (`eager` if given,
    else the op's implementation): the custom-op dispatch costs tens of microseconds per call, which shows at
    small T."""
    eager = impl if eager is None else eager

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return eager(*args)

    call.op = op
    return call
_F8 = torch.float8_e4m3fn


def _mxfp8_quantize_2d_impl(x2d: Tensor, rowwise: bool, columnwise: bool, scale_mode: str) -> tuple[
        Tensor, Tensor, Tensor, Tensor]:
    return mxfp8_quant_2d(x2d, rowwise, columnwise, scale_mode)


_mxfp8_quantize_2d_def = torch.library.custom_op(
    "mla_qproj::mxfp8_quantize_2d", _mxfp8_quantize_2d_impl, mutates_args=())
mxfp8_quantize_2d_op = _eager_fast(_mxfp8_quantize_2d_def, _mxfp8_quantize_2d_impl)


@_mxfp8_quantize_2d_def.register_fake
def _(x2d, rowwise, columnwise, scale_mode):
    T, N = x2d.shape
    e = x2d.new_empty
    return (e((T, N) if rowwise else (0,), dtype=_F8), e((T, N // MX_BLOCK) if rowwise else (0,), dtype=torch.uint8),
            e((T, N) if columnwise else (0,), dtype=_F8),
            e((cdiv(T, MX_BLOCK), N) if columnwise else (0,), dtype=torch.uint8))


def _dequantize_columnwise_bf16_impl(data: Tensor, scale: Tensor) -> Tensor:
    return dequantize_columnwise_bf16(data, scale)


_dequant_col_def = torch.library.custom_op(
    "mla_qproj::dequantize_columnwise_bf16", _dequantize_columnwise_bf16_impl, mutates_args=())
dequantize_columnwise_bf16_op = _eager_fast(_dequant_col_def, _dequantize_columnwise_bf16_impl)


@_dequant_col_def.register_fake
def _(data, scale):
    return data.new_empty(data.shape, dtype=torch.bfloat16)


def _rmsnorm_quant_fwd_impl(x2d: Tensor, norm_weight: Tensor, eps: float, zero_centered_gamma: bool, precision: str,
                         scale_mode: str, columnwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return rmsnorm_quant_fwd(x2d, norm_weight, eps, zero_centered_gamma, precision, scale_mode, columnwise)


_rmsnorm_quant_fwd_def = torch.library.custom_op(
    "mla_qproj::rmsnorm_quant_fwd", _rmsnorm_quant_fwd_impl, mutates_args=())
rmsnorm_quant_fwd_op = _eager_fast(_rmsnorm_quant_fwd_def, _rmsnorm_quant_fwd_impl)


@_rmsnorm_quant_fwd_def.register_fake
def _(x2d, norm_weight, eps, zero_centered_gamma, precision, scale_mode, columnwise):
    T, K = x2d.shape
    mx = precision == "mxfp8" and columnwise
    e = x2d.new_empty
    return (e((T,), dtype=torch.float32), e((T, K), dtype=torch.bfloat16), e((T, K) if mx else (0,), dtype=_F8),
            e((cdiv(T, MX_BLOCK), K) if mx else (0,), dtype=torch.uint8))


def _rope_quant_impl(y2d: Tensor, cos_h: Tensor, sin_h: Tensor, num_heads: int, head_dim: int, qk_head_dim: int,
                  rope_dim: int, rope_style: str, inverse: bool, mode: str, columnwise: bool,
                  scale_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Always four outputs: (out, row scale, col data/image, col scale); see kernels.rope_quant."""
    outs = rope_quant(y2d, cos_h, sin_h, num_heads=num_heads, head_dim=head_dim, qk_head_dim=qk_head_dim,
                      rope_dim=rope_dim, rope_style=rope_style, inverse=inverse, mode=mode, columnwise=columnwise,
                      scale_mode=scale_mode)
    if mode == "mxfp8":
        return outs
    empty = y2d.new_empty((0,), dtype=torch.uint8)
    col = outs[1] if mode == "mxfp8_images" else y2d.new_empty((0,), dtype=torch.bfloat16)
    return outs[0], empty, col, empty.clone()


_rope_quant_def = torch.library.custom_op("mla_qproj::rope_quant", _rope_quant_impl, mutates_args=())
rope_quant_op = _eager_fast(_rope_quant_def, _rope_quant_impl)


@_rope_quant_def.register_fake
def _(y2d, cos_h, sin_h, num_heads, head_dim, qk_head_dim, rope_dim, rope_style, inverse, mode, columnwise,
      scale_mode):
    T, N = y2d.shape
    e = y2d.new_empty
    u8 = torch.uint8
    if mode == "mxfp8":
        return (e((T, N), dtype=_F8), e((T, N // MX_BLOCK), dtype=u8), e((T, N) if columnwise else (0,), dtype=_F8),
                e((cdiv(T, MX_BLOCK), N) if columnwise else (0,), dtype=u8))
    out_dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    col = e((T, N) if (mode == "mxfp8_images" and columnwise) else (0,), dtype=torch.bfloat16)
    return e((T, N), dtype=out_dtype), e((0,), dtype=u8), col, e((0,), dtype=u8)


def _rmsnorm_bwd_impl(dxn: Tensor, x2d: Tensor, rsigma: Tensor, norm_weight: Tensor,
                   zero_centered_gamma: bool) -> tuple[Tensor, Tensor]:
    return rmsnorm_bwd(dxn, x2d, rsigma, norm_weight, zero_centered_gamma)


_rmsnorm_bwd_def = torch.library.custom_op("mla_qproj::rmsnorm_bwd", _rmsnorm_bwd_impl, mutates_args=())
rmsnorm_bwd_op = _eager_fast(_rmsnorm_bwd_def, _rmsnorm_bwd_impl)


@_rmsnorm_bwd_def.register_fake
def _(dxn, x2d, rsigma, norm_weight, zero_centered_gamma):
    return torch.empty_like(x2d), torch.empty_like(norm_weight)
