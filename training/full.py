"""Full fine-tuning (the paper's setting): every weight trainable, the mask token a real embedding row.

LoRA (training/lora.py) keeps the base frozen and ships a small adapter; full fine-tuning changes every
tensor, so its result ships as a whole Fast_dLLM_v2 checkpoint (training/fast_dllm_format.py). The model
stays a plain engine.model.CausalLM (no wrapper modules), so its state dict is already in the checkpoint's
names and FSDP can shard it layer by layer.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.model import CausalLM


def make_full(model: CausalLM, mask_id: int) -> list[str]:
    """All parameters trainable in fp32 (the AdamW masters; bf16 compute comes from autocast).

    A mask id past the embedding (SmolLM2: 49152 of 49152 rows) gets a new row, initialised as the mean
    embedding as the LoRA path does; a spare row of a padded embedding (Qwen2.5: 151665 of 151936) is
    trained in place. Returns the trainable parameter names.
    """
    emb = model.model.embed_tokens
    extra = mask_id + 1 - emb.num_embeddings
    if extra > 1:
        raise ValueError(f"mask token id {mask_id} leaves a gap after the {emb.num_embeddings} embedding rows")
    if extra == 1:
        w = emb.weight.detach()
        new = nn.Embedding(emb.num_embeddings + 1, emb.embedding_dim, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight[:-1] = w
            new.weight[-1] = w.float().mean(0).to(w.dtype)
        model.model.embed_tokens = new
        head = nn.Linear(model.cfg.hidden_size, new.num_embeddings, bias=False, device=w.device, dtype=w.dtype)
        if model.cfg.tie_word_embeddings:
            head.weight = new.weight
        else:  # the mask token is never a target: a zero output row, as engine.weights.apply_adapter adds
            with torch.no_grad():
                head.weight.zero_()
                head.weight[:-1] = model.lm_head.weight.detach()
        model.lm_head = head
        model.cfg.vocab_size = new.num_embeddings
    for p in model.parameters():
        p.data = p.data.float()
        p.requires_grad_(True)
    return [n for n, _ in model.named_parameters()]


def export_checkpoint(sd: dict, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """A full fine-tuning checkpoint (training.train's format, `config["full"]`) -> a Fast_dLLM_v2 directory."""
    from engine.weights import MASK_TOKEN, build_model, load_tokenizer, resolve_source

    from . import fast_dllm_format

    src = resolve_source(sd["config"]["model"])
    tok = load_tokenizer(src.path, add_mask_token=True)
    model = build_model(src.path, torch.device("cpu"), torch.float32)
    names = make_full(model, tok.get_vocab()[MASK_TOKEN])
    if set(names) != set(sd["trainable"]):
        raise ValueError(f"export: the checkpoint's tensors do not match {src.spec} under full fine-tuning")
    model.load_state_dict({n: t.float() for n, t in sd["trainable"].items()}, strict=False)
    return fast_dllm_format.write(model.eval(), tok, out_dir, dtype)
