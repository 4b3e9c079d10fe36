#!/usr/bin/env bash
# GPU block 4 (issue 22), 15 minutes of device time (2026-11-28, an H200): one device command per call,
# `bash scripts/gpu_block4.sh N`. Same shape as block 3 (scripts/gpu_block3.sh): calls 1-3 carry one GGUF part each
# (call 1 also re-runs the CUDA tests), call 4 converts the base and trains. What differs: call 4 trains TWO
# candidates side by side on the committed `finish` data (20,460 kept at max-len 512), both from the shipped adapter
# at peak lr 5e-5 (block 3's log: 2e-4 knocked the adapter out of its minimum), instead of one trainer beside the
# data generator:
#   a: the recipe alone;
#   b: + --distill-kl 0.3 (the CPU run at 1.0 cut loops but lowered tokens per forward 1.18 -> 1.05) and
#      + --certainty-weight 1.0 (dParallel's weight: entropy of the right predictions, i.e. confidence).
# The data set grows no further this block: 20k answers are not what held p5 back (training/README.md), two scored
# candidates are worth more than 7.7k more answers. $OUT: a/ and b/ hold each slim checkpoint (3 files each), the
# two logs + train.json go in one tarball (7 files), the bundled model's gpu.json is the 8th.
# carry: 1: .whl .gpu .gl/gguf/parts.json .gl/gguf/<part 1>; 2, 3: .whl parts.json <part N>; 4: .whl parts.json <part 4>.
# Env for call 4: MINUTES (trainer minutes, 7), EPOCHS_A (1.25: 400 steps of 64), EPOCHS_B (1.0: 320 steps, it runs
# a teacher forward too), BENCH_S (bundled-model bench timeout, 60; 0 skips it).
set -uo pipefail
call=${1:?usage: bash scripts/gpu_block4.sh CALL}
out=${OUT:?OUT must be set (the device tool sets it)}
source "$(dirname "$0")/gpu_lib.sh"  # wheels, unbuffered output, smi_start / smi_stop
TRAIN="--answers finish --batch-size 64 --micro-batch 32 --max-len 512 --rank 32 --alpha 64 --lr 5e-5 --warmup-steps 20 --save-every-s 120 --threads 6 --init-from assets/fastdllm_adapter.safetensors"
case "$call" in
1|2|3) parts_call "$call" ;;  # scripts/gpu_lib.sh: a GGUF part; call 1 also nvidia-smi and the CUDA tests
4)  python3 -m training gpu weights --out /tmp/w && cat /tmp/w/weights.json || exit 1
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    smi_start
    python3 -m training gpu train --out "$out/a" --data training/data/selfinstruct --run runs/gpu/p6a \
      --minutes "${MINUTES:-7}" -- $TRAIN --epochs "${EPOCHS_A:-1.25}" >/tmp/train_a.log 2>&1 &
    A=$!
    python3 -m training gpu train --out "$out/b" --data training/data/selfinstruct --run runs/gpu/p6b \
      --minutes "${MINUTES:-7}" -- $TRAIN --epochs "${EPOCHS_B:-1.0}" --distill-kl 0.3 --certainty-weight 1.0 \
      >/tmp/train_b.log 2>&1 &
    B=$!
    wait "$A"; echo "train a: exit $?"; wait "$B"; echo "train b: exit $?"; smi_stop
    for r in a b; do
      echo "== $r"; tail -c 600 /tmp/train_$r.log; echo
      # as it ran, `gpu train` returned train.json and log.jsonl; since then they travel as train-logs.tar
      mkdir -p /tmp/logs/$r && mv "$out/$r/train-logs.tar" /tmp/logs/$r/ 2>/dev/null
      mv "$out/$r/train.json" "$out/$r/log.jsonl" /tmp/logs/$r/ 2>/dev/null
      cp /tmp/train_$r.log /tmp/logs/train_$r.log
    done
    cp /tmp/smi.log /tmp/logs/ 2>/dev/null
    tar czf "$out/logs.tgz" -C /tmp/logs . && ls -la "$out" "$out"/*
    if [ "${BENCH_S:-60}" -gt 0 ]; then
      timeout "${BENCH_S:-60}" python3 -m bench gpu --sections bundled,clients --bundled-seconds 20 --out /tmp/gpu_bundled
      echo "bundled: exit $?"; cp /tmp/gpu_bundled/gpu.json "$out/gpu_bundled.json" 2>/dev/null
    fi ;;
*)  echo "unknown call $call"; exit 2 ;;
esac
