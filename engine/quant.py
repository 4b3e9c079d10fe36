"""4-bit weights at run time: the bundled GGUF's Q4_1 blocks (projections) and Q8_0 rows (tied embedding / LM head),
kept as stored.

A Q4_1 block stores 32 weights as q in 0..15 with an fp16 scale d and minimum m: w = d*q + m. Two backends:
* ours (engine/cpu_kernels.py, engine/csrc/; CPUs with AVX-512 VNNI and a C++ compiler): narrow calls multiply
  the file's q, d, m with fp32 activations (the fp32 path's numbers up to summation order) or, with
  FASTDLLM_ACTIVATIONS=int8, int8 ones per 32-group (VNNI); wide calls dequantise tiles to bf16 in L1
  (q4_bf16, AVX-512 BF16) or use a dense bf16 copy; the head runs its Q8_0 rows at every width; and
  `LayerStep` runs a whole decoder layer of a cached forward (up to a block) in one C++ call.
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

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .model import WIDE_CALLS, CausalLM
from . import env

MODES = ("int4+bf16", "int4", "bf16", "fp32")
DEFAULT_MODE = "int4+bf16"
HEAD_WIDE_ROWS = 4  # LM head: int4 planes below, dense bf16 from here (7.4 vs 14.8 ms at 1 row, 25.5 vs 20.7 at 8);
# counted per sequence, so an 8-row AR batch pays the 25.5 ms to keep every row's logits equal to its own alone
FUSED_MAX_WIDTH = 32  # widest forward the one-call layer step takes (a block step); prefills stay eager
# Where wide calls start (bf16 activations), per backend. Ours: above a block, so every cached decode step (AR, sub-block,
# block) keeps fp32 activations and the fp32 path's tokens, and only prefills take bf16 (diffusion answers equal to the
# fp32 path's: 302/309 against 292 at 16, for 0.82-0.92x its speed; README). torch's int4 kernel: at 16, where it costs as much
# as dense bf16.
OURS_WIDE_ROWS = FUSED_MAX_WIDTH + 1
TORCH_WIDE_ROWS = 16
ACTS = ("fp32", "int8")
DEFAULT_ACT = "fp32"  # activations of our kernels' narrow calls (README: speed and greedy agreement of both)
GROUP = 32  # Q4_1 / Q8_0 block size
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BYTES = 34  # fp16 d, 32 int8


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """Which weights the projections run with: `mode` in MODES; `wide_rows`: int4+bf16's switch point (None: the
    backend's, `switch`); `act`: the activations our 4-bit kernels take below it (fp32, or int8 per 32-group like
    llama.cpp)."""

    mode: str = DEFAULT_MODE
    wide_rows: int | None = None
    act: str = DEFAULT_ACT

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"FASTDLLM_WEIGHTS: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.wide_rows is not None and self.wide_rows < 2:
            raise ValueError(f"FASTDLLM_INT4_WIDE_ROWS: {self.wide_rows} must be >= 2")
        if self.act not in ACTS:
            raise ValueError(f"FASTDLLM_ACTIVATIONS: {self.act!r} is not one of {', '.join(ACTS)}")

    @classmethod
    def from_env(cls) -> "WeightPolicy":
        mode = env.get("FASTDLLM_WEIGHTS", DEFAULT_MODE)
        raw = env.get("FASTDLLM_INT4_WIDE_ROWS")
        try:
            wide = int(raw) if raw else None
        except ValueError:
            raise ValueError(f"FASTDLLM_INT4_WIDE_ROWS: {raw!r} is not an integer >= 2") from None
        return cls(mode, wide, env.get("FASTDLLM_ACTIVATIONS", DEFAULT_ACT))

    def switch(self, ours: bool) -> int:
        """Positions per sequence from which int4+bf16 runs bf16 activations, with our kernels or torch's."""
        return self.wide_rows if self.wide_rows is not None else OURS_WIDE_ROWS if ours else TORCH_WIDE_ROWS


# ---- reading the GGUF ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Q4Blocks:
    """One Q4_1 matrix [out, in]: q (uint8 0..15), per-group d and m (fp32) [out, in / 32]."""

    q: Tensor
    d: Tensor
    m: Tensor

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() * self.d[..., None] + self.m[..., None]
        return w.view(n, k)

    def rows(self, perm: Tensor) -> "Q4Blocks":
        return Q4Blocks(self.q[perm], self.d[perm], self.m[perm])


def _q4_1(raw: Tensor, out: int, inp: int) -> Q4Blocks:
    b = raw.view(out, inp // GROUP, _Q4_1_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = b[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], -1)  # weight j in the low nibble of byte j, weight j + 16 in its high one
    return Q4Blocks(q.reshape(out, inp), d, m)


def _q8_0(raw: Tensor, out: int, inp: int) -> tuple[Tensor, Tensor]:
    b = raw.view(out, inp // GROUP, _Q8_0_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    return b[..., 2:].contiguous().view(torch.int8).reshape(out, inp), d


def _unpermute(n_head: int, rows: int) -> Tensor:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; this row order undoes it (as
    transformers' GGUF loader does)."""
    half = rows // n_head // 2
    return torch.arange(rows).view(n_head, half, 2).transpose(1, 2).reshape(rows)


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


@dataclass(slots=True)
class GGUFWeights:
    """The Q4_1 projections by our parameter name (without '.weight') and the Q8_0 embedding."""

    q4: dict[str, Q4Blocks]
    embed_q: Tensor  # int8 [vocab, hidden]
    embed_d: Tensor  # fp32 [vocab, hidden / 32]


def read_gguf(path: Path, n_head: int, n_kv_head: int) -> GGUFWeights:
    import gguf

    reader = gguf.GGUFReader(str(path))
    q4: dict[str, Q4Blocks] = {}
    embed = None
    for t in reader.tensors:
        if len(t.shape) != 2:  # norms: read from the converted checkpoint like every other tensor
            continue
        inp, out = (int(x) for x in t.shape)  # GGUF lists dims innermost first
        raw = torch.from_numpy(t.data.copy()).view(torch.uint8)
        if t.name == "token_embd.weight":
            if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
                raise ValueError(f"gguf: token_embd is {t.tensor_type.name}, expected Q8_0")
            embed = _q8_0(raw, out, inp)
            continue
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in GGUF_NAMES:
            continue
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            raise ValueError(f"gguf: {t.name} is {t.tensor_type.name}, expected Q4_1")
        blocks = _q4_1(raw, out, inp)
        if parts[2] in ("attn_q", "attn_k"):
            blocks = blocks.rows(_unpermute(n_head if parts[2] == "attn_q" else n_kv_head, out))
        q4[f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}"] = blocks
    if embed is None:
        raise ValueError(f"gguf: {path} has no token_embd.weight")
    return GGUFWeights(q4, *embed)


def cached_gguf(path: Path, n_head: int, n_kv_head: int, cache: Path) -> GGUFWeights:
    """read_gguf, memoised as a safetensors file (GGUFReader spends ~10 s parsing the tokenizer fields)."""
    from safetensors.torch import load_file, save_file

    if cache.exists():
        t = load_file(str(cache))
        names = {k.rsplit(".", 1)[0] for k in t if k.startswith("model.")}
        q4 = {n: Q4Blocks(t[n + ".q"], t[n + ".d"].float(), t[n + ".m"].float()) for n in names}
        return GGUFWeights(q4, t["embed.q"], t["embed.d"].float())
    w = read_gguf(path, n_head, n_kv_head)
    t = {"embed.q": w.embed_q, "embed.d": w.embed_d.half()}  # d and m are fp16 in the file: stored exactly
    for n, b in w.q4.items():
        t.update({n + ".q": b.q.contiguous(), n + ".d": b.d.half(), n + ".m": b.m.half()})
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    save_file(t, str(tmp))
    tmp.replace(cache)
    return w


# ---- run-time modules -----------------------------------------------------------------------------------

TILE = 4  # our kernels' output tile: its rows are interleaved into one weight stream (engine/csrc/q4.cpp)


def tiled(t: Tensor, chunks: int) -> Tensor:
    """t [N, ...] with each row cut into `chunks` equal chunks -> same shape, contents reordered to
    [N/TILE, chunks, TILE, chunk]: a tile's rows side by side, chunk by chunk."""
    n = t.shape[0]
    return t.reshape(n // TILE, TILE, chunks, -1).transpose(1, 2).reshape(t.shape).contiguous()


def pack_pairs(q: Tensor) -> Tensor:
    """q [N, K] in 0..15 -> uint8 [N, K/2]: per pair of 32-groups (g, g + 1), byte b holds q_g[b] in its low nibble
    and q_{g+1}[b] in its high one; then tiled (engine/csrc/q4.cpp's layout)."""
    n, k = q.shape
    g = q.view(n, k // (2 * GROUP), 2, GROUP).to(torch.uint8)
    return tiled((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2), k // (2 * GROUP))


def _ours(n: int, k: int) -> ModuleType | None:
    """Our kernels when they are built and fit the shape (K a multiple of 64, N of 4), else None."""
    kernels = cpu_kernels.load()
    return kernels if kernels is not None and k % (2 * GROUP) == 0 and k <= 2048 and n % 4 == 0 else None


class Int4Weight(nn.Module):
    """One (fused) projection's base weight, 4-bit, and what wide calls run (int4+bf16).

    With our kernels (engine/cpu_kernels.py): the file's q, d, m as they are (`qs` nibble pairs, `dm` fp16, `mt` =
    m as fp32 [groups, out] for the int8-activation path); wide calls dequantise tiles to bf16 on the fly
    (`q4_bf16`, on CPUs with AVX-512 BF16) or, elsewhere, use a dense bf16 copy. Otherwise torch's int4 pack, whose
    kernel wants bf16 scales and zeros (d and m + 8d rounded to bf16), and a dense bf16 copy."""

    def __init__(self, blocks: Q4Blocks, dense_bf16: bool):
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        self.kernels = _ours(self.out_features, self.in_features)
        self.wide_bf16 = False  # wide calls through q4_bf16 (no dense copy)
        dense = None
        if self.kernels is not None:
            self.register_buffer("qs", pack_pairs(blocks.q))
            self.register_buffer("dm", tiled(torch.stack([blocks.d, blocks.m], -1).half(), self.in_features // GROUP))
            self.register_buffer("mt", blocks.m.t().contiguous().float())
            self.wide_bf16 = dense_bf16 and cpu_kernels.bf16_ok()
            if dense_bf16 and not self.wide_bf16:
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
            return self.kernels.q4_i8(x, self.qs, self.dm, self.mt)
        return self.kernels.q4_f32(x, self.qs, self.dm)

    def wide(self, x: Tensor) -> Tensor:
        """x [rows, in] -> [rows, out] fp32 with bf16 weights and activations (int4+bf16's wide calls)."""
        if self.wide_bf16:
            return self.kernels.q4_bf16(x.float().contiguous(), self.qs, self.dm)
        return F.linear(x.to(torch.bfloat16), self.dense).float()


class LoRA(nn.Module):
    """A fused low-rank delta: h = x A^T for every fused part in one product, then each part's B adds into its own
    slice of the output (no block-diagonal zeros: q|k|v's were 2/3 zeros); the scale is folded into B; parts
    without an adapter are skipped. fp32, like the residual stream: on this CPU a small bf16 GEMM costs a
    ~25 us floor (oneDNN), fp32 ones 3-25 us, and the zero-free fp32 path is the fastest we measured (README)."""

    def __init__(self, parts: list[tuple[Tensor, Tensor] | None], outs: list[int], scale: float):
        super().__init__()
        kept = [(i, p) for i, p in enumerate(parts) if p is not None]
        self.register_buffer("a_t", torch.cat([p[0].float() for _, p in kept], 0).t().contiguous())
        starts = [sum(outs[:i]) for i in range(len(outs))]
        self.slices: list[tuple[str, int, int, int, int]] = []  # (B buffer, rank start, rank end, out start, out end)
        r0 = 0
        for j, (i, (a, b)) in enumerate(kept):
            self.register_buffer(f"b_t{j}", (b.float() * scale).t().contiguous())
            self.slices.append((f"b_t{j}", r0, r0 + a.shape[0], starts[i], starts[i] + outs[i]))
            r0 += a.shape[0]
        self.whole = len(kept) == 1 and len(outs) == 1

    def add_to(self, y: Tensor, x: Tensor) -> Tensor:
        """y [rows, sum outs] += the delta for x [rows, in], in place (both fp32)."""
        h = x.to(self.a_t.dtype) @ self.a_t
        if self.whole:
            return y.addmm_(h, self.b_t0)
        for b, r0, r1, o0, o1 in self.slices:
            y[:, o0:o1].addmm_(h[:, r0:r1], self._buffers[b])
        return y


def _width(x: Tensor) -> int:
    """Positions per sequence of an activation [B, T, features] (rows of a 2-D one): what picks the kernel."""
    return x.shape[-2] if x.dim() > 2 else x.shape[0]


class Int4Linear(nn.Module):
    """y = x W^T (+ LoRA) with W 4-bit; `splits` = widths of the fused outputs (q|k|v, gate|up)."""

    def __init__(self, weight: Int4Weight, splits: list[int], wide_rows: int | None, lora: LoRA | None = None,
                 act: str = DEFAULT_ACT):
        super().__init__()
        self.weight = weight  # shared between the AR base and the dLLM
        self.splits = splits
        self.wide_rows = wide_rows  # None: 4-bit at every width
        self.lora = lora
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        x2 = x.reshape(-1, w.in_features)
        if self.wide_rows is not None and (_width(x) >= self.wide_rows or WIDE_CALLS.get()):
            y = w.wide(x2).to(x.dtype)
        else:
            y = w.narrow(x2, self.act).to(x.dtype)
        if self.lora is not None:
            y = self.lora.add_to(y, x2)
        return y.view(*x.shape[:-1], w.out_features)


class DenseBF16Linear(nn.Module):
    """y = x W^T with W dense bf16 (the "bf16" mode's projections and every mode's LM head)."""

    def __init__(self, weight: Tensor, splits: list[int], lora: LoRA | None = None):
        super().__init__()
        self.register_buffer("weight", weight.bfloat16().contiguous())
        self.splits = splits
        self.lora = lora

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = F.linear(x2.to(torch.bfloat16), self.weight).to(x.dtype)
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

    With our kernels: as stored (q + 128 as uint8, fp16 d), at every width (fp32 or int8 activations). Otherwise
    two int4 products (q = 16 hi + lo; exact but for bf16 scales) below `HEAD_WIDE_ROWS` positions per sequence,
    2x faster than dense bf16 for the AR step, and dense bf16 for wider calls."""

    def __init__(self, q: Tensor, d: Tensor):
        super().__init__()
        self.kernels = _ours(*q.shape)
        self.planes: tuple[Int4Weight, Int4Weight] | None = None
        if self.kernels is not None:
            self.register_buffer("u", tiled((q.int() + 128).to(torch.uint8), q.shape[1] // (2 * GROUP)))
            self.register_buffer("d", tiled(d.half(), d.shape[1]))
            self.register_buffer("mt", (-128 * d.half().float()).t().contiguous())
            self.register_buffer("weight", None)
        else:
            hi, lo = q8_planes(q, d)
            self.planes = (Int4Weight(hi, dense_bf16=False), Int4Weight(lo, dense_bf16=False))
            for name, plane in zip(("hi", "lo"), self.planes):
                self.add_module(name, plane)
            self.register_buffer("weight", (q.float().view(q.shape[0], -1, GROUP) * d[..., None]).flatten(1).bfloat16())

    def forward(self, x2: Tensor, width: int, act: str) -> Tensor:
        """x2 [rows, hidden] -> fp32 logits; `width` = positions per sequence."""
        if self.kernels is not None:
            x = x2.float().contiguous()
            return self.kernels.q8_i8(x, self.u, self.d, self.mt) if act == "int8" else self.kernels.q8_f32(x, self.u, self.d)
        if width < HEAD_WIDE_ROWS:
            hi, lo = self.planes
            return hi.narrow(x2, "fp32") + lo.narrow(x2, "fp32")
        return F.linear(x2.to(torch.bfloat16), self.weight).float()


class LMHead(nn.Module):
    """Logits over the file's vocabulary (a shared Q8Head) plus the adapter's new rows (fp32), if any."""

    def __init__(self, core: Q8Head, extra_rows: Tensor | None, act: str = DEFAULT_ACT):
        super().__init__()
        self.core = core
        self.act = act
        self.register_buffer("extra", extra_rows)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = self.core(x2, _width(x), self.act).to(x.dtype)
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


class LayerStep:
    """One decoder layer's narrow forward as a single call of our kernels (engine/csrc/layer.cpp), for layers whose
    four projections are Int4Linear on our kernels. Holds the layer's tensors, gathered once: the model is
    inference-only once its weights are quantised."""

    def __init__(self, layer: nn.Module, kernels: ModuleType, act: str):
        attn, mlp = layer.self_attn, layer.mlp
        projs = [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj]
        self.kernels, self.int8 = kernels, act == "int8"
        self.wide_rows = projs[0].wide_rows
        # widths it takes: below wide_rows; up to a block (FUSED_MAX_WIDTH) when wide calls have q4_bf16
        self.max_width = FUSED_MAX_WIDTH if all(p.weight.wide_bf16 for p in projs) and self.wide_rows is not None \
            else (self.wide_rows or FUSED_MAX_WIDTH + 1) - 1
        self.heads, self.kv_heads = attn.h, attn.hkv
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.weights = [t for p in projs for t in (p.weight.qs, p.weight.dm, p.weight.mt)]
        self.lora_a = [p.lora.a_t if p.lora is not None else None for p in projs]
        self.lora_b = [[p.lora._buffers[b] for b, *_ in p.lora.slices] if p.lora is not None else [] for p in projs]
        self.slices = [[v for _, *r in p.lora.slices for v in r] if p.lora is not None else [] for p in projs]

    @staticmethod
    def fits(layer: nn.Module) -> bool:
        projs = [layer.self_attn.qkv, layer.mlp.gate_up, layer.self_attn.o_proj, layer.mlp.down_proj]
        return all(isinstance(p, Int4Linear) and p.weight.kernels is not None for p in projs)

    def __call__(self, x: Tensor, cache_k: Tensor, cache_v: Tensor, shared: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        cos, sin, pos, mask = shared
        wide = self.wide_rows is not None and x.shape[1] >= self.wide_rows
        return self.kernels.layer_step(x, self.norm1, self.norm2, self.eps, self.weights, self.lora_a, self.lora_b,
                                       self.slices, self.int8, wide, self.heads, self.kv_heads, cos, sin, cache_k,
                                       cache_v, pos, mask)


def fused_wanted() -> bool:
    """FASTDLLM_FUSED=0 turns the one-call layer step off (bench profile's per-module split needs the eager layer)."""
    return env.get("FASTDLLM_FUSED") != "0"


# ---- assembling a model ---------------------------------------------------------------------------------

FUSED = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
         "gate_up": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def _fused_blocks(w: GGUFWeights, layer: int, sub: str, names: tuple[str, ...]) -> Q4Blocks:
    parts = [w.q4[f"model.layers.{layer}.{sub}.{n}"] for n in names]
    return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts], 0) for f in ("q", "d", "m")))


def read_lora(tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """name (without '.weight') -> (A [r, in], B [out, r]) from an adapter file's tensors."""
    return {k[len("lora_A."):-len(".weight")]: (t, tensors["lora_B." + k[len("lora_A."):]])
            for k, t in tensors.items() if k.startswith("lora_A.")}


class QuantizedPair:
    """Builds the 4-bit AR base and (optionally) the dLLM on top of the same shared weights."""

    def __init__(self, weights: GGUFWeights, policy: WeightPolicy):
        self.w, self.policy = weights, policy
        self._shared: dict[tuple[int, str], nn.Module] = {}
        self.head = Q8Head(weights.embed_q, weights.embed_d)  # shared by the base and the dLLM

    def _weight(self, layer: int, key: str) -> nn.Module:
        sub, names = FUSED[key]
        if (layer, key) not in self._shared:
            blocks = _fused_blocks(self.w, layer, sub, names)
            if self.policy.mode == "bf16":
                self._shared[(layer, key)] = DenseBF16Linear(blocks.dequantize(), [])
            else:
                self._shared[(layer, key)] = Int4Weight(blocks, dense_bf16=self.policy.mode == "int4+bf16")
        return self._shared[(layer, key)]

    def apply(self, model: CausalLM, lora: dict[str, tuple[Tensor, Tensor]] | None = None, lora_scale: float = 1.0,
              extra_rows: Tensor | None = None) -> CausalLM:
        """Replace `model`'s projections, LM head and embedding in place (its dense weights are dropped)."""
        wide = self.policy.switch(self.head.kernels is not None) if self.policy.mode == "int4+bf16" else None
        for i, layer in enumerate(model.model.layers):
            for key, (sub, names) in FUSED.items():
                owner = getattr(layer, sub)
                full = [f"model.layers.{i}.{sub}.{n}" for n in names]
                splits = [self.w.q4[f].q.shape[0] for f in full]
                delta = None
                if lora is not None and any(f in lora for f in full):
                    delta = LoRA([lora.get(f) for f in full], splits, lora_scale)
                base = self._weight(i, key)
                mod: nn.Module = DenseBF16Linear(base.weight, splits, delta) if isinstance(base, DenseBF16Linear) \
                    else Int4Linear(base, splits, wide, delta, self.policy.act)  # either way the base tensors are shared
                setattr(owner, key, mod)
                for n in names:
                    if n != key:
                        setattr(owner, n, None)
        steps = [LayerStep(layer, self.head.kernels, self.policy.act) for layer in model.model.layers
                 if LayerStep.fits(layer)] if self.head.kernels is not None and fused_wanted() else []
        model.steps = steps if len(steps) == len(model.model.layers) else None
        dtype = model.model.norm.weight.dtype
        model.model.embed_tokens = Q8Embedding(self.w.embed_q, self.w.embed_d, extra_rows, dtype)
        model.lm_head = LMHead(self.head, None if extra_rows is None else extra_rows.float(), self.policy.act)
        model.packed = True
        return model


def quantize_bundled(base: CausalLM, dllm: CausalLM, gguf_path: Path, cache: Path, adapter: dict[str, Tensor] | None,
                     lora_scale: float, policy: WeightPolicy) -> None:
    """Put the GGUF's 4-bit weights into `base` and, when it is a separate model, `dllm` (in place).

    `dllm` was built by merging the adapter into dense weights (loading.apply_adapter); its projections,
    embedding and head are replaced here by the shared 4-bit ones plus the adapter's separate LoRA path.
    """
    w = cached_gguf(gguf_path, base.cfg.num_attention_heads, base.cfg.num_key_value_heads, cache)
    pair = QuantizedPair(w, policy)
    if dllm is not base:
        tensors = adapter or {}
        replaced = [k for k in tensors if k.startswith("set.") and k[4:-len(".weight")] in w.q4]
        if replaced:
            raise ValueError(f"adapter replaces 4-bit projections ({replaced[:3]}): use FASTDLLM_WEIGHTS=fp32")
        pair.apply(dllm, read_lora(tensors), lora_scale, tensors.get("extend.model.embed_tokens.weight"))
    pair.apply(base)


def narrow_bytes(model: CausalLM) -> int | None:
    """Bytes a narrow (AR) forward of a 4-bit model streams: 4-bit blocks, scales, LoRA, norms, the Q8 head;
    not the dense bf16 copies that only wide calls read (nor m as fp32, which only int8 activations read).
    None for a model without 4-bit weights."""
    mods = [m for m in model.modules() if isinstance(m, (Int4Weight, Q8Head, Q8Embedding, DenseBF16Linear))]
    if not any(isinstance(m, Int4Weight) for m in mods):
        return None
    int8 = any(getattr(m, "act", None) == "int8" for m in model.modules())
    skip = {id(m.dense) for m in mods if isinstance(m, Int4Weight) and m.dense is not None}
    skip |= {id(m.weight) for m in mods if isinstance(m, Q8Head) and m.weight is not None}
    if not int8:
        skip |= {id(m.mt) for m in mods if isinstance(m, (Int4Weight, Q8Head)) and m.kernels is not None}
    skip |= {id(m.q) for m in mods if isinstance(m, Q8Embedding)}  # a lookup reads only its rows
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in skip or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
