"""Any Qwen2/Llama safetensors checkpoint at 4-bit: quantised at load, tensor by tensor, into the blocks the bundled
GGUF carries (engine/weights/gguf.py), and cached on disk.

Projections become Q4_1 (groups of 32: w = d*q + m, q in 0..15, fp16 d and m) and the embedding and LM head Q8_0
(w = d*q, q in -127..127), with llama.cpp's reference rounding (`quantize_row_q4_1_ref` / `quantize_row_q8_0_ref`):
re-quantising a GGUF's dequantised weights gives back its blocks bit for bit (tests/test_q4_quantize.py), so a
checkpoint dequantised from a GGUF decodes with the GGUF path's tokens.

Peak memory: tensors are read one at a time from the safetensors files, which are reopened per layer so the pages
already read are unmapped, and each layer's blocks go to a cache file of their own as soon as they are made; no dense
model is ever built and the first load never holds every block (the model is then assembled from the cache, as on a
later load). Biases and norms stay as stored (engine/weights/quant.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .gguf import GGUF_NAMES, GROUP, GGUFWeights, Q4Blocks, block_tensors, load_blocks

FORMAT = "fastdllm-q4-v2"  # bump when the rounding or the layout below changes: old caches are then ignored
PROJECTIONS = tuple(GGUF_NAMES.values())
CHUNK_ROWS = 8192  # rows quantised at a time  # self_attn.q_proj ... mlp.down_proj


def quantize_q4_1(w: Tensor) -> Q4Blocks:
    """w [out, in] (in a multiple of 32) -> Q4_1 blocks; min and max per group, d = (max - min) / 15,
    q = min(15, trunc((x - min) / d + 0.5)), computed in fp32 from the unrounded min and d as llama.cpp does."""
    out, inp = w.shape
    if inp % GROUP:
        raise ValueError(f"q4_1: input features {inp} must be a multiple of {GROUP}")
    x = w.float().view(out, inp // GROUP, GROUP)
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = ((x - lo[..., None]) * inv[..., None] + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    return Q4Blocks(q.view(out, inp), d.half().float(), lo.half().float())


def quantize_q8_0(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [rows, in] -> (int8 q [rows, in], fp32 d [rows, in / 32] holding fp16 values); d = max|x| / 127,
    q = round-half-away(x / d), as llama.cpp."""
    rows, inp = w.shape
    if inp % GROUP:
        raise ValueError(f"q8_0: input features {inp} must be a multiple of {GROUP}")
    q = torch.empty(rows, inp, dtype=torch.int8)
    d = torch.empty(rows, inp // GROUP)
    for r in range(0, rows, CHUNK_ROWS):  # a 151,936-row embedding in fp32 temporaries would add ~3 GB at once
        x = w[r:r + CHUNK_ROWS].float().view(-1, inp // GROUP, GROUP)
        dc = x.abs().amax(-1) / 127
        inv = torch.where(dc != 0, 1 / dc, torch.zeros_like(dc))
        v = x * inv[..., None]
        q[r:r + CHUNK_ROWS] = (v.sign() * (v.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8).view(-1, inp)
        d[r:r + CHUNK_ROWS] = dc.half().float()
    return q, d


def weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    where: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            where.update({k: f for k in h.keys()})
    return where


def _read(files: dict[str, Path], names: list[str]) -> dict[str, Tensor]:
    """The named tensors, each file opened once and closed after (its pages unmapped)."""
    out: dict[str, Tensor] = {}
    for f in sorted({files[n] for n in names}):
        with safe_open(str(f), "pt") as h:
            out.update({n: h.get_tensor(n) for n in names if files[n] == f})
    return out


def quantized_names(files: dict[str, Path]) -> set[str]:
    """The tensors the 4-bit model holds as blocks (everything else is read as stored)."""
    q = {n for n in files if n.startswith("model.layers.") and any(n.endswith(f".{p}.weight") for p in PROJECTIONS)}
    return q | {n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in files}


Rows = tuple[Tensor, Tensor, Tensor | None, Tensor | None]  # Q8_0 embedding q, d, and an untied head's (or None)


def _parts(path: Path, num_layers: int, tied: bool) -> Iterator[tuple[str, dict[str, Q4Blocks], Rows | None]]:
    """The checkpoint's projections as Q4_1 one layer at a time, then its embedding (and untied head) as Q8_0:
    (name, Q4 blocks, Q8 rows) per part, each made when asked for."""
    files = weight_files(path)
    for i in range(num_layers):
        names = [f"model.layers.{i}.{p}.weight" for p in PROJECTIONS]
        missing = [n for n in names if n not in files]
        if missing:
            raise ValueError(f"model: checkpoint {path} lacks {missing[:3]}")
        yield f"layer{i:03d}", {n[: -len(".weight")]: quantize_q4_1(t) for n, t in _read(files, names).items()}, None
    embed = quantize_q8_0(_read(files, ["model.embed_tokens.weight"])["model.embed_tokens.weight"])
    head: tuple[Tensor | None, Tensor | None] = (None, None)
    if not tied:
        if "lm_head.weight" not in files:
            raise ValueError(f"model: checkpoint {path} has an untied head but no lm_head.weight")
        head = quantize_q8_0(_read(files, ["lm_head.weight"])["lm_head.weight"])
    yield "embed", {}, (*embed, *head)


def quantize_checkpoint(path: Path, num_layers: int, tied: bool) -> GGUFWeights:
    """The whole checkpoint's blocks in memory (tests; a load streams them to the cache instead: write_cache)."""
    q4: dict[str, Q4Blocks] = {}
    rows: Rows | None = None
    for _, blocks, rows in _parts(path, num_layers, tied):
        q4.update(blocks)
    assert rows is not None
    return GGUFWeights(q4, *rows)


def write_cache(path: Path, num_layers: int, tied: bool, cache: Path) -> None:
    """Quantise into a cache directory, one safetensors file per layer written as it is made (the first load's peak
    memory is one layer's temporaries, not the whole model's blocks), then renamed into place in one step."""
    from safetensors.torch import save_file

    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, blocks, rows in _parts(path, num_layers, tied):
        embed, head = (rows[:2], rows[2:]) if rows is not None else (None, (None, None))
        save_file(block_tensors(blocks, embed, head), str(tmp / f"{name}.safetensors"))
        del blocks, rows
    try:
        tmp.rename(cache)
    except OSError:  # another process wrote the same cache first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def cache_key(path: Path) -> str:
    """Names the cached blocks: the checkpoint's resolved path and its weight files' sizes and times, the format."""
    parts = [FORMAT, str(path.resolve())]
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cached_checkpoint(path: Path, num_layers: int, tied: bool, cache_root: Path) -> tuple[GGUFWeights, bool]:
    """The checkpoint's blocks, quantised once into cache_root/q4/ (write_cache); also says whether the cache answered."""
    cache = cache_root / "q4" / f"{path.resolve().name}-{cache_key(path)}"
    if cache.is_dir():
        return load_blocks(cache), True
    write_cache(path, num_layers, tied, cache)
    from . import packing

    packing.release_freed_memory()  # the quantisation's temporaries; then the blocks come back mapped, as cached ones
    return load_blocks(cache), False
