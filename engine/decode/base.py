"""What the two decoders share: sampling, the repetition knobs, commits, events, retirement (rows.py: their state).

A Decoder decodes one batch of prompts, one Event per forward and row, then a 'done' Event per row. run() decodes to
the end; prefill / step / merge / drop_cancelled go one forward at a time, so a scheduler can add rows between
forwards and drop one row alone. What a forward is differs by mode: ar.py (the baseline, one token a forward) and
diffusion.py (Fast-dLLM v2's block diffusion) each implement `_prefill_rows` and `_step_rows`.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from ..config import DecodeConfig
from ..events import Event, Listener, Summary, Token
from ..model import CausalLM, KVCache, causal_mask, wide_calls
from ..penalties import NgramIndex, Penalties, apply_scales, ban
from ..sampling import sample
from ..static import StaticStepper
from ..text import IncrementalDetokenizer, TokenBytes
from .rows import Batch, Cancel, Row


class Decoder:
    """The bookkeeping of one batch; a mode's subclass says what each forward is (see the module docstring)."""

    block = 1  # sequence room is rounded up to this, plus one of it past the last answer position

    def __init__(self, model: CausalLM, cfg: DecodeConfig, mask_id: int | None, tb: TokenBytes,
                 listener: Listener | None = None, cancel: Cancel | None = None,
                 stepper: StaticStepper | None = None, joins: bool = False):
        self.model, self.cfg, self.mask_id, self.tb = model, cfg, mask_id, tb
        self.listener, self.cancel = listener, cancel
        self.stepper = stepper  # static-shape (CUDA graph) decode steps; None = CausalLM.forward
        # rows join a running batch (a scheduler): prefills write a plain cache, merge copies it into the storage
        self.joins = joins
        self.stop_ids = set(cfg.stop_token_ids)
        self.device = next(model.parameters()).device
        self.step_forwards = 0  # forwards the last step() ran (a dual-cache step runs one per forward width)

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

    def _top(self, alts: list | None, b: int, j: int, k: int) -> list | None:
        """Row b's alternatives at position j (sampling.row_alternatives, after _sample) as Token.top."""
        if alts is None or alts[b] is None:
            return None
        return [(t, self.tb.piece(t), v) for t, v in zip(alts[b][0][j][:k], alts[b][1][j][:k])]

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
        if self.stepper is not None and not self.joins:
            return self.stepper.new_cache(batch, max_len)
        return KVCache(self.model.cfg, batch, max_len, self.device, self._dtype())

    def _step(self, ids: Tensor, pos: Tensor, cache: KVCache, *, start: int | None, ends: list[int],
              mask: Tensor | None, logits_idx: Tensor, width: int, lengths: list[int] | None = None,
              cache_rows: Tensor | None = None) -> Tensor:
        """A cached decode forward of a fixed-width kind (AR 1, dual sub-block + 1, block): keys < ends[row]
        are visible. Through the static stepper when there is one (lengths: each row's real window, the rest of
        its window padding), else CausalLM.forward (cache_rows: the cache rows of a part of the batch)."""
        if self.stepper is not None:
            return self.stepper.step(ids, pos, cache, ends, logits_idx, width, lengths)
        return self.model(ids, pos, cache, start=start, kv_len=max(ends), mask=mask, logits_idx=logits_idx,
                          cache_rows=cache_rows)

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

    def _commit(self, row: Row, q: int, tok: int, conf: float, out: list[Token], top: list | None = None) -> None:
        row.answer[q - row.prompt_len] = tok
        if row.ngrams is not None:
            row.ngrams.add(q, tok)
        out.append(Token(q - row.prompt_len, tok, self.tb.piece(tok), conf, top))
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
                       stop_reason=row.done, text=row.detok.text, token_ids=ids, cached_tokens=row.cached)

    def _finish(self, row: Row, reason: str) -> None:
        row.done = reason
        self._emit("done", row, -1, [], [])

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _listening(self, r: Row) -> bool:
        return r.listener is not None or self.listener is not None

    # ---------------------------------------------------------------- what a mode implements
    def _fill_id(self) -> int:
        """The token every undecided position of the sequence holds."""
        return 0

    @staticmethod
    def caches(cfg: DecodeConfig) -> bool:
        """Whether this mode keeps a KV cache under cfg (only then can a prompt be prefilled in chunks)."""
        return True

    def uses_cache(self) -> bool:
        return self.caches(self.cfg)

    def _prompt_mask(self, pos: Tensor, k_len: int) -> Tensor:
        """What prompt positions pos [B, T] see of keys [0, k_len): causal (AR)."""
        return causal_mask(pos, k_len)

    def _prefill_rows(self, batch: Batch, prompts: list[list[int]], cached: int = 0) -> None:
        """The first forward of new rows (positions from `cached` on); it also commits their first tokens."""
        raise NotImplementedError

    def _step_rows(self, batch: Batch) -> int:
        """One forward for every live row of the batch, and its commits; returns how many forwards that took."""
        raise NotImplementedError

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
                 penalties: list[Penalties] | None = None, seeds: list[int | None] | None = None,
                 tops: list[int] | None = None) -> list[Row]:
        """Fresh rows for prompts; a scheduler gives each its own index (event.row), answer cap, listener, stop
        flag, repetition knobs, sampling seed and top_logprobs (the rest of the DecodeConfig is the batch's).
        Without seeds, row i is seeded with the DecodeConfig's seed + i. A row's samples do not depend on what it
        is batched with."""
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
                    gen=self._generator(seeds[i]), top=tops[i] if tops else self.cfg.top_logprobs)
                for i, p in enumerate(prompts)]

    def _max_len(self, rows: list[Row]) -> int:
        """Sequence room: every answer position plus one block for the window past the last one."""
        bs = self.block
        return -(-max(r.limit for r in rows) // bs) * bs + bs

    def open_batch(self, prompts: list[list[int]], rows: list[Row]) -> Batch:
        """The batch of new rows before any forward: prompts in the sequence, an empty cache."""
        max_len = self._max_len(rows)
        seq = torch.full((len(rows), max_len), self._fill_id(), dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            seq[b, :len(p)] = torch.tensor(p, dtype=torch.long, device=self.device)
        return Batch(rows, seq, self._new_cache(len(rows), max_len) if self.uses_cache() else None)

    def prefill(self, prompts: list[list[int]], rows: list[Row], batch: Batch | None = None,
                cached: int = 0) -> Batch:
        """The first forward of new rows (it also commits their first tokens); call under inference_mode.
        `batch` and `cached`: a batch from open_batch whose cache already holds the prompts' first `cached`
        positions (prefill_chunk), so this forward covers only the rest."""
        batch = batch if batch is not None else self.open_batch(prompts, rows)
        self._prefill_rows(batch, prompts, cached)
        return self._retire(batch)

    def prefill_width(self, n: int) -> int:
        """Positions the prefill forward of an n-token prompt covers alone (in a batch: its widest row's)."""
        return -(-n // self.block) * self.block

    def chunk_limit(self, rows: list[Row]) -> int:
        """How far prefill_chunk may fill the cache: the final prefill still covers what it reads logits from
        (the last prompt position; for block diffusion, whole prompt blocks before the prompt's last one)."""
        bs = self.block
        return min((r.prompt_len - 1) // bs * bs for r in rows)

    def prefill_chunk(self, batch: Batch, start: int, end: int) -> None:
        """K/V of prompt positions [start, end) of every row into the cache, no logits read and nothing committed:
        a long prompt prefilled in pieces between other batches' forwards (chunked prefill, engine/scheduler.py).
        start and end must be multiples of the block, end <= chunk_limit(rows); call under inference_mode."""
        if batch.cache is None or start % self.block or end % self.block or end > self.chunk_limit(batch.rows):
            raise ValueError(f"prefill_chunk: [{start}, {end}) is not a whole-block piece of every row's prompt "
                             f"up to {self.chunk_limit(batch.rows)} (block {self.block}; a cache is needed)")
        pos = torch.arange(start, end, device=self.device)[None].expand(len(batch.rows), -1)
        first = torch.zeros((len(batch.rows), 1), dtype=torch.long, device=self.device)
        with wide_calls():  # the kernels of a prefill of this width
            self.model(batch.seq[:, start:end], pos, batch.cache, start=start, kv_len=end,
                       mask=self._prompt_mask(pos, end), logits_idx=first)

    def step(self, batch: Batch) -> Batch:
        """One forward for every live row; finished rows leave. Call under inference_mode."""
        self.step_forwards = self._step_rows(batch)
        return self._retire(batch)

    def drop_cancelled(self, batch: Batch) -> Batch:
        """Rows whose own stop flag is set end as 'cancelled' and leave; the others are untouched."""
        for r in batch.rows:
            if r.cancel is not None and r.cancel.is_set() and not r.done:
                self._finish(r, "cancelled")
        return self._retire(batch)

    def merge(self, a: Batch | None, b: Batch) -> Batch:
        """Rows b join batch a (admission between forwards; a None or empty: b starts the batch): seq and cache
        padded to the longer room. With a static stepper (built with joins=True, so b's prefill wrote a plain
        cache) b's K/V are copied into the stepper's storage after a's rows: shapes stay the stepper's."""
        a = a if a is not None and a.rows else None
        static = self.stepper is not None and b.cache is not None
        if static and not self.joins:
            raise ValueError("merge: this decoder's prefills write the stepper's storage; build it with joins=True")
        if a is None and not static:
            return b
        if not b.rows and not static:
            return a
        n = max(a.seq.shape[1] if a else 0, b.seq.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, n - t.shape[1]), value=self._fill_id())  # noqa: E731
        seq = torch.cat([pad(a.seq), pad(b.seq)]) if a else b.seq
        if static:
            cache = self.stepper.join(a.cache if a else None, len(a.rows) if a else 0, b.cache, len(b.rows), n)
        else:
            cache = a.cache.merged(b.cache) if a.cache is not None and b.cache is not None else None
        return Batch((a.rows if a else []) + b.rows, seq, cache)

    def _retire(self, batch: Batch) -> Batch:
        """Finished rows leave the batch (their summary is kept); the cache fills their places with its last rows
        (KVCache.compact), and the rows and sequences follow its order."""
        live = batch.rows
        keep = [i for i, r in enumerate(live) if not r.done]
        for r in live:
            if r.done and r.summary is None:
                r.summary = self._summary(r)
        if len(keep) == len(live):
            return batch
        order = batch.cache.compact(keep) if batch.cache is not None and keep else keep
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        return Batch([live[i] for i in order], batch.seq.index_select(0, idx), batch.cache)

    def _cancelled(self, live: list[Row]) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            for r in live:
                self._finish(r, "cancelled")
            return True
        return False

