"""Fast-dLLM v2 block diffusion over one batch.

Block grid from absolute position 0; token shift (position q is read from the logits at q - 1);
sub-blocks decoded left to right with confidence-thresholded parallel commits; after a block has no
masks, one commit forward writes its clean K/V and yields the next block's first token.
Cache modes: none (recompute the prefix), block (cached committed blocks), dual (also reuse the
active block's K/V: a refresh forward at each new sub-block, then forwards of the sub-block only), dual-sparse
(dual whose forwards between a block's first and its commit compute only the rows they need: `_plan`).
In a batch every row runs the forward it would run alone (`_forwards`: rows grouped by their forward's width).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import DecodeConfig
from ..events import Token
from ..model import block_causal_mask
from ..sampling import row_alternatives, select_commits
from .base import Decoder
from .rows import Batch, Row


# A row's next forward: kind ('commit', 'block', 'sub', 'refresh'), window start and end, and for dual-sparse steps the
# positions it computes (None: the whole window)
Plan = tuple[str, int, int, "list[int] | None"]


class DiffusionDecoder(Decoder):
    """Block diffusion with the confidence threshold (or factor rule) inside sub-blocks; cache none, block, dual or
    dual-sparse."""

    @property
    def block(self) -> int:  # type: ignore[override]
        return self.cfg.block_size

    def _fill_id(self) -> int:
        return self.mask_id if self.mask_id is not None else 0

    @staticmethod
    def caches(cfg: DecodeConfig) -> bool:
        return cfg.cache != "none"

    def _prompt_mask(self, pos: Tensor, k_len: int) -> Tensor:
        return block_causal_mask(pos, k_len, self.cfg.block_size)

    def _prefill_rows(self, batch: Batch, prompts: list[list[int]], cached: int = 0) -> None:
        self._prefill_diffusion(batch, cached)

    def open_batch(self, prompts: list[list[int]], rows: list[Row]) -> Batch:
        if self.mask_id is None:
            raise ValueError("mode: this model has no mask token |<MASK>|, so it cannot decode by "
                             "block diffusion; use mode 'ar'")
        if self.cfg.cache == "dual-sparse" and self.stepper is not None:
            raise ValueError("cache: 'dual-sparse' runs on the dynamic path only (its forwards have no static width); "
                             "use 'dual', or FASTDLLM_STATIC=0")
        return super().open_batch(prompts, rows)

    def _step_rows(self, batch: Batch) -> int:
        return self._step_diffusion(batch)

    def _prefill_diffusion(self, batch: Batch, cached: int = 0) -> None:
        # Prefill: whole prompt blocks, plus the partial block (prompt tail + masks) when there is one, which
        # makes the prefill also the first decoding step of that block. With `cached` (whole blocks already in the
        # cache: chunked prefill), the forward starts there; the block-causal rule is the same.
        rows, bs = batch.rows, self.cfg.block_size
        for r in rows:
            r.block_start = r.prompt_len // bs * bs
        ends = [r.block_start + (bs if r.prompt_len % bs else 0) for r in rows]
        width = max(ends)
        pos = torch.arange(cached, width, device=self.device)[None].expand(len(rows), -1)
        valid = torch.tensor(ends, device=self.device)
        mask = block_causal_mask(pos, width, bs, valid)
        targets = [self._targets(r, cached, e, full=True) for r, e in zip(rows, ends)]
        logits = self.model(batch.seq[:, cached:width], pos, batch.cache, start=cached, kv_len=width, mask=mask,
                            logits_idx=self._idx(targets, [cached] * len(rows)))
        # an aligned prompt's prefill covers whole prompt blocks only: the new block's K/V are not there yet
        self._after_forward("prefill", rows, batch.seq, targets, logits, [r.prompt_len % bs != 0 for r in rows])

    def _step_diffusion(self, batch: Batch) -> int:
        plan = [self._plan(r) for r in batch.rows]  # (kind, window start, window end, rows) of each row's own forward
        forwards = self._forwards(plan)
        for at, width in forwards:
            self._forward(batch, at, [plan[b] for b in at], width)
        return len(forwards)

    def _forwards(self, plan: list[Plan]) -> list[tuple[list[int], int]]:
        """The batching policy: which rows share a forward (batch indices), and its window width.

        A row must get the forward it would get alone: with the dual cache, a whole-block forward (the refresh at a
        new sub-block, or the commit) rewrites the block's K/V, so a row refreshed because another row needed it
        decodes on other K/V than alone, and its answer can change. So the rows are grouped by the width of their
        own forward: whole block, sub-block + the token before it, or (the first sub-block) the sub-block alone;
        one forward per group, at most three a step, none of them with padded work. On the static path (CUDA
        graphs) the step is one forward at its static width, each row's narrower window padded with pads that
        write only the trash slot: there one launch over padded rows costs less than several.
        The none and block caches run whole blocks for every row: always one forward."""
        every = list(range(len(plan)))
        if self.cfg.cache == "none":
            return [(every, max(e for _, _, e, _ in plan))]  # each row over its prefix, up to the longest one's block end
        widths = [len(at) if at is not None else e - s for _, s, e, at in plan]
        if self.stepper is not None:
            return [(every, max(widths))]
        groups: dict[int, list[int]] = {}
        for b, w in enumerate(widths):
            groups.setdefault(w, []).append(b)
        return [(at, w) for w, at in sorted(groups.items(), reverse=True)]

    def _forward(self, batch: Batch, at: list[int], plan: list[Plan], width: int) -> None:
        """One forward for the rows `at` of the batch, each over its own window of its plan (padded to `width` on
        the static path only; dual-sparse: over its plan's positions), and their commits. Rows not in `at` are
        untouched: the forward reads and writes only its rows of the cache."""
        cfg, bs = self.cfg, self.cfg.block_size
        rows = [batch.rows[b] for b in at]
        every = len(at) == len(batch.rows)
        rows_t = None if every else torch.tensor(at, device=self.device)
        seq = batch.seq if rows_t is None else batch.seq.index_select(0, rows_t)
        ends = [r.block_start + bs for r in rows]  # every key before the active block's end is visible
        if cfg.cache == "none":  # the whole prefix from scratch, block-causal
            starts = [0] * len(rows)
            pos = torch.arange(width, device=self.device)[None].expand(len(rows), -1)
            mask = block_causal_mask(pos, width, bs, torch.tensor(ends, device=self.device))
        else:
            starts = [s for _, s, _, _ in plan]
            if any(p is not None for *_, p in plan):  # dual-sparse sub-block steps: each row's own positions
                listed = [p if p is not None else list(range(s, s + width)) for _, s, _, p in plan]
                pos = torch.tensor(listed, device=self.device)
                same = False
            else:
                pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)[None]
                same = all(a == starts[0] for a in starts)  # (then the ends are equal too: one block)
            kv_len = max(ends)
            mask = None if same else (torch.arange(kv_len, device=self.device)[None, None, None]
                                      < torch.tensor(ends, device=self.device)[:, None, None, None])
        # the clean block's last logit gives the next block's first token; else the masked positions to decode
        # (a row's targets are read only inside its own window, never from a static path's pads)
        targets = [([r.block_start + bs] if r.block_start + bs < r.limit else []) if kind == "commit"
                   else self._targets(r, a, a + (width if cfg.cache == "none" else e - s), full=kind == "block")
                   for r, (kind, s, e, _), a in zip(rows, plan, starts)]
        if cfg.cache == "none" or all(p is None for *_, p in plan):
            idx = self._idx(targets, starts)
        else:  # where each target's logits sit among the row's forward positions
            idx = self._idx_at(targets, listed)
        if cfg.cache == "none":
            logits = self.model(seq[:, :width], pos, None, mask=mask, logits_idx=idx)
        elif self.stepper is not None:  # static widths: the block, or the sub-block + 1 (see engine/static.py)
            sub = all(kind == "sub" for kind, *_ in plan)
            logits = self._step(seq.gather(1, pos), pos, batch.cache, start=None, ends=ends, mask=None,
                                logits_idx=idx, width=cfg.sub_block_size + 1 if sub else bs,
                                lengths=[e - a for _, a, e, _ in plan])
        else:  # a part of the batch addresses its own cache rows (CausalLM.forward's cache_rows)
            logits = self._step(seq.gather(1, pos), pos, batch.cache, start=starts[0] if same else None, ends=ends,
                                mask=mask, logits_idx=idx, width=width, cache_rows=rows_t)
        kinds = [kind for kind, *_ in plan]
        self._after_forward(kinds, rows, batch.seq, targets, logits, [kind != "sub" for kind in kinds], at)

    def _masked(self, r: Row, lo: int, hi: int) -> list[int]:
        """Still-masked answer positions in [lo, hi), never past an earlier committed stop token."""
        hi = min(hi, r.limit, r.stop_at if r.stop_at is not None else hi)
        return [q for q in range(max(lo, r.prompt_len), hi) if r.answer[q - r.prompt_len] is None]

    def _active_sub(self, r: Row) -> int:
        sbs = self.cfg.sub_block_size
        first = self._masked(r, r.block_start, r.block_start + self.cfg.block_size)[0]
        return (first - r.block_start) // sbs

    def _plan(self, r: Row) -> Plan:
        """What this row's next forward is: 'commit', a whole-block 'block' step, a dual 'sub' step, or a dual-sparse
        'refresh' (a new sub-block's first step); over the window [start, end), or (dual-sparse) only over the listed
        positions.

        dual-sparse: a sub step computes the positions whose logits it reads (the one before each masked position),
        the tokens the row's previous forward committed (their K/V were computed with the mask as input) and the
        token left of each of those (its nearest context changed); the other committed tokens of the sub-block keep
        the K/V of their last forward, as the masked positions right of the sub-block already do in the dual cache.
        `dual` recomputes the whole sub-block window every step. (Without the left neighbours: 1.16x cheaper forwards
        instead of 1.13x, and 11 fewer of 309 short answers right instead of 5: bench/results/dual_sparse.)
        A new sub-block after the block's first is refreshed by the same rule, its window reaching back over the
        tokens the previous sub-block's last step committed, instead of a whole-block forward (`dual` refreshes the
        whole block at every sub-block): bench/results/sparse_refresh."""
        bs, sbs = self.cfg.block_size, self.cfg.sub_block_size
        if not self._masked(r, r.block_start, r.block_start + bs):
            return "commit", r.block_start, r.block_start + bs, None
        k = self._active_sub(r)
        sparse = self.cfg.cache == "dual-sparse"
        # the block's first whole-block forward writes every position's K/V; dual-sparse refreshes later sub-blocks
        # sparsely (below), dual with another whole-block forward
        whole = r.refreshed_sub != k and not (sparse and r.refreshed_sub >= 0)
        if self.cfg.cache not in ("dual", "dual-sparse") or whole:
            return "block", r.block_start, r.block_start + bs, None
        lo = r.block_start + k * sbs
        start, end = max(lo - 1, r.block_start), lo + sbs  # lo - 1: the logits that predict position lo
        if not sparse:
            return "sub", start, end, None
        kind = "sub"
        if r.refreshed_sub != k:  # a new sub-block: its step, and the previous sub-block's tokens just committed
            kind, start = "refresh", max(r.block_start, min([start] + [q - 1 for q in r.fresh]))
        need = {q - 1 for q in self._masked(r, lo, end)} | {q for q in r.fresh if start <= q < end} \
            | {q - 1 for q in r.fresh if start <= q - 1 < end}
        return kind, start, end, sorted(q for q in need if q >= start)

    def _draws(self, r: Row, kind: str, targets: list[int]) -> int:
        """How many of a row's targets are commit candidates (sampled from the row's generator): all but the
        heatmap's extra positions past the active sub-block, which only a listener asks for and which must not
        use up the row's random numbers (else watching a sampled decode would change it)."""
        if kind == "commit" or not targets:
            return len(targets)
        end = r.block_start + (self._active_sub(r) + 1) * self.cfg.sub_block_size
        return sum(q < end for q in targets)

    def _targets(self, r: Row, a: int, b: int, full: bool) -> list[int]:
        """Masked positions q to read logits for (at q - 1, inside the window [a, b))."""
        bs, sbs = self.cfg.block_size, self.cfg.sub_block_size
        if not self._masked(r, r.block_start, r.block_start + bs):
            return []
        lo = r.block_start + self._active_sub(r) * sbs
        sub = self._masked(r, lo, lo + sbs)
        extra = []
        if self._listening(r) and full:  # the heatmap wants every masked position of the block
            extra = [q for q in self._masked(r, r.block_start, r.block_start + bs) if q >= lo + sbs]
        return [q for q in sub + extra if a <= q - 1 < b]

    def _idx(self, targets: list[list[int]], starts: list[int]) -> Tensor:
        n = max(1, max(len(t) for t in targets))
        rows = [[q - 1 - a for q in t] + [0] * (n - len(t)) for t, a in zip(targets, starts)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _idx_at(self, targets: list[list[int]], positions: list[list[int]]) -> Tensor:
        """Like _idx, for forwards over listed positions: the index of q - 1 among each row's positions."""
        n = max(1, max(len(t) for t in targets))
        where = [{p: i for i, p in enumerate(ps)} for ps in positions]
        rows = [[w[q - 1] for q in t] + [0] * (n - len(t)) for t, w in zip(targets, where)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _after_forward(self, kinds, rows: list[Row], seq: Tensor, targets: list[list[int]], logits: Tensor,
                       refreshed: list[bool], at: list[int] | None = None) -> None:
        """Sample and commit; rows[b] is row at[b] of seq (default b)."""
        cfg, bs, sbs = self.cfg, self.cfg.block_size, self.cfg.sub_block_size
        at = at if at is not None else list(range(len(rows)))
        kinds = [kinds] * len(rows) if isinstance(kinds, str) else kinds
        logits = self._penalised(rows, logits, targets)
        tok, conf = self._sample(logits, rows, [self._draws(r, k, t) for r, k, t in zip(rows, kinds, targets)])
        alts = row_alternatives(logits, [r.top for r in rows], cfg.temperature, cfg.top_p)
        tok_l, conf_l = self._to_host(tok, conf)
        writes: list[tuple[int, int, int]] = []
        for b, (r, kind, tq) in enumerate(zip(rows, kinds, targets)):
            r.nfe += 1
            committed: list[Token] = []
            n_writes = len(writes)
            if kind == "commit":
                if tq:  # the clean block's last logit gives the next block's first token
                    self._commit(r, tq[0], tok_l[b][0], conf_l[b][0], committed, self._top(alts, b, 0, r.top))
                    writes.append((at[b], tq[0], tok_l[b][0]))
                r.block_start += bs
                r.refreshed_sub = -1
                self._emit("commit", r, -1, committed, [])
            else:
                k = self._active_sub(r)
                if refreshed[b]:
                    r.refreshed_sub = k
                lo = r.block_start + k * sbs
                n_sub = sum(1 for q in tq if q < lo + sbs)
                n_cand = n_sub
                if cfg.stop_guard:  # candidates end at the first predicted stop: what lies past it would be cut
                    n_cand = next((j + 1 for j in range(n_sub) if tok_l[b][j] in self.stop_ids), n_sub)
                c = torch.tensor(conf_l[b][:n_cand])
                chosen = select_commits(c, cfg.strategy, cfg.threshold, cfg.factor).tolist() + [False] * (n_sub - n_cand)
                if r.ngrams is not None:
                    chosen = self._no_new_repeats(r, tq[:n_sub], tok_l[b], conf_l[b], chosen)
                masked: list[Token] = []
                for j, q in enumerate(tq):
                    if j < n_sub and chosen[j]:
                        self._commit(r, q, tok_l[b][j], conf_l[b][j], committed, self._top(alts, b, j, r.top))
                        writes.append((at[b], q, tok_l[b][j]))
                    elif self._listening(r):
                        t = tok_l[b][j]
                        masked.append(Token(q - r.prompt_len, t, self.tb.piece(t), conf_l[b][j]))
                self._emit("prefill" if kind == "prefill" else "step", r, k, committed, masked)
            r.fresh = [q for _, q, _ in writes[n_writes:]]
            self._check_done(r)
        self._write_tokens(seq, writes)

    @staticmethod
    def _no_new_repeats(r: Row, qs: list[int], toks: list[int], confs: list[float], chosen: list[bool]) -> list[bool]:
        """no_repeat_ngram_size: the step's commits, most confident first; one that would form a repeated n-gram
        with those already accepted stays masked (the logits bans cover each position alone, not two at once).
        The most confident is always accepted: its bans were computed on this step's known tokens, so it is
        safe, and every step still commits at least one token."""
        assert r.ngrams is not None
        keep = [False] * len(chosen)
        for n, j in enumerate(sorted((j for j, c in enumerate(chosen) if c), key=lambda j: -confs[j])):
            if n == 0 or not r.ngrams.creates_repeat(qs[j], toks[j]):
                keep[j] = True
                r.ngrams.add(qs[j], toks[j])
        return keep

    def _check_done(self, r: Row) -> None:
        if r.done:
            return
        if r.stop_at is not None and not self._masked(r, r.prompt_len, r.stop_at):
            self._finish(r, "stop_token")
        elif all(t is not None for t in r.answer):
            self._finish(r, "max_new_tokens")
