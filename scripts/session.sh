#!/usr/bin/env bash
# One device call per session (device tool, H200): memory-bound kernels vs copy, the layer profile, the benchmark,
# then the whole test suite compiled on the GPU. Logs and bench.json/png go to $OUT; short tables print last.
#   STEPS="kernels profile bench tests" TOKENS=1024,4096,16384,65536 bash scripts/session.sh
# Timings seen on the H200 (2026-11-30): bench at 4 sizes ~60-85 s, sweep ~20-30 s, kernels ~8 s, profile ~20 s, host
# ~10 s, `-m gpu` tests ~30-45 s; compiled test files: test_layer + test_kernels ~230 s, test_qproj_gemm +
# test_mxfp8_quant + test_tensor + test_compile + test_module ~180 s — the whole suite takes two calls.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/session_out}; mkdir -p "$OUT"
STEPS=${STEPS:-"kernels profile bench tests"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for s in $STEPS; do
  t0=$(date +%s)
  case $s in
    kernels) timeout ${KERNELS_TIMEOUT:-90} python3 -m mla_qproj.bench_kernels --tokens 4096,16384 > "$OUT/kernels.txt" 2>&1 ;;
    sweep) timeout ${SWEEP_TIMEOUT:-200} python3 scripts/kernel_sweep.py > "$OUT/sweep.txt" 2>&1 ;;
    gemm) timeout ${GEMM_TIMEOUT:-150} python3 scripts/gemm_probe.py --variants ${GEMM_VARIANTS:-tma} ${GEMM_ARGS:-} > "$OUT/gemm.txt" 2>&1 ;;
    profile) timeout ${PROFILE_TIMEOUT:-120} python3 scripts/profile_layer.py > "$OUT/profile.txt" 2>&1 ;;
    host) timeout ${HOST_TIMEOUT:-120} python3 scripts/host_profile.py > "$OUT/host.txt" 2>&1 ;;
    bench) timeout ${BENCH_TIMEOUT:-240} python3 -m mla_qproj.bench --tokens ${TOKENS:-1024,4096,16384,65536} \
             --rep ${REP:-50} --out "$OUT" > "$OUT/bench.log" 2>&1 ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfE -x --durations=8 ${TESTS:-tests/} \
             > "$OUT/pytest.log" 2>&1 ;;
  esac
  echo "step $s: rc $? in $(( $(date +%s) - t0 )) s"
done
for s in $STEPS; do
  case $s in
    kernels) echo "=== kernels"; cat "$OUT/kernels.txt" | tail -12 ;;
    sweep) echo "=== sweep"; grep -E "^ +[0-9]+  |^NVIDIA|Error|error" "$OUT/sweep.txt" | tail -70 ;;
    gemm) echo "=== gemm"; grep -E "^ +[0-9]+ \||variant|correctness|Error" "$OUT/gemm.txt" | tail -30 ;;
    host) echo "=== host"; grep -E "ms/step|function calls|^ +[0-9]" "$OUT/host.txt" | cut -c1-150 | head -80 ;;
    profile) echo "=== profile"; grep -v "^-" "$OUT/profile.txt" | grep -v "^ *$" | head -70 ;;
    bench) echo "=== bench"; tail -45 "$OUT/bench.log" ;;
    tests) echo "=== tests"; tail -22 "$OUT/pytest.log" ;;
  esac
done
