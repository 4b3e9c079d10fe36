"""Token-id shards: the answered prompts of a self-instruct directory (`shard-NNNNN.npz`), read and written.

A shard holds its examples in columns (`Shard`); `training/selfinstruct.py` writes them, `gpu_block.py` merges
them for transport, and the answers policy (`finish.finish_shards`) reads them back for training. Each prompt
is stored once under a 64-bit content key, so shards merged or copied between machines are deduplicated by key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

SOURCES = ("train", "magpie")  # stored as uint8 codes


@dataclass(slots=True)
class Shard:
    """Answered prompts in columns; `tokens` holds each example's prompt then answer ids, back to back."""

    keys: np.ndarray  # uint64 [N]
    sources: np.ndarray  # uint8 [N], index into SOURCES
    prompt_len: np.ndarray  # uint32 [N]
    answer_len: np.ndarray  # uint32 [N]
    stopped: np.ndarray  # bool [N]: the answer ends with the stop token (else cut at max_new_tokens)
    tokens: np.ndarray  # uint16 (uint32 for vocabularies over 65,535) [sum of lengths]

    def __len__(self) -> int:
        return len(self.keys)

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.npz")  # hidden from shard_paths' glob until renamed
        np.savez_compressed(tmp, **{k: getattr(self, k) for k in self.__slots__})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Shard":
        with np.load(path) as z:
            return cls(**{k: z[k] for k in cls.__slots__})

    @classmethod
    def concat(cls, shards: list["Shard"]) -> "Shard":
        return cls(**{k: np.concatenate([getattr(s, k) for s in shards]) for k in cls.__slots__})

    def examples(self) -> list[tuple[int, list[int], list[int], bool]]:
        """(key, prompt ids, answer ids, stopped) per example."""
        out, at = [], 0
        ends = np.cumsum(self.prompt_len.astype(np.int64) + self.answer_len)
        toks = self.tokens.tolist()
        for i, end in enumerate(ends.tolist()):
            p = int(self.prompt_len[i])
            out.append((int(self.keys[i]), toks[at:at + p], toks[at + p:end], bool(self.stopped[i])))
            at = end
        return out


def shard_paths(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*.npz"))


def make_shard(rows: list[tuple[int, int, list[int], list[int], bool]], vocab: int) -> Shard:
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    return Shard(keys=np.array([r[0] for r in rows], dtype=np.uint64),
                 sources=np.array([r[1] for r in rows], dtype=np.uint8),
                 prompt_len=np.array([len(r[2]) for r in rows], dtype=np.uint32),
                 answer_len=np.array([len(r[3]) for r in rows], dtype=np.uint32),
                 stopped=np.array([r[4] for r in rows], dtype=bool),
                 tokens=np.array([t for r in rows for t in r[2] + r[3]], dtype=dtype))


def answered_keys(out: Path) -> set[int]:
    keys: set[int] = set()
    for p in shard_paths(out):
        with np.load(p) as z:
            keys.update(z["keys"].tolist())
    return keys


def summarize(out: Path) -> dict:
    """Counts over every shard in the directory (deduplicated by key)."""
    seen: set[int] = set()
    n = ans = stopped = 0
    by_source = dict.fromkeys(SOURCES, 0)
    files = []
    for p in shard_paths(out):
        s = Shard.load(p)
        new = np.array([k not in seen for k in s.keys.tolist()], dtype=bool)
        seen.update(s.keys.tolist())
        n += int(new.sum())
        ans += int(s.answer_len[new].sum())
        stopped += int(s.stopped[new].sum())
        for code, name in enumerate(SOURCES):
            by_source[name] += int((s.sources[new] == code).sum())
        files.append({"file": p.name, "examples": len(s), "bytes": p.stat().st_size})
    return {"examples": n, "answer_tokens": ans, "stopped": stopped, "truncated": n - stopped,
            "by_source": by_source, "shards": files}


def stored_examples(path: Path) -> Iterator[tuple[str, int, list[int], list[int], bool]]:
    """(shard file name, key, prompt ids, answer ids, stopped) of every stored example, in shard order."""
    for f in shard_paths(path):
        for key, prompt, answer, stopped in Shard.load(f).examples():
            yield f.name, key, prompt, answer, stopped
