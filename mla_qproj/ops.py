"""The fused GEMM's launches registered as `torch.library` custom ops (with fake implementations), so that the
layer can be traced by `torch.compile(fullgraph=True)` and captured in CUDA graphs. The other ops live in their
kernel files (kernels/mxfp8_quant.py, rmsnorm_quant.py, rope_quant.py, rmsnorm_bwd.py, fp8_block_quant.py), each
registered through `kernels._op.define_op`."""

from __future__ import annotations

import functools

import torch

from ._config import QProjConfig
from .kernels._op import eager_fast

Tensor = torch.Tensor


def _eager_fast(op, impl, eager=None):
    """`kernels._op.eager_fast` with the eager callable defaulting to the op's implementation."""
    return eager_fast(op, impl if eager is None else eager)


@functools.lru_cache(maxsize=64)
def _gemm_cfg(K, H, nope, R, D, style, output_format, columnwise, scale_mode) -> QProjConfig:
    return QProjConfig.make(K, H, nope, R, D, rope_style=style, output_format=output_format,
                            columnwise_output=columnwise, scale_mode=scale_mode)


def _prepare_fused_weight_impl(w_bf16: Tensor, num_heads: int, qk_head_dim: int, rope_dim: int, head_dim: int,
                               rope_style: str, output_format: str) -> Tensor:
    """W [H·D, K] bf16 -> the fused GEMM's row order (kernels.qproj_gemm.prepare_fused_weight). The layout
    depends on the geometry, the rope style and the output format only. An op, so that torch.compile does not
    trace the layout's host code (a cached index map)."""
    from .kernels.qproj_gemm import prepare_fused_weight

    cfg = _gemm_cfg(w_bf16.shape[1], num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, False,
                    "rceil")
    return prepare_fused_weight(w_bf16, cfg)


# cudagraph_unsafe: the layout's index map is built on the host and copied to the device at every call, which a
# CUDA graph cannot capture (compile's cudagraph mode then leaves the graph uncaptured, as it does for host tensors)
_prepare_fused_weight_def = torch.library.custom_op(
    "mla_qproj::prepare_fused_weight", _prepare_fused_weight_impl, mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
prepare_fused_weight_op = _eager_fast(_prepare_fused_weight_def, _prepare_fused_weight_impl)


@_prepare_fused_weight_def.register_fake
def _(w_bf16, num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format):
    from .kernels.qproj_gemm import fused_layout

    cfg = _gemm_cfg(w_bf16.shape[1], num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, False,
                    "rceil")
    return w_bf16.new_empty((fused_layout(cfg)[2], w_bf16.shape[1]))  # the rows prepare_fused_weight lays out


def _four_outputs(outs: tuple, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The launcher's outputs as the op's four (q data or bf16 q, row scale, col data, col scale), absent ones
    empty."""
    outs = outs if len(outs) == 4 else (outs[0], None, None, None)
    return tuple(like.new_empty((0,), dtype=torch.uint8) if t is None else t for t in outs)


def _gemm(a: Tensor, w_prepared: Tensor, cos_h: Tensor, sin_h: Tensor, geo: tuple, a_scale_inv: Tensor | None = None,
          w_scale_inv: Tensor | None = None, check: bool = True) -> tuple:
    """The fused GEMM launcher on an op's arguments; geo = (num_heads, qk_head_dim, rope_dim, head_dim, rope_style,
    output_format, columnwise, scale_mode)."""
    from .kernels.qproj_gemm import qproj_gemm_fwd

    return qproj_gemm_fwd(a, w_prepared, cos_h, sin_h, _gemm_cfg(a.shape[1], *geo), a_scale_inv=a_scale_inv,
                          w_scale_inv=w_scale_inv, check=check)


def _gemm_fake(a: Tensor, geo: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ops' fake implementation: the launcher's own allocation (`qproj_gemm_outputs`) on a's device."""
    from .kernels.qproj_gemm import qproj_gemm_outputs

    return _four_outputs(qproj_gemm_outputs(a.shape[0], _gemm_cfg(a.shape[1], *geo), a), a)


def _eager_outputs(outs: tuple) -> tuple:
    """The layer's eager form of the launcher's outputs: four, None for the absent ones (no empty tensors made)."""
    return (outs[0], None, None, None) if len(outs) == 1 else outs


def _qproj_gemm_fwd_impl(a: Tensor, w_prepared: Tensor, cos_h: Tensor, sin_h: Tensor, num_heads: int,
                         qk_head_dim: int, rope_dim: int, head_dim: int, rope_style: str, output_format: str,
                         columnwise: bool, scale_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Always four outputs (q data or bf16 q, row scale, col data, col scale); absent ones are empty."""
    geo = (num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise, scale_mode)
    return _four_outputs(_gemm(a, w_prepared, cos_h, sin_h, geo), a)


def _qproj_gemm_fwd_eager(a: Tensor, w_prepared: Tensor, cos_h: Tensor, sin_h: Tensor, num_heads: int,
                          qk_head_dim: int, rope_dim: int, head_dim: int, rope_style: str, output_format: str,
                          columnwise: bool, scale_mode: str) -> tuple:
    """Eager path for the layer (its arguments are built and checked by the module): the kernel's outputs as
    (q data or bf16 q, row scale, col data, col scale) with None for the absent ones, no argument re-checks."""
    geo = (num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise, scale_mode)
    return _eager_outputs(_gemm(a, w_prepared, cos_h, sin_h, geo, check=False))


_qproj_gemm_fwd_def = torch.library.custom_op("mla_qproj::qproj_gemm_fwd", _qproj_gemm_fwd_impl, mutates_args=())
qproj_gemm_fwd_op = _eager_fast(_qproj_gemm_fwd_def, _qproj_gemm_fwd_impl, _qproj_gemm_fwd_eager)


@_qproj_gemm_fwd_def.register_fake
def _(a, w_prepared, cos_h, sin_h, num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise,
      scale_mode):
    return _gemm_fake(a, (num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise,
                          scale_mode))


# fp8_block operands (SPEC §5): a = xn's 1x128 E4M3 codes [T, K] with scale_inv [K/128, T]; w_prepared and its
# scale_inv [K/128, rows] from `kernels.qproj_gemm.prepare_fused_weight_fp8`
def _qproj_gemm_fp8_fwd_impl(a: Tensor, a_scale_inv: Tensor, w_prepared: Tensor, w_scale_inv: Tensor,
                             cos_h: Tensor, sin_h: Tensor, num_heads: int, qk_head_dim: int, rope_dim: int,
                             head_dim: int, rope_style: str, output_format: str, columnwise: bool,
                             scale_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Always four outputs (q data or bf16 q, row scale, col data, col scale); absent ones are empty."""
    geo = (num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise, scale_mode)
    return _four_outputs(_gemm(a, w_prepared, cos_h, sin_h, geo, a_scale_inv, w_scale_inv), a)


def _qproj_gemm_fp8_fwd_eager(a: Tensor, a_scale_inv: Tensor, w_prepared: Tensor, w_scale_inv: Tensor,
                              cos_h: Tensor, sin_h: Tensor, num_heads: int, qk_head_dim: int, rope_dim: int,
                              head_dim: int, rope_style: str, output_format: str, columnwise: bool,
                              scale_mode: str) -> tuple:
    """As `_qproj_gemm_fwd_eager`, for fp8_block operands."""
    geo = (num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise, scale_mode)
    return _eager_outputs(_gemm(a, w_prepared, cos_h, sin_h, geo, a_scale_inv, w_scale_inv, check=False))


_qproj_gemm_fp8_fwd_def = torch.library.custom_op("mla_qproj::qproj_gemm_fp8_fwd", _qproj_gemm_fp8_fwd_impl,
                                                  mutates_args=())
qproj_gemm_fp8_fwd_op = _eager_fast(_qproj_gemm_fp8_fwd_def, _qproj_gemm_fp8_fwd_impl, _qproj_gemm_fp8_fwd_eager)


@_qproj_gemm_fp8_fwd_def.register_fake
def _(a, a_scale_inv, w_prepared, w_scale_inv, cos_h, sin_h, num_heads, qk_head_dim, rope_dim, head_dim, rope_style,
      output_format, columnwise, scale_mode):
    return _gemm_fake(a, (num_heads, qk_head_dim, rope_dim, head_dim, rope_style, output_format, columnwise,
                          scale_mode))
