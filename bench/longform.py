"""Long answers (issue 21): does each answer finish, does it loop, and is a checkable one right?

Short-answer accuracy cannot see a model that never stops: its first 32 tokens look fine. So `bench quality`
also decodes long-answer prompts with every mode (the AR base included, in the same run) and reports per
(mode, threshold) and per set (prefix `long_` for bench/data/long_answer.jsonl, `checkable_` for
bench/data/long_checkable.jsonl):

- stop_rate: share of answers that end with the stop token before the cap (stop_reason == "stop_token");
- loop_rate: share that loop (engine/finish.py's rule, shared with the studio, the server and training);
- mean_answer_tokens;
- tokens_per_forward over all answers, and complete_tokens_per_forward over complete answers only (stopped and
  not looping; complete_n of them): a loop is easy to predict several tokens at a time, so the first number
  alone shows repetition as speed. looping_tokens_per_forward is the same over the looping answers.
- checkable only: right / right_rate, where right means complete, in order and stopped (rule below and in
  bench/data/README.md), and in_order_rate (the sequence is there, stopped or not).

Grading a checkable answer. The mentions of an answer are the whole-word, case-insensitive matches of the
item's sequence elements (grading/checker.mention_pattern), in text order, as element indices; a numbered-list
marker opening a line ("12. ", "3) ") is not a mention.
- match "list" (default): the mentions must contain the whole sequence as one contiguous run (every element,
  in order, nothing from the sequence in between), and at most EXTRA_MENTIONS mentions outside that run (room
  for a restatement such as "from 1 to 20"; "..., Sunday, Sunday, Sunday" or a second pass is wrong). Where
  every element belongs to a closed kind (bench/data/checkable_kinds.json: days, months, whole numbers, ...),
  the kind's other words are mentions too, of no element: "September, October, November, February, December"
  breaks the run, and counting on past the last number counts as extra.
- match "steps" (procedures, stages): the elements occur in order as a subsequence of the mentions; other
  mentions are free (a procedure names its water or its frog more than once). Where the elements are of a
  closed kind (an arithmetic chain's numbers), the last one the answer says must be the last element: a chain
  that wanders on through wrong results and passes the right ones on the way is wrong.
Either way the answer is right only when also stopped (stop token) and not looping.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.finish import Finish, judge

from grading.checker import WHOLE_NUMBER, load_eval_set, mention_pattern, normalise, read_records
from .common import BENCH_DIR, progress

CHECKABLE_SET = BENCH_DIR / "data" / "long_checkable.jsonl"
KINDS_FILE = BENCH_DIR / "data" / "checkable_kinds.json"
NUMBERS = "numbers"  # the kind of every whole number, matched by WHOLE_NUMBER instead of a word list
EXTRA_MENTIONS = 2
MATCH_RULES = ("list", "steps")
_KEYS = {"id", "category", "prompt", "sequence", "match"}
_ALNUM = re.compile(r"[^\W_]")

Sequence = list[tuple[str, ...]]  # per element, its normalised variants


# ---------------------------------------------------------------------------------------------- the set

def _element(value: Any) -> tuple[str, ...] | None:
    """An element is a non-empty string or a non-empty list of them (variants, e.g. ["autumn", "fall"])."""
    variants = value if isinstance(value, list) else [value]
    if not variants or not all(isinstance(v, str) and normalise(v) for v in variants):
        return None
    return tuple(normalise(v) for v in variants)


def _problem(item: Any) -> str | None:
    if not isinstance(item, dict):
        return "record must be a JSON object"
    if unknown := sorted(set(item) - _KEYS):
        return f"unknown field(s) {unknown}; allowed: {sorted(_KEYS)}"
    for key in ("id", "category", "prompt"):
        if not isinstance(item.get(key), str) or not item[key].strip():
            return f"'{key}' must be a non-empty string"
    if item.get("match", "list") not in MATCH_RULES:
        return f"'match' must be one of {list(MATCH_RULES)}, not {item['match']!r}"
    seq = item.get("sequence")
    if not isinstance(seq, list) or len(seq) < 2:
        return "'sequence' must be a list of at least 2 elements"
    elements = [_element(v) for v in seq]
    if None in elements:
        bad = seq[elements.index(None)]
        return f"'sequence' element {bad!r} must be a non-empty string or a non-empty list of non-empty strings"
    owner: dict[str, int] = {}
    for i, variants in enumerate(elements):
        for v in variants:
            if v in owner:
                return f"'sequence' names {v!r} twice (elements must be distinct: a mention must say which one it is)"
            owner[v] = i
            if not _ALNUM.search(v):  # "..." would match punctuation anywhere
                return f"'sequence' element {v!r} has no letter or digit to match as a whole word"
    return None


def load_checkable(path: str | Path) -> list[dict[str, Any]]:
    """The checkable long-answer set, validated; a bad record raises ValueError naming the file, line and field."""
    items = read_records(path, _problem)
    if not items:
        raise ValueError(f"{path}: no items")
    return items


def spread(items: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` items taken round-robin over categories (in file order), so a short run of a set sorted
    by category still sees lists, code and prose alike; all items when limit is None or large."""
    if not limit or limit >= len(items):
        return list(items)
    cats: dict[Any, list[dict[str, Any]]] = {}
    for it in items:
        cats.setdefault(it.get("category"), []).append(it)
    out: list[dict[str, Any]] = []
    for rank in range(max(len(v) for v in cats.values())):
        out += [v[rank] for v in cats.values() if rank < len(v)]
    return out[:limit]


# ---------------------------------------------------------------------------------------------- grading

@lru_cache(maxsize=1)
def kinds() -> dict[str, frozenset[str]]:
    """The closed kinds of bench/data/checkable_kinds.json, normalised; NUMBERS maps to an empty set."""
    raw = json.loads(KINDS_FILE.read_text(encoding="utf-8")).get("kinds")
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{KINDS_FILE}: 'kinds' must be an object of kind name -> list of words")
    out: dict[str, frozenset[str]] = {}
    for name, words in raw.items():
        if name == NUMBERS:
            out[name] = frozenset()
        elif isinstance(words, list) and words and all(isinstance(w, str) and _ALNUM.search(w) for w in words):
            out[name] = frozenset(normalise(w) for w in words)
        else:
            raise ValueError(f"{KINDS_FILE}: kind {name!r} must be a non-empty list of words")
    return out


def kinds_of(sequence: Sequence) -> list[str]:
    """The kinds every element of the sequence belongs to (by one of its variants)."""
    def member(kind: str, variants: tuple[str, ...]) -> bool:
        return any(v.isdigit() if kind == NUMBERS else v in kinds()[kind] for v in variants)
    return [k for k in kinds() if all(member(k, variants) for variants in sequence)]


def distractors(sequence: Sequence) -> list[re.Pattern[str]]:
    """Patterns of the words of the sequence's kinds that are no element of it (see the module docstring)."""
    own = {v for variants in sequence for v in variants}
    out: list[re.Pattern[str]] = []
    for kind in kinds_of(sequence):
        if kind == NUMBERS:
            out.append(WHOLE_NUMBER)  # a number equal to an element is that element: elements win ties
        else:
            out += [mention_pattern(w) for w in sorted(kinds()[kind] - own)]
    return out


_MARKER = re.compile(r"^[ \t]*\d{1,3}[.)][ \t]+(?=\S)", re.M)  # "12. " or "3) " opening a line


def mentions(text: str, sequence: Sequence, others: list[re.Pattern[str]] | None = None) -> list[int]:
    """Element index of each whole-word mention in `text`, in text order, -1 for a match of one of `others`
    (distractors: words of the sequence's kind that are no element); overlapping matches keep the earlier, then
    the longer one, then an element's. Numbered-list markers are not mentions: "1. 1\n2. 2" counts 1, 2."""
    norm = normalise(_MARKER.sub("", text))
    k = len(sequence)
    found = sorted((m.start(), -len(v), i, m.end()) for i, variants in enumerate(sequence) for v in variants
                   for m in mention_pattern(v).finditer(norm))
    found += [(m.start(), -(m.end() - m.start()), k, m.end()) for p in others or () for m in p.finditer(norm)]
    out: list[int] = []
    end = -1
    for start, _, i, stop in sorted(found):
        if start >= end:
            out.append(i if i < k else -1)
            end = stop
    return out


@dataclass(frozen=True, slots=True)
class Grade:
    """One checkable answer, graded."""

    finish: Finish
    in_order: bool  # the rule's sequence is there (list: one contiguous run; steps: a subsequence)
    extra_mentions: int  # mentions outside the run (list rule; 0 under steps)
    found: int  # elements found in order from the first (greedy subsequence): how far it got

    @property
    def right(self) -> bool:
        return self.in_order and self.extra_mentions <= EXTRA_MENTIONS and self.finish.complete


def grade(text: str, stop_reason: str, sequence: list[Any], match: str = "list") -> Grade:
    """Grade one answer against a sequence as written in the set (elements: strings or lists of variants)."""
    if match not in MATCH_RULES:
        raise ValueError(f"match must be one of {list(MATCH_RULES)}, not {match!r}")
    seq = [_element(v) for v in sequence]
    if None in seq or not seq:
        raise ValueError(f"sequence {sequence!r}: elements must be non-empty strings or lists of them")
    others = distractors(seq)  # type: ignore[arg-type]
    got = mentions(text, seq, others)  # type: ignore[arg-type]
    found = 0
    for i in got:
        found += i == found and found < len(seq)
    k = len(seq)
    if match == "steps":  # with a closed kind (an arithmetic chain's numbers) the last one said is the result
        return Grade(judge(text, stop_reason), found == k and (not others or got[-1] == k - 1), 0, found)
    run = next((j for j in range(len(got) - k + 1) if got[j:j + k] == list(range(k))), None)
    extra = len(got) - k if run is not None else len(got)
    return Grade(judge(text, stop_reason), run is not None, extra, found)


# ---------------------------------------------------------------------------------------------- measures

def tokens_per_forward(outs: list[dict[str, Any]]) -> float | None:
    """Answer tokens / forwards over recorded answers (None without forwards)."""
    nfe = sum(o["nfe"] for o in outs)
    return sum(o["answer_tokens"] for o in outs) / nfe if nfe else None


class LongScore:
    """Running totals of one (mode, threshold) over one long set."""

    def __init__(self, checkable: bool) -> None:
        self.checkable = checkable
        self.outputs: list[dict[str, Any]] = []
        self.seconds = 0.0

    def add(self, chunk: list[dict[str, Any]], results: list[Any]) -> None:
        self.seconds += max(r.summary.seconds for r in results)
        for it, r in zip(chunk, results):
            s = r.summary
            f = judge(s.text, s.stop_reason)
            out = {"id": it.get("id"), "category": it.get("category"), "output": s.text,
                   "answer_tokens": s.answer_tokens, "nfe": s.nfe, "stop_reason": s.stop_reason,
                   "finish": f.label, "repeat_share": f.repeat_share}
            if self.checkable:
                g = grade(s.text, s.stop_reason, it["sequence"], it.get("match", "list"))
                out.update(right=g.right, in_order=g.in_order, extra_mentions=g.extra_mentions, found=g.found,
                           of=len(it["sequence"]))
            self.outputs.append(out)

    def result(self, prefix: str) -> dict[str, Any]:
        outs = self.outputs
        n = len(outs)
        stopped = [o for o in outs if o["stop_reason"] == "stop_token"]
        looping = [o for o in outs if o["finish"] == "looping"]
        complete = [o for o in stopped if o["finish"] == "complete"]  # stopped and not looping
        reasons: dict[str, int] = {}
        for o in outs:
            reasons[o["stop_reason"]] = reasons.get(o["stop_reason"], 0) + 1
        toks, nfe = sum(o["answer_tokens"] for o in outs), sum(o["nfe"] for o in outs)
        r: dict[str, Any] = {
            "n": n, "stop_rate": len(stopped) / n if n else 0.0, "loop_rate": len(looping) / n if n else 0.0,
            "complete_rate": len(complete) / n if n else 0.0, "mean_answer_tokens": toks / n if n else 0.0,
            "answer_tokens": toks, "nfe": nfe, "tokens_per_forward": toks / nfe if nfe else 0.0,
            "complete_n": len(complete), "complete_tokens_per_forward": tokens_per_forward(complete),
            "looping_n": len(looping), "looping_tokens_per_forward": tokens_per_forward(looping),
            "stop_reasons": reasons, "seconds": self.seconds}
        if self.checkable:
            right = sum(o["right"] for o in outs)
            r.update(right=right, right_rate=right / n if n else 0.0,
                     in_order_rate=sum(o["in_order"] for o in outs) / n if n else 0.0)
        r["outputs"] = outs
        return {f"{prefix}_{k}": v for k, v in r.items()}


def run_long_sets(eng, args: argparse.Namespace, runs: list[tuple[str, float | None]], cfgs: list[Any],
                  results: list[dict[str, Any]]) -> list[str]:
    """Decode each long set with every (mode, threshold) in `runs` (cfgs: their DecodeConfigs, long cap set),
    chunk by chunk and setting by setting in turn (drift of a shared machine hits all alike); results gain the
    prefixed measures. Returns the prefixes run."""
    sets: list[tuple[str, list[dict[str, Any]]]] = []
    if args.long_set:
        sets.append(("long", spread(load_eval_set(args.long_set, require_answers=False), args.long_limit)))
    if args.checkable_set:
        sets.append(("checkable", spread(load_checkable(args.checkable_set), args.checkable_limit)))
    bar = progress(len(runs) * sum(len(items) for _, items in sets), "long sets", disable=args.quiet)
    for prefix, items in sets:
        scores = [LongScore(prefix == "checkable") for _ in runs]
        for j in range(0, len(items), args.batch_size):
            chunk = items[j:j + args.batch_size]
            ids = [eng.encode(eng.chat_prompt([{"role": "user", "content": it["prompt"]}])) for it in chunk]
            for (mode, th), cfg, sc in zip(runs, cfgs, scores):
                bar.set_postfix_str(f"{prefix} {mode} {th if th is not None else ''}")
                sc.add(chunk, eng.generate_ids(ids, cfg, record=False))
                bar.update(len(chunk))
        for r, sc in zip(results, scores):
            r.update(sc.result(prefix))
    bar.close()
    return [p for p, _ in sets]


def long_chart(results: list[dict[str, Any]], prefixes: list[str]):
    """Stop rate, loop rate and right-and-stopped of the dLLM vs threshold, the AR base's as dotted reference
    lines of the same colour; tokens per forward (all answers vs complete only) on the right axis."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    diff = sorted((r for r in results if r["mode"] == "diffusion"), key=lambda r: r["threshold"])
    ar = next((r for r in results if r["mode"] == "ar"), None)
    xs = [r["threshold"] for r in diff]
    span = [min(xs + [0.5]) - 0.05, max(xs + [1.0]) + 0.05]  # AR's reference lines run across the thresholds
    lines = [(p, k, name) for p in prefixes for k, name in
             (("stop_rate", "stop rate"), ("loop_rate", "loop rate"), ("right_rate", "right and stopped"))
             if k != "right_rate" or p == "checkable"]
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"]
    for (p, k, name), color in zip(lines, palette):
        label = f"{p}: {name}"
        fig.add_trace(go.Scatter(name=f"dLLM {label}", x=xs, y=[r.get(f"{p}_{k}") for r in diff],
                                 mode="lines+markers", line_color=color), secondary_y=False)
        if ar is not None and f"{p}_{k}" in ar:  # values in the legend: annotations on close lines overlap
            fig.add_trace(go.Scatter(name=f"AR {label} {ar[f'{p}_{k}']:.2f}", x=span, y=[ar[f"{p}_{k}"]] * 2,
                                     mode="lines", line_dash="dot", line_color=color), secondary_y=False)
    for p, dash in zip(prefixes, ("dash", "dashdot")):
        for k, name in (("tokens_per_forward", "all answers"), ("complete_tokens_per_forward", "complete only")):
            fig.add_trace(go.Scatter(name=f"dLLM {p}: tokens/forward, {name}", x=xs, y=[r.get(f"{p}_{k}") for r in diff],
                                     mode="lines+markers", line_dash=dash if k == "tokens_per_forward" else "dot",
                                     line_color="gray" if p == "long" else "black"), secondary_y=True)
    fig.update_xaxes(title_text="threshold", range=span)
    fig.update_yaxes(title_text="share of answers", range=[0, 1.05], secondary_y=False)
    tpfs = [v for r in diff for p in prefixes for k in ("tokens_per_forward", "complete_tokens_per_forward")
            if isinstance(v := r.get(f"{p}_{k}"), (int, float))]
    fig.update_yaxes(title_text="tokens per forward", range=[0, 1.15 * max(tpfs + [1.0])], secondary_y=True)
    fig.update_layout(title="Long answers: stop, loop and right-and-stopped vs threshold (AR base dotted)",
                      template="plotly_white")
    return fig
