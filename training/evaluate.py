"""A cheap check of an adapter: short-answer accuracy (AR base vs diffusion) and tokens per forward.

The bench/ package has the full benchmarks; this is the few-minute sanity check run after export.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class EvalConfig:
    model: str | None = None  # None: the bundled default (base + assets adapter)
    short: int = 40
    long: int = 10
    max_new_tokens: int = 128  # long-answer prompts (tokens per forward)
    short_max_new_tokens: int = 64  # short answers come first; the cap keeps the check cheap
    threshold: float = 0.9
    batch_size: int = 8
    out: Path | None = None
    adapter: Path | None = None  # the bundled base's adapter (FASTDLLM_ADAPTER's field); None: the environment's


def _spread(items: list[dict], n: int) -> list[dict]:
    """n items spread evenly over the file (the files are grouped by category)."""
    if n >= len(items):
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def _read(path: Path) -> list[dict]:
    from grading.checker import read_jsonl

    return [item for _, item in read_jsonl(path)]


def _run(engine, prompts: list[str], cfg, batch: int) -> list:
    out = []
    for i in range(0, len(prompts), batch):
        out += engine.generate(prompts[i:i + batch], cfg, record=False)
    return out


def evaluate(cfg: EvalConfig) -> dict:
    from grading.checker import is_correct
    from engine import Engine
    from engine.runtime import Runtime

    runtime = Runtime.from_env()
    engine = Engine.load(cfg.model, runtime=replace(runtime, adapter=Path(cfg.adapter)) if cfg.adapter else runtime)
    short = _spread(_read(REPO / "bench/data/eval_short.jsonl"), cfg.short)
    long = _spread(_read(REPO / "bench/data/long_answer.jsonl"), cfg.long)
    def modes(n: int) -> dict:
        return {"ar": engine.decode_config(mode="ar", max_new_tokens=n, temperature=0.0),
                "diffusion": engine.decode_config(mode="diffusion", threshold=cfg.threshold, cache="dual",
                                                  max_new_tokens=n, temperature=0.0)}

    report: dict = {"model": engine.lm.banner(), "short_items": len(short), "long_items": len(long)}
    examples = {}
    for name, dcfg in modes(cfg.short_max_new_tokens).items():
        t0 = time.perf_counter()
        res = _run(engine, [it["prompt"] for it in short], dcfg, cfg.batch_size)
        ok = [is_correct(r.text, it["answers"]) for r, it in zip(res, short)]
        report[f"{name}_accuracy"] = round(sum(ok) / len(ok), 4)
        report[f"{name}_short_seconds"] = round(time.perf_counter() - t0, 1)
        report[f"{name}_short_tokens_per_forward"] = round(
            sum(r.summary.answer_tokens for r in res) / max(sum(r.summary.nfe for r in res), 1), 3)
        examples[name] = [(it["prompt"], r.text[:160], k) for it, r, k in zip(short[:5], res[:5], ok[:5])]
    t0 = time.perf_counter()
    res = _run(engine, [it["prompt"] for it in long], modes(cfg.max_new_tokens)["diffusion"], cfg.batch_size)
    toks, nfe = sum(r.summary.answer_tokens for r in res), sum(r.summary.nfe for r in res)
    report["long_tokens_per_forward"] = round(toks / max(nfe, 1), 3)
    report["long_tokens_per_forward_mean_of_rows"] = round(
        sum(r.summary.tokens_per_forward for r in res) / len(res), 3)
    report["long_answer_tokens"] = toks
    report["long_seconds"] = round(time.perf_counter() - t0, 1)
    report["long_example"] = res[0].text[:400]
    report["short_examples"] = examples
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(report, indent=1))
    return report
