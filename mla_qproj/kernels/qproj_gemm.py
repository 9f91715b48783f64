"""Forward query GEMM for Hopper with the RoPE + output-quantization epilogue fused (SPEC §1.3-1.5).

# %% Background
y = A · Wᵀ with A [T, K] and W [N = H·D, K] the exact bf16 images of the MXFP8 operands (E4M3·2^k is exact in
bf16), so a bf16 tensor-core GEMM with fp32 accumulation is MXFP8 arithmetic up to the fp32 summation order.
Per head, columns [0, P) and [P + R, D) pass through and the R rope columns hold pairs (a, b) rotated by
a' = a·c - b·s, b' = b·c + a·s (SPEC §3), on the fp32 accumulator.

The kernel never shuffles the accumulator to find a pair's partner. `prepare_fused_weight` permutes W's rows
once (an exact re-arrangement) into tiles of BLOCK_N = 256 rows, each tile two halves of HB = 128 rows:
- pass-through tiles: any 2·HB pass-through output columns (in runs of SEG contiguous output columns);
- rope tiles: the "a" member of HB pairs in the low half and the matching "b" members in the high half.
A program computes acc = A·W'ᵀ for one [BLOCK_M, 2·HB] tile (one 256-wide wgmma) and splits it into the halves
lo, hi (a register renaming in the MMA layout); a rope tile then forms lo' = lo·c - hi·s and hi' = hi·c + lo·s
elementwise, rounded like the reference (FMA contraction off). Each half is stored through an arithmetic column map:
- deepseek / neox: lo' of pair i of a head -> output column P + i, hi' -> P + R/2 + i, so with R/2 % 32 == 0
  every 32 contiguous kernel columns of a half are one MX block of the output (rowwise scale per 32 columns);
- gptj: lo' -> P + 2i, hi' -> P + 2i + 1; an MX block holds 16 columns of each half, so the 16-column amaxes
  of both halves are combined (pass-through tiles are laid out the same way: lo / hi = the two 16-column
  halves of an output MX block).
Columnwise MXFP8 blocks are 32 rows of one column: a [BLOCK_M // 32, 32, HB] reduction in the tile.

The kernel is persistent (one program per SM, GROUP_M-swizzled tile order) and reads A and W' through tensor
descriptors (TMA on sm_90; the interpreter emulates them, zero-filling out-of-bounds rows like TMA does).
Under TRITON_INTERPRET=1 the same kernel runs with three switches: the dot on fp32 upcasts (the interpreter
multiplies bf16 bit patterns as integers), a while loop over tiles (its range() rejects tensor bounds under
numpy 2) and EMULATED rounding (explicit RNE to E4M3 / bf16 and a NaN-ignoring amax; its casts mis-round).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._config import QProjConfig, interpreter_enabled
from ._common import amax_nan_ignoring, cdiv, check_pair_tables, e8m0_from_amax, quantize_e4m3, to_bf16

BLOCK_N = 256  # default rows of W' per tile (two halves of HALF_N); W' is laid out per tile: `prepare_fused_weight(hb)`
# TMA-store epilogue from this many tokens: below it the call is host-bound and the two extra tensor descriptors
# (encoded on the host at every launch) cost more than the faster stores save
TMA_STORE_MIN_T = 8192
HALF_N = BLOCK_N // 2
_MX = 32

__all__ = ["fused_gemm_supported", "prepare_fused_weight", "qproj_gemm_fwd", "fused_layout", "tma_store_supported"]


# ----------------------------------------------------------------------------------------------- layout


def _seg(cfg: QProjConfig) -> int:
    """Largest power of two <= 32 dividing P, D - R and R/2: runs of contiguous output columns in a half."""
    g = math.gcd(math.gcd(cfg.qk_head_dim, cfg.q_head_dim - cfg.rope_dim), cfg.rope_dim // 2)
    return min(g & -g, 32)  # lowest set bit (g > 0 because R/2 > 0)


def _paired(cfg: QProjConfig) -> bool:
    """gptj with MXFP8 out: an MX block holds 16 columns of each half (their amaxes are combined)."""
    return cfg.rope_style == "gptj" and cfg.output_format == "mxfp8"


def fused_gemm_supported(cfg: QProjConfig) -> bool:
    """Geometries the fused kernel covers. bf16 output: all. MXFP8 output: every MX block of the output must be
    one run of kernel columns: P % 32 == 0 and R/2 % 32 == 0 (deepseek, neox) or R/2 % 16 == 0 (gptj)."""
    if not isinstance(cfg, QProjConfig):
        return False
    if cfg.q_lora_rank % 8:  # TMA: row stride of A and W' must be 16-byte aligned
        return False
    if cfg.output_format == "bf16":
        return True
    P, RH = cfg.qk_head_dim, cfg.rope_dim // 2
    return P % _MX == 0 and RH % (16 if cfg.rope_style == "gptj" else _MX) == 0


def tma_store_supported(cfg: QProjConfig, hb: int = HALF_N) -> bool:
    """Output halves are boxes of the [T, H, D] output: P % hb == 0, no trailing pass-through, hb % (R/2) == 0,
    rows of >= 16 bytes (TMA); deepseek / neox only (gptj interleaves the two halves in the output)."""
    P, R, D, RH = cfg.qk_head_dim, cfg.rope_dim, cfg.q_head_dim, cfg.rope_dim // 2
    elem = 1 if cfg.output_format == "mxfp8" else 2
    return (fused_gemm_supported(cfg) and cfg.rope_style != "gptj" and P % hb == 0 and D == P + R
            and hb % RH == 0 and RH * elem >= 16 and (D * elem) % 16 == 0)


@functools.lru_cache(maxsize=64)
def fused_layout(cfg: QProjConfig, hb: int = HALF_N) -> tuple[int, int, int]:
    """(pass-through tiles, rope tiles, rows of W') of the kernel's column order with tiles of 2·hb rows."""
    H, D, R = cfg.num_heads, cfg.q_head_dim, cfg.rope_dim
    nt_pass = cdiv(H * (D - R), 2 * hb)
    nt_rope = cdiv(H * (R // 2), hb)
    return nt_pass, nt_rope, (nt_pass + nt_rope) * 2 * hb


def _column_maps(cfg: QProjConfig, hb: int = HALF_N) -> tuple[torch.Tensor, torch.Tensor]:
    """Host twin of the kernel's column maps: for every row of W' (= kernel column), the source row of W and
    the output column it lands on after RoPE; -1 for padding. Used by `prepare_fused_weight` and the tests."""
    H, D, P, R = cfg.num_heads, cfg.q_head_dim, cfg.qk_head_dim, cfg.rope_dim
    RH, PW = R // 2, D - R
    nt_pass, nt_rope, n_rows = fused_layout(cfg, hb)
    j = torch.arange(hb)
    src, out = [], []
    for n in range(nt_pass):
        for half in range(2):
            if _paired(cfg):
                u = n * hb + j
                c = (u // 16) * 32 + half * 16 + u % 16
            else:
                c = n * 2 * hb + half * hb + j
            k = c % PW
            o = (c // PW) * D + k + torch.where(k >= P, R, 0)
            o = torch.where(c < H * PW, o, -1)
            src.append(o)
            out.append(o)
    for m in range(nt_rope):
        u = m * hb + j
        head, i = u // RH, u % RH
        valid = u < H * RH
        for half in range(2):
            if cfg.rope_style == "neox":
                s = head * D + P + i + half * RH
            else:  # deepseek, gptj: pair i = columns (2i, 2i + 1)
                s = head * D + P + 2 * i + half
            if cfg.rope_style == "gptj":
                o = head * D + P + 2 * i + half
            else:  # deepseek, neox: a' -> P + i, b' -> P + R/2 + i
                o = head * D + P + i + half * RH
            src.append(torch.where(valid, s, -1))
            out.append(torch.where(valid, o, -1))
    return torch.cat(src), torch.cat(out)


def prepare_fused_weight(w_bf16: torch.Tensor, cfg: QProjConfig, hb: int = HALF_N) -> torch.Tensor:
    """W [H·D, K] bf16 -> W' [rows, K] bf16 in the kernel's column order (an exact row permutation, zero rows as
    padding) with tiles of 2·hb rows. Call once per weight version; the result only feeds `qproj_gemm_fwd` with
    the same cfg (and the same HB launch knob, default `HALF_N`)."""
    if not isinstance(w_bf16, torch.Tensor) or w_bf16.dtype != torch.bfloat16:
        raise TypeError(f"w_bf16 must be a bfloat16 tensor, got {getattr(w_bf16, 'dtype', type(w_bf16))}")
    if w_bf16.shape != (cfg.out_features, cfg.q_lora_rank):
        raise ValueError(f"w_bf16 must have shape {(cfg.out_features, cfg.q_lora_rank)}, got {tuple(w_bf16.shape)}")
    src, _ = _column_maps(cfg, hb)
    src = src.to(w_bf16.device)
    w = torch.cat([w_bf16, w_bf16.new_zeros(1, w_bf16.shape[1])])  # row -1 -> the zero row
    return w[src].contiguous()


# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _out_cols(i_n, j, HALF: tl.constexpr, H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
              STYLE: tl.constexpr, PAIRED: tl.constexpr, SEG: tl.constexpr, NT_PASS: tl.constexpr,
              HB: tl.constexpr):
    """Kernel columns j of half HALF of tile column i_n -> (output column in [0, H·D), valid, rope pair index).
    Written as runs of SEG contiguous columns so the compiler sees contiguous, aligned stores."""
    RH: tl.constexpr = R // 2
    PW: tl.constexpr = D - R
    NG: tl.constexpr = max(PW // SEG, 1)  # pass-through runs per head (no pass-through: branch never taken)
    NGR: tl.constexpr = RH // SEG  # rope runs per head (per half)
    if i_n < NT_PASS:
        if PAIRED:
            u = i_n * HB + j
            c = (u // 16) * 32 + HALF * 16 + u % 16
        else:
            c = i_n * (2 * HB) + HALF * HB + j
        g = c // SEG  # run index
        k_g = g % NG
        o = (g // NG) * D + k_g * SEG + tl.where(k_g >= P // SEG, R, 0) + c % SEG
        m = c < H * PW
        i = c * 0
    else:
        u = (i_n - NT_PASS) * HB + j  # global pair index
        g = u // SEG
        head = g // NGR
        i = (g % NGR) * SEG + u % SEG  # pair index inside the head
        if STYLE == "gptj":
            o = head * D + P + 2 * i + HALF
        else:
            o = head * D + P + HALF * RH + i
        m = u < H * RH
    return o, m, i


@triton.jit
def _store_rowwise_scale(rs_ptr, b_byte, o_t, m_t, i_n, GS: tl.constexpr, HALF: tl.constexpr, H: tl.constexpr,
                         D: tl.constexpr, P: tl.constexpr, R: tl.constexpr, STYLE: tl.constexpr,
                         PAIRED: tl.constexpr, SEG: tl.constexpr, NT_PASS: tl.constexpr, HB: tl.constexpr):
    """b_byte [BLOCK_M, HB // GS]: the scale of the MX block starting at kernel column g·GS of the half."""
    o_g, m_g, _ = _out_cols(i_n, tl.arange(0, HB // GS) * GS, HALF, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
    NS: tl.constexpr = H * D // 32
    p = rs_ptr + o_t[:, None] * NS + (o_g // 32)[None, :]
    tl.store(p, b_byte.to(tl.uint8), mask=m_t[:, None] & m_g[None, :])


@triton.jit
def _tma_store_half(desc_pass, desc_rope, b_v, i_m, i_n, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                    HB: tl.constexpr, P: tl.constexpr, R: tl.constexpr, NT_PASS: tl.constexpr):
    """Store one half b_v [BLOCK_M, HB] (output dtype) through a tensor descriptor of the [T, H, D] output (TMA on
    sm_90: asynchronous, drains while the next tile's MMAs run). TMA_STORE geometries: P % HB == 0, no trailing
    pass-through, HB % (R/2) == 0, so a pass-through half is [BLOCK_M, 1, HB] at (token, head, column) and a
    rope half is [BLOCK_M, HB / (R/2), R/2] (the same pair run of HB / (R/2) heads). Rows past T are clipped."""
    RH: tl.constexpr = R // 2
    u = (i_n - NT_PASS) * HB
    if NT_PASS == 0:  # no pass-through tiles (P == 0, no pass descriptor): the pass branch is not compiled at all
        desc_rope.store([i_m * BLOCK_M, u // RH, P + HALF * RH], tl.reshape(b_v, [BLOCK_M, HB // RH, RH]))
    elif i_n < NT_PASS:
        c = i_n * (2 * HB) + HALF * HB
        desc_pass.store([i_m * BLOCK_M, c // P, c % P], tl.reshape(b_v, [BLOCK_M, 1, HB]))
    else:
        desc_rope.store([i_m * BLOCK_M, u // RH, P + HALF * RH], tl.reshape(b_v, [BLOCK_M, HB // RH, RH]))


@triton.jit
def _store_half(b_y, i_m, i_n, o_t, m_t, o_tb, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass, yd_rope, cd_pass, cd_rope, T,
                HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, HB: tl.constexpr, H: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                R: tl.constexpr, STYLE: tl.constexpr, PAIRED: tl.constexpr, SEG: tl.constexpr,
                NT_PASS: tl.constexpr, OUT_FORMAT: tl.constexpr, COLWISE: tl.constexpr,
                SCALE_MODE: tl.constexpr, EMULATED: tl.constexpr, TMA_STORE: tl.constexpr):
    """Store one half b_y [BLOCK_M, HB] (fp32, after RoPE): bf16, or MXFP8 rowwise (unless PAIRED, done by the
    caller) and columnwise."""
    N: tl.constexpr = H * D
    o_n, m_n, _ = _out_cols(i_n, tl.arange(0, HB), HALF, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
    m = m_t[:, None] & m_n[None, :]
    o_y = o_t[:, None] * N + o_n[None, :]  # [BLOCK_M, HB] int64
    if STYLE != "gptj":
        # deepseek / neox: each aligned run of V kernel columns lands on V contiguous output columns starting at a
        # multiple of V (SEG divides P, R/2, D - R, hence D and N; a half starts at a multiple of HB). Triton 3.6
        # derives this itself (the hint leaves its sm_90 code unchanged); Triton 3.9 does not, and without the hint
        # stores every element by itself (STG.U8 / U16 instead of 128-bit stores)
        V: tl.constexpr = min(SEG, HB)
        o_y = tl.max_contiguous(tl.multiple_of(o_y, [1, V]), [1, V])
    if OUT_FORMAT == "bf16":
        if TMA_STORE:
            _tma_store_half(yd_pass, yd_rope, to_bf16(b_y, EMULATED), i_m, i_n, HALF, BLOCK_M, HB, P, R, NT_PASS)
        else:
            tl.store(y_ptr + o_y, to_bf16(b_y, EMULATED), mask=m)
    else:
        tl.static_assert(OUT_FORMAT == "mxfp8")
        if not PAIRED:
            b_y3 = tl.reshape(b_y, [BLOCK_M, HB // 32, 32])
            b_byte = e8m0_from_amax(amax_nan_ignoring(b_y3, 2, EMULATED), SCALE_MODE)  # [BLOCK_M, HB // 32]
            b_q = tl.reshape(quantize_e4m3(b_y3, b_byte[:, :, None], EMULATED, False), [BLOCK_M, HB])
            if TMA_STORE:
                _tma_store_half(yd_pass, yd_rope, b_q, i_m, i_n, HALF, BLOCK_M, HB, P, R, NT_PASS)
            else:
                tl.store(y_ptr + o_y, b_q, mask=m)
            _store_rowwise_scale(rs_ptr, b_byte, o_t, m_t, i_n, 32, HALF, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS,
                                 HB)
        if COLWISE:
            # rows past T become NaN: ignored by the amax, so a partial block's amax is over the rows that exist
            b_c3 = tl.reshape(tl.where(m_t[:, None], b_y, float("nan")), [BLOCK_M // 32, 32, HB])
            b_cbyte = e8m0_from_amax(amax_nan_ignoring(b_c3, 1, EMULATED), SCALE_MODE)  # [BLOCK_M // 32, HB]
            b_cq = tl.reshape(quantize_e4m3(b_c3, b_cbyte[:, None, :], EMULATED, False), [BLOCK_M, HB])
            if TMA_STORE:
                _tma_store_half(cd_pass, cd_rope, b_cq, i_m, i_n, HALF, BLOCK_M, HB, P, R, NT_PASS)
            else:
                tl.store(cd_ptr + o_y, b_cq, mask=m)
            m_b = o_tb < tl.cdiv(T, 32)  # o_tb [BLOCK_M // 32]: rows of the column scale
            tl.store(cs_ptr + o_tb[:, None] * N + o_n[None, :], b_cbyte.to(tl.uint8), mask=m_b[:, None] & m_n[None, :])


def _launch_metadata(grid, kernel, args):
    T, N, K = args["T"], args["H"] * args["D"], args["K"]
    return {"name": f"qproj_gemm_fwd T={T} N={N} K={K}", "flops": 2.0 * T * N * K}


@triton.jit
def _tile_coords(tile, num_m, NT_N: tl.constexpr, GROUP_M: tl.constexpr):
    """GROUP_M-swizzled (row block, tile column) of a linear tile index (L2 reuse of W' across row blocks)."""
    IN_GROUP: tl.constexpr = GROUP_M * NT_N
    first_m = (tile // IN_GROUP) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    i_m = first_m + (tile % IN_GROUP) % group_m
    i_n = (tile % IN_GROUP) // group_m
    return i_m, i_n


@triton.jit
def _mainloop(a_desc, w_desc, i_m, i_n, K: tl.constexpr, BLOCK_M: tl.constexpr, HB: tl.constexpr,
              BLOCK_K: tl.constexpr, TWO_DOTS: tl.constexpr, DOT_F32: tl.constexpr):
    """(lo, hi) = A[i_m] · W'[i_n]ᵀ, the two [BLOCK_M, HB] halves, fp32."""
    o_am = i_m * BLOCK_M
    o_wn = i_n * (2 * HB)
    if TWO_DOTS:
        b_lo = tl.zeros([BLOCK_M, HB], dtype=tl.float32)
        b_hi = tl.zeros([BLOCK_M, HB], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_M, 2 * HB], dtype=tl.float32)
    for i_k in range((K + BLOCK_K - 1) // BLOCK_K):
        o_k = i_k * BLOCK_K
        b_a = a_desc.load([o_am, o_k])  # [BLOCK_M, BLOCK_K]
        if DOT_F32:  # the interpreter multiplies bf16 as integers: upcast (exact) and use an ieee fp32 dot
            b_a = b_a.to(tl.float32)
        if TWO_DOTS:
            b_wl = w_desc.load([o_wn, o_k])  # [HB, BLOCK_K]
            b_wh = w_desc.load([o_wn + HB, o_k])  # [HB, BLOCK_K]
            if DOT_F32:
                b_lo = tl.dot(b_a, b_wl.to(tl.float32).T, b_lo, input_precision="ieee")
                b_hi = tl.dot(b_a, b_wh.to(tl.float32).T, b_hi, input_precision="ieee")
            else:
                b_lo = tl.dot(b_a, b_wl.T, b_lo)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, HB]
                b_hi = tl.dot(b_a, b_wh.T, b_hi)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, HB]
        else:
            b_w = w_desc.load([o_wn, o_k])  # [2 * HB, BLOCK_K]
            if DOT_F32:
                b_acc = tl.dot(b_a, b_w.to(tl.float32).T, b_acc, input_precision="ieee")
            else:
                b_acc = tl.dot(b_a, b_w.T, b_acc)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, 2 * HB]
    if not TWO_DOTS:
        b_lo, b_hi = tl.split(tl.permute(tl.reshape(b_acc, [BLOCK_M, 2, HB]), (0, 2, 1)))
    return b_lo, b_hi


@triton.jit
def _epilogue(b_lo, b_hi, i_m, i_n, cos_ptr, sin_ptr, stride_cs, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass, yd_rope,
              cd_pass, cd_rope, T,
              H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr, STYLE: tl.constexpr,
              PAIRED: tl.constexpr, SEG: tl.constexpr, OUT_FORMAT: tl.constexpr, COLWISE: tl.constexpr,
              SCALE_MODE: tl.constexpr, NT_PASS: tl.constexpr, BLOCK_M: tl.constexpr, HB: tl.constexpr,
              ROPE_BCAST: tl.constexpr, EMULATED: tl.constexpr, TMA_STORE: tl.constexpr):
    """RoPE on a rope tile's halves, then bf16 / MXFP8 stores of both halves."""
    RH: tl.constexpr = R // 2
    o_t = i_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows, int64 offsets
    m_t = o_t < T
    o_tb = i_m.to(tl.int64) * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)  # [BLOCK_M // 32] col-scale rows

    if i_n >= NT_PASS:  # rope tile: lo holds the pairs' "a" members, hi the matching "b" members
        if ROPE_BCAST:  # HB % RH == 0: every RH-run of a half has pair indices 0..RH-1, so load [BLOCK_M, RH]
            o_i = tl.arange(0, RH)
            m_c = m_t[:, None] & (o_i < RH)[None, :]
            o_cs = o_t[:, None] * stride_cs + o_i[None, :]
            b_c = tl.load(cos_ptr + o_cs, mask=m_c, other=0.0).to(tl.float32)[:, None, :]  # [BLOCK_M, 1, RH]
            b_s = tl.load(sin_ptr + o_cs, mask=m_c, other=0.0).to(tl.float32)[:, None, :]  # [BLOCK_M, 1, RH]
            # the tables are broadcast to the halves' [BLOCK_M, HB] shape, not the halves reshaped to the tables':
            # the same code under Triton 3.6, and Triton 3.9 (sm_90) cannot compile the reshaped halves flowing out
            # of this branch into the bf16 TMA-store epilogue (its layout propagation gives the branch's results two
            # layouts)
            b_c = tl.reshape(tl.broadcast_to(b_c, [BLOCK_M, HB // RH, RH]), [BLOCK_M, HB])
            b_s = tl.reshape(tl.broadcast_to(b_s, [BLOCK_M, HB // RH, RH]), [BLOCK_M, HB])
            b_lo, b_hi = b_lo * b_c - b_hi * b_s, b_hi * b_c + b_lo * b_s  # a' = a c - b s, b' = b c + a s
        else:
            _, m_i, o_i = _out_cols(i_n, tl.arange(0, HB), 0, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
            m_c = m_t[:, None] & m_i[None, :]
            o_cs = o_t[:, None] * stride_cs + o_i[None, :]
            b_c = tl.load(cos_ptr + o_cs, mask=m_c, other=0.0).to(tl.float32)  # [BLOCK_M, HB]
            b_s = tl.load(sin_ptr + o_cs, mask=m_c, other=0.0).to(tl.float32)  # [BLOCK_M, HB]
            b_lo, b_hi = b_lo * b_c - b_hi * b_s, b_hi * b_c + b_lo * b_s

    if PAIRED:  # gptj MXFP8: one MX block = 16 columns of each half, amaxes combined
        N: tl.constexpr = H * D
        b_l3 = tl.reshape(b_lo, [BLOCK_M, HB // 16, 16])
        b_h3 = tl.reshape(b_hi, [BLOCK_M, HB // 16, 16])
        b_ml = amax_nan_ignoring(b_l3, 2, EMULATED)  # [BLOCK_M, HB // 16]
        b_mh = amax_nan_ignoring(b_h3, 2, EMULATED)
        b_m = tl.where(b_ml != b_ml, b_mh, tl.where(b_mh != b_mh, b_ml, tl.maximum(b_ml, b_mh)))  # NaN-ignoring
        b_byte = e8m0_from_amax(b_m, SCALE_MODE)
        o_l, m_l, _ = _out_cols(i_n, tl.arange(0, HB), 0, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
        o_h, m_h, _ = _out_cols(i_n, tl.arange(0, HB), 1, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
        b_ql = tl.reshape(quantize_e4m3(b_l3, b_byte[:, :, None], EMULATED, False), [BLOCK_M, HB])
        b_qh = tl.reshape(quantize_e4m3(b_h3, b_byte[:, :, None], EMULATED, False), [BLOCK_M, HB])
        tl.store(y_ptr + o_t[:, None] * N + o_l[None, :], b_ql, mask=m_t[:, None] & m_l[None, :])
        tl.store(y_ptr + o_t[:, None] * N + o_h[None, :], b_qh, mask=m_t[:, None] & m_h[None, :])
        _store_rowwise_scale(rs_ptr, b_byte, o_t, m_t, i_n, 16, 0, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
    _store_half(b_lo, i_m, i_n, o_t, m_t, o_tb, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass, yd_rope, cd_pass, cd_rope, T,
                0, BLOCK_M, HB, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, OUT_FORMAT, COLWISE, SCALE_MODE, EMULATED,
                TMA_STORE)
    _store_half(b_hi, i_m, i_n, o_t, m_t, o_tb, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass, yd_rope, cd_pass, cd_rope, T,
                1, BLOCK_M, HB, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, OUT_FORMAT, COLWISE, SCALE_MODE, EMULATED,
                TMA_STORE)


@triton.jit(launch_metadata=_launch_metadata)
def _qproj_gemm_fwd_kernel(
    a_desc, w_desc,  # [T, K] bf16 ; [(NT_PASS + NT_ROPE) * 2 * HB, K] bf16 (W' rows = kernel columns)
    cos_ptr, sin_ptr, stride_cs,  # [T, R // 2] fp32 / bf16 / fp16 pair tables, unit inner stride, row stride
    y_ptr, rs_ptr, cd_ptr, cs_ptr,  # outputs: bf16 y [T, H, D] | fp8 row data, row scale, col data, col scale
    yd_pass, yd_rope, cd_pass, cd_rope,  # TMA_STORE: descriptors of y / col data viewed [T, H, D] (else None)
    T,
    K: tl.constexpr, H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    STYLE: tl.constexpr, PAIRED: tl.constexpr, SEG: tl.constexpr,
    OUT_FORMAT: tl.constexpr, COLWISE: tl.constexpr, SCALE_MODE: tl.constexpr,
    NT_PASS: tl.constexpr, NT_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, HB: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    TWO_DOTS: tl.constexpr, ROPE_BCAST: tl.constexpr, EMULATED: tl.constexpr, DOT_F32: tl.constexpr,
    FLATTEN: tl.constexpr, SERIAL_LOOP: tl.constexpr, EPILOGUE: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """lo = A·W'_loᵀ, hi = A·W'_hiᵀ (fp32); rope tiles: lo' = lo·c - hi·s, hi' = hi·c + lo·s;
    then each half -> bf16 or MXFP8 (rowwise 32-blocks along each head's D, columnwise 32-blocks along T)."""
    NT_N: tl.constexpr = NT_PASS + NT_ROPE
    i_sm = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    num_tiles = num_m * NT_N
    if SERIAL_LOOP:  # interpreter: its range() cannot take tensor bounds (numpy 2), a while loop can
        tile = i_sm
        while tile < num_tiles:
            i_m, i_n = _tile_coords(tile, num_m, NT_N, GROUP_M)
            b_lo, b_hi = _mainloop(a_desc, w_desc, i_m, i_n, K, BLOCK_M, HB, BLOCK_K, TWO_DOTS, DOT_F32)
            _epilogue(b_lo, b_hi, i_m, i_n, cos_ptr, sin_ptr, stride_cs, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass,
                      yd_rope, cd_pass, cd_rope, T, H, D, P, R, STYLE, PAIRED, SEG, OUT_FORMAT, COLWISE, SCALE_MODE,
                      NT_PASS, BLOCK_M, HB, ROPE_BCAST, EMULATED, TMA_STORE)
            tile += NUM_SMS
    else:
        tile_c = i_sm - NUM_SMS  # the epilogue's own counter: the next tile's loads can be hoisted over it
        for tile in tl.range(i_sm, num_tiles, NUM_SMS, flatten=FLATTEN):
            i_m, i_n = _tile_coords(tile, num_m, NT_N, GROUP_M)
            b_lo, b_hi = _mainloop(a_desc, w_desc, i_m, i_n, K, BLOCK_M, HB, BLOCK_K, TWO_DOTS, DOT_F32)
            tile_c += NUM_SMS
            i_m, i_n = _tile_coords(tile_c, num_m, NT_N, GROUP_M)
            if EPILOGUE:
                _epilogue(b_lo, b_hi, i_m, i_n, cos_ptr, sin_ptr, stride_cs, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass,
                          yd_rope, cd_pass, cd_rope, T, H, D, P, R, STYLE, PAIRED, SEG, OUT_FORMAT, COLWISE, SCALE_MODE,
                          NT_PASS, BLOCK_M, HB, ROPE_BCAST, EMULATED, TMA_STORE)
            elif T < 0:  # benchmark knob EPILOGUE=False: the GEMM alone (never stores, but keeps the dots alive)
                tl.store(y_ptr + tl.arange(0, HB), (b_lo + b_hi).reshape(BLOCK_M, HB).max(axis=0).to(
                    y_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------- launcher


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_config(T: int, device: torch.device) -> dict:
    """Fixed configs keyed on a T bucket (autotuning costs seconds per config). The tile width (2·HB) is W' layout's."""
    if device.type != "cuda":  # interpreter: small tiles keep the CPU emulation quick and exercise edges
        return dict(BLOCK_M=32, BLOCK_K=32, GROUP_M=2, NUM_SMS=3, num_warps=4, num_stages=1)
    if T <= 64:
        return dict(BLOCK_M=64, BLOCK_K=64, GROUP_M=8, NUM_SMS=_num_sms(device.index or 0), num_warps=4,
                    num_stages=4)
    return dict(BLOCK_M=128, BLOCK_K=64, GROUP_M=8, NUM_SMS=_num_sms(device.index or 0), num_warps=8,
                num_stages=3)


def _check_inputs(a, w_prepared, cos_h, sin_h, cfg, hb):
    if not isinstance(cfg, QProjConfig):
        raise TypeError(f"cfg must be a QProjConfig, got {type(cfg).__name__}")
    if not fused_gemm_supported(cfg):
        raise ValueError(f"qproj_gemm_fwd does not cover this geometry: {cfg}")
    for name, t in (("a", a), ("w_prepared", w_prepared), ("cos_h", cos_h), ("sin_h", sin_h)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a on {a.device}")
    for name, t in (("a", a), ("w_prepared", w_prepared)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be {torch.bfloat16}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_pair_tables(cos_h, sin_h)
    T, K = a.shape if a.dim() == 2 else (None, None)
    if a.dim() != 2 or K != cfg.q_lora_rank:
        raise ValueError(f"a must be [T, {cfg.q_lora_rank}], got {tuple(a.shape)}")
    rows = fused_layout(cfg, hb)[2]
    if tuple(w_prepared.shape) != (rows, K):
        raise ValueError(f"w_prepared must be [{rows}, {K}] (from prepare_fused_weight), got {tuple(w_prepared.shape)}")
    for name, t in (("cos_h", cos_h), ("sin_h", sin_h)):
        if tuple(t.shape) != (T, cfg.rope_dim // 2):
            raise ValueError(f"{name} must be [T, R/2] = {(T, cfg.rope_dim // 2)}, got {tuple(t.shape)}")


def qproj_gemm_fwd(a: torch.Tensor, w_prepared: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor,
                   cfg: QProjConfig, *, check: bool = True, **overrides) -> tuple:
    """q = RoPE(a · Wᵀ) viewed [T, H, D], then quantized exactly as `reference.qproj.quantize_output`.

    Args:
        a: [T, K] bf16, contiguous (exact image of the quantized input).
        w_prepared: `prepare_fused_weight(W, cfg)`.
        cos_h, sin_h: [T, R/2] fp32 contiguous pair tables.
        check: validate the arguments (False: for a caller that built them itself, as the layer does; skips a few
            tens of microseconds of host work per call).
        overrides: launch knobs for benchmarks and tests (BLOCK_M, BLOCK_K, GROUP_M, num_warps, num_stages,
            TWO_DOTS, ROPE_BCAST, EMULATED, FLATTEN, EPILOGUE, TMA_STORE, maxnreg, NUM_SMS, HB); every
            combination gives the same bytes (EPILOGUE=False skips the epilogue and leaves the outputs unwritten:
            GEMM-only timing). HB (half-tile width, default `HALF_N`) must be the hb w_prepared was built with.
    Returns:
        mxfp8: (row data fp8 [T, H, D], row scale uint8 [T, H, D/32], col data or None, col scale
        uint8 [ceil(T/32), H, D] or None); bf16: (y bf16 [T, H, D],).
    """
    hb = overrides.pop("HB", HALF_N)
    if check:
        _check_inputs(a, w_prepared, cos_h, sin_h, cfg, hb)
    T, K = a.shape
    H, D, R = cfg.num_heads, cfg.q_head_dim, cfg.rope_dim
    dev = a.device
    if cfg.output_format == "bf16":
        y = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
        rs = cd = cs = None
        outs = (y,)
    else:
        y = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev)
        rs = torch.empty(T, H, D // _MX, dtype=torch.uint8, device=dev)
        cd = cs = None
        if cfg.columnwise_output:
            cd = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev)
            cs = torch.empty(cdiv(T, _MX), H, D, dtype=torch.uint8, device=dev)
        outs = (y, rs, cd, cs)
    if T == 0:
        return outs

    interp = interpreter_enabled()
    conf = _pick_config(T, dev)
    RH = R // 2
    # Defaults measured on an H200 (2026-11-29, T = 16384, MXFP8 rowwise out; scripts/gemm_probe.py):
    # one [BLOCK_M, 256] dot split in registers beats two [BLOCK_M, 128] dots sharing A (1.96 vs 2.44 ms);
    # a flattened persistent loop beats the plain one (1.95 vs 2.01 ms); broadcasting the [BLOCK_M, R/2] pair
    # table beats gathering [BLOCK_M, 128] (which spills: 3.3 ms); the hardware E4M3 cast and max.f32 beat the
    # emulated rounding (2.34 ms) with identical bytes. GEMM alone (EPILOGUE=False): 1.64 ms.
    # 2026-11-30 (scripts/gemm_probe.py --variants tma): storing the outputs through tensor descriptors (TMA_STORE)
    # 1.93 vs 2.07 ms (MXFP8 rowwise), 1.86 vs 1.94 ms (bf16, unflattened loop), 2.68 vs 2.70 ms (row + col).
    knobs = dict(TWO_DOTS=False, ROPE_BCAST=hb % RH == 0 and (RH & (RH - 1)) == 0,
                 EMULATED=interp or dev.type != "cuda", FLATTEN=True, SERIAL_LOOP=interp,
                 EPILOGUE=True, TMA_STORE=tma_store_supported(cfg, hb) and T >= TMA_STORE_MIN_T)
    conf.update(knobs)
    conf.update(overrides)
    if conf["TMA_STORE"] and cfg.output_format == "bf16" and "FLATTEN" not in overrides:
        conf["FLATTEN"] = False  # Triton 3.6's loop flattening rejects the bf16 descriptor stores
    if not conf["EPILOGUE"]:  # Triton 3.6's loop-fusion pass rejects the flattened loop without the epilogue
        conf["FLATTEN"] = False
    nt_pass, nt_rope, _ = fused_layout(cfg, hb)
    BLOCK_M, BLOCK_K = conf["BLOCK_M"], conf["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(w_prepared, [hb if conf["TWO_DOTS"] else 2 * hb, BLOCK_K])
    num_tiles = cdiv(T, BLOCK_M) * (nt_pass + nt_rope)
    num_sms = conf.pop("NUM_SMS")

    def grid(meta):
        return (min(meta["NUM_SMS"], num_tiles),)

    descs = dict(yd_pass=None, yd_rope=None, cd_pass=None, cd_rope=None)
    if conf["TMA_STORE"]:
        if not tma_store_supported(cfg, hb):
            raise ValueError(f"TMA_STORE does not cover this geometry: {cfg}")
        P = cfg.qk_head_dim
        for name, t in (("yd", y), ("cd", cd)):
            if t is not None:
                descs[name + "_pass"] = TensorDescriptor.from_tensor(t, [BLOCK_M, 1, hb]) if P else None
                descs[name + "_rope"] = TensorDescriptor.from_tensor(t, [BLOCK_M, hb // RH, RH])
    _qproj_gemm_fwd_kernel[grid](
        a_desc=a_desc, w_desc=w_desc, cos_ptr=cos_h, sin_ptr=sin_h, stride_cs=cos_h.stride(0), **descs,
        y_ptr=y, rs_ptr=rs if rs is not None else y, cd_ptr=cd if cd is not None else y,
        cs_ptr=cs if cs is not None else y,
        T=T, K=K, H=H, D=D, P=cfg.qk_head_dim, R=R,
        STYLE=cfg.rope_style, PAIRED=_paired(cfg), SEG=_seg(cfg),
        OUT_FORMAT=cfg.output_format, COLWISE=cfg.columnwise_output, SCALE_MODE=cfg.scale_mode,
        NT_PASS=nt_pass, NT_ROPE=nt_rope, HB=hb, NUM_SMS=num_sms, DOT_F32=interp,
        enable_fp_fusion=False,  # a·c - b·s rounded as the reference rounds it (no FMA contraction)
        **conf,
    )
    return outs
