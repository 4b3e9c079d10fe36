"""Tests for the eval sets, the answer checker and the training prompt builder."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from grading.checker import is_correct, load_eval_set  # noqa: E402
from training.data_prompts import (  # noqa: E402
    EvalFilter,
    build_prompts,
    load_excluded_prompts,
    normalise_prompt,
)

EVAL_SHORT = REPO_ROOT / "bench" / "data" / "eval_short.jsonl"
LONG_ANSWER = REPO_ROOT / "bench" / "data" / "long_answer.jsonl"
TRAIN_FILE = REPO_ROOT / "training" / "data" / "prompts.jsonl"


def test_eval_short_size_and_balance() -> None:
    """The short eval set has >= 200 valid items, >= 4 categories, >= 40 items each."""
    items = load_eval_set(EVAL_SHORT)
    assert len(items) >= 200
    counts = Counter(item["category"] for item in items)
    assert len(counts) >= 4
    assert all(n >= 40 for n in counts.values()), counts
    assert len({normalise_prompt(item["prompt"]) for item in items}) == len(items)


def test_eval_short_answers_are_self_consistent() -> None:
    """Every listed answer string is itself judged correct by the checker."""
    for item in load_eval_set(EVAL_SHORT):
        for answer in item["answers"]:
            assert is_correct(f"The answer is {answer}.", item["answers"]), item["id"]


def test_long_answer_set() -> None:
    """The long-answer set has >= 50 unique prompts, none shared with the short set."""
    items = load_eval_set(LONG_ANSWER, require_answers=False)
    assert len(items) >= 50
    prompts = {normalise_prompt(item["prompt"]) for item in items}
    assert len(prompts) == len(items)
    short = {normalise_prompt(item["prompt"]) for item in load_eval_set(EVAL_SHORT)}
    assert not prompts & short


def test_training_prompts_exclude_eval_prompts() -> None:
    """No built or written training prompt equals (or near-duplicates) an eval prompt."""
    eval_prompts = load_excluded_prompts()
    excluded = {normalise_prompt(p) for p in eval_prompts}
    built = build_prompts()
    assert not {normalise_prompt(p) for p in built} & excluded
    filt = EvalFilter(eval_prompts)
    assert not [p for p in built if filt.rejects(p)]
    if TRAIN_FILE.exists():
        with TRAIN_FILE.open(encoding="utf-8") as handle:
            written = [json.loads(line)["prompt"] for line in handle if line.strip()]
        assert len(written) >= 8000
        assert not {normalise_prompt(p) for p in written} & excluded


def test_near_duplicate_filter_catches_paraphrases() -> None:
    """The near-duplicate rule flags light rewordings of eval prompts but not unrelated ones."""
    filt = EvalFilter(["What is the capital of France? Answer with one word.", "List ten fruits."])
    assert filt.rejects("what is  the capital of FRANCE? answer with one word.")
    assert filt.rejects("Name the capital city of France.")
    assert filt.rejects("Name 10 fruits.")
    assert not filt.rejects("What is the capital of Peru?")
    assert not filt.rejects("Tell me three facts about France.")


def test_build_prompts_deterministic_and_unique() -> None:
    """Same seed gives the same list; a different seed gives a different one; prompts are unique."""
    first = build_prompts(8000, seed=0)
    assert first == build_prompts(8000, seed=0)
    assert len(first) == 8000
    assert len({normalise_prompt(p) for p in first}) == len(first)
    assert all(isinstance(p, str) and p.strip() for p in first)
    other = build_prompts(500, seed=1)
    assert other == build_prompts(500, seed=1)
    assert other != build_prompts(500, seed=2)


def test_prompts_file_rebuilds_byte_identically(tmp_path: Path) -> None:
    """`python -m training.data_prompts` (its vocabularies and templates read from training/data/*.json)
    rebuilds the committed training/data/prompts.jsonl byte for byte."""
    from training.data_prompts import main

    out = tmp_path / "prompts.jsonl"
    main(["--out", str(out)])
    assert out.read_bytes() == TRAIN_FILE.read_bytes()


def test_maths_draws_run_left_to_right_and_refuse_anything_else() -> None:
    """prompt_maths.json's draws: Python's evaluation order (the random stream is part of the data), earlier names
    visible, and any other expression (attribute access, a call outside the draw functions) refused by name."""
    import random

    from training.data_prompts import _draw

    r, ref = random.Random(7), random.Random(7)
    assert _draw("d * randint(5, 20) + randint(0, d - 1)", {"d": 12}, r) == 12 * ref.randint(5, 20) + ref.randint(0, 11)
    assert _draw("randints(10, 99, randint(4, 6))", {}, r) == [ref.randint(10, 99) for _ in range(ref.randint(4, 6))]
    assert _draw("and_list([3, 4, 5])", {}, r) == "3, 4 and 5"
    assert _draw("-5 + max(a, 2)", {"a": 9}, r) == 4
    for bad in ("__import__('os')", "a.real", "open('x')", "a / 2", "unknown + 1"):
        with pytest.raises(ValueError, match="prompt_maths.json"):
            _draw(bad, {"a": 1}, r)


def test_checker_whole_word_matching() -> None:
    """Whole-word, case-insensitive matching with number boundaries."""
    assert is_correct("The capital is Paris.", ["paris"])
    assert not is_correct("120", ["12"])
    assert is_correct("twelve", ["12", "twelve"])
    assert is_correct("It is 12.", ["12"])
    assert not is_correct("about 12.5 units", ["12"])
    assert not is_correct("Parisian food", ["paris"])
    assert is_correct("The answer:\n blue   SKY", ["blue sky"])
    assert is_correct("c-a-t", ["c-a-t"])
    assert not is_correct("anything at all", [""])
    assert not is_correct("", ["paris"])


def test_load_eval_set_reports_line_number(tmp_path: Path) -> None:
    """Malformed lines raise ValueError naming the offending line number."""
    good = json.dumps({"id": "a", "category": "facts", "prompt": "Q?", "answers": ["x"]})
    cases = {
        json.dumps({"id": "b", "prompt": "Q2?", "answers": []}): "answers",
        json.dumps({"id": "b", "prompt": "", "answers": ["x"]}): "prompt",
        json.dumps({"id": "b", "prompt": "Q2?", "answers": ["x", 3]}): "answers",
        "{not json": "invalid JSON",
        json.dumps({"id": "a", "prompt": "Q2?", "answers": ["x"]}): "duplicate id",
    }
    for bad, problem in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(f"{good}\n\n{bad}\n", encoding="utf-8")
        with pytest.raises(ValueError, match=rf"line 3: .*{problem}"):
            load_eval_set(path)
    path = tmp_path / "ok.jsonl"
    path.write_text(good + "\n", encoding="utf-8")
    assert load_eval_set(path)[0]["answers"] == ["x"]


def test_load_eval_set_messages_exactly(tmp_path: Path) -> None:
    """Each refusal says exactly what is wrong (mutation testing left the messages, the id/category rule, the
    optional answers of prompt-only sets and the duplicate's first line unpinned)."""
    path = tmp_path / "set.jsonl"

    def refused(record: object, require_answers: bool = True) -> str:
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
        with pytest.raises(ValueError) as info:
            load_eval_set(path) if require_answers else load_eval_set(path, require_answers=False)  # the default
        return str(info.value).split("line 1: ", 1)[1]

    assert refused([1]) == "record must be a JSON object"
    assert refused({"prompt": " "}) == "'prompt' must be a non-empty string"
    assert refused({"prompt": "Q", "id": 3, "answers": ["x"]}) == "'id' must be a non-empty string when present"
    assert refused({"prompt": "Q", "id": " ", "answers": ["x"]}) == "'id' must be a non-empty string when present"
    assert refused({"prompt": "Q", "category": "", "answers": ["x"]}) == \
        "'category' must be a non-empty string when present"
    assert refused({"prompt": "Q"}) == "'answers' must be a non-empty list of strings"
    assert refused({"prompt": "Q", "answers": [" "]}) == "'answers' must contain only non-empty strings"
    # prompt-only sets (long answers): answers are optional, but checked when present
    assert refused({"prompt": "Q", "answers": []}, require_answers=False) == \
        "'answers' must be a non-empty list of strings"
    path.write_text(json.dumps({"prompt": "Q"}) + "\n", encoding="utf-8")
    assert load_eval_set(path, require_answers=False) == [{"prompt": "Q"}]
    lines = [{"id": "a", "prompt": "Q", "answers": ["x"]}, {"id": "b", "prompt": "R", "answers": ["y"]},
             {"id": "b", "prompt": "S", "answers": ["z"]}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 3: duplicate id 'b' \(first on line 2\)$"):
        load_eval_set(path)
    path.write_text(json.dumps({"prompt": "Café?", "answers": ["é"]}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_eval_set(path)[0]["prompt"] == "Café?"  # read as UTF-8 whatever the locale
