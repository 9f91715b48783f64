"""The backward's gradient operands for block-scaled FP8 (SPEC §5) in one read of dq [T, N = H*D]: inverse RoPE on
each head's rope columns (SPEC §3; the arithmetic of `reference.rope.apply_rope_inverse`, launched with FMA
contraction off so that each product is rounded before the sum), then
(a) 1x128 blocks along N (dgrad; blocks run across heads, the last one may be partial): codes [T, N] and scale_inv
    stored M-major [ceil(N/128), T];
(b) 128x1 blocks along T (wgrad; the last one may be partial): codes stored transposed [N, T_pad] (T_pad =
    round_up(T, 16), zero codes in the padding) and scale_inv [ceil(T/128), N].
NaN in the rotated gradient is made +NaN (code 0x7F; reference/fp8_block.py says why). Bytes equal
`reference.fp8_block.grad_operands_fp8_block` in these layouts.

Each program owns a [128 tokens, 128 columns] tile, built as 128 / W runs of W columns kept in registers:
- contiguous runs (where `unit_fits`: W in (64, 32) divides the pass-through and rope runs of a head; DeepSeek-V3
  qualifies in every style): a run is all pass-through or all rope, read as contiguous tiles with its pairs split /
  joined in registers, and every thread holds TJ consecutive tokens of 8 consecutive columns, so both code layouts
  are packed into 32-bit words in registers and stored as words (`_rope_fp8_block_packed_kernel`);
- gather runs (any geometry): every rope column loads its two sources through `rope_sources`, which never leaves
  [qk_head_dim, qk_head_dim + R) of its own head; codes stored as bytes, the 128x1 layout transposed through
  shared memory (`_rope_fp8_block_gather_kernel`).
Both give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._config import ROPE_STYLES, QProjConfig, validate_choice
from ..._constants import FP8_BLOCK
from .. import _op
from . import _fp8_block
from ._common import amax, cap_on_releases, cdiv, check_pair_tables, register_cap, rope_sources
from ._fp8_block import (
    encode_operand,
    fp8_block_scale,
    nan_max,
    pack_e4m3_words,
    quantize_with_scale,
    runs_of,
    widen,
    widen_lean,
)


@triton.jit
def _store_row_codes(b_g, b_scale, o_t, m_t, col0, row_data_ptr, N: tl.constexpr, W: tl.constexpr,
                     BLOCK_SCALE: tl.constexpr, EMULATED: tl.constexpr):
    """1x128 codes of output columns [col0, col0 + W) (b_g [128, W] fp32, b_scale [128]: its rows' block scale)."""
    o_c = col0 + tl.arange(0, W)
    b_q = quantize_with_scale(b_g, b_scale[:, None], 0, EMULATED, False, BLOCK_SCALE)
    tl.store(row_data_ptr + o_t[:, None] * N + o_c[None, :], b_q, mask=m_t[:, None] & (o_c < N)[None, :])


@triton.jit
def _store_col_blocks(b_g, o_t, i_t, T_pad, col0, col_data_ptr, col_sinv_ptr, N: tl.constexpr, W: tl.constexpr,
                      BLOCK_SCALE: tl.constexpr, EMULATED: tl.constexpr):
    """128x1 blocks of output columns [col0, col0 + W): the tile's 128 rows are one block per column (rows past T
    hold 0). Codes stored transposed [N, T_pad]: the padding rows' codes are those zeros."""
    o_c = col0 + tl.arange(0, W).to(tl.int64)
    m_c = o_c < N
    b_scale, b_sinv = fp8_block_scale(amax(b_g, 0, EMULATED), BLOCK_SCALE)  # [W]
    b_q = quantize_with_scale(b_g, b_scale[None, :], 0, EMULATED, False, BLOCK_SCALE)
    tl.store(col_data_ptr + o_c[:, None] * T_pad + o_t[None, :], tl.trans(b_q),
             mask=m_c[:, None] & (o_t < T_pad)[None, :])  # [W, 128]: tokens contiguous in memory
    tl.store(col_sinv_ptr + i_t * N + o_c, b_sinv, mask=m_c)


@triton.jit
def _gather_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr,
                N: tl.constexpr, STYLE: tl.constexpr, W: tl.constexpr, EMULATED: tl.constexpr):
    """g [128, W] fp32 of output columns [n0, n0 + W), any geometry (the run may cross heads and rope edges):
    g[:, n] = dq[:, src1] * c[pair] + sign * dq[:, src2] * s[pair] on rope columns (sources from `rope_sources`,
    inside the column's own head), dq[:, n] elsewhere; columns past N load as 0."""
    o_n = n0 + tl.arange(0, W)  # int32: N = H * D is far below 2^31
    m_n = o_n < N
    h = o_n // D
    p = o_n - h * D - NOPE  # position in the head's rope columns
    is_rope = (p >= 0) & (p < R) & m_n
    src1, src2, sign, pair = rope_sources(tl.where(is_rope, p, 0), R // 2, STYLE, True)
    base = h * D + NOPE
    b_v1 = widen(tl.load(p_row + tl.where(is_rope, base + src1, o_n)[None, :],
                                 mask=m_t[:, None] & m_n[None, :], other=0.0), EMULATED)  # [128, W]
    m_r = m_t[:, None] & is_rope[None, :]
    b_v2 = widen(tl.load(p_row + (base + src2)[None, :], mask=m_r, other=0.0), EMULATED)  # [128, W]
    b_c = widen(tl.load(cos_ptr + o_cs + pair[None, :], mask=m_r, other=1.0), EMULATED)  # [128, W]
    b_s = widen(tl.load(sin_ptr + o_cs + pair[None, :], mask=m_r, other=0.0), EMULATED)
    # (v1*c) + ((±v2)*s): bitwise the reference's a*c + b*s / b*c - a*s (FMA contraction off)
    return tl.where(is_rope[None, :], b_v1 * b_c + (sign[None, :] * b_v2) * b_s, b_v1)


@triton.jit
def _rope_fp8_block_gather_kernel(
    dq_ptr, stride_dq, cos_ptr, sin_ptr, stride_cs,
    row_data_ptr, row_sinv_ptr, col_data_ptr, col_sinv_ptr,
    T, T_pad,
    H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, STYLE: tl.constexpr,
    W: tl.constexpr, BLOCK_SCALE: tl.constexpr, TOKENS_ON_AXIS0: tl.constexpr,
    EMULATED: tl.constexpr,
):
    """Program (128 tokens, 128 columns) as 128 / W gather runs of W columns (2 or 4, kept in registers): the 1x128 amax
    is the max over the runs' row amaxes, then each run's row codes and 128x1 blocks are stored.
    Rows / columns outside the tensor load as 0: a block's amax and scale stay those of the elements that exist
    (0 and an all-NaN amax both give scale 1), and the padding rows encode as the zero codes the transposed layout
    wants."""
    tl.static_assert((W == 64) | (W == 32))
    i_t = tl.program_id(0 if TOKENS_ON_AXIS0 else 1).to(tl.int64)
    i_n = tl.program_id(1 if TOKENS_ON_AXIS0 else 0)
    N: tl.constexpr = H * D
    o_t = i_t * 128 + tl.arange(0, 128)
    m_t = o_t < T
    p_row = dq_ptr + o_t[:, None] * stride_dq  # [128, 1]
    o_cs = o_t[:, None] * stride_cs  # [128, 1]
    n0 = i_n * 128
    b_0 = _gather_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0, D, NOPE, R, N, STYLE, W, EMULATED)
    b_1 = _gather_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0 + W, D, NOPE, R, N, STYLE, W, EMULATED)
    b_amax = nan_max(amax(b_0, 1, EMULATED), amax(b_1, 1, EMULATED), EMULATED)
    if W == 32:
        b_2 = _gather_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0 + 2 * W, D, NOPE, R, N, STYLE, W, EMULATED)
        b_3 = _gather_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0 + 3 * W, D, NOPE, R, N, STYLE, W, EMULATED)
        b_amax = nan_max(b_amax, nan_max(amax(b_2, 1, EMULATED), amax(b_3, 1, EMULATED),
                                         EMULATED), EMULATED)
    b_scale, b_sinv = fp8_block_scale(b_amax, BLOCK_SCALE)  # [128]: one 1x128 block per row
    tl.store(row_sinv_ptr + i_n.to(tl.int64) * T + o_t, b_sinv, mask=m_t)  # M-major [ceil(N/128), T]
    _store_row_codes(b_0, b_scale, o_t, m_t, n0, row_data_ptr, N, W, BLOCK_SCALE, EMULATED)
    _store_col_blocks(b_0, o_t, i_t, T_pad, n0, col_data_ptr, col_sinv_ptr, N, W, BLOCK_SCALE, EMULATED)
    _store_row_codes(b_1, b_scale, o_t, m_t, n0 + W, row_data_ptr, N, W, BLOCK_SCALE, EMULATED)
    _store_col_blocks(b_1, o_t, i_t, T_pad, n0 + W, col_data_ptr, col_sinv_ptr, N, W, BLOCK_SCALE, EMULATED)
    if W == 32:
        _store_row_codes(b_2, b_scale, o_t, m_t, n0 + 2 * W, row_data_ptr, N, W, BLOCK_SCALE, EMULATED)
        _store_col_blocks(b_2, o_t, i_t, T_pad, n0 + 2 * W, col_data_ptr, col_sinv_ptr, N, W, BLOCK_SCALE, EMULATED)
        _store_row_codes(b_3, b_scale, o_t, m_t, n0 + 3 * W, row_data_ptr, N, W, BLOCK_SCALE, EMULATED)
        _store_col_blocks(b_3, o_t, i_t, T_pad, n0 + 3 * W, col_data_ptr, col_sinv_ptr, N, W, BLOCK_SCALE, EMULATED)


@triton.jit
def _packed_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr,
                N: tl.constexpr, STYLE: tl.constexpr, W: tl.constexpr, EMULATED: tl.constexpr):
    """g [TR, TJ, W] fp32 of output columns [n0, n0 + W) (token = TR-index * TJ + TJ-index; p_row, o_cs
    [TR, TJ, 1], m_t [TR, TJ]) where W divides the head's pass-through and rope runs (`unit_fits`): the run is all
    pass-through or all rope (a runtime branch on n0), read as contiguous tiles. Inverse RoPE of pairs (x1, x2):
    (x1 c + x2 s, x2 c - x1 s); deepseek reads halves and writes pairs interleaved, neox is halves both ways, gptj
    interleaved both ways. Offsets are contiguous in runs of 8 output columns (4 pairs), so that every thread holds
    TJ consecutive tokens of 8 consecutive columns, the layout of the word-packed stores."""
    HALF: tl.constexpr = R // 2
    h = n0 // D
    p0 = n0 - h * D - NOPE
    m_t3 = m_t[:, :, None]
    m = tl.where(n0 < N, m_t3, False)
    p_head = p_row + h * D + NOPE
    if (p0 >= 0) & (p0 < R):
        if STYLE == "neox":
            o_w = runs_of(0, W, 8)[None, None, :]
            hi = p0 >= HALF
            pair0 = tl.where(hi, p0 - HALF, p0)
            b_x1 = widen_lean(tl.load(p_head + p0 + o_w, mask=m, other=0.0), EMULATED)
            b_x2 = widen_lean(tl.load(p_head + tl.where(hi, p0 - HALF, p0 + HALF) + o_w, mask=m, other=0.0),
                              EMULATED)
            b_c = widen(tl.load(cos_ptr + o_cs + pair0 + o_w, mask=m_t3, other=1.0), EMULATED)
            b_s = widen(tl.load(sin_ptr + o_cs + pair0 + o_w, mask=m_t3, other=0.0), EMULATED)
            b_g = b_x1 * b_c + (tl.where(hi, -1.0, 1.0) * b_x2) * b_s
        else:
            o_h = runs_of(0, W // 2, 4)[None, None, :]
            i0 = p0 // 2
            if STYLE == "deepseek":
                b_x1 = widen_lean(tl.load(p_head + i0 + o_h, mask=m, other=0.0), EMULATED)
                b_x2 = widen_lean(tl.load(p_head + HALF + i0 + o_h, mask=m, other=0.0), EMULATED)
            else:
                tl.static_assert(STYLE == "gptj")
                b_x = widen_lean(tl.load(p_head + p0 + runs_of(0, W, 8)[None, None, :], mask=m, other=0.0),
                                 EMULATED)
                b_x1, b_x2 = tl.split(tl.reshape(b_x, [b_x.shape[0], b_x.shape[1], W // 2, 2]))
            b_c = widen(tl.load(cos_ptr + o_cs + i0 + o_h, mask=m_t3, other=1.0), EMULATED)
            b_s = widen(tl.load(sin_ptr + o_cs + i0 + o_h, mask=m_t3, other=0.0), EMULATED)
            b_g = tl.reshape(tl.join(b_x1 * b_c + b_x2 * b_s, b_x2 * b_c - b_x1 * b_s),
                             [b_x1.shape[0], b_x1.shape[1], W])
    else:
        b_g = widen_lean(tl.load(p_row + n0 + runs_of(0, W, 8)[None, None, :], mask=m, other=0.0), EMULATED)
    return b_g


@triton.jit
def _store_packed(b_g, b_scale, o_t, m_t, o_r, i_t, T_pad, n0, row_w_ptr, col_w_ptr, col_sinv_ptr, N: tl.constexpr,
                  W: tl.constexpr, TJ: tl.constexpr, BLOCK_SCALE: tl.constexpr, EMULATED: tl.constexpr):
    """Run [n0, n0 + W) of `_packed_run`'s g: its 1x128 codes (b_scale [TR, TJ]: the rows' block scale) as words of
    4 columns, its 128x1 blocks' codes as words of 4 tokens in the transposed [N, T_pad] layout, their scale_inv.
    Rows past T hold 0 (their loads): their codes are the padding's zero codes."""
    o_c = n0 + runs_of(0, W, 8)
    m_c = o_c < N
    b_rw = pack_e4m3_words(encode_operand(b_g, b_scale[:, :, None], BLOCK_SCALE), EMULATED)  # [TR, TJ, W/4]
    o_cw = n0 // 4 + runs_of(0, W // 4, 2)
    tl.store(row_w_ptr + o_t[:, :, None] * (N // 4) + o_cw[None, None, :], b_rw,
             mask=m_t[:, :, None] & (o_cw < N // 4)[None, None, :])
    b_cscale, b_csinv = fp8_block_scale(amax(amax(b_g, 1, EMULATED), 0, EMULATED), BLOCK_SCALE)  # [W]
    b_cw = pack_e4m3_words(tl.permute(encode_operand(b_g, b_cscale[None, None, :], BLOCK_SCALE), (0, 2, 1)),
                           EMULATED)  # [TR, W, TJ/4]
    o_tw = (i_t * 128 + o_r[:, None] * TJ) // 4 + tl.arange(0, TJ // 4)[None, :]  # [TR, TJ/4]: token words
    p_cw = col_w_ptr + o_c.to(tl.int64)[None, :, None] * (T_pad // 4) + o_tw[:, None, :]
    # a thread-row's TJ tokens (TJ | 16 | T_pad) are all in [0, T_pad) or all out
    tl.store(p_cw, b_cw, mask=(i_t * 128 + o_r * TJ < T_pad)[:, None, None] & m_c[None, :, None])
    tl.store(col_sinv_ptr + i_t * N + o_c, b_csinv, mask=m_c)


@triton.jit
def _rope_fp8_block_packed_kernel(
    dq_ptr, stride_dq, cos_ptr, sin_ptr, stride_cs,
    row_w_ptr, row_sinv_ptr, col_w_ptr, col_sinv_ptr,
    T, T_pad,
    H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, STYLE: tl.constexpr,
    W: tl.constexpr, TJ: tl.constexpr, BLOCK_SCALE: tl.constexpr, TOKENS_ON_AXIS0: tl.constexpr,
    EMULATED: tl.constexpr,
):
    """`_rope_fp8_block_gather_kernel`'s bytes from contiguous [TR, TJ, W] runs: every thread holds TJ
    consecutive tokens of 8 consecutive columns, so both code layouts are stored as 32-bit words packed in
    registers (4 columns of a row; 4 tokens of a column of the transposed layout), with no byte transposition."""
    tl.static_assert((W == 64) | (W == 32))
    TR: tl.constexpr = 128 // TJ
    i_t = tl.program_id(0 if TOKENS_ON_AXIS0 else 1).to(tl.int64)
    i_n = tl.program_id(1 if TOKENS_ON_AXIS0 else 0)
    N: tl.constexpr = H * D
    o_r = tl.arange(0, TR)
    o_t = i_t * 128 + o_r[:, None] * TJ + tl.arange(0, TJ)[None, :]  # [TR, TJ]
    m_t = o_t < T
    p_row = dq_ptr + o_t[:, :, None] * stride_dq  # [TR, TJ, 1]
    o_cs = o_t[:, :, None] * stride_cs
    n0 = i_n * 128
    b_0 = _packed_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0, D, NOPE, R, N, STYLE, W, EMULATED)
    b_1 = _packed_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0 + W, D, NOPE, R, N, STYLE, W, EMULATED)
    b_amax = nan_max(amax(b_0, 2, EMULATED), amax(b_1, 2, EMULATED), EMULATED)
    if W == 32:
        b_2 = _packed_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0 + 2 * W, D, NOPE, R, N, STYLE, W, EMULATED)
        b_3 = _packed_run(p_row, m_t, cos_ptr, sin_ptr, o_cs, n0 + 3 * W, D, NOPE, R, N, STYLE, W, EMULATED)
        b_amax = nan_max(b_amax, nan_max(amax(b_2, 2, EMULATED), amax(b_3, 2, EMULATED), EMULATED), EMULATED)
    b_scale, b_sinv = fp8_block_scale(b_amax, BLOCK_SCALE)  # [TR, TJ]: one 1x128 block per row
    tl.store(row_sinv_ptr + i_n.to(tl.int64) * T + o_t, b_sinv, mask=m_t)  # M-major [ceil(N/128), T]
    _store_packed(b_0, b_scale, o_t, m_t, o_r, i_t, T_pad, n0, row_w_ptr, col_w_ptr, col_sinv_ptr, N, W, TJ,
                  BLOCK_SCALE, EMULATED)
    _store_packed(b_1, b_scale, o_t, m_t, o_r, i_t, T_pad, n0 + W, row_w_ptr, col_w_ptr, col_sinv_ptr, N, W, TJ,
                  BLOCK_SCALE, EMULATED)
    if W == 32:
        _store_packed(b_2, b_scale, o_t, m_t, o_r, i_t, T_pad, n0 + 2 * W, row_w_ptr, col_w_ptr, col_sinv_ptr, N,
                      W, TJ, BLOCK_SCALE, EMULATED)
        _store_packed(b_3, b_scale, o_t, m_t, o_r, i_t, T_pad, n0 + 3 * W, row_w_ptr, col_w_ptr, col_sinv_ptr, N,
                      W, TJ, BLOCK_SCALE, EMULATED)


def unit_fits(w: int, qk_head_dim: int, rope_dim: int, head_dim: int, rope_style: str) -> bool:
    """Run width w (64 or 32) of the contiguous-run kernel: it must divide qk_head_dim, the rope run (R for deepseek /
    gptj, each half R/2 for neox) and head_dim (then the trailing pass-through too)."""
    rope_run = rope_dim // 2 if rope_style == "neox" else rope_dim
    return w in (64, 32) and qk_head_dim % w == 0 and rope_run % w == 0 and head_dim % w == 0


def fast_unit(qk_head_dim: int, rope_dim: int, head_dim: int, rope_style: str) -> int:
    """The widest run width that fits (64, else 32), 0 when none does (the gather kernel).
    DeepSeek-V3 (128, 64, 192): 64 for deepseek / gptj, 32 for neox."""
    return next((w for w in (64, 32) if unit_fits(w, qk_head_dim, rope_dim, head_dim, rope_style)), 0)


@dataclass(frozen=True)
class RopeFp8BlockConfig:
    """Launch parameters: unit = the run width W (64 or 32); gather = runs gather their sources per column (any
    geometry; `_rope_fp8_block_gather_kernel`) instead of reading contiguous runs (`_rope_fp8_block_packed_kernel`:
    needs `unit_fits` and `packed_tokens` in (4, 8, 16)); num_warps; maxnreg: a cap on the registers a thread (None:
    ptxas's choice), which sets how many programs an SM holds (65536 registers over 32 * num_warps threads)."""

    unit: int = 32
    gather: bool = True
    num_warps: int = 8
    maxnreg: int | None = None


def packed_tokens(unit: int, num_warps: int) -> int:
    """Consecutive tokens per thread (TJ) of the packed kernel: 8 columns per thread, unit / 8 threads of a warp
    along a run's columns, the warp's other threads and the warps along the tokens."""
    return 128 * (unit // 8) // (32 * num_warps)


# Triton releases whose code for the contiguous kernel fits 168 registers without spilling (sm_90, offline): 3.6
# gives it 198 uncapped and 168 with no spill; 3.9 gives it 253 and spills under any cap up to 200
CAPPED_TRITON = ((3, 6),)
_CONTIGUOUS_MAXNREG = cap_on_releases(168, CAPPED_TRITON)


def default_config(qk_head_dim: int, rope_dim: int, head_dim: int, rope_style: str,
                   device: torch.device) -> RopeFp8BlockConfig:
    """Contiguous runs (the widest that fits) with 4 warps, at most 168 registers a thread on the Triton releases of
    `CAPPED_TRITON`; else 32-column gather runs with 16 warps (sm_90, offline: 8 warps spill there, 16 do not).
    Triton 3.6 gives the contiguous kernel 198 registers, so an SM holds 2 of its 128-thread programs; 168 fits 3
    (65536 / (128 * 168)) with no spill. On an H200 (DeepSeek-V3, T = 16384, Triton 3.6) the cap takes it from
    0.70 / 0.71 / 0.53 of a device copy to 0.82 / 0.77 / 0.57 (deepseek / gptj / neox); 160 and 128 are slower, as
    are 2 and 8 warps (BENCHMARKS.md)."""
    w = fast_unit(qk_head_dim, rope_dim, head_dim, rope_style)
    if not w:
        return RopeFp8BlockConfig(unit=32, gather=True, num_warps=16)
    return RopeFp8BlockConfig(unit=w, gather=False, num_warps=4, maxnreg=_CONTIGUOUS_MAXNREG)


def rope_fp8_block_outputs(dq2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row codes fp8 [T, N], row scale_inv fp32 [ceil(N/128), T], col codes fp8 [N, T_pad], col scale_inv fp32
    [ceil(T/128), N]), contiguous. Shared by the launcher and the fake."""
    T, N = dq2d.shape
    e = dq2d.new_empty
    f8 = torch.float8_e4m3fn
    return (e((T, N), dtype=f8), e((cdiv(N, FP8_BLOCK), T), dtype=torch.float32),
            e((N, _fp8_block.round_up(T, _fp8_block.T_PAD)), dtype=f8), e((cdiv(T, FP8_BLOCK), N), dtype=torch.float32))


def _check(dq2d, cos_h, sin_h, num_heads, head_dim, qk_head_dim, rope_dim, rope_style):
    _fp8_block.check_float_tensor("dq2d", dq2d)
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim), ("rope_dim", rope_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(qk_head_dim, bool) or not isinstance(qk_head_dim, int) or qk_head_dim < 0:
        raise ValueError(f"qk_head_dim must be a non-negative int, got {qk_head_dim!r}")
    if rope_dim % 2 or qk_head_dim + rope_dim > head_dim:
        raise ValueError(f"rope_dim ({rope_dim}) must be even and qk_head_dim + rope_dim ({qk_head_dim} + {rope_dim}) "
                         f"<= head_dim ({head_dim})")
    validate_choice("rope_style", rope_style, ROPE_STYLES)
    if dq2d.dim() != 2 or dq2d.shape[1] != num_heads * head_dim:
        raise ValueError(f"dq2d must be [T, num_heads * head_dim] = [T, {num_heads * head_dim}], got "
                         f"{tuple(dq2d.shape)}")
    if dq2d.stride(1) != 1:
        raise ValueError(f"dq2d must have a unit inner stride, got strides {dq2d.stride()}")
    check_pair_tables(cos_h, sin_h)
    if tuple(cos_h.shape) != (dq2d.shape[0], rope_dim // 2):
        raise ValueError(f"cos_h / sin_h must be [T, rope_dim / 2] = {(dq2d.shape[0], rope_dim // 2)}, got "
                         f"{tuple(cos_h.shape)}")
    if cos_h.device != dq2d.device:
        raise ValueError(f"cos_h / sin_h are on {cos_h.device}, dq2d on {dq2d.device}")


def rope_fp8_block_bwd(dq2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, *, num_heads: int,
                       head_dim: int, qk_head_dim: int, rope_dim: int, rope_style: str, block_scale: str = "pow2",
                       config: RopeFp8BlockConfig | None = None) -> tuple[torch.Tensor, ...]:
    """dq2d [T, num_heads * head_dim] (fp32 / bf16 / fp16, unit inner stride, any row stride), cos_h / sin_h [T, R/2]
    pair tables (`check_pair_tables`) -> the four tensors of `rope_fp8_block_outputs`."""
    _check(dq2d, cos_h, sin_h, num_heads, head_dim, qk_head_dim, rope_dim, rope_style)
    _fp8_block.check_block_scale(block_scale)
    outs = rope_fp8_block_outputs(dq2d)
    rd, rs, cd, cs = outs
    T, N = dq2d.shape
    if T == 0:
        return outs
    cfg = config or default_config(qk_head_dim, rope_dim, head_dim, rope_style, dq2d.device)
    if cfg.unit not in (64, 32) or not (cfg.gather or unit_fits(cfg.unit, qk_head_dim, rope_dim, head_dim,
                                                                  rope_style)):
        raise ValueError(f"config {cfg} does not fit the geometry (qk_head_dim {qk_head_dim}, rope_dim {rope_dim}, "
                         f"head_dim {head_dim}, {rope_style}): unit must be 64 or 32, and contiguous runs "
                         f"(gather=False) need `unit_fits`")
    tj = packed_tokens(cfg.unit, cfg.num_warps)
    if not cfg.gather and tj not in (4, 8, 16):
        raise ValueError(f"config {cfg}: contiguous runs (gather=False) need 4, 8 or 16 tokens per thread; unit "
                         f"{cfg.unit} with {cfg.num_warps} warps gives {tj}")
    n_t, n_n = cdiv(T, FP8_BLOCK), cdiv(N, FP8_BLOCK)
    tokens_on_axis0 = n_t > 65535  # a CUDA grid's y extent
    emulated = _op.emulated(dq2d.device)
    grid = (n_t, n_n) if tokens_on_axis0 else (n_n, n_t)
    if not cfg.gather:
        # codes as int32 words: N % 4 == 0 (W | head_dim) and T_pad % 16 == 0
        _rope_fp8_block_packed_kernel[grid](
            dq_ptr=dq2d, stride_dq=dq2d.stride(0), cos_ptr=cos_h, sin_ptr=sin_h, stride_cs=cos_h.stride(0),
            row_w_ptr=rd.view(torch.int32), row_sinv_ptr=rs, col_w_ptr=cd.view(torch.int32), col_sinv_ptr=cs,
            T=T, T_pad=cd.shape[1], H=num_heads, D=head_dim, NOPE=qk_head_dim, R=rope_dim, STYLE=rope_style,
            W=cfg.unit, TJ=tj, BLOCK_SCALE=_fp8_block.block_scale_code(block_scale),
            TOKENS_ON_AXIS0=tokens_on_axis0, EMULATED=emulated, num_warps=cfg.num_warps, enable_fp_fusion=False,
            **register_cap(cfg.maxnreg),
        )
        return outs
    _rope_fp8_block_gather_kernel[grid](
        dq_ptr=dq2d, stride_dq=dq2d.stride(0), cos_ptr=cos_h, sin_ptr=sin_h, stride_cs=cos_h.stride(0),
        row_data_ptr=rd.view(torch.uint8), row_sinv_ptr=rs, col_data_ptr=cd.view(torch.uint8), col_sinv_ptr=cs,
        T=T, T_pad=cd.shape[1], H=num_heads, D=head_dim, NOPE=qk_head_dim, R=rope_dim, STYLE=rope_style,
        W=cfg.unit, BLOCK_SCALE=_fp8_block.block_scale_code(block_scale),
        TOKENS_ON_AXIS0=tokens_on_axis0,
        EMULATED=emulated, num_warps=cfg.num_warps, enable_fp_fusion=False, **register_cap(cfg.maxnreg),
    )
    return outs


# ------------------------------------------------------------------------------------------------ custom op


def _rope_fp8_block_bwd_impl(dq2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, cfg: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_fp8_block_bwd` with the geometry, rope style and block scale of the layer config cfg
    (`QProjConfig.encode`)."""
    c = QProjConfig.decode(cfg)
    return rope_fp8_block_bwd(dq2d, cos_h, sin_h, num_heads=c.num_heads, head_dim=c.q_head_dim,
                              qk_head_dim=c.qk_head_dim, rope_dim=c.rope_dim, rope_style=c.rope_style,
                              block_scale=c.block_scale)


def _rope_fp8_block_bwd_fake(dq2d, cos_h, sin_h, cfg):
    return rope_fp8_block_outputs(dq2d)


rope_fp8_block_bwd_op = _op.define_op("mla_qproj::rope_fp8_block_bwd", _rope_fp8_block_bwd_impl,
                                      _rope_fp8_block_bwd_fake)
