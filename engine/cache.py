"""The KV cache: preallocated K/V of every layer for a batch of rows, with spare rows for continuous batching."""
from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig

# CPU attention over a cache reads keys in whole multiples of this, the rest masked. SDPA's CPU kernel sums a
# length-n key axis in SIMD lanes plus a length-dependent tail, so the same row attending over n keys alone and
# over a batch's longer padded length rounds differently (~1e-7), which bf16 activations (the 4-bit path) can
# turn into a different greedy token; over whole multiples the masked keys add exact zeros in the same lanes, so
# a row's numbers no longer depend on its batch (tests/test_engine.py, tests/test_quant.py). Caches round up to it.
KEY_QUANTUM = 32


def whole_key_quanta(n: int) -> int:
    """n rounded up to a multiple of KEY_QUANTUM."""
    return -(-n // KEY_QUANTUM) * KEY_QUANTUM


class KVCache:
    """Preallocated K/V for every layer: [layers, batch, kv_heads, max_len, head_dim].

    `k` / `v` are views of the first `batch` rows of a storage (`store_k` / `store_v`) that may hold spare rows:
    rows that join a running batch are copied into spare rows and rows that finish are replaced by the batch's last
    rows (`merged`, `compact`), so continuous batching copies the rows that move, not the whole batch's K/V at every
    join and every finish (which, for 16 clients of ~750-token prompts, was 40 % of the decoding thread's time).
    The spare rows are bounded: half the rows (at least the joining ones) when the storage grows, and a storage
    at most a quarter used is cut back, so memory follows the batch."""

    resizable = True  # engine/static.py's cache is a view of a stepper's storage, whose addresses must stay

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
        max_len = whole_key_quanta(max_len)  # room for whole key quanta (see KEY_QUANTUM)
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.store_k = self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.store_v = self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    def _view(self, rows: int) -> None:
        self.k, self.v = self.store_k[:, :rows], self.store_v[:, :rows]

    def _resize(self, rows: int, room: int) -> None:
        """New storage of `rows` rows and `room` positions holding the live rows (zeros elsewhere)."""
        b, shape = self.k.shape[1], list(self.store_k.shape)
        shape[1], shape[3] = rows, room
        k, v = self.store_k.new_zeros(shape), self.store_v.new_zeros(shape)
        t = min(room, self.max_len)
        k[:, :b, :, :t] = self.k[:, :, :, :t]
        v[:, :b, :, :t] = self.v[:, :, :, :t]
        self.store_k, self.store_v, self.max_len = k, v, room
        self._view(b)

    def keep_rows(self, rows: Tensor) -> None:
        """Keep these rows, in this order (compacted in place)."""
        n = rows.numel()
        self.store_k[:, :n] = self.k.index_select(1, rows)
        self.store_v[:, :n] = self.v.index_select(1, rows)
        self._view(n)

    def compact(self, keep: list[int]) -> list[int]:
        """Keep rows `keep` (ascending): each finished row among the first len(keep) is replaced by a kept row from
        past them (one row copied per finished row, not every row after it). Returns the rows' new order: new row i
        is old row order[i] (the caller reorders its per-row state the same way)."""
        n, kept = len(keep), set(keep)
        order = list(range(n))
        for hole, tail in zip([i for i in range(n) if i not in kept], [i for i in keep if i >= n]):
            order[hole] = tail
            self.store_k[:, hole] = self.store_k[:, tail]
            self.store_v[:, hole] = self.store_v[:, tail]
        self._view(n)
        if self.resizable and self.store_k.shape[1] > 8 and 4 * n <= self.store_k.shape[1]:
            self._resize(2 * n, self.max_len)  # most rows finished: give their memory back
        return order

    def merged(self, other: "KVCache") -> "KVCache":
        """This cache's rows, then other's (a scheduler admitting rows), in this cache (returned): other's rows are
        copied into spare rows, zeros past their room; the storage grows (half again the rows needed, at least
        the joining ones again; the longer room) when it must."""
        b, n = self.k.shape[1], other.k.shape[1]
        room = max(self.max_len, other.max_len)
        if b + n > self.store_k.shape[1] or room > self.max_len:
            self._resize(max(self.store_k.shape[1], b + n + max(n, (b + n) // 2)), room)
        t = other.max_len
        for store, new in ((self.store_k, other.k), (self.store_v, other.v)):
            store[:, b:b + n, :, :t] = new
            store[:, b:b + n, :, t:] = 0  # a spare row may hold a finished row's K/V
        self._view(b + n)
        return self

    def take(self, rows: Tensor, length: int) -> "KVCache":
        """A compact copy of some rows' first `length` positions (whole key quanta): a forward of only those rows
        of a batch (engine/decode/diffusion.py), whose new K/V `put` then copies back."""
        out = object.__new__(KVCache)
        out.store_k = out.k = self.k[:, rows, :, :length]
        out.store_v = out.v = self.v[:, rows, :, :length]
        out.max_len = length
        return out

    def put(self, rows: Tensor, part: "KVCache", lo: int, hi: int) -> None:
        """Positions [lo, hi) of `part` (from take(rows, ...)) back into those rows."""
        self.k[:, rows, :, lo:hi] = part.k[:, :, :, lo:hi]
        self.v[:, rows, :, lo:hi] = part.v[:, :, :, lo:hi]

    def write(self, layer: int, k: Tensor, v: Tensor, pos: Tensor, start: int | None) -> None:
        if start is not None:  # every row writes the same contiguous window: a plain slice copy
            self.k[layer, :, :, start:start + k.shape[2]] = k
            self.v[layer, :, :, start:start + k.shape[2]] = v
            return
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(pos)
        self.k[layer].transpose(1, 2)[rows, pos] = k.transpose(1, 2)
        self.v[layer].transpose(1, 2)[rows, pos] = v.transpose(1, 2)
