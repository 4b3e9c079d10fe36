"""The block-diffusion adapter file: LoRA deltas, replaced tensors and the mask token's new embedding rows on top of
an AR base (the bundled model's dLLM), in one safetensors file whose metadata names its format and LoRA scale."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..model import CausalLM

MASK_TOKEN = "|<MASK>|"
ADAPTER_FORMAT = "fastdllm-adapter-v1"


class AdapterError(ValueError):
    """The adapter file cannot be read."""


def apply_adapter(base: CausalLM, adapter: Path, merge_lora: bool = True) -> CausalLM:
    """A new model: base + merged LoRA deltas + replaced tensors + new vocabulary rows (the mask token).

    Parameters the adapter does not touch are shared with `base`, so both fit in ~1.3x one model.
    merge_lora=False leaves the LoRA deltas out (engine/weights/quant.py runs them as a separate path).
    """
    with safe_open(str(adapter), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != ADAPTER_FORMAT:
        raise AdapterError(f"model: {adapter} is not a {ADAPTER_FORMAT} file")
    scale = float(meta.get("lora_scale", "1.0"))
    new_rows = tensors.pop("extend.model.embed_tokens.weight", None)
    cfg = ModelConfig(**{**{k: getattr(base.cfg, k) for k in base.cfg.__slots__},
                         "vocab_size": base.cfg.vocab_size + (0 if new_rows is None else new_rows.shape[0])})
    with torch.device("meta"):
        model = CausalLM(cfg)
    params = dict(base.named_parameters())
    dev, dt = params["model.embed_tokens.weight"].device, params["model.embed_tokens.weight"].dtype
    state = dict(params)
    if new_rows is not None:
        state["model.embed_tokens.weight"] = torch.cat([params["model.embed_tokens.weight"], new_rows.to(dev, dt)])
        if not cfg.tie_word_embeddings:
            state["lm_head.weight"] = torch.cat([params["lm_head.weight"], new_rows.new_zeros(new_rows.shape).to(dev, dt)])
    for key, t in tensors.items():
        kind, name = key.split(".", 1)
        if kind == "set":
            state[name] = t.to(dev, dt)
        elif kind == "lora_A" and merge_lora:
            b = tensors["lora_B." + name].float()
            state[name] = (params[name].float() + scale * (b @ t.float()).to(dev)).to(dt)
    state = {k: v.detach() for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta)
    return model.to(dev).eval().requires_grad_(False)


def read_adapter_tensors(adapter: Path | None) -> tuple[dict[str, torch.Tensor] | None, float]:
    """An adapter file's tensors and its lora_scale (None, 1.0 without a file)."""
    if adapter is None:
        return None, 1.0
    with safe_open(str(adapter), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, float((f.metadata() or {}).get("lora_scale", "1.0"))


def save_adapter(path: Path, *, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], sets: dict[str, torch.Tensor],
                 new_embed_rows: torch.Tensor | None, lora_scale: float, meta: dict[str, str] | None = None) -> None:
    """Write the adapter format apply_adapter reads: lora (A [r,in], B [out,r]) per weight name."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b) in lora.items():
        tensors["lora_A." + name] = a.detach().to(torch.bfloat16).contiguous()
        tensors["lora_B." + name] = b.detach().to(torch.bfloat16).contiguous()
    for name, t in sets.items():
        tensors["set." + name] = t.detach().float().contiguous()
    if new_embed_rows is not None:
        tensors["extend.model.embed_tokens.weight"] = new_embed_rows.detach().float().contiguous()
    md = {"format": ADAPTER_FORMAT, "lora_scale": str(lora_scale), "mask_token": MASK_TOKEN, **(meta or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=md)
