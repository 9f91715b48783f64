#!/usr/bin/env bash
# Probe (GPU): the fp8 engine's 256-column tiles (.cute/kernels, this tree) against the head tiles (.cute/old: the
# kernels of 2e20317): the engine's GPU tests, then the two V3 kernels timed with cuBLAS blockwise in one process.
MLA_QPROJ_CUTE_KERNELS=$PWD/.cute/kernels python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_cute_rope_gemm.py 2>&1 | tail -6
V3=rope_fp8_block_bf16_k1536_h128_d192_p128_r64_deepseek_sm132.so
python3 tools/probe_tile.py .cute/kernels heads=.cute/old/v3_bf16.so wide=.cute/kernels/$V3 --tokens 16384,65536,4096 --rounds 5
