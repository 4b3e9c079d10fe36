"""Chat JSONL -> token ids with the answer span marked (only the last assistant turn carries loss).

The prompt is encoded exactly as the engine encodes it at inference (chat template with the generation
prompt, no special tokens added), so training and decoding see the same token boundaries.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence


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


def load_examples(path: Path, tok, stop_id: int, max_len: int, keep_truncated: bool = True,
                  min_answer: int = 1) -> tuple[list[Example], dict[str, int]]:
    """Read, encode and cut to max_len; returns the examples and counts of what was dropped.

    Answers the teacher cut at max_new_tokens are kept without a stop token by default (their prefix
    is still exactly what the AR base says); keep_truncated=False drops them. A directory is read as
    token-id shards of `python -m training selfinstruct` (same rules, same counts).
    """
    if path.is_dir():
        from .selfinstruct import load_shard_examples

        return load_shard_examples(path, stop_id, max_len, keep_truncated, min_answer)
    out: list[Example] = []
    stats = {"records": 0, "kept_truncated": 0, "dropped_truncated": 0, "dropped_long_prompt": 0, "cut_to_max_len": 0}
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            stats["records"] += 1
            cut = rec.get("stop_reason", "stop_token") != "stop_token"
            if cut and not keep_truncated:
                stats["dropped_truncated"] += 1
                continue
            ex = encode_chat(tok, rec["messages"], stop_id)
            if cut and ex.ids[-1] == stop_id:  # the teacher never stopped: no stop token to learn here
                ex = Example(ex.ids[:-1], ex.prompt_len)
                stats["kept_truncated"] += 1
            if ex.prompt_len + min_answer > max_len:
                stats["dropped_long_prompt"] += 1
                continue
            if len(ex.ids) > max_len:
                stats["cut_to_max_len"] += 1
                ex = Example(ex.ids[:max_len], ex.prompt_len)
            out.append(ex)
    return out, stats


Pairs = Iterable[tuple[Sequence[int], Sequence[int]]]  # (prompt_ids, answer_ids), answer through its stop token
# Token-id sources by file suffix (e.g. ".npz" shards): a reader yields Pairs; anything else is chat JSONL.
PAIR_READERS: dict[str, Callable[[Path], Pairs]] = {}


def examples_from_pairs(pairs: Pairs, max_len: int, min_answer: int = 1) -> tuple[list[Example], dict[str, int]]:
    """Already tokenized (prompt, answer) pairs -> examples cut to max_len, with the same counts as JSONL."""
    out: list[Example] = []
    stats = {"records": 0, "dropped_empty_answer": 0, "dropped_long_prompt": 0, "cut_to_max_len": 0}
    for prompt, answer in pairs:
        stats["records"] += 1
        if len(answer) < min_answer:
            stats["dropped_empty_answer"] += 1
            continue
        if len(prompt) + min_answer > max_len:
            stats["dropped_long_prompt"] += 1
            continue
        ids = [int(t) for t in prompt] + [int(t) for t in answer]
        if len(ids) > max_len:
            stats["cut_to_max_len"] += 1
            ids = ids[:max_len]
        out.append(Example(ids, len(prompt)))
    return out, stats


def load_data(path: Path, tok, stop_id: int, max_len: int, keep_truncated: bool = True) -> tuple[list[Example], dict]:
    """Examples from a registered token-id source (PAIR_READERS, by suffix; a directory: its files with a
    registered suffix, in name order, e.g. shards) or from chat JSONL."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in PAIR_READERS)
        if not files:
            raise ValueError(f"data: {path} holds no file with a registered suffix {sorted(PAIR_READERS)}")
        return examples_from_pairs((pair for f in files for pair in PAIR_READERS[f.suffix](f)), max_len)
    reader = PAIR_READERS.get(path.suffix)
    if reader is not None:
        return examples_from_pairs(reader(path), max_len)
    return load_examples(path, tok, stop_id, max_len, keep_truncated)
