"""Local lm-eval tasks over small JSONL files next to this module (no dataset download)."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _docs(name: str):
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_short_answer(**kwargs):
    """Short-answer generation docs: {"prompt", "answers": [...]} (the bench eval-set format)."""
    return _docs("short_answer.jsonl")


def load_choice(**kwargs):
    """Two-way multiple choice docs for the loglikelihood path: {"question", "choices", "label"}."""
    return _docs("choice.jsonl")


def process_short_answer(doc: dict, results: list[str]) -> dict[str, float]:
    """Correct when any answer occurs in the output as a whole word, ignoring case (grading/checker.py)."""
    from grading.checker import is_correct

    return {"acc": float(is_correct(results[0], doc["answers"]))}
