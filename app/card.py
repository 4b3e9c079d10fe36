"""What the loaded model measured, read from the adapter's model card (assets/MODEL_CARD.md front matter).

The numbers are data, not code: the card's YAML front matter holds the bundled adapter's measured accuracy and
tokens per forward (from `python -m bench quality`), and how often its long answers finish and loop against its
AR base's (the long_* keys). They are shown only when the loaded adapter is the one the
card describes (its metadata's training step matches), so a retrained or foreign adapter never borrows them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from safetensors import safe_open

CARD = Path(__file__).resolve().parent.parent / "assets" / "MODEL_CARD.md"
PAPER_URL = "https://arxiv.org/abs/2509.26328"


@dataclass(frozen=True)
class LongAnswers:
    """Whether long answers finish (engine/finish.py's rule), dLLM against its AR base in the same run, and tokens
    per forward over complete non-looping answers only (a loop is easy to predict several tokens at a time)."""

    source: str  # where the numbers come from (a results file, or the issue that measured them)
    set: str
    stop_rate: float  # share of answers that end with the stop token before the cap
    loop_rate: float  # share of answers that loop
    ar_stop_rate: float
    ar_loop_rate: float
    tokens_per_forward_complete: float | None = None
    tokens_per_forward_all: float | None = None
    complete_n: int | None = None  # how many complete answers tokens_per_forward_complete is over


LONG_KEYS = ("long_stop_rate", "long_loop_rate", "ar_long_stop_rate", "ar_long_loop_rate")


def long_answers(fm: dict[str, Any]) -> LongAnswers | None:
    """The card's long-answer measures (front-matter keys long_stop_rate, long_loop_rate, ar_long_stop_rate,
    ar_long_loop_rate, tokens_per_forward_complete, long_complete_n, long_tokens_per_forward, long_source, long_set),
    or None when
    the four rates are not all there."""
    if not all(isinstance(fm.get(k), (int, float)) for k in LONG_KEYS):
        return None
    opt = lambda k: float(fm[k]) if isinstance(fm.get(k), (int, float)) else None  # noqa: E731
    return LongAnswers(str(fm.get("long_source", "model card")), str(fm.get("long_set", "long-answer prompts")),
                       *(float(fm[k]) for k in LONG_KEYS), opt("tokens_per_forward_complete"),
                       opt("long_tokens_per_forward"),
                       int(fm["long_complete_n"]) if isinstance(fm.get("long_complete_n"), int) else None)


@dataclass(frozen=True)
class Measured:
    """One adapter's measured quality: AR base accuracy and, per threshold, diffusion accuracy + tokens/forward."""

    source: str
    set: str
    ar_accuracy: float
    by_threshold: dict[float, tuple[float, float]]  # threshold -> (accuracy, tokens per forward on long answers)
    train_minutes: float | None = None  # from the adapter's metadata
    tokens_seen: int | None = None
    long: LongAnswers | None = None  # stop and loop rates on long answers, when the card has them

    def at(self, threshold: float) -> tuple[float, float] | None:
        return self.by_threshold.get(round(float(threshold), 2))


def front_matter(path: Path = CARD) -> dict[str, Any]:
    """The YAML between the card's leading '---' lines ({} when there is none)."""
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return {}
    end = text.find("\n---\n", 4)
    if end < 0:
        return {}
    return yaml.safe_load(text[4:end]) or {}


def adapter_meta(adapter: Path | None) -> dict[str, str]:
    """An adapter file's metadata: training step, seconds, tokens seen ({} without an adapter)."""
    if adapter is None or not Path(adapter).is_file():
        return {}
    with safe_open(str(adapter), "pt") as f:
        return f.metadata() or {}


def measured_for(adapter: Path | None, path: Path = CARD) -> Measured | None:
    """The card's measurements when `adapter` is the adapter the card describes, else None."""
    fm = front_matter(path)
    m = fm.get("measured")
    meta = adapter_meta(adapter)
    if not m or meta.get("step") is None or str(fm.get("adapter_step")) != meta["step"]:
        return None
    rows = {round(float(r["threshold"]), 2): (float(r["accuracy"]), float(r["tokens_per_forward_long"]))
            for r in m["diffusion"]}
    # every phase of training when the adapter records them (training export), else its last run
    seconds, tokens = meta.get("train_seconds_total", meta.get("train_seconds")), meta.get("tokens_seen_total",
                                                                                         meta.get("tokens_seen"))
    minutes = float(seconds) / 60 if seconds is not None else None
    tokens = int(tokens) if tokens is not None else None
    return Measured(str(m["source"]), str(m["set"]), float(m["ar_accuracy"]), rows, minutes, tokens, long_answers(fm))
