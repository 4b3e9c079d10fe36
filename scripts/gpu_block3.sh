#!/usr/bin/env bash
# GPU block 3 (issue 22), planned for a 15-minute device budget (2026-11-27): one device command per call,
# `bash scripts/gpu_block3.sh N`. The tree measures 34 MiB, so the GGUF travels in 4 parts of 23.5 MiB
# (python -m training gpu prepare); calls 1-3 carry one part each (call 1 also re-runs the CUDA tests on the
# refactored engine, with .gpu's tokenizer), call 4 converts the base, trains p5 from the shipped adapter (p4)
# on the committed `finish` data while `gpu data --seed 2` generates new answers beside it, then measures the
# bundled model on the GPU for what time is left (stdout only: $OUT holds 5 train + 3 data files, the limit).
# carry: 1: .whl .gpu .gl/gguf/parts.json .gl/gguf/<part 1>; 2, 3: .whl parts.json <part N>; 4: .whl parts.json <part 4>.
# Env for call 4: MINUTES (trainer minutes, 6.5), EPOCHS (2: 16,309 kept at max-len 512 -> 510 steps of 64),
# DATA_S (generator time budget, 270), BENCH_S (bundled-model bench timeout, 75; 0 skips it).
set -uo pipefail
call=${1:?usage: bash scripts/gpu_block3.sh CALL}
out=${OUT:?OUT must be set (the device tool sets it)}
source "$(dirname "$0")/gpu_lib.sh"  # wheels, unbuffered output, smi_start / smi_stop
TRAIN="--answers finish --batch-size 64 --micro-batch 32 --max-len 512 --rank 32 --alpha 64 --lr 2e-4 --warmup-steps 20 --save-every-s 120 --threads 6"
case "$call" in
1|2|3) parts_call "$call" ;;  # scripts/gpu_lib.sh: a GGUF part; call 1 also nvidia-smi and the CUDA tests
4)  python3 -m training gpu weights --out /tmp/w && cat /tmp/w/weights.json || exit 1
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    smi_start
    python3 -m training gpu data --out "$out/data" --seed-from training/data/selfinstruct --seed 2 --magpie 30000 \
      --magpie-batch 1024 --batch-size 256 --max-new-tokens 256 --time-budget "${DATA_S:-270}" --threads 6 >/tmp/data.log 2>&1 &
    DATA=$!
    python3 -m training gpu train --out "$out/train" --data training/data/selfinstruct --run runs/gpu/p5 \
      --minutes "${MINUTES:-6.5}" -- $TRAIN --epochs "${EPOCHS:-2}" --init-from assets/fastdllm_adapter.safetensors
    echo "train: exit $?"
    wait "$DATA"; echo "data: exit $?"; smi_stop; tail -c 1500 /tmp/data.log
    if [ "${BENCH_S:-75}" -gt 0 ]; then
      timeout "${BENCH_S:-75}" python3 -m bench gpu --sections bundled --bundled-seconds 30 --out /tmp/gpu_bundled
      echo "bundled: exit $?"
      python3 -c "
import json; r = json.load(open('/tmp/gpu_bundled/gpu.json')); b = r.get('bundled') or {}
print(json.dumps({'device': r['device'], 'errors': r['errors'], 'section_seconds': r.get('section_seconds'),
                  'bundled': {k: ({kk: vv for kk, vv in v.items() if kk != 'token_ids'} if isinstance(v, dict) else v)
                              for k, v in b.items()}}, separators=(',', ':')))"
    fi ;;
*)  echo "unknown call $call"; exit 2 ;;
esac
