"""The bundled model at 4-bit: which weights the projections run with (WeightPolicy, FASTDLLM_WEIGHTS: int4+bf16 by
default, int4, bf16, fp32) and assembling the AR base and the dLLM from the GGUF's blocks (engine/weights/gguf.py) as
4-bit layers (engine/weights/int4.py has the kernels' story). Base and dLLM share one copy of the 4-bit weights; the
adapter's LoRA stays a separate low-rank path."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..model import CausalLM
from ..runtime import Runtime
from . import kernels as cpu_kernels
from .gguf import GROUP, GGUF_NAMES, GGUFWeights, Q4Blocks, cached_gguf, read_gguf  # noqa: F401 (engine.weights.quant.X)
from .int4 import (ACTS, DEFAULT_ACT, DEFAULT_WIDE_ACT, FUSED_MAX_WIDTH, WIDE_ACTS, HEAD_WIDE_ROWS, OURS_WIDE_ROWS, TILE,  # noqa: F401
                   TORCH_WIDE_ROWS, DenseBF16Linear, Int4Linear, Int4Weight, LMHead, Q8Embedding,
                   Q8Head, pack_pairs, q8_planes, tiled)
from .layer_step import LayerStep, LayerSteps  # noqa: F401 (engine.weights.quant.LayerStep)
from .lora import LoRA, exact_weights  # noqa: F401 (engine.weights.quant.LoRA)


MODES = ("int4+bf16", "int4", "bf16", "fp32")
DEFAULT_MODE = "int4+bf16"
# Int8-activation products (FASTDLLM_WIDE_ACTIVATIONS=int8, FASTDLLM_ACTIVATIONS=int8) run on a copy of the 4-bit
# weights prepacked at load into the kernel's 16-output interleave (unless FASTDLLM_INT8_PREPACK says otherwise):
# - when every product takes int8 activations (both switches int8, the studio's), that copy replaces the stored
#   tiled one, which nothing reads then: no memory cost, whatever the model's size;
# - otherwise (int8 one-token steps beside bf16 wide calls, the engine's default; or fp32 one-token steps beside int8
#   wide calls) it is a second copy, made when it is at most this many
#   bytes: the bundled model's ~96 MB, yes (a 9-wide step 1.13-1.18x cheaper per projection, 1.45x in the head);
#   Qwen2.5-1.5B's ~1 GB, no (issue 23's 2.5 GB peak RSS): its int8 calls build the interleave per call.
# bench/results/prepack/.
PREPACK_MAX_BYTES = 512 << 20



@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """Which weights the projections run with: `mode` in MODES; `wide_rows`: int4+bf16's switch point (None: the
    backend's, `switch`); `act`: the activations our 4-bit kernels take below it (fp32, or int8 per 32-group like
    llama.cpp); `kernels`: FASTDLLM_KERNELS' choice; `fused`: one C++ call per decoder layer where it fits;
    `wide_act`: the activations of int4+bf16's wide calls on our kernels (bf16, or int8 per 32-group on VNNI)."""

    mode: str = DEFAULT_MODE
    wide_rows: int | None = None
    act: str = DEFAULT_ACT
    kernels: str = "auto"
    fused: bool = True
    wide_act: str = DEFAULT_WIDE_ACT
    prepack: bool | None = None  # FASTDLLM_INT8_PREPACK (None: PREPACK_MAX_BYTES' rule)
    amx: bool = True  # FASTDLLM_AMX: bf16 wide products on AMX tiles where the CPU has them

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"FASTDLLM_WEIGHTS: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.wide_rows is not None and self.wide_rows < 2:
            raise ValueError(f"FASTDLLM_INT4_WIDE_ROWS: {self.wide_rows} must be >= 2")
        if self.act not in ACTS:
            raise ValueError(f"FASTDLLM_ACTIVATIONS: {self.act!r} is not one of {', '.join(ACTS)}")
        if self.wide_act not in WIDE_ACTS:
            raise ValueError(f"FASTDLLM_WIDE_ACTIVATIONS: {self.wide_act!r} is not one of {', '.join(WIDE_ACTS)}")
        cpu_kernels.check(self.kernels)

    @classmethod
    def of(cls, runtime: Runtime) -> "WeightPolicy":
        return cls(runtime.weights, runtime.int4_wide_rows, runtime.activations or DEFAULT_ACT, runtime.kernels,
                   runtime.fused, runtime.wide_activations or DEFAULT_WIDE_ACT, runtime.int8_prepack, runtime.amx)

    @classmethod
    def from_env(cls) -> "WeightPolicy":
        return cls.of(Runtime.from_env())

    def int8_calls(self) -> bool:
        """Some products take int8 activations: narrow ones, or int4+bf16's wide ones."""
        return self.mode in ("int4", "int4+bf16") and (self.act == "int8" or
                                                       (self.mode == "int4+bf16" and self.wide_act == "int8"))

    def only_int8(self) -> bool:
        """Every product takes int8 activations: narrow ones, and wide ones where there is a wide switch."""
        return self.act == "int8" and (self.mode == "int4" or (self.mode == "int4+bf16" and self.wide_act == "int8"))

    def switch(self, ours: bool) -> int:
        """Positions per sequence from which int4+bf16 runs bf16 activations, with our kernels or torch's."""
        return self.wide_rows if self.wide_rows is not None else OURS_WIDE_ROWS if ours else TORCH_WIDE_ROWS



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


def _fused_bias(owner: nn.Module, names: tuple[str, ...], splits: list[int]) -> Tensor | None:
    """The fused projections' biases side by side as fp32 (Qwen2's q/k/v have them), None when none has one."""
    linears = [getattr(owner, n) for n in names]
    if all(getattr(lin, "bias", None) is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach().float() if getattr(lin, "bias", None) is not None else torch.zeros(w)
                      for lin, w in zip(linears, splits)])


class QuantizedPair:
    """Builds the 4-bit AR base and (optionally) the dLLM on top of the same shared weights."""

    def __init__(self, weights: GGUFWeights, policy: WeightPolicy):
        self.w, self.policy = weights, policy
        self._shared: dict[tuple[int, str], nn.Module] = {}
        # shared by the base and the dLLM: the embedding's rows when tied (the bundled GGUF), else the head's own
        q, d = (weights.head_q, weights.head_d) if weights.head_q is not None else (weights.embed_q, weights.embed_d)
        self.head = Q8Head(q, d, policy.kernels, policy.wide_act)
        # decided on the first apply(), from the model's shape: prepacked int8 copies, and whether the tiled ones stay
        self.prepack: bool | None = None
        self.keep_tiled = True

    def _decide_prepack(self, model: CausalLM) -> tuple[bool, bool]:
        """(prepacked copies, keep the tiled ones) by PREPACK_MAX_BYTES' rule: Q4_1 is 5 bits a weight with its
        scales, Q8_0 8.5 (bytes counted from the model's shapes, no block read)."""
        if not self.policy.int8_calls() or self.head.kernels is None:
            return False, True
        only = self.policy.only_int8()
        if self.policy.prepack is not None:
            return self.policy.prepack, not (only and self.policy.prepack)
        if only:
            return True, False
        projs = sum(m.in_features * m.out_features for layer in model.model.layers
                    for sub in (layer.self_attn, layer.mlp) for m in sub.children() if isinstance(m, nn.Linear))
        return projs * 5 // 8 + self.head.u.numel() * 17 // 16 <= PREPACK_MAX_BYTES, True

    def _weight(self, layer: int, key: str) -> nn.Module:
        sub, names = FUSED[key]
        if (layer, key) not in self._shared:
            blocks = _fused_blocks(self.w, layer, sub, names)
            if self.policy.mode == "bf16":
                self._shared[(layer, key)] = DenseBF16Linear(blocks.dequantize(), [])
            else:
                self._shared[(layer, key)] = Int4Weight(blocks, self.policy.mode == "int4+bf16", self.policy.kernels,
                                                       self.policy.wide_act, bool(self.prepack), self.keep_tiled)
        return self._shared[(layer, key)]

    def apply(self, model: CausalLM, lora: dict[str, tuple[Tensor, Tensor]] | None = None, lora_scale: float = 1.0,
              extra_rows: Tensor | None = None) -> CausalLM:
        """Replace `model`'s projections, LM head and embedding in place (its dense weights are dropped)."""
        wide = self.policy.switch(self.head.kernels is not None) if self.policy.mode == "int4+bf16" else None
        if self.prepack is None:
            self.prepack, self.keep_tiled = self._decide_prepack(model)
            if self.prepack:
                self.head.prepack(self.keep_tiled)
        for i, layer in enumerate(model.model.layers):
            for key, (sub, names) in FUSED.items():
                owner = getattr(layer, sub)
                full = [f"model.layers.{i}.{sub}.{n}" for n in names]
                splits = [getattr(owner, n).out_features for n in names]  # (not from the blocks: read on use)
                delta = None
                if lora is not None and any(f in lora for f in full):
                    delta = LoRA([lora.get(f) for f in full], splits, lora_scale, self.head.kernels)
                bias = _fused_bias(owner, names, splits)
                base = self._weight(i, key)
                mod: nn.Module = DenseBF16Linear(base.weight, splits, delta, bias) if isinstance(base, DenseBF16Linear) \
                    else Int4Linear(base, splits, wide, delta, self.policy.act, bias)  # the base tensors are shared
                setattr(owner, key, mod)
                for n in names:
                    if n != key:
                        setattr(owner, n, None)
        steps = [LayerStep(layer, self.head.kernels, self.policy.act) for layer in model.model.layers
                 if LayerStep.fits(layer)] if self.head.kernels is not None and self.policy.fused else []
        model.steps = LayerSteps(steps) if len(steps) == len(model.model.layers) else None
        dtype = model.model.norm.weight.dtype
        model.model.embed_tokens = Q8Embedding(self.w.embed_q, self.w.embed_d, extra_rows, dtype)
        model.lm_head = LMHead(self.head, None if extra_rows is None else extra_rows.float(), self.policy.act, wide)
        model.packed = True
        return model


def quantize_bundled(base: CausalLM, dllm: CausalLM, gguf_path: Path, cache: Path, adapter: dict[str, Tensor] | None,
                     lora_scale: float, policy: WeightPolicy) -> None:
    """Put the GGUF's 4-bit weights into `base` and, when it is a separate model, `dllm` (in place).

    `dllm` was built by merging the adapter into dense weights (adapter.apply_adapter); its projections,
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


def quantize_checkpoint_model(model: CausalLM, weights: GGUFWeights, policy: WeightPolicy) -> None:
    """Put a checkpoint's quantised blocks (engine/weights/q4_quantize.py) into `model`, in place: the projections, the
    embedding and the head were left unread (on the meta device) by checkpoint.build_model(skip=...)."""
    QuantizedPair(weights, policy).apply(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"model: tensors left unread after quantisation: {left[:5]}")


def narrow_bytes(model: CausalLM) -> int | None:
    """Bytes a narrow (AR) forward of a 4-bit model streams: 4-bit blocks, scales, LoRA, norms, the Q8 head;
    not the dense bf16 copies that only wide calls read. None for a model without 4-bit weights."""
    mods = [m for m in model.modules() if isinstance(m, (Int4Weight, Q8Head, Q8Embedding, DenseBF16Linear))]
    if not any(isinstance(m, Int4Weight) for m in mods):
        return None
    skip = {id(m.dense) for m in mods if isinstance(m, Int4Weight) and m.dense is not None}
    skip |= {id(m.weight) for m in mods if isinstance(m, Q8Head) and m.weight is not None}
    skip |= {id(m.q) for m in mods if isinstance(m, Q8Embedding)}  # a lookup reads only its rows
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in skip or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
