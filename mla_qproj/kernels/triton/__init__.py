"""The Triton kernels: one file per op (kernel(s), launcher, launch config, custom op); `_common.py` and
`_fp8_block.py` hold the tile helpers they share. On a CPU they run under Triton's interpreter."""
