"""Per-row sampling and confidence, and the Fast-dLLM v2 rules that pick which masks to commit."""
from __future__ import annotations

import torch
from torch import Tensor


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Tokens and their probabilities for logits [..., V]; greedy when temperature == 0.

    Confidence is the probability of the chosen token under the (tempered, top-p filtered) distribution,
    computed per row: every row has its own nucleus (the reference used row 0's for all rows).
    """
    probs = distribution(logits, temperature, top_p)
    if temperature <= 0:
        conf, tok = probs.max(dim=-1)
        return tok, conf
    flat = probs.reshape(-1, probs.shape[-1])
    tok = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    conf = probs.gather(-1, tok[..., None]).squeeze(-1)
    return tok, conf


def distribution(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """The probabilities a token is committed from: softmax of the logits (greedy: untempered; sampling: divided
    by the temperature, then cut to the top-p nucleus and renormalised)."""
    logits = logits.float()
    if temperature <= 0:
        return torch.softmax(logits, dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def alternatives(logits: Tensor, temperature: float, top_p: float, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely tokens of each position's commit distribution (the one `sample` draws from and reads
    confidence in): (ids, natural-log probabilities), most likely first. A token outside the top-p nucleus has
    probability 0: its log-probability is LOGPROB_FLOOR, as vLLM writes it, not -inf (JSON has no infinity); when
    the nucleus holds fewer than k tokens, the next ones are the most likely outside it under the tempered
    distribution (ranked, not drawn at random among equal floors)."""
    probs = distribution(logits, temperature, top_p)
    lp = probs.log().clamp_min(LOGPROB_FLOOR)
    if temperature <= 0 or top_p >= 1.0:
        best = lp.topk(k, dim=-1)
        return best.indices, best.values
    rank = torch.where(probs > 0, 2.0 + probs, torch.softmax(logits.float() / temperature, dim=-1))
    idx = rank.topk(k, dim=-1).indices
    return idx, lp.gather(-1, idx)


LOGPROB_FLOOR = -9999.0


def row_alternatives(logits: Tensor, tops: list[int], temperature: float,
                     top_p: float) -> list[tuple[list, list] | None] | None:
    """top_logprobs of a batch: for each row b with tops[b] > 0, the alternatives at every position of logits
    ([B, n, V] or [B, V]) as host lists (ids, logprobs) per position; None for the other rows, and None when no
    row asks (the default: nothing computed)."""
    want = [b for b, k in enumerate(tops) if k]
    if not want:
        return None
    x = logits if logits.dim() == 3 else logits[:, None]
    ids, lps = alternatives(x[torch.tensor(want, device=x.device)], temperature, top_p, max(tops[b] for b in want))
    out: list[tuple[list, list] | None] = [None] * len(tops)
    for b, i, v in zip(want, ids.cpu().tolist(), lps.double().cpu().tolist()):
        out[b] = (i, v)
    return out


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
