"""Static-shape decode steps over a static KV cache, captured as CUDA graphs on GPUs (gpt-fast's decode loop).

Every cached decode forward has one of three widths: 1 (the AR step), sub_block + 1 (the dual-cache
sub-block step: the sub-block and the token before it), or block (block-cache step, dual refresh, commit).
A step's window is padded to its width, row by row (in a dual-cache step a row's own forward may be narrower than
the step's: the first sub-block's window, or a sub-block step beside a refresh; its pads write only the trash slot,
so every row writes the K/V it would write alone), and its logit rows to a power of two, so each (rows, width,
logit rows) is one fixed shape: on CUDA it is captured once as a graph and replayed (one launch instead of ~400
small kernels); on CPU the same code runs eagerly. Batches of more than EXACT_ROWS rows are padded to a row
bucket (`row_bucket`): a 512-row batch whose rows finish one by one would otherwise need a graph for nearly
every row count (a capture costs about two eager steps); with buckets it needs at most 18 per width.
What differs from CausalLM.forward, and why:
  * K/V are scattered to per-row write positions; pad slots write to a trash slot past every row's end,
    so padding never changes what later steps read;
  * attention reads the cache's whole capacity with a per-row key-length mask (key < end), so the shapes
    do not depend on how far decoding has got;
  * RoPE rows are gathered from a table sized to the capacity: no int(pos.max()) host sync.
Prefill and the `none` cache (variable widths) stay on CausalLM.forward; they write the same cache.
A step returns logits only: sampling and the repetition knobs (engine/penalties.py, per row) run on them in the
Decoder, the same on both paths, so the knobs need no route of their own here (tests/test_penalties.py).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .model import CausalLM, KVCache, head_logits
from .runtime import Runtime


EXACT_ROWS = 8  # up to here each row count gets its own shape (studio, serve: few rows, no padded work)


def row_bucket(rows: int) -> int:
    """The row count a step of `rows` live rows runs at: exact up to EXACT_ROWS, then the next power of two up
    to 64, then the next multiple of 64 (pad rows cost little on a GPU; each distinct count costs a capture)."""
    if rows <= EXACT_ROWS:
        return rows
    return 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64


def wanted(device: torch.device, runtime: Runtime | None = None) -> bool:
    """FASTDLLM_STATIC=1/0 forces the static path on/off; default: on for CUDA, off for CPU (measured slower
    there: attention over the whole capacity and padded windows cost more than the host work saved)."""
    val = (runtime or Runtime.from_env()).static
    return val if val is not None else device.type == "cuda"


def graphs_wanted(device: torch.device, runtime: Runtime | None = None) -> bool:
    """CUDA graphs on CUDA unless FASTDLLM_GRAPHS=0 (static shapes without capture, for debugging), and not on
    Hugging Face ZeroGPU (SPACES_ZERO_GPU set): there each request runs in a process that holds the GPU only
    for that call, so graphs captured in one call would not outlive it."""
    if os.environ.get("SPACES_ZERO_GPU"):
        return False
    return device.type == "cuda" and (runtime or Runtime.from_env()).graphs


class StaticKVCache(KVCache):
    """A view of the first `batch` rows of the stepper's storage: addresses stay fixed across decodes, so
    captured graphs stay valid; finished rows leave by compacting in place, not by reallocating."""

    resizable = False  # compact() keeps the storage: captured graphs hold its addresses

    def __init__(self, k: Tensor, v: Tensor, batch: int):  # noqa: D107 (no KVCache.__init__: no allocation)
        self.store_k, self.store_v = k, v
        self.k, self.v = k[:, :batch], v[:, :batch]
        self.max_len = k.shape[3] - 1  # the last slot is the trash slot of pad writes

    def keep_rows(self, rows: Tensor) -> None:
        n = rows.numel()
        self.store_k[:, :n] = self.store_k[:, :self.k.shape[1]].index_select(1, rows)
        self.store_v[:, :n] = self.store_v[:, :self.v.shape[1]].index_select(1, rows)
        self.k, self.v = self.store_k[:, :n], self.store_v[:, :n]


@dataclass
class _Shape:
    """Static inputs and output of one (rows, width, logit rows) step, and its graph once captured."""

    ids: Tensor  # [B, W] token ids
    pos: Tensor  # [B, W] absolute positions (RoPE)
    write: Tensor  # [B, W] cache slot each position's K/V goes to (pads: the trash slot)
    ends: Tensor  # [B] keys < end are visible (the block grid makes every cached key before it visible)
    idx: Tensor  # [B, N] window positions whose logits are needed
    out: Tensor | None = None
    graph: "torch.cuda.CUDAGraph | None" = None


def static_layer(layer: torch.nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, k_cache: Tensor,
                 v_cache: Tensor, write: Tensor) -> Tensor:
    """One decoder layer of a static step: K/V scattered to their slots, attention over the whole capacity.
    Every layer runs this same code on same-shaped tensors, so `torch.compile` of it (FASTDLLM_COMPILE) compiles
    once and serves all layers (regional compilation: seconds, not the minutes of a whole unrolled model)."""
    att = layer.self_attn
    b, t, _ = x.shape
    q, k, v = att.project(layer.input_layernorm(x), cos, sin)
    slots = write[:, None, :, None].expand(b, att.hkv, t, att.d)
    k_cache.scatter_(2, slots, k)
    v_cache.scatter_(2, slots, v)
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=att.h != att.hkv)
    x = x + att.o_proj(out.transpose(1, 2).reshape(b, t, att.h * att.d))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def static_forward(model: CausalLM, cos_t: Tensor, sin_t: Tensor, keys: Tensor, cache: StaticKVCache,
                   s: _Shape, layer_fn=static_layer) -> Tensor:
    """CausalLM.forward for a decode step, with static shapes and no host sync (see the module docstring)."""
    x = model.model.embed_tokens(s.ids)
    cos, sin = cos_t[s.pos].unsqueeze(1), sin_t[s.pos].unsqueeze(1)
    mask = (keys[None, :] < s.ends[:, None])[:, None, None, :]  # [B, 1, 1, capacity]
    for i, layer in enumerate(model.model.layers):
        x = layer_fn(layer, x, cos, sin, mask, cache.k[i], cache.v[i], s.write)
    width = x.shape[1]
    x = x.gather(1, s.idx[..., None].expand(-1, -1, x.shape[-1]))
    return head_logits(model, x, width)


def compile_wanted(runtime: Runtime | None = None) -> bool:
    """FASTDLLM_COMPILE=1: torch.compile each static step's layer (fuses the ~50 small kernels a layer replays
    around fp32 RMSNorm and RoPE; see docs/gpu.md). Off by default: it costs a compile per step shape at start."""
    return (runtime or Runtime.from_env()).compile


def compiled_layer(backend: str = "inductor"):
    """static_layer under torch.compile, one per process and backend (the compiled code is shared by every
    stepper's layers). dynamic=False: each (rows, width) is its own specialised graph, which is what CUDA graphs
    replay anyway. Tests use backend "eager" (dynamo's tracing and guards without code generation)."""
    if backend not in _COMPILED:
        import torch._dynamo

        # one graph per step shape; the default limit (8) would send a busy server's later shapes to eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED[backend] = torch.compile(static_layer, dynamic=False, backend=backend)
    return _COMPILED[backend]


_COMPILED: dict[str, object] = {}


class StaticStepper:
    """Owns the static KV storage, RoPE tables and per-shape buffers (and graphs) of one model."""

    def __init__(self, model: CausalLM, graphs: bool = False, quantum: int = 256, compile: bool | str = False):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.model.norm.weight.dtype  # (a 4-bit model's embedding is int8)
        self.graphs = graphs and self.device.type == "cuda"
        self.quantum = quantum  # capacity grows in these steps, so one set of graphs serves many prompt lengths
        self.rows = self.capacity = 0
        self.shapes: dict[tuple[int, int, int], _Shape] = {}
        self.pool = None
        self.captured = 0  # graphs captured so far (tests and benchmarks read it)
        self.graph_error: str | None = None  # why capture failed, if it did (the steps then run uncaptured)
        # compile: True = torch.compile's default backend (inductor), a string = that backend
        self.layer_fn = compiled_layer(compile if isinstance(compile, str) else "inductor") if compile else static_layer
        self.compile_error: str | None = None  # why compiling failed, if it did (the steps then run uncompiled)

    # ------------------------------------------------------------ cache
    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A cache for `batch` rows of `max_len` positions; storage is reused while it is big enough."""
        self._room(row_bucket(batch), self._capacity_for(max_len), keep=0)
        return StaticKVCache(self.k, self.v, batch)

    def join(self, running: StaticKVCache | None, kept: int, new: KVCache, added: int, max_len: int) -> StaticKVCache:
        """Rows joining a running batch (continuous batching): the `kept` rows of `running` stay where they are,
        the `added` rows of `new` (a plain cache their prefill wrote) are copied in after them. The storage grows
        when it must, keeping what the running rows hold; its graphs are then captured again on their next step."""
        self._room(row_bucket(kept + added), self._capacity_for(max_len), keep=kept if running is not None else 0)
        t = min(new.k.shape[3], self.capacity)
        self.k[:, kept:kept + added, :, :t] = new.k[:, :added, :, :t]
        self.v[:, kept:kept + added, :, :t] = new.v[:, :added, :, :t]
        return StaticKVCache(self.k, self.v, kept + added)

    def _capacity_for(self, max_len: int) -> int:
        return -(-(max_len + 1) // self.quantum) * self.quantum  # +1: the trash slot

    def _room(self, rows: int, need: int, keep: int) -> None:
        """Storage of at least `rows` rows and `need` positions; its first `keep` rows survive a regrowth."""
        if rows <= self.rows and need <= self.capacity:
            return
        rows, need = max(rows, self.rows), max(need, self.capacity)
        cfg = self.model.cfg
        shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, need, cfg.head_dim)
        old_k, old_v, old_cap = (self.k, self.v, self.capacity) if keep else (None, None, 0)
        self.k = self.v = None  # (without rows to keep, the old storage is freed before the new one is taken)
        try:  # zeros, not empty: masked keys still meet V in SDPA's math backend, and 0 * NaN would be NaN
            k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        except RuntimeError:  # out of memory: running rows keep the storage they had; else there is none now
            if keep:
                self.k, self.v = old_k, old_v
            else:
                self.rows = self.capacity = 0
                self.shapes.clear()
            raise
        if keep:  # the running rows' K/V move with them (their positions are unchanged; not the old trash slot)
            k[:, :keep, :, :old_cap - 1] = old_k[:, :keep, :, :old_cap - 1]
            v[:, :keep, :, :old_cap - 1] = old_v[:, :keep, :, :old_cap - 1]
        del old_k, old_v
        self.k, self.v, self.rows, self.capacity = k, v, rows, need
        self.shapes.clear()  # graphs point into the old storage
        # and a new pool: once its graphs are gone, the old pool's use count is 0, and capturing into it
        # again fails an allocator assert (it->second->use_count > 0; seen on the H100 in selfinstruct)
        self.pool = None
        self.keys = torch.arange(self.capacity, device=self.device)
        # the model's own RoPE table (same values as the eager path), grown to the capacity once
        self.model.rope(torch.tensor([self.capacity - 1], device=self.device), self.dtype)
        self.cos, self.sin = self.model.rope._cos, self.model.rope._sin

    # ------------------------------------------------------------ one step
    def step(self, ids: Tensor, pos: Tensor, cache: StaticKVCache, ends: list[int], logits_idx: Tensor,
             width: int, lengths: list[int] | None = None) -> Tensor:
        """Logits [B, n] for a decode step over window ids/pos [B, w <= width] (padded to `width`). lengths: the
        real positions of each row's window (default all w); the rest are pads, as those past w are, so rows whose
        own forwards differ in width share one step without one of them writing K/V it would not write alone."""
        b, w = ids.shape
        n = logits_idx.shape[1]
        if w > width:
            raise ValueError(f"width: the window has {w} tokens, more than the step width {width}")
        rows = row_bucket(b)  # new_cache made room for it
        key = (rows, width, min(width, 1 << (n - 1).bit_length()))
        s = self.shapes.get(key)
        if s is None:
            s = self.shapes[key] = self._alloc(*key)
        s.ids[:b, :w].copy_(ids)
        s.pos[:b, :w].copy_(pos)
        s.write[:b, :w].copy_(pos)
        if lengths is not None and min(lengths) < w:
            pad = torch.arange(w, device=self.device)[None] >= torch.tensor(lengths, device=self.device)[:, None]
            s.write[:b, :w].masked_fill_(pad, self.capacity - 1)
        if w < width:  # pads: token 0 at the last real position, K/V to the trash slot, output unused
            s.ids[:b, w:] = 0
            s.pos[:b, w:] = pos[:, -1:]
            s.write[:b, w:] = self.capacity - 1
        if rows > b:  # pad rows (storage rows past the live ones): K/V to the trash slot, one visible key
            s.ids[b:] = 0
            s.pos[b:] = 0
            s.write[b:] = self.capacity - 1
        s.ends.copy_(torch.tensor(ends + [1] * (rows - b), dtype=torch.long))
        s.idx.zero_()
        s.idx[:b, :n].copy_(logits_idx)
        if rows > b:  # the same storage, `rows` rows wide: every row's work stays in its row
            cache = StaticKVCache(cache.store_k, cache.store_v, rows)
        if self.layer_fn is not static_layer and s.out is None:
            try:  # compile (or fetch) this shape's graph before any capture; a failure falls back to eager layers
                s.out = self._forward(cache, s)
            except Exception as exc:  # noqa: BLE001 - a backend error must not stop decoding
                self.layer_fn, self.compile_error = static_layer, f"{type(exc).__name__}: {exc}"[:500]
                warnings.warn(f"torch.compile of the static layer failed; steps run uncompiled: {self.compile_error}")
        if s.graph is None and self.graphs:
            try:
                self._capture(s, cache)
            except RuntimeError as exc:  # an op that cannot be captured here: decode on, uncaptured, and say why
                self.graphs, self.graph_error, s.graph = False, f"{type(exc).__name__}: {exc}"[:500], None
                warnings.warn(f"CUDA graph capture failed; static steps run uncaptured: {self.graph_error}")
        if s.graph is None:
            return self._forward(cache, s)[:b, :n]
        s.graph.replay()
        return s.out[:b, :n]

    def _forward(self, cache: StaticKVCache, s: _Shape) -> Tensor:
        return static_forward(self.model, self.cos, self.sin, self.keys, cache, s, self.layer_fn)

    def _alloc(self, b: int, width: int, n: int) -> _Shape:
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=self.device)  # noqa: E731
        return _Shape(ids=z(b, width), pos=z(b, width), write=z(b, width), ends=z(b), idx=z(b, n))

    def _capture(self, s: _Shape, cache: StaticKVCache) -> None:
        """Warm up on a side stream (lazy inits, autotuning), then record one replayable step."""
        run = lambda: self._forward(cache, s)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # the K/V it writes are the same the replay writes next: harmless
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        s.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(s.graph, pool=self.pool):
            s.out = run()
        self.captured += 1
