"""The paper's recipe ablation (naive token shift / + pad / + complementary masks) as one table.

Each run directory is a `python -m training train --recipe R` run on the same data, seed and budget.
Every adapter is judged by the same protocol, whatever recipe trained it:
  * held-out masked-token loss and top-1 accuracy: the last `val_size` examples of the data (the ones
    `--val-size` held out of training), one fixed noise draw, scored as at inference: answers padded with
    mask tokens to the block boundary, the noisy view and its complement (every answer token scored once);
  * decoding: short-answer accuracy (AR base vs diffusion) and tokens per forward on long answers, through
    the engine with the exported adapter (training.evaluate).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .evaluate import EvalConfig, evaluate

# Fast-dLLM v2 1.5B, paper Table 2 (GSM8K and the average over 9 benchmarks), for the side-by-side.
PAPER_TABLE2 = {"naive": {"gsm8k": 59.0, "avg": 41.3}, "pad": {"gsm8k": 60.1, "avg": 42.2},
                "full": {"gsm8k": 62.0, "avg": 45.0}}
LABELS = {"naive": "naive token shift", "pad": "+ pad", "full": "+ pad + complementary masks"}


@dataclass
class AblationConfig:
    runs: list[Path]
    data: Path
    val_size: int = 16
    short: int = 40
    long: int = 8
    max_new_tokens: int = 128
    threshold: float = 0.9
    out: Path = Path("bench/results/ablation")
    extra: dict = field(default_factory=dict)


@torch.no_grad()
def score_heldout(model, val: list, block_size: int, mask_id: int, pad_id: int, seed: int = 12345) -> dict:
    """Masked-token loss and top-1 accuracy, full-recipe protocol: every answer token scored exactly once."""
    from .recipe import IGNORE, build_batch, draw_noise

    gen = torch.Generator().manual_seed(seed)
    loss_sum, hits, count = 0.0, 0, 0
    for ex in val:
        noise = [draw_noise(ex, block_size, gen)]
        b = build_batch([ex], noise, recipe="full", block_size=block_size, mask_id=mask_id, pad_id=pad_id)
        logits = model(b.ids, b.pos, mask=b.mask, logits_idx=b.logits_idx).float()
        keep = b.targets != IGNORE
        loss_sum += torch.nn.functional.cross_entropy(logits[keep], b.targets[keep], reduction="sum").item()
        hits += int((logits[keep].argmax(-1) == b.targets[keep]).sum())
        count += int(keep.sum())
    return {"heldout_loss": round(loss_sum / max(count, 1), 4), "heldout_top1": round(hits / max(count, 1), 4),
            "heldout_tokens": count}


def heldout_metrics(adapter: Path, data: Path, val_size: int, block_size: int) -> dict:
    """score_heldout for the bundled base + this adapter on the last val_size examples of the data."""
    from engine.weights import MASK_TOKEN, apply_adapter, build_model, load_tokenizer, resolve_source

    from .examples import load_examples

    src = resolve_source("bundled-base")
    model = apply_adapter(build_model(src.path, torch.device("cpu"), torch.float32), adapter).eval()
    tok = load_tokenizer(src.path, add_mask_token=True)
    vocab = tok.get_vocab()
    mask_id, stop_id = vocab[MASK_TOKEN], vocab["<|im_end|>"]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop_id
    examples, _ = load_examples(data, tok, stop_id, 256)
    return score_heldout(model, examples[len(examples) - val_size:], block_size, mask_id, pad_id)


def model_tokens(run: Path, step: int) -> int:
    """Tokens through the model up to `step` (the compute: full = 3L per row, naive/pad = 2L)."""
    total = 0
    for line in (run / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "forward_tokens" in rec and rec["step"] <= step:
            total += rec["forward_tokens"]
    return total


def protocol(cfg: AblationConfig) -> dict:
    return {"data": str(cfg.data), "val_size": cfg.val_size, "short_items": cfg.short, "long_items": cfg.long,
            "max_new_tokens": cfg.max_new_tokens, "threshold": cfg.threshold, "cache": "dual"}


def run_ablation(cfg: AblationConfig) -> dict:
    from .export import export

    rows = []
    for run in cfg.runs:
        adapter = run / "adapter.safetensors"
        meta = export(run, adapter)
        cached = run / "ablation_row.json"  # a run scored before at this step and protocol is not re-scored
        key = {"step": int(meta["step"]), "protocol": protocol(cfg)}
        if cached.exists() and json.loads(cached.read_text()).get("key") == key:
            rows.append({**json.loads(cached.read_text())["row"], "model_tokens": model_tokens(run, key["step"])})
            print(f"{run}: scored before at step {key['step']}")
            continue
        row = {"run": str(run), "recipe": meta["recipe"], "label": LABELS[meta["recipe"]],
               "steps": int(meta["step"]), "tokens_seen": int(meta["tokens_seen"]),
               "train_seconds": float(meta["train_seconds"]), "model_tokens": model_tokens(run, int(meta["step"]))}
        row.update(heldout_metrics(adapter, cfg.data, cfg.val_size, int(meta["block_size"])))
        rep = evaluate(EvalConfig(model="bundled", short=cfg.short, long=cfg.long,
                                  max_new_tokens=cfg.max_new_tokens, threshold=cfg.threshold, adapter=adapter))
        row.update({k: rep[k] for k in ("ar_accuracy", "diffusion_accuracy", "long_tokens_per_forward")})
        row["paper_gsm8k"] = PAPER_TABLE2[row["recipe"]]["gsm8k"]
        row["paper_avg"] = PAPER_TABLE2[row["recipe"]]["avg"]
        rows.append(row)
        cached.write_text(json.dumps({"key": key, "row": row}, indent=1))
        print(json.dumps(row))
    report = {"protocol": protocol(cfg), "rows": rows, **cfg.extra}
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "results.json").write_text(json.dumps(report, indent=1))
    (cfg.out / "table.md").write_text(markdown(rows))
    return report


def markdown(rows: list[dict]) -> str:
    head = ("| recipe | tokens seen | model tokens | held-out loss | held-out top-1 | diffusion acc. (AR base) | long tok/fwd "
            "| paper GSM8K | paper avg. |\n|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['label']} | {r['tokens_seen']:,} | {r.get('model_tokens', 0):,} | {r['heldout_loss']:.3f} | {r['heldout_top1']:.3f} "
        f"| {r['diffusion_accuracy']:.3f} ({r['ar_accuracy']:.3f}) | {r['long_tokens_per_forward']:.2f} "
        f"| {r['paper_gsm8k']} | {r['paper_avg']} |\n" for r in rows)
    return head + body
