"""The CuTe DSL engine: sm_90a kernels written in NVIDIA's CuTe DSL (`cutlass.cute`, PyPI `nvidia-cutlass-dsl`), beside
the Triton kernels of `mla_qproj/kernels/triton/`. Triton cannot warp-specialize on sm_90 (no producer warp, no register
reallocation), and the block-scaled FP8 GEMM needs both to run at the FP8 rate; CuTe DSL writes them directly.

- `rope_gemm_sm90.py`: the forward GEMM with the RoPE epilogue (fp8_block codes or bf16 images; bf16 or MXFP8 query;
  imports `cutlass`, loaded only when a kernel is compiled).
- `rope_gemm.py`: what the recipes call: which configs the engine serves, the kernel cache, the launcher and its
  custom op. It imports nothing of the DSL until a kernel is needed.

Kernels come from one of two places, looked up in this order:
1. a directory of prebuilt kernels (`MLA_QPROJ_CUTE_KERNELS`): shared objects exported ahead of time by
   `tools/build_cute_kernels.py` (no compiler needed where they run: the CuTe DSL runtime library and
   `apache-tvm-ffi` suffice);
2. the CuTe DSL compiler (`pip install "mla_qproj[cute]"`): compiled on first use per geometry (about a second),
   then kept for the process.
Without either, or off sm_90, the forward runs the Triton kernels, and says so once in the log.
"""
