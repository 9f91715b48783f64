"""Triton twins of `reference/mxfp8.py` (same names, same steps), the forms the kernels call (one per concept,
switched on EMULATED: `amax`, `quantize_e4m3`, `to_bf16`, `widen`; `mx_quantize` / `mx_image` for MXFP8 tiles) and
the RoPE index maps.

SPEC §2: the element rounding is done explicitly in fp32 onto the E4M3 grid and only then cast, because
Triton's interpreter mis-rounds fp32 -> float8e4nv casts of off-grid values (on-grid casts are exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._constants import FLOAT_DTYPES

_INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)  # becomes fp32(1/448) against an fp32 operand (SPEC §2)
_TWO_POW_23 = tl.constexpr(8388608.0)


@triton.jit
def nan_ignoring_amax(x, axis: tl.constexpr):
    """max |x| along axis ignoring NaN (fmax semantics); NaN only when all are NaN. Mask with NaN to skip."""
    a = tl.abs(x)
    a = tl.where(a == a, a, -1.0)
    m = tl.max(a, axis=axis)
    # NaN made from bits: a NaN global constexpr would fail Triton's "global changed" check (nan != nan)
    nan = (m.to(tl.int32, bitcast=True) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(m < 0, nan, m)


@triton.jit
def e8m0_from_amax_rceil(amax):
    """Biased exponent of v = amax * fp32(1/448), plus one if v has mantissa bits (SPEC §2 rceil)."""
    v = amax * _INV_E4M3_MAX
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    round_up = (mant != 0) & (exp != 0xFE) & ((exp != 0) | (mant > 0x400000))
    byte = exp + round_up.to(tl.int32)
    # exponent 0xFF: inf -> 0xFE, NaN -> 0xFF
    return tl.where(exp == 0xFF, tl.where(mant == 0, 0xFE, 0xFF), byte)


@triton.jit
def e8m0_from_amax_floor(amax):
    """clamp(floor(log2(amax)) - 8 + 127, 0, 254); 0 for amax 0, 0xFE for inf, 0xFF for NaN (SPEC §2 floor)."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    byte = tl.minimum(tl.maximum(exp - 8, 0), 0xFE)
    return tl.where(exp == 0xFF, tl.where(mant == 0, 0xFE, 0xFF), byte)


@triton.jit
def e8m0_from_amax(amax, SCALE_MODE: tl.constexpr):
    if SCALE_MODE == "rceil":
        byte = e8m0_from_amax_rceil(amax)
    else:
        tl.static_assert(SCALE_MODE == "floor")
        byte = e8m0_from_amax_floor(amax)
    return byte


@triton.jit
def quant_multiplier(byte, SCALE_MODE: tl.constexpr):
    """r = 2^(127 - byte) (SPEC §2), except rceil's byte 0 gives r = 1 (its blocks round to zero); floor's byte 0
    gives 2^127 like every other byte. byte >= 254 gives the subnormal 2^-127 (only inf/NaN blocks)."""
    bits = tl.where(byte >= 254, 0x00400000, (254 - tl.minimum(byte, 253)) << 23)
    r = bits.to(tl.float32, bitcast=True)
    if SCALE_MODE == "rceil":
        r = tl.where(byte == 0, 1.0, r)
    return r


@triton.jit
def e8m0_to_fp32(byte):
    """2^(byte - 127) for byte in [0, 254] (exact; byte 0 is the subnormal 2^-127): decode of a stored scale."""
    return tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3_grid(x):
    """fp32 -> nearest-even E4M3 value as fp32, saturated to ±448; NaN stays NaN; sign of zero kept.

    e = clamp(exponent(|x|), -6, 8) gives the grid spacing 2^(e-3); |x| * 2^(3-e) is rounded to an integer
    with the fp32 add/subtract-2^23 trick (round-to-nearest-even) and scaled back; all scalings are exact.
    """
    xb = x.to(tl.int32, bitcast=True)
    ax = tl.abs(x)
    e = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, -6), 8)
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3-e)
    down = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e-3)
    m = ax * up
    r = (m + _TWO_POW_23) - _TWO_POW_23
    r = tl.where(m >= _TWO_POW_23, m, r)
    y = tl.minimum(r * down, 448.0)
    y = (y.to(tl.int32, bitcast=True) | ((xb >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(x == x, y, x)


@triton.jit
def encode_e4m3(y, x):
    """E4M3 codes of y = x * r (fp32): round onto the E4M3 grid, then the (exact) cast. NaN is written as the
    E4M3 NaN code 0x7F with x's sign explicitly (the interpreter's cast of NaN gives other codes)."""
    yr = round_to_e4m3_grid(y)
    code = yr.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    nan_code = (0x7F | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)
    return tl.where(yr == yr, code, nan_code).to(tl.float8e4nv, bitcast=True)


@triton.jit
def rope_sources(p, HALF: tl.constexpr, STYLE: tl.constexpr, INVERSE: tl.constexpr):
    """For rope-column p (0 <= p < R) of the *result*: (src1, src2, sign, pair) with
    result[p] = in[src1] * c[pair] + sign * in[src2] * s[pair] (SPEC §3). Indices stay inside the head."""
    if STYLE == "neox":
        hi = p >= HALF
        pair = tl.where(hi, p - HALF, p)
        src1 = p
        src2 = tl.where(hi, p - HALF, p + HALF)
        lo_first = ~hi
    elif STYLE == "gptj":
        odd = (p % 2) == 1
        pair = p // 2
        src1 = p
        src2 = tl.where(odd, p - 1, p + 1)
        lo_first = ~odd
    else:
        tl.static_assert(STYLE == "deepseek")
        if INVERSE:
            # result (input layout) column 2i <- a = g[i] c + g[H+i] s; 2i+1 <- b = g[H+i] c - g[i] s
            odd = (p % 2) == 1
            pair = p // 2
            src1 = tl.where(odd, HALF + pair, pair)
            src2 = tl.where(odd, pair, HALF + pair)
            lo_first = ~odd
        else:
            # result column i <- a' = in[2i] c - in[2i+1] s; column H+i <- b' = in[2i+1] c + in[2i] s
            hi = p >= HALF
            pair = tl.where(hi, p - HALF, p)
            src1 = tl.where(hi, 2 * pair + 1, 2 * pair)
            src2 = tl.where(hi, 2 * pair, 2 * pair + 1)
            lo_first = ~hi
    # forward: first member gets -s; inverse (transpose): first member gets +s
    if INVERSE:
        sign = tl.where(lo_first, 1.0, -1.0)
    else:
        sign = tl.where(lo_first, -1.0, 1.0)
    return src1, src2, sign, pair


@triton.jit
def _round_to_bf16_bits(x):
    """fp32 -> bf16 with round-to-nearest-even done on the bits, then the (exact) cast: the interpreter's
    fp32 -> bf16 cast does not round to nearest-even, the GPU's does; this makes both match torch."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    y = bits.to(tl.float32, bitcast=True)
    return tl.where(x == x, y, x).to(tl.bfloat16)


# ------------------------------------------------------------------ switched forms (same bytes, fewer instructions)
# What the kernels call. EMULATED (a constexpr: the interpreter, or a CPU tensor; `kernels._op.emulated`) selects the
# explicit forms above; on the GPU the hardware instructions give the same bytes: max.f32 ignores NaN,
# cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even and saturates to ±448, cvt.rn.bf16.f32 rounds to nearest even.


@triton.jit
def amax(x, axis: tl.constexpr, EMULATED: tl.constexpr):
    """max |x| along axis ignoring NaN (NaN only when all are NaN): `nan_ignoring_amax`, or max.f32 on the GPU."""
    if EMULATED:
        m = nan_ignoring_amax(x, axis)
    else:
        m = tl.max(tl.abs(x), axis=axis)
    return m


@triton.jit
def quantize_e4m3(x, byte, SCALE_MODE: tl.constexpr, EMULATED: tl.constexpr, NAN_SIGN: tl.constexpr):
    """E4M3 codes of x * quant_multiplier(byte): `encode_e4m3`, or the hardware cast on the GPU; NaN keeps its sign
    (0x7F | sign) on both paths (the GPU's multiply and cast canonicalize NaN to +NaN). NAN_SIGN=False (GPU only, for
    codes that only feed a bf16 image, where NaN-ness is all that counts) skips that fix: ~4 instructions per
    element."""
    if EMULATED:
        q = encode_e4m3(x * quant_multiplier(byte, SCALE_MODE), x)
    elif NAN_SIGN:
        code = (x * quant_multiplier(byte, SCALE_MODE)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        nan_code = (0x7F | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)
        q = tl.where(x == x, code, nan_code).to(tl.float8e4nv, bitcast=True)
    else:
        q = (x * quant_multiplier(byte, SCALE_MODE)).to(tl.float8e4nv)
    return q


@triton.jit
def mx_quantize(b_x, AXIS: tl.constexpr, SCALE_MODE: tl.constexpr, EMULATED: tl.constexpr, NAN_SIGN: tl.constexpr):
    """MXFP8 of a tile whose AXIS spans exactly one block (32 elements; a partial block's missing elements are
    NaN, which the amax ignores): (E4M3 codes shaped like b_x, E8M0 bytes with AXIS reduced). The one tile
    quantizer of every MXFP8 kernel (SPEC §2)."""
    b_byte = e8m0_from_amax(amax(b_x, AXIS, EMULATED), SCALE_MODE)
    return quantize_e4m3(b_x, tl.expand_dims(b_byte, AXIS), SCALE_MODE, EMULATED, NAN_SIGN), b_byte


@triton.jit
def widen(x, EMULATED: tl.constexpr):
    """x (fp32 / bf16 / fp16) -> fp32, exactly. The interpreter flushes some bf16 subnormals when it widens them,
    so there bf16 is widened through its bits (its 16 bits are the top half of the fp32 pattern)."""
    if EMULATED and x.dtype == tl.bfloat16:
        y = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def image_multipliers_rceil(amax):
    """(r, s) of an rceil block straight from its amax, for codes that only become bf16 images (GPU path): the E4M3
    code is (x * r) rounded and its image code * s, where r = quant_multiplier(byte) and s the decoded scale of
    byte = e8m0_from_amax_rceil(amax) — without forming the byte. s = 2^(byte - 127) for byte 1..254 (the exponent
    field rounded up: (bits + 0x7FFFFF) & 0x7F800000, kept at 0xFE as SPEC §2 keeps it); byte 0 (v <= 2^-127: every
    code is ±0) gives r = 1, s = 0 (the image ±0 as well); an all-NaN block gives r = 1, s = 0 (its codes are NaN);
    inf gives byte 0xFE. r = 2^(127 - byte) = bits 0x7F000000 - s_bits, the subnormal 2^-127 for byte 0xFE."""
    vb = (amax * _INV_E4M3_MAX).to(tl.int32, bitcast=True)
    up = tl.minimum((vb + 0x7FFFFF) & 0x7F800000, 0x7F000000)  # NaN wraps to 0 (int32 add), inf to 0x7F000000
    s_bits = tl.where(vb < 0x800000, tl.where(vb > 0x400000, 0x800000, 0), up)  # subnormal v: byte 1 iff > 2^-127
    r_bits = tl.where(s_bits == 0, 0x3F800000, tl.where(s_bits == 0x7F000000, 0x400000, 0x7F000000 - s_bits))
    return r_bits.to(tl.float32, bitcast=True), s_bits.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x, EMULATED: tl.constexpr):
    """fp32 -> bf16, round to nearest even (explicit bits in the interpreter, cvt.rn on the GPU)."""
    if EMULATED:
        y = _round_to_bf16_bits(x)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def dequantize_e4m3(q, byte, x, EMULATED: tl.constexpr):
    """The exact value of code q under scale byte (fp32; exact in bf16), NaN where the quantized x was NaN (the
    interpreter decodes the E4M3 NaN code 0x7F as 480; the GPU's cvt decodes it as NaN)."""
    v = q.to(tl.float32) * e8m0_to_fp32(byte)
    if EMULATED:
        v = tl.where(x == x, v, x)
    return v


@triton.jit
def mx_image(b_x, AXIS: tl.constexpr, SCALE_MODE: tl.constexpr, EMULATED: tl.constexpr, NAN_SIGN: tl.constexpr):
    """The exact image (fp32, exact in bf16) of `mx_quantize(b_x, AXIS, ...)`: the codes decoded with their scales.
    On the GPU with rceil and NAN_SIGN=False the code's multiplier and the image's scale come straight from the amax
    (`image_multipliers_rceil`: no scale byte formed)."""
    if (not EMULATED) and (not NAN_SIGN) and SCALE_MODE == "rceil":
        b_r, b_s = image_multipliers_rceil(amax(b_x, AXIS, False))
        b_img = (b_x * tl.expand_dims(b_r, AXIS)).to(tl.float8e4nv).to(tl.float32) * tl.expand_dims(b_s, AXIS)
    else:
        b_q, b_byte = mx_quantize(b_x, AXIS, SCALE_MODE, EMULATED, NAN_SIGN)
        b_img = dequantize_e4m3(b_q, tl.expand_dims(b_byte, AXIS), b_x, EMULATED)
    return b_img


# ------------------------------------------------------------------------------------------------ host checks

PAIR_TABLE_DTYPES = FLOAT_DTYPES


def check_pair_tables(cos_h: torch.Tensor, sin_h: torch.Tensor) -> None:
    """cos/sin pair tables as the kernels read them: [T, R/2] fp32 / bf16 / fp16 (upcast exactly in the kernel), the
    same dtype and strides for both, unit inner stride, any row stride (a full-width table's view, a broadcast row)."""
    for name, t in (("cos_h", cos_h), ("sin_h", sin_h)):
        if t.dtype not in PAIR_TABLE_DTYPES:
            raise TypeError(f"{name} must be one of {PAIR_TABLE_DTYPES}, got {t.dtype}")
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be 2-D [T, R/2] with a unit inner stride, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")
    if cos_h.dtype != sin_h.dtype or cos_h.shape != sin_h.shape or cos_h.stride() != sin_h.stride():
        raise ValueError(f"cos_h and sin_h must share dtype, shape and strides: {cos_h.dtype} {tuple(cos_h.shape)} "
                         f"{cos_h.stride()} vs {sin_h.dtype} {tuple(sin_h.shape)} {sin_h.stride()}")


# host-side integer helpers: Triton 3.6's triton.cdiv / next_power_of_2 are constexpr functions whose Python call
# costs several microseconds each on the host (argument unwrapping), which adds up on the small-T launch path
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cap_on_releases(maxnreg: int, releases: tuple[tuple[int, int], ...]) -> int | None:
    """maxnreg where the running Triton's (major, minor) is one of `releases` (those whose code for the kernel was
    checked offline to fit the cap without spilling), else None: the cap is a fact about one compiler's code."""
    return maxnreg if tuple(int(v) for v in triton.__version__.split(".")[:2]) in releases else None


def register_cap(maxnreg: int | None) -> dict:
    """Launch options for a cap on a kernel's registers a thread (Triton's `maxnreg`; none when None). The cap is
    what lets an SM hold one more program of a register-heavy kernel: 65536 registers, allocated 8 a thread."""
    if maxnreg is None:
        return {}
    if isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not 24 <= maxnreg <= 248 or maxnreg % 8:
        raise ValueError(f"maxnreg must be None or a multiple of 8 in [24, 248], got {maxnreg!r}")
    return {"maxnreg": maxnreg}
