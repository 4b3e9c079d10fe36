"""Per-row sampling and confidence, and the Fast-dLLM v2 rules that pick which masks to commit."""
from __future__ import annotations

import torch
from torch import Tensor


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Tokens and their probabilities for logits [..., V]; greedy when temperature == 0.

    Confidence is the probability of the chosen token under the (tempered, top-p filtered) distribution,
    computed per row: every row has its own nucleus (the reference used row 0's for all rows).
    """
    logits = logits.float()
    if temperature <= 0:
        probs = torch.softmax(logits, dim=-1)
        conf, tok = probs.max(dim=-1)
        return tok, conf
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    flat = probs.reshape(-1, probs.shape[-1])
    tok = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    conf = probs.gather(-1, tok[..., None]).squeeze(-1)
    return tok, conf


def select_commits(conf: Tensor, strategy: str, threshold: float, factor: float) -> Tensor:
    """Boolean mask over candidate positions (1-D confidences) of those to commit this step.

    threshold: every confidence above the threshold, and always the most confident one.
    factor: sorted c1 >= c2 >= ..., the largest n with (n + 1) * (1 - c_n) < f, at least one.
    """
    n = conf.numel()
    chosen = torch.zeros(n, dtype=torch.bool, device=conf.device)
    if n == 0:
        return chosen
    if strategy == "threshold":
        chosen = conf > threshold
    else:
        sorted_c, order = conf.sort(descending=True)
        ranks = torch.arange(1, n + 1, device=conf.device, dtype=conf.dtype)
        ok = (ranks + 1) * (1 - sorted_c) < factor
        # largest n such that the condition holds for that n (the rule is evaluated at n, not as a prefix)
        k = int(torch.nonzero(ok).max()) + 1 if bool(ok.any()) else 0
        chosen[order[:k]] = True
    chosen[conf.argmax()] = True
    return chosen
