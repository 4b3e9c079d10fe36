"""4-bit layers at run time: the bundled GGUF's Q4_1 blocks (projections) and Q8_0 rows (tied embedding / LM head),
kept as stored.

A Q4_1 block stores 32 weights as q in 0..15 with an fp16 scale d and minimum m: w = d*q + m. Two backends:
* ours (engine/weights/kernels.py, engine/weights/csrc/; CPUs with AVX-512 VNNI and a C++ compiler): narrow calls multiply
  the file's q, d, m with fp32 activations (the fp32 path's numbers up to summation order) or, with
  FASTDLLM_ACTIVATIONS=int8, int8 ones per 32-group (VNNI, q4_i8w); wide calls dequantise tiles to bf16 in L1
  (q4_bf16, AVX-512 BF16; elsewhere a dense bf16 copy) or, with FASTDLLM_WIDE_ACTIVATIONS=int8, run q4_i8w too;
  the head keeps its Q8_0 rows as stored (q8_f32 / q8_bf16 / q8_i8w alike); the adapter's LoRA is one call
  (lora_add; beside q4_bf16 one call with the product, q4_bf16_lora, on AMX tiles from the product's bf16 x); int8
  calls read a copy prepacked at load where the model has one (q4_i8p / q8_i8p, engine/weights/quant.py
  PREPACK_MAX_BYTES); and `LayerStep` (layer_step.py) runs a decoder layer of a cached forward in one C++ call.
* torch (fallback, or FASTDLLM_KERNELS=torch): w = d*(q - 8) + (m + 8d) is torch's int4 weight-only format with
  group size 32 (`aten._weight_int4pack_mm_for_cpu`), bf16 activations and scales; a dense bf16 copy for wide
  calls; the Q8_0 head as two int4 planes (q = 16 hi + lo) below HEAD_WIDE_ROWS positions, dense bf16 above.
"Narrow" and "wide" split at `wide_rows` positions of one sequence (FASTDLLM_INT4_WIDE_ROWS), not rows of the
batch, so a batch of AR rows (1 position each) runs the same kernels as each row alone: batched greedy answers
equal single-user ones (a scheduler admitting users must not change anyone's tokens).

The dLLM's LoRA adapter stays a separate low-rank path (x A^T) B^T on top of the shared base weights:
base and dLLM share one copy of the 4-bit weights, and no merged weight is re-quantised.

FASTDLLM_WEIGHTS picks the projection weights of the bundled model on CPU: int4+bf16 (default), int4 (4-bit at
every width), bf16, fp32 (the dequantised path).
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels as cpu_kernels
from ..model import HEAD_WIDTH, WIDE_CALLS
from .gguf import GROUP, Q4Blocks
from .lora import LoRA

HEAD_WIDE_ROWS = 4  # LM head: int4 planes below, dense bf16 from here (7.4 vs 14.8 ms at 1 row, 25.5 vs 20.7 at 8);
# counted per sequence, so an 8-row AR batch pays the 25.5 ms to keep every row's logits equal to its own alone
FUSED_MAX_WIDTH = 32  # widest forward the one-call layer step takes (a block step); prefills stay eager
# Where wide calls start (bf16 activations, projections and head), per backend. Ours: at 2 positions per sequence, so
# every forward of several positions (diffusion sub-block, refresh and commit steps, prefills) runs bf16 activations
# and only the one-position AR step keeps fp32 ones (the fp32 path's numbers). Judged by answers, not token identity:
# bench/results/wide_bf16/ (issue 23). FASTDLLM_INT4_WIDE_ROWS=33 gives the fp32-activation steps of before. torch's
# int4 kernel: at 16, where it costs as much as dense bf16.
OURS_WIDE_ROWS = 2
TORCH_WIDE_ROWS = 16
ACTS = ("fp32", "int8")
# Activations of wide calls with our kernels: bf16 (q4_bf16 / q8_bf16, needs AVX-512 BF16) or int8 per row and
# 32-group (q4_i8w / q8_i8w: VNNI on a 16-output interleave built per call, engine/weights/csrc/wide_i8.cpp).
WIDE_ACTS = ("bf16", "int8")
DEFAULT_WIDE_ACT = "bf16"
# Activations of our kernels' narrow calls (the one-token step): int8 per 32-group since 2026-11-28, as llama.cpp's Q8
# activations, AR 1.4-1.5x faster on the bundled model; the AR base's answers measured as fp32's within noise (short
# 153 vs 144 of 309 right, long sets 10 vs 12 complete of 20 and 10 vs 11 of 36 checkable right), the dLLM's the same
# text (bench/results/int8_steps/). fp32 keeps the exact one-token step (FASTDLLM_ACTIVATIONS=fp32).
DEFAULT_ACT = "int8"


MAX_K = 20480  # engine/weights/csrc/q4.cpp's kMaxGroups groups of 32 (Qwen2.5-7B's MLP has 18944 inputs)
TILE = 4  # our kernels' output tile: its rows are interleaved into one weight stream (engine/weights/csrc/q4.cpp)


def tiled(t: Tensor, chunks: int) -> Tensor:
    """t [N, ...] with each row cut into `chunks` equal chunks -> same shape, contents reordered to
    [N/TILE, chunks, TILE, chunk]: a tile's rows side by side, chunk by chunk."""
    n = t.shape[0]
    return t.reshape(n // TILE, TILE, chunks, -1).transpose(1, 2).reshape(t.shape).contiguous()


def pack_pairs(q: Tensor) -> Tensor:
    """q [N, K] in 0..15 -> uint8 [N, K/2]: per pair of 32-groups (g, g + 1), byte b holds q_g[b] in its low nibble
    and q_{g+1}[b] in its high one; then tiled (engine/weights/csrc/q4.cpp's layout)."""
    n, k = q.shape
    g = q.view(n, k // (2 * GROUP), 2, GROUP).to(torch.uint8)
    return tiled((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2), k // (2 * GROUP))


def _dropped(w: Tensor, sc: Tensor) -> tuple[Tensor, Tensor]:
    """Stand-ins for a tiled weight and its scales once the prepacked copy replaces them: [N, 0] and [0] (the
    output count stays readable; a kernel handed them refuses: 0 features)."""
    return w.new_empty(w.shape[0], 0), sc.new_empty(0)


def _ours(n: int, k: int, choice: str) -> ModuleType | None:
    """Our kernels (FASTDLLM_KERNELS `choice` allowing) when they are built and fit the shape (K a multiple of 64 up
    to MAX_K, N of 4), else None."""
    kernels = cpu_kernels.load(choice)
    return kernels if kernels is not None and k % (2 * GROUP) == 0 and k <= MAX_K and n % 4 == 0 else None


class Int4Weight(nn.Module):
    """One (fused) projection's base weight, 4-bit, and what wide calls run (int4+bf16).

    With our kernels (engine/weights/kernels.py): the file's q, d, m as they are (`qs` nibble pairs, `dm` fp16); wide
    calls dequantise tiles to bf16 on the fly (`q4_bf16`, on CPUs with AVX-512 BF16; elsewhere a dense bf16 copy) or
    take int8 activations (`q4_i8w`, `wide_act` "int8"). Otherwise torch's int4 pack, whose kernel wants bf16 scales
    and zeros (d and m + 8d rounded to bf16), and a dense bf16 copy."""

    def __init__(self, blocks: Q4Blocks, dense_bf16: bool, kernels: str = "auto", wide_act: str = DEFAULT_WIDE_ACT,
                 prepack: bool = False, keep_tiled: bool = True):
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        self.kernels = _ours(self.out_features, self.in_features, kernels)
        self.wide_bf16 = False  # wide calls through q4_bf16 (no dense copy)
        self.wide_int8 = False  # wide calls through q4_i8w (no dense copy)
        self.register_buffer("pk", None)  # `prepack`: the int8 calls' prepacked copy (q4_i8p: pk, ps)
        self.register_buffer("ps", None)
        dense = None
        if self.kernels is not None:
            self.register_buffer("qs", pack_pairs(blocks.q))
            self.register_buffer("dm", tiled(torch.stack([blocks.d, blocks.m], -1).half(), self.in_features // GROUP))
            if prepack:
                self.pk, self.ps = self.kernels.i8w_prepack(self.qs, self.dm, False)
                if not keep_tiled:  # every call takes int8 activations: only the prepacked copy is read
                    self.qs, self.dm = _dropped(self.qs, self.dm)
            self.wide_int8 = dense_bf16 and wide_act == "int8"
            self.wide_bf16 = dense_bf16 and not self.wide_int8 and cpu_kernels.bf16_ok()
            if dense_bf16 and not self.wide_bf16 and not self.wide_int8:
                dense = blocks.dequantize()
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.int(), 1))
            zero = blocks.m + 8 * blocks.d
            sz = torch.stack([blocks.d, zero], -1).transpose(0, 1).contiguous().bfloat16()
            self.register_buffer("scale_zero", sz)
            if dense_bf16:  # from the same bf16 scales/zeros, so both paths compute with the same weights
                q = blocks.q.view(self.out_features, -1, GROUP).float() - 8
                sz = sz.float().transpose(0, 1)  # [out, groups, 2]
                dense = (q * sz[..., 0:1] + sz[..., 1:2]).view(self.out_features, self.in_features)
        self.register_buffer("dense", None if dense is None else dense.bfloat16())

    def narrow(self, x: Tensor, act: str) -> Tensor:
        """x [rows, in] -> [rows, out] fp32 through the 4-bit weights; `act` = activations of our kernels."""
        if self.kernels is None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                              self.scale_zero).float()
        x = x.float().contiguous()
        if act == "int8":
            return self.int8(x)
        return self.kernels.q4_f32(x, self.qs, self.dm)

    def int8(self, x: Tensor) -> Tensor:
        """x fp32 [rows, in] -> [rows, out], int8 activations: on the prepacked copy if there is one (same numbers)."""
        if self.pk is not None:
            return self.kernels.q4_i8p(x, self.pk, self.ps, self.out_features)
        return self.kernels.q4_i8w(x, self.qs, self.dm)

    def wide(self, x: Tensor) -> Tensor:
        """x [rows, in] -> [rows, out] fp32, int4+bf16's wide calls: bf16 weights and activations, or the 4-bit
        weights with int8 activations (FASTDLLM_WIDE_ACTIVATIONS=int8)."""
        if self.wide_int8:
            return self.int8(x.float().contiguous())
        if self.wide_bf16:
            return self.kernels.q4_bf16(x.float().contiguous(), self.qs, self.dm)
        return F.linear(x.to(torch.bfloat16), self.dense).float()


def _width(x: Tensor) -> int:
    """Positions per sequence of an activation [B, T, features] (rows of a 2-D one): what picks the kernel."""
    return x.shape[-2] if x.dim() > 2 else x.shape[0]


class Int4Linear(nn.Module):
    """y = x W^T (+ LoRA) with W 4-bit; `splits` = widths of the fused outputs (q|k|v, gate|up)."""

    def __init__(self, weight: Int4Weight, splits: list[int], wide_rows: int | None, lora: LoRA | None = None,
                 act: str = DEFAULT_ACT, bias: Tensor | None = None):
        super().__init__()
        self.weight = weight  # shared between the AR base and the dLLM
        self.splits = splits
        self.wide_rows = wide_rows  # None: 4-bit at every width
        self.lora = lora
        self.act = act
        self.register_buffer("bias", bias)  # fp32 [sum splits] (Qwen2's q|k|v), added before the LoRA delta

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        x2 = x.reshape(-1, w.in_features)
        wide = self.wide_rows is not None and (_width(x) >= self.wide_rows or WIDE_CALLS.get())
        lora = self.lora
        if wide and w.wide_bf16 and lora is not None and lora.kernels is not None and x.dtype == torch.float32:
            # layer.cpp's product and delta in one call: on AMX tiles x A^T reuses the product's bf16 rows of x
            y = w.kernels.q4_bf16_lora(x2.contiguous(), w.qs, w.dm, self.bias, lora.a_t, lora.b_list(), lora.bounds)
            return y.view(*x.shape[:-1], w.out_features)
        if wide:
            y = w.wide(x2).to(x.dtype)
        else:
            y = w.narrow(x2, self.act).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.lora is not None:
            y = self.lora.add_to(y, x2)
        return y.view(*x.shape[:-1], w.out_features)


class DenseBF16Linear(nn.Module):
    """y = x W^T with W dense bf16 (the "bf16" mode's projections and every mode's LM head)."""

    def __init__(self, weight: Tensor, splits: list[int], lora: LoRA | None = None, bias: Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight.bfloat16().contiguous())
        self.register_buffer("bias", bias)
        self.splits = splits
        self.lora = lora

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = F.linear(x2.to(torch.bfloat16), self.weight).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.lora is not None:
            y = self.lora.add_to(y, x2)
        return y.view(*x.shape[:-1], y.shape[-1])


def q8_planes(q: Tensor, d: Tensor) -> tuple[Q4Blocks, Q4Blocks]:
    """A Q8_0 matrix as two int4 matrices whose products add up to it: q = 16 hi + lo, hi in -8..7, lo in 0..15."""
    q = q.int()
    hi, lo = q >> 4, q & 15
    return Q4Blocks(hi + 8, 16 * d, -128 * d), Q4Blocks(lo, d, torch.zeros_like(d))


class Q8Head(nn.Module):
    """The tied Q8_0 LM head's weights, shared by the base and the dLLM.

    With our kernels: as stored (q + 128 as uint8, fp16 d): fp32 or int8 activations, and for the wide calls of
    int4+bf16 int8 ones (q8_i8w, `wide_act` "int8") or bf16 ones (q8_bf16, on CPUs with AVX-512 BF16; fp32
    elsewhere). Otherwise
    two int4 products (q = 16 hi + lo; exact but for bf16 scales) below `HEAD_WIDE_ROWS` positions per sequence,
    2x faster than dense bf16 for the AR step, and dense bf16 for wider calls."""

    def __init__(self, q: Tensor, d: Tensor, kernels: str = "auto", wide_act: str = DEFAULT_WIDE_ACT):
        super().__init__()
        self.kernels = _ours(*q.shape, kernels)
        self.register_buffer("pk", None)  # `prepack`: the int8 calls' prepacked copy (q8_i8p: pk, ps)
        self.register_buffer("ps", None)
        self.wide_int8 = self.kernels is not None and wide_act == "int8"  # q8_i8w for wide calls
        # q8_bf16 for wide calls (read /proc once)
        self.wide_bf16 = self.kernels is not None and not self.wide_int8 and cpu_kernels.bf16_ok()
        self.planes: tuple[Int4Weight, Int4Weight] | None = None
        if self.kernels is not None:
            self.register_buffer("u", tiled((q.int() + 128).to(torch.uint8), q.shape[1] // (2 * GROUP)))
            self.register_buffer("d", tiled(d.half(), d.shape[1]))
            self.register_buffer("weight", None)
        else:
            hi, lo = q8_planes(q, d)
            self.planes = (Int4Weight(hi, False, kernels), Int4Weight(lo, False, kernels))
            for name, plane in zip(("hi", "lo"), self.planes):
                self.add_module(name, plane)
            self.register_buffer("weight", (q.float().view(q.shape[0], -1, GROUP) * d[..., None]).flatten(1).bfloat16())

    def forward(self, x2: Tensor, width: int, act: str, wide: bool = False) -> Tensor:
        """x2 [rows, hidden] -> fp32 logits; `width` = positions per sequence; `wide`: the caller's int4+bf16 switch
        says wide activations (our kernels then run the Q8 rows through q8_i8w, or q8_bf16 on AVX-512 BF16)."""
        if self.kernels is not None:
            x = x2.float().contiguous()
            if wide and self.wide_int8:
                return self.int8(x)
            if wide and self.wide_bf16:
                return self.kernels.q8_bf16(x, self.u, self.d)
            return self.int8(x) if act == "int8" else self.kernels.q8_f32(x, self.u, self.d)
        if width < HEAD_WIDE_ROWS:
            hi, lo = self.planes
            return hi.narrow(x2, "fp32") + lo.narrow(x2, "fp32")
        return F.linear(x2.to(torch.bfloat16), self.weight).float()


    def prepack(self, keep_tiled: bool = True) -> None:
        """Make the int8 calls' prepacked copy (once; a model decides for its whole set of weights); without
        `keep_tiled` it replaces the stored rows (every call then takes int8 activations)."""
        if self.kernels is not None and self.pk is None:
            self.pk, self.ps = self.kernels.i8w_prepack(self.u, self.d, True)
            if not keep_tiled:
                self.u, self.d = _dropped(self.u, self.d)

    def int8(self, x: Tensor) -> Tensor:
        """x fp32 [rows, hidden] -> logits, int8 activations: on the prepacked copy if there is one (same numbers)."""
        if self.pk is not None:
            return self.kernels.q8_i8p(x, self.pk, self.ps, self.u.shape[0])
        return self.kernels.q8_i8w(x, self.u, self.d)


class LMHead(nn.Module):
    """Logits over the file's vocabulary (a shared Q8Head) plus the adapter's new rows (fp32), if any. In forwards of
    `wide_rows` positions per sequence or more (int4+bf16's switch, None: never; counted over the forward, not the
    positions whose logits it reads, engine/model.py HEAD_WIDTH) with bf16 activations, like the projections; but
    not in a prefill (`wide_calls()`): its logits are one position per row, and an AR answer keeps the fp32 head."""

    def __init__(self, core: Q8Head, extra_rows: Tensor | None, act: str = DEFAULT_ACT, wide_rows: int | None = None):
        super().__init__()
        self.core = core
        self.act = act
        self.wide_rows = wide_rows
        self.register_buffer("extra", extra_rows)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        width = _width(x)
        forward = HEAD_WIDTH.get() or width
        prefill = WIDE_CALLS.get()
        wide = self.wide_rows is not None and forward >= self.wide_rows and not prefill
        # torch's backend picks planes or its dense copy by width too: the forward's, except in a prefill, whose
        # logits are one position per row however a batch splits the prompt
        y = self.core(x2, width if prefill else forward, self.act, wide).to(x.dtype)
        if self.extra is not None:
            y = torch.cat([y, F.linear(x2.to(self.extra.dtype), self.extra).to(y.dtype)], -1)
        return y.view(*x.shape[:-1], y.shape[-1])


class Q8Embedding(nn.Module):
    """The Q8_0 embedding as stored (int8 + per-32 scales); a lookup dequantises only the rows it reads.
    Rows past the file's vocabulary (the adapter's mask token) are kept in fp32."""

    def __init__(self, q: Tensor, d: Tensor, extra_rows: Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("d", d)
        self.register_buffer("extra", extra_rows)
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        v = self.q.shape[0]
        inside = ids.clamp(max=v - 1)
        x = (self.q[inside].view(*ids.shape, -1, GROUP).to(self.dtype) * self.d[inside][..., None].to(self.dtype))
        x = x.flatten(-2)
        if self.extra is not None and bool((ids >= v).any()):
            x = torch.where((ids >= v)[..., None], self.extra[(ids - v).clamp(min=0)].to(self.dtype), x)
        return x
