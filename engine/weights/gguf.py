"""Reading the bundled GGUF's 4-bit blocks: Q4_1 projections and Q8_0 rows, kept as stored, cached on disk."""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

GROUP = 32  # Q4_1 / Q8_0 block size
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BYTES = 34  # fp16 d, 32 int8


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

    q4: Mapping[str, Q4Blocks]  # a dict, or CachedBlocks reading each from the cache file on use
    embed_q: Tensor  # int8 [vocab, hidden]
    embed_d: Tensor  # fp32 [vocab, hidden / 32]
    head_q: Tensor | None = None  # an untied LM head's Q8_0 rows (None: the head is the embedding)
    head_d: Tensor | None = None


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


def block_tensors(q4: Mapping[str, Q4Blocks], embed: tuple[Tensor, Tensor] | None = None,
                  head: tuple[Tensor | None, Tensor | None] = (None, None)) -> dict[str, Tensor]:
    """The cache file's tensors (d and m as fp16, as a GGUF stores them: exact)."""
    t: dict[str, Tensor] = {}
    if embed is not None:
        t.update({"embed.q": embed[0], "embed.d": embed[1].half()})
    if head[0] is not None:
        t.update({"head.q": head[0], "head.d": head[1].half()})
    for n, b in q4.items():
        t.update({n + ".q": b.q.contiguous(), n + ".d": b.d.half(), n + ".m": b.m.half()})
    return t


def save_blocks(w: GGUFWeights, cache: Path) -> None:
    """Write the blocks to one file, atomically."""
    from safetensors.torch import save_file

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    save_file(block_tensors(w.q4, (w.embed_q, w.embed_d), (w.head_q, w.head_d)), str(tmp))
    tmp.replace(cache)


class CachedBlocks(Mapping[str, Q4Blocks]):
    """The Q4 blocks of cache files by name, each read when asked for (its file opened and closed around it), so
    assembling a model holds one projection's unpacked planes at a time, not the file (at Qwen2.5-1.5B's shape a
    mapped file kept 1.3 GB of touched pages in RSS until the last block was packed). `where`: name -> file."""

    def __init__(self, where: Mapping[str, Path]):
        self.where = dict(where)

    def __getitem__(self, name: str) -> Q4Blocks:
        from safetensors import safe_open

        with safe_open(str(self.where[name]), "pt") as f:
            return Q4Blocks(f.get_tensor(name + ".q"), f.get_tensor(name + ".d").float(), f.get_tensor(name + ".m").float())

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.where))

    def __len__(self) -> int:
        return len(self.where)


def load_blocks(cache: Path) -> GGUFWeights:
    """A cache's blocks: the Q8 rows read now, the Q4 blocks on use (CachedBlocks). `cache` is one file (save_blocks)
    or a directory of files (engine/weights/q4_quantize.py writes one per layer, then the Q8 rows in `embed.safetensors`)."""
    from safetensors import safe_open

    files = sorted(cache.glob("*.safetensors")) if cache.is_dir() else [cache]
    where: dict[str, Path] = {}
    embed = head = (None, None)
    for path in files:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            where.update({k.rsplit(".", 1)[0]: path for k in keys if k.startswith("model.")})
            if "embed.q" in keys:  # copied out: a kept tensor must not pin the file's mapping (and every page read)
                embed = (f.get_tensor("embed.q").clone(), f.get_tensor("embed.d").float())
            if "head.q" in keys:
                head = (f.get_tensor("head.q").clone(), f.get_tensor("head.d").float())
    if embed[0] is None:
        raise ValueError(f"model: the 4-bit cache {cache} holds no embedding (delete it to rebuild it)")
    return GGUFWeights(CachedBlocks(where), *embed, *head)


def cached_gguf(path: Path, n_head: int, n_kv_head: int, cache: Path) -> GGUFWeights:
    """read_gguf, memoised as a safetensors file (GGUFReader spends ~10 s parsing the tokenizer fields)."""
    if cache.exists():
        return load_blocks(cache)
    w = read_gguf(path, n_head, n_kv_head)
    save_blocks(w, cache)
    return w
