"""Forward query GEMM for Hopper with the RoPE + output-quantization epilogue fused (SPEC §1.3-1.5).

# %% Background
y = A · Wᵀ with A [T, K] and W [N = H·D, K] the exact bf16 images of the MXFP8 operands (E4M3·2^k is exact in
bf16), so a bf16 tensor-core GEMM with fp32 accumulation is MXFP8 arithmetic up to the fp32 summation order.
Per head, columns [0, P) and [P + R, D) pass through and the R rope columns hold pairs (a, b) rotated by
a' = a·c - b·s, b' = b·c + a·s (SPEC §3), on the fp32 accumulator.

The kernel never shuffles the accumulator to find a pair's partner. `prepare_fused_weight` permutes W's rows
once (an exact re-arrangement) into tiles of 2·HB rows, each tile two halves of HB rows. The half width HB is the
W' layout's parameter (a constexpr of the kernel): `fused_half_width(cfg, operands)` fixes it per layer, 128 for
bf16 operands ([BLOCK_M, 256] tiles) and 64 for fp8_block operands ([128, 128] tiles, see below):
- pass-through tiles: any 2·HB pass-through output columns (in runs of SEG contiguous output columns);
- rope tiles: the "a" member of HB pairs in the low half and the matching "b" members in the high half.
A program computes acc = A·W'ᵀ for one [BLOCK_M, 2·HB] tile (one 2·HB-wide wgmma) and splits it into the halves
lo, hi (a register renaming in the MMA layout); a rope tile then forms lo' = lo·c - hi·s and hi' = hi·c + lo·s
elementwise, rounded like the reference (FMA contraction off). Each half is stored through an arithmetic column map:
- deepseek / neox: lo' of pair i of a head -> output column P + i, hi' -> P + R/2 + i, so with R/2 % 32 == 0
  every 32 contiguous kernel columns of a half are one MX block of the output (rowwise scale per 32 columns);
- gptj: lo' -> P + 2i, hi' -> P + 2i + 1; an MX block holds 16 columns of each half, so the 16-column amaxes
  of both halves are combined (pass-through tiles are laid out the same way: lo / hi = the two 16-column
  halves of an output MX block).
Columnwise MXFP8 blocks are 32 rows of one column: a [BLOCK_M // 32, 32, HB] reduction in the tile.

Block-scaled FP8 operands (SPEC §5, the `OPERANDS="fp8_block"` main loop; the epilogue is the same): A = the E4M3
codes of xn's 1x128 blocks along K with fp32 scale_inv [K/128, T], W' = the codes of W's 128x128 tiles in the same
row order (each tile's quarters reordered so that a warpgroup owning half of the tile's columns holds whole pairs:
`fused_row_source(cfg, "fp8_block")`) with a per-row scale_inv [K/128, rows] (`prepare_fused_weight_fp8`). Per
128-wide K block one fp8 dot (the tensor core's own accumulation over the block's 128 products) is promoted into
the fp32 accumulator with the block's scales, acc = fma(dot, sa·sw, acc): DeepSeek-V3's recipe. The promotion keeps
the block's dot result live next to the accumulator, so a [BLOCK_M, 2·HB] tile costs 2·BLOCK_M·2·HB/threads fp32
registers: HB = 64 makes [128, 128] tiles with 8 warps fit (64 + 64 per thread) where [128, 256] spills.

The kernel is persistent (one program per SM, GROUP_M-swizzled tile order) and reads A and W' through tensor
descriptors (TMA on sm_90; the interpreter emulates them, zero-filling out-of-bounds rows like TMA does). Its launch
parameters are a `GemmConfig`; `default_config` picks them per operand kind by device and T bucket. Every config
gives the same bytes (fp8 on the GPU: as long as the tensor core's rounding inside a block does not depend on the
MMA instruction shape, which BLOCK_M and num_warps choose: the GPU tests compare configs, BENCHMARKS.md names the
probe that timed them).
Under TRITON_INTERPRET=1 the same kernel runs with three switches: the dot on fp32 upcasts (the interpreter
multiplies bf16 bit patterns as integers), a while loop over tiles (its range() rejects tensor bounds under
numpy 2) and EMULATED rounding (explicit RNE to E4M3 / bf16 and a NaN-ignoring amax; its casts mis-round).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..._config import QProjConfig, interpreter_enabled
from ..._constants import FP8_BLOCK
from ..._constants import MX_BLOCK as _MX
from .. import _op
from ._common import amax, cdiv, check_pair_tables, e8m0_from_amax, mx_quantize, quantize_e4m3, to_bf16, widen

BLOCK_N = 256  # rows of W' per tile with the bf16 operands' half width HALF_N (W' tiles are 2·HB rows)
# TMA-store epilogue from this many tokens: below it the call is host-bound and the two extra tensor descriptors
# (encoded on the host at every launch) cost more than the faster stores save
TMA_STORE_MIN_T = 8192
HALF_N = BLOCK_N // 2
HALF_WIDTHS = (64, 128)  # half widths the kernel is built for (the [BLOCK_M, 2·HB] tile is 128 or 256 wide)
OPERANDS = ("bf16", "fp8_block")

__all__ = ["GemmConfig", "default_config", "fused_gemm_supported", "fused_half_width", "fused_layout",
           "fused_row_source", "fused_rows", "fused_runs_on", "prepare_fused_weight", "prepare_fused_weight_fp8",
           "qproj_gemm_fp8_fwd_op", "qproj_gemm_fwd", "qproj_gemm_fwd_op", "qproj_gemm_outputs", "tma_store_supported"]


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


def fused_half_width(cfg: QProjConfig, operands: str = "bf16") -> int:
    """HB, the W' layout's half width for these operands: a function of the layer's geometry and precision only
    (the layer lays W' out once, `fused_row_source`), never of T. bf16 operands: 128 (one [BLOCK_M, 256] dot split
    in registers, measured best). fp8_block: 128 as well: [64, 256] tiles ran faster on the H200 than the [128, 128]
    tiles of HB = 64 (BENCHMARKS.md: 2.01 vs 2.05-2.13 ms at T = 16384, bf16 out); HB = 64 stays supported
    (`GemmConfig.HB`, with W' laid out for it). cfg is taken for the signature's sake: every geometry
    `fused_gemm_supported` covers works with either width."""
    if operands in OPERANDS:
        return HALF_N
    raise ValueError(f"operands must be one of {OPERANDS}, got {operands!r}")


def _check_hb(hb: int) -> int:
    if hb not in HALF_WIDTHS:
        raise ValueError(f"half width must be one of {HALF_WIDTHS}, got {hb!r}")
    return hb


def tma_store_supported(cfg: QProjConfig, hb: int = HALF_N) -> bool:
    """Output halves (hb columns) are boxes of the [T, H, D] output: P % hb == 0, no trailing pass-through,
    hb % (R/2) == 0, rows of >= 16 bytes (TMA); deepseek / neox only (gptj interleaves the two halves)."""
    P, R, D, RH = cfg.qk_head_dim, cfg.rope_dim, cfg.q_head_dim, cfg.rope_dim // 2
    elem = 1 if cfg.output_format == "mxfp8" else 2
    return (fused_gemm_supported(cfg) and cfg.rope_style != "gptj" and P % hb == 0 and D == P + R
            and hb % RH == 0 and RH * elem >= 16 and (D * elem) % 16 == 0)


def fused_layout(cfg: QProjConfig, hb: int = HALF_N) -> tuple[int, int, int]:
    """(pass-through tiles, rope tiles, rows of W') of the kernel's column order with tiles of 2·hb rows.
    Plain arithmetic, no cache: `prepare_fused_weight` runs inside the layer's graph under torch.compile."""
    H, D, R = cfg.num_heads, cfg.q_head_dim, cfg.rope_dim
    nt_pass = cdiv(H * (D - R), 2 * hb)
    nt_rope = cdiv(H * (R // 2), hb)
    return nt_pass, nt_rope, (nt_pass + nt_rope) * 2 * hb


def _column_maps(cfg: QProjConfig, hb: int = HALF_N) -> tuple[torch.Tensor, torch.Tensor]:
    """Host twin of the kernel's column maps for half width hb: for every kernel column (row of W' in the bf16
    order), the source row of W and the output column it lands on after RoPE; -1 for padding. Used by
    `fused_row_source` and the tests."""
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


def fused_row_source(cfg: QProjConfig, operands: str = "bf16", hb: int | None = None) -> torch.Tensor:
    """int64 [rows of W']: the row of W that each row of W' comes from, -1 for padding: the permutation
    `prepare_fused_weight` ("bf16") / `prepare_fused_weight_fp8` ("fp8_block") applies; a caller may compute it
    once per layer and pass it as `src`. hb: the half width (default `fused_half_width(cfg, operands)`; the launch
    config's HB must match it). "bf16": row r of W' is kernel column r (`_column_maps`). "fp8_block": the same
    rows with each 2·hb-row tile's quarters reordered [lo 0:hb/2, hi 0:hb/2, lo hb/2:hb, hi hb/2:hb], so that a
    warpgroup owning half of a tile's columns (8 warps side by side along N: BLOCK_M = 64) holds both members of
    its pairs; with the warpgroups stacked along M (BLOCK_M = 128) every thread holds all of the tile's columns and
    the order is as good as the bf16 one (see `_mainloop`)."""
    hb = _check_hb(fused_half_width(cfg, operands) if hb is None else hb)
    src = _column_maps(cfg, hb)[0]
    if operands == "bf16":
        return src
    q = hb // 2  # [tiles, half, quarter, q] -> [tiles, quarter, half, q]
    return src.reshape(-1, 2, 2, q).transpose(1, 2).reshape(-1)


_ROWS: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def fused_runs_on(device: torch.device) -> bool:
    """The fused kernel is built for sm_90 and newer (TMA descriptors, wgmma-sized tiles); the interpreter runs it
    on the CPU. Older GPUs take the general path."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


@torch.compiler.assume_constant_result
def fused_rows(encoded_cfg: str, operands: str, device: torch.device) -> torch.Tensor:
    """`fused_row_source(cfg, operands)` on `device`, computed once per (config, operands, device) and kept: the
    layer asks for it at every weight preparation. A constant of the graph under torch.compile (its Python loops
    run once, at trace time). encoded_cfg: `cfg.encode()` of a config `fused_gemm_supported` accepts."""
    key = (encoded_cfg, operands, device)
    src = _ROWS.get(key)
    if src is None:
        src = _ROWS[key] = fused_row_source(QProjConfig.decode(encoded_cfg), operands).to(device)
    return src


def prepare_fused_weight(w_bf16: torch.Tensor, cfg: QProjConfig, src: torch.Tensor | None = None,
                         hb: int | None = None) -> torch.Tensor:
    """W [H·D, K] bf16 -> W' [rows, K] bf16 in the kernel's column order (an exact row permutation, zero rows as
    padding). Call once per weight version; the result only feeds `qproj_gemm_fwd` with the same cfg (and a launch
    config with HB = hb). src: `fused_row_source(cfg, "bf16", hb)` if already computed (any device); hb: the half
    width (default `fused_half_width(cfg)`), ignored when src is given."""
    if not isinstance(w_bf16, torch.Tensor) or w_bf16.dtype != torch.bfloat16:
        raise TypeError(f"w_bf16 must be a bfloat16 tensor, got {getattr(w_bf16, 'dtype', type(w_bf16))}")
    if w_bf16.shape != (cfg.out_features, cfg.q_lora_rank):
        raise ValueError(f"w_bf16 must have shape {(cfg.out_features, cfg.q_lora_rank)}, got {tuple(w_bf16.shape)}")
    src = (fused_row_source(cfg, "bf16", hb) if src is None else src).to(w_bf16.device)
    w = torch.cat([w_bf16, w_bf16.new_zeros(1, w_bf16.shape[1])])  # row -1 -> the zero row
    return w[src].contiguous()


def prepare_fused_weight_fp8(w_data: torch.Tensor, w_scale_inv: torch.Tensor, cfg: QProjConfig,
                             src: torch.Tensor | None = None,
                             hb: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W's 128x128-tile FP8 codes (SPEC §5) -> the kernel's operand: (W' codes, W' scale_inv), exact.

    Args:
        w_data: float8_e4m3fn [H·D, K] codes of W; w_scale_inv: float32 [ceil(H·D / 128), K / 128] tile scale_inv.
        src: `fused_row_source(cfg, "fp8_block", hb)` if already computed (any device).
        hb: the half width (default `fused_half_width(cfg, "fp8_block")`), ignored when src is given.
    Returns:
        W' float8_e4m3fn [rows, K]: row r is W's row src(r) (code 0 for padding rows); its scale_inv float32
        [K / 128, rows] (K-block major: the kernel loads one [2·hb] row slice per K block): element [kb, r] is
        w_scale_inv[src(r) // 128, kb], 0 for padding rows.
    """
    N, K = cfg.out_features, cfg.q_lora_rank
    if not isinstance(w_data, torch.Tensor) or w_data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"w_data must be a float8_e4m3fn tensor, got {getattr(w_data, 'dtype', type(w_data))}")
    if not isinstance(w_scale_inv, torch.Tensor) or w_scale_inv.dtype != torch.float32:
        raise TypeError(f"w_scale_inv must be a float32 tensor, got {getattr(w_scale_inv, 'dtype', type(w_scale_inv))}")
    if K % FP8_BLOCK:
        raise ValueError(f"q_lora_rank must be a multiple of {FP8_BLOCK} for fp8_block operands, got {K}")
    if tuple(w_data.shape) != (N, K):
        raise ValueError(f"w_data must have shape {(N, K)}, got {tuple(w_data.shape)}")
    if tuple(w_scale_inv.shape) != (cdiv(N, FP8_BLOCK), K // FP8_BLOCK):
        raise ValueError(f"w_scale_inv must have shape {(cdiv(N, FP8_BLOCK), K // FP8_BLOCK)}, got "
                         f"{tuple(w_scale_inv.shape)}")
    if w_scale_inv.device != w_data.device:
        raise ValueError(f"w_scale_inv is on {w_scale_inv.device}, w_data on {w_data.device}")
    src = (fused_row_source(cfg, "fp8_block", hb) if src is None else src).to(w_data.device)
    codes = w_data.view(torch.uint8)  # index the bytes: exact, and fp8 indexing is not on every device
    codes = torch.cat([codes, codes.new_zeros(1, K)])[src]  # row -1 -> the zero row
    sinv = torch.cat([w_scale_inv, w_scale_inv.new_zeros(1, K // FP8_BLOCK)])
    sinv = sinv[torch.where(src >= 0, src // FP8_BLOCK, -1)]  # [rows, K / 128]; padding -> the zero row
    return codes.view(torch.float8_e4m3fn).contiguous(), sinv.t().contiguous()


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
            b_q, b_byte = mx_quantize(b_y3, 2, SCALE_MODE, EMULATED, False)  # b_byte [BLOCK_M, HB // 32]
            b_q = tl.reshape(b_q, [BLOCK_M, HB])
            if TMA_STORE:
                _tma_store_half(yd_pass, yd_rope, b_q, i_m, i_n, HALF, BLOCK_M, HB, P, R, NT_PASS)
            else:
                tl.store(y_ptr + o_y, b_q, mask=m)
            _store_rowwise_scale(rs_ptr, b_byte, o_t, m_t, i_n, 32, HALF, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS,
                                 HB)
        if COLWISE:
            # rows past T become NaN: ignored by the amax, so a partial block's amax is over the rows that exist
            b_c3 = tl.reshape(tl.where(m_t[:, None], b_y, float("nan")), [BLOCK_M // 32, 32, HB])
            b_cq, b_cbyte = mx_quantize(b_c3, 1, SCALE_MODE, EMULATED, False)  # b_cbyte [BLOCK_M // 32, HB]
            b_cq = tl.reshape(b_cq, [BLOCK_M, HB])
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
def _e4m3_to_f32(b_q):
    """E4M3 codes -> their fp32 values (exact) under the interpreter, whose cast decodes the NaN codes 0x7F / 0xFF
    as ±480."""
    b_v = b_q.to(tl.float32)
    return tl.where((b_q.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), b_v)


@triton.jit
def _mainloop(a_desc, w_desc, sa_ptr, sw_ptr, i_m, i_n, T, K: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_M: tl.constexpr, HB: tl.constexpr, BLOCK_K: tl.constexpr, OPERANDS: tl.constexpr,
              DOT_F32: tl.constexpr):
    """(lo, hi) = A[i_m] · W'[i_n]ᵀ, the two [BLOCK_M, HB] halves, fp32: one [BLOCK_M, 2·HB] dot split in registers.

    OPERANDS "bf16": A, W' bf16, one fp32 accumulation over K. "fp8_block" (SPEC §5, DeepSeek-V3's recipe): A, W'
    E4M3 codes in 128-wide K blocks with fp32 scale_inv sa [K/128, T] (per token) and sw [K/128, ROWS] (per W' row);
    each block's dot is promoted to the fp32 accumulator with its scales: acc = fma(A_kb·W'_kbᵀ, sa·sw, acc)."""
    o_am = i_m * BLOCK_M
    o_wn = i_n * (2 * HB)
    b_acc = tl.zeros([BLOCK_M, 2 * HB], dtype=tl.float32)
    if OPERANDS == "bf16":
        for i_k in range((K + BLOCK_K - 1) // BLOCK_K):
            o_k = i_k * BLOCK_K
            b_a = a_desc.load([o_am, o_k])  # [BLOCK_M, BLOCK_K]
            b_w = w_desc.load([o_wn, o_k])  # [2 * HB, BLOCK_K]
            if DOT_F32:  # the interpreter multiplies bf16 as integers: upcast (exact) and use an ieee fp32 dot
                b_acc = tl.dot(widen(b_a, True), widen(b_w, True).T, b_acc, input_precision="ieee")
            else:
                b_acc = tl.dot(b_a, b_w.T, b_acc)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, 2 * HB]
        b_lo, b_hi = tl.split(tl.permute(tl.reshape(b_acc, [BLOCK_M, 2, HB]), (0, 2, 1)))
    else:
        tl.static_assert(OPERANDS == "fp8_block")
        tl.static_assert(BLOCK_K == 128)  # one scale block per step (SPEC §5: 1x128 and 128x128 blocks)
        NK: tl.constexpr = K // BLOCK_K
        o_m = i_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
        m_m = o_m < T
        p_sa = sa_ptr + o_m  # [BLOCK_M] scale_inv of K block 0; the next block's is T further on
        p_sw = sw_ptr + i_n.to(tl.int64) * (2 * HB) + tl.arange(0, 2 * HB)  # [2 * HB]; next block ROWS further
        # the scales are loaded one block ahead: Triton's pipeliner only prefetches loads that feed a dot, so this
        # hides their latency behind the current block's MMAs by hand
        b_sa_n = tl.load(p_sa, mask=m_m, other=0.0)  # [BLOCK_M] fp32
        b_sw_n = tl.load(p_sw)  # [2 * HB] fp32 (padding rows of W' have scale 0)
        for i_k in range(NK):
            o_k = i_k * BLOCK_K
            b_a = a_desc.load([o_am, o_k])  # [BLOCK_M, BLOCK_K] e4m3
            b_w = w_desc.load([o_wn, o_k])  # [2 * HB, BLOCK_K] e4m3
            b_sa, b_sw = b_sa_n, b_sw_n
            p_sa += T
            p_sw += ROWS
            b_sa_n = tl.load(p_sa, mask=m_m & (i_k + 1 < NK), other=0.0)  # [BLOCK_M] next block's (or 0 past K)
            b_sw_n = tl.load(p_sw, mask=i_k + 1 < NK, other=0.0)  # [2 * HB]
            if DOT_F32:  # interpreter: exact fp32 images of the codes, ieee fp32 dot
                b_d = tl.dot(_e4m3_to_f32(b_a), _e4m3_to_f32(b_w).T, input_precision="ieee")
            else:
                # the tensor core's fp8 accumulation over this block's 128 products, no promotion inside the dot
                # (max_num_imprecise_acc = BLOCK_K): the promotion is the fma below, once per block (DeepSeek-V3)
                b_d = tl.dot(b_a, b_w.T, max_num_imprecise_acc=BLOCK_K)  # [BLOCK_M, 128] @ [128, 2 * HB]
            b_acc = tl.fma(b_d, b_sa[:, None] * b_sw[None, :], b_acc)
        # W' tile rows are [lo 0:HB/2, hi 0:HB/2, lo HB/2:HB, hi HB/2:HB] (`fused_row_source(cfg, "fp8_block")`):
        # when the two warpgroups split the tile along N (BLOCK_M = 64, 8 warps), each holds both members of its
        # pairs, so this split is a register renaming too (the bf16 order would move the tile through shared
        # memory); when they split it along M (BLOCK_M = 128) every thread holds all 2·HB columns either way
        b_lo, b_hi = tl.split(tl.permute(tl.reshape(b_acc, [BLOCK_M, 2, 2, HB // 2]), (0, 1, 3, 2)))
        b_lo = tl.reshape(b_lo, [BLOCK_M, HB])  # [BLOCK_M, 2, HB / 2] -> pairs in order
        b_hi = tl.reshape(b_hi, [BLOCK_M, HB])
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
            b_c = widen(tl.load(cos_ptr + o_cs, mask=m_c, other=0.0), EMULATED)[:, None, :]  # [BLOCK_M, 1, RH]
            b_s = widen(tl.load(sin_ptr + o_cs, mask=m_c, other=0.0), EMULATED)[:, None, :]  # [BLOCK_M, 1, RH]
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
            b_c = widen(tl.load(cos_ptr + o_cs, mask=m_c, other=0.0), EMULATED)  # [BLOCK_M, HB]
            b_s = widen(tl.load(sin_ptr + o_cs, mask=m_c, other=0.0), EMULATED)  # [BLOCK_M, HB]
            b_lo, b_hi = b_lo * b_c - b_hi * b_s, b_hi * b_c + b_lo * b_s

    if PAIRED:  # gptj MXFP8: one MX block = 16 columns of each half, amaxes combined
        N: tl.constexpr = H * D
        b_l3 = tl.reshape(b_lo, [BLOCK_M, HB // 16, 16])
        b_h3 = tl.reshape(b_hi, [BLOCK_M, HB // 16, 16])
        b_ml = amax(b_l3, 2, EMULATED)  # [BLOCK_M, HB // 16]
        b_mh = amax(b_h3, 2, EMULATED)
        b_m = tl.where(b_ml != b_ml, b_mh, tl.where(b_mh != b_mh, b_ml, tl.maximum(b_ml, b_mh)))  # NaN-ignoring
        b_byte = e8m0_from_amax(b_m, SCALE_MODE)
        o_l, m_l, _ = _out_cols(i_n, tl.arange(0, HB), 0, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
        o_h, m_h, _ = _out_cols(i_n, tl.arange(0, HB), 1, H, D, P, R, STYLE, PAIRED, SEG, NT_PASS, HB)
        b_ql = tl.reshape(quantize_e4m3(b_l3, b_byte[:, :, None], SCALE_MODE, EMULATED, False), [BLOCK_M, HB])
        b_qh = tl.reshape(quantize_e4m3(b_h3, b_byte[:, :, None], SCALE_MODE, EMULATED, False), [BLOCK_M, HB])
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
    a_desc, w_desc,  # [T, K] ; [ROWS = (NT_PASS + NT_ROPE) * 2 * HB, K] (W' rows = kernel columns): bf16 or e4m3
    sa_ptr, sw_ptr,  # fp8_block: fp32 scale_inv of A [K/128, T] and of W' [K/128, ROWS] (bf16: None)
    cos_ptr, sin_ptr, stride_cs,  # [T, R // 2] fp32 / bf16 / fp16 pair tables, unit inner stride, row stride
    y_ptr, rs_ptr, cd_ptr, cs_ptr,  # outputs: bf16 y [T, H, D] | fp8 row data, row scale, col data, col scale
    yd_pass, yd_rope, cd_pass, cd_rope,  # TMA_STORE: descriptors of y / col data viewed [T, H, D] (else None)
    T,
    K: tl.constexpr, H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    STYLE: tl.constexpr, PAIRED: tl.constexpr, SEG: tl.constexpr,
    OUT_FORMAT: tl.constexpr, COLWISE: tl.constexpr, SCALE_MODE: tl.constexpr,
    NT_PASS: tl.constexpr, NT_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, HB: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    OPERANDS: tl.constexpr, ROPE_BCAST: tl.constexpr, EMULATED: tl.constexpr, DOT_F32: tl.constexpr,
    FLATTEN: tl.constexpr, SERIAL_LOOP: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """lo = A·W'_loᵀ, hi = A·W'_hiᵀ (fp32); rope tiles: lo' = lo·c - hi·s, hi' = hi·c + lo·s;
    then each half -> bf16 or MXFP8 (rowwise 32-blocks along each head's D, columnwise 32-blocks along T)."""
    NT_N: tl.constexpr = NT_PASS + NT_ROPE
    ROWS: tl.constexpr = NT_N * 2 * HB
    i_sm = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    num_tiles = num_m * NT_N
    if SERIAL_LOOP:  # interpreter: its range() cannot take tensor bounds (numpy 2), a while loop can
        tile = i_sm
        while tile < num_tiles:
            i_m, i_n = _tile_coords(tile, num_m, NT_N, GROUP_M)
            b_lo, b_hi = _mainloop(a_desc, w_desc, sa_ptr, sw_ptr, i_m, i_n, T, K, ROWS, BLOCK_M, HB, BLOCK_K,
                                   OPERANDS, DOT_F32)
            _epilogue(b_lo, b_hi, i_m, i_n, cos_ptr, sin_ptr, stride_cs, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass,
                      yd_rope, cd_pass, cd_rope, T, H, D, P, R, STYLE, PAIRED, SEG, OUT_FORMAT, COLWISE, SCALE_MODE,
                      NT_PASS, BLOCK_M, HB, ROPE_BCAST, EMULATED, TMA_STORE)
            tile += NUM_SMS
    else:
        tile_c = i_sm - NUM_SMS  # the epilogue's own counter: the next tile's loads can be hoisted over it
        for tile in tl.range(i_sm, num_tiles, NUM_SMS, flatten=FLATTEN):
            i_m, i_n = _tile_coords(tile, num_m, NT_N, GROUP_M)
            b_lo, b_hi = _mainloop(a_desc, w_desc, sa_ptr, sw_ptr, i_m, i_n, T, K, ROWS, BLOCK_M, HB, BLOCK_K,
                                   OPERANDS, DOT_F32)
            tile_c += NUM_SMS
            i_m, i_n = _tile_coords(tile_c, num_m, NT_N, GROUP_M)
            _epilogue(b_lo, b_hi, i_m, i_n, cos_ptr, sin_ptr, stride_cs, y_ptr, rs_ptr, cd_ptr, cs_ptr, yd_pass,
                      yd_rope, cd_pass, cd_rope, T, H, D, P, R, STYLE, PAIRED, SEG, OUT_FORMAT, COLWISE, SCALE_MODE,
                      NT_PASS, BLOCK_M, HB, ROPE_BCAST, EMULATED, TMA_STORE)


# --------------------------------------------------------------------------------------------- launcher


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of the fused GEMM; every config gives the same bytes (fp8 on the GPU: see the module
    docstring). Upper-case fields are the kernel's constexprs, lower-case ones Triton's launch options. Start from
    `default_config` and `dataclasses.replace` it.

    BLOCK_M: token rows per tile (a tile is [BLOCK_M, 2·HB] of the output); BLOCK_K: K per main-loop step
    (128 for fp8_block operands: one scale block); HB: the half width of W's layout (`fused_half_width`), which
    the W' operand must have been laid out with (`fused_row_source(cfg, operands, HB)`);
    GROUP_M: row blocks per L2 swizzle group; NUM_SMS: persistent programs (at most one per tile);
    FLATTEN: flatten the persistent loop (`tl.range(flatten=...)`; Triton 3.6 rejects it with bf16 TMA stores);
    TMA_STORE: store the outputs through tensor descriptors (`tma_store_supported` geometries only);
    ROPE_BCAST: load a rope tile's pair tables as [BLOCK_M, R/2] and broadcast them (needs R/2 a power of two
    dividing HB), else gather [BLOCK_M, HB]; maxnreg: register cap per thread (None: Triton's choice).
    """

    BLOCK_M: int
    BLOCK_K: int
    GROUP_M: int
    NUM_SMS: int
    num_warps: int
    num_stages: int
    FLATTEN: bool = True
    TMA_STORE: bool = False
    ROPE_BCAST: bool = False
    maxnreg: int | None = None
    HB: int = HALF_N


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rope_bcast_ok(cfg: QProjConfig, hb: int = HALF_N) -> bool:
    RH = cfg.rope_dim // 2
    return hb % RH == 0 and (RH & (RH - 1)) == 0


def flatten_ok(cfg: QProjConfig, tma_store: bool) -> bool:
    """Triton 3.6 rejects the flattened persistent loop together with bf16 TMA stores."""
    return not (tma_store and cfg.output_format == "bf16")


def _geometry_config(T: int, device: torch.device, cfg: QProjConfig, HB: int, flatten: bool = True,
                     **tiles) -> GemmConfig:
    """tiles + what the geometry decides: ROPE_BCAST where possible; on the GPU, TMA_STORE from TMA_STORE_MIN_T
    tokens where supported, and FLATTEN (if the chooser wants it) where `flatten_ok`."""
    bcast = _rope_bcast_ok(cfg, HB)
    if device.type != "cuda":
        return GemmConfig(**tiles, HB=HB, ROPE_BCAST=bcast)
    tma = T >= TMA_STORE_MIN_T and tma_store_supported(cfg, HB)
    flatten = flatten and flatten_ok(cfg, tma)
    return GemmConfig(**tiles, HB=HB, NUM_SMS=_num_sms(device.index or 0), FLATTEN=flatten, TMA_STORE=tma,
                      ROPE_BCAST=bcast)


def _default_config_bf16(T: int, device: torch.device, cfg: QProjConfig) -> GemmConfig:
    """Measured on an H200 at T = 16384 (figures in BENCHMARKS.md): one [BLOCK_M, 256] dot split in registers beats
    two [BLOCK_M, 128] dots sharing A; the flattened persistent loop beats the plain one; broadcasting the
    [BLOCK_M, R/2] pair table beats gathering [BLOCK_M, 128] (which spills); TMA stores beat pointer stores at
    large T."""
    hb = fused_half_width(cfg, "bf16")
    if device.type != "cuda":  # interpreter: small tiles keep the CPU emulation quick and exercise edges
        return _geometry_config(T, device, cfg, hb, BLOCK_M=32, BLOCK_K=32, GROUP_M=2, NUM_SMS=3, num_warps=4,
                                num_stages=1)
    if T <= 64:
        return _geometry_config(T, device, cfg, hb, BLOCK_M=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return _geometry_config(T, device, cfg, hb, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _default_config_fp8(T: int, device: torch.device, cfg: QProjConfig) -> GemmConfig:
    """BLOCK_K = 128: one scale block per step; HB = 128 (`fused_half_width`): [64, 256] tiles with 8 warps (two
    warpgroups side by side along N, hence W's quarter order), 4 stages (sm_90 offline: 194-197 registers, no
    spills; a [128, 256] tile doubles the accumulator and the block's dot result and spills). Measured on the H200
    against the [128, 128] tiles of HB = 64 (BENCHMARKS.md): the faster at T = 16384."""
    hb = fused_half_width(cfg, "fp8_block")
    if device.type != "cuda":
        return _geometry_config(T, device, cfg, hb, BLOCK_M=32, BLOCK_K=128, GROUP_M=2, NUM_SMS=3, num_warps=4,
                                num_stages=1)
    return _geometry_config(T, device, cfg, hb, BLOCK_M=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)


# default configs by (operands, cfg, device, T buckets): building one costs several microseconds of the launch's
# host time. Only the launcher (inside the custom ops, never traced by dynamo) and scripts call default_config.
_DEFAULT_CONFIGS: dict[tuple, GemmConfig] = {}


def default_config(T: int, device: torch.device, cfg: QProjConfig, operands: str = "bf16") -> GemmConfig:
    """The launch config `qproj_gemm_fwd` uses for T tokens on device: fixed configs per operand kind (the kernel
    variant), keyed on the device and a T bucket (autotuning costs seconds per config)."""
    key = (operands, cfg, device, T <= 64, T >= TMA_STORE_MIN_T)  # every T bucket the choosers use
    config = _DEFAULT_CONFIGS.get(key)
    if config is None:
        if operands == "bf16":
            config = _default_config_bf16(T, device, cfg)
        elif operands == "fp8_block":
            config = _default_config_fp8(T, device, cfg)
        else:
            raise ValueError(f"operands must be one of {OPERANDS}, got {operands!r}")
        _DEFAULT_CONFIGS[key] = config
    return config


def _check_config(config: GemmConfig, cfg: QProjConfig, operands: str) -> None:
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig, got {type(config).__name__}")
    if config.HB not in HALF_WIDTHS:
        raise ValueError(f"config.HB must be one of {HALF_WIDTHS}, got {config.HB!r}")
    if config.BLOCK_M % 32:
        raise ValueError(f"config.BLOCK_M must be a multiple of 32 (columnwise MX blocks), got {config.BLOCK_M}")
    if config.TMA_STORE and not tma_store_supported(cfg, config.HB):
        raise ValueError(f"config.TMA_STORE does not cover this geometry with HB = {config.HB}: {cfg}")
    if config.ROPE_BCAST and not _rope_bcast_ok(cfg, config.HB):
        raise ValueError(f"config.ROPE_BCAST needs R/2 a power of two dividing {config.HB}, got R = {cfg.rope_dim}")
    if operands == "fp8_block" and config.BLOCK_K != FP8_BLOCK:
        raise ValueError(f"config.BLOCK_K must be {FP8_BLOCK} for fp8_block operands, got {config.BLOCK_K}")


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device, hint: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, a on {device}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}{hint}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_inputs(a, w_prepared, cos_h, sin_h, cfg, a_scale_inv, w_scale_inv, config):
    if not isinstance(cfg, QProjConfig):
        raise TypeError(f"cfg must be a QProjConfig, got {type(cfg).__name__}")
    if not fused_gemm_supported(cfg):
        raise ValueError(f"qproj_gemm_fwd does not cover this geometry: {cfg}")
    fp8 = a_scale_inv is not None or w_scale_inv is not None
    operands = "fp8_block" if fp8 else "bf16"
    if config is not None:
        _check_config(config, cfg, operands)
    hb = fused_half_width(cfg, operands) if config is None else config.HB  # W' rows are laid out for it
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a must be a tensor, got {type(a).__name__}")
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    K, rows = cfg.q_lora_rank, fused_layout(cfg, hb)[2]
    if a.dim() != 2:
        raise ValueError(f"a must be [T, {K}], got {tuple(a.shape)}")
    T = a.shape[0]
    _check_tensor("a", a, dtype, (T, K), a.device)
    w_hint = f" (from prepare_fused_weight{'_fp8' if fp8 else ''} with half width {hb})"
    _check_tensor("w_prepared", w_prepared, dtype, (rows, K), a.device, w_hint)
    if fp8:
        if K % FP8_BLOCK:
            raise ValueError(f"q_lora_rank must be a multiple of {FP8_BLOCK} for fp8_block operands, got {K}")
        _check_tensor("a_scale_inv", a_scale_inv, torch.float32, (K // FP8_BLOCK, T), a.device, " ([K/128, T])")
        _check_tensor("w_scale_inv", w_scale_inv, torch.float32, (K // FP8_BLOCK, rows), a.device, w_hint)
    for name, t in (("cos_h", cos_h), ("sin_h", sin_h)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a on {a.device}")
    check_pair_tables(cos_h, sin_h)
    for name, t in (("cos_h", cos_h), ("sin_h", sin_h)):
        if tuple(t.shape) != (T, cfg.rope_dim // 2):
            raise ValueError(f"{name} must be [T, R/2] = {(T, cfg.rope_dim // 2)}, got {tuple(t.shape)}")


def qproj_gemm_outputs(T: int, cfg: QProjConfig, like: torch.Tensor) -> tuple:
    """The launcher's outputs, allocated on like's device (also the custom op's fake implementation):
    bf16 out: (y bf16 [T, H, D],); mxfp8: (row data fp8 [T, H, D], row scale uint8 [T, H, D/32],
    col data fp8 [T, H, D] or None, col scale uint8 [ceil(T/32), H, D] or None)."""
    H, D, dev = cfg.num_heads, cfg.q_head_dim, like.device
    if cfg.output_format == "bf16":
        return (torch.empty((T, H, D), dtype=torch.bfloat16, device=dev),)
    rd = torch.empty((T, H, D), dtype=torch.float8_e4m3fn, device=dev)
    rs = torch.empty((T, H, D // _MX), dtype=torch.uint8, device=dev)
    cd = cs = None
    if cfg.columnwise_output:
        cd = torch.empty((T, H, D), dtype=torch.float8_e4m3fn, device=dev)
        cs = torch.empty((cdiv(T, _MX), H, D), dtype=torch.uint8, device=dev)
    return rd, rs, cd, cs


def output_rows(outs: tuple, t0: int, t1: int) -> tuple:
    """Views of tokens [t0, t1) of `qproj_gemm_outputs` (the columnwise scale's rows are 32-token blocks: t0 and t1
    multiples of 32 there, or t1 the end), themselves a valid `out` for those tokens' launch."""
    if len(outs) == 1:
        return (outs[0][t0:t1],)
    rd, rs, cd, cs = outs
    if cd is None:
        return rd[t0:t1], rs[t0:t1], None, None
    if t0 % _MX or (t1 % _MX and t1 != rd.shape[0]):
        raise ValueError(f"columnwise outputs split at multiples of {_MX} tokens only, got [{t0}, {t1})")
    return rd[t0:t1], rs[t0:t1], cd[t0:t1], cs[t0 // _MX:cdiv(t1, _MX)]


def _check_out(out, T: int, cfg: QProjConfig, like: torch.Tensor) -> None:
    want = qproj_gemm_outputs(T, cfg, like.new_empty(0, device="meta"))
    if not isinstance(out, tuple) or len(out) != len(want):
        raise TypeError(f"out must be a tuple of {len(want)} tensors as qproj_gemm_outputs lays them out")
    for i, (t, w) in enumerate(zip(out, want, strict=True)):
        if w is None:
            if t is not None:
                raise ValueError(f"out[{i}] must be None for this config (no columnwise output)")
        else:  # contiguous: the rows of a larger output are, other strides are not
            _check_tensor(f"out[{i}]", t, w.dtype, tuple(w.shape), like.device)


def qproj_gemm_fwd(a: torch.Tensor, w_prepared: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor,
                   cfg: QProjConfig, *, a_scale_inv: torch.Tensor | None = None,
                   w_scale_inv: torch.Tensor | None = None, check: bool = True,
                   config: GemmConfig | None = None, out: tuple | None = None) -> tuple:
    """q = RoPE(a · Wᵀ) viewed [T, H, D], then quantized exactly as `reference.qproj.quantize_output`.

    Args:
        a: [T, K] contiguous: bf16 (exact image of the quantized input), or with a_scale_inv the float8_e4m3fn codes
            of its 1x128 blocks along K (SPEC §5; K % 128 == 0).
        w_prepared: `prepare_fused_weight(W, cfg)` (bf16), or the codes from `prepare_fused_weight_fp8`.
        cos_h, sin_h: [T, R/2] pair tables (`check_pair_tables`).
        a_scale_inv: fp8_block only: float32 [K/128, T] contiguous, element [kb, t] the scale_inv of token t's
            K block kb (M-major).
        w_scale_inv: fp8_block only: the scale_inv from `prepare_fused_weight_fp8`, float32 [K/128, rows].
        (w_prepared and w_scale_inv must be laid out with the config's half width HB: by default
        `fused_half_width(cfg, operands)`, the layout `prepare_fused_weight*` make by default.)
        check: validate the arguments (False: for a caller that built them itself, as the layer does; skips a few
            tens of microseconds of host work per call).
        config: launch parameters (default: `default_config(T, a.device, cfg, operands)`); every config gives the
            same bytes.
        out: the outputs to write, laid out as `qproj_gemm_outputs(T, cfg, a)` (e.g. `output_rows` of a larger
            one: the sequence-parallel forward writes each rank's tokens into its rows of the query); default new.
    Returns:
        `qproj_gemm_outputs(T, cfg, a)` (or out), written.
    """
    operands = "bf16" if a_scale_inv is None else "fp8_block"
    if check:
        _check_inputs(a, w_prepared, cos_h, sin_h, cfg, a_scale_inv, w_scale_inv, config)
        if out is not None:
            _check_out(out, a.shape[0], cfg, a)
    elif config is not None:
        _check_config(config, cfg, operands)
    T, K = a.shape
    outs = qproj_gemm_outputs(T, cfg, a) if out is None else out
    if T == 0:
        return outs
    dev = a.device
    if config is None:
        config = default_config(T, dev, cfg, operands)
    interp = interpreter_enabled()
    H, D, R = cfg.num_heads, cfg.q_head_dim, cfg.rope_dim
    RH = R // 2
    y, rs, cd, cs = outs if len(outs) == 4 else (outs[0], None, None, None)
    HB, BLOCK_M, BLOCK_K = config.HB, config.BLOCK_M, config.BLOCK_K
    nt_pass, nt_rope, _ = fused_layout(cfg, HB)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(w_prepared, [2 * HB, BLOCK_K])
    num_tiles = cdiv(T, BLOCK_M) * (nt_pass + nt_rope)

    def grid(meta):
        return (min(meta["NUM_SMS"], num_tiles),)

    descs = dict(yd_pass=None, yd_rope=None, cd_pass=None, cd_rope=None)
    if config.TMA_STORE:
        P = cfg.qk_head_dim
        for name, t in (("yd", y), ("cd", cd)):
            if t is not None:
                descs[name + "_pass"] = TensorDescriptor.from_tensor(t, [BLOCK_M, 1, HB]) if P else None
                descs[name + "_rope"] = TensorDescriptor.from_tensor(t, [BLOCK_M, HB // RH, RH])
    options = {} if config.maxnreg is None else dict(maxnreg=config.maxnreg)
    _qproj_gemm_fwd_kernel[grid](
        a_desc=a_desc, w_desc=w_desc, sa_ptr=a_scale_inv, sw_ptr=w_scale_inv, cos_ptr=cos_h, sin_ptr=sin_h,
        stride_cs=cos_h.stride(0), **descs,
        y_ptr=y, rs_ptr=rs if rs is not None else y, cd_ptr=cd if cd is not None else y,
        cs_ptr=cs if cs is not None else y,
        T=T, K=K, H=H, D=D, P=cfg.qk_head_dim, R=R,
        STYLE=cfg.rope_style, PAIRED=_paired(cfg), SEG=_seg(cfg),
        OUT_FORMAT=cfg.output_format, COLWISE=cfg.columnwise_output, SCALE_MODE=cfg.query_scale_mode,
        NT_PASS=nt_pass, NT_ROPE=nt_rope, HB=HB, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, GROUP_M=config.GROUP_M,
        NUM_SMS=config.NUM_SMS, OPERANDS=operands, ROPE_BCAST=config.ROPE_BCAST,
        EMULATED=_op.emulated(dev), DOT_F32=interp, FLATTEN=config.FLATTEN, SERIAL_LOOP=interp,
        TMA_STORE=config.TMA_STORE,
        num_warps=config.num_warps, num_stages=config.num_stages,
        enable_fp_fusion=False,  # a·c - b·s rounded as the reference rounds it (no FMA contraction)
        **options,
    )
    return outs


# ------------------------------------------------------------------------------------------- custom ops
# `mla_qproj::qproj_gemm_fwd` (bf16 operands) and `mla_qproj::qproj_gemm_fp8_fwd` (fp8_block operands): the
# launcher as torch.library custom ops, so that the layer traces under torch.compile(fullgraph=True) and captures in
# CUDA graphs (output shapes depend on input shapes only). The ops always return four tensors (q data or bf16 q, row
# scale, col data, col scale), absent ones empty; the fake is the launcher's own allocation (`qproj_gemm_outputs`).
# W' arrives laid out with the default half width (`fused_half_width`): the layout the layer builds.


def _four_outputs(outs: tuple, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launcher's outputs as the op's four, absent ones empty uint8 tensors (custom ops return no None)."""
    outs = outs if len(outs) == 4 else (outs[0], None, None, None)
    return tuple(like.new_empty((0,), dtype=torch.uint8) if t is None else t for t in outs)


def _eager_outputs(outs: tuple) -> tuple:
    """The layer's eager form of the launcher's outputs: four, None for the absent ones (no empty tensors made)."""
    return (outs[0], None, None, None) if len(outs) == 1 else outs


def _fake(a: torch.Tensor, cfg: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _four_outputs(qproj_gemm_outputs(a.shape[0], QProjConfig.decode(cfg), a), a)


@torch.library.custom_op("mla_qproj::qproj_gemm_fwd", mutates_args=())
def _qproj_gemm_fwd_def(a: torch.Tensor, w_prepared: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor,
                        cfg: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 operands: a [T, K] and W' from `prepare_fused_weight`; cfg: the layer config (`QProjConfig.encode`)."""
    return _four_outputs(qproj_gemm_fwd(a, w_prepared, cos_h, sin_h, QProjConfig.decode(cfg)), a)


@_qproj_gemm_fwd_def.register_fake
def _(a, w_prepared, cos_h, sin_h, cfg):
    return _fake(a, cfg)


def _qproj_gemm_fwd_eager(a, w_prepared, cos_h, sin_h, cfg) -> tuple:
    return _eager_outputs(qproj_gemm_fwd(a, w_prepared, cos_h, sin_h, QProjConfig.decode(cfg), check=False))


@torch.library.custom_op("mla_qproj::qproj_gemm_fp8_fwd", mutates_args=())
def _qproj_gemm_fp8_fwd_def(a: torch.Tensor, a_scale_inv: torch.Tensor, w_prepared: torch.Tensor,
                            w_scale_inv: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, cfg: str) -> tuple[
                                torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8_block operands (SPEC §5): a = xn's 1x128 E4M3 codes [T, K] with scale_inv [K/128, T]; W' and its
    scale_inv [K/128, rows] from `prepare_fused_weight_fp8`."""
    return _four_outputs(qproj_gemm_fwd(a, w_prepared, cos_h, sin_h, QProjConfig.decode(cfg), a_scale_inv=a_scale_inv,
                                        w_scale_inv=w_scale_inv), a)


@_qproj_gemm_fp8_fwd_def.register_fake
def _(a, a_scale_inv, w_prepared, w_scale_inv, cos_h, sin_h, cfg):
    return _fake(a, cfg)


def _qproj_gemm_fp8_fwd_eager(a, a_scale_inv, w_prepared, w_scale_inv, cos_h, sin_h, cfg) -> tuple:
    return _eager_outputs(qproj_gemm_fwd(a, w_prepared, cos_h, sin_h, QProjConfig.decode(cfg), a_scale_inv=a_scale_inv,
                                         w_scale_inv=w_scale_inv, check=False))


# the layer's entry points: call(*args) runs the launcher directly in eager mode and the registered op under
# torch.compile; call.op is the registered op
qproj_gemm_fwd_op = _op.eager_fast(_qproj_gemm_fwd_def, _qproj_gemm_fwd_eager)
qproj_gemm_fp8_fwd_op = _op.eager_fast(_qproj_gemm_fp8_fwd_def, _qproj_gemm_fp8_fwd_eager)
