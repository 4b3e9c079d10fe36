"""Chat JSONL -> token ids with the answer span marked (only the last assistant turn carries loss).

The prompt is encoded exactly as the engine encodes it at inference (chat template with the generation
prompt, no special tokens added), so training and decoding see the same token boundaries.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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
