"""Attention for the recipe's packed row [noisy_1 ‖ … ‖ noisy_V ‖ clean] (DESIGN.md §3), three ways.

The rule, per query/key pair: same segment and same block, or the key is clean and in a strictly
earlier block; keys past a row's visible length are hidden (a padding query keeps itself).
Only ~1/5 of the (V+1)L x (V+1)L pairs are allowed at L = 224, so a dense mask wastes most of the work:

* ``dense``: SDPA with the boolean mask (any recipe; the reference the others are tested against).
* ``blockwise``: one unmasked SDPA call per block, every segment at once: query block c of any segment
  sees the clean prefix [0, c*bs) plus its own segment's block c, which is exactly the rule when every
  block is wholly real or wholly padding (the "+pad" recipes). Real queries never see a padding block
  (it lies after them); padding queries attend to something finite and carry no loss. CPU default.
* ``flex``: ``flex_attention`` with a BlockMask built from the same rule (skips empty tiles); CUDA only
  (torch has no flex backward on CPU). Its forward runs on CPU eagerly, which is how the tests check it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

IMPLS = ("auto", "dense", "blockwise", "flex")


def allowed(qi: Tensor, ki: Tensor, visible: Tensor, length: int, views: int, block_size: int) -> Tensor:
    """The recipe's visibility for query/key indices into the packed row (broadcasts; flex mask_mod too)."""
    sq, sk = qi // length, ki // length
    pq, pk = qi % length, ki % length
    bq, bk = pq // block_size, pk // block_size
    ok = ((sq == sk) & (bq == bk)) | ((sk == views) & (bk < bq))
    return (ok & (pk < visible)) | ((qi == ki) & (pq >= visible))


def dense_mask(length: int, visible: Tensor, views: int, block_size: int) -> Tensor:
    """[B, 1, T, T] boolean mask (True = may attend), T = (views + 1) * length."""
    idx = torch.arange((views + 1) * length, device=visible.device)
    return allowed(idx[None, :, None], idx[None, None, :], visible[:, None, None], length, views, block_size)[:, None]


@dataclass(frozen=True)
class Blockwise:
    """Per-block SDPA over the packed row; needs block-aligned visible lengths (see module doc)."""

    length: int
    views: int
    block_size: int

    @torch.compiler.disable  # under --compile the layer's graph breaks here; this loop of SDPA calls stays eager
    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, h, t, d = q.shape
        s, bs = self.views + 1, self.block_size
        q5 = q.view(b, h, s, self.length, d)
        k5, v5 = (x.view(b, x.shape[1], s, self.length, d) for x in (k, v))
        outs = []
        for start in range(0, self.length, bs):
            qc = q5[:, :, :, start:start + bs].transpose(1, 2).reshape(b * s, h, bs, d)
            kc, vc = (self._keys(x, start) for x in (k5, v5))
            out = F.scaled_dot_product_attention(qc, kc, vc, enable_gqa=h != kc.shape[1])
            outs.append(out.view(b, s, h, bs, d))
        return torch.cat(outs, dim=3).transpose(1, 2).reshape(b, h, t, d)

    def _keys(self, x5: Tensor, start: int) -> Tensor:
        """Clean prefix [0, start) shared by every segment, then each segment's own block."""
        b, hkv, s, _, d = x5.shape
        own = x5[:, :, :, start:start + self.block_size].transpose(1, 2)  # [b, s, hkv, bs, d]
        if start == 0:
            return own.reshape(b * s, hkv, self.block_size, d)
        prefix = x5[:, :, self.views, :start].unsqueeze(1).expand(b, s, hkv, start, d)
        return torch.cat([prefix, own], dim=3).reshape(b * s, hkv, start + self.block_size, d)


_compiled_flex: Callable | None = None
flex_error: str | None = None  # why flex_attention failed in this process; `auto` then stops choosing it


def flex_available(device: torch.device) -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" and flex_error is None


class Flex:
    """flex_attention with a BlockMask from `allowed`, built once per batch and shared by every layer
    (compiled on CUDA; eager elsewhere, forward only).

    If flex fails (an untested GPU machine's compiler, or a backward on CPU), the batch goes on with the
    dense mask and a warning, and `auto` picks blockwise/dense from then on: GPU minutes are not lost."""

    def __init__(self, length: int, views: int, block_size: int, visible: Tensor):
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, qi, ki):
            return allowed(qi, ki, visible[b], length, views, block_size)

        self.length, self.views, self.block_size, self.visible = length, views, block_size, visible
        t = (views + 1) * length
        self.block_mask = create_block_mask(mask_mod, len(visible), None, t, t, device=visible.device)
        self._dense: Tensor | None = None

    @torch.compiler.disable  # under --compile the layer's graph breaks here: flex keeps its own compiled kernel
    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        global _compiled_flex, flex_error
        gqa = q.shape[1] != k.shape[1]
        if flex_error is None:
            fn = flex_attention
            if q.device.type == "cuda":  # torch.compile's automatic dynamic shapes cover the varying row length
                _compiled_flex = _compiled_flex or torch.compile(flex_attention)
                fn = _compiled_flex
            try:
                return fn(q, k, v, block_mask=self.block_mask, enable_gqa=gqa)
            except Exception as exc:  # noqa: BLE001 - any failure: fall back, exactly, and say so
                flex_error = f"{type(exc).__name__}: {exc}"[:300]
                warnings.warn(f"flex_attention failed ({flex_error}); using the dense mask for this batch and "
                              "blockwise/dense attention after it", RuntimeWarning, stacklevel=2)
        if self._dense is None:
            self._dense = dense_mask(self.length, self.visible, self.views, self.block_size)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._dense, enable_gqa=gqa)


def choose(impl: str, device: torch.device, block_aligned: bool) -> str:
    """Resolve `auto`: flex on CUDA, blockwise where every block is wholly real or padding, else dense."""
    if impl not in IMPLS:
        raise ValueError(f"attention must be one of {IMPLS} (got {impl!r})")
    if impl == "blockwise" and not block_aligned:
        raise ValueError("attention 'blockwise' needs block-aligned sequences (recipe 'pad' or 'full', not 'naive')")
    if impl == "flex" and not flex_available(device):
        why = f"it failed earlier in this process ({flex_error})" if flex_error else f"device: {device}"
        raise ValueError(f"attention 'flex' needs CUDA and torch.nn.attention.flex_attention ({why})")
    if impl != "auto":
        return impl
    if flex_available(device):
        return "flex"
    return "blockwise" if block_aligned else "dense"
