"""Log-likelihood of given tokens: lm-eval's in-process model and the server's `echo` share this one definition.

AR: the base model's ordinary causal likelihood. Diffusion: a block-diffusion LM has no causal factorisation of
its own, but it defines one exactly through its decoding order: committing one token at a time, left to right,
the probability of token q is read at q - 1 (token shift) with the clean prefix cached block by block and positions
q.. of q's block still masked. The product of those conditionals is a normalised distribution over sequences, so
the scores are exact under that left-to-right decoding policy. Cost: one forward of one block per scored token
(plus one commit forward per block), like decoding with cache=block and threshold=1.0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .loading import LoadedModel


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """log p(x_q | x_<q) of one scored token, whether it is the argmax, and the `top` most likely tokens."""

    logprob: float
    greedy: bool
    top: list[tuple[int, float]] = field(default_factory=list)


def _row(lm: LoadedModel, logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float().reshape(-1, logits.shape[-1])
    mask_id = lm.mask_token_id
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits[..., mask_id] = float("-inf")  # never an answer token, as in decoding
    return F.log_softmax(logits, dim=-1)


def _entry(lp: torch.Tensor, target: int, top: int) -> TokenLogprob:
    best = lp.topk(max(1, top))
    return TokenLogprob(float(lp[target]), int(best.indices[0]) == target,
                        [(int(i), float(v)) for i, v in zip(best.indices[:top], best.values[:top])])


@torch.inference_mode()
def token_logprobs(lm: LoadedModel, x: list[int], first: int, mode: str = "diffusion", block_size: int = 32,
                   top: int = 0) -> list[TokenLogprob]:
    """One entry per token x[first:], scored given everything before it (first >= 1)."""
    if not 1 <= first <= len(x):
        raise ValueError(f"first: must be in [1, {len(x)}] (got {first})")
    dev = next(lm.base.parameters()).device
    if mode == "ar":
        ids = torch.tensor([x], device=dev)
        pos = torch.arange(len(x), device=dev)[None]
        idx = torch.arange(first - 1, len(x) - 1, device=dev)[None]
        lp = _row(lm, lm.base(ids, pos, causal=True, logits_idx=idx))
        return [_entry(lp[j], x[first + j], top) for j in range(len(x) - first)]
    if lm.dllm is None or lm.mask_token_id is None:
        raise ValueError("mode: diffusion likelihood needs a model with a mask token; use mode 'ar'")
    return _diffusion(lm, x, first, block_size, top, dev)


def _diffusion(lm: LoadedModel, x: list[int], first: int, bs: int, top: int, dev: torch.device) -> list[TokenLogprob]:
    from .model import KVCache, block_causal_mask

    model, mask_id, n = lm.dllm, lm.mask_token_id, len(x)
    cache = KVCache(model.cfg, 1, -(-n // bs) * bs, dev, next(model.parameters()).dtype)
    seq = torch.tensor([x], device=dev)
    out: list[TokenLogprob] = []

    def take(logits: torch.Tensor, q: int) -> None:
        out.append(_entry(_row(lm, logits)[0], x[q], top))

    b0 = first // bs * bs
    if b0:  # clean prefix blocks, cached once; the last logit predicts position b0
        pos = torch.arange(b0, device=dev)[None]
        logits = model(seq[:, :b0], pos, cache, start=0, kv_len=b0, mask=block_causal_mask(pos, b0, bs),
                       logits_idx=torch.tensor([[b0 - 1]], device=dev))
        if first == b0:
            take(logits, b0)
    for start in range(b0, n, bs):
        end = start + bs
        pos = torch.arange(start, end, device=dev)[None]
        for q in range(max(first, start + 1), min(n, end)):
            win = torch.full((1, bs), mask_id, dtype=torch.long, device=dev)
            win[0, :q - start] = seq[0, start:q]
            logits = model(win, pos, cache, start=start, kv_len=end,
                           logits_idx=torch.tensor([[q - 1 - start]], device=dev))
            take(logits, q)
        if end < n:  # commit the clean block: its K/V for later blocks, its last logit for position `end`
            logits = model(seq[:, start:end], pos, cache, start=start, kv_len=end,
                           logits_idx=torch.tensor([[bs - 1]], device=dev))
            if end >= first:
                take(logits, end)
    return out
