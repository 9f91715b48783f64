"""Triton twins of `reference/fp8_block.py` (SPEC §5; same names, same steps) shared by the block-scaled FP8
kernels, plus host-side argument checks.

EMULATED (a constexpr: the interpreter or CPU tensors) selects explicit forms where Triton's interpreter differs
from the GPU (SPEC §2): elements are rounded onto the E4M3 grid in fp32 before the (then exact) cast, bf16 is widened
through its bits, the amax ignores NaN explicitly. On the GPU, `(x * scale).to(tl.float8e4nv)` is
cvt.rn.satfinite.e4m3x2.f32 (round to nearest even, saturate to ±448) and max.f32 ignores NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import BLOCK_SCALES, check_block_scale
from ..._constants import FLOAT_DTYPES, FLT_MAX
from ._common import amax, round_to_e4m3_grid, widen

__all__ = ["fp8_block_scale", "block_scale_code", "encode_operand", "quantize_with_scale", "nan_sign", "nan_max",
           "block_amax", "pack_e4m3_words", "runs_of", "widen_lean", "check_float_tensor", "round_up", "BLOCK_SCALES",
           "check_block_scale", "T_PAD", "FLOAT_DTYPES"]

_FLT_MAX = tl.constexpr(FLT_MAX)
# fp32(448 / amax) is inf exactly when amax <= 448 * 2^-128 = 7 * 2^-122: there the real quotient is >= 2^128, and
# one fp32 step above (amax + 2^-143) it falls below FLT_MAX + half an ulp. Testing amax against it gives the SPEC's
# FLT_MAX without dividing into an overflow (numpy, behind the interpreter, warns on it).
_OVERFLOW_AMAX = tl.constexpr(7.0 * 2.0**-122)

T_PAD = 16  # transposed 128x1 codes [N, T_pad]: T_pad = round_up(T, T_PAD) (cuBLAS: 16-byte aligned rows)


def block_scale_code(block_scale: str) -> int:
    """The kernels' BLOCK_SCALE constexpr: 0 "pow2", 1 "fp32", 2 "deepseek"."""
    return BLOCK_SCALES.index(check_block_scale(block_scale))


@triton.jit
def encode_operand(x, scale, BLOCK_SCALE: tl.constexpr):
    """fp32(x * scale), or for "deepseek" fp32(x / scale_inv) (`fp8_block_scale`'s first result is then scale_inv)."""
    if BLOCK_SCALE == 2:
        return tl.math.div_rn(x, scale)
    return x * scale


@triton.jit
def fp8_block_scale(amax, BLOCK_SCALE: tl.constexpr):
    """SPEC §5: (encode operand, scale_inv) fp32 of blocks with this amax (>= 0 or NaN).
    BLOCK_SCALE 0 "pow2" / 1 "fp32" (TransformerEngine's rules): the multiplier scale = 1.0 for amax 0, NaN or inf;
    else fp32(448 / amax) (round to nearest even), FLT_MAX where that overflows; "pow2" then clears its mantissa
    bits. scale_inv = fp32(1 / scale) (exact for "pow2").
    BLOCK_SCALE 2 "deepseek" (DeepSeek-V3's kernels): scale_inv = fp32(amax / 448) (1.0 for amax 0, NaN or inf, and
    where the quotient underflows to 0), which is also the operand: the codes divide by it (`encode_operand`).

    "pow2" from the exponent alone (no division; checked against the SPEC form on all 2^31 non-negative fp32 amaxes,
    no mismatch: the check's commit is in BENCHMARKS.md): for amax = m * 2^e (1 <= m < 2, e = biased exponent -
    127), 448 / amax = (1.75 / m) * 2^(8 - e) and 1.75 / m lies in [1, 1.75] for m <= 1.75 and in (0.875, 1) above,
    never rounding up to the next power of two: scale = 2^k with
    k = 135 - biased_exp - (mantissa bits > 0x600000); k >= 128 is exactly the overflow (amax <= 7 * 2^-122, fp32
    subnormals included), whose FLT_MAX clears to 2^127. scale_inv = 2^-k (the subnormal 2^-127 for k = 127).
    In bits (few instructions: the kernels compute one scale per row and column they hold): adding 0x1FFFFF carries
    into the exponent field exactly when the mantissa bits exceed 0x600000, so e = (bits + 0x1FFFFF) >> 23 is
    biased_exp + (mantissa bits > 0x600000) and scale's biased exponent is min(262 - e, 254); scale_inv's bits are
    0x7F000000 - scale's (2^-k for k < 127; 1.0 for scale 1.0), raised to 0x400000 (2^-127) where that gives 0
    (k = 127). Special amaxes (0, inf, NaN; any sign bit) are those with bits - 1 >= 0x7F7FFFFF unsigned.
    "fp32" and "deepseek" divide with tl.math.div_rn (plain `/` is approximate on the GPU)."""
    if BLOCK_SCALE == 0:
        bits = amax.to(tl.uint32, bitcast=True)
        special = (bits - 1) >= 0x7F7FFFFF  # 0, inf, NaN
        e = (bits + 0x1FFFFF) >> 23  # garbage only where special
        kb = tl.minimum(tl.where(special, 127, 262 - e.to(tl.int32)), 254)
        scale_bits = kb << 23
        scale = scale_bits.to(tl.float32, bitcast=True)
        scale_inv = tl.maximum(0x7F000000 - scale_bits, 0x400000).to(tl.float32, bitcast=True)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        special = (amax == 0) | (((bits >> 23) & 0xFF) == 0xFF)  # 0, inf, NaN
        if BLOCK_SCALE == 2:
            scale_inv = tl.math.div_rn(tl.where(special, 0.0, amax), 448.0)
            scale_inv = tl.where(scale_inv == 0, 1.0, scale_inv)
            scale = scale_inv
        else:
            overflow = amax <= _OVERFLOW_AMAX  # False for NaN
            scale = tl.math.div_rn(448.0, tl.where(special | overflow, 1.0, amax))
            scale = tl.where(special, 1.0, tl.where(overflow, _FLT_MAX, scale))
            scale_inv = tl.math.div_rn(1.0, scale)
    return scale, scale_inv


@triton.jit
def nan_sign(x_raw):
    """0x80 where x's sign bit is set, else 0 (int32), read from x's own bits: the GPU's fp16 -> fp32 conversion
    drops a NaN's sign, bitwise the sign survives in every input dtype."""
    if x_raw.dtype.primitive_bitwidth == 16:
        s = (x_raw.to(tl.int16, bitcast=True).to(tl.int32) >> 8) & 0x80
    else:
        s = (x_raw.to(tl.int32, bitcast=True) >> 24) & 0x80
    return s


@triton.jit
def quantize_with_scale(x, scale, sign, EMULATED: tl.constexpr, NAN_SIGN: tl.constexpr, BLOCK_SCALE: tl.constexpr):
    """Element code bits (uint8; SPEC §5, §2 element rules): E4M3 round-to-nearest-even of `encode_operand(x, scale)`
    (fp32(x * scale); "deepseek": fp32(x / scale_inv)), saturated to ±448; NaN is 0x7F | sign (sign: 0 or 0x80, see
    `nan_sign`), the sign of zero is kept.
    NAN_SIGN=False: the caller passes sign 0 (computed tensors, NaN made +NaN: reference `canonical_nan`); on the GPU
    the multiply already gives +NaN, which the cast encodes 0x7F, so the fix-up is skipped there."""
    y = encode_operand(x, scale, BLOCK_SCALE)
    if EMULATED:
        code = round_to_e4m3_grid(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(x == x, code, 0x7F | sign).to(tl.uint8)
    else:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if NAN_SIGN:
            code = tl.where(x == x, code, 0x7F | sign).to(tl.uint8)
    return code


@triton.jit
def widen_lean(x, EMULATED: tl.constexpr):
    """`widen` with bf16 on the GPU as one shift / one mask per element of a bf16 pair held in one 32-bit
    register (the default lowering spends three instructions per pair more); the same bits."""
    if EMULATED or x.dtype != tl.bfloat16:
        y = widen(x, EMULATED)
    else:
        y = tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                      dtype=tl.float32, is_pure=True, pack=2)
    return y


@triton.jit
def _e4m3x4_gpu(a, b, c, d):
    """Four fp32 tensors -> one int32 of E4M3 codes, a in the low byte (memory order a, b, c, d on a little-endian
    device). cvt.rn.satfinite.e4m3x2.f32 is the conversion `.to(tl.float8e4nv)` lowers to (round to nearest even,
    saturate to ±448, NaN -> 0x7F); it packs its second source in the low byte."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,r,r,r,r", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _code_bits(y):
    """EMULATED element code (int32 0..255) of y = x * scale: the E4M3 grid value cast exactly, NaN -> 0x7F."""
    code = round_to_e4m3_grid(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where(y == y, code, 0x7F)


@triton.jit
def runs_of(c0, W: tl.constexpr, C: tl.constexpr):
    """c0 + [0, W) as offsets known contiguous in runs of C (not W): caps Triton's axis information so that tiles
    loaded through these offsets get the layout of the word-packed stores (no conversions between them)."""
    o = tl.arange(0, W)
    return c0 + (o // C) * C + o % C


@triton.jit
def pack_e4m3_words(y, EMULATED: tl.constexpr):
    """y [A, B, 4k] fp32 (x * scale of computed values: NaN is +NaN) -> int32 [A, B, k]: the element codes of 4
    consecutive elements of the last dimension per word, the first in the low byte, so that a word store writes the
    codes in memory order. On the GPU two conversions of two elements each (`_e4m3x4_gpu`) per word and no byte
    shuffling; where the 4 elements lie in one thread (the callers' layouts) the splits are register renamings."""
    A: tl.constexpr = y.shape[0]
    B: tl.constexpr = y.shape[1]
    K4: tl.constexpr = y.shape[2] // 4
    e0, e1 = tl.split(tl.reshape(y, [A, B, K4, 2, 2]))  # element 4m + 2 i + j: e_j [A, B, K4, 2 (i)]
    a, c = tl.split(e0)  # elements 4m, 4m + 2
    b, d = tl.split(e1)  # elements 4m + 1, 4m + 3
    if EMULATED:
        w = _code_bits(a) | (_code_bits(b) << 8) | (_code_bits(c) << 16) | (_code_bits(d) << 24)
    else:
        w = _e4m3x4_gpu(a, b, c, d)
    return w


@triton.jit
def nan_max(a, b, EMULATED: tl.constexpr):
    """max(a, b) ignoring NaN (NaN only if both are): combines the amaxes of two parts of one block."""
    if EMULATED:
        m = tl.where(a != a, b, tl.where(b != b, a, tl.maximum(a, b)))
    else:
        m = tl.maximum(a, b)  # max.f32: NaN-ignoring
    return m


@triton.jit
def block_amax(x, EMULATED: tl.constexpr):
    """NaN-ignoring amax of a whole 2-D tile (one 128x128 block): the max of its rows' amaxes."""
    return amax(amax(x, 1, EMULATED), 0, EMULATED)


# ------------------------------------------------------------------------------------------------ host checks


def check_float_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
    return t


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
