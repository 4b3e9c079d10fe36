"""The dLLM's LoRA adapter as a separate low-rank path, (x A^T) B^T on top of the shared 4-bit base weights
(engine/weights/int4.py's Int4Linear and DenseBF16Linear add it to their output)."""
from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn


def exact_weights(t: Tensor, kernels: ModuleType | None) -> Tensor:
    """`t` as bf16 where our LoRA kernel runs and bf16 holds every value exactly (the adapter file's bf16 weights,
    B times a power-of-two scale) and its inputs pair up (even), else fp32: half the bytes a forward streams, the same
    numbers."""
    t = t.float().contiguous()
    if kernels is not None and t.shape[0] % 2 == 0 and torch.equal(t.bfloat16().float(), t):
        return t.bfloat16()
    return t


PANEL = 32  # outputs per panel of lora.cpp's layout


def panels(t: Tensor) -> Tensor:
    """t [K, N] -> [ceil(N / 32), K, 32], zero past N: each 32-output panel contiguous, read by lora.cpp as one
    sequential stream. bf16 (K even): each k-pair's two panel rows interleaved as [32][2] (k and k + 1 of an output
    side by side in a dword, which lora.cpp splits with one shift or one and per 16 weights)."""
    k, n = t.shape
    c = -(-n // PANEL)
    p = torch.nn.functional.pad(t, (0, c * PANEL - n)).reshape(k, c, PANEL).permute(1, 0, 2)
    if t.dtype == torch.bfloat16:
        p = p.reshape(c, k // 2, 2, PANEL).transpose(2, 3).reshape(c, k, PANEL)
    return p.contiguous()


def unpanel(p: Tensor, n: int) -> Tensor:
    """panels' inverse: [C, K, 32] -> [K, n]."""
    c, k, _ = p.shape
    if p.dtype == torch.bfloat16:
        p = p.reshape(c, k // 2, PANEL, 2).transpose(2, 3).reshape(c, k, PANEL)
    return p.permute(1, 0, 2).reshape(k, -1)[:, :n]


class LoRA(nn.Module):
    """A fused low-rank delta: h = x A^T for every fused part in one product, then each part's B adds into its own
    slice of the output (no block-diagonal zeros: q|k|v's were 2/3 zeros); the scale is folded into B; parts
    without an adapter are skipped. With our kernels (`kernels`): one call, `lora_add` (engine/weights/csrc/lora.cpp),
    the weights as exact as the file (bf16 when it holds them) in its panel layout (`panels`: a_t and each b_t as
    [outputs / 32, inputs, 32]), each row summed on its own (fp32 FMAs; beside a bf16 product on AMX tiles, Int4Linear
    and layer.cpp call q4_bf16_lora, which runs the delta on tiles too: bench/results/lora_amx/); otherwise ATen's fp32
    products (on this CPU a small bf16 GEMM costs a ~25 us floor in oneDNN, fp32 ones 3-25 us)."""

    def __init__(self, parts: list[tuple[Tensor, Tensor] | None], outs: list[int], scale: float,
                 kernels: ModuleType | None = None):
        super().__init__()
        self.kernels = kernels
        kept = [(i, p) for i, p in enumerate(parts) if p is not None]
        lay = panels if kernels is not None else (lambda t: t)
        self.rank = sum(p[0].shape[0] for _, p in kept)
        self.register_buffer("a_t", lay(exact_weights(torch.cat([p[0].float() for _, p in kept], 0).t(), kernels)))
        starts = [sum(outs[:i]) for i in range(len(outs))]
        self.slices: list[tuple[str, int, int, int, int]] = []  # (B buffer, rank start, rank end, out start, out end)
        r0 = 0
        for j, (i, (a, b)) in enumerate(kept):
            self.register_buffer(f"b_t{j}", lay(exact_weights((b.float() * scale).t(), kernels)))
            self.slices.append((f"b_t{j}", r0, r0 + a.shape[0], starts[i], starts[i] + outs[i]))
            r0 += a.shape[0]
        self.whole = len(kept) == 1 and len(outs) == 1
        self.bounds = [v for _, *r in self.slices for v in r]  # lora_add's (r0, r1, o0, o1) per B, flat

    def b_list(self) -> list[Tensor]:
        """Each part's B buffer, in `bounds`' order (lora_add's and q4_bf16_lora's list)."""
        return [self._buffers[b] for b, *_ in self.slices]

    def add_to(self, y: Tensor, x: Tensor) -> Tensor:
        """y [rows, sum outs] += the delta for x [rows, in], in place (both fp32)."""
        if self.kernels is not None and y.dtype == torch.float32 and y.is_contiguous():
            return self.kernels.lora_add(y, x.float().contiguous(), self.a_t, self.b_list(), self.bounds)
        h = x.to(torch.float32) @ self._plain("a_t", self.rank)
        if self.whole:
            return y.addmm_(h, self._plain("b_t0", self.slices[0][4] - self.slices[0][3]))
        for b, r0, r1, o0, o1 in self.slices:
            y[:, o0:o1].addmm_(h[:, r0:r1], self._plain(b, o1 - o0))
        return y

    def _plain(self, name: str, n: int) -> Tensor:
        """A buffer as [inputs, n] fp32 (the ATen path; with our kernels it is stored in panels)."""
        t = self._buffers[name]
        return (unpanel(t, n) if self.kernels is not None else t).float()
