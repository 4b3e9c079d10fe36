"""Self-distillation: the AR base answers the training prompts (greedy), written as chat JSONL.

The bundled dLLM learns to decode in parallel what its own AR base would say, so its answers are the
natural targets: no external data set, no licence beyond the base model's (Apache-2.0).
Resumable: the output file is appended to and prompts already present are skipped.

mode="diffusion" collects the dLLM's *own* decoding trajectories instead (the engine's block-diffusion
decoder with an adapter, greedy, threshold): the data of the certainty-forcing stage (dParallel), where
`train --certainty-weight` teaches the model to be confident on what it already decodes.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(slots=True)
class DistillConfig:
    prompts: Path
    out: Path
    model: str = "bundled-base"  # the AR base WITHOUT the adapter (mode "ar"); base + adapter for "diffusion"
    limit: int | None = None  # use only the first N prompts of the file
    batch_size: int = 24
    max_new_tokens: int = 160
    time_budget_s: float | None = None  # stop after the batch that crosses this wall time
    mode: str = "ar"  # "ar": the base's answers; "diffusion": the dLLM's own trajectories
    threshold: float = 0.9  # diffusion confidence threshold (mode "diffusion")
    dtype: str | None = None  # engine weights/activations: None = the engine's default (fp32 CPU, bf16 CUDA)

    def __post_init__(self) -> None:
        if self.mode not in ("ar", "diffusion"):
            raise ValueError(f"mode must be 'ar' or 'diffusion' (got {self.mode!r})")


def read_prompts(path: Path) -> list[str]:
    """Prompts from JSONL records {"prompt": ...}, in file order, duplicates dropped."""
    seen: dict[str, None] = {}
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            p = rec.get("prompt") if isinstance(rec, dict) else None
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"{path}:{n}: each record needs a non-empty 'prompt' string")
            seen.setdefault(p, None)
    return list(seen)


def done_prompts(path: Path) -> set[str]:
    """User turns already answered in an existing distill file (truncated ones included: not redone)."""
    if not path.exists():
        return set()
    out = set()
    with path.open() as f:
        for line in f:
            if line.strip():
                out.add(json.loads(line)["messages"][0]["content"])
    return out


def bucket_by_length(prompts: list[str], encode, window: int) -> list[str]:
    """Sort by token length inside windows of file order: batches pad less, a time budget stays unbiased."""
    out: list[str] = []
    for i in range(0, len(prompts), window):
        out += sorted(prompts[i:i + window], key=lambda p: len(encode(p)))
    return out


def record(prompt: str, answer: str, stop_reason: str, n_tokens: int, **extra) -> dict:
    """One chat JSONL line; stop_reason lets the data loader drop answers cut at max_new_tokens."""
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            "stop_reason": stop_reason, "answer_tokens": n_tokens, **extra}


def distill(cfg: DistillConfig, engine=None) -> dict:
    """Generate the missing answers batch by batch; returns throughput numbers for the log/model card.

    `engine`: an already loaded engine.Engine for cfg.model (else it is loaded here)."""
    from engine import Engine

    prompts = read_prompts(cfg.prompts)
    if cfg.limit is not None:
        prompts = prompts[:cfg.limit]
    done = done_prompts(cfg.out)
    todo = [p for p in prompts if p not in done]
    engine = engine or Engine.load(cfg.model, dtype=cfg.dtype)
    todo = bucket_by_length(todo, engine.encode, cfg.batch_size * 8)
    knobs = {"threshold": cfg.threshold} if cfg.mode == "diffusion" else {}
    dcfg = engine.decode_config(mode=cfg.mode, max_new_tokens=cfg.max_new_tokens, temperature=0.0, **knobs)
    extra = {"mode": cfg.mode, **knobs} if cfg.mode == "diffusion" else {}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    t0, tokens, written, truncated = time.perf_counter(), 0, 0, 0
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", dynamic_ncols=True)
    with cfg.out.open("a") as f:
        for i in range(0, len(todo), cfg.batch_size):
            batch = todo[i:i + cfg.batch_size]
            results = engine.generate(batch, dcfg, record=False)
            for p, r in zip(batch, results):
                s = r.summary
                rec = record(p, s.text, s.stop_reason, s.answer_tokens,
                             **({**extra, "tokens_per_forward": round(s.tokens_per_forward, 3)} if extra else {}))
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                tokens += s.answer_tokens
                truncated += s.stop_reason != "stop_token"
            f.flush()
            written += len(batch)
            dt = time.perf_counter() - t0
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / dt:.1f}", truncated=truncated)
            if cfg.time_budget_s is not None and dt > cfg.time_budget_s:
                break
    bar.close()
    dt = time.perf_counter() - t0
    stats = {"prompts_total": len(prompts), "already_done": len(done), "written": written,
             "truncated": truncated, "answer_tokens": tokens, "seconds": round(dt, 1),
             "tokens_per_second": round(tokens / dt, 1) if dt > 0 else 0.0}
    print(json.dumps(stats))
    return stats
