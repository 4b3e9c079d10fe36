#!/usr/bin/env bash
# Issue 21's CPU repair run: continue the shipped adapter on the self-instruct data under the `finish` answers
# policy (every answer ends with its stop token, loops dropped; training/finish.py), in segments of SEG steps.
# After each segment the adapter is exported to $RUN/curve/step-NNNNNN.safetensors, to be scored with
#   python -m bench quality --long-only ... (see assets/MODEL_CARD.md, "Long answers").
# Resumable: run it again and it continues from the run's latest checkpoint (exact resume, training/README.md).
# On a fresh machine (no runs/), INIT=<a slim checkpoint or adapter file> starts a new phase from where an earlier
# period stopped; optimiser momentum and the schedule start again, and the phases are recorded in the adapter's
# metadata. Default: the shipped adapter.
# Env: RUN (runs/repair), STEPS (total steps of this phase's schedule), SEG (steps per segment), THREADS (1), LR (1e-4),
# KL (the --distill-kl weight: 0, off).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/repair} STEPS=${STEPS:-240} SEG=${SEG:-20} THREADS=${THREADS:-1} LR=${LR:-1e-4} KL=${KL:-0}
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FASTDLLM_THREADS=$THREADS
mkdir -p "$RUN/curve"
INIT=${INIT:-assets/fastdllm_adapter.safetensors}
# the examples the `finish` policy keeps at max-len 256 (the data's manifest; 20,460 since block 3), at batch 8:
# the cosine schedule spans STEPS steps
KEPT=$($PY -c "import json; print(json.load(open('training/data/selfinstruct/manifest.json'))['answers_policy']['by_max_len']['256']['finish']['kept'])")
EPOCHS=$($PY -c "print(round($STEPS * 8 / $KEPT, 6))")
while :; do
  done_steps=$($PY - "$RUN" <<'EOF'
import sys
from pathlib import Path
from training.train import latest_checkpoint
import torch
c = latest_checkpoint(Path(sys.argv[1]))
print(torch.load(c, map_location="cpu", weights_only=False)["step"] if c else 0)
EOF
)
  [ "$done_steps" -ge "$STEPS" ] && break
  next=$(( (done_steps / SEG + 1) * SEG )); [ "$next" -gt "$STEPS" ] && next=$STEPS
  $PY -m training train --data training/data/selfinstruct --answers finish --max-len 256 \
      --init-from "$INIT" --run "$RUN" --batch-size 8 --micro-batch 4 \
      --lr "$LR" --warmup-steps 5 --min-lr-ratio 0.3 --epochs "$EPOCHS" --threads "$THREADS" \
      --save-every-s 600 --max-steps "$next" --seed 21 --distill-kl "$KL"
  $PY -m training export --run "$RUN" --out "$RUN/curve/step-$(printf %06d "$next").safetensors"
done
echo "repair run: $STEPS steps done in $RUN"
