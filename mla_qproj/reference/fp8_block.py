"""Block-scaled FP8 (SPEC §5: the DeepSeek-V3 / TransformerEngine Float8BlockScaling recipe) in plain PyTorch.
Twin of `kernels/triton/_fp8_block.py`: same names, same bytes. CPU-safe; the source of truth for the kernels' bytes.

One fp32 scale per block of 128 (1x128 along a row, 128x1 along a column, or a 128x128 tile); E4M3 elements.
A partial block at an edge has its amax over the elements that exist. Element codes follow SPEC §2's element
rules: `encode_e4m3` of reference/mxfp8.py (torch's cast, checked bit for bit against the explicit grid rounding
`round_to_e4m3_grid` that the kernels' EMULATED form mirrors), amax ignoring NaN.

NaN signs of *computed* tensors: IEEE 754 does not fix the sign of a NaN that arithmetic produces (x86 keeps an
operand's sign or gives the negative default NaN, the GPU gives +NaN), so the layer's computed quantizer inputs
(xn, the inverse-RoPE gradient) have their NaNs made +NaN (`canonical_nan`) before quantization: their NaN codes are
0x7F on every device. A tensor quantized as given (`quantize_blocks`, the public quantizer) keeps its NaN signs.

GEMM references: `block_scaled_mm` promotes each 128-wide K-block's product to fp32 and scales it there, in the
kernels' order: out += (A_q[:, kb] @ B_q[:, kb]^T) * sa[:, kb] * sb[:, kb].
"""

from __future__ import annotations

import torch

from .._config import BLOCK_SCALES, QProjConfig, check_block_scale, check_block_shape  # noqa: F401 (re-exported)
from .._constants import BLOCK_SHAPES, E4M3_MAX, FLT_MAX, FP8_BLOCK  # noqa: F401 (re-exported)
from .mxfp8 import _fp32_bits, encode_e4m3, nan_ignoring_amax
from .qproj import quantize_output, rmsnorm_bwd, rmsnorm_fwd
from .rope import apply_rope, apply_rope_inverse

_EXP_MASK = 0x7F800000  # fp32 exponent field


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_block_scale(amax: torch.Tensor, block_scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §5: (encode operand, scale_inv) fp32 of blocks with this amax.

    "pow2" and "fp32" (TransformerEngine's rules): the operand is the multiplier scale = 1.0 for amax 0, NaN (all-NaN
    block) or inf; else fp32(448 / amax) (an fp32 division, round to nearest even), FLT_MAX where that overflows;
    "pow2" then clears its mantissa bits (rounds down to a power of two). scale_inv = fp32(1 / scale) (exact for
    "pow2": 2^-e, the subnormal 2^-127 for scale 2^127).
    "deepseek" (DeepSeek-V3's kernels): scale_inv = fp32(amax / 448), 1.0 for amax 0, NaN or inf and where the
    quotient underflows to 0; the operand is scale_inv itself, the divisor (`quantize_with_scale(..., divide=True)`).
    """
    check_block_scale(block_scale)
    a = amax.float()
    special = (a == 0) | torch.isnan(a) | torch.isinf(a)
    if block_scale == "deepseek":
        # fp32 / fp32, correctly rounded: a tensor divisor (CUDA divides by a Python scalar as a multiplication by
        # its rounded reciprocal, one ulp off in some blocks)
        sinv = torch.div(torch.where(special, torch.zeros_like(a), a), torch.full_like(a, E4M3_MAX))
        sinv = torch.where(sinv == 0, torch.ones_like(a), sinv)
        return sinv, sinv
    safe = torch.where(special, torch.ones_like(a), a)  # no 448 / 0 or 448 / NaN
    scale = torch.div(torch.full_like(a, E4M3_MAX), safe)  # fp32 / fp32, correctly rounded
    scale = torch.where(torch.isinf(scale), torch.full_like(a, FLT_MAX), scale)
    if block_scale == "pow2":
        scale = (_fp32_bits(scale) & _EXP_MASK).view(torch.float32)  # scale > 0 is normal: 2^floor(log2(scale))
    scale = torch.where(special, torch.ones_like(a), scale)
    scale_inv = torch.div(torch.ones_like(scale), scale)
    return scale, scale_inv


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """Element codes (SPEC §5, §2 element rules): E4M3 round-to-nearest-even of fp32(x * scale) (divide: fp32(x /
    scale)), saturated to ±448; NaN stays NaN with x's sign, the sign of zero is kept. scale broadcasts against x."""
    xf = x.float()
    return encode_e4m3(torch.div(xf, scale) if divide else xf * scale, xf)


def _blocks(xf: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """[M, N] -> [ceil(M/bm), ceil(N/bn), bm*bn], padded with NaN (ignored by the amax: a partial block's amax is
    over the elements that exist)."""
    M, N = xf.shape
    mb, nb = _cdiv(M, bm), _cdiv(N, bn)
    xp = xf.new_full((mb * bm, nb * bn), float("nan"))
    xp[:M, :N] = xf
    return xp.reshape(mb, bm, nb, bn).permute(0, 2, 1, 3).reshape(mb, nb, bm * bn)


def _expand(s: torch.Tensor, bm: int, bn: int, M: int, N: int) -> torch.Tensor:
    """Per-block values [ceil(M/bm), ceil(N/bn)] repeated over their blocks: [M, N]."""
    return s.repeat_interleave(bm, dim=0)[:M].repeat_interleave(bn, dim=1)[:, :N]


def quantize_blocks(x2d: torch.Tensor, block_shape=(1, FP8_BLOCK),
                    block_scale: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [M, N] -> (data float8_e4m3fn [M, N], scale_inv fp32 [ceil(M/bm), ceil(N/bn)]) for block_shape (bm, bn)
    in (1, 128), (128, 1), (128, 128)."""
    bm, bn = check_block_shape(block_shape)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D, got shape {tuple(x2d.shape)}")
    M, N = x2d.shape
    xf = x2d.float()
    amax = nan_ignoring_amax(_blocks(xf, bm, bn), dim=-1)  # [ceil(M/bm), ceil(N/bn)]
    scale, scale_inv = fp8_block_scale(amax, block_scale)
    return quantize_with_scale(xf, _expand(scale, bm, bn, M, N), block_scale == "deepseek"), scale_inv


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block_shape=(1, FP8_BLOCK),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code * scale_inv of its block (fp32, exact for pow2 scales), then cast to dtype."""
    bm, bn = check_block_shape(block_shape)
    M, N = data.shape
    return (data.float() * _expand(scale_inv.float(), bm, bn, M, N)).to(dtype)


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """NaN -> +NaN (the GPU's NaN): the sign of a NaN made by arithmetic is platform-defined (module docstring)."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


# ------------------------------------------------------------------------------------------------ GEMMs


def block_scaled_mm(a_data: torch.Tensor, a_sinv: torch.Tensor, b_data: torch.Tensor, b_sinv: torch.Tensor,
                    a_block_rows: int = 1, b_block_rows: int = FP8_BLOCK) -> torch.Tensor:
    """out [M, Nout] fp32 = A [M, R] · B [Nout, R]^T over reduction blocks of 128 (the last one may be partial):

        out = sum over kb of (A_q[:, kb] @ B_q[:, kb]^T) * sa[:, kb, None] * sb[None, :, kb]

    each block's product in fp32 (E4M3 products are exact in fp32), scaled in that order, summed over kb in order.
    a_sinv: [ceil(M / a_block_rows), ceil(R / 128)]: rows of A sharing a scale (1: 1x128 blocks along the reduction;
    128: 128x128 tiles); b_sinv likewise with b_block_rows. The layer's three GEMMs:

        forward  y   = block_scaled_mm(xn_q, xn_s (1x128 along K), w_q, w_s (128x128))
        dgrad    dxn = block_scaled_mm(dy_q, dy_s (1x128 along N), w_q.t(), w_s.t())  # B = W^T [K, N], blocks along N
        wgrad    dW  = block_scaled_mm(dy_c.t(), dy_cs.t(), xn_c.t(), xn_cs.t(), 1, 1)  # 128x1 along T, transposed
    """
    M, R = a_data.shape
    Nout, R_b = b_data.shape
    if R != R_b:
        raise ValueError(f"reduction lengths differ: A [{M}, {R}] vs B [{Nout}, {R_b}]")
    nb = _cdiv(R, FP8_BLOCK)
    for name, s, rows, n in (("a_sinv", a_sinv, a_block_rows, M), ("b_sinv", b_sinv, b_block_rows, Nout)):
        if rows not in (1, FP8_BLOCK):
            raise ValueError(f"{name}: block rows must be 1 or {FP8_BLOCK}, got {rows}")
        if tuple(s.shape) != (_cdiv(n, rows), nb):
            raise ValueError(f"{name} must be [{_cdiv(n, rows)}, {nb}], got {tuple(s.shape)}")
    sa = a_sinv.float().repeat_interleave(a_block_rows, dim=0)[:M]  # [M, nb]
    sb = b_sinv.float().repeat_interleave(b_block_rows, dim=0)[:Nout]  # [Nout, nb]
    out = torch.zeros(M, Nout, dtype=torch.float32, device=a_data.device)
    for kb in range(nb):
        k = slice(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK)
        prod = a_data[:, k].float() @ b_data[:, k].float().t()  # [M, Nout], fp32
        out += prod * sa[:, kb, None] * sb[None, :, kb]
    return out


# ------------------------------------------------------------------------------------------------ the layer


def prepare_weight_fp8_block(weight: torch.Tensor, block_scale: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] in 128x128 tiles: (codes [N, K], scale_inv [ceil(N/128), K/128]); used by forward and dgrad."""
    return quantize_blocks(weight.detach(), (FP8_BLOCK, FP8_BLOCK), block_scale)


def qproj_fwd_fp8_block(x2d, norm_weight, w_data, w_sinv, cos_h, sin_h, cfg: QProjConfig,
                        block_scale: str | None = None):
    """SPEC §5 forward. Returns (outputs as in `reference.qproj.quantize_output`, rsigma [T], xn_saved) where
    xn_saved = (codes [T, K], scale_inv [ceil(T/128), K]): xn in 128x1 blocks along T, what wgrad reads.
    block_scale: the scale rule (SPEC §5), default cfg.block_scale."""
    block_scale = cfg.block_scale if block_scale is None else block_scale
    T = x2d.shape[0]
    xn, rsigma = rmsnorm_fwd(x2d, norm_weight, cfg.eps, cfg.zero_centered_gamma)  # fp32, never rounded to bf16
    xn = canonical_nan(xn)
    a_data, a_sinv = quantize_blocks(xn, (1, FP8_BLOCK), block_scale)
    y = block_scaled_mm(a_data, a_sinv, w_data, w_sinv, 1, FP8_BLOCK).reshape(T, cfg.num_heads, cfg.q_head_dim)
    y = apply_rope(y, cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style)
    xn_saved = quantize_blocks(xn, (FP8_BLOCK, 1), block_scale)
    return quantize_output(y, cfg), rsigma, xn_saved


def grad_operands_fp8_block(dq: torch.Tensor, cos_h, sin_h, cfg: QProjConfig, block_scale: str | None = None):
    """Inverse RoPE on the query gradient, then its two quantizations [T, N]: (row codes, row scale_inv
    [T, ceil(N/128)]) in 1x128 blocks along N (across heads; dgrad) and (col codes, col scale_inv [ceil(T/128), N])
    in 128x1 blocks along T (wgrad). block_scale: default cfg.block_scale."""
    block_scale = cfg.block_scale if block_scale is None else block_scale
    T = dq.shape[0]
    dq = dq.reshape(T, cfg.num_heads, cfg.q_head_dim)
    g = apply_rope_inverse(dq.float(), cos_h, sin_h, cfg.qk_head_dim, cfg.rope_dim, cfg.rope_style)
    g = canonical_nan(g.reshape(T, cfg.out_features))
    return (*quantize_blocks(g, (1, FP8_BLOCK), block_scale), *quantize_blocks(g, (FP8_BLOCK, 1), block_scale))


def qproj_bwd_fp8_block(dq, x2d, rsigma, xn_saved, norm_weight, w_data, w_sinv, cos_h, sin_h, cfg: QProjConfig,
                        block_scale: str | None = None):
    """SPEC §5 backward. Returns (dx [T, K] in x's dtype, dnorm_weight, dW fp32 [N, K])."""
    dr, drs, dc, dcs = grad_operands_fp8_block(dq, cos_h, sin_h, cfg, block_scale)
    xc, xcs = xn_saved
    dxn = block_scaled_mm(dr, drs, w_data.t(), w_sinv.t(), 1, FP8_BLOCK)  # W's forward tiles, no re-quantization
    dw = block_scaled_mm(dc.t(), dcs.t(), xc.t(), xcs.t(), 1, 1)
    dx, dg = rmsnorm_bwd(dxn, x2d, rsigma, norm_weight, cfg.zero_centered_gamma)
    return dx, dg, dw
