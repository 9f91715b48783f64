"""RoPE (forward or inverse) fused with quantization, one program per (32 tokens, head).

Forward (SPEC §1.4-1.5): y [T, H*D] fp32 from the GEMM -> RoPE on each head's rope columns -> MXFP8 rowwise
(32-blocks along D) [+ columnwise, 32-blocks along T] or bf16 (the general forward path; the fused GEMM's
epilogue does this on sm_90).
Inverse (SPEC backward 1-2): dq [T, H*D] -> transpose rotation -> the exact bf16 images of the MXFP8 dgrad
operand (rowwise) and wgrad operand (columnwise), or the bf16 / fp32 gradient.

Two kernels, the same bytes (tests/test_kernels.py compares them on special values):
- `_rope_quant_fast_kernel` (default where `fast_path_supported`): contiguous [32, 32] / [32, 64] tiles, pairs
  split/joined in registers, hardware E4M3 / bf16 conversions on the GPU;
- `_rope_quant_kernel` (any geometry): [32 tokens, 32 columns] tiles whose rope columns gather their partners through
  `rope_sources`, which never leaves [qk_head_dim, qk_head_dim + R) of the same head; columns >= D are masked.
Both are bounded to their head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._config import interpreter_enabled
from .._constants import MX_BLOCK
from ._common import (
    amax_nan_ignoring,
    cdiv,
    check_pair_tables,
    dequantize_e4m3,
    image_multipliers_rceil,
    mx_quantize,
    rope_sources,
    round_to_bf16,
    to_bf16,
    widen,
)


@triton.jit
def _rope_quant_kernel(
    y_ptr, stride_y, cos_ptr, sin_ptr, stride_cs,
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
        b_o = widen(tl.load(p_y + o_d[None, :], mask=m, other=float("nan")), True)  # [32, 32]
        if (j * 32 + 32 > NOPE) and (j * 32 < NOPE + R):  # compile-time: this tile overlaps the rope columns
            p = o_d - NOPE
            is_rope = (p >= 0) & (p < R) & m_d
            src1, src2, sign, pair = rope_sources(tl.where(is_rope, p, 0), HALF, STYLE, INVERSE)
            m_r = m_t[:, None] & is_rope[None, :]
            b_v1 = widen(tl.load(p_y + (NOPE + src1)[None, :], mask=m_r, other=float("nan")), True)
            b_v2 = widen(tl.load(p_y + (NOPE + src2)[None, :], mask=m_r, other=0.0), True)
            b_c = widen(tl.load(cos_ptr + o_t[:, None] * stride_cs + pair[None, :], mask=m_r, other=1.0), True)
            b_s = widen(tl.load(sin_ptr + o_t[:, None] * stride_cs + pair[None, :], mask=m_r, other=0.0), True)
            # (v1*c) + ((±v2)*s): bitwise the reference's a*c - b*s (launched with FMA contraction off)
            b_o = tl.where(is_rope[None, :], b_v1 * b_c + (sign[None, :] * b_v2) * b_s, b_o)
        o_out = o_t[:, None] * N + i_h * D + o_d[None, :]
        if MODE == "mxfp8" or MODE == "mxfp8_images":
            b_q, b_byte = mx_quantize(b_o, 1, SCALE_MODE, True, True)  # b_byte [32]: one block per row
            if MODE == "mxfp8":
                tl.store(out_ptr + o_out, b_q, mask=m)
                tl.store(row_scale_ptr + o_t * (N // 32) + i_h * (D // 32) + j, b_byte.to(tl.uint8), mask=m_t)
            else:
                b_img = dequantize_e4m3(b_q, b_byte[:, None], b_o, True)
                tl.store(out_ptr + o_out, b_img.to(tl.bfloat16), mask=m)  # exact image
            if COLUMNWISE:
                b_cq, b_cbyte = mx_quantize(b_o, 0, SCALE_MODE, True, True)  # b_cbyte [32]: one block per column
                if MODE == "mxfp8":
                    tl.store(col_data_ptr + o_out, b_cq, mask=m)
                    tl.store(col_scale_ptr + i_t * N + i_h * D + o_d, b_cbyte.to(tl.uint8), mask=m_d)
                else:
                    b_cimg = dequantize_e4m3(b_cq, b_cbyte[None, :], b_o, True)
                    tl.store(col_data_ptr + o_out, b_cimg.to(tl.bfloat16), mask=m)
        elif MODE == "bf16":
            tl.store(out_ptr + o_out, round_to_bf16(b_o), mask=m)
        else:
            tl.static_assert(MODE == "fp32")
            tl.store(out_ptr + o_out, b_o, mask=m)


# ------------------------------------------------------------------------------------------ fast path
# Geometries whose qk_head_dim, rope_dim / 2 and trailing pass-through are multiples of 32 (DeepSeek: 128 + 64 + 0):
# every MX block of a head is either 32 pass-through columns or one half of 32 rope pairs, so the rope part is read
# and written as contiguous [32, 32] / [32, 64] tiles (no gathers): an interleaved tile is split into its even/odd
# members (reshape + split) or joined back (join + reshape), and cos/sin are [32 tokens, 32 pairs] tiles.


@triton.jit
def _emit_tile(b_y, o_t, m_t, i_t, col0, out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
               W: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr, COLUMNWISE: tl.constexpr,
               SCALE_MODE: tl.constexpr, EMULATED: tl.constexpr, IMAGE_NAN_SIGN: tl.constexpr,
               FAST_SCALE: tl.constexpr):
    """Store b_y [32 tokens, W] (fp32, W % 32 == 0) at output columns col0 + [0, W): rowwise MXFP8 (one block per
    32 columns) as codes + scales or as the bf16 image, columnwise (one block per column), bf16 or fp32."""
    o_w = tl.arange(0, W)
    o_out = o_t[:, None] * N + col0 + o_w[None, :]
    m = m_t[:, None] & (o_w < W)[None, :]
    NAN_SIGN: tl.constexpr = MODE == "mxfp8" or IMAGE_NAN_SIGN  # codes stored: SPEC §2 NaN sign
    # images on the GPU, rceil: the code's multiplier and the image's scale straight from the amax (no byte)
    LEAN: tl.constexpr = MODE == "mxfp8_images" and not NAN_SIGN and not EMULATED and SCALE_MODE == "rceil" and \
        FAST_SCALE
    if LEAN:
        b_y3 = tl.reshape(b_y, [32, W // 32, 32])
        b_r, b_s = image_multipliers_rceil(amax_nan_ignoring(b_y3, 2, False))  # [32, W // 32]
        b_img = (b_y3 * b_r[:, :, None]).to(tl.float8e4nv).to(tl.float32) * b_s[:, :, None]  # exact in bf16
        tl.store(out_ptr + o_out, tl.reshape(b_img, [32, W]).to(tl.bfloat16), mask=m)
        if COLUMNWISE:
            b_cr, b_cs = image_multipliers_rceil(amax_nan_ignoring(b_y, 0, False))  # [W]
            b_cimg = (b_y * b_cr[None, :]).to(tl.float8e4nv).to(tl.float32) * b_cs[None, :]
            tl.store(col_data_ptr + o_out, b_cimg.to(tl.bfloat16), mask=m)
    elif MODE == "mxfp8" or MODE == "mxfp8_images":
        b_y3 = tl.reshape(b_y, [32, W // 32, 32])
        b_q, b_byte = mx_quantize(b_y3, 2, SCALE_MODE, EMULATED, NAN_SIGN)  # b_byte [32, W // 32]
        if MODE == "mxfp8":
            tl.store(out_ptr + o_out, tl.reshape(b_q, [32, W]), mask=m)
            o_s = o_t[:, None] * (N // 32) + col0 // 32 + tl.arange(0, W // 32)[None, :]
            tl.store(row_scale_ptr + o_s, b_byte.to(tl.uint8), mask=m_t[:, None])
        else:
            b_img = dequantize_e4m3(b_q, b_byte[:, :, None], b_y3, EMULATED)  # exact in bf16
            tl.store(out_ptr + o_out, tl.reshape(b_img, [32, W]).to(tl.bfloat16), mask=m)
        if COLUMNWISE:
            b_cq, b_cbyte = mx_quantize(b_y, 0, SCALE_MODE, EMULATED, NAN_SIGN)  # b_cbyte [W]
            if MODE == "mxfp8":
                tl.store(col_data_ptr + o_out, b_cq, mask=m)
                tl.store(col_scale_ptr + i_t * N + col0 + o_w, b_cbyte.to(tl.uint8))
            else:
                b_cimg = dequantize_e4m3(b_cq, b_cbyte[None, :], b_y, EMULATED)
                tl.store(col_data_ptr + o_out, b_cimg.to(tl.bfloat16), mask=m)
    elif MODE == "bf16":
        tl.store(out_ptr + o_out, to_bf16(b_y, EMULATED), mask=m)
    else:
        tl.static_assert(MODE == "fp32")
        tl.store(out_ptr + o_out, b_y, mask=m)


@triton.jit
def _rope_quant_fast_kernel(
    y_ptr, stride_y, cos_ptr, sin_ptr, stride_cs,
    out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    T,
    H: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr,
    STYLE: tl.constexpr, INVERSE: tl.constexpr, MODE: tl.constexpr, COLUMNWISE: tl.constexpr,
    SCALE_MODE: tl.constexpr, HEADS: tl.constexpr, NOPE_W: tl.constexpr, EMULATED: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, IMAGE_NAN_SIGN: tl.constexpr, FAST_SCALE: tl.constexpr,
):
    """One program per (32 tokens, HEADS heads). Pairs (x1, x2) -> forward (x1 c - x2 s, x2 c + x1 s), inverse
    (x1 c + x2 s, x2 c - x1 s), each product rounded before the sum (launched with FMA contraction off), the
    reference's operation order. Interleaved layouts hold pair i at (2i, 2i + 1), halves at (i, R/2 + i):
    deepseek forward reads interleaved and writes halves (its inverse the opposite), neox is halves both ways,
    gptj interleaved both ways."""
    # HEAD_MAJOR: program_id(0) walks the head groups, so programs running side by side cover whole rows
    i_t = tl.program_id(1 if HEAD_MAJOR else 0).to(tl.int64)
    i_g = tl.program_id(0 if HEAD_MAJOR else 1).to(tl.int64)
    HALF: tl.constexpr = R // 2
    N: tl.constexpr = H * D
    IN_IL: tl.constexpr = (STYLE == "gptj") or (STYLE == "deepseek" and not INVERSE)
    OUT_IL: tl.constexpr = (STYLE == "gptj") or (STYLE == "deepseek" and INVERSE)
    o_t = i_t * 32 + tl.arange(0, 32)
    m_t = o_t < T
    o_32 = tl.arange(0, 32)
    for hh in range(HEADS):  # a runtime loop: one head's tiles are live at a time
        i_h = i_g * HEADS + hh
        p_y = y_ptr + o_t[:, None] * stride_y + i_h * D  # [32, 1] row starts of this head
        # pass-through columns: [32, NOPE_W] tiles; rows past T load as NaN (ignored by every amax, not stored)
        for j in tl.static_range(NOPE // NOPE_W):
            o_w = j * NOPE_W + tl.arange(0, NOPE_W)
            b_x = widen(tl.load(p_y + o_w[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)
            _emit_tile(b_x, o_t, m_t, i_t, i_h * D + j * NOPE_W, out_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
                       NOPE_W, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED, IMAGE_NAN_SIGN, FAST_SCALE)
        # trailing pass-through columns [NOPE + R, D): [32, 32] tiles
        for j in tl.static_range((D - NOPE - R) // 32):
            o_w = NOPE + R + j * 32 + o_32
            b_x = widen(tl.load(p_y + o_w[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)
            _emit_tile(b_x, o_t, m_t, i_t, i_h * D + NOPE + R + j * 32, out_ptr, row_scale_ptr, col_data_ptr,
                       col_scale_ptr, 32, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED, IMAGE_NAN_SIGN, FAST_SCALE)
        # rope columns: chunks of 32 pairs
        for c in tl.static_range(HALF // 32):
            o_cs = o_t[:, None] * stride_cs + c * 32 + o_32[None, :]
            b_c = widen(tl.load(cos_ptr + o_cs, mask=m_t[:, None], other=1.0), EMULATED)
            b_s = widen(tl.load(sin_ptr + o_cs, mask=m_t[:, None], other=0.0), EMULATED)
            if IN_IL:
                o_in = NOPE + c * 64 + tl.arange(0, 64)
                b_in = widen(tl.load(p_y + o_in[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)
                b_x1, b_x2 = tl.split(tl.reshape(b_in, [32, 32, 2]))
            else:
                o_1 = NOPE + c * 32 + o_32
                b_x1 = widen(tl.load(p_y + o_1[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)
                b_x2 = widen(tl.load(p_y + (o_1 + HALF)[None, :], mask=m_t[:, None], other=float("nan")), EMULATED)
            if INVERSE:
                b_y1 = b_x1 * b_c + b_x2 * b_s
                b_y2 = b_x2 * b_c - b_x1 * b_s
            else:
                b_y1 = b_x1 * b_c - b_x2 * b_s
                b_y2 = b_x2 * b_c + b_x1 * b_s
            if OUT_IL:
                b_yo = tl.reshape(tl.join(b_y1, b_y2), [32, 64])
                _emit_tile(b_yo, o_t, m_t, i_t, i_h * D + NOPE + c * 64, out_ptr, row_scale_ptr, col_data_ptr,
                           col_scale_ptr, 64, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED, IMAGE_NAN_SIGN, FAST_SCALE)
            else:
                _emit_tile(b_y1, o_t, m_t, i_t, i_h * D + NOPE + c * 32, out_ptr, row_scale_ptr, col_data_ptr,
                           col_scale_ptr, 32, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED, IMAGE_NAN_SIGN, FAST_SCALE)
                _emit_tile(b_y2, o_t, m_t, i_t, i_h * D + NOPE + HALF + c * 32, out_ptr, row_scale_ptr,
                           col_data_ptr, col_scale_ptr, 32, N, MODE, COLUMNWISE, SCALE_MODE, EMULATED, IMAGE_NAN_SIGN,
                           FAST_SCALE)


def fast_path_supported(qk_head_dim: int, rope_dim: int, head_dim: int) -> bool:
    """The contiguous-tile kernel covers qk_head_dim, rope_dim / 2 and the trailing pass-through width
    head_dim - qk_head_dim - rope_dim all multiples of 32 (DeepSeek: 128 + 64 + 0)."""
    tail = head_dim - qk_head_dim - rope_dim
    return qk_head_dim % 32 == 0 and rope_dim > 0 and (rope_dim // 2) % 32 == 0 and tail >= 0 and tail % 32 == 0


def _fast_launch(qk_head_dim: int, device: torch.device, **knobs) -> dict:
    """Launch knobs of the fast kernel (defaults measured on an H200, see BENCHMARKS.md); knobs override."""
    nope_w = knobs.pop("NOPE_W", None) or next((w for w in (64, 32) if qk_head_dim % w == 0), 32)
    # H200, T = 16384, backward operands (scripts/kernel_sweep.py, 2026-11-30): one head per program and 2 warps;
    # several heads per program ran 1.2-4x slower (registers), the emulated rounding 6x slower.
    # IMAGE_NAN_SIGN=False (mxfp8_images only): codes that only become bf16 images skip the NaN-sign fix (the image
    # is NaN either way): 232 -> 80 registers, ~30 % fewer instructions, 1.02 -> 0.745 ms (0.56 -> 0.77 of copy)
    # FAST_SCALE (GPU, rceil images): the multipliers from the amax bits directly (`image_multipliers_rceil`)
    # 2026-12-01: one warp per program (no shared-memory column amax, no barriers; 816 -> 693 sm_90 warp-instructions
    # per 1024 elements): 0.720 -> 0.679 ms at T = 16384, 0.79 -> 0.84 of copy (evict-first loads and streaming
    # stores measured slower: 0.74-0.76)
    conf = dict(HEADS=1, NOPE_W=nope_w, num_warps=1, HEAD_MAJOR=True, IMAGE_NAN_SIGN=False, FAST_SCALE=True,
                EMULATED=interpreter_enabled() or device.type != "cuda")
    conf.update(knobs)
    return conf


def rope_quant(y2d: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, *, num_heads: int, head_dim: int,
               qk_head_dim: int, rope_dim: int, rope_style: str, inverse: bool, mode: str, columnwise: bool,
               scale_mode: str, fast: bool | None = None, **knobs):
    """y2d [T, H*D] (unit inner stride), cos_h/sin_h [T, R/2] pair tables (`check_pair_tables`: fp32 / bf16 /
    fp16, unit inner stride, any row stride).

    mode 'mxfp8': (row data fp8 [T, N], row scale [T, N/32], col data, col scale [ceil(T/32), N]) — forward output.
    mode 'mxfp8_images': (row image bf16 [T, N], col image bf16 [T, N]) — backward GEMM operands.
    mode 'bf16' / 'fp32': (rotated [T, N],). Absent outputs are empty tensors. MXFP8 modes need D % 32 == 0.
    fast: the contiguous-tile kernel (default: when `fast_path_supported`); knobs: its launch knobs (benchmarks).
    """
    T, N = y2d.shape
    dev = y2d.device
    check_pair_tables(cos_h, sin_h)
    if tuple(cos_h.shape) != (T, rope_dim // 2):
        raise ValueError(f"cos_h / sin_h must be [T, rope_dim / 2] = {(T, rope_dim // 2)}, got {tuple(cos_h.shape)}")
    mx = mode == "mxfp8"
    e = torch.empty
    if mode == "mxfp8":
        out = e((T, N), dtype=torch.float8_e4m3fn, device=dev)
        rs = e((T, N // MX_BLOCK), dtype=torch.uint8, device=dev)
    else:
        out = e((T, N), dtype=torch.float32 if mode == "fp32" else torch.bfloat16, device=dev)
        rs = e((0,), dtype=torch.uint8, device=dev)
    cd = e((T, N) if columnwise else (0,), dtype=torch.float8_e4m3fn if mx else torch.bfloat16, device=dev)
    cs = e((cdiv(T, MX_BLOCK), N) if (columnwise and mx) else (0,), dtype=torch.uint8, device=dev)
    if fast is None:
        fast = fast_path_supported(qk_head_dim, rope_dim, head_dim)
    if T > 0 and fast:
        conf = _fast_launch(qk_head_dim, dev, **knobs)
        if num_heads % conf["HEADS"]:
            raise ValueError(f"HEADS ({conf['HEADS']}) must divide num_heads ({num_heads})")
        grid = (cdiv(T, 32), num_heads // conf["HEADS"])
        if grid[0] > 65535:  # a CUDA grid's y extent: keep the token blocks on x
            conf["HEAD_MAJOR"] = False
        _rope_quant_fast_kernel[grid[::-1] if conf["HEAD_MAJOR"] else grid](
            y_ptr=y2d, stride_y=y2d.stride(0), cos_ptr=cos_h, sin_ptr=sin_h, stride_cs=cos_h.stride(0),
            out_ptr=out, row_scale_ptr=rs, col_data_ptr=cd, col_scale_ptr=cs, T=T,
            H=num_heads, D=head_dim, NOPE=qk_head_dim, R=rope_dim, STYLE=rope_style, INVERSE=inverse,
            MODE=mode, COLUMNWISE=columnwise, SCALE_MODE=scale_mode, enable_fp_fusion=False, **conf,
        )
    elif T > 0:
        _rope_quant_kernel[(cdiv(T, 32), num_heads)](
            y_ptr=y2d, stride_y=y2d.stride(0), cos_ptr=cos_h, sin_ptr=sin_h, stride_cs=cos_h.stride(0),
            out_ptr=out, row_scale_ptr=rs, col_data_ptr=cd, col_scale_ptr=cs, T=T,
            H=num_heads, D=head_dim, NOPE=qk_head_dim, R=rope_dim, STYLE=rope_style, INVERSE=inverse,
            MODE=mode, COLUMNWISE=columnwise, SCALE_MODE=scale_mode, num_warps=4, enable_fp_fusion=False,
        )
    if mode == "mxfp8":
        return out, rs, cd, cs
    if mode == "mxfp8_images":
        return out, cd
    return (out,)
