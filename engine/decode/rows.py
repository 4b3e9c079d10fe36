"""The state a decode keeps per sequence (Row) and per batch (Batch), on the host and in the batch's tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..events import Listener, Summary
from ..model import KVCache
from ..penalties import NgramIndex, Penalties
from ..text import IncrementalDetokenizer


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
    fresh: list[int] = field(default_factory=list)  # positions its last forward committed (K/V still of a mask)
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
    top: int = 0  # top_logprobs: alternatives kept per committed token (0 = none; rows of a batch may differ)
    cached: int = 0  # prompt positions whose K/V were copied from the prefix cache (the driver's chunked prefill)

    def known(self, q: int) -> bool:
        return q < self.prompt_len or self.answer[q - self.prompt_len] is not None


@dataclass
class Batch:
    """Rows decoding together: row b of seq and of the cache belongs to rows[b]."""

    rows: list[Row]
    seq: Tensor  # [B, max_len] prompt + answer tokens (masks where undecided)
    cache: KVCache | None
