"""Per-forward decoding events and the JSON trace that replays a run without the model."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

TRACE_VERSION = 1
EVENT_KINDS = ("prefill", "step", "commit", "done")


@dataclass(slots=True)
class Token:
    """One answer position: pos is answer-relative (0 = first answer token)."""

    pos: int
    id: int
    text: str
    conf: float
    # top_logprobs > 0 (committed tokens only): the k most likely tokens of the distribution this one was committed
    # from, (id, text, natural-log probability), most likely first; not written to traces
    top: list[tuple[int, str, float]] | None = None

    def logprob(self) -> float:
        """ln(the probability it was committed with)."""
        return math.log(max(self.conf, 1e-45))

    def alternatives(self) -> list[tuple[int, str, float]]:
        """`top` with this token's own entry carrying logprob() exactly (top holds it rounded through float32)."""
        own = self.logprob()
        return [(i, s, own if i == self.id else v) for i, s, v in (self.top or [])]


@dataclass(slots=True)
class Event:
    """What one forward did to one sequence (row), or the final 'done'."""

    kind: str  # prefill | step | commit | done
    row: int
    nfe: int  # forwards so far for this row, this one included
    block: int  # absolute block index of the active block; for 'commit', the block that starts next
    sub_block: int  # index of the active sub-block inside the block (-1 for AR / commit)
    committed: list[Token]  # positions committed by this forward
    masked: list[Token]  # still-masked positions of the active window: current best token + confidence
    text_delta: str  # new whole text of the contiguous committed answer prefix
    t: float  # engine seconds since the decode started (tokenisation and UI excluded)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["committed"] = [[x.pos, x.id, x.text, round(x.conf, 4)] for x in self.committed]
        d["masked"] = [[x.pos, x.id, x.text, round(x.conf, 4)] for x in self.masked]
        d["t"] = round(self.t, 6)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Event":
        toks = lambda xs: [Token(int(p), int(i), str(s), float(c)) for p, i, s, c in xs]  # noqa: E731
        return cls(kind=str(d["kind"]), row=int(d["row"]), nfe=int(d["nfe"]), block=int(d["block"]),
                   sub_block=int(d["sub_block"]), committed=toks(d["committed"]), masked=toks(d["masked"]),
                   text_delta=str(d["text_delta"]), t=float(d["t"]))


@dataclass(slots=True)
class Summary:
    answer_tokens: int  # up to and including the stop token, never pads
    nfe: int  # forwards, prefill and commit forwards included
    tokens_per_forward: float
    seconds: float  # engine time
    tokens_per_second: float
    ttft: float  # seconds to the first committed answer token
    stop_reason: str  # "stop_token" | "max_new_tokens" | "cancelled" | "context"
    text: str
    token_ids: list[int]
    cached_tokens: int = 0  # prompt positions whose K/V the prefix cache gave (engine/prefix_cache.py), not prefilled


@dataclass
class Trace:
    """header (model, config, prompt), events, summary: a run that replays without the model."""

    header: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    summary: Summary | None = None

    def to_json(self) -> dict[str, Any]:
        return {"version": TRACE_VERSION, "header": self.header, "events": [e.to_json() for e in self.events],
                "summary": asdict(self.summary) if self.summary else None}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Trace":
        if not isinstance(d, dict) or d.get("version") != TRACE_VERSION:
            raise ValueError(f"trace: expected an object with version {TRACE_VERSION}")
        if not isinstance(d.get("header"), dict) or not isinstance(d.get("events"), list):
            raise ValueError("trace: needs 'header' (object) and 'events' (list)")
        s = d.get("summary")
        return cls(header=d["header"], events=[Event.from_json(e) for e in d["events"]],
                   summary=Summary(**s) if s else None)

    @classmethod
    def loads(cls, text: str) -> "Trace":
        return cls.from_json(json.loads(text))


@dataclass
class Result:
    """One decoded prompt: its summary, and its trace when recorded (what every front door hands back)."""

    summary: Summary
    trace: Trace | None

    @property
    def text(self) -> str:
        return self.summary.text


Listener = Callable[[Event], None]
