"""Repetition knobs on candidate logits: repetition, frequency and presence penalties, and no-repeat n-grams.

Semantics (the same numbers as the libraries people know them from):
  * repetition_penalty p (transformers' RepetitionPenaltyLogitsProcessor, vLLM's apply_penalties): for every
    token id present in the context, i.e. the prompt plus the answer so far (both libraries use prompt +
    output), logit < 0 -> logit * p, else logit / p. 1 = off.
  * frequency_penalty f, presence_penalty r (OpenAI's definition, as vLLM implements it): over the answer's
    tokens only, logit -= f * count(token); then logit -= r * (count(token) > 0). 0 = off.
    vLLM applies repetition first, then frequency, then presence, all before temperature; so do we.
  * no_repeat_ngram_size n (transformers' NoRepeatNGramLogitsProcessor): never produce an n-gram already in
    prompt + answer (transformers bans over the whole input_ids, prompt included): a banned token's logit is -inf.
References: transformers/src/transformers/generation/logits_process.py (RepetitionPenaltyLogitsProcessor:
`torch.where(score < 0, score * penalty, score / penalty)` over input_ids; NoRepeatNGramLogitsProcessor and
_get_ngrams); vLLM vllm/model_executor/layers/utils.py apply_penalties (`logits -= frequency_penalties *
output_bin_counts; logits -= presence_penalties * output_mask`).

Block diffusion (where these libraries have no answer; our choices):
  * "The answer so far" is every committed answer position, in any order: a token committed to the right of a
    still-masked position counts too. Every candidate (masked) position a step scores is penalised, before
    confidence and sampling, so a penalty changes both the token and its confidence, hence what the threshold
    commits.
  * no_repeat_ngram_size: transformers looks only at the n-1 tokens before the next position, which is all that
    is known in left-to-right decoding. A diffusion candidate q can also complete an n-gram with committed tokens
    on its right, and two candidates committed in the same step can together form one, so the prefix rule alone
    lets repeats through. So, for a candidate q, every window of n positions containing q whose other n-1
    positions are all known (prompt or committed) bans the tokens that would make it equal an existing n-gram
    (or equal another new window through q); and after the unmasking rule picks a step's commits, they are
    accepted in order of confidence, and one that would now form a repeated n-gram with another of the step's
    commits stays masked for the next step (the most confident is always safe, so every step still commits).
    In AR decoding only the prefix window is ever complete: exactly transformers' rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .config import DecodeConfig


@dataclass(frozen=True, slots=True)
class Penalties:
    """One row's repetition settings (a batch may mix them: see Decoder.new_rows)."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    no_repeat_ngram: int = 0

    @classmethod
    def of(cls, cfg: "DecodeConfig") -> "Penalties":
        return cls(float(cfg.repetition_penalty), float(cfg.frequency_penalty), float(cfg.presence_penalty),
                   int(cfg.no_repeat_ngram_size))

    @property
    def scales(self) -> bool:
        """Any of the three logit-shifting penalties is on."""
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    @property
    def active(self) -> bool:
        return self.scales or self.no_repeat_ngram > 0


OFF = Penalties()


def _bins(ids: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """counts[r, t] = occurrences of token t in ids[r] (ids outside the vocab ignored), float32."""
    counts = torch.zeros((len(ids), vocab), dtype=torch.float32, device=device)
    flat = [(r, t) for r, row in enumerate(ids) for t in row if 0 <= t < vocab]
    if flat:
        idx = torch.tensor(flat, dtype=torch.long, device=device)
        counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(flat), device=device), accumulate=True)
    return counts


def apply_scales(logits: Tensor, prompt: list[list[int]], answer: list[list[int]], pens: list[Penalties]) -> Tensor:
    """Repetition, frequency and presence penalties on logits [R, N, V] (N candidate positions of row r share its
    context); prompt[r] and answer[r] are row r's prompt and committed answer token ids. Returns new float32 logits.
    A row whose settings are off comes back unchanged, bit for bit (x / 1, x * 1 and x - 0 are exact)."""
    logits = logits.float()
    r, _, v = logits.shape
    dev = logits.device
    col = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)[:, None, None]  # noqa: E731
    out_counts = _bins(answer, v, dev)[:, None]  # [R, 1, V]
    if any(p.repetition != 1.0 for p in pens):
        seen = (_bins(prompt, v, dev)[:, None] > 0) | (out_counts > 0)
        rep = col([p.repetition for p in pens])
        logits = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
    if any(p.frequency != 0.0 for p in pens):
        logits = logits - col([p.frequency for p in pens]) * out_counts
    if any(p.presence != 0.0 for p in pens):
        logits = logits - col([p.presence for p in pens]) * (out_counts > 0).float()
    return logits


class NgramIndex:
    """The complete n-grams among one row's known tokens (prompt + committed answer), kept up to date as tokens
    commit in any order; answers which tokens a masked position may not take (see the module docstring).

    Each n-position window is indexed once, when its last unknown position becomes known: O(n) per commit, and a
    position's banned set costs O(n^2) dict lookups, whatever the answer's length."""

    def __init__(self, n: int, prompt: list[int], length: int):
        if n < 1:
            raise ValueError(f"no_repeat_ngram_size: must be >= 1 here (got {n})")
        self.n = n
        self.tok: list[int | None] = list(prompt) + [None] * max(0, length - len(prompt))
        self.grams: set[tuple[int, ...]] = set()
        # holes[j][other n-1 tokens of a window, in order] = the tokens seen at offset j of such windows
        self.holes: list[dict[tuple[int, ...], set[int]]] = [{} for _ in range(n)]
        for s in range(len(prompt) - n + 1):
            self._index(s)

    def _window(self, s: int) -> tuple | None:
        if s < 0 or s + self.n > len(self.tok):
            return None
        w = tuple(self.tok[s:s + self.n])
        return None if None in w else w  # type: ignore[return-value]

    def _index(self, s: int) -> None:
        w = self._window(s)
        if w is None or w in self.grams:
            return
        self.grams.add(w)
        for j in range(self.n):
            self.holes[j].setdefault(w[:j] + w[j + 1:], set()).add(w[j])

    def add(self, q: int, t: int) -> None:
        """Position q now holds token t (idempotent)."""
        if q >= len(self.tok):
            self.tok += [None] * (q + 1 - len(self.tok))
        if self.tok[q] == t:
            return
        self.tok[q] = t
        for s in range(q - self.n + 1, q + 1):
            self._index(s)

    def _open_windows(self, q: int) -> list[tuple[int, list]]:
        """(offset of q, window tokens with q's slot None) for each window through q whose other tokens are known."""
        out = []
        for j in range(self.n):
            s = q - j
            if s < 0 or s + self.n > len(self.tok):
                continue
            w = self.tok[s:s + self.n]
            w[j] = None
            if w.count(None) == 1:
                out.append((j, w))
        return out

    def banned(self, q: int) -> set[int]:
        """Tokens that, at still-unknown position q, would form an n-gram already present, or two equal new ones."""
        if q < len(self.tok) and self.tok[q] is not None:
            return set()
        if q >= len(self.tok):
            self.tok += [None] * (q + 1 - len(self.tok))
        out: set[int] = set()
        wins = self._open_windows(q)
        for j, w in wins:
            out |= self.holes[j].get(tuple(w[:j] + w[j + 1:]), set())
        for a, (j1, w1) in enumerate(wins):  # two new windows through q made equal by q's token t:
            for j2, w2 in wins[a + 1:]:  # then t = w2[j1] = w1[j2] and the rest agree
                t = w2[j1]
                if w1[j2] == t and all(x == y for k, (x, y) in enumerate(zip(w1, w2)) if k not in (j1, j2)):
                    out.add(t)
        return out

    def creates_repeat(self, q: int, t: int) -> bool:
        """Would token t at unknown position q form an n-gram that is already present (or twice at once)?"""
        new = [tuple(w[:j] + [t] + w[j + 1:]) for j, w in self._open_windows(q)]
        return any(g in self.grams for g in new) or len(set(new)) < len(new)


def ban(logits: Tensor, bans: list[tuple[int, int, set[int]]]) -> Tensor:
    """logits[r, j, t] = -inf for every (r, j, tokens) in bans (in place; logits float)."""
    flat = [(r, j, t) for r, j, ts in bans for t in ts if 0 <= t < logits.shape[-1]]
    if flat:
        idx = torch.tensor(flat, dtype=torch.long, device=logits.device)
        logits[idx[:, 0], idx[:, 1], idx[:, 2]] = float("-inf")
    return logits
