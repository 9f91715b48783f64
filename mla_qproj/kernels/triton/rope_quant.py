"""RoPE (forward or inverse) fused with quantization, one program per (32 tokens, head).

Forward (SPEC §1.4-1.5): y [T, H*D] fp32 from the GEMM -> RoPE on each head's rope columns -> MXFP8 rowwise
(32-blocks along D) [+ columnwise, 32-blocks along T] or bf16 (the general forward path; the fused GEMM's
epilogue does this on sm_90).
Inverse (SPEC backward 1-2): dq [T, H*D] -> transpose rotation -> the exact bf16 images of the MXFP8 dgrad
operand (rowwise) and wgrad operand (columnwise), or the bf16 / fp32 gradient.

One kernel, `_rope_quant_kernel`, with two paths that give the same bytes (tests/ops/test_rope_quant.py compares
them on special values):
- fast (`RopeQuantConfig.FAST`, default where `fast_path_supported`; `_contiguous_tiles`): contiguous [32, 32] /
  [32, 64] tiles, pairs split/joined in registers, hardware E4M3 / bf16 conversions on the GPU;
- gather (any geometry): [32 tokens, 32 columns] tiles whose rope columns gather their partners through
  `rope_sources`, which never leaves [P, P + R) of the same head; columns >= D are masked.
Both are bounded to their head. Kernel dims: H heads of D = q_head_dim columns, P = qk_head_dim pass-through
columns first, then R = rope_dim rope columns. Custom op `mla_qproj::rope_quant`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._config import QProjConfig
from ..._constants import MX_BLOCK
from .. import _op
from ._common import cdiv, check_pair_tables, mx_image, mx_quantize, rope_sources, to_bf16, widen


@triton.jit
def _store_dense(p_out, b, m, MODE: tl.constexpr, EMULATED: tl.constexpr):
    """The "bf16" (round-to-nearest-even, SPEC §2) or "fp32" output of an fp32 tile."""
    if MODE == "bf16":
        tl.store(p_out, to_bf16(b, EMULATED), mask=m)
    else:
        tl.static_assert(MODE == "fp32")
        tl.store(p_out, b, mask=m)


# ------------------------------------------------------------------------------------------ fast path
# Geometries whose qk_head_dim, rope_dim / 2 and trailing pass-through are multiples of 32 (DeepSeek: 128 + 64 + 0):
# every MX block of a head is either 32 pass-through columns or one half of 32 rope pairs, so the rope part is read
# and written as contiguous [32, 32] / [32, 64] tiles (no gathers): an interleaved tile is split into its even/odd
# members (reshape + split) or joined back (join + reshape), and cos/sin are [32 tokens, 32 pairs] tiles.


@triton.jit
def _emit_tile(b_y, o_t, m_t, i_t, col0, out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
               W: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr, COLUMNWISE: tl.constexpr,
               SCALE_MODE: tl.constexpr, EMULATED: tl.constexpr):
    """Store b_y [32 tokens, W] (fp32, W % 32 == 0) at output columns col0 + [0, W): rowwise MXFP8 (one block per
    32 columns) as codes + scales or as the bf16 image, columnwise (one block per column), bf16 or fp32."""
    o_w = tl.arange(0, W)
    o_out = o_t[:, None] * N + col0 + o_w[None, :]
    m = m_t[:, None] & (o_w < W)[None, :]
    if MODE == "mxfp8":
        b_y3 = tl.reshape(b_y, [32, W // 32, 32])
        b_q, b_byte = mx_quantize(b_y3, 2, SCALE_MODE, EMULATED, True)  # b_byte [32, W // 32]
        tl.store(out_ptr + o_out, tl.reshape(b_q, [32, W]), mask=m)
        o_s = o_t[:, None] * (N // 32) + col0 // 32 + tl.arange(0, W // 32)[None, :]
        tl.store(row_scale_ptr + o_s, b_byte.to(tl.uint8), mask=m_t[:, None])
        if COLUMNWISE:
            b_cq, b_cbyte = mx_quantize(b_y, 0, SCALE_MODE, EMULATED, True)  # b_cbyte [W]
            tl.store(col_data_ptr + o_out, b_cq, mask=m)
            tl.store(col_scale_ptr + i_t * N + col0 + o_w, b_cbyte.to(tl.uint8))
    elif MODE == "mxfp8_images":
        # codes that only become bf16 images skip the NaN-sign fix on the GPU (the image is NaN either way; ~4
        # instructions per element), which lets rceil images take their multipliers straight from the amax
        b_img = mx_image(tl.reshape(b_y, [32, W // 32, 32]), 2, SCALE_MODE, EMULATED, False)  # exact in bf16
        tl.store(out_ptr + o_out, tl.reshape(b_img, [32, W]).to(tl.bfloat16), mask=m)
        if COLUMNWISE:
            b_cimg = mx_image(b_y, 0, SCALE_MODE, EMULATED, False)  # [32, W]
            tl.store(col_data_ptr + o_out, b_cimg.to(tl.bfloat16), mask=m)
    else:
        _store_dense(out_ptr + o_out, b_y, m, MODE, EMULATED)


@triton.jit
def _contiguous_tiles(p_y, o_t, m_t, i_t, i_h, cos_ptr, sin_ptr, stride_cs, out_ptr, row_scale_ptr, col_data_ptr,
                      col_scale_ptr, N: tl.constexpr, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
                      STYLE: tl.constexpr, INVERSE: tl.constexpr, MODE: tl.constexpr, COLUMNWISE: tl.constexpr,
                      SCALE_MODE: tl.constexpr, PASS_W: tl.constexpr, EMULATED: tl.constexpr):
    """The fast path of one (32 tokens, head) program (p_y [32, 1]: the head's row starts). Pairs (x1, x2) ->
    forward (x1 c - x2 s, x2 c + x1 s), inverse (x1 c + x2 s, x2 c - x1 s), each product rounded before the sum
    (launched with FMA contraction off), the reference's operation order. Interleaved layouts hold pair i at
    (2i, 2i + 1), halves at (i, R/2 + i): deepseek forward reads interleaved and writes halves (its inverse the
    opposite), neox is halves both ways, gptj interleaved both ways."""
    HALF: tl.constexpr = R // 2
    IN_IL: tl.constexpr = (STYLE == "gptj") or (STYLE == "deepseek" and not INVERSE)
    OUT_IL: tl.constexpr = (STYLE == "gptj") or (STYLE == "deepseek" and INVERSE)
    o_32 = tl.arange(0, 32)
    # pass-through columns: [32, PASS_W] tiles; rows past T load as NaN (ignored by every amax, not stored)
    for j in tl.static_range(P // PASS_W):
        o_w = j * PASS_W + tl.arange(0, PASS_W)
        b_x = widen(tl.load(p_y + o_w[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)  # [32, PASS_W]
        _emit_tile(b_x, o_t, m_t, i_t, i_h * D + j * PASS_W, out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
                   PASS_W, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED)
    # trailing pass-through columns [P + R, D): [32, 32] tiles
    for j in tl.static_range((D - P - R) // 32):
        o_w = P + R + j * 32 + o_32
        b_x = widen(tl.load(p_y + o_w[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)  # [32, 32]
        _emit_tile(b_x, o_t, m_t, i_t, i_h * D + P + R + j * 32, out_ptr, row_scale_ptr, col_data_ptr,
                   col_scale_ptr, 32, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED)
    # rope columns: chunks of 32 pairs
    for c in tl.static_range(HALF // 32):
        o_cs = o_t[:, None] * stride_cs + c * 32 + o_32[None, :]
        b_c = widen(tl.load(cos_ptr + o_cs, mask=m_t[:, None], other=1.0), EMULATED)  # [32, 32]
        b_s = widen(tl.load(sin_ptr + o_cs, mask=m_t[:, None], other=0.0), EMULATED)  # [32, 32]
        if IN_IL:
            o_in = P + c * 64 + tl.arange(0, 64)
            b_in = widen(tl.load(p_y + o_in[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)  # [32, 64]
            b_x1, b_x2 = tl.split(tl.reshape(b_in, [32, 32, 2]))
        else:
            o_1 = P + c * 32 + o_32
            b_x1 = widen(tl.load(p_y + o_1[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)  # [32, 32]
            b_x2 = widen(tl.load(p_y + (o_1 + HALF)[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)
        if INVERSE:
            b_y1 = b_x1 * b_c + b_x2 * b_s
            b_y2 = b_x2 * b_c - b_x1 * b_s
        else:
            b_y1 = b_x1 * b_c - b_x2 * b_s
            b_y2 = b_x2 * b_c + b_x1 * b_s
        if OUT_IL:
            b_yo = tl.reshape(tl.join(b_y1, b_y2), [32, 64])
            _emit_tile(b_yo, o_t, m_t, i_t, i_h * D + P + c * 64, out_ptr, row_scale_ptr, col_data_ptr,
                       col_scale_ptr, 64, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED)
        else:
            _emit_tile(b_y1, o_t, m_t, i_t, i_h * D + P + c * 32, out_ptr, row_scale_ptr, col_data_ptr,
                       col_scale_ptr, 32, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED)
            _emit_tile(b_y2, o_t, m_t, i_t, i_h * D + P + HALF + c * 32, out_ptr, row_scale_ptr, col_data_ptr,
                       col_scale_ptr, 32, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED)


@triton.jit
def _rope_quant_kernel(
    y_ptr, stride_y, cos_ptr, sin_ptr, stride_cs,
    out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    T,
    H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    STYLE: tl.constexpr, INVERSE: tl.constexpr, MODE: tl.constexpr, COLUMNWISE: tl.constexpr,
    SCALE_MODE: tl.constexpr, FAST: tl.constexpr, PASS_W: tl.constexpr, EMULATED: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    """One program per (32 tokens, head). FAST: `_contiguous_tiles`. Else [32, 32] tiles with explicit rounding
    (EMULATED is the fast path's): out[:, p] = in[:, src1] * c[pair] + sign * in[:, src2] * s[pair] on rope columns,
    in[:, p] elsewhere."""
    # HEAD_MAJOR: program_id(0) walks the heads, so programs running side by side cover whole rows
    i_t = tl.program_id(1 if HEAD_MAJOR else 0).to(tl.int64)
    i_h = tl.program_id(0 if HEAD_MAJOR else 1).to(tl.int64)
    HALF: tl.constexpr = R // 2
    N: tl.constexpr = H * D
    o_t = i_t * 32 + tl.arange(0, 32)
    m_t = o_t < T
    p_y = y_ptr + o_t[:, None] * stride_y + i_h * D  # [32, 1] row starts of this head
    if FAST:
        _contiguous_tiles(p_y, o_t, m_t, i_t, i_h, cos_ptr, sin_ptr, stride_cs, out_ptr, row_scale_ptr, col_data_ptr,
                          col_scale_ptr, N, D, P, R, STYLE, INVERSE, MODE, COLUMNWISE, SCALE_MODE, PASS_W, EMULATED)
    else:
        for j in tl.static_range(0, (D + 31) // 32):
            o_d = j * 32 + tl.arange(0, 32)
            m_d = o_d < D
            m = m_t[:, None] & m_d[None, :]
            # rows/cols outside load as NaN: ignored by every amax, never stored
            b_o = widen(tl.load(p_y + o_d[None, :], mask=m, other=float("nan")), True)  # [32, 32]
            if (j * 32 + 32 > P) and (j * 32 < P + R):  # compile-time: this tile overlaps the rope columns
                p = o_d - P
                is_rope = (p >= 0) & (p < R) & m_d
                src1, src2, sign, pair = rope_sources(tl.where(is_rope, p, 0), HALF, STYLE, INVERSE)
                m_r = m_t[:, None] & is_rope[None, :]
                b_v1 = widen(tl.load(p_y + (P + src1)[None, :], mask=m_r, other=float("nan")), True)
                b_v2 = widen(tl.load(p_y + (P + src2)[None, :], mask=m_r, other=0.0), True)
                b_c = widen(tl.load(cos_ptr + o_t[:, None] * stride_cs + pair[None, :], mask=m_r, other=1.0), True)
                b_s = widen(tl.load(sin_ptr + o_t[:, None] * stride_cs + pair[None, :], mask=m_r, other=0.0), True)
                # (v1*c) + ((±v2)*s): bitwise the reference's a*c - b*s (launched with FMA contraction off)
                b_o = tl.where(is_rope[None, :], b_v1 * b_c + (sign[None, :] * b_v2) * b_s, b_o)
            o_out = o_t[:, None] * N + i_h * D + o_d[None, :]
            if MODE == "mxfp8":
                b_q, b_byte = mx_quantize(b_o, 1, SCALE_MODE, True, True)  # b_byte [32]: one block per row
                tl.store(out_ptr + o_out, b_q, mask=m)
                tl.store(row_scale_ptr + o_t * (N // 32) + i_h * (D // 32) + j, b_byte.to(tl.uint8), mask=m_t)
                if COLUMNWISE:
                    b_cq, b_cbyte = mx_quantize(b_o, 0, SCALE_MODE, True, True)  # b_cbyte [32]: one block per column
                    tl.store(col_data_ptr + o_out, b_cq, mask=m)
                    tl.store(col_scale_ptr + i_t * N + i_h * D + o_d, b_cbyte.to(tl.uint8), mask=m_d)
            elif MODE == "mxfp8_images":
                tl.store(out_ptr + o_out, mx_image(b_o, 1, SCALE_MODE, True, True).to(tl.bfloat16), mask=m)
                if COLUMNWISE:
                    tl.store(col_data_ptr + o_out, mx_image(b_o, 0, SCALE_MODE, True, True).to(tl.bfloat16), mask=m)
            else:
                _store_dense(out_ptr + o_out, b_o, m, MODE, True)


def fast_path_supported(qk_head_dim: int, rope_dim: int, head_dim: int) -> bool:
    """The contiguous-tile kernel covers qk_head_dim, rope_dim / 2 and the trailing pass-through width
    head_dim - qk_head_dim - rope_dim all multiples of 32 (DeepSeek: 128 + 64 + 0)."""
    tail = head_dim - qk_head_dim - rope_dim
    return qk_head_dim % 32 == 0 and rope_dim > 0 and (rope_dim // 2) % 32 == 0 and tail >= 0 and tail % 32 == 0


@dataclass(frozen=True)
class RopeQuantConfig:
    """Launch parameters of `rope_quant`; every config gives the same bytes. Upper-case fields are kernel constexprs,
    lower-case ones launch options.

    FAST: the contiguous-tile kernel (`fast_path_supported` geometries), else the gather kernel; the rest is the
    fast kernel's: PASS_W: width of its pass-through tiles (a power of two >= 32 dividing qk_head_dim);
    HEAD_MAJOR: program_id(0) walks the heads (a CUDA grid's y extent, 65535, then bounds the token blocks);
    num_warps: warps per program."""

    FAST: bool
    PASS_W: int = 32
    HEAD_MAJOR: bool = True
    num_warps: int = 4


MAX_GRID_Y = 65535  # a CUDA grid's y extent


def _default_config(T: int, qk_head_dim: int, rope_dim: int, head_dim: int) -> RopeQuantConfig:
    """The fast kernel where it applies: one head per program, one warp (a tile's columnwise amax stays inside the
    warp), pass-through tiles 64 wide where they divide qk_head_dim, a head-major grid unless T / 32 exceeds the
    grid's y extent (figures: BENCHMARKS.md); else the gather kernel with 4 warps."""
    if not fast_path_supported(qk_head_dim, rope_dim, head_dim):
        return RopeQuantConfig(FAST=False)
    pass_w = 64 if qk_head_dim % 64 == 0 else 32
    return RopeQuantConfig(FAST=True, PASS_W=pass_w, HEAD_MAJOR=cdiv(T, 32) <= MAX_GRID_Y, num_warps=1)


_DEFAULT_CONFIGS: dict[tuple, RopeQuantConfig] = {}


def default_config(T: int, qk_head_dim: int, rope_dim: int, head_dim: int, device: torch.device) -> RopeQuantConfig:
    """The config `rope_quant` uses (the same on every device; kept by geometry and T bucket: building one costs
    microseconds of the launch's host time)."""
    key = (qk_head_dim, rope_dim, head_dim, cdiv(T, 32) <= MAX_GRID_Y)
    config = _DEFAULT_CONFIGS.get(key)
    if config is None:
        config = _DEFAULT_CONFIGS[key] = _default_config(T, qk_head_dim, rope_dim, head_dim)
    return config


def _check_config(config: RopeQuantConfig, T: int, num_heads: int, qk_head_dim: int, rope_dim: int,
                  head_dim: int) -> None:
    if not isinstance(config, RopeQuantConfig):
        raise TypeError(f"config must be a RopeQuantConfig, got {type(config).__name__}")
    if not config.FAST:
        return
    if not fast_path_supported(qk_head_dim, rope_dim, head_dim):
        raise ValueError(f"config.FAST does not cover qk_head_dim={qk_head_dim}, rope_dim={rope_dim}, "
                         f"head_dim={head_dim} (fast_path_supported)")
    w = config.PASS_W
    if w < 32 or w & (w - 1) or qk_head_dim % w:
        raise ValueError(f"config.PASS_W must be a power of two >= 32 dividing qk_head_dim ({qk_head_dim}), got {w}")
    if (cdiv(T, 32) if config.HEAD_MAJOR else num_heads) > MAX_GRID_Y:
        raise ValueError(f"config.HEAD_MAJOR={config.HEAD_MAJOR}: grid y extent above {MAX_GRID_Y} at T={T}, "
                         f"num_heads={num_heads}")


def rope_quant_outputs(y2d: torch.Tensor, mode: str, columnwise: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of `rope_quant` (also the op's fake), always four: (out, row scale, col data or image,
    col scale); absent ones are empty. mode 'mxfp8': (fp8 [T, N], uint8 [T, N/32], fp8 [T, N], uint8
    [ceil(T/32), N]); 'mxfp8_images': (bf16 [T, N], -, bf16 [T, N], -); 'bf16' / 'fp32': (rotated [T, N], -, -, -);
    the columnwise pair only with columnwise."""
    T, N = y2d.shape
    e, u8 = y2d.new_empty, torch.uint8
    mx = mode == "mxfp8"
    col = columnwise and mode in ("mxfp8", "mxfp8_images")
    if mx:
        out, rs = e((T, N), dtype=torch.float8_e4m3fn), e((T, N // MX_BLOCK), dtype=u8)
    else:
        out, rs = e((T, N), dtype=torch.float32 if mode == "fp32" else torch.bfloat16), e((0,), dtype=u8)
    cd = e((T, N) if col else (0,), dtype=torch.float8_e4m3fn if mx else torch.bfloat16)
    cs = e((cdiv(T, MX_BLOCK), N) if col and mx else (0,), dtype=u8)
    return out, rs, cd, cs


def rope_quant(y2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, *, num_heads: int, head_dim: int,
               qk_head_dim: int, rope_dim: int, rope_style: str, inverse: bool, mode: str, columnwise: bool,
               scale_mode: str, config: RopeQuantConfig | None = None) -> tuple[
                   torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE (inverse: its transpose) on each head's rope columns of y2d [T, H*D] (unit inner stride), then the
    output form of `mode` ('mxfp8', 'mxfp8_images', 'bf16', 'fp32'; `rope_quant_outputs`). cos_h/sin_h: [T, R/2]
    pair tables (`check_pair_tables`: fp32 / bf16 / fp16, unit inner stride, any row stride). MXFP8 modes need
    D % 32 == 0. config: `default_config` unless given."""
    T, N = y2d.shape
    check_pair_tables(cos_h, sin_h)
    if tuple(cos_h.shape) != (T, rope_dim // 2):
        raise ValueError(f"cos_h / sin_h must be [T, rope_dim / 2] = {(T, rope_dim // 2)}, got {tuple(cos_h.shape)}")
    if config is None:
        conf = default_config(T, qk_head_dim, rope_dim, head_dim, y2d.device)
    else:
        _check_config(config, T, num_heads, qk_head_dim, rope_dim, head_dim)
        conf = config
    out, rs, cd, cs = rope_quant_outputs(y2d, mode, columnwise)
    if T == 0:
        return out, rs, cd, cs
    args = dict(y_ptr=y2d, stride_y=y2d.stride(0), cos_ptr=cos_h, sin_ptr=sin_h, stride_cs=cos_h.stride(0),
                out_ptr=out, row_scale_ptr=rs, col_data_ptr=cd, col_scale_ptr=cs, T=T,
                H=num_heads, D=head_dim, P=qk_head_dim, R=rope_dim, STYLE=rope_style, INVERSE=inverse,
                MODE=mode, COLUMNWISE=columnwise, SCALE_MODE=scale_mode, num_warps=conf.num_warps,
                enable_fp_fusion=False)  # products rounded before the sums: the reference's bits
    head_major = conf.FAST and conf.HEAD_MAJOR  # the gather path's grid is token-major
    grid = (num_heads, cdiv(T, 32)) if head_major else (cdiv(T, 32), num_heads)
    _rope_quant_kernel[grid](FAST=conf.FAST, PASS_W=conf.PASS_W, HEAD_MAJOR=head_major,
                             EMULATED=_op.emulated(y2d.device), **args)
    return out, rs, cd, cs


# ------------------------------------------------------------------------------------------------ custom op


def _rope_quant_impl(y2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, cfg: str, inverse: bool, mode: str,
                     columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_quant` with the geometry, rope style and scale mode of the layer config cfg (`QProjConfig.encode`): the
    query's (forward) or the MXFP8 GEMM inputs' (inverse: the query gradient's images)."""
    c = QProjConfig.decode(cfg)
    return rope_quant(y2d, cos_h, sin_h, num_heads=c.num_heads, head_dim=c.q_head_dim, qk_head_dim=c.qk_head_dim,
                      rope_dim=c.rope_dim, rope_style=c.rope_style, inverse=inverse, mode=mode,
                      columnwise=columnwise, scale_mode=c.scale_mode if inverse else c.query_scale_mode)


def _rope_quant_fake(y2d, cos_h, sin_h, cfg, inverse, mode, columnwise):
    return rope_quant_outputs(y2d, mode, columnwise)


rope_quant_op = _op.define_op("mla_qproj::rope_quant", _rope_quant_impl, _rope_quant_fake)
