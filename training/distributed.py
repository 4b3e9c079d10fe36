"""The recipe's trainer under `accelerate launch`: DDP or FSDP over many processes, bf16, exact resume.

The step is the single-process step, split: every process reads the same global batch (same data order,
same noise, drawn in data order from the same generator), trains its contiguous slice of it, and the
gradient all-reduce sums the slices. So N processes with a global batch B compute the update one process
computes with batch B (up to float summation order), which tests/test_distributed_training.py checks.

Loss scaling: a process weights each micro-batch's mean by its share of the *global* step's loss tokens, so
the sum over processes is the single-process loss; DDP and FSDP average gradients over processes, hence the
factor `num_processes`. Micro-batches (gradient accumulation) skip the all-reduce until the step's last one.

Checkpoints: `accelerate.save_state` (model, optimizer, every process's RNG, the scheduler and the
trainer's progress) in `state-<step>/`, `latest_state` naming the newest; plus the slim `ckpt-<step>.pt`
that `python -m training export` reads (trainable tensors, config, history), `latest` naming it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import adapter_io
from .examples import Example
from .recipe import Batch, loss_parts
from .stream import ExampleStream
from .train import Trainer, TrainConfig, init_state, load_base, load_examples_for


@dataclass(frozen=True)
class Launch:
    """What the launcher gave this process."""

    processes: int
    rank: int
    kind: str  # accelerate's DistributedType: NO, MULTI_CPU, MULTI_GPU, FSDP
    mixed_precision: str
    device: str


def fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def make_accelerator(cfg: TrainConfig):
    """An Accelerator for this run: the launch config decides DDP vs FSDP, `cfg.bf16` the precision."""
    from accelerate import Accelerator

    kwargs = {}
    if fsdp_requested() and cfg.bf16:
        kwargs["fsdp_plugin"] = _fsdp_plugin()
    # cpu=True when there is no GPU: accelerate otherwise ignores torchrun's ranks on a CPU-only machine
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16" if cfg.bf16 else "no", **kwargs)


def _fsdp_plugin():
    """FSDP from the launch config, with bf16 compute but fp32 gradient reduction (accelerate's default
    reduces in bf16, which loses the small LoRA/late-training gradients)."""
    from accelerate import FullyShardedDataParallelPlugin

    if int(os.environ.get("FSDP_VERSION", "1")) == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        from torch.distributed.fsdp import MixedPrecision

        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FullyShardedDataParallelPlugin(mixed_precision_policy=policy)


class Progress:
    """The trainer's own state for `accelerate.save_state` (register_for_checkpointing wants this shape)."""

    def __init__(self, trainer: "AcceleratedTrainer"):
        self.t = trainer

    def state_dict(self) -> dict:
        t = self.t
        return {"step": t.step, "tokens_seen": t.tokens_seen, "loss_tokens": t.loss_tokens, "elapsed": t.elapsed,
                "history": t.history, "prior_phases": t.prior_phases, "noise": t.noise_gen.get_state(),
                "num_examples": len(t.examples), "processes": t.world}

    def load_state_dict(self, sd: dict) -> None:
        t = self.t
        if sd["num_examples"] != len(t.examples):
            raise ValueError(f"checkpoint was trained on {sd['num_examples']} examples, the data now has "
                             f"{len(t.examples)}: an exact resume needs the same data")
        t.step, t.tokens_seen, t.loss_tokens, t.elapsed = sd["step"], sd["tokens_seen"], sd["loss_tokens"], sd["elapsed"]
        t.history, t.prior_phases = list(sd["history"]), list(sd["prior_phases"])
        t.noise_gen.set_state(sd["noise"])


class AcceleratedTrainer(Trainer):
    """Trainer whose step is shared by accelerate's processes (one process: the same run as Trainer's)."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, examples, mask_id: int, pad_id: int, acc,
                 val: list[Example] | None = None, init: dict | None = None):
        super().__init__(cfg, model, examples, mask_id, pad_id, val)
        self.acc, self.world, self.rank = acc, acc.num_processes, acc.process_index
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of the {self.world} processes")
        self.is_main = acc.is_main_process
        if init is not None:  # --init-from: before wrapping, while names are the plain model's
            self.load_weights(init)
        self.wrapped, self.opt = acc.prepare(model, self.opt)
        self.params = [p for p in self.wrapped.parameters() if p.requires_grad]  # FSDP: its sharded parameters
        # the scheduler is not prepare()d: accelerate would step it once per process per step
        acc.register_for_checkpointing(self.sched, Progress(self))
        self._batches, self._at = None, None  # streaming: the open epoch iterator and the step it serves next

    @property
    def launch(self) -> Launch:
        a = self.acc
        return Launch(a.num_processes, a.process_index, str(a.distributed_type).split(".")[-1], a.mixed_precision,
                      str(a.device))

    # ------------------------------------------------------------------ data
    def step_examples(self) -> list[Example]:
        if not isinstance(self.examples, ExampleStream):
            return super().step_examples()
        epoch, k = divmod(self.step, self.steps_per_epoch)
        if self._at != (epoch, k):  # first step, new epoch or after a resume: replay the stream to here
            self._batches = self.examples.batches(epoch, self.cfg.batch_size, skip=k)
        self._at = (epoch, k + 1)
        return next(self._batches)

    def shard(self, exs: list[Example], noise: list) -> tuple[list[Example], list]:
        n = len(exs) // self.world
        return exs[self.rank * n:(self.rank + 1) * n], noise[self.rank * n:(self.rank + 1) * n]

    # ------------------------------------------------------------------ one step
    def _sum(self, values: list[float]) -> list[float]:
        """Sum over processes (float64: token counts stay exact)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.acc.device)
        return self.acc.reduce(t, "sum").tolist()

    def train_step(self) -> dict:
        self.wrapped.train()
        batches: list[Batch] = self.next_batches()
        total = max(int(self._sum([sum(b.loss_tokens for b in batches)])[0]), 1)  # the global step's loss tokens
        self.opt.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.acc.no_sync(self.wrapped):
                with self.autocast():
                    out = loss_parts(self.wrapped, batch.to(self.device), self.cfg.attention, self.loss_cfg)
                weight = batch.loss_tokens / total
                self.acc.backward(out["loss"] * (weight * self.world))  # DDP/FSDP divide by the process count
            for k, v in out.items():
                parts[k] = parts.get(k, 0.0) + v.item() * weight
        gnorm = self.acc.clip_grad_norm_(self.wrapped.parameters(), self.cfg.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        keys = sorted(parts)
        counts = [sum(b.seq_tokens for b in batches), sum(b.answer_tokens for b in batches),
                  sum(int(b.ids.numel()) for b in batches)]
        summed = self._sum([parts[k] for k in keys] + counts)
        parts = dict(zip(keys, summed))
        seq, answers, forward = (int(x) for x in summed[len(keys):])
        self.tokens_seen += seq
        self.loss_tokens += total
        rec = {"step": self.step, "loss": round(parts.pop("loss"), 5), "lr": lr, "grad_norm": round(float(gnorm), 4),
               "seq_tokens": seq, "answer_tokens": answers, "forward_tokens": forward, "loss_tokens": total,
               "tokens_seen": self.tokens_seen}
        if self.loss_cfg.certainty_weight:
            rec.update({k: round(v, 5) for k, v in parts.items()})
        self.history.append(rec)
        return rec

    def agree(self, flag: bool) -> bool:
        """Every process stops and saves at the same step (wall clocks differ; collectives must not)."""
        return bool(self._sum([float(flag)])[0]) if self.world > 1 else flag

    # ------------------------------------------------------------------ checkpoints
    def gathered_trainable(self) -> dict[str, torch.Tensor]:
        """The trainable tensors, whole, on the main process ({} elsewhere); every process must call it."""
        state = self.acc.get_state_dict(self.wrapped)  # FSDP: gathers the shards
        if not self.is_main:
            return {}
        # wrappers' prefixes (DDP's module., activation checkpointing's) are not part of the names we export
        state = {k.replace("module.", "").replace("_checkpoint_wrapped_", ""): v for k, v in state.items()}
        return {n: state[n].detach().float().cpu().clone() for n in self.names}

    def slim_state(self, trainable: dict[str, torch.Tensor], state_dir: str) -> dict:
        """What `python -m training export` reads (Trainer.state_dict without optimizer and RNG)."""
        from dataclasses import asdict

        return {"trainable": trainable, "scheduler": self.sched.state_dict(), "step": self.step,
                "tokens_seen": self.tokens_seen, "loss_tokens": self.loss_tokens, "elapsed": self.elapsed,
                "history": self.history,
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.cfg).items()},
                "total_steps": self.total_steps, "num_examples": len(self.examples), "mask_id": self.mask_id,
                "base_vocab": self.base_vocab, "prior_phases": self.prior_phases, "accelerate_state": state_dir,
                "processes": self.world}

    def save(self, run: Path, keep: int = 2) -> Path:
        state_dir = run / f"state-{self.step:06d}"
        # pickle, not safetensors: tied embeddings share one tensor, which safetensors refuses to store twice
        self.acc.save_state(str(state_dir), safe_serialization=False)
        trainable = self.gathered_trainable()
        if self.is_main:
            path = run / f"ckpt-{self.step:06d}.pt"
            torch.save(self.slim_state(trainable, state_dir.name), path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            for name, target in (("latest", path.name), ("latest_state", state_dir.name)):
                (run / f"{name}.tmp").write_text(target)
                os.replace(run / f"{name}.tmp", run / name)  # the pointers move only once both are whole
            for old in sorted(run.glob("ckpt-*.pt"))[:-keep]:
                old.unlink()
            for old in sorted(run.glob("state-*"))[:-keep]:
                shutil.rmtree(old)
            if self.cfg.export_to is not None:
                self._write_adapter(self.cfg.export_to, trainable)
        self.exported_step = self.step
        self.acc.wait_for_everyone()
        return state_dir

    def export(self, out: Path) -> list[Path]:
        trainable = self.gathered_trainable()
        self.exported_step = self.step
        return self._write_adapter(out, trainable) if self.is_main else []

    def _write_adapter(self, out: Path, trainable: dict[str, torch.Tensor]) -> list[Path]:
        cfg = self.cfg
        meta = {"base": str(cfg.model), "recipe": cfg.recipe, "block_size": str(cfg.block_size),
                "rank": str(cfg.rank), "alpha": str(cfg.alpha), "step": str(self.step),
                "total_steps": str(self.total_steps), "tokens_seen": str(self.tokens_seen)}
        return adapter_io.write(out, adapter_io.flat_tensors(trainable), cfg.alpha / cfg.rank, meta,
                                int(cfg.export_max_mib * 2**20))

    def resume(self, run: Path) -> bool:
        """Load the newest accelerate state of `run`, if any; every process must call it."""
        ptr = run / "latest_state"
        if not ptr.exists():
            return False
        self.acc.load_state(str(run / ptr.read_text().strip()))
        self._at = None
        return True


def train_distributed(cfg: TrainConfig) -> AcceleratedTrainer:
    """`train` under accelerate: load, resume from `cfg.run`'s accelerate state when there is one, train."""
    acc = make_accelerator(cfg)
    fsdp = fsdp_requested()
    if fsdp and not cfg.full:
        cfg.bf16_weights = False  # FSDP shards one dtype per unit: fp32 base + LoRA, bf16 compute via its policy
    with acc.main_process_first():  # a hub id is downloaded once, by the main process, into the shared cache
        base = load_base(cfg, torch.device("cpu") if fsdp else acc.device)
    if cfg.stream:
        if cfg.val_size:
            raise ValueError("--val-size with --stream: hold out a separate data file instead")
        data = ExampleStream(cfg.data, base.tok, base.stop_id, cfg.max_len, cfg.answers, cfg.seed,
                             cfg.shuffle_buffer, cfg.limit)
        val, stats = [], {"stream": True, "answers": cfg.answers}
    else:
        data, val, stats = load_examples_for(cfg, base)
    cfg.extra = {"base": base.spec, "data": str(cfg.data), "data_stats": stats, "train_examples": len(data),
                 "val_examples": len(val)}
    fresh = not (cfg.run / "latest_state").exists()
    init = init_state(cfg.init_from, cfg.alpha / cfg.rank) if fresh and cfg.init_from is not None else None
    trainer = AcceleratedTrainer(cfg, base.model, data, base.mask_id, base.pad_id, acc, val, init)
    if trainer.resume(cfg.run):
        acc.print(f"resumed from {cfg.run / (cfg.run / 'latest_state').read_text().strip()} "
                  f"at step {trainer.step}/{trainer.total_steps}")
    else:
        acc.print(f"new run {cfg.run}: {len(data)} examples, {trainer.total_steps} steps, "
                  f"{sum(p.numel() for p in base.model.parameters() if p.requires_grad):,} trainable parameters, "
                  f"{trainer.launch}")
    cfg.run.mkdir(parents=True, exist_ok=True)
    trainer.run(cfg.run)
    acc.wait_for_everyone()
    return trainer
