"""Answer checking and eval-set reading: the grading rule of bench/data/'s eval sets (bench/data/README.md).

Pure text rules, no model: bench/ grades its runs with them and training/ its quick check, so both import
this package and neither imports the other."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

_WHITESPACE = re.compile(r"\s+")
# A "word character" for boundary purposes: any Unicode letter or digit (not underscore).
# An apostrophe right after a letter also counts, so "t" does not match inside "don't".
_NOT_BEFORE = r"(?<![^\W_])(?<![^\W_]['\u2019])"
_NOT_AFTER = r"(?![^\W_])"


def normalise(text: str) -> str:
    """Case-fold text and collapse every run of whitespace to one space."""
    return _WHITESPACE.sub(" ", text).strip().casefold()


@lru_cache(maxsize=4096)
def _answer_pattern(answer: str) -> re.Pattern[str]:
    """Compile the whole-word/phrase regex for one already-normalised answer."""
    pattern = _NOT_BEFORE + re.escape(answer) + _NOT_AFTER
    if answer[-1].isdigit():
        pattern += r"(?![.,]\d)"  # "12" must not match "12.5" or "12,000"
    if answer[0].isdigit():
        pattern = r"(?<!\d[.,])" + pattern  # nor the tail of "3.12"
    return re.compile(pattern)


@lru_cache(maxsize=4096)
def mention_pattern(element: str) -> re.Pattern[str]:
    """Whole-word regex for one already-normalised list element (bench/longform.py). Like the answer pattern, but
    a digit element only refuses decimals ("3" not in "3.5"): "1,2,3" is a list here, not one thousands number."""
    pattern = _NOT_BEFORE + re.escape(element) + _NOT_AFTER
    if element[-1].isdigit():
        pattern += r"(?!\.\d)"
    if element[0].isdigit():
        pattern = r"(?<!\d\.)" + pattern
    return re.compile(pattern)


# Any whole number, with mention_pattern's boundaries for digits ("3" in "3.5" is not one; "2nd" is not one).
WHOLE_NUMBER = re.compile(r"(?<!\d\.)" + _NOT_BEFORE + r"\d+" + _NOT_AFTER + r"(?!\.\d)")


def is_correct(output: str, answers: list[str]) -> bool:
    """Return True when any answer occurs in output as a whole word/phrase, ignoring case."""
    text = normalise(output)
    for answer in answers:
        norm = normalise(answer)
        if norm and _answer_pattern(norm).search(text):
            return True
    return False


def _problem(item: Any, require_answers: bool) -> str | None:
    """Describe what is wrong with one parsed eval record, or None if it is valid."""
    if not isinstance(item, dict):
        return "record must be a JSON object"
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return "'prompt' must be a non-empty string"
    for key in ("id", "category"):
        if key in item and (not isinstance(item[key], str) or not item[key].strip()):
            return f"'{key}' must be a non-empty string when present"
    if require_answers or "answers" in item:
        answers = item.get("answers")
        if not isinstance(answers, list) or not answers:
            return "'answers' must be a non-empty list of strings"
        if not all(isinstance(a, str) and a.strip() for a in answers):
            return "'answers' must contain only non-empty strings"
    return None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) for each non-blank line; invalid JSON raises ValueError naming the line."""
    with Path(path).open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from exc


def read_records(path: str | Path, problem: Callable[[Any], str | None]) -> list[dict[str, Any]]:
    """Every record of a JSONL set, each checked by `problem` (a message, or None when valid) and for an id used twice;
    the first bad record raises ValueError naming the file and line."""
    items: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for lineno, item in read_jsonl(path):
        msg = problem(item)
        if msg is None and item.get("id") in seen:
            msg = f"duplicate id {item['id']!r} (first on line {seen[item['id']]})"
        if msg is not None:
            raise ValueError(f"{path}: line {lineno}: {msg}")
        if item.get("id") is not None:
            seen[item["id"]] = lineno
        items.append(item)
    return items


def load_eval_set(path: str | Path, *, require_answers: bool = True) -> list[dict[str, Any]]:
    """Load a JSONL eval set, raising ValueError naming the line number of any bad record."""
    return read_records(path, lambda item: _problem(item, require_answers))
