"""Training examples: chat JSONL, token-id shards or registered token-id files -> `Example(ids, prompt_len)`,
under the answers policy (training/finish.py). Only the last assistant turn carries loss.

For chat JSONL the prompt is encoded exactly as the engine encodes it at inference (chat template with the generation
prompt, no special tokens added), so training and decoding see the same token boundaries.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from .finish import FinishStats, Pieces, finish_answer, finish_shards
from .shards import shard_paths


@dataclass(slots=True)
class Example:
    """One training sequence: ids = prompt + answer (answer ends with the stop token unless cut)."""

    ids: list[int]
    prompt_len: int

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.prompt_len


def encode_chat(tok, messages: list[dict[str, str]], stop_id: int) -> Example:
    """Everything before the last assistant turn is prompt; the answer runs through its stop token."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    prompt_text = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    full_text = tok.apply_chat_template(messages, tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError("chat template: the conversation does not extend the generation prompt")
    prompt = list(tok.encode(prompt_text, add_special_tokens=False))
    answer = list(tok.encode(full_text[len(prompt_text):], add_special_tokens=False))
    if stop_id in answer:  # drop what the template adds after the stop token (a newline)
        answer = answer[:answer.index(stop_id) + 1]
    return Example(prompt + answer, len(prompt))


def load_examples(path: Path, tok, stop_id: int, max_len: int, answers: str = "finish",
                  min_answer: int = 1) -> tuple[list[Example], dict]:
    """Read, encode and apply the answers policy (training/finish.py: by default every kept answer ends with
    its stop token, capped ones cut at a sentence end and closed, loops dropped); returns the examples and
    the policy's counts. A directory is read as token-id shards of `python -m training selfinstruct`.
    """
    if path.is_dir():
        return load_shard_examples(path, stop_id, max_len, answers, min_answer, decode=tok.decode)
    stats = FinishStats()
    out = list(iter_chat_examples(path, tok, stop_id, max_len, answers, min_answer, stats))
    return out, stats.to_json() | {"answers": answers}


def iter_chat_examples(path: Path, tok, stop_id: int, max_len: int, answers: str = "finish", min_answer: int = 1,
                       stats: FinishStats | None = None) -> Iterator[Example]:
    """Chat JSONL record by record under the answers policy (load_examples' reader; training/stream.py's too)."""
    stats, piece = stats if stats is not None else FinishStats(), Pieces(tok.decode)
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            stopped = rec.get("stop_reason", "stop_token") == "stop_token"
            ex = encode_chat(tok, rec["messages"], stop_id)
            answer = ex.ids[ex.prompt_len:]
            if not stopped and answer[-1:] == [stop_id]:  # the template closed a turn the teacher never ended
                answer = answer[:-1]
            elif stopped and answer[-1:] != [stop_id]:
                answer = answer + [stop_id]
            ids = finish_answer(ex.ids[:ex.prompt_len], answer, stopped, max_len=max_len, stop_id=stop_id,
                                piece=piece, policy=answers, stats=stats, min_answer=min_answer)
            if ids is not None:
                yield Example(ids, ex.prompt_len)


def load_shard_examples(path: Path, stop_id: int, max_len: int, answers: str = "finish", min_answer: int = 1,
                        decode=None) -> tuple[list[Example], dict]:
    """Training examples from a self-instruct directory (token-id shards, training/shards.py) under an answers
    policy (finish.finish_shards), and the policy's counts; each prompt once, in shard order."""
    kept, stats = finish_shards(path, stop_id, max_len, answers, min_answer, decode)
    return [Example(ids, prompt_len) for ids, prompt_len in kept], stats

Pairs = Iterable[tuple[Sequence[int], Sequence[int]]]  # (prompt_ids, answer_ids), answer through its stop token
# Token-id sources by file suffix (e.g. ".npz" shards): a reader yields Pairs; anything else is chat JSONL.
PAIR_READERS: dict[str, Callable[[Path], Pairs]] = {}


def examples_from_pairs(pairs: Pairs, max_len: int, stop_id: int, answers: str = "finish",
                        min_answer: int = 1) -> tuple[list[Example], dict[str, int]]:
    """Already tokenized (prompt, answer) pairs -> examples. Without a tokenizer nothing can be cut at a
    sentence end, so under 'finish' an answer that does not end with its stop token, or does not fit
    max_len, is dropped; under 'keep' it is cut to max_len as it is (training/finish.py)."""
    out: list[Example] = []
    stats = {"records": 0, "dropped_empty_answer": 0, "dropped_long_prompt": 0, "cut_to_max_len": 0,
             "dropped_without_stop": 0, "dropped_too_long": 0, "answers": answers}
    for prompt, answer in pairs:
        stats["records"] += 1
        answer = [int(t) for t in answer]
        if len(answer) < min_answer:
            stats["dropped_empty_answer"] += 1
            continue
        if len(prompt) + min_answer > max_len:
            stats["dropped_long_prompt"] += 1
            continue
        ids = [int(t) for t in prompt] + answer
        if answers != "keep" and answer[-1] != stop_id:
            stats["dropped_without_stop"] += 1
            continue
        if len(ids) > max_len:
            if answers != "keep":
                stats["dropped_too_long"] += 1
                continue
            stats["cut_to_max_len"] += 1
            ids = ids[:max_len]
        out.append(Example(ids, len(prompt)))
    return out, stats


def load_data(path: Path, tok, stop_id: int, max_len: int, answers: str = "finish") -> tuple[list[Example], dict]:
    """Examples from a registered token-id source (PAIR_READERS, by suffix; a directory: its files with a
    registered suffix, in name order), a `training selfinstruct` shard directory, or chat JSONL."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in PAIR_READERS)
        if files:
            return examples_from_pairs((pair for f in files for pair in PAIR_READERS[f.suffix](f)), max_len, stop_id,
                                       answers)
        if shard_paths(path):
            return load_examples(path, tok, stop_id, max_len, answers)
        raise ValueError(f"data: {path} holds neither `training selfinstruct` shards (shard-*.npz) nor a file "
                         f"with a registered suffix {sorted(PAIR_READERS)}")
    reader = PAIR_READERS.get(path.suffix)
    if reader is not None:
        return examples_from_pairs(reader(path), max_len, stop_id, answers)
    return load_examples(path, tok, stop_id, max_len, answers)
