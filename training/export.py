"""Checkpoint -> the adapter file the engine loads (engine.weights.apply_adapter's format)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.weights import save_adapter

from .lora import adapter_tensors
from .train import latest_checkpoint, phase_summary, phases


def export(run: Path, out: Path, checkpoint: Path | None = None, after: list[Path] | tuple = ()) -> dict:
    """Write LoRA A/B (bf16), trained norms and the mask-token row; returns the metadata written.

    The metadata's `*_total` and `phases` count every run that made the weights: the ones a checkpoint was
    `--init-from`'d from (recorded by the trainer), or, for checkpoints that predate that record, the
    checkpoints named in `after` (earliest first)."""
    ckpt = checkpoint or latest_checkpoint(run)
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint in {run} (train first: python -m training train --run {run})")
    sd = torch.load(ckpt, map_location="cpu", weights_only=False)
    cfg = sd["config"]
    lora, sets, new_rows = adapter_tensors(sd["trainable"])
    if new_rows is not None and sd["mask_id"] < sd["base_vocab"]:
        # a spare row of a padded embedding (Qwen2.5): the format can only replace the whole matrix
        from engine.weights import read_state_dict, resolve_source

        emb = read_state_dict(resolve_source(cfg["model"]).path)["model.embed_tokens.weight"].float().clone()
        emb[sd["mask_id"]:sd["mask_id"] + new_rows.shape[0]] = new_rows.float()
        sets["model.embed_tokens.weight"], new_rows = emb, None
    earlier = list(sd.get("prior_phases", []))
    if after:
        if earlier:
            raise ValueError(f"after: {ckpt} already records the runs it was initialised from; drop --after")
        for p in after:
            earlier += phases(torch.load(p, map_location="cpu", weights_only=False))
    lineage = [*earlier, phase_summary(sd)]
    hist = sd["history"]
    head = [h["loss"] for h in hist[:10]]
    tail = [h["loss"] for h in hist[-10:]]
    meta = {
        "base": str(cfg.get("model")), "recipe": cfg["recipe"], "block_size": str(cfg["block_size"]),
        "rank": str(cfg["rank"]), "alpha": str(cfg["alpha"]), "lr": str(cfg["lr"]),
        "step": str(sd["step"]), "total_steps": str(sd["total_steps"]), "tokens_seen": str(sd["tokens_seen"]),
        "train_examples": str(sd["num_examples"]), "train_seconds": str(round(sd["elapsed"], 1)),
        "loss_first10": f"{sum(head) / max(len(head), 1):.4f}", "loss_last10": f"{sum(tail) / max(len(tail), 1):.4f}",
        "checkpoint": ckpt.name, "phases": json.dumps(lineage),
        "tokens_seen_total": str(sum(p["tokens_seen"] for p in lineage)),
        "train_seconds_total": str(round(sum(p["train_seconds"] for p in lineage), 1)),
    }
    save_adapter(out, lora=lora, sets=sets, new_embed_rows=new_rows, lora_scale=cfg["alpha"] / cfg["rank"], meta=meta)
    meta["file"] = str(out)
    meta["megabytes"] = f"{out.stat().st_size / 1e6:.1f}"
    return json.loads(json.dumps(meta))


def merge(adapter: Path, base_spec: str, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Base + adapter merged into a Fast_dLLM_v2 checkpoint directory (`--model out_dir` loads it).

    The engine applies adapters only to the bundled base; any other adapted model ships merged, and the
    paper's layout (training/fast_dllm_format.py) lets other tools read it too.
    """
    from engine.weights import apply_adapter, build_model, load_tokenizer, resolve_source

    from . import fast_dllm_format

    src = resolve_source(base_spec)
    model = apply_adapter(build_model(src.path, torch.device("cpu"), torch.float32), adapter)
    return fast_dllm_format.write(model, load_tokenizer(src.path, add_mask_token=True), out_dir, dtype)


def _checkpoint(run: Path, checkpoint: Path | None) -> Path:
    ckpt = checkpoint or latest_checkpoint(run)
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint in {run} (train first: python -m training train --run {run})")
    return ckpt


def is_full(run: Path, checkpoint: Path | None = None) -> bool:
    """Whether the run fine-tuned every weight (`train --full`)."""
    ckpt = checkpoint or latest_checkpoint(run)
    if ckpt is None or not ckpt.exists():
        return False
    sd = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)  # mmap: no tensor is read
    return bool(sd["config"].get("full", False))


def export_full(run: Path, out_dir: Path, checkpoint: Path | None = None, dtype: str = "bfloat16") -> Path:
    """A full fine-tuning checkpoint -> a Fast_dLLM_v2 checkpoint directory (training/full.py)."""
    from .full import export_checkpoint

    sd = torch.load(_checkpoint(run, checkpoint), map_location="cpu", weights_only=False)
    return export_checkpoint(sd, out_dir, dtype)
