#!/usr/bin/env bash
# Issue 11's GPU measurements in one device command (README "GPU"): the CUDA tests, then `python -m bench gpu`.
# On the device machine, from the repository root, with '.gpu' carried (python -m bench gpu --prepare, here):
#   bash scripts/gpu_bench.sh "$OUT" [bench gpu options]   # ~6-8 min on an H100 (estimate), 4 files back
# The bundled-model parts skip (with the reason) unless the bundled base was converted on the machine first.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_bench.sh OUT_DIR}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv >"$out/nvidia_smi.csv" 2>&1
timeout 240 python3 -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider >"$out/cuda_tests.log" 2>&1
echo "cuda tests: exit $? (log: cuda_tests.log)"
tail -3 "$out/cuda_tests.log"
timeout 330 python3 -m bench gpu --out "$out/gpu" "${@:2}"   # extra arguments go to bench gpu (e.g. --smoke)
