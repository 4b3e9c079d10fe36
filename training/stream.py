"""Training data as a stream: chat JSONL, token-id shards or registered token-id files, read one example at a time.

The in-memory path (examples.load_data) holds every example as Python ints, ~40 bytes per token: fine for the
bundled adapter's data, not for the paper's 1-3B tokens. Here an epoch is one pass over the files through a
seeded shuffle buffer, so memory is the buffer (plus, for shards, one shard and the seen keys). The order is a
function of (seed, epoch) alone, so every process reads the same stream and a resumed run replays it to its
position: exact, at the cost of re-reading (cheap for token-id shards; JSONL is tokenized again, so
pre-tokenize big data with `python -m training selfinstruct` shards or a PAIR_READERS format).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

from .examples import PAIR_READERS, Example, examples_from_pairs, iter_chat_examples
from .finish import iter_finished_shards
from .shards import shard_paths


def iter_examples(path: Path, tok, stop_id: int, max_len: int, answers: str = "finish") -> Iterator[Example]:
    """Every training example of `path` in file order, under the answers policy (as examples.load_data reads it)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in PAIR_READERS)
        if files:
            for f in files:
                yield from _pairs(PAIR_READERS[f.suffix](f), max_len, stop_id, answers)
            return
        if shard_paths(path):
            for ids, prompt_len in iter_finished_shards(path, stop_id, max_len, answers, decode=tok.decode):
                yield Example(ids, prompt_len)
            return
        raise ValueError(f"data: {path} holds neither shard-*.npz nor a file with a registered suffix {sorted(PAIR_READERS)}")
    reader = PAIR_READERS.get(path.suffix)
    if reader is not None:
        yield from _pairs(reader(path), max_len, stop_id, answers)
    else:
        yield from iter_chat_examples(path, tok, stop_id, max_len, answers)


def _pairs(pairs, max_len: int, stop_id: int, answers: str) -> Iterator[Example]:
    for pair in pairs:
        yield from examples_from_pairs([pair], max_len, stop_id, answers)[0]


def shuffled(items: Iterator[Example], buffer: int, seed: int) -> Iterator[Example]:
    """A buffered shuffle: each item leaves from a random slot of `buffer` filled in stream order."""
    rng = random.Random(seed)
    buf: list[Example] = []
    for item in items:
        if len(buf) < buffer:
            buf.append(item)
            continue
        j = rng.randrange(buffer)
        buf[j], item = item, buf[j]
        yield item
    rng.shuffle(buf)
    yield from buf


class ExampleStream:
    """Sized like a list for the trainer's schedule (one counting pass), read by epochs in global batches."""

    def __init__(self, path: Path, tok, stop_id: int, max_len: int, answers: str, seed: int, buffer: int,
                 limit: int | None = None):
        self.path, self.tok, self.stop_id, self.max_len, self.answers = path, tok, stop_id, max_len, answers
        self.seed, self.buffer, self.limit = seed, buffer, limit
        self._len: int | None = None

    def source(self) -> Iterator[Example]:
        it = iter_examples(self.path, self.tok, self.stop_id, self.max_len, self.answers)
        for i, ex in enumerate(it):
            if self.limit is not None and i >= self.limit:
                return
            yield ex

    def __len__(self) -> int:
        if self._len is None:
            self._len = sum(1 for _ in self.source())
        return self._len

    def batches(self, epoch: int, batch_size: int, skip: int = 0) -> Iterator[list[Example]]:
        """Epoch `epoch`'s full batches in order, from batch `skip` on (a resumed run replays up to it)."""
        it = shuffled(self.source(), self.buffer, self.seed * 1_000_003 + epoch)
        k = 0
        while True:
            batch = [ex for _, ex in zip(range(batch_size), it)]
            if len(batch) < batch_size:
                return
            if k >= skip:
                yield batch
            k += 1
