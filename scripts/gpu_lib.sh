# Sourced by scripts/gpu_block*.sh on the device machine (after `set -uo pipefail`): the device README's wheel
# install (the machine has no package index; .whl travels in `carry`), unbuffered Python output, and nvidia-smi
# sampling around a call's training (busy share and memory every 2 s).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
smi_start() { nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 >/tmp/smi.log 2>&1 & SMI=$!; }
smi_stop() {
  kill "$SMI" 2>/dev/null
  awk -F', ' '{u+=$1; n++; if ($2>m) m=$2} END {if (n) printf "nvidia-smi: GPU busy mean %.0f %% over %d samples (2 s), memory used max %d MiB\n", u/n, n, m}' /tmp/smi.log
}
# Calls 1-3 of blocks 3 and later: one GGUF part each; call 1 also records the GPU and runs the CUDA tests.
parts_call() {
  if [ "$1" = 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv >"$out/nvidia_smi.csv" 2>&1
    cat "$out/nvidia_smi.csv"; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  fi
  python3 -m training gpu weights --out "$out"
  if [ "$1" = 1 ]; then
    timeout 120 python3 -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider >"$out/cuda_tests.log" 2>&1
    echo "cuda tests: exit $?"; tail -25 "$out/cuda_tests.log"
  fi
}
