"""Did an answer finish, and does it loop? One rule, shared by the bench, the studio, the server and training.

A reader judges an answer first by whether it ends (the model emitted its stop token before the length cap)
and whether it repeats itself; tokens per forward only mean something on answers that do both right, since
a loop is easy to predict several tokens at a time.

Loop rule (issue 21): split the text into words (lower-cased runs of letters, digits and apostrophes, so
punctuation and spacing do not hide a repeat), take every word 4-gram; the answer loops when it has at
least LOOP_MIN_NGRAMS 4-grams and more than LOOP_SHARE of them repeat an earlier one. A 4-gram is used
because shorter ones repeat in ordinary prose ("of the", "in the"); 30 % is the issue's measured line
between the AR base's normal answers (median a few percent) and the dLLM's loops (50-90 %).
List numbers at the start of a line ("13. ", "4) ") are not words: a numbered list that repeats its items
("13. Strawanges 14. Bananges 15. Strawanges ...") is a loop although its numbers go up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

LOOP_N = 4
LOOP_SHARE = 0.30
LOOP_MIN_NGRAMS = 8  # shorter answers are never called loops: too few 4-grams to tell
_WORD = re.compile(r"[\w']+")
_LIST_NUMBER = re.compile(r"^[ \t]*\d+[.)][ \t]*", re.MULTILINE)


def words(text: str) -> list[str]:
    """Lower-cased words of `text`: punctuation, markup, spacing and line-opening list numbers dropped."""
    return _WORD.findall(_LIST_NUMBER.sub(" ", text.lower()))


def _repeats(text: str, n: int) -> tuple[int, int]:
    """(word n-grams that repeat an earlier one, all word n-grams) of `text`."""
    ws = words(text)
    grams = [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


def repeated_ngram_share(text: str, n: int = LOOP_N) -> float:
    """Share of the word n-grams of `text` that repeat an earlier n-gram (0.0 with fewer than one n-gram)."""
    rep, total = _repeats(text, n)
    return rep / total if total else 0.0


def is_looping(text: str) -> bool:
    """The loop rule above. Compared in exact fractions: in floats 1 - 7/10 > 0.3, which would call a share of
    exactly 30 % a loop."""
    rep, total = _repeats(text, LOOP_N)
    return total >= LOOP_MIN_NGRAMS and Fraction(rep, total) > Fraction(str(LOOP_SHARE))


@dataclass(frozen=True, slots=True)
class Finish:
    """How an answer ended, as a reader sees it."""

    stopped: bool  # ended with its stop token (not the length cap, a cancel or the context)
    looping: bool  # the loop rule above
    repeat_share: float  # share of repeated word 4-grams
    stop_reason: str = "stop_token"  # the engine's: stop_token | max_new_tokens | cancelled | context

    @property
    def complete(self) -> bool:
        """Stopped and not looping: the only answers whose speed is worth comparing."""
        return self.stopped and not self.looping

    @property
    def label(self) -> str:
        """One word for the UI and logs: complete | looping | capped | cancelled | context (looping wins: it is
        what a reader sees first)."""
        if self.looping:
            return "looping"
        if self.stopped:
            return "complete"
        return {"max_new_tokens": "capped"}.get(self.stop_reason, self.stop_reason)


def judge(text: str, stop_reason: str) -> Finish:
    """Judge one answer from its text and the engine's stop reason."""
    return Finish(stopped=stop_reason == "stop_token", looping=is_looping(text),
                  repeat_share=round(repeated_ngram_share(text), 4), stop_reason=stop_reason)
