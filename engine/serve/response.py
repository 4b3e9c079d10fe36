"""Answers out: stop strings, a request's rows on the scheduler, choices, logprobs and usage in OpenAI's shape."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

from ..config import DecodeConfig
from ..driver import Driver
from ..events import Event, Result, Summary
from ..scheduler import Ticket


class StopMatcher:
    """Cuts the streamed text at the first stop string; holds back a tail that could start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.buf, self.hit = stops, "", False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, delta: str) -> str:
        """Text that is safe to send now."""
        if self.hit:
            return ""
        self.buf += delta
        cuts = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit = True
            out, self.buf = self.buf[:min(cuts)], ""
            return out
        keep = len(self.buf) - self.hold if self.hold else len(self.buf)
        out, self.buf = self.buf[:max(keep, 0)], self.buf[max(keep, 0):]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit else self.buf), ""
        return out


class LiveGroup:
    """A request's n scheduler tickets seen from asyncio: (choice index, events) as the forwards run, then Results."""

    def __init__(self, sched: Driver, ids: list[int], cfgs: list[DecodeConfig], prompt_text: str | None,
                 record: bool):
        loop = asyncio.get_running_loop()
        self.q: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()
        self.tickets: list[Ticket] = []
        try:
            for i, cfg in enumerate(cfgs):
                put = functools.partial(self._put, loop, i)  # called on the decoding thread
                self.tickets.append(sched.submit(ids, cfg, listener=put, prompt_text=prompt_text, record=record,
                                                 on_finish=lambda _, put=put: put(None)))
        except BaseException:
            self.cancel()
            raise

    def _put(self, loop: asyncio.AbstractEventLoop, i: int, x: Event | None) -> None:
        loop.call_soon_threadsafe(self.q.put_nowait, (i, x))

    async def batches(self) -> AsyncIterator[tuple[int, list[Event]]]:
        """Every event in order per choice, grouped by what arrived together; ends when every choice is done."""
        left = len(self.tickets)
        while left:
            items = [await self.q.get()]
            while not self.q.empty():
                items.append(self.q.get_nowait())
            by: dict[int, list[Event]] = {}
            for i, x in items:
                if x is None:
                    left -= 1
                else:
                    by.setdefault(i, []).append(x)
            for i, events in by.items():
                yield i, events

    def cancel(self, i: int | None = None) -> None:
        for t in self.tickets if i is None else [self.tickets[i]]:
            t.cancel()

    def results(self) -> list[Result]:
        return [t.wait(0) for t in self.tickets]


class Choice:
    """One choice's text (cut at stop strings) and its committed tokens, for logprobs in text order."""

    def __init__(self, index: int, stops: list[str]):
        self.index, self.stop, self.text = index, StopMatcher(stops), ""
        self.tokens: dict[int, Any] = {}  # answer position -> events.Token
        self.next_pos, self.offset = 0, 0  # logprobs handed out so far

    def push(self, batch: list[Event]) -> str:
        for e in batch:
            for t in e.committed:
                self.tokens[t.pos] = t
        d = self.stop.push("".join(e.text_delta for e in batch))
        self.text += d
        return d

    def flush(self) -> str:
        d = self.stop.flush()
        self.text += d
        return d

    def take(self) -> list[tuple[Any, int]]:
        """(token, text offset) of the answer tokens that start inside the text released so far, not yet taken."""
        out = []
        while self.next_pos in self.tokens and self.offset < len(self.text):
            t = self.tokens[self.next_pos]
            out.append((t, self.offset))
            self.offset += len(t.text)
            self.next_pos += 1
        return out


def _logprobs_json(chat: bool, toks: list[tuple[Any, int]], top: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object. logprob = ln(the probability the token was committed with, in the distribution it
    was committed from: after the repetition knobs, temperature and top-p; vLLM's `processed_logprobs`); top > 0: the
    top most likely tokens of that distribution (Token.top), where chat lists them and completions give a dict that
    holds the token itself too, as vLLM writes it. The token's own entry among them carries the same value."""
    lp = [t.logprob() for t, _ in toks]
    if chat:
        return {"content": [{"token": t.text, "logprob": v, "bytes": list(t.text.encode("utf-8")),
                             "top_logprobs": [{"token": s, "logprob": x, "bytes": list(s.encode("utf-8"))}
                                              for _, s, x in t.alternatives()]}
                            for (t, _), v in zip(toks, lp)]}
    tops = [{t.text: v, **{s: x for _, s, x in t.alternatives()}} for (t, _), v in zip(toks, lp)] if top else None
    return {"tokens": [t.text for t, _ in toks], "token_logprobs": lp, "top_logprobs": tops,
            "text_offset": [o for _, o in toks]}


def _echo_logprobs(ptext: str, ptoks: list[str], scored: list[Any] | None, answer: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's completions logprobs with echo: the prompt's tokens first (the first has no context: null), then
    the answer's; each top_logprobs dict holds the token itself and its alternatives (logprobs 0: itself only)."""
    offsets, at = [], 0
    for t in ptoks:
        offsets.append(at)
        at += len(t)
    plp = [None] + [lp for _, lp in (scored or [])[:len(ptoks) - 1]]
    ptop = [None] + [{t: lp, **dict(top)} for t, (top, lp) in zip(ptoks[1:], (scored or [])[:len(ptoks) - 1])]
    atop = answer["top_logprobs"] or [{t: v} for t, v in zip(answer["tokens"], answer["token_logprobs"])]
    return {"tokens": ptoks + answer["tokens"], "token_logprobs": plp + answer["token_logprobs"],
            "top_logprobs": ptop + atop,
            "text_offset": offsets + [len(ptext) + o for o in answer["text_offset"]]}


def usage(prompt_tokens: int, summaries: list[Summary]) -> dict[str, Any]:
    """OpenAI's usage, plus what a dLLM run is measured by (completion tokens count through the stop token); with
    n > 1 choices: tokens and NFE summed, seconds the longest row's, TTFT the first row's; cached_tokens (prompt
    positions the prefix cache gave, OpenAI's and vLLM's name) the most any choice's row got."""
    tokens, nfe = sum(s.answer_tokens for s in summaries), sum(s.nfe for s in summaries)
    tpf = summaries[0].tokens_per_forward if len(summaries) == 1 else tokens / max(nfe, 1)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
            "prompt_tokens_details": {"cached_tokens": max(s.cached_tokens for s in summaries)}, "nfe": nfe,
            "tokens_per_forward": round(tpf, 4), "engine_seconds": round(max(s.seconds for s in summaries), 6),
            "engine_ttft": round(min(s.ttft for s in summaries), 6)}


