"""One compact Qwen2/Llama-family forward over a preallocated KV cache.

The same module serves AR decoding (causal), block diffusion (block-causal, cached prefix)
and training (an arbitrary boolean attention mask over [noisy || clean]).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KEY_QUANTUM, KVCache, whole_key_quanta  # noqa: F401 (KEY_QUANTUM, KVCache: re-exported)
from .config import ModelConfig

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, k, v) -> attention output, shapes as SDPA's



# Forwards inside `wide_calls()` take the wide kernels of the 4-bit CPU path (engine/weights/quant.py) at any width. An AR
# prefill runs in it: a prompt's K/V then come out the same whether it is prefilled whole (one user) or as a shared
# prefix plus a short suffix (a batch, engine/decode/), so batched answers stay the single-user ones.
WIDE_CALLS: ContextVar[bool] = ContextVar("fastdllm_wide_calls", default=False)


@contextmanager
def wide_calls() -> Iterator[None]:
    token = WIDE_CALLS.set(True)
    try:
        yield
    finally:
        WIDE_CALLS.reset(token)


# The positions per sequence of the forward whose logits the LM head computes. With `logits_idx` the head sees only
# the picked positions, padded to the batch's widest row; a head whose kernels follow the width (the 4-bit CPU head,
# engine/weights/int4.py) reads this instead, so a row's logits do not depend on its batch.
HEAD_WIDTH: ContextVar[int | None] = ContextVar("fastdllm_head_width", default=None)


def head_logits(model: "CausalLM", x: Tensor, width: int) -> Tensor:
    """model's final norm and LM head on hidden states x of a forward `width` positions wide."""
    token = HEAD_WIDTH.set(width)
    try:
        return model.lm_head(model.model.norm(x))
    finally:
        HEAD_WIDTH.reset(token)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel; same numbers in fp32
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as x*cos + rotate_half(x)*sin, where rotate_half(x) = cat(-x2, x1) = roll(x, d/2) with its first half
    negated: `sin` comes from Rope with that sign folded in, so this is 3 kernels instead of 6."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class Rope(nn.Module):
    """Rotary tables grown on demand; indexed by absolute position so rows may sit anywhere.
    The sin table has its first half negated (see `rotary`)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # A plain attribute, not a buffer: Module.to(dtype=bf16) would round it, and bf16 angles drift by
        # up to ~1.4 rad at position 1,000 (theta 1e5). The tables are computed in fp32, then cast.
        self.inv_freq = inv
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None

    def forward(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        need = int(pos.max()) + 1
        if self._cos is None or self._cos.shape[0] < need or self._cos.device != pos.device or self._cos.dtype != dtype:
            n = max(need, 2 * (self._cos.shape[0] if self._cos is not None else 1024))
            t = torch.arange(n, device=pos.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(pos.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, : sin.shape[1] // 2].neg_()
            self._cos, self._sin = emb.cos().to(dtype), sin.to(dtype)
        return self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1)  # [B, 1, T, D]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.qkv: nn.Module | None = None  # fused q|k|v of the CPU decode layout (engine/weights/packing.py)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as [B, heads, T, head_dim], RoPE applied (shared with engine/static.py's step)."""
        b, t, _ = x.shape
        if self.qkv is not None:  # q and k sit side by side in the fused output: one RoPE pass for both
            qkv = self.qkv(x)
            n = (self.h + self.hkv) * self.d
            qk = rotary(qkv[..., :n].view(b, t, self.h + self.hkv, self.d).transpose(1, 2), cos, sin)
            q, k = qk.split((self.h, self.hkv), dim=1)
            return q, k, qkv[..., n:].view(b, t, self.hkv, self.d).transpose(1, 2)
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.hkv, self.d).transpose(1, 2)
        return rotary(q, cos, sin), rotary(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, cache: KVCache | None,
                start: int | None, kv_len: int | None, mask: Tensor | Attend | None, causal: bool) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            cache.write(self.layer, k, v, pos, start)
            k = cache.k[self.layer, :, :, :kv_len]
            v = cache.v[self.layer, :, :, :kv_len]
        if mask is not None and not isinstance(mask, Tensor):  # training's structured attention (training/attention.py)
            out = mask(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                 enable_gqa=self.h != self.hkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: nn.Module | None = None  # fused gate|up of the CPU decode layout (engine/weights/packing.py)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, *args) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names follow transformers (model.layers.N..., lm_head) so checkpoints load as-is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed = False  # True after engine.weights.packing.pack_for_decode (inference only)
        # engine/weights/layer_step.py LayerSteps (set by engine/weights/quant.py): cached forwards up to a block,
        # every layer in one call of our kernels
        self.steps = None

    def forward(self, ids: Tensor, pos: Tensor, cache: KVCache | None = None, *, start: int | None = None,
                kv_len: int | None = None, mask: Tensor | Attend | None = None, causal: bool = False,
                logits_idx: Tensor | None = None, cache_rows: Tensor | None = None) -> Tensor:
        """Run ids [B, T] at absolute positions pos [B, T].

        With a cache, K/V are written at pos (a slice at `start` when all rows share it) and attention
        reads cache[:kv_len]. `mask` is boolean (True = may attend), broadcastable to [B, 1, T, keys];
        None with causal=False means every key is visible (a decode step on the block grid); a callable
        (q, k, v) -> out replaces SDPA (the training recipe's block-sparse attention).
        `logits_idx` [B, n] picks the window positions whose logits are needed (LM head only there).
        `cache_rows` [B]: the cache rows this forward's rows use (a part of a batch; None: rows 0..B-1). The one-call
        layer steps address them in place; the eager layers run on a compact copy whose new positions are put back.
        """
        # the one-call layer steps (engine/weights/csrc/layer.cpp) run cached CPU forwards up to their width
        explicit = cache is not None and ids.device.type == "cpu" and (mask is None or isinstance(mask, Tensor))
        fused = explicit and self.steps is not None and not torch.is_grad_enabled() \
            and ids.shape[1] <= self.steps.max_width and not WIDE_CALLS.get()
        if cache_rows is not None and not fused:
            n = int(pos.max()) + 1 if kv_len is None else kv_len
            part = cache.take(cache_rows, min(whole_key_quanta(n), cache.k.shape[3]))
            out = self(ids, pos, part, start=start, kv_len=kv_len, mask=mask, causal=causal, logits_idx=logits_idx)
            cache.put(cache_rows, part, int(pos.min()), int(pos.max()) + 1)
            return out
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope(pos, x.dtype)
        if cache is not None and kv_len is None:
            kv_len = int(pos.max()) + 1
        if explicit:
            mask, kv_len = _quantum_mask(pos, mask, causal, kv_len, cache.k.shape[3])
            causal = False
        if fused:
            b, t = ids.shape
            d = cos.shape[-1]
            shared = (cos.expand(b, 1, t, d).reshape(b * t, d).contiguous(), sin.expand(b, 1, t, d).reshape(b * t, d).contiguous(),
                      pos.expand(b, t).contiguous(), mask.expand(b, 1, t, mask.shape[-1]).reshape(b, t, -1).contiguous(),
                      cache_rows)
            x = self.steps(x, cache.k, cache.v, shared)
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin, pos, cache, start, kv_len, mask, causal)
        width = x.shape[1]
        if logits_idx is not None:
            x = x.gather(1, logits_idx[..., None].expand(-1, -1, x.shape[-1]))
        return head_logits(self, x, width)


def _quantum_mask(q_pos: Tensor, mask: Tensor | None, causal: bool, kv_len: int, room: int) -> tuple[Tensor, int]:
    """A cached forward's visibility as an explicit mask over n = kv_len rounded up to whole key quanta; and n."""
    n = min(whole_key_quanta(kv_len), room)
    if mask is not None:
        return F.pad(mask, (0, n - mask.shape[-1]), value=False), n
    if causal:
        return causal_mask(q_pos, n), n
    return (torch.arange(n, device=q_pos.device) < kv_len)[None, None, None, :], n


def block_causal_mask(q_pos: Tensor, k_len: int, block_size: int, valid_len: Tensor | None = None) -> Tensor:
    """Block-causal visibility [B, 1, T, k_len]: a key is visible when its block <= the query's block."""
    k = torch.arange(k_len, device=q_pos.device)
    allowed = (k[None, None, :] // block_size) <= (q_pos[:, :, None] // block_size)
    if valid_len is not None:
        allowed = allowed & (k[None, None, :] < valid_len[:, None, None])
    return allowed[:, None]


def causal_mask(q_pos: Tensor, k_len: int, valid_len: Tensor | None = None) -> Tensor:
    """Causal visibility [B, 1, T, k_len] for rows at different absolute positions."""
    k = torch.arange(k_len, device=q_pos.device)
    allowed = k[None, None, :] <= q_pos[:, :, None]
    if valid_len is not None:
        allowed = allowed & (k[None, None, :] < valid_len[:, None, None])
    return allowed[:, None]
