"""The training loop: AdamW + warm-up/cosine, bf16, micro-batches, checkpoints that resume exactly.

Exact resume: the data order of an epoch is a permutation drawn from (seed, epoch) alone, the noise has
its own generator whose state is checkpointed, and a checkpoint holds the trainable tensors, AdamW and
scheduler states, RNG states and the data position. Same threads + same data -> the same run.

Precision (bf16 on): the frozen base weights are stored in bf16 and activations run in bf16 under
autocast; the trainable tensors (LoRA A/B, the mask-token row, norms if trained) and AdamW's state stay
fp32 masters, cast to bf16 where used; RMSNorm statistics, softmax and the loss are computed in fp32.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from . import adapter_io
from .attention import IMPLS
from .finish import POLICIES
from .examples import Example
from .lora import add_adapter, trainable_state
from .options import opt
from .recipe import RECIPES, Batch, LossConfig, batch_loss, build_batch, draw_noise, loss_parts


@dataclass
class TrainConfig:
    data: Path | None = None
    run: Path = field(default=Path("runs/train"), metadata=opt('run directory: checkpoints, log; resumes if present'))
    model: str = field(default="bundled-base", metadata=opt('engine model spec of the AR base to adapt'))
    recipe: str = field(default="full", metadata=opt(
        'paper ablation: naive token shift / + pad to block boundary / + complementary masks', choices=RECIPES))
    block_size: int = field(default=32, metadata=opt('diffusion block size'))
    max_len: int = field(default=256, metadata=opt('prompt+answer tokens kept (multiple of block size)'))
    answers: str = field(default="finish", metadata=opt(
        'answers policy (training/finish.py): finish = every answer ends with its stop token (capped or over-'
        'long ones cut at their last sentence end and closed, loops dropped); keep = the old rule (capped '
        'kept without a stop token); drop = capped, over-long and looping dropped', choices=POLICIES))
    rank: int = field(default=32, metadata=opt('LoRA rank (32; 64-128 for the GPU runs)'))
    alpha: float = field(default=64.0, metadata=opt('LoRA alpha (scale = alpha / rank)'))
    train_norms: bool = field(default=False, metadata=opt('also train the RMSNorm weights'))
    lr: float = field(default=3e-4, metadata=opt('peak learning rate (AdamW)'))
    weight_decay: float = field(default=0.0, metadata=opt('AdamW weight decay'))
    warmup_steps: int = field(default=10, metadata=opt('linear warm-up steps'))
    min_lr_ratio: float = field(default=0.1, metadata=opt('cosine decay floor, fraction of --lr'))
    epochs: float = field(default=2.0, metadata=opt('passes over the data (sets the schedule length)'))
    batch_size: int = field(default=4, metadata=opt('sequences per optimiser step'))
    micro_batch: int | None = field(default=None, metadata=opt(
        'sequences per forward (gradient accumulation over --batch-size); default: --batch-size'))
    grad_clip: float = field(default=1.0, metadata=opt('gradient norm clip'))
    bf16: bool = field(default=True, metadata=opt(
        'no bf16 at all: fp32 weights and activations', flag="fp32", invert=True))
    bf16_weights: bool = field(default=True, metadata=opt(
        'keep the frozen base in fp32 under bf16 autocast (slower: recasts every weight each step)',
        flag="fp32-weights", invert=True))
    attention: str = field(default="auto", metadata=opt(
        'recipe attention: auto = flex on CUDA, blockwise per-block SDPA for pad/full, dense mask otherwise',
        choices=IMPLS))
    mask_later: float = field(default=0.0, metadata=opt(
        'noise bias in [0, 1]: mask later positions of each sub-block more often (0: uniform per block)'))
    sub_block_size: int = field(default=8, metadata=opt('sub-block size that --mask-later ramps over'))
    certainty_weight: float = field(default=0.0, metadata=opt(
        'certainty forcing (dParallel): weight of the entropy of correctly predicted masked tokens'))
    certainty_temperature: float = field(default=0.5, metadata=opt('softmax temperature of that entropy'))
    distill_kl: float = field(default=0.0, metadata=opt(
        'weight of KL(base || dLLM) at every masked answer position: the AR base\'s whole next-token distribution as '
        'a target beside its token (the teacher is the base itself, the adapter off: one causal forward of the clean '
        'copy without gradients: ~10-15 %% more compute per step, estimated). LoRA only; 0: off'))
    export_to: Path | None = field(default=None, metadata=opt(
        'at every checkpoint also write the adapter here in fp16 (split into parts if over --export-max-mib)'))
    export_max_mib: float = field(default=16.0, metadata=opt('largest adapter file --export-to writes'))
    seed: int = field(default=0, metadata=opt('seeds data order, masks and LoRA init'))
    save_every_s: float = field(default=240.0, metadata=opt('checkpoint at least this often (seconds)'))
    save_every_steps: int = field(default=0, metadata=opt('also checkpoint every N steps (0: off)'))
    max_steps: int | None = field(default=None, metadata=opt('stop this process after this global step'))
    minutes: float | None = field(default=None, metadata=opt('stop this process after this wall time (resume later)'))
    limit: int | None = field(default=None, metadata=opt('use only the first N training examples'))
    val_size: int = field(default=0, metadata=opt('hold out N examples; their loss is logged at each checkpoint'))
    init_from: Path | None = field(default=None, metadata=opt(
        "new run only: start from the adapter weights of this checkpoint (or a run directory's latest), or of"
        ' an exported adapter file (.safetensors, e.g. the shipped one; LoRA read back from bf16); fresh '
        'optimiser/schedule; a lower rank grows into --rank (same alpha/rank; new directions start at B = 0)'))
    compile: bool = field(default=False, metadata=opt(
        'torch.compile each decoder layer (regional: one compiled graph serves every layer; the recipe attention '
        'runs outside it as before). GPU block 3\'s profile: the largest share of a step\'s kernel time is small elementwise '
        'kernels (LoRA sums, norms, RoPE, casts), which this fuses; opt-in until a GPU block times it'))
    full: bool = field(default=False, metadata=opt(
        "full fine-tuning (every weight; the paper's setting) instead of LoRA; export with --merge-to"))
    accelerate: bool = field(default=False, metadata=opt(
        'run through accelerate (DDP/FSDP, bf16, accelerate checkpoints); implied under `accelerate '
        'launch`/torchrun with more than one process (training/README.md)'))
    stream: bool = field(default=False, metadata=opt(
        'stream the data (one pass per epoch through a shuffle buffer) instead of loading it all'))
    shuffle_buffer: int = field(default=10_000, metadata=opt('examples the --stream shuffle mixes'))
    progress: bool = True
    extra: dict = field(default_factory=dict)  # recorded in checkpoints and the adapter's metadata

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES} (got {self.recipe!r})")
        if self.answers not in POLICIES:
            raise ValueError(f"answers must be one of {POLICIES} (got {self.answers!r})")
        if self.max_len % self.block_size:
            raise ValueError(f"max_len ({self.max_len}) must be a multiple of block_size ({self.block_size})")
        if self.attention not in IMPLS:
            raise ValueError(f"attention must be one of {IMPLS} (got {self.attention!r})")
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1 (got {self.rank})")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {self.batch_size})")
        micro = self.micro_batch or self.batch_size
        if micro < 1 or self.batch_size % micro:
            raise ValueError(f"micro_batch must be >= 1 and divide batch_size {self.batch_size} (got {micro})")
        if not 0.0 <= self.mask_later <= 1.0:
            raise ValueError(f"mask_later must be in [0, 1] (got {self.mask_later})")
        if self.mask_later and (self.sub_block_size < 2 or self.block_size % self.sub_block_size):
            raise ValueError(f"sub_block_size must be >= 2 and divide block_size {self.block_size} "
                             f"(got {self.sub_block_size})")
        if self.export_max_mib <= 0:
            raise ValueError(f"export_max_mib must be > 0 (got {self.export_max_mib})")
        if self.full and (self.export_to is not None or self.init_from is not None):
            raise ValueError("full fine-tuning: export_to / init_from are adapter features; export the run with "
                             "`python -m training export --merge-to DIR`")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1 (got {self.shuffle_buffer})")
        if self.distill_kl and (self.full or self.train_norms):
            raise ValueError("distill_kl: the teacher is the base with the adapter off, so it needs LoRA on a frozen "
                             "base (not --full, not --train-norms)")
        self.loss_config()  # validates the loss settings

    def loss_config(self) -> LossConfig:
        return LossConfig(self.certainty_weight, self.certainty_temperature, self.distill_kl)


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up to 1, then cosine down to `floor` at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def phase_summary(sd: dict) -> dict:
    """What one run (phase) of a checkpoint did: its steps, tokens, training seconds and examples."""
    return {"step": sd["step"], "tokens_seen": sd["tokens_seen"], "train_seconds": round(float(sd["elapsed"]), 1),
            "examples": sd["num_examples"]}


def phases(sd: dict) -> list[dict]:
    """Every phase that made a checkpoint's weights, earliest first: the runs it was initialised from, then itself."""
    return [*sd.get("prior_phases", []), phase_summary(sd)]


def grow_into(param: Tensor, t: Tensor, name: str) -> None:
    """Copy an init tensor into a parameter; a LoRA pair of a lower rank fills the first rows of A and the first
    columns of B. The run's new directions keep their fresh init (A random, B zero), so B A, and the model, start
    where the smaller adapter left them (same alpha/rank: `init_state` checks the scale) with more capacity to train."""
    if t.shape == param.shape:
        param.copy_(t)
    elif name.endswith(".lora_A") and t.shape[1:] == param.shape[1:] and t.shape[0] < param.shape[0]:
        param[: t.shape[0]].copy_(t)
    elif name.endswith(".lora_B") and t.shape[0] == param.shape[0] and t.shape[1] < param.shape[1]:
        param[:, : t.shape[1]].copy_(t)
        param[:, t.shape[1]:].zero_()
    else:
        raise ValueError(f"init checkpoint: {name} is {tuple(t.shape)}, this run's {tuple(param.shape)} (a LoRA rank "
                         "may only grow)")


def init_state(path: Path, lora_scale: float) -> dict:
    """What `--init-from` reads: a checkpoint (full or slim), or an exported adapter file (the shipped
    assets/fastdllm_adapter.safetensors), turned back into trainable tensors and the phases that made it."""
    if path.is_dir():  # a run directory: its latest checkpoint
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"init-from: no checkpoint in {path}")
        path = ckpt
    if path.suffix != ".safetensors":
        return torch.load(path, map_location="cpu", weights_only=False)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        raw = {k: f.get_tensor(k) for k in f.keys()}
    if abs(float(meta.get("lora_scale", lora_scale)) - lora_scale) > 1e-6:
        raise ValueError(f"init-from: {path} has LoRA scale {meta['lora_scale']}, this run alpha/rank = {lora_scale}")
    trainable = {}
    for k, t in raw.items():
        kind, _, name = k.partition(".")
        if kind in ("lora_A", "lora_B"):
            trainable[name.removesuffix(".weight") + "." + kind] = t.float()
        elif k == "extend.model.embed_tokens.weight":
            trainable["model.embed_tokens.new"] = t.float()
        elif kind == "set" and name != "model.embed_tokens.weight":
            trainable[name] = t.float()
        else:
            raise ValueError(f"init-from: {path} holds {k}, which an adapter file cannot give back as trainable "
                             "tensors; start from the run's checkpoint instead")
    done = json.loads(meta["phases"]) if "phases" in meta else [
        {"step": int(meta.get("step", 0)), "tokens_seen": int(meta.get("tokens_seen", 0)),
         "train_seconds": float(meta.get("train_seconds", 0.0)), "examples": int(meta.get("train_examples", 0))}]
    last = done[-1]
    return {"trainable": trainable, "prior_phases": done[:-1], "step": last["step"],
            "tokens_seen": last["tokens_seen"], "elapsed": last["train_seconds"], "num_examples": last["examples"]}


class Trainer:
    """Owns the model's trainable part, the optimiser and the data position."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, examples: list[Example], mask_id: int, pad_id: int,
                 val: list[Example] | None = None):
        self.cfg, self.model, self.examples, self.val = cfg, model, examples, val or []
        self.mask_id, self.pad_id = mask_id, pad_id
        self.base_vocab = model.model.embed_tokens.num_embeddings
        self.loss_cfg = cfg.loss_config()
        if cfg.export_to is not None and mask_id < self.base_vocab:
            raise ValueError("export_to: the mask token overrides a spare embedding row (Qwen2.5); "
                             "use `python -m training export`, which writes the whole embedding")
        if cfg.full:  # every weight is an fp32 master; bf16 compute comes from autocast alone
            from .full import make_full

            self.names = make_full(model, mask_id)
        else:
            if cfg.bf16 and cfg.bf16_weights:
                for p in model.parameters():  # parameters only: the rotary inv_freq buffer stays fp32
                    p.data = p.data.to(torch.bfloat16)
            self.names = add_adapter(model, cfg.rank, cfg.alpha, cfg.seed, cfg.train_norms, new_token_id=mask_id)
        self.params = [p for n, p in model.named_parameters() if p.requires_grad]
        if cfg.compile:
            for layer in model.model.layers:  # same code and shapes in every layer: compiled once, reused
                layer.compile()
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99),
                                     fused=self.params[0].is_cuda or None)  # one kernel for ~200 LoRA tensors
        self.steps_per_epoch = max(1, len(examples) // cfg.batch_size)
        self.total_steps = max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio))
        self.noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.step = 0
        self.tokens_seen = 0  # prompt + answer tokens of the sequences trained on
        self.loss_tokens = 0
        self.elapsed = 0.0  # training wall time over all processes of this run
        self.history: list[dict] = []
        self.prior_phases: list[dict] = []  # the runs this one was initialised from (--init-from), earliest first
        self.exported_step: int | None = None
        self.is_main = True  # the process that logs and writes files (training/distributed.py: rank 0)

    # ------------------------------------------------------------------ data
    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.examples), generator=g).tolist()

    def step_examples(self) -> list[Example]:
        epoch, k = divmod(self.step, self.steps_per_epoch)
        idx = self.order(epoch)[k * self.cfg.batch_size:(k + 1) * self.cfg.batch_size]
        return [self.examples[i] for i in idx]

    def make_batch(self, exs: list[Example], noise: list) -> Batch:
        return build_batch(exs, noise, recipe=self.cfg.recipe, block_size=self.cfg.block_size,
                           mask_id=self.mask_id, pad_id=self.pad_id)

    def draw(self, ex: Example, gen: torch.Generator):
        return draw_noise(ex, self.cfg.block_size, gen, later=self.cfg.mask_later, sub_block_size=self.cfg.sub_block_size)

    def next_batches(self) -> list[Batch]:
        """The step's sequences (noise drawn in data order), as micro-batches of similar length.

        Sorting inside the step cuts the padding to each micro-batch's longest row without changing
        which sequences or noise the step trains on.
        """
        exs = self.step_examples()
        noise = [self.draw(ex, self.noise_gen) for ex in exs]
        exs, noise = self.shard(exs, noise)
        micro = min(self.cfg.micro_batch or self.cfg.batch_size, len(exs))
        if micro == len(exs):
            return [self.make_batch(exs, noise)]
        order = sorted(range(len(exs)), key=lambda i: len(exs[i].ids))
        return [self.make_batch([exs[i] for i in order[j:j + micro]], [noise[i] for i in order[j:j + micro]])
                for j in range(0, len(order), micro)]

    def shard(self, exs: list[Example], noise: list) -> tuple[list[Example], list]:
        """This process's part of the step (noise was drawn for the whole step): here all of it."""
        return exs, noise

    def autocast(self):
        return torch.autocast("cpu" if self.device.type == "cpu" else self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.bf16)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """One optimiser step over the step's micro-batches; the gradient is that of the whole batch."""
        self.model.train()
        batches = self.next_batches()
        total = max(sum(b.loss_tokens for b in batches), 1)
        self.opt.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        for batch in batches:
            with self.autocast():
                out = loss_parts(self.model, batch.to(self.device), self.cfg.attention, self.loss_cfg)
            weight = batch.loss_tokens / total  # micro-batch means -> the mean over the whole step
            (out["loss"] * weight).backward()
            for k, v in out.items():
                parts[k] = parts.get(k, 0.0) + v.item() * weight
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        seq = sum(b.seq_tokens for b in batches)
        self.tokens_seen += seq
        self.loss_tokens += total
        rec = {"step": self.step, "loss": round(parts.pop("loss"), 5), "lr": lr, "grad_norm": round(float(gnorm), 4),
               "seq_tokens": seq, "answer_tokens": sum(b.answer_tokens for b in batches),
               "forward_tokens": sum(int(b.ids.numel()) for b in batches),
               "loss_tokens": total, "tokens_seen": self.tokens_seen}
        if self.loss_cfg.certainty_weight or self.loss_cfg.kl_weight:
            rec.update({k: round(v, 5) for k, v in parts.items()})
        self.history.append(rec)
        return rec

    @torch.no_grad()
    def val_loss(self) -> float | None:
        """Loss on held-out examples with fixed noise (comparable across checkpoints)."""
        if not self.val:
            return None
        self.model.eval()
        gen = torch.Generator().manual_seed(12345)
        total, count = 0.0, 0
        for i in range(0, len(self.val), self.cfg.batch_size):
            exs = self.val[i:i + self.cfg.batch_size]
            batch = self.make_batch(exs, [self.draw(ex, gen) for ex in exs])
            with self.autocast():
                total += batch_loss(self.model, batch.to(self.device), self.cfg.attention).item() * batch.loss_tokens
            count += batch.loss_tokens
        return total / max(count, 1)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"trainable": trainable_state(self.model), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "step": self.step, "tokens_seen": self.tokens_seen,
                "loss_tokens": self.loss_tokens, "elapsed": self.elapsed, "history": self.history,
                "rng": {"noise": self.noise_gen.get_state(), "torch": torch.get_rng_state(),
                        "python": random.getstate()},
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.cfg).items()},
                "total_steps": self.total_steps, "num_examples": len(self.examples),
                "mask_id": self.mask_id, "base_vocab": self.base_vocab, "prior_phases": self.prior_phases}

    def load_state_dict(self, sd: dict) -> None:
        if sd["num_examples"] != len(self.examples):
            raise ValueError(f"checkpoint was trained on {sd['num_examples']} examples, the data now has "
                             f"{len(self.examples)}: an exact resume needs the same data")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in sd["trainable"].items():
                params[n].copy_(t)
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])
        self.step, self.tokens_seen, self.loss_tokens = sd["step"], sd["tokens_seen"], sd["loss_tokens"]
        self.elapsed, self.history = sd["elapsed"], list(sd["history"])
        self.prior_phases = list(sd.get("prior_phases", []))
        self.noise_gen.set_state(sd["rng"]["noise"])
        torch.set_rng_state(sd["rng"]["torch"])
        random.setstate(sd["rng"]["python"])

    def load_weights(self, sd: dict) -> None:
        """Only the trained tensors of a checkpoint: a new phase (new data, fresh optimiser and schedule)."""
        params = dict(self.model.named_parameters())
        if set(sd["trainable"]) != set(self.names):
            raise ValueError("init checkpoint: its trainable tensors differ from this run's (--train-norms?)")
        with torch.no_grad():
            for n, t in sd["trainable"].items():
                grow_into(params[n], t, n)
        self.prior_phases = phases(sd)

    def save(self, run: Path, keep: int = 2) -> Path:
        """Atomic write of ckpt-<step>.pt, then `latest` points at it; older ones beyond `keep` go."""
        run.mkdir(parents=True, exist_ok=True)
        path = run / f"ckpt-{self.step:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        (run / "latest.tmp").write_text(path.name)
        os.replace(run / "latest.tmp", run / "latest")
        for old in sorted(run.glob("ckpt-*.pt"))[:-keep]:
            old.unlink()
        if self.cfg.export_to is not None:
            self.export(self.cfg.export_to)
        return path

    def export(self, out: Path) -> list[Path]:
        """The current adapter in fp16, in parts of <= export_max_mib (what a lost GPU machine leaves us)."""
        cfg = self.cfg
        meta = {"base": str(cfg.model), "recipe": cfg.recipe, "block_size": str(cfg.block_size),
                "rank": str(cfg.rank), "alpha": str(cfg.alpha), "step": str(self.step),
                "total_steps": str(self.total_steps), "tokens_seen": str(self.tokens_seen)}
        tensors = adapter_io.flat_tensors(trainable_state(self.model))
        self.exported_step = self.step
        return adapter_io.write(out, tensors, cfg.alpha / cfg.rank, meta, int(cfg.export_max_mib * 2**20))

    # ------------------------------------------------------------------ loop
    def agree(self, flag: bool) -> bool:
        """A decision taken from this process's clock (training/distributed.py: any process's, for all)."""
        return flag

    def run(self, run: Path) -> None:
        cfg = self.cfg
        stop_at = min(self.total_steps, cfg.max_steps if cfg.max_steps is not None else self.total_steps)
        t_start = time.perf_counter()
        last_save = t_start
        tok0, answers, t_seg = self.tokens_seen, 0, t_start
        run.mkdir(parents=True, exist_ok=True)
        log = (run / "log.jsonl").open("a") if self.is_main else open(os.devnull, "w")
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.is_main), mininterval=5.0)
        ema = None
        while self.step < stop_at:
            t0 = time.perf_counter()
            rec = self.train_step()
            now = time.perf_counter()
            self.elapsed += now - t0
            rec["elapsed_s"] = round(self.elapsed, 1)
            ema = rec["loss"] if ema is None else 0.9 * ema + 0.1 * rec["loss"]
            answers += rec["answer_tokens"]
            tok_s = (self.tokens_seen - tok0) / max(now - t_seg, 1e-9)
            ans_s = answers / max(now - t_seg, 1e-9)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tok_s:.0f}", answer_tok_s=f"{ans_s:.0f}", lr=f"{rec['lr']:.1e}")
            out_of_time = cfg.minutes is not None and self.agree(now - t_start > cfg.minutes * 60)
            due = self.agree(now - last_save > cfg.save_every_s) or (cfg.save_every_steps and self.step % cfg.save_every_steps == 0)
            if due or out_of_time or self.step >= stop_at:
                vl = self.val_loss()
                path = self.save(run)
                if vl is not None:
                    log.write(json.dumps({"step": self.step, "val_loss": round(vl, 5)}) + "\n")
                    log.flush()
                if self.is_main:
                    bar.write(f"step {self.step}: saved {path}" + (f" (val loss {vl:.4f})" if vl is not None else ""))
                last_save = time.perf_counter()
            if out_of_time:
                break
        bar.close()
        log.close()
        if cfg.export_to is not None and self.exported_step != self.step:
            self.export(cfg.export_to)  # a command with nothing left to train still hands back the adapter


def latest_checkpoint(run: Path) -> Path | None:
    ptr = run / "latest"
    return run / ptr.read_text().strip() if ptr.exists() else None


@dataclass
class Base:
    """The model to adapt and the token ids the recipe needs."""

    model: nn.Module
    tok: object  # the tokenizer, with |<MASK>|
    mask_id: int
    stop_id: int
    pad_id: int
    spec: str


def load_base(cfg: TrainConfig, device: torch.device) -> Base:
    from engine.weights import MASK_TOKEN, build_model, load_tokenizer, resolve_source

    source = resolve_source(cfg.model)
    model = build_model(source.path, device, torch.float32)
    tok = load_tokenizer(source.path, add_mask_token=True)
    vocab = tok.get_vocab()
    mask_id, stop_id = vocab[MASK_TOKEN], vocab["<|im_end|>"]
    if mask_id > model.cfg.vocab_size:
        raise ValueError(f"mask token id {mask_id} leaves a gap after the {model.cfg.vocab_size} embedding rows")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop_id
    return Base(model, tok, mask_id, stop_id, pad_id, source.spec)


def load_examples_for(cfg: TrainConfig, base: Base) -> tuple[list[Example], list[Example], dict]:
    """(train, held-out, the answers policy's counts), every example in memory."""
    from .examples import load_data

    examples, stats = load_data(cfg.data, base.tok, base.stop_id, cfg.max_len, cfg.answers)
    if cfg.answers == "finish":  # the invariant the policy promises, checked where training reads it
        bad = sum(ex.ids[-1] != base.stop_id for ex in examples)
        if bad:
            raise ValueError(f"data: {bad} answers do not end with the stop token {base.stop_id} under answers=finish")
    if cfg.limit is not None:
        examples = examples[:cfg.limit]
    if len(examples) <= cfg.val_size:
        raise ValueError(f"data: {len(examples)} examples left after the answers policy {cfg.answers!r} "
                         f"({stats}); nothing to train on")
    val = examples[len(examples) - cfg.val_size:] if cfg.val_size else []
    examples = examples[:len(examples) - cfg.val_size] if cfg.val_size else examples
    return examples, val, stats


def train_single(cfg: TrainConfig) -> Trainer:
    """One process: load the base and data, resume from the run directory when it has a checkpoint, train
    (training/run.py picks this or the accelerate trainer)."""
    base = load_base(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    examples, val, stats = load_examples_for(cfg, base)
    cfg.extra = {"base": base.spec, "data": str(cfg.data), "data_stats": stats,
                 "train_examples": len(examples), "val_examples": len(val)}
    trainer = Trainer(cfg, base.model, examples, base.mask_id, base.pad_id, val)
    ckpt = latest_checkpoint(cfg.run)
    if ckpt is not None:
        trainer.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False))
        print(f"resumed from {ckpt} at step {trainer.step}/{trainer.total_steps}")
    else:
        if cfg.init_from is not None:
            trainer.load_weights(init_state(cfg.init_from, cfg.alpha / cfg.rank))
            print(f"initialised the adapter from {cfg.init_from}")
        print(f"new run {cfg.run}: {len(examples)} examples ({stats}), {trainer.total_steps} steps, "
              f"{sum(p.numel() for p in trainer.params):,} trainable parameters")
    cfg.run.mkdir(parents=True, exist_ok=True)
    trainer.run(cfg.run)
    return trainer
