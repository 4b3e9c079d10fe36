"""One training process for tests/test_distributed_training.py (run alone, or by torchrun as one of N ranks).

Trains test_training's tiny random model through training.distributed.AcceleratedTrainer, resuming from --run's
accelerate state when there is one, and writes this rank's losses and trainable tensors to --out/rank<r>.pt.
--die-after K ends the process right after the checkpoint of step K, with no clean shutdown (a kill).
--stream reads the same examples through training.stream (a token-id file, a shuffle buffer) instead of a list.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from test_training import BS, MASK, PAD, examples, tiny_model
from training.distributed import AcceleratedTrainer, make_accelerator
from training.examples import PAIR_READERS
from training.stream import ExampleStream
from training.train import TrainConfig


def read_pairs(path: Path):
    for line in path.open():
        yield json.loads(line)


def pairs_file(path: Path, exs) -> Path:
    """The examples as a token-id file (one [prompt, answer] per line), read through PAIR_READERS."""
    PAIR_READERS[".pairs"] = read_pairs
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():  # every rank writes the same bytes; write-then-rename keeps a reader from a torn file
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text("".join(json.dumps([ex.ids[:ex.prompt_len], ex.ids[ex.prompt_len:]]) + "\n" for ex in exs))
        os.replace(tmp, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--save-every-steps", type=int, default=0)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = TrainConfig(run=a.run_dir, recipe="full", block_size=BS, max_len=16, rank=4, alpha=8.0, lr=3e-2, warmup_steps=2,
                      epochs=100.0, batch_size=a.batch_size, micro_batch=a.micro_batch, bf16=a.bf16, seed=0,
                      save_every_s=1e9, save_every_steps=a.save_every_steps, progress=False, train_norms=True,
                      max_steps=a.steps, full=a.full, accelerate=True)
    acc = make_accelerator(cfg)
    data = examples(24)
    if a.stream:
        data = ExampleStream(pairs_file(a.run_dir.parent / f"{a.run_dir.name}.pairs", data), None, stop_id=0,
                             max_len=16, answers="keep", seed=0, buffer=5)
    tr = AcceleratedTrainer(cfg, tiny_model(), data, MASK, PAD, acc)
    tr.resume(a.run_dir)
    resumed_at = tr.step
    if a.die_after is not None:
        save = tr.save

        def save_then_die(run: Path, keep: int = 2) -> Path:
            path = save(run, keep)
            if tr.step == a.die_after:
                os._exit(9)  # like a kill: no final checkpoint, no process-group teardown
            return path

        tr.save = save_then_die
    tr.run(a.run_dir)
    a.out.mkdir(parents=True, exist_ok=True)
    params = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    torch.save({"losses": [h["loss"] for h in tr.history], "grad_norms": [h["grad_norm"] for h in tr.history],
                "params": params, "launch": tr.launch,
                "resumed_at": resumed_at},
               a.out / f"rank{tr.rank}.pt")
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
