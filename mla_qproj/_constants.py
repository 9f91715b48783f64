"""Numeric constants of the MXFP8 format (SPEC §2: OCP Microscaling v1.0, E4M3 elements, block 32)."""

from __future__ import annotations

MX_BLOCK = 32  # elements per scale block
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_MIN_NORMAL_EXP = -6  # exponent of the smallest normal E4M3 value (2^-6)
E4M3_MANTISSA_BITS = 3
E8M0_BIAS = 127  # scale byte b encodes 2^(b - 127)
E8M0_NAN = 0xFF  # scale of a block whose amax is NaN
E8M0_MAX = 0xFE  # largest finite scale byte (rceil: amax == inf)
INV_E4M3_MAX = 1.0 / 448.0  # rounded to fp32 where used: SPEC §2 `v = amax * fp32(1/448)`
