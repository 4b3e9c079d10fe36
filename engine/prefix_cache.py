"""Prefix caching: K/V of prompt chunks already prefilled, copied into later prompts that start with the same tokens
(vLLM's automatic prefix caching, SGLang's radix cache), without changing a bit of any answer.

Why it is exact: the scheduler prefills a prompt longer than `prefill_chunk` in pieces on a fixed grid of `chunk` (C:
the scheduler's prefill_grain, 64 positions on a CPU) from position 0, [0, C), [C, 2C), ..., each a one-row forward of
its own over keys [0, end), then one final forward for the rest (engine/scheduler.py, engine/driver.py). Piece k's K/V
therefore depend only on the prompt's first (k + 1) C tokens, the model and
the prompt's attention rule (causal for AR, block-causal of its block size for diffusion), so a later prompt that
starts with the same tokens gets the same K/V bit for bit whether it computes them or copies them from here. Only
chunks its own prefill would run as chunk pieces are reused (`reusable`): the final piece's span never comes from
here, so a hit skips forwards and never changes one. Prompts of at most prefill_chunk + 1 tokens are prefilled in one
forward and neither read nor fill the cache.

What it buys: a conversation's next turn re-sends the whole history; its prefill then runs only from the last whole
grain the previous turn prefilled (a six-turn chat on the bundled model, one CPU thread: first tokens 4-8x sooner
from turn 2 on; bench/results/prefix_cache/). So do requests that share a long system prompt or document (16 API
clients with one ~715-token handbook: 109 AR tokens/s together against 15-16 without it, serve_system/).

Keys: a chain digest (blake2b of the scope, the parent chunk's digest and the chunk's tokens), the chunk's tokens kept
beside it for an exact check. Memory: at most `capacity` bytes of K/V, least recently used first out; a lookup or a
save touches a chain from its deepest chunk to its first, so a chunk never leaves before the chunks after it.
Used by the driver's worker thread only (under the engine lock); the counters may be read from any thread.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from torch import Tensor

from .model import KVCache

PREFIX_CACHE_MIB = 512  # default capacity (FASTDLLM_PREFIX_CACHE_MIB, `serve --prefix-cache-mib`; 0 turns it off)


@dataclass
class Chunk:
    tokens: tuple[int, ...]  # this chunk's own tokens (the parent digest pins the ones before)
    k: Tensor  # [layers, kv_heads, C, head_dim], on the model's device
    v: Tensor
    nbytes: int


def reusable(limit: int, chunk: int) -> int:
    """How many whole chunks a prompt's own prefill runs as chunk pieces when chunks may fill the cache up to `limit`
    (Decoder.chunk_limit): the scheduler cuts [kC, (k+1)C) while the rest is longer than C, so (limit - 1) // C."""
    return max(0, (limit - 1) // chunk)


class PrefixCache:
    """K/V of whole prompt chunks by (scope, tokens up to the chunk's end); see the module docstring."""

    def __init__(self, capacity_bytes: int, chunk: int):
        if capacity_bytes < 0 or chunk < 1:
            raise ValueError(f"prefix cache: capacity {capacity_bytes} must be >= 0 and chunk {chunk} >= 1")
        self.capacity, self.chunk = capacity_bytes, chunk
        self.chunks: OrderedDict[bytes, Chunk] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.queried_tokens = 0  # prompt positions looked up (reusable chunks of chunked prompts)
        self.hit_tokens = 0  # of those, copied from here instead of prefilled
        self.evicted = 0

    def _digests(self, scope: Hashable, ids: Sequence[int], n: int) -> list[bytes]:
        c, out = self.chunk, []
        parent = hashlib.blake2b(repr(scope).encode(), digest_size=16).digest()
        for i in range(n):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(array("q", ids[i * c:(i + 1) * c]).tobytes())
            parent = h.digest()
            out.append(parent)
        return out

    def _touch(self, digests: list[bytes]) -> None:
        for d in reversed(digests):  # deepest first: its parents end up more recent, so they leave after it
            self.chunks.move_to_end(d)

    def restore(self, scope: Hashable, ids: Sequence[int], limit: int, cache: KVCache, row: int = 0) -> int:
        """Copy the longest run of stored chunks from position 0 of `ids` (at most reusable(limit)) into `row` of
        `cache`; returns how many prompt positions that covers (a multiple of the chunk)."""
        n = reusable(limit, self.chunk)
        digests = self._digests(scope, ids, n)
        hits: list[bytes] = []
        for i, d in enumerate(digests):
            got = self.chunks.get(d)
            if got is None or got.tokens != tuple(ids[i * self.chunk:(i + 1) * self.chunk]):
                break
            lo, hi = i * self.chunk, (i + 1) * self.chunk
            cache.k[:, row, :, lo:hi] = got.k
            cache.v[:, row, :, lo:hi] = got.v
            hits.append(d)
        self._touch(hits)
        self.queried_tokens += n * self.chunk
        self.hit_tokens += len(hits) * self.chunk
        return len(hits) * self.chunk

    def save(self, scope: Hashable, ids: Sequence[int], start: int, cache: KVCache, row: int = 0) -> None:
        """Keep chunk [start, start + C) of `row` of `cache`, just prefilled for `ids` (start a multiple of C)."""
        c = self.chunk
        if start % c or start + c > len(ids):
            raise ValueError(f"prefix cache: [{start}, {start + c}) is not a whole chunk of a {len(ids)}-token prompt")
        digests = self._digests(scope, ids, start // c + 1)
        d = digests[-1]
        if d not in self.chunks:
            k = cache.k[:, row, :, start:start + c].clone()
            v = cache.v[:, row, :, start:start + c].clone()
            nbytes = k.numel() * k.element_size() * 2
            if nbytes > self.capacity:
                return
            self.chunks[d] = Chunk(tuple(ids[start:start + c]), k, v, nbytes)
            self.bytes += nbytes
        self._touch([x for x in digests if x in self.chunks])
        while self.bytes > self.capacity:
            _, old = self.chunks.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1

    def clear(self) -> None:
        self.chunks.clear()
        self.bytes = 0
