"""Fast-dLLM v2 block-diffusion decoding and the AR baseline, over one batch of prompts.

Block grid from absolute position 0; token shift (position q is read from the logits at q - 1);
sub-blocks decoded left to right with confidence-thresholded parallel commits; after a block has no
masks, one commit forward writes its clean K/V and yields the next block's first token.
Cache modes: none (recompute the prefix), block (cached committed blocks), dual (also reuse the
active block's K/V: a refresh forward at each new sub-block, then forwards of the sub-block only).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .config import DecodeConfig
from .events import Event, Listener, Summary, Token
from .model import CausalLM, KVCache, block_causal_mask, causal_mask, wide_calls
from .penalties import NgramIndex, Penalties, apply_scales, ban
from .sampling import sample, select_commits
from .static import StaticStepper
from .text import IncrementalDetokenizer, TokenBytes


SHARED_PREFIX_MIN = 16  # AR prefill: a common prompt prefix this long gets its own one-row forward (see _prefill_ar)


class Cancel(Protocol):
    def is_set(self) -> bool: ...


@dataclass
class Row:
    """Host-side state of one sequence of the batch."""

    index: int  # row index in the caller's batch (stable while rows leave)
    prompt_len: int
    limit: int  # absolute end of allowed answer positions: prompt_len + max_new_tokens
    detok: IncrementalDetokenizer
    answer: list[int | None] = field(default_factory=list)  # answer-relative; None = still masked
    block_start: int = 0
    refreshed_sub: int = -1  # dual cache: sub-block whose block K/V were last refreshed
    stop_at: int | None = None  # absolute position of the earliest committed stop token
    emitted: int = 0  # contiguous answer tokens already given to the detokenizer
    emitted_ar: int = 0  # AR: answer tokens produced so far
    nfe: int = 0
    first_token_t: float | None = None
    done: str = ""  # stop reason once finished
    summary: Summary | None = None  # set when the row leaves the batch
    t0: float = 0.0  # perf_counter when this row's decode started (its events' clock)
    listener: Listener | None = None  # this row's own listener (a scheduler's request), else the Decoder's
    cancel: Cancel | None = None  # this row's own stop flag: only this row leaves the batch
    prompt: list[int] = field(default_factory=list)  # the prompt's ids (repetition penalty context)
    pen: Penalties = field(default_factory=Penalties)  # this row's repetition knobs (rows of a batch may differ)
    ngrams: NgramIndex | None = None  # no_repeat_ngram_size > 0: the n-grams of prompt + committed answer
    gen: torch.Generator | None = None  # sampling (temperature > 0): this row's own random stream, from its seed

    def known(self, q: int) -> bool:
        return q < self.prompt_len or self.answer[q - self.prompt_len] is not None


@dataclass
class Batch:
    """Rows decoding together: row b of seq and of the cache belongs to rows[b]."""

    rows: list[Row]
    seq: Tensor  # [B, max_len] prompt + answer tokens (masks where undecided)
    cache: KVCache | None


class Decoder:
    """Decodes a batch; one Event per forward and row, then a 'done' Event per row.

    run() decodes to the end; prefill / step / merge / drop_cancelled go one forward at a time, so a scheduler can
    add rows between forwards and drop one row alone.
    """

    def __init__(self, model: CausalLM, cfg: DecodeConfig, mask_id: int | None, tb: TokenBytes,
                 listener: Listener | None = None, cancel: Cancel | None = None,
                 stepper: StaticStepper | None = None):
        self.model, self.cfg, self.mask_id, self.tb = model, cfg, mask_id, tb
        self.listener, self.cancel = listener, cancel
        self.stepper = stepper  # static-shape (CUDA graph) decode steps; None = CausalLM.forward
        self.stop_ids = set(cfg.stop_token_ids)
        self.device = next(model.parameters()).device

    # ---------------------------------------------------------------- shared helpers
    @staticmethod
    def _now(row: Row) -> float:
        return time.perf_counter() - row.t0

    def _sample(self, logits: Tensor, rows: list[Row], counts: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """logits [B, n, V] (or [B, V]), row b of them rows[b]'s; its first counts[b] of n are commit candidates
        (default all), the rest display-only or padding. Sampling draws from each row's own generator, so a seeded
        row gives the same tokens whatever it is batched with (one shared generator made two identical seeded
        requests that ran together differ: issue 24)."""
        if self.mask_id is not None and self.mask_id < logits.shape[-1]:
            logits[..., self.mask_id] = float("-inf")  # the mask token is never an answer token
        if self.cfg.temperature <= 0:
            return sample(logits, 0.0, 1.0, None)
        if logits.dim() == 2:  # AR: one position per row
            tok, conf = self._sample(logits[:, None], rows, counts)
            return tok[:, 0], conf[:, 0]
        tok = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        conf = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for b, r in enumerate(rows):
            # only the row's own candidates draw: padding up to the batch's widest row would use up random
            # numbers, and the row's next step would draw from another point of its stream than alone
            k = logits.shape[1] if counts is None else counts[b]
            if k:
                tok[b, :k], conf[b, :k] = sample(logits[b, :k], self.cfg.temperature, self.cfg.top_p, r.gen)
            if k < logits.shape[1]:  # the heatmap's extra positions (and padding): shown, never committed, no draw
                tok[b, k:], conf[b, k:] = sample(logits[b, k:] / self.cfg.temperature, 0.0, 1.0, None)
        return tok, conf

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if self.cfg.temperature <= 0:
            return None  # greedy never draws
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return gen

    def _penalised(self, rows: list[Row], logits: Tensor, targets: list[list[int]]) -> Tensor:
        """Repetition knobs (engine/penalties.py) on logits [B, N, V] whose [b, j] scores position targets[b][j]:
        every candidate of a step, before confidence and sampling, so they steer what the unmasking rule commits.
        Rows with the knobs off (the default) are untouched; a batch without any is returned as it is. This runs on
        the logits whatever produced them, CausalLM.forward or the static stepper (CUDA graphs), so both honour the
        knobs with no separate path."""
        on = [b for b, r in enumerate(rows) if r.pen.active]
        if not on:
            return logits
        x = logits.float()
        logits = x.clone() if x is logits else x  # never write into the caller's tensor (a CUDA graph's output)
        scaled = [b for b in on if rows[b].pen.scales]
        if scaled:
            idx = torch.tensor(scaled, device=logits.device)
            ctx = [self._answer_so_far(rows[b]) for b in scaled]
            logits[idx] = apply_scales(logits[idx], [rows[b].prompt for b in scaled], ctx,
                                       [rows[b].pen for b in scaled])
        bans = [(b, j, rows[b].ngrams.banned(q)) for b in on if rows[b].ngrams is not None
                for j, q in enumerate(targets[b])]
        return ban(logits, bans)

    @staticmethod
    def _answer_so_far(row: Row) -> list[int]:
        """Committed answer tokens, in any order (masked gaps skipped), through the earliest stop token."""
        end = len(row.answer) if row.stop_at is None else row.stop_at - row.prompt_len + 1
        return [t for t in row.answer[:end] if t is not None]

    def _new_cache(self, batch: int, max_len: int) -> KVCache:
        if self.stepper is not None:
            return self.stepper.new_cache(batch, max_len)
        return KVCache(self.model.cfg, batch, max_len, self.device, self._dtype())

    def _step(self, ids: Tensor, pos: Tensor, cache: KVCache, *, start: int | None, ends: list[int],
              mask: Tensor | None, logits_idx: Tensor, width: int) -> Tensor:
        """A cached decode forward of a fixed-width kind (AR 1, dual sub-block + 1, block): keys < ends[row]
        are visible. Through the static stepper when there is one, else CausalLM.forward."""
        if self.stepper is not None:
            return self.stepper.step(ids, pos, cache, ends, logits_idx, width)
        return self.model(ids, pos, cache, start=start, kv_len=max(ends), mask=mask, logits_idx=logits_idx)

    @staticmethod
    def _to_host(tok: Tensor, conf: Tensor) -> tuple[list, list]:
        """Tokens and confidences in one device->host copy (with the static stepper, the step's only sync)."""
        both = torch.stack((tok.to(torch.float64), conf.to(torch.float64))).cpu()
        return both[0].long().tolist(), both[1].tolist()

    def _write_tokens(self, seq: Tensor, writes: list[tuple[int, int, int]]) -> None:
        """A step's committed (row, position, token) into the device sequence in one copy, not one per token."""
        if writes:
            n, width = len(writes), seq.shape[1]
            both = torch.tensor([b * width + q for b, q, _ in writes] + [t for _, _, t in writes], device=seq.device)
            seq.view(-1).scatter_(0, both[:n], both[n:])

    def _commit(self, row: Row, q: int, tok: int, conf: float, out: list[Token]) -> None:
        row.answer[q - row.prompt_len] = tok
        if row.ngrams is not None:
            row.ngrams.add(q, tok)
        out.append(Token(q - row.prompt_len, tok, self.tb.piece(tok), conf))
        if tok in self.stop_ids and (row.stop_at is None or q < row.stop_at):
            row.stop_at = q
        if q == row.prompt_len:  # TTFT: the first answer token, the one streaming text can start with
            row.first_token_t = self._now(row)

    def _advance_text(self, row: Row) -> str:
        delta = []
        end = len(row.answer) if row.stop_at is None else row.stop_at - row.prompt_len + 1
        while row.emitted < end and row.answer[row.emitted] is not None:
            delta.append(row.detok.push(row.answer[row.emitted]))
            row.emitted += 1
        return "".join(delta)

    def _emit(self, kind: str, row: Row, sub: int, committed: list[Token], masked: list[Token]) -> None:
        delta = self._advance_text(row)
        listener = row.listener or self.listener
        if listener is not None:
            listener(Event(kind, row.index, row.nfe, row.block_start // self.cfg.block_size, sub,
                           committed, masked, delta, self._now(row)))

    def _summary(self, row: Row) -> Summary:
        """Answer = the contiguous committed prefix, through the stop token when there is one."""
        end = len(row.answer) if row.stop_at is None else row.stop_at - row.prompt_len + 1
        ids: list[int] = []
        for t in row.answer[:end]:
            if t is None:
                break
            ids.append(t)
        row.detok.flush()
        n, secs = len(ids), self._now(row)
        return Summary(answer_tokens=n, nfe=row.nfe, tokens_per_forward=n / max(row.nfe, 1), seconds=secs,
                       tokens_per_second=n / secs if secs > 0 else 0.0,
                       ttft=row.first_token_t if row.first_token_t is not None else secs,
                       stop_reason=row.done, text=row.detok.text, token_ids=ids)

    def _finish(self, row: Row, reason: str) -> None:
        row.done = reason
        self._emit("done", row, -1, [], [])

    # ---------------------------------------------------------------- public entry
    def run(self, prompts: list[list[int]], penalties: list[Penalties] | None = None) -> list[Summary]:
        """Decode a whole batch to the end (what Engine.generate_ids does); penalties: per-row repetition knobs
        (default: the DecodeConfig's for every row)."""
        rows = self.new_rows(prompts, penalties=penalties)
        with torch.inference_mode():
            batch = self.prefill(prompts, rows)
            while batch.rows and not self._cancelled(batch.rows):
                batch = self.step(batch)
            self._retire(batch)
        return [r.summary for r in rows]  # type: ignore[misc]  # rows are in caller order

    def new_rows(self, prompts: list[list[int]], *, indices: list[int] | None = None,
                 max_new: list[int] | None = None, listeners: list[Listener | None] | None = None,
                 cancels: list[Cancel | None] | None = None,
                 penalties: list[Penalties] | None = None, seeds: list[int | None] | None = None) -> list[Row]:
        """Fresh rows for prompts; a scheduler gives each its own index (event.row), answer cap, listener, stop
        flag, repetition knobs and sampling seed (the rest of the DecodeConfig is the batch's). Without seeds, row i
        is seeded with the DecodeConfig's seed + i. A row's samples do not depend on what it is batched with."""
        t0, skip = time.perf_counter(), self.stop_ids | self.tb.special
        caps = max_new or [self.cfg.max_new_tokens] * len(prompts)
        pens = penalties or [Penalties.of(self.cfg)] * len(prompts)
        if seeds is None:  # row i of a batch under one seed s samples as a request seeded s + i would alone (as n > 1
            # does on the server): distinct rows (Magpie draws many samples of one prompt) that each reproduce
            seeds = [None if self.cfg.seed is None else (self.cfg.seed + i) % 2**63 for i in range(len(prompts))]
        return [Row(indices[i] if indices else i, len(p), len(p) + caps[i], IncrementalDetokenizer(self.tb, skip),
                    [None] * caps[i], t0=t0, listener=listeners[i] if listeners else None,
                    cancel=cancels[i] if cancels else None, prompt=list(p), pen=pens[i],
                    ngrams=NgramIndex(pens[i].no_repeat_ngram, p, len(p) + caps[i]) if pens[i].no_repeat_ngram else None,
                    gen=self._generator(seeds[i]))
                for i, p in enumerate(prompts)]

    def _max_len(self, rows: list[Row]) -> int:
        """Sequence room: every answer position plus one block for the window past the last one."""
        bs = self.cfg.block_size if self.cfg.mode == "diffusion" else 1
        return -(-max(r.limit for r in rows) // bs) * bs + bs

    def _fill(self) -> int:
        return self.mask_id if (self.cfg.mode == "diffusion" and self.mask_id is not None) else 0

    def prefill(self, prompts: list[list[int]], rows: list[Row]) -> Batch:
        """The first forward of new rows (it also commits their first tokens); call under inference_mode."""
        if self.cfg.mode == "diffusion" and self.mask_id is None:
            raise ValueError("mode: this model has no mask token |<MASK>|, so it cannot decode by "
                             "block diffusion; use mode 'ar'")
        max_len = self._max_len(rows)
        seq = torch.full((len(rows), max_len), self._fill(), dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            seq[b, :len(p)] = torch.tensor(p, dtype=torch.long, device=self.device)
        cache = None if (self.cfg.mode == "diffusion" and self.cfg.cache == "none") else \
            self._new_cache(len(rows), max_len)
        batch = Batch(rows, seq, cache)
        if self.cfg.mode == "ar":
            with wide_calls():  # however the batch splits the prompts, their K/V come from the same kernels
                self._prefill_ar(batch, prompts)
        else:
            self._prefill_diffusion(batch)
        return self._retire(batch)

    def step(self, batch: Batch) -> Batch:
        """One forward for every live row; finished rows leave. Call under inference_mode."""
        if self.cfg.mode == "ar":
            self._step_ar(batch)
        else:
            self._step_diffusion(batch)
        return self._retire(batch)

    def drop_cancelled(self, batch: Batch) -> Batch:
        """Rows whose own stop flag is set end as 'cancelled' and leave; the others are untouched."""
        for r in batch.rows:
            if r.cancel is not None and r.cancel.is_set() and not r.done:
                self._finish(r, "cancelled")
        return self._retire(batch)

    def merge(self, a: Batch, b: Batch) -> Batch:
        """Rows b join batch a (admission between forwards): seq and cache padded to the longer room."""
        if self.stepper is not None:
            raise ValueError("merge: the static stepper's cache has a fixed shape; a scheduler decodes without it")
        if not a.rows or not b.rows:
            return a if a.rows else b
        n = max(a.seq.shape[1], b.seq.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, n - t.shape[1]), value=self._fill())  # noqa: E731
        cache = a.cache.merged(b.cache) if a.cache is not None and b.cache is not None else None
        return Batch(a.rows + b.rows, torch.cat([pad(a.seq), pad(b.seq)]), cache)

    def _retire(self, batch: Batch) -> Batch:
        """Finished rows leave the batch (their summary is kept)."""
        live = batch.rows
        keep = [i for i, r in enumerate(live) if not r.done]
        for r in live:
            if r.done and r.summary is None:
                r.summary = self._summary(r)
        if len(keep) == len(live):
            return batch
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if batch.cache is not None and keep:
            batch.cache.keep_rows(idx)
        return Batch([live[i] for i in keep], batch.seq.index_select(0, idx) if keep else batch.seq[:0], batch.cache)

    def _cancelled(self, live: list[Row]) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            for r in live:
                self._finish(r, "cancelled")
            return True
        return False

    def _listening(self, r: Row) -> bool:
        return r.listener is not None or self.listener is not None

    # ---------------------------------------------------------------- AR baseline
    def _shared_prefix(self, prompts: list[list[int]], cache: KVCache | None) -> int:
        """Tokens every prompt of the batch starts with (a chat template's system turn), when worth one forward of
        their own: at least SHARED_PREFIX_MIN, and at least one token of every prompt left to prefill per row."""
        if len(prompts) < 2 or cache is None or self.stepper is not None:
            return 0
        n = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
        return n if n >= SHARED_PREFIX_MIN else 0

    def _prefill_ar(self, batch: Batch, prompts: list[list[int]]) -> None:
        rows, seq = batch.rows, batch.seq
        plen = torch.tensor([r.prompt_len for r in rows], device=self.device)
        width = int(plen.max())
        shared = self._shared_prefix(prompts, batch.cache)
        if shared:  # the common prefix once, its K/V copied to every row; then only the rows' own tokens
            assert batch.cache is not None
            one = KVCache(self.model.cfg, 1, shared, self.device, self._dtype())
            pos1 = torch.arange(shared, device=self.device)[None]
            self.model(seq[:1, :shared], pos1, one, start=0, kv_len=shared, causal=True, logits_idx=pos1[:, -1:])
            batch.cache.k[:, :, :, :shared] = one.k[:, :, :, :shared]
            batch.cache.v[:, :, :, :shared] = one.v[:, :, :, :shared]
        pos = torch.arange(shared, width, device=self.device)[None].expand(len(rows), -1)
        same = not shared and bool((plen == width).all())
        mask = None if same else causal_mask(pos, width, plen)
        logits = self.model(seq[:, shared:width], pos, batch.cache, start=shared, kv_len=width, mask=mask, causal=same,
                            logits_idx=(plen - 1 - shared)[:, None])
        self._commit_ar(batch, logits, "prefill")

    def _step_ar(self, batch: Batch) -> None:
        qs = [r.prompt_len + r.emitted_ar - 1 for r in batch.rows]  # host lists: no device sync
        q = torch.tensor(qs, device=self.device)
        same = all(x == qs[0] for x in qs)
        mask = None if same else causal_mask(q[:, None], max(qs) + 1)
        last = torch.zeros((len(qs), 1), dtype=torch.long, device=self.device)
        logits = self._step(batch.seq.gather(1, q[:, None]), q[:, None], batch.cache, start=qs[0] if same else None,
                            ends=[x + 1 for x in qs], mask=mask, logits_idx=last, width=1)
        self._commit_ar(batch, logits, "step")

    def _commit_ar(self, batch: Batch, logits: Tensor, kind: str) -> None:
        nxt = [[r.prompt_len + r.emitted_ar] for r in batch.rows]
        tok, conf = self._sample(self._penalised(batch.rows, logits[:, -1:], nxt)[:, 0], batch.rows)
        writes: list[tuple[int, int, int]] = []
        for b, (r, t, c) in enumerate(zip(batch.rows, *self._to_host(tok, conf))):
            r.nfe += 1
            q = r.prompt_len + r.emitted_ar
            r.emitted_ar += 1
            committed: list[Token] = []
            self._commit(r, q, t, c, committed)
            writes.append((b, q, t))
            self._emit(kind, r, -1, committed, [])
            if r.stop_at is not None:
                self._finish(r, "stop_token")
            elif q + 1 >= r.limit:
                self._finish(r, "max_new_tokens")
        self._write_tokens(batch.seq, writes)

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---------------------------------------------------------------- block diffusion
    def _prefill_diffusion(self, batch: Batch) -> None:
        # Prefill: whole prompt blocks, plus the partial block (prompt tail + masks) when there is one, which
        # makes the prefill also the first decoding step of that block.
        rows, bs = batch.rows, self.cfg.block_size
        for r in rows:
            r.block_start = r.prompt_len // bs * bs
        ends = [r.block_start + (bs if r.prompt_len % bs else 0) for r in rows]
        width = max(ends)
        pos = torch.arange(width, device=self.device)[None].expand(len(rows), -1)
        valid = torch.tensor(ends, device=self.device)
        mask = block_causal_mask(pos, width, bs, valid)
        targets = [self._targets(r, 0, e, full=True) for r, e in zip(rows, ends)]
        logits = self.model(batch.seq[:, :width], pos, batch.cache, start=0, kv_len=width, mask=mask,
                            logits_idx=self._idx(targets, [0] * len(rows)))
        # an aligned prompt's prefill covers whole prompt blocks only: the new block's K/V are not there yet
        self._after_forward("prefill", rows, batch.seq, targets, logits, [r.prompt_len % bs != 0 for r in rows])

    def _step_diffusion(self, batch: Batch) -> None:
        cfg, bs, live, seq, cache = self.cfg, self.cfg.block_size, batch.rows, batch.seq, batch.cache
        plan = [self._plan(r) for r in live]  # (kind, window start, window end)
        full = any(k != "sub" for k, _, _ in plan)
        if cfg.cache == "none":
            ends = [r.block_start + bs for r in live]
            width = max(ends)
            starts = [0] * len(live)
            pos = torch.arange(width, device=self.device)[None].expand(len(live), -1)
            mask = block_causal_mask(pos, width, bs, torch.tensor(ends, device=self.device))
            ids, start, kv_len = seq[:, :width], 0, None
        else:
            width = bs if full else max(e - s for _, s, e in plan)
            starts = [r.block_start if full else min(s, r.block_start + bs - width) for r, (_, s, _) in zip(live, plan)]
            st = torch.tensor(starts, device=self.device)
            pos = st[:, None] + torch.arange(width, device=self.device)[None]
            ends = [r.block_start + bs for r in live]
            ends_t = torch.tensor(ends, device=self.device)
            kv_len = max(ends)
            same = all(s == starts[0] for s in starts)
            mask = None if same else (torch.arange(kv_len, device=self.device)[None, None, None] < ends_t[:, None, None, None])
            ids, start = seq.gather(1, pos), (starts[0] if same else None)
        targets = []
        for r, (kind, s, e), a in zip(live, plan, starts):
            if kind == "commit":
                targets.append([r.block_start + bs]) if r.block_start + bs < r.limit else targets.append([])
            else:
                targets.append(self._targets(r, a, a + width, full=full or cfg.cache == "none"))
        idx = self._idx(targets, starts)
        if cache is None:
            logits = self.model(ids, pos, cache, start=start, kv_len=kv_len, mask=mask, logits_idx=idx)
        else:
            logits = self._step(ids, pos, cache, start=start, ends=ends, mask=mask, logits_idx=idx,
                                width=bs if full else cfg.sub_block_size + 1)
        kinds = [k for k, _, _ in plan]
        self._after_forward(kinds, live, seq, targets, logits, [full or cfg.cache == "none"] * len(live))

    def _masked(self, r: Row, lo: int, hi: int) -> list[int]:
        """Still-masked answer positions in [lo, hi), never past an earlier committed stop token."""
        hi = min(hi, r.limit, r.stop_at if r.stop_at is not None else hi)
        return [q for q in range(max(lo, r.prompt_len), hi) if r.answer[q - r.prompt_len] is None]

    def _active_sub(self, r: Row) -> int:
        sbs = self.cfg.sub_block_size
        first = self._masked(r, r.block_start, r.block_start + self.cfg.block_size)[0]
        return (first - r.block_start) // sbs

    def _plan(self, r: Row) -> tuple[str, int, int]:
        """What this row's next forward is: 'commit', a whole-block 'block' step, or a dual 'sub' step."""
        bs, sbs = self.cfg.block_size, self.cfg.sub_block_size
        if not self._masked(r, r.block_start, r.block_start + bs):
            return "commit", r.block_start, r.block_start + bs
        k = self._active_sub(r)
        if self.cfg.cache != "dual" or r.refreshed_sub != k:
            return "block", r.block_start, r.block_start + bs
        lo = r.block_start + k * sbs
        return "sub", max(lo - 1, r.block_start), lo + sbs  # lo - 1: the logits that predict position lo

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

    def _after_forward(self, kinds, rows: list[Row], seq: Tensor, targets: list[list[int]], logits: Tensor,
                       refreshed: list[bool]) -> None:
        cfg, bs, sbs = self.cfg, self.cfg.block_size, self.cfg.sub_block_size
        kinds = [kinds] * len(rows) if isinstance(kinds, str) else kinds
        tok, conf = self._sample(self._penalised(rows, logits, targets), rows,
                                 [self._draws(r, k, t) for r, k, t in zip(rows, kinds, targets)])
        tok_l, conf_l = self._to_host(tok, conf)
        writes: list[tuple[int, int, int]] = []
        for b, (r, kind, tq) in enumerate(zip(rows, kinds, targets)):
            r.nfe += 1
            committed: list[Token] = []
            if kind == "commit":
                if tq:  # the clean block's last logit gives the next block's first token
                    self._commit(r, tq[0], tok_l[b][0], conf_l[b][0], committed)
                    writes.append((b, tq[0], tok_l[b][0]))
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
                        self._commit(r, q, tok_l[b][j], conf_l[b][j], committed)
                        writes.append((b, q, tok_l[b][j]))
                    elif self._listening(r):
                        t = tok_l[b][j]
                        masked.append(Token(q - r.prompt_len, t, self.tb.piece(t), conf_l[b][j]))
                self._emit("prefill" if kind == "prefill" else "step", r, k, committed, masked)
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
