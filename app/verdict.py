"""Did an answer finish, and may its speed be compared? The studio's words for engine/finish.py's rule.

A loop is easy to predict several tokens at a time, so an answer that hit the length cap or repeats itself
shows a high tokens/s and tokens per forward that mean nothing. The studio marks such answers (chat bubble,
meters, race, sweep) and compares speed only between answers that both finished: complete (stopped with the
stop token) and not looping. The rule itself lives in engine/finish.py; nothing here redefines it.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from engine import Summary
from engine.finish import LOOP_N, Finish, judge

STOPPED = "cancelled"  # the engine's stop_reason when Stop ended a decode
SIDES = {"diffusion": "dLLM", "ar": "AR"}


def _d(s: Summary | dict[str, Any]) -> dict[str, Any]:
    return s if isinstance(s, dict) else asdict(s)


def finish_of(s: Summary | dict[str, Any]) -> Finish:
    """The shared rule applied to a run's summary (its text and stop reason)."""
    d = _d(s)
    return judge(str(d.get("text") or ""), str(d["stop_reason"]))


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def finish_phrase(f: Finish, tokens: int) -> str:
    """Why an answer did not finish, in a few words ("cut at 256 tokens, looping"); "" when it is complete.
    `tokens`: the answer's length (the cap, when the cap cut it)."""
    parts = []
    if f.stop_reason == "max_new_tokens":
        parts.append(f"cut at {tokens} tokens")
    elif f.stop_reason == STOPPED:
        parts.append("stopped by Stop")
    elif f.stop_reason == "context":
        parts.append("ran out of context")
    if f.looping:
        parts.append("looping")
    return ", ".join(parts)


def finish_badges(f: Finish, tokens: int) -> list[str]:
    """The warnings shown under an unfinished answer (plain text; none for a complete or a stopped one: Stop's
    own note says that)."""
    out = []
    if f.stop_reason == "max_new_tokens":
        out.append(f"⚠ cut at {tokens} tokens — did not finish")
    elif f.stop_reason == "context":
        out.append("⚠ ran out of context — did not finish")
    if f.looping:
        out.append(f"⚠ repeats itself ({_pct(f.repeat_share)} repeated word {LOOP_N}-grams)")
    return out


def finish_record(s: Summary | dict[str, Any]) -> dict[str, Any]:
    """What the conversation keeps about how an answer ended (JSON-able; the bubble shows its badges)."""
    d = _d(s)
    f = finish_of(d)
    return {"label": f.label, "complete": f.complete, "repeat_share": f.repeat_share,
            "badges": finish_badges(f, int(d["answer_tokens"]))}


def _seconds(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.1f} s"


@dataclass(frozen=True)
class Verdict:
    """A race's outcome in words: which sides finished, time to a complete answer, and a tokens/s ratio only
    when every compared answer finished."""

    headline: str  # plain text
    comparable: bool  # every run of both sides complete: tokens/s may be compared
    finished: dict[str, list[str]]  # mode -> finish label of each run
    time_to_complete: dict[str, float | None]  # mode -> median engine seconds of its complete runs (None: none)
    speedup: float | None  # median diffusion/AR tokens/s over the pairs; None unless comparable
    speedup_range: tuple[float, float] | None


def race_verdict(diffs: list[Summary | dict[str, Any]], ars: list[Summary | dict[str, Any]]) -> Verdict | None:
    """The headline of a race over its first min(len) interleaved pairs (None before a pair exists)."""
    n = min(len(diffs), len(ars))
    if not n:
        return None
    runs = {"diffusion": [_d(x) for x in diffs[:n]], "ar": [_d(x) for x in ars[:n]]}
    fins = {m: [finish_of(x) for x in rs] for m, rs in runs.items()}
    times: dict[str, float | None] = {}
    said = []
    for m, rs in runs.items():
        done = [float(x["seconds"]) for x, f in zip(rs, fins[m]) if f.complete]
        times[m] = statistics.median(done) if done else None
        bad = [(x, f) for x, f in zip(rs, fins[m]) if not f.complete]
        if not bad:
            said.append(f"{SIDES[m]} finished in {_seconds(times[m])}")
            continue
        x, f = bad[0]
        runs_note = "" if len(bad) == n else f" in {len(bad)} of {n} runs"
        said.append(f"{SIDES[m]} did not finish{runs_note} ({finish_phrase(f, int(x['answer_tokens']))})")
    comparable = all(f.complete for fs in fins.values() for f in fs)
    speedup = rng = None
    if comparable:
        ratios = [float(d["tokens_per_second"]) / max(float(a["tokens_per_second"]), 1e-9)
                  for d, a in zip(runs["diffusion"], runs["ar"])]
        speedup, rng = statistics.median(ratios), (min(ratios), max(ratios))
        td, ta = times["diffusion"], times["ar"]
        faster = "dLLM" if td < ta else "AR"
        headline = (f"Both finished. Time to a complete answer: dLLM {_seconds(td)}, AR {_seconds(ta)} "
                    f"({faster} {max(td, ta) / max(min(td, ta), 1e-9):.2f}× faster).")
    else:
        headline = "; ".join(said) + ". No speed comparison: tokens/s is compared only between answers that both " \
                                     "finished (stopped by the model, not looping)."
    return Verdict(headline, comparable, {m: [f.label for f in fs] for m, fs in fins.items()}, times, speedup, rng)


def sweep_finish(summaries: list[Summary | dict[str, Any]]) -> str:
    """One sweep point's finish: the label when every run agrees, else e.g. "capped 1/2"."""
    labels = [finish_of(s).label for s in summaries]
    bad = [x for x in labels if x != "complete"]
    if not bad:
        return "complete"
    if len(bad) == len(labels) and len(set(bad)) == 1:
        return bad[0]
    return f"{bad[0]} {len(bad)}/{len(labels)}"
