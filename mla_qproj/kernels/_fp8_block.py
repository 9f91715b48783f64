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

from ..reference.fp8_block import BLOCK_SCALES, FLT_MAX, check_block_scale
from ._common import amax_nan_ignoring, round_to_e4m3_grid

__all__ = ["fp8_block_scale", "quantize_with_scale", "nan_sign", "widen_to_fp32", "nan_max", "block_amax",
           "check_float_tensor", "round_up", "BLOCK_SCALES", "check_block_scale", "T_PAD", "FLOAT_DTYPES"]

_FLT_MAX = tl.constexpr(FLT_MAX)
# fp32(448 / amax) is inf exactly when amax <= 448 * 2^-128 = 7 * 2^-122: there the real quotient is >= 2^128, and
# one fp32 step above (amax + 2^-143) it falls below FLT_MAX + half an ulp. Testing amax against it gives the SPEC's
# FLT_MAX without dividing into an overflow (numpy, behind the interpreter, warns on it).
_OVERFLOW_AMAX = tl.constexpr(7.0 * 2.0**-122)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
T_PAD = 16  # transposed 128x1 codes [N, T_pad]: T_pad = round_up(T, T_PAD) (cuBLAS: 16-byte aligned rows)


@triton.jit
def fp8_block_scale(amax, POW2: tl.constexpr):
    """SPEC §5: (scale, scale_inv) fp32 of blocks with this amax (>= 0 or NaN). scale = 1.0 for amax 0, NaN or inf;
    else fp32(448 / amax) (round to nearest even), FLT_MAX where that overflows; POW2 then clears its mantissa bits.
    scale_inv = fp32(1 / scale) (exact for POW2).

    POW2 from the exponent alone (no division; scripts/fp8_block_pow2_check.py checks it against the SPEC form on
    every fp32 amax): for amax = m * 2^e (1 <= m < 2, e = biased exponent - 127), 448 / amax = (1.75 / m) * 2^(8 - e)
    and 1.75 / m lies in [1, 1.75] for m <= 1.75 and in (0.875, 1) above, never rounding up to the next power of
    two: scale = 2^k with
    k = 135 - biased_exp - (mantissa bits > 0x600000); k >= 128 is exactly the overflow (amax <= 7 * 2^-122, fp32
    subnormals included), whose FLT_MAX clears to 2^127. scale_inv = 2^-k (the subnormal 2^-127 for k = 127).
    "fp32" divides with tl.math.div_rn (plain `/` is approximate on the GPU)."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    special = (amax == 0) | (exp == 0xFF)  # 0, inf, NaN
    if POW2:
        k = tl.minimum(135 - exp - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32), 127)
        scale = tl.where(special, 0x3F800000, (k + 127) << 23).to(tl.float32, bitcast=True)
        scale_inv = tl.where(special, 0x3F800000, tl.where(k == 127, 0x400000, (127 - k) << 23))
        scale_inv = scale_inv.to(tl.float32, bitcast=True)
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
def widen_to_fp32(x, EMULATED: tl.constexpr):
    """x (fp32 / bf16 / fp16) as fp32, exactly. The interpreter's bf16 -> fp32 cast flushes some subnormals: widen
    bf16 through its bits there."""
    if EMULATED and x.dtype == tl.bfloat16:
        y = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def quantize_with_scale(x, scale, sign, EMULATED: tl.constexpr, NAN_SIGN: tl.constexpr):
    """Element code bits (uint8; SPEC §5, §2 element rules): E4M3 round-to-nearest-even of fp32(x * scale), saturated
    to ±448; NaN is 0x7F | sign (sign: 0 or 0x80, see `nan_sign`), the sign of zero is kept.
    NAN_SIGN=False: the caller passes sign 0 (computed tensors, NaN made +NaN: reference `canonical_nan`); on the GPU
    the multiply already gives +NaN, which the cast encodes 0x7F, so the fix-up is skipped there."""
    y = x * scale
    if EMULATED:
        code = round_to_e4m3_grid(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(x == x, code, 0x7F | sign).to(tl.uint8)
    else:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if NAN_SIGN:
            code = tl.where(x == x, code, 0x7F | sign).to(tl.uint8)
    return code


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
    return amax_nan_ignoring(amax_nan_ignoring(x, 1, EMULATED), 0, EMULATED)


# ------------------------------------------------------------------------------------------------ host checks


def check_float_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
    return t


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
