"""What the studio does, without Gradio: build prompts, decode, race, sweep. The UI and the API share it."""
from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine import ConfigError, DecodeConfig, Engine, Event, Result

from .settings import BLOCK_SIZES, check_repeats, fit_sub_block, to_config
from .stream import decode_stream, set_engine
from .verdict import race_verdict, sweep_finish

MAX_MESSAGE_CHARS = 20_000
MAX_SYSTEM_CHARS = MAX_MESSAGE_CHARS
MAX_HISTORY = 200
MAX_HISTORY_CHARS = 10 * MAX_MESSAGE_CHARS
MAX_SWEEP_RUNS = 24


@dataclass
class Prepared:
    """One decode, ready to run: token ids, validated config, and the conversation it answers."""

    ids: list[int]
    cfg: DecodeConfig
    messages: list[dict[str, str]]  # system + history + the new user message (what the template saw)
    user: str


def check_text(field: str, text: str, limit: int) -> str:
    """Text the tokenizer can take: bounded, and valid Unicode (a browser or client can send lone surrogates)."""
    if len(text) > limit:
        raise ConfigError(field, f"is longer than {limit} characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(field, f"is not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


def _content(c: Any) -> str:
    """A message's text: plain strings, or Gradio's list-of-parts form."""
    if isinstance(c, str):
        return c
    if isinstance(c, dict) and isinstance(c.get("text"), str):
        return c["text"]
    if isinstance(c, list):
        return "".join(_content(x) for x in c if isinstance(x, (str, dict)))
    raise ConfigError("history", "message content must be text")


def normalise_history(history: Any) -> list[dict[str, str]]:
    """[{role, content}] with roles user/assistant only (the system prompt is a setting)."""
    if history is None:
        return []
    if not isinstance(history, list) or len(history) > MAX_HISTORY:
        raise ConfigError("history", f"must be a list of at most {MAX_HISTORY} {{role, content}} messages")
    out, room = [], MAX_HISTORY_CHARS
    for m in history:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ConfigError("history", "each message must be an object with role 'user' or 'assistant' and content")
        content = _content(m.get("content", ""))
        room -= len(content)
        if room < 0:
            raise ConfigError("history", f"has more than {MAX_HISTORY_CHARS} characters in all")
        out.append({"role": m["role"], "content": check_text("history", content, MAX_HISTORY_CHARS)})
    return out


def summary_dict(res: Result) -> dict[str, Any]:
    d = asdict(res.summary)
    d.pop("token_ids")
    return d


class Studio:
    """The engine plus the studio's operations on it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        set_engine(engine)

    @property
    def default_block_size(self) -> int:
        bs = self.engine.lm.cfg.bd_size
        return bs if bs in BLOCK_SIZES else 32

    def prepare(self, message: Any, history: Any, settings: dict[str, Any] | None, **overrides: Any) -> Prepared:
        """Validate everything before any decoding starts; ConfigError names the bad field."""
        if not isinstance(message, str):
            raise ConfigError("message", "must be text")
        if not message.strip():
            raise ConfigError("message", "type a message first")
        check_text("message", message, MAX_MESSAGE_CHARS)
        cfg, system = to_config(self.engine, settings, **overrides)
        check_text("system_prompt", system, MAX_SYSTEM_CHARS)
        msgs = ([{"role": "system", "content": system}] if system.strip() else []) + normalise_history(history)
        msgs.append({"role": "user", "content": message})
        ids = self.engine.encode(self.engine.chat_prompt(msgs))
        room = self.engine.max_context - len(ids)
        if room < 1:
            raise ConfigError("message", f"the conversation has {len(ids)} tokens; the model's context is "
                                         f"{self.engine.max_context}. Clear the chat and try again.")
        if cfg.max_new_tokens > room:  # the engine would clip it too; clip here so the live view's grid agrees
            cfg = replace(cfg, max_new_tokens=room)
        return Prepared(ids, cfg, msgs, message)

    def header(self, prep: Prepared) -> dict[str, Any]:
        """What the live view needs before the first event (the same fields the trace header has)."""
        return self.engine.trace_header(prep.ids, prep.cfg, prep.user)

    def stream(self, prep: Prepared, key: str | None = None) -> Iterator[tuple[list[Event], Result | None]]:
        return decode_stream(prep.ids, prep.cfg, prep.user, key)

    def steps(self, prep: Prepared, key: str | None = None) -> Iterator[str | Result]:
        """The answer so far once per frame, then the Result. Closing it (a client that cancels or goes away)
        stops the engine after its current forward."""
        text = ""
        with closing(self.stream(prep, key)) as frames:
            for events, res in frames:
                if res is not None:
                    yield res
                    return
                text += "".join(e.text_delta for e in events)
                yield text

    # ------------------------------------------------------------------ API operations (they stream: see steps)
    def generate(self, message: str, history: list | None = None,
                 settings: dict | None = None) -> Iterator[tuple[str, str]]:
        """Answer one chat turn: (answer so far, "") once per frame, last (answer text, trace JSON)."""
        prep = self.prepare(message, history, settings)
        with closing(self.steps(prep)) as steps:
            for x in steps:
                yield (x, "") if isinstance(x, str) else (x.text, x.trace.dumps())

    def race_preps(self, message: str, settings: dict | None) -> tuple[Prepared, Prepared]:
        if not self.engine.can_diffuse:
            raise ConfigError("mode", "race needs block diffusion: this model has no |<MASK>| token (no Fast-dLLM v2 "
                                      "adapter loaded)")
        diff = self.prepare(message, None, settings, mode="diffusion")
        return diff, Prepared(diff.ids, replace(diff.cfg, mode="ar"), diff.messages, diff.user)

    def race(self, message: str, settings: dict | None = None, repeats: int = 1) -> Iterator[dict[str, Any]]:
        """The same prompt by block diffusion and by the AR baseline, `repeats` times, interleaved (diffusion, AR,
        diffusion, AR, ...) so slow drifts of a shared machine hit both alike; never side by side.

        Yields {running: mode, run: n, text: answer so far} once per frame, last the median runs' summaries,
        every run's summary, each run's finish (complete | looping | capped | ...), the headline, the median time
        to a complete answer per side, and the tokens/s speed-up (median of the pairs' ratios, and its range) only
        when every answer of both sides finished (else None: a loop is not a speed).
        """
        repeats = check_repeats(repeats)
        preps = self.race_preps(message, settings)
        runs: dict[str, list[Result]] = {"diffusion": [], "ar": []}
        for n in range(repeats):
            for prep in preps:
                with closing(self.steps(prep)) as steps:
                    for x in steps:
                        if isinstance(x, str):
                            yield {"running": prep.cfg.mode, "run": n + 1, "text": x}
                        else:
                            runs[prep.cfg.mode].append(x)
        diffs, ars = ([r.summary for r in runs[m]] for m in ("diffusion", "ar"))
        diff, ar = (sorted(xs, key=lambda r: r.tokens_per_second)[(len(xs) - 1) // 2] for xs in (diffs, ars))
        v = race_verdict(diffs, ars)
        assert v is not None
        yield {"order": "interleaved: diffusion, AR, diffusion, AR, ... (one run at a time)", "repeats": repeats,
               "diffusion": summary_dict(Result(diff, None)), "ar": summary_dict(Result(ar, None)),
               "runs": {m: [summary_dict(r) for r in runs[m]] for m in runs},
               "finish": v.finished, "comparable": v.comparable, "headline": v.headline,
               "time_to_complete": v.time_to_complete, "speedup": v.speedup,
               "speedup_range": list(v.speedup_range) if v.speedup_range else None,
               "nfe_ratio": ar.nfe / max(diff.nfe, 1)}

    def sweep_plan(self, message: str, thresholds: Any, block_sizes: Any, settings: dict | None) -> list[Prepared]:
        if not self.engine.can_diffuse:
            raise ConfigError("mode", "a threshold sweep needs block diffusion: no Fast-dLLM v2 adapter is loaded")
        if not isinstance(thresholds, list) or not thresholds:
            raise ConfigError("thresholds", "pick at least one threshold")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in thresholds):
            raise ConfigError("thresholds", "must be numbers in (0, 1]")
        if not isinstance(block_sizes, list) or not block_sizes:
            raise ConfigError("block_sizes", "pick at least one block size")
        bad = [b for b in block_sizes if b not in BLOCK_SIZES]
        if bad:
            raise ConfigError("block_sizes", f"allowed: {', '.join(map(str, BLOCK_SIZES))} (got {bad[0]!r})")
        if len(thresholds) * len(block_sizes) > MAX_SWEEP_RUNS:
            raise ConfigError("thresholds", f"at most {MAX_SWEEP_RUNS} runs per sweep (thresholds × block sizes)")
        base = dict(settings or {})
        plan = []
        for bs in sorted(set(int(b) for b in block_sizes)):
            for th in sorted(set(thresholds)):
                plan.append(self.prepare(message, None, base, mode="diffusion", strategy="threshold", threshold=th,
                                         block_size=bs, sub_block_size=fit_sub_block(bs, base.get("sub_block_size"))))
        return plan

    @staticmethod
    def sweep_row(prep: Prepared, results: list[Result]) -> dict[str, Any]:
        """One sweep point: the median of its repeated runs, and the range of tokens/s."""
        ss = [r.summary for r in results]
        med = lambda k: statistics.median(getattr(x, k) for x in ss)  # noqa: E731
        tps = [x.tokens_per_second for x in ss]
        return {"threshold": prep.cfg.threshold, "block_size": prep.cfg.block_size,
                "sub_block_size": prep.cfg.sub_block_size, "runs": len(ss),
                "tokens_per_second": round(med("tokens_per_second"), 3), "tokens_per_second_min": round(min(tps), 3),
                "tokens_per_second_max": round(max(tps), 3), "tokens_per_forward": round(med("tokens_per_forward"), 3),
                "nfe": round(med("nfe"), 1), "answer_tokens": round(med("answer_tokens"), 1),
                "seconds": round(med("seconds"), 4), "stop_reason": ss[-1].stop_reason, "finish": sweep_finish(ss)}

    def sweep(self, message: str, thresholds: list | None = None, block_sizes: list | None = None,
              settings: dict | None = None, repeats: int = 1) -> Iterator[list[dict[str, Any]]]:
        """One prompt across thresholds × block sizes, each point run `repeats` times (median and range).

        Yields the rows so far once per frame, last every point's row.
        """
        repeats = check_repeats(repeats)
        rows: list[dict[str, Any]] = []
        for p in self.sweep_plan(message, thresholds, block_sizes, settings):
            results: list[Result] = []
            for _ in range(repeats):
                with closing(self.steps(p)) as steps:
                    for x in steps:
                        if isinstance(x, str):
                            yield list(rows)
                        else:
                            results.append(x)
            rows.append(self.sweep_row(p, results))
        yield rows
