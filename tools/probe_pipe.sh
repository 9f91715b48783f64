#!/usr/bin/env bash
# Probe (GPU): the pipelined fp8 K loop (.cute/pipe) against the loop form (.cute/kernels): bit-identity and timing in
# one process, then the engine's GPU tests on the pipelined kernels.
cp -n .cute/kernels/libcute_dsl_runtime.so .cute/pipe/
python3 tools/probe_pipe.py .cute/kernels .cute/pipe --rounds ${ROUNDS:-5}
MLA_QPROJ_CUTE_KERNELS=$PWD/.cute/pipe python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_cute_rope_gemm.py 2>&1 | tail -15
python3 tools/probe_pipe.py .cute/kernels .cute/pipe --rounds ${ROUNDS:-5} --tokens 16384,65536
