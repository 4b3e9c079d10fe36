"""Build small checkpoints on disk in the exact layouts the engine reads (no downloads)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.weights import MASK_TOKEN, bundled_base_dir, save_adapter, read_state_dict

QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def fast_dllm_config(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     inter: int = 128) -> dict:
    """config.json fields of Efficient-Large-Model/Fast_dLLM_v2_1.5B, at toy sizes."""
    return {
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "attention_dropout": 0.0, "bd_size": 32, "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
        "max_position_embeddings": 32768, "max_window_layers": layers, "model_type": "Fast_dLLM_Qwen",
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.53.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": vocab_size,
    }


def build_fast_dllm_checkpoint(out: Path, seed: int = 0, mask: bool = True, **shape: int) -> Path:
    """A random tiny model in the Fast_dLLM_v2 layout: config, safetensors names, tokenizer with |<MASK>| (without it
    when `mask` is False: a model the engine decodes by AR only); `shape`: fast_dllm_config's sizes (hidden, heads, ...)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(bundled_base_dir()))
    if mask:
        tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    vocab = (len(tok) + 63) // 64 * 64  # padded embedding: the mask id is one of its rows
    cfg = fast_dllm_config(vocab, **shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    state = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.q_proj.bias": r(h),
                  p + "self_attn.k_proj.weight": r(kv, h), p + "self_attn.k_proj.bias": r(kv),
                  p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.v_proj.bias": r(kv),
                  p + "self_attn.o_proj.weight": r(h, h), p + "mlp.gate_proj.weight": r(inter, h),
                  p + "mlp.up_proj.weight": r(inter, h), p + "mlp.down_proj.weight": r(h, inter),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def put_in_hub_cache(ckpt: Path, hub_cache: Path, repo_id: str) -> Path:
    """Lay a checkpoint out as huggingface_hub's cache does, so snapshot_download finds it offline."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(ckpt, snap, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def mask_only_adapter(path: Path) -> Path:
    """An adapter holding only the new |<MASK>| embedding row: the untrained dLLM (mechanics, not quality)."""
    emb = read_state_dict(bundled_base_dir())["model.embed_tokens.weight"]
    save_adapter(path, lora={}, sets={}, new_embed_rows=emb.mean(0, keepdim=True), lora_scale=1.0)
    return path
