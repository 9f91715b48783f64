"""The kernels and their launchers (no autograd, no nn), one subpackage per technology: `triton/` (every op),
`cute/` (the CuTe DSL engine: the fp8_block forward GEMM on sm_90). `_op.py`: the custom-op registration both use."""
