"""Numeric constants of the formats (SPEC §2: OCP Microscaling v1.0, E4M3 elements, block 32; SPEC §5: block-scaled
FP8, blocks of 128) and the shapes and dtypes the package names in more than one place."""

from __future__ import annotations

import torch

MX_BLOCK = 32  # elements per scale block
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_MIN_NORMAL_EXP = -6  # exponent of the smallest normal E4M3 value (2^-6)
E4M3_MANTISSA_BITS = 3
E8M0_BIAS = 127  # scale byte b encodes 2^(b - 127)
E8M0_NAN = 0xFF  # scale of a block whose amax is NaN
E8M0_MAX = 0xFE  # largest finite scale byte (rceil: amax == inf)
INV_E4M3_MAX = 1.0 / 448.0  # rounded to fp32 where used: SPEC §2 `v = amax * fp32(1/448)`

FP8_BLOCK = 128  # SPEC §5: elements per block along a blocked dimension (1x128 activations, 128x128 weights)
BLOCK_SHAPES = ((1, FP8_BLOCK), (FP8_BLOCK, 1), (FP8_BLOCK, FP8_BLOCK))  # what `quantize_blocks` accepts
FLT_MAX = 3.4028234663852886e38  # largest finite fp32 (SPEC §5: the scale where 448 / amax overflows)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations, parameters, RoPE tables

DEEPSEEK_V3 = (1536, 128, 128, 64)  # the query of DeepSeek-V3: q_lora_rank, heads, qk_head_dim, rope dim
