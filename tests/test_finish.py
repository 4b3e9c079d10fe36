"""The shared finish rule (engine/finish.py): stop, loop and the labels, on loops seen in issue 21 and on text
that must not count as a loop. Pure text, no model: runs in milliseconds."""
from __future__ import annotations

import pytest

from engine.finish import LOOP_MIN_NGRAMS, LOOP_N, LOOP_SHARE, is_looping, judge, repeated_ngram_share, words

# Issue 21: the dLLM at the studio defaults on "Write a haiku about the sea." and on the days of the week.
HAIKU_LOOP = "The sea is a beautiful poem that\n" + "that / The is a beautiful poem that / " * 20
DAYS_LOOP = "Monday, Tuesday,, Wednesday, Friday,, Thursday,,, Sunday, " * 12
PARAGRAPH = ("Rain forms when water vapour in the air cools and condenses into tiny droplets around specks of dust. "
             "These droplets gather into clouds, and as they collide they grow heavier. When they are too heavy for "
             "rising air to hold up, they fall as rain. In cold clouds, ice crystals grow first and melt on the way "
             "down, which is why a summer storm can start as snow high above the ground.")
NUMBERED = "\n".join(f"{i}. {item}" for i, item in enumerate([
    "Apples are crisp and sweet.", "Bananas give quick energy.", "Oranges are full of vitamin C.",
    "Grapes grow in bunches on vines.", "Mangoes are popular in India.", "Pears ripen after picking.",
    "Cherries have a single stone.", "Kiwis have fuzzy brown skin.", "Pineapples take two years to grow.",
    "Strawberries carry their seeds outside."], start=1))


def test_issue_loops_are_looping():
    for text in (HAIKU_LOOP, DAYS_LOOP):
        assert repeated_ngram_share(text) > 0.5, text[:60]
        assert is_looping(text)


@pytest.mark.parametrize("text", [PARAGRAPH, NUMBERED, "Paris.", "The answer is 4.", ""])
def test_ordinary_answers_are_not_looping(text):
    assert not is_looping(text)
    assert repeated_ngram_share(text) < LOOP_SHARE


def test_punctuation_and_case_do_not_hide_a_repeat():
    assert words("Monday,, TUESDAY!\n<b>it's</b>") == ["monday", "tuesday", "b", "it's", "b"]
    assert repeated_ngram_share("a b c d. A, B; c D") == pytest.approx(1 / 5)  # abcd repeats once in 5 grams


def test_boundary_share_exactly_at_the_line_is_not_a_loop():
    assert (LOOP_N, LOOP_SHARE, LOOP_MIN_NGRAMS) == (4, 0.30, 8)  # the numbers the texts below are built for
    at_line = "a b c d a b c d a b f g h"  # 10 word 4-grams, 3 repeat an earlier one: exactly 30 %
    over = "a b c d a b c d a b c g h"  # 10 word 4-grams, 4 repeat: 40 %
    assert repeated_ngram_share(at_line) == pytest.approx(0.3) and not is_looping(at_line)
    assert repeated_ngram_share(over) == pytest.approx(0.4) and is_looping(over)


def test_boundary_too_few_ngrams_is_never_a_loop():
    enough = " ".join(["la"] * (LOOP_N + LOOP_MIN_NGRAMS - 1))  # exactly LOOP_MIN_NGRAMS 4-grams, all but one repeat
    short = " ".join(["la"] * (LOOP_N + LOOP_MIN_NGRAMS - 2))  # one 4-gram fewer
    assert is_looping(enough)
    assert not is_looping(short) and repeated_ngram_share(short) > LOOP_SHARE


def test_judge_labels_and_complete():
    ok = judge(PARAGRAPH, "stop_token")
    assert ok.stopped and not ok.looping and ok.complete and ok.label == "complete"
    capped = judge(PARAGRAPH, "max_new_tokens")
    assert not capped.stopped and not capped.complete and capped.label == "capped"
    loop_stopped = judge(DAYS_LOOP, "stop_token")  # stopped, yet a loop: not complete, and labelled a loop
    assert loop_stopped.stopped and loop_stopped.looping and not loop_stopped.complete
    assert loop_stopped.label == "looping" and loop_stopped.repeat_share > LOOP_SHARE
    assert judge("Hi", "cancelled").label == "cancelled" and judge("Hi", "context").label == "context"


def test_a_numbered_list_that_repeats_its_items_loops():
    """The list numbers go up but the items repeat: line-opening numbers are not words, so this is a loop."""
    text = "\n".join(f"{i}. Strawanges\n{i + 1}. Bananges" for i in range(1, 30, 2))
    assert is_looping(text)
    distinct = "\n".join(f"{i}. {w}" for i, w in enumerate(
        "apple banana cherry date elderberry fig grape honeydew kiwi lemon mango".split(), 1))
    assert not is_looping(distinct)


def test_repeat_share_and_words_exactly():
    """The reported share is the 4-gram share to 4 decimals (the studio and bench show it), and list numbers that
    open a line leave no words behind (found by mutation testing: neither was pinned)."""
    text = "a b c d a b c d e"  # 6 word 4-grams, one ("a b c d") repeated: 1/6
    assert repeated_ngram_share(text) == pytest.approx(1 / 6)
    assert judge(text, "stop_token").repeat_share == 0.1667
    assert words("1. Apples\n2. Pears, and 3 plums") == ["apples", "pears", "and", "3", "plums"]
