"""MXFP8 quantization in plain PyTorch (SPEC §2). Twin of `kernels/triton/_common.py`: same names, same steps.

All arithmetic on the bit level is done on the fp32 image, so the result is defined to the byte and the
Triton kernels (GPU and interpreter) can reproduce it exactly.
"""

from __future__ import annotations

import math

import torch

from .._constants import E4M3_MAX, E8M0_BIAS, E8M0_MAX, E8M0_NAN, MX_BLOCK

_INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()  # fp32(1/448)


def _fp32_bits(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.int32)


def widen(x: torch.Tensor) -> torch.Tensor:
    """x as fp32, a NaN keeping its sign: CUDA's fp16 -> fp32 conversion makes every NaN +NaN, so for fp16 the sign
    bit is taken from x's own bits (SPEC §2: -NaN encodes as 0xFF on every device). No branch on values."""
    xf = x.float()
    if x.dtype != torch.float16:
        return xf
    neg_nan = torch.isnan(xf) & (x.view(torch.int16) < 0)
    return torch.where(neg_nan, _fp32_bits(xf) | torch.iinfo(torch.int32).min, _fp32_bits(xf)).view(torch.float32)


def nan_ignoring_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| over `dim`, ignoring NaN (fmax semantics); NaN only when every element is NaN. No host sync and no
    branch on values (traceable by torch.compile): NaN becomes -1 in place on the fresh |x| (one pass; inf kept),
    the amax of a block of only NaN is then -1, made NaN on the reduced tensor."""
    a = x.abs().float()
    m = a.nan_to_num_(nan=-1.0, posinf=math.inf).amax(dim=dim)
    return torch.where(m < 0, torch.full_like(m, math.nan), m)


def e8m0_from_amax_rceil(amax: torch.Tensor) -> torch.Tensor:
    """SPEC §2 rceil: the exponent of v = amax * fp32(1/448), rounded up; 0 / 0xFF (NaN) / 0xFE (inf)."""
    v = amax.float() * _INV_E4M3_MAX
    bits = _fp32_bits(v)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    round_up = (mant != 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    byte = exp + round_up.to(torch.int32)
    byte = torch.where(v == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isinf(v), torch.full_like(byte, E8M0_MAX), byte)
    byte = torch.where(torch.isnan(v), torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def e8m0_from_amax_floor(amax: torch.Tensor) -> torch.Tensor:
    """SPEC §2 floor (OCP v1.0): clamp(floor(log2(amax)) - 8 + 127, 0, 254); 0 for amax 0, 0xFF for NaN."""
    a = amax.float()
    bits = _fp32_bits(a)
    exp = (bits >> 23) & 0xFF  # floor(log2(a)) + 127 for normal a; subnormal a clamps to 0 below anyway
    byte = (exp - 8).clamp(0, E8M0_MAX)
    byte = torch.where(torch.isinf(a), torch.full_like(byte, E8M0_MAX), byte)
    byte = torch.where(a == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isnan(a), torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def e8m0_from_amax(amax: torch.Tensor, scale_mode: str) -> torch.Tensor:
    if scale_mode == "rceil":
        return e8m0_from_amax_rceil(amax)
    if scale_mode == "floor":
        return e8m0_from_amax_floor(amax)
    raise ValueError(f"scale_mode must be 'rceil' or 'floor', got {scale_mode!r}")


def e8m0_to_fp32(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) as fp32 (exact; byte 0 gives the subnormal 2^-127, 0xFF gives NaN)."""
    b = byte.to(torch.int32)
    val = _pow2(b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def quant_multiplier(byte: torch.Tensor, scale_mode: str = "rceil") -> torch.Tensor:
    """r in SPEC §2 (fp32, exact; 2^-127 is a subnormal): 2^(127 - byte), except that rceil's byte 0 gives r = 1
    (its blocks hold only values that round to zero); floor's byte 0 gives 2^127 like every other byte."""
    b = byte.to(torch.int32)
    r = _pow2(E8M0_BIAS - b)
    return torch.where(b == 0, torch.ones_like(r), r) if scale_mode == "rceil" else r


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for integer e in [-149, 127] (exact), from the bits."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)  # 2^-149 .. 2^-127
    return torch.where(e >= -126, normal, sub)


def round_to_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to nearest-even onto the E4M3 grid, saturating to ±448; NaN stays NaN, sign of zero kept.

    Done in fp32 arithmetic (no fp8 cast) so the Triton twin can mirror it step by step:
    e = clamp(exponent(|x|), -6, 8); the grid spacing at e is 2^(e-3); |x| * 2^(3-e) is rounded to an
    integer by the fp32 "add and subtract 2^23" trick (RNE), and scaled back. Every scaling is by a power
    of two, so the only rounding is the one we want.
    """
    x = x.float()
    ax = x.abs()
    exp = (_fp32_bits(ax) >> 23) & 0xFF
    e = (exp - 127).clamp(-6, 8)
    up = torch.ldexp(torch.ones_like(ax), 3 - e)  # 2^(3-e)
    down = torch.ldexp(torch.ones_like(ax), e - 3)  # 2^(e-3)
    m = ax * up
    magic = torch.tensor(8388608.0, dtype=torch.float32)  # 2^23
    r = (m + magic) - magic  # RNE to an integer for 0 <= m < 2^23
    r = torch.where(m >= 8388608.0, m, r)  # huge values (saturate below) and inf
    y = torch.clamp(r * down, max=E4M3_MAX)
    y = torch.where(torch.signbit(x), -y, y)  # keeps -0
    return torch.where(torch.isnan(x), x, y)


def to_e4m3(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cast on-grid fp32 values to float8_e4m3fn; NaN becomes 0x7F with x's sign (SPEC §2) on every device
    (torch's CUDA cast drops the sign of NaN, its CPU cast keeps it)."""
    code = y.to(torch.float8_e4m3fn).view(torch.uint8)
    sign = (_fp32_bits(x.float()) >> 24) & 0x80
    nan_code = (0x7F | sign).to(torch.uint8)
    return torch.where(torch.isnan(y), nan_code, code).view(torch.float8_e4m3fn)


def encode_e4m3(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fp32 y = x * r (r > 0) -> E4M3 codes: round to nearest even onto the grid, saturate to ±448, NaN as 0x7F with
    x's sign, sign of zero kept. torch's fp32 -> float8_e4m3fn cast rounds to nearest even (tests/test_reference.py
    checks it against `round_to_e4m3_grid` bit for bit) but its handling of values past the grid differs between CPU
    and CUDA, so y is clamped first (equivalent: rounding is monotonic and ±448 is the grid's end). The sign bit is
    x's: for a number it is the cast's already (r > 0 keeps the sign, zero included); for NaN it is the one SPEC §2
    asks for (CUDA's multiply and cast drop it; the cast's NaN code is 0x7F or 0xFF, 0x7F once the sign is cleared).
    A few passes on bytes instead of round_to_e4m3_grid's dozen on fp32, with no branch on whether a NaN is present:
    what makes the CPU reference fast enough at the DeepSeek-V3 weight size."""
    code = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8).bitwise_left_shift_(7)  # 0x00 or 0x80 (a cast: Inductor cannot lower a
    # bool tensor viewed as uint8 on torch 2.11)
    return code.bitwise_and_(0x7F).bitwise_or_(sign).view(torch.float8_e4m3fn)  # in place on fresh bytes


def quantize_rowwise(x: torch.Tensor, scale_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise MXFP8: 32-blocks along the last dim (a multiple of 32). Returns (fp8 data, uint8 scale)."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"last dimension must be a multiple of {MX_BLOCK}, got {x.shape[-1]}")
    xb = widen(x).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    byte = e8m0_from_amax(nan_ignoring_amax(xb, -1), scale_mode)
    q = encode_e4m3(xb * quant_multiplier(byte, scale_mode).unsqueeze(-1), xb)
    return q.reshape(x.shape), byte


def quantize_columnwise(x2d: torch.Tensor, scale_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise MXFP8 of a 2-D [T, N] view: 32-blocks along T, the last block partial (amax over rows that
    exist). Returns (fp8 data [T, N], uint8 scale [ceil(T/32), N])."""
    T, N = x2d.shape
    nb = -(-T // MX_BLOCK)
    pad = nb * MX_BLOCK - T
    xf = widen(x2d)
    # pad with NaN: ignored by the amax, so a partial block's amax is over the rows that exist
    xp = torch.cat([xf, xf.new_full((pad, N), float("nan"))]) if pad else xf
    xb = xp.reshape(nb, MX_BLOCK, N)
    byte = e8m0_from_amax(nan_ignoring_amax(xb, 1), scale_mode)  # [nb, N]
    q = encode_e4m3(xb * quant_multiplier(byte, scale_mode).unsqueeze(1), xb)
    return q.reshape(nb * MX_BLOCK, N)[:T], byte


def dequantize_rowwise(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * 2^(byte - 127), each scale applying to its 32-block along the last dim."""
    work = _dequant_dtype(dtype)
    s = e8m0_to_fp32(scale).unsqueeze(-1).to(work)
    blocks = data.to(work).reshape(*data.shape[:-1], data.shape[-1] // MX_BLOCK, MX_BLOCK)
    return (blocks * s).reshape(data.shape).to(dtype)


def dequantize_columnwise(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_columnwise`: data viewed [T, N] (any shape whose trailing dims match scale's)."""
    n = math.prod(scale.shape[1:])
    T = data.numel() // n if n else 0
    work = _dequant_dtype(dtype)
    d2 = data.reshape(T, n).to(work)
    s = e8m0_to_fp32(scale.reshape(scale.shape[0], n)).to(work)
    nb = s.shape[0]
    if T == nb * MX_BLOCK:  # whole blocks: broadcast the scales instead of repeating them
        return (d2.reshape(nb, MX_BLOCK, n) * s.unsqueeze(1)).reshape(data.shape).to(dtype)
    return (d2 * s.repeat_interleave(MX_BLOCK, dim=0)[:T]).reshape(data.shape).to(dtype)


def _dequant_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the decode multiplies in: bf16 directly for a bf16 result (code and 2^k are exact in bf16 and the
    product is rounded once, as the fp32 product cast to bf16 would be: half the bytes on the CPU path), else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
