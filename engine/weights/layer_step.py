"""One decoder layer's cached forward (up to a block) as one call of our kernels (engine/weights/csrc/layer.cpp), for
layers whose four projections are 4-bit on our kernels (engine/weights/int4.py)."""
from __future__ import annotations

from types import ModuleType

from torch import Tensor, nn

from .int4 import FUSED_MAX_WIDTH, Int4Linear


class LayerStep:
    """One decoder layer's narrow forward as a single call of our kernels (engine/weights/csrc/layer.cpp), for layers whose
    four projections are Int4Linear on our kernels. Holds the layer's tensors, gathered once: the model is
    inference-only once its weights are quantised."""

    def __init__(self, layer: nn.Module, kernels: ModuleType, act: str):
        attn, mlp = layer.self_attn, layer.mlp
        projs = [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj]
        self.kernels, self.int8 = kernels, act == "int8"
        self.wide_rows = projs[0].wide_rows
        # widths it takes: below wide_rows; up to a block (FUSED_MAX_WIDTH) when wide calls have q4_bf16 or q4_i8w
        self.wide_mode = 2 if all(p.weight.wide_int8 for p in projs) else 1  # layer.cpp: 1 = q4_bf16, 2 = q4_i8w
        self.max_width = FUSED_MAX_WIDTH if all(p.weight.wide_bf16 or p.weight.wide_int8 for p in projs) \
            and self.wide_rows is not None \
            else (self.wide_rows or FUSED_MAX_WIDTH + 1) - 1
        self.heads, self.kv_heads = attn.h, attn.hkv
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.weights = [t for p in projs for t in (p.weight.qs, p.weight.dm)]
        if all(p.weight.pk is not None for p in projs):  # layer.cpp runs int8 products on the prepacked copies
            self.weights += [t for p in projs for t in (p.weight.pk, p.weight.ps)]
        self.lora_a = [p.lora.a_t if p.lora is not None else None for p in projs]
        self.lora_b = [p.lora.b_list() if p.lora is not None else [] for p in projs]
        self.slices = [p.lora.bounds if p.lora is not None else [] for p in projs]
        self.qkv_bias = projs[0].bias

    @staticmethod
    def fits(layer: nn.Module) -> bool:
        """Four Int4Linear on our kernels, a bias only on q|k|v (Qwen2's), a head dim up to 128."""
        projs = [layer.self_attn.qkv, layer.mlp.gate_up, layer.self_attn.o_proj, layer.mlp.down_proj]
        return all(isinstance(p, Int4Linear) and p.weight.kernels is not None for p in projs) \
            and all(p.bias is None for p in projs[1:]) and layer.self_attn.d % 16 == 0 and layer.self_attn.d <= 128

    def wide(self, width: int) -> int:
        """layer.cpp's product mode for a forward of `width` positions: 0 (one-token kernels) below the switch point,
        else wide_mode."""
        return self.wide_mode if self.wide_rows is not None and width >= self.wide_rows else 0

    def __call__(self, x: Tensor, cache_k: Tensor, cache_v: Tensor,
                 shared: tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]) -> Tensor:
        cos, sin, pos, mask, cache_rows = shared  # cache_rows: the cache rows of x's rows (None: 0..B-1)
        return self.kernels.layer_step(x, self.norm1, self.norm2, self.eps, self.weights, self.lora_a, self.lora_b,
                                       self.slices, self.int8, self.wide(x.shape[1]), self.heads, self.kv_heads, cos,
                                       sin, cache_k, cache_v, pos, mask, self.qkv_bias, cache_rows)


class LayerSteps(list):
    """A model's LayerStep per layer, run as one call of the kernels (layer.cpp's LayerStack, which holds every
    layer's tensors from here on): a forward crosses from Python once instead of once per layer, each of which
    converted ~30 tensors (3-4 % of a 1-token forward on the bundled model)."""

    def __init__(self, steps: list[LayerStep]):
        super().__init__(steps)
        s = steps[0]
        self.stack = s.kernels.LayerStack([t.norm1 for t in steps], [t.norm2 for t in steps], s.eps,
                                          [t.weights for t in steps], [t.lora_a for t in steps],
                                          [t.lora_b for t in steps], [t.slices for t in steps],
                                          [t.qkv_bias for t in steps], s.int8, s.heads, s.kv_heads)

    def __call__(self, x: Tensor, cache_k: Tensor, cache_v: Tensor,
                 shared: tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]) -> Tensor:
        """x through every layer; cache_k / cache_v: the KV cache's [layers, B, kv_heads, len, D]."""
        return self.stack.forward(x, self[0].wide(x.shape[1]), cache_k, cache_v, *shared)

    @property
    def max_width(self) -> int:
        return self[0].max_width
