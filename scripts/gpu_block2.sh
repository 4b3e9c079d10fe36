#!/usr/bin/env bash
# GPU block 2 (issue 22), as it ran on 2026-11-25: one device command per call, `bash scripts/gpu_block2.sh N`.
# The tree measured 30.1 MiB, so the GGUF travels in 4 parts (python -m training gpu prepare --reserve-mib 4);
# calls 1-3 carry one part each and spend the rest of their time on the engine's GPU measurements, call 4
# converts the base and trains p3 while new data is generated, call 5 measures the bundled model and trains p4.
# carry: 1-3: .whl .gl/gguf/parts.json .gl/gguf/<part N>of4 (+ .gpu in call 2); 4: part 4; 5: .whl only.
set -uo pipefail
call=${1:?usage: bash scripts/gpu_block2.sh CALL}
out=${OUT:?OUT must be set (the device tool sets it)}
source "$(dirname "$0")/gpu_lib.sh"  # wheels, unbuffered output, smi_start / smi_stop
TRAIN="--answers finish --batch-size 64 --max-len 512 --rank 32 --alpha 64 --lr 2e-4 --warmup-steps 20 --save-every-s 120 --threads 6"
case "$call" in
1)  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv >"$out/nvidia_smi.csv" 2>&1
    cat "$out/nvidia_smi.csv"
    python3 -m training gpu weights --out "$out"
    timeout 240 python3 -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider >"$out/cuda_tests.log" 2>&1
    echo "cuda tests: exit $?"; tail -15 "$out/cuda_tests.log"
    timeout 150 python3 -m bench gpu --sections roofline --out "$out/gpu_roofline"; echo "roofline: exit $?" ;;
2)  python3 -m training gpu weights --out "$out"
    timeout 300 python3 -m bench gpu --sections engine --out "$out/gpu_engine"; echo "engine: exit $?" ;;
3)  python3 -m training gpu weights --out "$out" ;;
4)  python3 -m training gpu weights --out /tmp/w && cat /tmp/w/weights.json || exit 1
    # one profiled minute of the trainer alone (issue 22: measure before changing the trainer)
    timeout 120 python3 -m training throughput --data training/data/selfinstruct --variants after --batch-size 64 \
      --max-len 512 --rounds 3 --warmup 2 --profile --threads 6 --out /tmp/tp.json >/tmp/tp.log 2>&1
    echo "throughput: exit $?"
    python3 -c "import json; v=json.load(open('/tmp/tp.json'))['variants']['after']; print({k: v[k] for k in ('answer_tokens_per_s','model_tokens_per_s','seq_tokens_per_s','step_seconds')}); [print(r) for r in v.get('profile_top_ops', [])[:9]]" || tail -20 /tmp/tp.log
    smi_start
    python3 -m training gpu data --out "$out/data" --seed-from training/data/selfinstruct --seed 1 --magpie 30000 \
      --magpie-batch 1024 --batch-size 512 --max-new-tokens 256 --time-budget 300 --threads 6 >/tmp/data.log 2>&1 &
    DATA=$!
    python3 -m training gpu train --out "$out/train" --data training/data/selfinstruct --run runs/gpu/p3 --minutes 5.5 \
      -- $TRAIN --epochs 2 --init-from assets/fastdllm_adapter.safetensors
    wait "$DATA"; smi_stop; tail -c 1500 /tmp/data.log ;;
# The machine went back between calls 4 and 5 (idle > 30 s while this script was edited): calls 5-8 ran on a
# fresh one, with the GGUF in 3 parts (prepare --parts 3: 61.5 MiB per command) and p3's returned slim checkpoint
# carried as runs/gpu/p3/ckpt-slim.pt.
w)  python3 -m training gpu weights --out "$out" ;;
b)  python3 -m training gpu weights --out /tmp/w && cat /tmp/w/weights.json || exit 1
    timeout 150 python3 -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider >"$out/cuda_tests.log" 2>&1
    echo "cuda tests: exit $?"; tail -15 "$out/cuda_tests.log"
    timeout 110 python3 -m bench gpu --sections bundled --out "$out/gpu_bundled"; echo "bundled: exit $?" ;;
t)  # call 4's side generator ran out of GPU memory beside the trainer (56.5 GiB peak at micro-batch 64), so here
    # the trainer runs at --micro-batch 32 (same gradients) and the generator at batch 256, with expandable segments.
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    EPOCHS=${EPOCHS:?set EPOCHS}; MIN=${MINUTES:-5}
    smi_start
    python3 -m training gpu data --out "$out/data" --seed-from training/data/selfinstruct --seed 1 --magpie 30000 \
      --magpie-batch 1024 --batch-size 256 --max-new-tokens 256 --time-budget 250 --threads 6 >/tmp/data.log 2>&1 &
    DATA=$!
    python3 -m training gpu train --out "$out/train" --data training/data/selfinstruct --run runs/gpu/p4 --minutes "$MIN" \
      -- $TRAIN --micro-batch 32 --epochs "$EPOCHS" --init-from runs/gpu/p3/ckpt-slim.pt
    wait "$DATA"; smi_stop; tail -c 1500 /tmp/data.log ;;
*)  echo "unknown call $call"; exit 2 ;;
esac
