"""Adapter files in fp16, split into parts of at most `max_bytes` (the GPU machine returns files <= 16 MiB).

Same format as engine.weights.save_adapter (`lora_A.* / lora_B.* / set.* / extend.*`, lora_scale in the
metadata), so a single-part file is what `apply_adapter` and FASTDLLM_ADAPTER take. Every part is itself
a valid adapter (a LoRA pair never straddles two parts), and `join` writes them back as one file.
fp16 rather than bf16: the same 2 bytes with 3 more mantissa bits; LoRA factors are far from its range
limit, and `write` refuses values that would not survive the cast.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from engine.weights import ADAPTER_FORMAT, MASK_TOKEN

from .lora import adapter_tensors

MAX_BYTES = 16 * 2**20


def _entry_bytes(key: str, t: Tensor) -> int:
    """Data plus a generous bound on its safetensors header entry (name, dtype, shape, offsets)."""
    return t.numel() * t.element_size() + len(key) + 96


def flat_tensors(trainable: dict[str, Tensor], dtype: torch.dtype = torch.float16) -> dict[str, Tensor]:
    """Trainable state (training.lora names) -> adapter-format tensors in `dtype`."""
    lora, sets, new_rows = adapter_tensors(trainable)
    out: dict[str, Tensor] = {}
    for name, (a, b) in lora.items():
        out["lora_A." + name], out["lora_B." + name] = a, b
    out.update({"set." + k: t for k, t in sets.items()})
    if new_rows is not None:
        out["extend.model.embed_tokens.weight"] = new_rows
    cast = {k: t.detach().to(dtype).contiguous().cpu() for k, t in out.items()}
    bad = [k for k, t in cast.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"adapter: {bad[:3]} do not fit {dtype} (non-finite after the cast)")
    return cast


def part_paths(path: Path, n: int) -> list[Path]:
    if n == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i + 1:05d}-of-{n:05d}{path.suffix}") for i in range(n)]


def write(path: Path, tensors: dict[str, Tensor], lora_scale: float, meta: dict[str, str],
          max_bytes: int = MAX_BYTES) -> list[Path]:
    """Write the adapter as one file, or as parts named <stem>-0000k-of-0000n; returns the paths."""
    md = {"format": ADAPTER_FORMAT, "lora_scale": str(lora_scale), "mask_token": MASK_TOKEN, **meta}
    room = max_bytes - len(json.dumps(md)) - 256  # per file: the metadata, "part", JSON framing
    groups: list[list[str]] = [[]]
    size = 0
    for key in sorted(k for k in tensors if not k.startswith("lora_B.")):
        keys = [key, "lora_B." + key[len("lora_A."):]] if key.startswith("lora_A.") else [key]
        nbytes = sum(_entry_bytes(k, tensors[k]) for k in keys)
        if nbytes > room:
            raise ValueError(f"adapter: {key} alone ({nbytes} bytes) exceeds max_bytes {max_bytes}")
        if groups[-1] and size + nbytes > room:
            groups.append([])
            size = 0
        groups[-1] += keys
        size += nbytes
    paths = part_paths(path, len(groups))
    path.parent.mkdir(parents=True, exist_ok=True)
    stale = [*path.parent.glob(f"{path.stem}-*-of-*{path.suffix}"), path]
    for old in stale:
        if old not in paths and old.exists():
            old.unlink()  # an earlier export split differently: never leave a mix of two exports
    for i, (p, keys) in enumerate(zip(paths, groups)):
        tmp = p.with_suffix(".tmp")
        save_file({k: tensors[k] for k in keys}, str(tmp), metadata={**md, "part": f"{i + 1}/{len(paths)}"})
        tmp.replace(p)
    return paths


def join(parts: list[Path], out: Path) -> Path:
    """Parts -> one adapter file (the metadata of the first part, without its part number)."""
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for p in parts:
        with safe_open(str(p), "pt") as f:
            meta = meta or dict(f.metadata() or {})
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    meta.pop("part", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return out
