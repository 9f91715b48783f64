#!/usr/bin/env bash
# One device call: what the H200 must check for a change, in one go. Writes logs under $OUT (or ./gpu_out) and
# prints a short summary last. STEPS selects parts (default: tests bench kernels):
#   tests   the whole test suite compiled (pytest-xdist -n 8), the gpu-marked tests included
#   bench   python -m mla_qproj.bench (BENCH_ARGS), appending to bench_results.jsonl (copied to $OUT)
#   kernels python -m mla_qproj.bench_kernels
#   probe   any extra command in PROBE (e.g. a tools/ script)
# The CuTe DSL engine on a GPU machine without the DSL's compiler: put the apache-tvm-ffi wheel for its Python in
# $CUTE_DIR (default .cute) and the kernels in $CUTE_DIR/kernels (`python tools/build_cute_kernels.py --preset tests
# --out .cute/kernels`: every kernel the GPU tests and the bench ask for, on any machine, ~2.5 min on 2 cores, 45 MB
# with the runtime library; carry .cute); they are installed / used from there.
set -uo pipefail
cd "$(dirname "$0")/.."
CUTE_DIR=${CUTE_DIR:-.cute}
if compgen -G "$CUTE_DIR/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cute_site "$CUTE_DIR"/*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/cute_site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d "$CUTE_DIR/kernels" ] && export MLA_QPROJ_CUTE_KERNELS=${MLA_QPROJ_CUTE_KERNELS:-$PWD/$CUTE_DIR/kernels}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
STEPS=${STEPS:-"tests bench kernels"}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # a probe script under tools/ imports mla_qproj from this tree
export MLA_QPROJ_TESTS=${MLA_QPROJ_TESTS:-full}  # the slow tier too
summary=()
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests)
      python3 -m pytest -q -p no:cacheprovider -n 8 ${TEST_ARGS:-tests/} > "$OUT/pytest.log" 2>&1 || status=1
      summary+=("tests: $(tail -1 "$OUT/pytest.log")");;
    bench)
      python3 -m mla_qproj.bench ${BENCH_ARGS:-} --out "$OUT" > "$OUT/bench.log" 2>&1
      cp bench_results.jsonl "$OUT/" 2>/dev/null
      summary+=("bench: rc=$? (table at the end of bench.log)");;
    kernels)
      python3 -m mla_qproj.bench_kernels > "$OUT/kernels.txt" 2>&1
      summary+=("kernels: see kernels.txt");;
    probe)
      bash -c "${PROBE:-true}" > "$OUT/probe.txt" 2>&1
      summary+=("probe: rc=$?");;
  esac
done
grep -E "FAILED|ERROR" "$OUT/pytest.log" 2>/dev/null | head -30
[ -f "$OUT/probe.txt" ] && tail -40 "$OUT/probe.txt"
[ -f "$OUT/bench.log" ] && sed -n '/^     T  impl/,$p' "$OUT/bench.log"
[ -f "$OUT/kernels.txt" ] && tail -12 "$OUT/kernels.txt"
printf '%s\n' "${summary[@]}"
exit $status  # 1 when the tests failed
