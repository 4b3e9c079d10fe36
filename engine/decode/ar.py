"""The AR baseline: one token a forward, the same model without the adapter (or any causal LM)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..model import KVCache, causal_mask, wide_calls
from .base import Decoder
from .rows import Batch
from ..events import Token
from ..sampling import row_alternatives


class ARDecoder(Decoder):
    """Greedy or sampled next-token decoding over a KV cache (static-shape steps when there is a stepper)."""

    def _prefill_rows(self, batch: Batch, prompts: list[list[int]], cached: int = 0) -> None:
        with wide_calls():  # however the batch splits the prompts, their K/V come from the same kernels
            self._prefill_ar(batch, cached)

    def _step_rows(self, batch: Batch) -> int:
        self._step_ar(batch)
        return 1

    def _prefill_ar(self, batch: Batch, cached: int = 0) -> None:
        """Prompts from position `cached` on (the cache holds those before: chunked prefill, one row). Rows of one
        length share a forward; rows of unequal lengths are prefilled one at a time, each in the forward it gets
        alone (cache_rows: in place in the batch's cache). In a padded forward a row's attention runs in a call with
        more query rows, and torch's CPU attention then gives it other last bits (bench/results/ar_prefill_exact),
        which the bf16/int8 wide activations turn into other greedy answers (2 of 16 API clients on the 4-bit
        default, 2026-11-28); so did prefilling a shared system turn once for every row, which this replaces."""
        rows, seq = batch.rows, batch.seq
        lens = [r.prompt_len for r in rows]
        if len(set(lens)) == 1:
            logits = self._prefill_forward(seq, lens[0], batch.cache, cached)
        else:
            assert not cached, "a chunked prefill is one row"
            logits = torch.cat([self._prefill_forward(seq[b:b + 1], n, batch.cache, 0,
                                                      torch.tensor([b], device=self.device))
                                for b, n in enumerate(lens)])
        self._commit_ar(batch, logits, "prefill")

    def _prefill_forward(self, seq: Tensor, n: int, cache: KVCache | None, cached: int,
                         cache_rows: Tensor | None = None) -> Tensor:
        """Positions [cached, n) of rows that all have n prompt tokens; the logits of position n - 1."""
        pos = torch.arange(cached, n, device=self.device)[None].expand(seq.shape[0], -1)
        last = torch.full((seq.shape[0], 1), n - 1 - cached, dtype=torch.long, device=self.device)
        mask = causal_mask(pos, n) if cached else None  # after a chunk: the queries start past the cached keys
        return self.model(seq[:, cached:n], pos, cache, start=cached, kv_len=n, mask=mask, causal=not cached,
                          logits_idx=last, cache_rows=cache_rows)

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
        lg = self._penalised(batch.rows, logits[:, -1:], nxt)[:, 0]
        tok, conf = self._sample(lg, batch.rows)
        alts = row_alternatives(lg, [r.top for r in batch.rows], self.cfg.temperature, self.cfg.top_p)
        writes: list[tuple[int, int, int]] = []
        for b, (r, t, c) in enumerate(zip(batch.rows, *self._to_host(tok, conf))):
            r.nfe += 1
            q = r.prompt_len + r.emitted_ar
            r.emitted_ar += 1
            committed: list[Token] = []
            self._commit(r, q, t, c, committed, self._top(alts, b, 0, r.top))
            writes.append((b, q, t))
            self._emit(kind, r, -1, committed, [])
            if r.stop_at is not None:
                self._finish(r, "stop_token")
            elif q + 1 >= r.limit:
                self._finish(r, "max_new_tokens")
        self._write_tokens(batch.seq, writes)

