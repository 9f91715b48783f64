"""RoPE (forward or inverse) fused with quantization, one program per (32 tokens, head) — the general path.

Forward (SPEC §1.4-1.5): y [T, H*D] fp32 from the GEMM -> RoPE on each head's rope columns -> MXFP8 rowwise
(32-blocks along D) [+ columnwise, 32-blocks along T] or bf16.
Inverse (SPEC backward 1-2): dq [T, H*D] -> transpose rotation -> the exact bf16 images of the MXFP8 dgrad
operand (rowwise) and wgrad operand (columnwise), or the bf16 / fp32 gradient.
Every access is bounded to its head: partner columns come from `rope_sources`, which never leaves
[qk_head_dim, qk_head_dim + R) of the same head, and columns >= D are masked.

The head is walked in [32 tokens, 32 columns] tiles (one MX block each way): small register tiles (no spills),
no reshapes, and the pair gathers are only emitted for tiles that overlap the rope columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._constants import MX_BLOCK
from ._common import (
    e8m0_from_amax,
    e8m0_to_fp32,
    nan_ignoring_amax,
    quantize_to_e4m3,
    rope_sources,
    round_to_bf16,
)


@triton.jit
def _rope_quant_kernel(
    y_ptr, stride_y, cos_ptr, sin_ptr,
    out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    T,
    H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr,
    STYLE: tl.constexpr, INVERSE: tl.constexpr, MODE: tl.constexpr, COLUMNWISE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
):
    """out[:, p] = in[:, src1] * c[pair] + sign * in[:, src2] * s[pair] on rope columns, in[:, p] elsewhere."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    HALF: tl.constexpr = R // 2
    N: tl.constexpr = H * D
    o_t = i_t * 32 + tl.arange(0, 32)
    m_t = o_t < T
    p_y = y_ptr + o_t[:, None] * stride_y + i_h * D
    for j in tl.static_range(0, (D + 31) // 32):
        o_d = j * 32 + tl.arange(0, 32)
        m_d = o_d < D
        m = m_t[:, None] & m_d[None, :]
        # rows/cols outside load as NaN: ignored by every amax, never stored
        b_o = tl.load(p_y + o_d[None, :], mask=m, other=float("nan")).to(tl.float32)  # [32, 32]
        if (j * 32 + 32 > NOPE) and (j * 32 < NOPE + R):  # compile-time: this tile overlaps the rope columns
            p = o_d - NOPE
            is_rope = (p >= 0) & (p < R) & m_d
            src1, src2, sign, pair = rope_sources(tl.where(is_rope, p, 0), HALF, STYLE, INVERSE)
            m_r = m_t[:, None] & is_rope[None, :]
            b_v1 = tl.load(p_y + (NOPE + src1)[None, :], mask=m_r, other=float("nan")).to(tl.float32)
            b_v2 = tl.load(p_y + (NOPE + src2)[None, :], mask=m_r, other=0.0).to(tl.float32)
            b_c = tl.load(cos_ptr + o_t[:, None] * HALF + pair[None, :], mask=m_r, other=1.0)
            b_s = tl.load(sin_ptr + o_t[:, None] * HALF + pair[None, :], mask=m_r, other=0.0)
            # (v1*c) + ((±v2)*s): bitwise the reference's a*c - b*s (launched with FMA contraction off)
            b_o = tl.where(is_rope[None, :], b_v1 * b_c + (sign[None, :] * b_v2) * b_s, b_o)
        o_out = o_t[:, None] * N + i_h * D + o_d[None, :]
        if MODE == "mxfp8" or MODE == "mxfp8_images":
            b_byte = e8m0_from_amax(nan_ignoring_amax(b_o, 1), SCALE_MODE)  # [32]: one block per row
            b_q = quantize_to_e4m3(b_o, b_byte[:, None])
            if MODE == "mxfp8":
                tl.store(out_ptr + o_out, b_q, mask=m)
                tl.store(row_scale_ptr + o_t * (N // 32) + i_h * (D // 32) + j, b_byte.to(tl.uint8), mask=m_t)
            else:
                b_img = b_q.to(tl.float32) * e8m0_to_fp32(b_byte)[:, None]
                tl.store(out_ptr + o_out, b_img.to(tl.bfloat16), mask=m)  # exact image
            if COLUMNWISE:
                b_cbyte = e8m0_from_amax(nan_ignoring_amax(b_o, 0), SCALE_MODE)  # [32]: one block per column
                b_cq = quantize_to_e4m3(b_o, b_cbyte[None, :])
                if MODE == "mxfp8":
                    tl.store(col_data_ptr + o_out, b_cq, mask=m)
                    tl.store(col_scale_ptr + i_t * N + i_h * D + o_d, b_cbyte.to(tl.uint8), mask=m_d)
                else:
                    b_cimg = b_cq.to(tl.float32) * e8m0_to_fp32(b_cbyte)[None, :]
                    tl.store(col_data_ptr + o_out, b_cimg.to(tl.bfloat16), mask=m)
        elif MODE == "bf16":
            tl.store(out_ptr + o_out, round_to_bf16(b_o), mask=m)
        else:
            tl.static_assert(MODE == "fp32")
            tl.store(out_ptr + o_out, b_o, mask=m)


def rope_quant(y2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, *, num_heads: int, head_dim: int,
               qk_head_dim: int, rope_dim: int, rope_style: str, inverse: bool, mode: str, columnwise: bool,
               scale_mode: str):
    """y2d [T, H*D] (unit inner stride), cos_h/sin_h [T, R/2] fp32 contiguous.

    mode 'mxfp8': (row data fp8 [T, N], row scale [T, N/32], col data, col scale [ceil(T/32), N]) — forward output.
    mode 'mxfp8_images': (row image bf16 [T, N], col image bf16 [T, N]) — backward GEMM operands.
    mode 'bf16' / 'fp32': (rotated [T, N],). Absent outputs are empty tensors. MXFP8 modes need D % 32 == 0.
    """
    T, N = y2d.shape
    dev = y2d.device
    mx = mode == "mxfp8"
    e = torch.empty
    if mode == "mxfp8":
        out = e((T, N), dtype=torch.float8_e4m3fn, device=dev)
        rs = e((T, N // MX_BLOCK), dtype=torch.uint8, device=dev)
    else:
        out = e((T, N), dtype=torch.float32 if mode == "fp32" else torch.bfloat16, device=dev)
        rs = e((0,), dtype=torch.uint8, device=dev)
    cd = e((T, N) if columnwise else (0,), dtype=torch.float8_e4m3fn if mx else torch.bfloat16, device=dev)
    cs = e((triton.cdiv(T, MX_BLOCK), N) if (columnwise and mx) else (0,), dtype=torch.uint8, device=dev)
    if T > 0:
        _rope_quant_kernel[(triton.cdiv(T, 32), num_heads)](
            y_ptr=y2d, stride_y=y2d.stride(0), cos_ptr=cos_h, sin_ptr=sin_h,
            out_ptr=out, row_scale_ptr=rs, col_data_ptr=cd, col_scale_ptr=cs, T=T,
            H=num_heads, D=head_dim, NOPE=qk_head_dim, R=rope_dim, STYLE=rope_style, INVERSE=inverse,
            MODE=mode, COLUMNWISE=columnwise, SCALE_MODE=scale_mode, num_warps=4, enable_fp_fusion=False,
        )
    if mode == "mxfp8":
        return out, rs, cd, cs
    if mode == "mxfp8_images":
        return out, cd
    return (out,)
