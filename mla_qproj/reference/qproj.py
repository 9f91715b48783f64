"""The pieces of the layer in plain PyTorch (SPEC §1) that the recipes' reference implementations compose: RMSNorm
forward and backward, the weight's MXFP8 GEMM images, the query's quantization, the inverse RoPE of the gradient and
its MXFP8 GEMM images. Inputs are already flattened: x2d [T, K]; cos_h/sin_h [T, R/2] fp32 pair tables.

GEMM operands are the *exact* dense images of the quantized tensors (E4M3 * 2^k is exact in bf16 and fp32),
multiplied in fp32, so this is MXFP8 arithmetic up to the fp32 summation order.
"""

from __future__ import annotations

import torch

from .._config import QProjConfig
from .mxfp8 import dequantize_columnwise, dequantize_rowwise, quantize_columnwise, quantize_rowwise
from .rope import apply_rope_inverse


def rmsnorm_fwd(x2d: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, zero_centered_gamma: bool):
    """xn = x * rsigma * g in fp32 (g = 1 + w when zero-centered); returns (xn fp32, rsigma fp32 [T]). norm_weight
    None: a layer without a norm (SPEC §7): xn = x in fp32, rsigma ones."""
    xf = x2d.float()
    if norm_weight is None:
        return xf, xf.new_ones(xf.shape[0])
    rsigma = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    g = norm_weight.float() + 1.0 if zero_centered_gamma else norm_weight.float()
    return xf * rsigma.unsqueeze(-1) * g, rsigma


def rmsnorm_bwd(dxn: torch.Tensor, x2d: torch.Tensor, rsigma: torch.Tensor, norm_weight: torch.Tensor,
                zero_centered_gamma: bool):
    """dx = rsigma * (dxhat - xhat * mean(dxhat * xhat)), dxhat = dxn * g, xhat = x * rsigma; dg = sum_T dxn*xhat."""
    xhat = x2d.float() * rsigma.unsqueeze(-1)
    g = norm_weight.float() + 1.0 if zero_centered_gamma else norm_weight.float()
    dxhat = dxn.float() * g
    dx = rsigma.unsqueeze(-1) * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dg = (dxn.float() * xhat).sum(0)
    return dx.to(x2d.dtype), dg.to(norm_weight.dtype)


def mxfp8_weight_images(weight: torch.Tensor, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward image, dgrad image) of W [N, K] as exact bf16: its MXFP8 rowwise (along K) and columnwise (along
    N) quantizations."""
    w = weight.detach().float()  # widened once for both orientations
    fwd = dequantize_rowwise(*quantize_rowwise(w, scale_mode), dtype=torch.bfloat16)
    bwd = dequantize_columnwise(*quantize_columnwise(w, scale_mode), dtype=torch.bfloat16)
    return fwd, bwd


def quantize_output(y: torch.Tensor, cfg: QProjConfig) -> tuple:
    """y [T, H, D] fp32 -> (row data, row scale [T, H, D/32], col data, col scale [ceil(T/32), H, D]) or (bf16,)."""
    if cfg.output_format == "bf16":
        return (y.to(torch.bfloat16),)
    rd, rs = quantize_rowwise(y, cfg.query_scale_mode)
    cd = cs = None
    if cfg.columnwise_output:
        T, H, D = y.shape
        cd, cs = quantize_columnwise(y.reshape(T, H * D), cfg.query_scale_mode)
        cd, cs = cd.reshape(T, H, D), cs.reshape(-1, H, D)
    return rd, rs, cd, cs


def rope_inverse_grad(dq: torch.Tensor, cos_h, sin_h, cfg: QProjConfig) -> torch.Tensor:
    """Inverse RoPE on the query gradient [T, H, D] (or [T, N]): g [T, N] fp32, what the GEMM operands quantize."""
    T = dq.shape[0]
    dq = dq.reshape(T, cfg.num_heads, cfg.q_head_dim)
    g = apply_rope_inverse(dq.float(), cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style)
    return g.reshape(T, cfg.out_features)


def mxfp8_grad_images(g: torch.Tensor, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact images the two GEMMs consume of g [T, N]: (dgrad operand: rowwise along N, wgrad operand:
    columnwise along T), both [T, N] fp32."""
    # rowwise along N == columnwise of the transpose: also covers N % 32 != 0 (partial last block)
    dt, st = quantize_columnwise(g.t(), scale_mode)
    row = dequantize_columnwise(dt, st).t()
    col = dequantize_columnwise(*quantize_columnwise(g, scale_mode))
    return row, col
