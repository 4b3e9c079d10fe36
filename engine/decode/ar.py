"""The AR baseline: one token a forward, the same model without the adapter (or any causal LM)."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ..model import KVCache, causal_mask, wide_calls
from .base import Decoder
from .rows import Batch
from ..events import Token
from ..sampling import row_alternatives

SHARED_PREFIX_MIN = 16  # AR prefill: a common prompt prefix this long gets its own one-row forward (see _prefill_rows)


class ARDecoder(Decoder):
    """Greedy or sampled next-token decoding over a KV cache (static-shape steps when there is a stepper)."""

    def _prefill_rows(self, batch: Batch, prompts: list[list[int]], cached: int = 0) -> None:
        with wide_calls():  # however the batch splits the prompts, their K/V come from the same kernels
            self._prefill_ar(batch, prompts, cached)

    def _step_rows(self, batch: Batch) -> int:
        self._step_ar(batch)
        return 1

    def _shared_prefix(self, prompts: list[list[int]], cache: KVCache | None) -> int:
        """Tokens every prompt of the batch starts with (a chat template's system turn), when worth one forward of
        their own: at least SHARED_PREFIX_MIN, and at least one token of every prompt left to prefill per row."""
        if len(prompts) < 2 or cache is None or (self.stepper is not None and not self.joins):
            return 0
        n = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
        return n if n >= SHARED_PREFIX_MIN else 0

    def _prefill_ar(self, batch: Batch, prompts: list[list[int]], cached: int = 0) -> None:
        """Prompts from position `cached` on (the cache holds those before: chunked prefill)."""
        rows, seq = batch.rows, batch.seq
        plen = torch.tensor([r.prompt_len for r in rows], device=self.device)
        width = int(plen.max())
        shared = cached or self._shared_prefix(prompts, batch.cache)
        if shared and not cached:  # the common prefix once, its K/V copied to every row; then only the rows' own tokens
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

