"""A checkpoint directory (config.json + safetensors + tokenizer) read into our CausalLM, dense or at 4-bit."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..config import ModelConfig
from ..model import CausalLM
from ..runtime import Runtime
from . import q4_quantize, quant
from .adapter import MASK_TOKEN
from .sources import ModelSourceError

def read_state_dict(path: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory (single file or sharded index), but those named in `skip`."""
    index = path / "model.safetensors.index.json"
    files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
        else sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"model: no .safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not skip:
            state.update(load_file(str(f)))
            continue
        with safe_open(str(f), "pt") as h:  # only what is kept is read: the skipped tensors are quantised elsewhere
            state.update({k: h.get_tensor(k) for k in h.keys() if k not in skip})
    return state


def default_dtype(device: torch.device, runtime: Runtime | None = None) -> torch.dtype:
    """FASTDLLM_DTYPE, else bf16 on CUDA and fp32 on CPU."""
    val = (runtime or Runtime.from_env()).dtype
    if val:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[val]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(path: Path, device: torch.device, dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> CausalLM:
    """The checkpoint as our CausalLM. Tensors named in `skip` are not read: they stay on the meta device for
    engine/weights/quant.py to replace with 4-bit ones (so no dense copy of them is ever held)."""
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    state = read_state_dict(path, skip)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    with torch.device("meta"):
        model = CausalLM(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = set(dict(model.named_parameters())) - set(state) - set(skip) \
        - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ModelSourceError(f"model: checkpoint {path} lacks tensors: {sorted(missing)[:5]}")
    if skip:  # Module.to cannot move the meta tensors left for quantisation: convert what was read instead
        state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta)
    if skip:
        return model.eval().requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_four_bit(path: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                   policy: quant.WeightPolicy, cache: Path) -> tuple[CausalLM, str]:
    """Any Qwen2/Llama checkpoint with its projections at 4-bit (engine/weights/q4_quantize.py: quantised tensor by tensor on
    the first load, cached under `cache`/q4/ after); also says how the blocks were obtained."""
    t0 = time.perf_counter()
    files = q4_quantize.weight_files(path)
    weights, cached = q4_quantize.cached_checkpoint(path, cfg.num_hidden_layers, cfg.tie_word_embeddings, cache)
    how = f"4-bit blocks {'from the cache' if cached else 'quantised at load'} in {time.perf_counter() - t0:.1f} s"
    model = build_model(path, device, dtype, skip=frozenset(q4_quantize.quantized_names(files)))
    quant.quantize_checkpoint_model(model, weights, policy)
    return model, how


def four_bit_unfit(cfg: ModelConfig) -> str | None:
    """Why a checkpoint cannot take the 4-bit path (None when it can): blocks of 32 along every input."""
    for name, k in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size),
                    ("heads x head_dim", cfg.num_attention_heads * cfg.head_dim)):
        if k % 32:
            return f"{name} {k} is not a multiple of 32"
    return None


def load_tokenizer(path: Path, add_mask_token: bool):
    from transformers import AutoTokenizer

    # explicit False: a Fast_dLLM_Qwen config's auto_map would otherwise make transformers ask on stdin
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    if add_mask_token and MASK_TOKEN not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    return tok
