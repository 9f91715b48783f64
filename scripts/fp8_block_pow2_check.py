"""Exhaustive check of the kernels' pow2 scale rule (kernels/_fp8_block.py `fp8_block_scale`, POW2=True: from the
exponent, no division) against SPEC §5's form (fp32(448 / amax), FLT_MAX on overflow, mantissa bits cleared; scale_inv
= fp32(1 / scale)) on every non-negative fp32 amax bit pattern (2^31 values, numpy; ~10 CPU-minutes).

    python scripts/fp8_block_pow2_check.py          # prints "mismatches 0"
"""
from __future__ import annotations

import numpy as np

FLT_MAX = np.float32(3.4028234663852886e38)
CHUNK = 1 << 25


def main() -> int:
    bad = 0
    for start in range(0, 1 << 31, CHUNK):
        bits = np.arange(start, start + CHUNK, dtype=np.int64).astype(np.uint32)
        a = bits.view(np.float32)
        e = (bits >> 23) & 0xFF
        special = (a == 0) | (e == 255)
        with np.errstate(all="ignore"):  # 448 / subnormal overflows: that is the point
            q = np.float32(448) / np.where(special, np.float32(1), a)
        q = np.where(np.isinf(q), FLT_MAX, q)
        ref = np.where(special, np.uint32(0x3F800000), q.view(np.uint32) & np.uint32(0x7F800000))
        ref_inv = (np.float32(1) / ref.view(np.float32)).view(np.uint32)
        # the kernel's rule: k = 135 - biased exponent - (mantissa > 0x600000), capped at 127 (the overflow)
        k = np.minimum(135 - e.astype(np.int64) - ((bits & 0x7FFFFF) > 0x600000), 127)
        ours = np.where(special, 0x3F800000, (k + 127) << 23).astype(np.uint32)
        ours_inv = np.where(special, 0x3F800000, np.where(k == 127, 0x400000, (127 - k) << 23)).astype(np.uint32)
        bad += int((ours != ref).sum()) + int((ours_inv != ref_inv).sum())
    print("mismatches", bad)
    return int(bad != 0)


if __name__ == "__main__":
    raise SystemExit(main())
