"""Training throughput, variants measured interleaved: answer tokens/s and model tokens/s -> JSON.

Every variant trains on the same steps (same data order and noise: same seed), one step each in turn,
so load from other jobs on a shared machine hits all variants alike; the process's CPU time is recorded
next to wall time (on a machine shared with other busy jobs, tokens per CPU-second are the steadier
number). A variant is a set of TrainConfig overrides; `before` is the trainer as it was (fp32 weights
under bf16 autocast, dense [3L, 3L] mask).
"""
from __future__ import annotations

import copy
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .options import opt

VARIANTS: dict[str, dict] = {
    "before": {"bf16_weights": False, "attention": "dense"},
    "bf16_weights": {"bf16_weights": True, "attention": "dense"},
    "after": {},  # the defaults: bf16 weights, attention auto (blockwise on CPU, flex on CUDA)
    "b16_micro4": {"batch_size": 16, "micro_batch": 4},  # after, 16 sequences a step in sorted micro-batches of 4
    "fp32": {"bf16": False, "attention": "dense"},
    "compiled": {"compile": True},  # after, each decoder layer under torch.compile (the next GPU block times it)
}


@dataclass
class ThroughputConfig:
    data: Path
    variants: list[str] = field(default_factory=lambda: ["before", "after"])  # the CLI's --variants, split at commas
    rounds: int = field(default=3, metadata=opt("timed steps per variant (interleaved)"))
    warmup: int = field(default=1, metadata=opt("untimed steps per variant first"))
    batch_size: int = field(default=4, metadata=opt("sequences per step"))
    micro_batch: int | None = field(default=None, metadata=opt("sequences per forward"))
    max_len: int = field(default=256, metadata=opt("tokens kept per sequence"))
    rank: int = field(default=32, metadata=opt("LoRA rank"))
    model: str = "bundled-base"
    profile: bool = field(default=False, metadata=opt(
        "add the top operators of one profiled step per variant (torch.profiler: where the time goes)"))
    out: Path | None = None

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"variants must be among {list(VARIANTS)} (got {bad})")
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError(f"rounds must be >= 1 and warmup >= 0 (got {self.rounds}, {self.warmup})")


def padding_table(examples: list, mask_id: int, shapes: list[tuple[int, int]], sequences: int = 1280,
                  seed: int = 0) -> list[dict]:
    """Model tokens per answer token for (batch_size, micro_batch) shapes: the compute that padding and
    the recipe's three segments cost, counted (no model): sorted micro-batches pad to their own longest row."""
    from .recipe import build_batch, draw_noise

    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(examples), generator=gen).tolist()[:sequences]
    rows = []
    for batch, micro in shapes:
        model_tokens = answers = 0
        for s in range(0, len(perm) - batch + 1, batch):
            step = [examples[i] for i in perm[s:s + batch]]
            if micro < batch:
                step.sort(key=lambda e: len(e.ids))
            for j in range(0, batch, micro):
                part = step[j:j + micro]
                b = build_batch(part, [draw_noise(e, 32, gen) for e in part], recipe="full", block_size=32,
                                mask_id=mask_id, pad_id=0)
                model_tokens += b.ids.numel()
                answers += b.answer_tokens
        rows.append({"batch_size": batch, "micro_batch": micro,
                     "model_tokens_per_answer_token": round(model_tokens / answers, 3)})
    return rows


def profile_step(trainer, top: int = 12) -> list[dict]:
    """Self time of the costliest operators in one training step (ms), matmuls and attention included.

    On CUDA each row also carries the operator's GPU self time (`device_ms`), and the first row is a
    summary: the step's wall time against the summed GPU kernel time (busy share = host-bound or not)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)

    def dev_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    rows = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count,
             "share": round(e.self_cpu_time_total / total, 3),
             **({"device_ms": round(dev_us(e) / 1e3, 1)} if cuda else {})} for e in ops[:top]]
    if cuda:
        # kernels are their own events (device_type CUDA); summing them counts each GPU microsecond once
        kernels = [e for e in ops if "CUDA" in str(getattr(e, "device_type", ""))]
        dev_total = sum(dev_us(e) for e in kernels) / 1e3
        by_dev = sorted(kernels, key=dev_us, reverse=True)[:top]
        rows.insert(0, {"op": "(step)", "wall_ms": round(wall_ms, 1), "device_ms": round(dev_total, 1),
                        "busy_share": round(dev_total / wall_ms, 3) if wall_ms else None,
                        "calls": sum(e.count for e in ops),
                        "top_device": [[e.key, round(dev_us(e) / 1e3, 1), e.count] for e in by_dev]})
    return rows


def measure(cfg: ThroughputConfig) -> dict:
    from engine.weights import MASK_TOKEN, build_model, load_tokenizer, resolve_source

    from .examples import load_data
    from .train import TrainConfig, Trainer

    src = resolve_source(cfg.model)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(src.path, add_mask_token=True)
    vocab = tok.get_vocab()
    mask_id, stop_id = vocab[MASK_TOKEN], vocab["<|im_end|>"]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop_id
    examples, _ = load_data(cfg.data, tok, stop_id, cfg.max_len)
    base = build_model(src.path, dev, torch.float32)
    trainers = {}
    for name in cfg.variants:
        knobs = {"batch_size": cfg.batch_size, "micro_batch": cfg.micro_batch, **VARIANTS[name]}
        tc = TrainConfig(run=Path("/nonexistent"), max_len=cfg.max_len, rank=cfg.rank, progress=False, **knobs)
        trainers[name] = Trainer(tc, copy.deepcopy(base), examples, mask_id, pad_id)
    del base
    steps: dict[str, list[dict]] = {n: [] for n in cfg.variants}
    for r in range(cfg.warmup + cfg.rounds):
        for name, tr in trainers.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            rec = tr.train_step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if r >= cfg.warmup:
                steps[name].append({**rec, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0})
    profiles = {name: profile_step(tr) for name, tr in trainers.items()} if cfg.profile else {}
    rows = {}
    for name, recs in steps.items():
        sec, cpu = sum(s["seconds"] for s in recs), sum(s["cpu_seconds"] for s in recs)
        answers = sum(s["answer_tokens"] for s in recs)
        rows[name] = {"overrides": VARIANTS[name], "steps": len(recs), "seconds": round(sec, 3),
                      "cpu_seconds": round(cpu, 3),
                      # per CPU-second of this process: what a machine to itself would give per thread
                      "answer_tokens_per_cpu_s": round(answers / cpu, 2),
                      "model_tokens_per_cpu_s": round(sum(s["forward_tokens"] for s in recs) / cpu, 2),
                      "answer_tokens_per_s": round(sum(s["answer_tokens"] for s in recs) / sec, 2),
                      "model_tokens_per_s": round(sum(s["forward_tokens"] for s in recs) / sec, 2),
                      "seq_tokens_per_s": round(sum(s["seq_tokens"] for s in recs) / sec, 2),
                      "loss_tokens_per_s": round(sum(s["loss_tokens"] for s in recs) / sec, 2),
                      "step_seconds": [round(s["seconds"], 3) for s in recs],
                      "step_cpu_seconds": [round(s["cpu_seconds"], 3) for s in recs],
                      "losses": [s["loss"] for s in recs]}
        if name in profiles:
            rows[name]["profile_top_ops"] = profiles[name]
    report = {"device": str(dev), "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_average_after": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
              "variants": rows}
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(report, indent=1) + "\n")
    return report
