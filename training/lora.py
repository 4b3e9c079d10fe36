"""Hand-written LoRA for engine.model.CausalLM, plus the trainable mask-token embedding row.

~40 lines instead of peft: our model is a plain nn.Module with its own forward, and the export format
(engine.weights.save_adapter) wants A/B per weight name, which these modules hold directly.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """y = W x + scale * B A x, with W frozen; B starts at zero so training starts from the base. `off` (adapter_off):
    y = W x, the base alone (the teacher of --distill-kl)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gen: torch.Generator):
        super().__init__()
        self.base, self.scale, self.off = base, alpha / rank, False
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming-uniform(a=sqrt 5), as nn.Linear and peft
        a = (torch.rand(rank, base.in_features, generator=gen) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a.to(base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x: Tensor) -> Tensor:
        if self.off:
            return self.base(x)
        # scale folded into B: one small multiply instead of one over the whole [tokens, out] activation
        return self.base(x) + F.linear(F.linear(x, self.lora_A.to(x.dtype)), (self.lora_B * self.scale).to(x.dtype))


@contextmanager
def adapter_off(model: nn.Module):
    """Inside: every LoRALinear of `model` (any wrapper around it) computes its base alone. The mask-token row
    stays (the teacher never reads it: causal positions before an answer's end see no mask token)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not layers:
        raise ValueError("adapter_off: the model has no LoRA layers (the base is not separable from the weights)")
    for m in layers:
        m.off = True
    try:
        yield
    finally:
        for m in layers:
            m.off = False


class ExtendedEmbedding(nn.Module):
    """The frozen vocabulary with trainable rows for ids [first, first + n), e.g. |<MASK>|.

    first == the base vocabulary size appends rows (SmolLM2); first < it overrides spare rows of a
    padded embedding (Qwen2.5's |<MASK>| is 151665 of 151936 rows).
    """

    def __init__(self, base: nn.Embedding, new_rows: Tensor, first: int):
        super().__init__()
        if first > base.num_embeddings:
            raise ValueError(f"new token id {first} leaves a gap after the {base.num_embeddings} embedding rows")
        self.base, self.first = base, first
        self.new = nn.Parameter(new_rows.clone())

    def forward(self, ids: Tensor) -> Tensor:
        x = self.base(ids.clamp(max=self.base.num_embeddings - 1))
        rel = ids - self.first
        extra = (rel >= 0) & (rel < self.new.shape[0])
        if self.new.shape[0] == 1:
            # one new row (|<MASK>|): broadcast it. Indexing it with the [batch, tokens] id tensor made the
            # backward an index_put accumulate of every token onto one row: 51 ms of a 573 ms step on an H100
            # (GPU block 2's profile); a broadcast's backward is a sum.
            return torch.where(extra[..., None], self.new[0].to(x.dtype), x)
        return torch.where(extra[..., None], F.embedding(rel.clamp(0, self.new.shape[0] - 1), self.new).to(x.dtype), x)


def add_adapter(model: nn.Module, rank: int, alpha: float, seed: int, train_norms: bool = False,
                new_token_id: int | None = None, new_tokens: int = 1) -> list[str]:
    """Wrap every target Linear with LoRA, give the new token(s) a trainable row; returns trainable names.

    new_token_id defaults to the next row after the vocabulary. The rows start at the mean
    embedding: an "average token" the model already reads sensibly.
    """
    gen = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if child_name in TARGETS and isinstance(child, nn.Linear):
                setattr(mod, child_name, LoRALinear(child, rank, alpha, gen))
    emb = model.model.embed_tokens
    rows = emb.weight.detach().float().mean(0, keepdim=True).repeat(new_tokens, 1)
    first = emb.num_embeddings if new_token_id is None else new_token_id
    model.model.embed_tokens = ExtendedEmbedding(emb, rows, first)
    for name, p in model.named_parameters():
        trainable = name.endswith(("lora_A", "lora_B", "embed_tokens.new")) or (train_norms and name.endswith("norm.weight"))
        if trainable and p.dtype != torch.float32:
            p.data = p.data.float()  # master copies (and AdamW state) in fp32 over a bf16 base
        p.requires_grad_(trainable)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def adapter_tensors(state: dict[str, Tensor]) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, Tensor], Tensor | None]:
    """Trainable state -> (lora {weight name: (A, B)}, sets {name: tensor}, new embedding rows)."""
    lora, sets, new = {}, {}, None
    for name, t in state.items():
        if name.endswith(".lora_A"):
            mod = name[: -len(".lora_A")]
            lora[mod + ".weight"] = (t, state[mod + ".lora_B"])
        elif name.endswith(".lora_B"):
            continue
        elif name == "model.embed_tokens.new":
            new = t
        else:
            sets[name] = t
    return lora, sets, new
