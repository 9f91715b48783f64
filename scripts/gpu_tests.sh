#!/usr/bin/env bash
# On the H200 (device tool): the whole test suite compiled on the GPU (gpu-marked full-size tests included),
# then the profile of the layer. Logs go to $OUT when set.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${PROFILE_TIMEOUT:-120} python3 scripts/profile_layer.py 2>&1 | tee "$OUT/profile.txt" | grep -v "^-" | head -70
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rfE tests/ 2>&1 | tee "$OUT/pytest.log" | tail -25
