"""A plain reference decoder for Fast-dLLM v2 (DESIGN.md section 3), the oracle of tests/test_oracle.py.

No scheduling, no batching tricks: one row at a time, and (cache "none") a full forward over the whole sequence
with an explicit block-causal mask at every step. It uses nothing of the engine but the model's forward
(CausalLM.__call__), and for the dual-cache rule the model's KVCache. It returns every forward's commits, so a
test can compare the engine step by step, not only the final text.

Rules, as the paper states them:
- blocks of `block_size` on a grid from absolute position 0; attention is block-causal;
- token shift: the token at position q is read from the logits at q - 1;
- a block's first position is never decoded by diffusion: it comes from the last logit of the previous (clean)
  block, one forward of its own (for a prompt that ends on a block boundary, the prefill is that forward);
- inside a block, sub-blocks of `sub_block_size` left to right; a step decodes the masked positions of the
  first sub-block that still has masks;
- threshold: commit every position with confidence > threshold, and always the most confident one;
  factor: sorted c1 >= c2 >= ..., the largest n with (n + 1) * (1 - c_n) < f, at least one;
- stop: the row ends when a stop token is committed with no mask before it (positions after the earliest
  committed stop token are never decoded), or when all max_new_tokens positions are committed; the answer
  runs through the stop token.
Greedy only (confidence = the softmax probability of the argmax; the mask token is never a candidate).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class OracleRun:
    steps: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)  # (kind, [(answer pos, token)])
    answer: list[int] = field(default_factory=list)  # through the stop token
    stop_reason: str = ""
    # per step, what a listener's Event shows beside the commits: (block index, sub-block index; -1 for a block's
    # first position), each commit's confidence, and the heatmap: [(answer pos, best token, confidence)] of the
    # positions the step scored and left masked (its sub-block's; a whole-block forward also the rest of the block)
    where: list[tuple[int, int]] = field(default_factory=list)
    confs: list[list[float]] = field(default_factory=list)
    masked: list[list[tuple[int, int, float]]] = field(default_factory=list)


def commit_rule(conf: list[float], strategy: str, threshold: float, factor: float) -> list[bool]:
    """Which candidates to commit, written from the paper's rule (independent of engine/sampling.py)."""
    best = max(range(len(conf)), key=lambda i: conf[i])
    if strategy == "threshold":
        chosen = [c > threshold for c in conf]
    else:
        order = sorted(range(len(conf)), key=lambda i: -conf[i])
        n = max([k for k in range(1, len(conf) + 1) if (k + 1) * (1 - conf[order[k - 1]]) < factor], default=0)
        chosen = [False] * len(conf)
        for i in order[:n]:
            chosen[i] = True
    chosen[best] = True
    return chosen


def _block_causal(n: int, bs: int) -> torch.Tensor:
    """[1, 1, n, n] boolean: query i may see key j when block(j) <= block(i)."""
    i = torch.arange(n)
    return ((i[None, :] // bs) <= (i[:, None] // bs))[None, None]


def _greedy(logits: torch.Tensor, mask_id: int) -> tuple[int, float]:
    logits = logits.float().clone()
    if mask_id < logits.shape[-1]:
        logits[mask_id] = float("-inf")
    p = torch.softmax(logits, dim=-1)
    return int(p.argmax()), float(p.max())


class _Row:
    """One sequence's state; step() runs one forward for it."""

    def __init__(self, model, prompt, mask_id, stop_ids, bs, sbs, threshold, strategy, factor, max_new_tokens, cache,
                 stop_guard=False):
        self.stop_guard = stop_guard
        self.model, self.mask_id, self.stop_ids, self.bs, self.sbs = model, mask_id, set(stop_ids), bs, sbs
        self.rule, self.cache = (strategy, threshold, factor), cache
        self.plen, self.limit = len(prompt), len(prompt) + max_new_tokens
        self.room = -(-self.limit // bs) * bs + bs
        self.seq = torch.full((1, self.room), mask_id, dtype=torch.long)
        self.seq[0, :self.plen] = torch.tensor(prompt)
        self.known = [True] * self.plen + [False] * max_new_tokens
        self.stop_at: int | None = None
        self.kv = None
        self.refreshed = None  # dual: (block start, sub-block) whose whole-block K/V were last written to kv
        self.last: list[int] = []  # positions the previous forward committed (dual-sparse recomputes their K/V)
        self.confs: list[list[float]] = []
        self.run = OracleRun()

    def masked(self) -> list[int]:
        """Positions still to decode: answer positions before the earliest committed stop token."""
        end = self.limit if self.stop_at is None else self.stop_at
        return [q for q in range(self.plen, end) if not self.known[q]]

    def plan(self) -> str:
        """'first' (a block's first position, from the previous block), 'sub' (dual, K/V fresh for this
        sub-block) or 'full' (a whole-block forward)."""
        q0 = self.masked()[0]
        start = q0 // self.bs * self.bs
        if q0 == start:
            return "first"
        k = (q0 - start) // self.sbs
        if self.cache == "dual-sparse" and self.refreshed is not None and self.refreshed[0] == start:
            return "sub"  # dual-sparse: one whole-block forward per block; later sub-blocks refresh sparsely
        return "sub" if self.cache == "dual" and self.refreshed == (start, k) else "full"

    def _commit(self, q: int, tok: int, out: list, conf: float = 1.0) -> None:
        self.confs[-1].append(conf)
        self.seq[0, q] = tok
        self.known[q] = True
        out.append((q - self.plen, tok))
        if tok in self.stop_ids and (self.stop_at is None or q < self.stop_at):
            self.stop_at = q

    def _full_forward(self, end: int) -> torch.Tensor:
        """Logits [end, V] of positions 0..end-1, block-causal, from scratch (dual: also refilling its K/V)."""
        pos = torch.arange(end)[None]
        if self.cache in ("dual", "dual-sparse"):
            from engine.model import KVCache
            self.kv = KVCache(self.model.cfg, 1, self.room, self.seq.device, next(self.model.parameters()).dtype)
            return self.model(self.seq[:, :end], pos, self.kv, start=0, kv_len=end, mask=_block_causal(end, self.bs))[0]
        return self.model(self.seq[:, :end], pos, mask=_block_causal(end, self.bs))[0]

    def window(self) -> tuple[int, int]:
        """A dual sub-block step's positions [a, b): from the logits that predict the sub-block's first position."""
        q0 = self.masked()[0]
        start = q0 // self.bs * self.bs
        lo = start + (q0 - start) // self.sbs * self.sbs
        return max(lo - 1, start), lo + self.sbs

    def step(self) -> None:
        bs, sbs = self.bs, self.sbs
        q0 = self.masked()[0]
        start = q0 // bs * bs
        kind, out, shown = self.plan(), [], []
        self.confs.append([])
        if kind == "first":
            tok, conf = _greedy(self._full_forward(q0)[q0 - 1], self.mask_id)
            self._commit(q0, tok, out, conf)
            self.refreshed = None
            self.run.where.append((q0 // bs, -1 if self.run.steps else 0))
        else:
            k = (q0 - start) // sbs
            lo = start + k * sbs
            cand = [q for q in self.masked() if lo <= q < lo + sbs]
            rest = [q for q in self.masked() if lo + sbs <= q < start + bs]  # the heatmap's rest of the block
            self.run.where.append((start // bs, k))
            if kind == "sub" and self.cache == "dual-sparse":
                # only the positions whose logits are read, those the previous forward committed (their K/V were
                # written with the mask as input) and the one left of each of those, over the K/V every other
                # position last got; a new sub-block's first step reaches back over the previous one's last commits
                a, b = self.window()
                if self.refreshed != (start, k):
                    a = max(start, min([a] + [q - 1 for q in self.last]))
                    self.refreshed = (start, k)
                need = sorted({q - 1 for q in cand if q - 1 >= a} | {q for q in self.last if a <= q < b}
                              | {q - 1 for q in self.last if a <= q - 1 < b})
                logits = self.model(self.seq[:, need], torch.tensor([need]), self.kv, kv_len=start + bs)[0]
                picks = [_greedy(logits[need.index(q - 1)], self.mask_id) for q in cand]
            elif kind == "sub":  # only the window [lo - 1, lo + sbs), over stale block K/V
                a, b = self.window()
                logits = self.model(self.seq[:, a:b], torch.arange(a, b)[None], self.kv, start=a, kv_len=start + bs)[0]
                picks = [_greedy(logits[q - 1 - a], self.mask_id) for q in cand]
            else:
                logits = self._full_forward(start + bs)
                self.refreshed = (start, k)
                picks = [_greedy(logits[q - 1], self.mask_id) for q in cand]
                shown = [(q - self.plen, *_greedy(logits[q - 1], self.mask_id)) for q in rest]
            # stop guard (the engine's option, not the paper's): candidates end at the first predicted stop token
            n = next((j + 1 for j, (tok, _) in enumerate(picks) if tok in self.stop_ids), len(picks)) \
                if self.stop_guard else len(picks)
            chosen = commit_rule([c for _, c in picks[:n]], *self.rule) + [False] * (len(picks) - n)
            for q, (tok, conf), yes in zip(cand, picks, chosen):
                if yes:
                    self._commit(q, tok, out, conf)
            shown = [(q - self.plen, tok, conf) for q, (tok, conf), yes in zip(cand, picks, chosen) if not yes] + shown
        self.last = [self.plen + pos for pos, _ in out]
        label = "prefill" if not self.run.steps else ("commit" if kind == "first" else "step")
        self.run.steps.append((label, out))
        self.run.confs.append(self.confs[-1])
        self.run.masked.append(shown)
        if not self.masked():
            end = self.limit if self.stop_at is None else self.stop_at + 1
            self.run.answer = [int(t) for t in self.seq[0, self.plen:end]]
            self.run.stop_reason = "max_new_tokens" if self.stop_at is None else "stop_token"


@torch.inference_mode()
def decode(model, prompts: list[list[int]], *, mask_id: int, stop_ids, block_size: int = 32, sub_block_size: int = 8,
           threshold: float = 0.9, strategy: str = "threshold", factor: float = 1.0, max_new_tokens: int = 32,
           cache: str = "none", stop_guard: bool = False) -> list[OracleRun]:
    """Decode prompts; one OracleRun each, every row alone (a batch must decode each row as it would alone: the
    engine's caches are tested against this, in batches). cache "none": each step from scratch (the engine's
    "none" and "block" caches must match it exactly). cache "dual": a step that does not start a sub-block runs
    only the window [lo - 1, lo + sub_block_size) over the K/V its sub-block's first (whole-block) step wrote, so
    the rest of the block's K/V are stale. cache "dual-sparse": such a step runs only the positions whose logits it
    reads, those the previous forward committed and the one left of each of those, and so does the first step of
    every sub-block after the block's first (its window reaching back over the previous forward's commits)."""
    rows = [_Row(model, p, mask_id, stop_ids, block_size, sub_block_size, threshold, strategy, factor,
                 max_new_tokens, cache, stop_guard) for p in prompts]
    for r in rows:
        while r.masked():
            r.step()
    return [r.run for r in rows]


@torch.inference_mode()
def decode_ar(model, prompt: list[int], *, stop_ids, max_new_tokens: int, mask_id: int | None = None) -> list[int]:
    """Greedy AR with a full causal forward per token (no cache)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        x = torch.tensor([ids])
        logits = model(x, torch.arange(len(ids))[None], causal=True)[0, -1]
        tok, _ = _greedy(logits, mask_id if mask_id is not None else logits.shape[-1])
        ids.append(tok)
        if tok in stop_ids:
            break
    return ids[len(prompt):]
