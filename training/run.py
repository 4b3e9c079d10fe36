"""`train(cfg)`: the one entry point of a training run, which picks the trainer.

One process (training/train.py) unless the run asks for accelerate (`--accelerate`, `--stream`), was started by a
launcher with several processes, or already holds an accelerate state (a run keeps its mode when it resumes).
"""
from __future__ import annotations

import os

from .train import Trainer, TrainConfig, train_single


def launched() -> bool:
    """Started by accelerate launch / torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def train(cfg: TrainConfig) -> Trainer:
    """Train `cfg` to its end (or its time limit), resuming from cfg.run."""
    if cfg.accelerate or cfg.stream or launched() or (cfg.run / "latest_state").exists():
        from .distributed import train_distributed

        return train_distributed(cfg)
    return train_single(cfg)
