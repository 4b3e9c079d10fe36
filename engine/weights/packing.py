"""The CPU decode layout: projections stored transposed ([in, out]) and fused (q|k|v, gate|up), LM head untied.

A decode step multiplies one (AR) or a few (diffusion) vectors by every weight, so on a CPU its cost is
streaming the weights from memory. PyTorch's CPU kernels stream a [in, out]-contiguous matrix through
x @ W about 1.5-2x faster than nn.Linear's [out, in] layout when `in` is small (SmolLM2: 576), and
fewer, larger matrices stream better than many small ones (`python -m bench roofline` measures both).
Same weights, same dtype, same arithmetic; only the memory layout (and so the summation order) changes.
Multi-token forwards (diffusion steps) get 5-9 % slower in this layout, so Engine.load packs the AR model
only (and a model that serves both modes). Done once at load, after any adapter is merged; training and
export never see packed models.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor, nn

from ..model import CausalLM


class PackedLinear(nn.Module):
    """y = x @ weight_t (+ bias) for one or several fused nn.Linear; `splits` = their output widths."""

    def __init__(self, *linears: nn.Linear):
        super().__init__()
        w = torch.cat([lin.weight.detach() for lin in linears], 0)
        self.weight_t = nn.Parameter(w.t().contiguous(), requires_grad=False)
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases):
            b = torch.cat([lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features)
                           for lin in linears])
            self.bias = nn.Parameter(b, requires_grad=False)
        else:
            self.bias = None
        self.splits = [lin.out_features for lin in linears]

    def forward(self, x: Tensor) -> Tensor:
        y = torch.matmul(x, self.weight_t)
        return y + self.bias if self.bias is not None else y


def wanted(device: torch.device, pack: bool = True) -> bool:
    """Pack on CPU unless FASTDLLM_PACK=0 (`pack`: Runtime.pack; GPU GEMM kernels are layout-agnostic)."""
    return device.type == "cpu" and pack


def pack_for_decode(model: CausalLM) -> CausalLM:
    """Repack `model` in place (idempotent)."""
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        if att.qkv is None:
            att.qkv = PackedLinear(att.q_proj, att.k_proj, att.v_proj)
            att.o_proj = PackedLinear(att.o_proj)
            att.q_proj = att.k_proj = att.v_proj = None
        if mlp.gate_up is None:
            mlp.gate_up = PackedLinear(mlp.gate_proj, mlp.up_proj)
            mlp.down_proj = PackedLinear(mlp.down_proj)
            mlp.gate_proj = mlp.up_proj = None
    if not isinstance(model.lm_head, PackedLinear):
        model.lm_head = PackedLinear(model.lm_head)  # tied models keep the embedding for lookups, untouched
    model.packed = True
    return model


def release_freed_memory() -> None:
    """Hand the replaced [out, in] weights' pages back to the OS (glibc keeps freed heap otherwise:
    +650 MB of RSS for the bundled model); a no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
