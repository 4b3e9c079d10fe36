"""Write a model as a Fast_dLLM_v2 checkpoint: the layout of the paper's hub models and code.

`Efficient-Large-Model/Fast_dLLM_v2_1.5B` is a Qwen2 checkpoint with `model_type` "Fast_dLLM_Qwen",
`bd_size`, q/k/v biases, and `|<MASK>|` in its tokenizer. A Llama-family base (SmolLM2) is the same
network with zero q/k/v biases (DESIGN.md §5), so our merged model is written in that layout too and
loads in any tool that reads those checkpoints: our engine (config + safetensors), or transformers with
trust_remote_code through `auto_map`, which points at the paper's modeling code on the hub, as their
own checkpoints do (their `generate()` takes `mask_id` and `stop_token`: pass ours, they differ from
Qwen's 151665 / 151645).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.weights import MASK_TOKEN
from engine.model import CausalLM

HUB_CODE = "Efficient-Large-Model/Fast_dLLM_v2_1.5B"  # where auto_map finds configuration.py / modeling.py
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def qwen2_state(model: CausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Parameters under Qwen2 names, q/k/v biases added as zeros where the base has none, tied head dropped."""
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
             if not (model.cfg.tie_word_embeddings and k == "lm_head.weight")}
    for i, layer in enumerate(model.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.bias"
            if key not in state:
                state[key] = torch.zeros(getattr(layer.self_attn, proj).out_features, dtype=dtype)
    return state


def config_json(model: CausalLM, dtype: str, mask_id: int, stop_id: int, pad_id: int | None) -> dict:
    """config.json with the fields of the hub's Fast_dLLM_v2 configs (Qwen2Config + bd_size)."""
    c = model.cfg
    return {
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {"AutoConfig": f"{HUB_CODE}--configuration.Fast_dLLM_QwenConfig",
                     "AutoModelForCausalLM": f"{HUB_CODE}--modeling.Fast_dLLM_QwenForCausalLM"},
        "model_type": "Fast_dLLM_Qwen",
        "bd_size": c.bd_size,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": c.max_position_embeddings,
        "max_window_layers": c.num_hidden_layers,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "bos_token_id": None,
        "eos_token_id": stop_id,
        "pad_token_id": pad_id,
        "mask_token_id": mask_id,
        "torch_dtype": dtype,
    }


def write(model: CausalLM, tokenizer, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """config.json, generation_config.json, model.safetensors and the tokenizer (with |<MASK>|) in out_dir."""
    if dtype not in DTYPES:
        raise ValueError(f"merge_dtype: must be one of {', '.join(DTYPES)} (got {dtype!r})")
    vocab = tokenizer.get_vocab()
    if MASK_TOKEN not in vocab or vocab[MASK_TOKEN] >= model.cfg.vocab_size:
        raise ValueError(f"tokenizer: {MASK_TOKEN} must be a token with an embedding row (vocab {model.cfg.vocab_size})")
    mask_id, stop_id = vocab[MASK_TOKEN], vocab.get("<|im_end|>", tokenizer.eos_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(qwen2_state(model, DTYPES[dtype]), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = config_json(model, dtype, mask_id, stop_id, tokenizer.pad_token_id)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"eos_token_id": stop_id, "pad_token_id": tokenizer.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=1))
    tokenizer.save_pretrained(str(out_dir))
    portable_tokenizer_config(out_dir / "tokenizer_config.json")
    return out_dir


def portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class and the mask token so transformers 4.x (the paper's code pins 4.53) reads it too.

    transformers 5 writes `TokenizersBackend` and a list under `extra_special_tokens`, which 4.x cannot
    load; `PreTrainedTokenizerFast` + `additional_special_tokens` mean the same to both.
    """
    cfg = json.loads(path.read_text())
    extra = cfg.pop("extra_special_tokens", None) or []
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = sorted(set(cfg.get("additional_special_tokens", [])) | set(extra) | {MASK_TOKEN})
    path.write_text(json.dumps(cfg, indent=1, ensure_ascii=False))
