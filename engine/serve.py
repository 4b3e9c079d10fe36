"""The OpenAI-compatible HTTP layer over the scheduler: /v1/models, /v1/chat/completions, /v1/completions.

Decoding knobs ride as extra body fields (mode, threshold, strategy, factor, block_size, sub_block_size, cache)
and are validated by DecodeConfig, so a bad one gets HTTP 400 naming it, as in the CLI and the studio. The
repetition knobs: OpenAI's frequency_penalty and presence_penalty, and vLLM's extra repetition_penalty and
no_repeat_ngram_size (engine/penalties.py has their meanings); null means the default, off. `usage`
adds NFE, tokens per forward and engine seconds; `denoise_events: true` streams the trace's per-forward events
(engine/events.py) with the text, so any client can draw the live denoising view.

Around the routes: GET /health, GET /metrics (Prometheus text), an optional API key (Bearer), optional CORS, one
JSON log line per request on the "engine.serve" logger, and every error in OpenAI's shape
{"error": {"message", "type", "param", "code"}}, unknown routes and wrong methods included. `n` > 1 runs n rows (seeds
seed + i); `logprobs` serves each answer token's committed confidence, logged; `echo` (completions) returns the
prompt scored by engine/likelihood.py, which with /tokenizer_info and /detokenize lets lm-eval's own OpenAI client
score log-likelihood tasks against the server (docs/serving.md).
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ConfigError, DecodeConfig
from .engine import Engine, Result
from .events import Event, Summary
from .loading import MASK_TOKEN
from .scheduler import MAX_BATCH, Scheduler, SchedulerBusy, Ticket

KNOBS = ("mode", "block_size", "sub_block_size", "threshold", "strategy", "factor", "cache", "stop_guard")
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "no_repeat_ngram_size")
MAX_N = 16  # choices per request (n): each is a scheduler row
MAX_TOP_LOGPROBS = 5  # OpenAI's limit for completions' logprobs
MAX_ECHO_DIFFUSION_TOKENS = 512  # echo + logprobs under diffusion: one forward per prompt token (engine/likelihood.py)
MAX_PROMPT_CHARS = 200_000  # tokenising is cheap, not free: bound it before the context check
MAX_BODY_BYTES = 8 << 20  # a request body larger than this gets 413 before it is parsed
MAX_JSON_DEPTH = 32  # the deepest real request nests 4 levels (messages -> message -> content parts -> part)
MAX_MESSAGE_CHARS = 1000  # error messages quote the bad value, cut to this
MAX_STOPS = 4
FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_busy"}
log = logging.getLogger("engine.serve")


def _show(v: Any, limit: int = 60) -> str:
    """repr(v) for an error message, cut short (a client can send a megabyte or a deeply nested value)."""
    try:
        r = repr(v)
    except (RecursionError, ValueError):  # ValueError: an int with more digits than str() allows
        r = f"<{type(v).__name__}>"
    return r if len(r) <= limit else r[:limit] + "..."


class ApiError(Exception):
    """An OpenAI-style error: status, message, and the request parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        kind = ERROR_TYPES.get(self.status, "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


@dataclass
class ApiRequest:
    """One parsed completion request."""

    chat: bool
    prompt: str  # the text the model continues (chat template applied for chat)
    user_text: str | None  # what the trace header shows as the prompt
    ids: list[int] | None  # /v1/completions may send token ids instead of text (OpenAI allows both)
    cfg: DecodeConfig
    stream: bool = False
    include_usage: bool = False
    denoise_events: bool = False
    stops: list[str] = field(default_factory=list)
    max_tokens_name: str = "max_tokens"  # the name the client used, for error messages
    max_tokens_given: bool = False  # False: the engine default, clipped to the context room left
    n: int = 1  # independent choices, each its own row (seeds seed + i)
    logprobs: bool = False  # each answer token's log-probability (its committed confidence, logged)
    echo: bool = False  # completions: the prompt comes back before the answer, with its tokens' log-probabilities
    top: int = 0  # with echo: the most likely alternatives per prompt token (lm-eval asks 1 to test greediness)


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{name}: must be true or false (got {v!r})", name)
    return v


def _text(v: Any, name: str) -> str:
    """Message content: a string, or OpenAI's list of {type: text, text} parts; valid Unicode only."""
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in v):
        v = "".join(p["text"] for p in v)
    if not isinstance(v, str):
        raise ApiError(400, f"{name}: must be a string or a list of text parts", name)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can carry lone surrogates; the tokenizer cannot
        raise ApiError(400, f"{name}: not valid Unicode (a lone surrogate at character {e.start})", name) from None
    return v


def _messages(v: Any) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise ApiError(400, "messages: must be a non-empty list of {role, content} objects", "messages")
    out = []
    for m in v:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, "messages: each message needs role system, user or assistant, and content", "messages")
        out.append({"role": m["role"], "content": _text(m.get("content"), "messages")})
    return out


def _stops(v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else (v or [])
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return stops


def _response_format(v: Any) -> None:
    """OpenAI's response_format: {"type": "text"} (the default) is what every answer is; JSON modes are refused."""
    if v is None or v == {"type": "text"}:
        return
    kind = v.get("type") if isinstance(v, dict) else None
    if kind in ("json_object", "json_schema"):
        raise ApiError(400, f"response_format: {kind} is not supported (no constrained decoding); "
                            'only {"type": "text"}', "response_format")
    raise ApiError(400, f'response_format: must be {{"type": "text"}} (got {_show(v)})', "response_format")


def parse(body: Any, chat: bool, engine: Engine, model_id: str) -> ApiRequest:
    """Validate a request body; ApiError names the first bad parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") != model_id:
        raise ApiError(404, f"model: {_show(body.get('model'))} is not served here; this server serves {model_id!r}",
                       "model", "model_not_found")
    n = 1 if body.get("n") is None else body["n"]
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n: must be an integer in [1, {MAX_N}] (got {_show(n)})", "n")
    echo = False if chat else _bool(body, "echo")
    logprobs, top = _logprobs(body, chat, echo)
    if echo and (n > 1 or _bool(body, "stream")):
        raise ApiError(400, "echo: only with n = 1 and without stream", "echo")
    known = set(KNOBS) | set(PENALTIES) | {"n", "logprobs", "top_logprobs", *(() if chat else ("echo",)),
        "model", "messages", "prompt", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "seed", "stop", "denoise_events", "response_format"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"{_show(unknown[0])[1:-1]}: unknown parameter; decoding knobs: "
                            f"{', '.join(KNOBS + PENALTIES)}", unknown[0])
    _response_format(body.get("response_format"))
    where = "messages" if chat else "prompt"
    ids, prompt, user_text = None, "", None
    if chat:
        msgs = _messages(body.get("messages"))
        prompt, user_text = engine.chat_prompt(msgs), msgs[-1]["content"]
    elif isinstance(body.get("prompt"), list) and body["prompt"] and all(type(t) is int for t in body["prompt"]):
        ids = _token_ids(body["prompt"], engine)
    elif (isinstance(body.get("prompt"), list) and len(body["prompt"]) == 1 and isinstance(body["prompt"][0], list)
          and body["prompt"][0] and all(type(t) is int for t in body["prompt"][0])):
        ids = _token_ids(body["prompt"][0], engine)  # a batch of one token list (lm-eval's local-completions sends it)
    else:
        prompt = user_text = _text(body.get("prompt"), "prompt")
    if ids is None and not prompt.strip():
        raise ApiError(400, f"{where}: the prompt must not be empty", where)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"{where}: longer than {MAX_PROMPT_CHARS} characters", where)
    if engine.can_diffuse and MASK_TOKEN in prompt:
        raise ApiError(400, f"{where}: contains the mask token {MASK_TOKEN}, which only the decoder may place", where)
    # null means "not given" (OpenAI's SDKs send it): max_completion_tokens wins when both are set
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    knobs = {"mode": "diffusion" if engine.can_diffuse else "ar"} | {k: body[k] for k in KNOBS if k in body}
    for k in ("temperature", "top_p", "seed") + PENALTIES:
        if body.get(k) is not None:
            knobs[k] = body[k]
    if body.get(name) is not None:
        knobs["max_new_tokens"] = body[name]
    try:
        cfg = engine.decode_config(**knobs)
        if cfg.mode == "diffusion" and not engine.can_diffuse:
            raise ConfigError("mode", "this model has no |<MASK>| token and cannot decode by block diffusion; use 'ar'")
    except ConfigError as e:
        if e.field == "sub_block_size" and "sub_block_size" not in body:  # the client sent block_size alone
            sub = DecodeConfig().sub_block_size
            raise ApiError(400, f"block_size: must be a multiple of sub_block_size={sub} (its default; send "
                                f"sub_block_size too to change it) (got {_show(body.get('block_size'))})",
                           "block_size") from None
        param = name if e.field == "max_new_tokens" else e.field
        raise ApiError(400, str(e).replace("max_new_tokens", param, 1), param) from None
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options: must be an object", "stream_options")
    events = _bool(body, "denoise_events")
    if events and n > 1:
        raise ApiError(400, "denoise_events: only with n = 1", "denoise_events")
    return ApiRequest(chat, prompt, user_text, ids, cfg, _bool(body, "stream"), bool(opts.get("include_usage")),
                      events, _stops(body.get("stop")), name, body.get(name) is not None, n, logprobs, echo, top)


def _logprobs(body: dict[str, Any], chat: bool, echo: bool = False) -> tuple[bool, int]:
    """(logprobs on, top alternatives). Chat: logprobs true/false and top_logprobs; completions: logprobs as a count.
    The decoder keeps each answer token's own probability, not the alternatives, so answers get 0 alternatives; with
    echo the prompt's tokens are scored afresh (engine/likelihood.py) and get up to MAX_TOP_LOGPROBS."""
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or top != 0):
        raise ApiError(400, f"top_logprobs: only 0; the engine keeps each answer token's own probability, not the "
                            f"alternatives (got {_show(top)})", "top_logprobs")
    v = body.get("logprobs")
    if v is None:
        return False, 0
    if chat:
        if not isinstance(v, bool):
            raise ApiError(400, f"logprobs: must be true or false (got {_show(v)})", "logprobs")
        return v, 0
    if echo:
        if type(v) is not int or not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs: with echo, an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives for the "
                                f"prompt's tokens) (got {_show(v)})", "logprobs")
        return True, v
    if type(v) is not int or v != 0:
        raise ApiError(400, f"logprobs: only 0 (each answer token's own log-probability; alternatives only for the "
                            f"prompt's tokens, with echo) (got {_show(v)})", "logprobs")
    return True, 0


def _token_ids(ids: list[int], engine: Engine) -> list[int]:
    vocab = engine.lm.cfg.vocab_size
    if not all(0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
    mask = engine.lm.mask_token_id
    if mask is not None and mask in ids:
        raise ApiError(400, f"prompt: contains the mask token id {mask} ({MASK_TOKEN}), which only the decoder may "
                            f"place (at position {ids.index(mask)})", "prompt")
    return ids


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

    def __init__(self, sched: Scheduler, ids: list[int], cfgs: list[DecodeConfig], prompt_text: str | None,
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


def _logprobs_json(chat: bool, toks: list[tuple[Any, int]]) -> dict[str, Any]:
    """OpenAI's logprobs object; logprob = ln(the confidence the token was committed with)."""
    lp = [math.log(max(t.conf, 1e-45)) for t, _ in toks]
    if chat:
        return {"content": [{"token": t.text, "logprob": v, "bytes": list(t.text.encode("utf-8")), "top_logprobs": []}
                            for (t, _), v in zip(toks, lp)]}
    return {"tokens": [t.text for t, _ in toks], "token_logprobs": lp, "top_logprobs": None,
            "text_offset": [o for _, o in toks]}


def _echo_logprobs(ptext: str, ptoks: list[str], scored: list[Any] | None, answer: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's completions logprobs with echo: the prompt's tokens first (the first has no context: null), then
    the answer's (their own probability only; alternatives are not kept)."""
    offsets, at = [], 0
    for t in ptoks:
        offsets.append(at)
        at += len(t)
    plp = [None] + [lp for _, lp in (scored or [])[:len(ptoks) - 1]]
    ptop = [None] + [dict(top) for top, _ in (scored or [])[:len(ptoks) - 1]]
    return {"tokens": ptoks + answer["tokens"], "token_logprobs": plp + answer["token_logprobs"],
            "top_logprobs": ptop + [{t: v} for t, v in zip(answer["tokens"], answer["token_logprobs"])],
            "text_offset": offsets + [len(ptext) + o for o in answer["text_offset"]]}


def usage(prompt_tokens: int, summaries: list[Summary]) -> dict[str, Any]:
    """OpenAI's usage, plus what a dLLM run is measured by (completion tokens count through the stop token); with
    n > 1 choices: tokens and NFE summed, seconds the longest row's, TTFT the first row's."""
    tokens, nfe = sum(s.answer_tokens for s in summaries), sum(s.nfe for s in summaries)
    tpf = summaries[0].tokens_per_forward if len(summaries) == 1 else tokens / max(nfe, 1)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens, "nfe": nfe,
            "tokens_per_forward": round(tpf, 4), "engine_seconds": round(max(s.seconds for s in summaries), 6),
            "engine_ttft": round(min(s.ttft for s in summaries), 6)}


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count), written by hand: no client library needed."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """What GET /metrics reports; updated by the request middleware on the event loop (no locks needed)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generated_tokens = 0
        self.ttft = Histogram((0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.latency = Histogram((0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def record(self, route: str, status: int, info: dict[str, Any], seconds: float) -> None:
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
        if "completion_tokens" not in info:  # not a completion that ran
            return
        self.prompt_tokens += info.get("prompt_tokens") or 0
        self.generated_tokens += info["completion_tokens"] or 0
        self.latency.observe(seconds)
        if info.get("ttft") is not None:
            self.ttft.observe(info["ttft"])

    def text(self, scheduler: Scheduler) -> str:
        p = "fastdllm_"
        out = [f"# HELP {p}requests_total HTTP requests answered, by route and status.", f"# TYPE {p}requests_total counter"]
        out += [f'{p}requests_total{{route="{r}",status="{c}"}} {n}' for (r, c), n in sorted(self.requests.items())]
        gauges = [("queue_length", "Requests waiting for a batch row.", len(scheduler.waiting)),
                  ("running_rows", "Rows in running batches after the scheduler's last pass.", scheduler.running)]
        for name, about, v in gauges:
            out += [f"# HELP {p}{name} {about}", f"# TYPE {p}{name} gauge", f"{p}{name} {v}"]
        counters = [("prompt_tokens_total", "Prompt tokens of completed requests.", self.prompt_tokens),
                    ("generated_tokens_total", "Answer tokens generated (through the stop token); rate() = tokens/s.",
                     self.generated_tokens)]
        for name, about, v in counters:
            out += [f"# HELP {p}{name} {about}", f"# TYPE {p}{name} counter", f"{p}{name} {v}"]
        for name, about, h in [("time_to_first_token_seconds", "Request arrival to its first committed answer token.",
                                self.ttft),
                               ("request_latency_seconds", "Request arrival to its last byte (completions).",
                                self.latency)]:
            out += [f"# HELP {p}{name} {about}", f"# TYPE {p}{name} histogram", *h.lines(p + name)]
        return "\n".join(out) + "\n"


class Surface:
    """ASGI middleware around every route: request id, API key, one JSON log line and the metrics per request."""

    def __init__(self, app: Any, api_key: str | None, metrics: Metrics, routes: set[str]):
        self.app, self.api_key, self.metrics, self.routes = app, api_key, metrics, routes

    def _authorized(self, scope: dict) -> bool:
        if not self.api_key or scope["path"] == "/health" or scope["method"] == "OPTIONS":
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        want = b"Bearer " + self.api_key.encode()
        return hmac.compare_digest(auth, want)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, t0 = uuid.uuid4().hex[:24], time.perf_counter()
        info: dict[str, Any] = {}
        scope.setdefault("state", {}).update(request_id=rid, t0=t0, log=info)
        status = 500

        async def send_(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg["headers"] = [*msg.get("headers", []), (b"x-request-id", rid.encode())]
            await send(msg)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_)
            else:
                await ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", None,
                               "invalid_api_key").response({"WWW-Authenticate": "Bearer"})(scope, receive, send_)
        finally:
            seconds = time.perf_counter() - t0
            route = scope["path"] if scope["path"] in self.routes else "other"  # bounded label set
            self.metrics.record(route, status, info, seconds)
            log.info(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "request_id": rid,
                                 "method": scope["method"], "route": route, "status": status,
                                 "prompt_tokens": info.get("prompt_tokens"),
                                 "completion_tokens": info.get("completion_tokens"), "seconds": round(seconds, 4),
                                 "ttft": None if info.get("ttft") is None else round(info["ttft"], 4),
                                 "finish_reason": info.get("finish_reason")}))


def _depth(obj: Any) -> int:
    """How deeply lists and objects nest (iteratively: no recursion on what a client sent)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_JSON_DEPTH:
            break
        stack += [(x, d + 1) for x in (o.values() if isinstance(o, dict) else o) if isinstance(x, (dict, list))]
    return deepest if isinstance(obj, (dict, list)) else 0


def create_app(engine: Engine, scheduler: Scheduler, model_id: str | None = None, *, api_key: str | None = None,
               allowed_origins: list[str] | tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app; the caller owns the scheduler (and closes it). api_key: every route but /health needs
    `Authorization: Bearer <api_key>`; allowed_origins: browsers on these origins may call it (CORS; none by default)."""
    model_id = model_id or engine.lm.name
    created = int(time.time())
    app = FastAPI(title="Fast-dLLM v2 (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return ApiError(e.status_code, msg.get(e.status_code, str(e.detail))).response(getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return ApiError(400, f"invalid request: {e.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def _server_error(_: Request, e: Exception) -> JSONResponse:  # a bug: the shape stays OpenAI's, the
        return ApiError(500, f"internal error: {type(e).__name__}").response()  # traceback goes to the log

    lm = engine.lm
    about = {"banner": lm.banner(), "can_diffuse": engine.can_diffuse, "max_model_len": engine.max_context,
             "bd_size": lm.cfg.bd_size, "source": lm.source.reason,
             "adapter": Path(lm.source.adapter).name if lm.source.adapter else None,
             "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""),
             "mask_token_id": lm.mask_token_id, "stop_token_ids": list(lm.stop_token_ids)}  # what a remote studio
    # shows, lays its live view out by, and writes into trace headers

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the model is loaded and the scheduler's decoding thread runs; 503 otherwise."""
        worker = getattr(scheduler, "_worker", None)
        alive = worker is not None and worker.is_alive() and not getattr(scheduler, "_closed", False)
        if not alive:
            raise ApiError(503, "the scheduler's decoding thread is not running")
        return JSONResponse({"status": "ok", "model": model_id, "running_rows": scheduler.running,
                             "queue_length": len(scheduler.waiting)})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.text(scheduler), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "fast-dllm-v2", **about}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's /tokenize (prompt, or messages with the chat template), plus the templated text."""
        body = await _json(request)
        if "messages" in body:
            text = engine.chat_prompt(_messages(body["messages"]))
        else:
            text = _text(body.get("prompt"), "prompt")
        if len(text) > MAX_PROMPT_CHARS:
            raise ApiError(400, f"prompt: longer than {MAX_PROMPT_CHARS} characters", "prompt")
        ids = engine.encode(text)
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "prompt": text}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: token ids -> text (lm-eval's remote tokenizer calls it)."""
        body = await _json(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids) or len(ids) > MAX_PROMPT_CHARS:
            raise ApiError(400, "tokens: must be a list of token ids", "tokens")
        vocab = engine.lm.cfg.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        return {"prompt": engine.lm.tokenizer.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's /tokenizer_info: what lm-eval's remote tokenizer reads (special tokens, chat template) before it
        scores against this server with /tokenize and /detokenize."""
        tok = engine.lm.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": engine.max_context}

    async def _json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, f"the request body nests too deeply (the limit is {MAX_JSON_DEPTH} levels)") from None
        except ValueError:  # JSONDecodeError, UnicodeDecodeError, an integer with over 4,300 digits
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if _depth(body) > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests too deeply (the limit is {MAX_JSON_DEPTH} levels)")
        return body

    async def complete(request: Request, chat: bool):
        req = parse(await _json(request), chat, engine, model_id)
        ids = req.ids or engine.encode(req.prompt)
        param = "messages" if chat else "prompt"
        mask = engine.lm.mask_token_id
        if mask is not None and req.ids is None and mask in ids:  # e.g. the mask text split by the template
            raise ApiError(400, f"{param}: contains the mask token {MASK_TOKEN}, which only the decoder may place", param)
        if len(ids) >= engine.max_context:
            raise ApiError(400, f"{param}: the prompt has {len(ids)} tokens; the model's context is "
                                f"{engine.max_context} tokens (prompt and answer together)", param)
        if req.max_tokens_given and len(ids) + req.cfg.max_new_tokens > engine.max_context:
            n = req.max_tokens_name
            raise ApiError(400, f"{n}: the prompt has {len(ids)} tokens and {n} is {req.cfg.max_new_tokens}: "
                                f"{len(ids) + req.cfg.max_new_tokens} tokens, over the model's context of "
                                f"{engine.max_context}; ask for at most {engine.max_context - len(ids)}", n)
        info = request.scope["state"]["log"]
        info["prompt_tokens"] = len(ids)
        seed = req.cfg.seed
        cfgs = [req.cfg if seed is None else replace(req.cfg, seed=(seed + i) % 2**63) for i in range(req.n)]
        try:
            live = LiveGroup(scheduler, ids, cfgs, req.user_text, record=req.denoise_events)
        except ConfigError as e:
            raise ApiError(400, str(e), param) from None
        except SchedulerBusy as e:
            raise ApiError(503, str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + request.scope["state"]["request_id"]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_id}
        if req.stream:
            return StreamingResponse(_stream(request, live, req, head, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        echo = None
        if req.echo and req.logprobs and req.cfg.mode == "diffusion" and len(ids) > MAX_ECHO_DIFFUSION_TOKENS:
            raise ApiError(400, f"echo: scoring a prompt under block diffusion costs one forward per token; at most "
                                f"{MAX_ECHO_DIFFUSION_TOKENS} prompt tokens (got {len(ids)}; mode 'ar' scores any "
                                f"length in one forward)", "echo")
        if req.echo:  # scored before decoding starts, off the event loop
            ptoks = [engine.lm.tokenizer.decode([t]) for t in ids]
            scored = None
            if req.logprobs:
                from .likelihood import token_logprobs

                def score() -> list[Any]:
                    with engine.lock:  # the model's forwards take turns with the scheduler's (engine.py)
                        return token_logprobs(engine.lm, ids, 1, req.cfg.mode, req.cfg.block_size, req.top)

                scored = await run_in_threadpool(score)
                scored = [([(engine.lm.tokenizer.decode([i]), v) for i, v in t.top], t.logprob) for t in scored]
            echo = (req.prompt if req.ids is None else engine.lm.tokenizer.decode(ids), ptoks, scored)
        return await _whole(request, live, req, head, len(ids), echo)

    def _seen(request: Request, batch: list[Event]) -> None:
        """Time to first token: request arrival to the first event that commits an answer token."""
        state = request.scope["state"]
        if "ttft" not in state["log"] and any(e.committed for e in batch):
            state["log"]["ttft"] = time.perf_counter() - state["t0"]

    def _finished(request: Request, results: list[Result], reasons: list[str]) -> None:
        request.scope["state"]["log"].update(completion_tokens=sum(r.summary.answer_tokens for r in results),
                                             finish_reason=reasons[0] if len(set(reasons)) == 1 else reasons)

    def _reason(c: Choice, res: Result) -> str:
        return "stop" if c.stop.hit else FINISH.get(res.summary.stop_reason, "stop")

    async def _whole(request: Request, live: LiveGroup, req: ApiRequest, head: dict, n_prompt: int,
                     echo: tuple[str, list[str], list[Any] | None] | None = None) -> dict:
        choices = [Choice(i, req.stops) for i in range(req.n)]
        try:
            async for i, batch in live.batches():
                _seen(request, batch)
                choices[i].push(batch)
                if choices[i].stop.hit:
                    live.cancel(i)
                if await request.is_disconnected():
                    live.cancel()
            for c in choices:
                c.flush()
        finally:
            live.cancel()  # no-op once finished; frees the rows if this handler is torn down early
        try:
            results = live.results()
        except Exception as e:  # noqa: BLE001 - an engine fault: this request fails, the server keeps serving
            raise ApiError(500, f"decoding failed: {e}") from None
        reasons = [_reason(c, r) for c, r in zip(choices, results)]
        _finished(request, results, reasons)
        out_choices = []
        for c, reason in zip(choices, reasons):
            lp = _logprobs_json(req.chat, c.take()) if req.logprobs else None
            if echo is not None:  # the prompt before the answer; its tokens scored, the first one without a context
                ptext, ptoks, scored = echo
                c.text = ptext + c.text
                if lp is not None:
                    lp = _echo_logprobs(ptext, ptoks, scored, lp)
            out_choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": reason} if req.chat else
                               {"index": c.index, "text": c.text, "finish_reason": reason, "logprobs": lp})
        out = {**head, "choices": out_choices, "usage": usage(n_prompt, [r.summary for r in results])}
        if req.denoise_events and results[0].trace is not None:
            out["trace"] = results[0].trace.to_json()
        return out

    async def _stream(request: Request, live: LiveGroup, req: ApiRequest, head: dict,
                      n_prompt: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if req.chat else "text_completion"

        def chunk(c: Choice, text: str | None, reason: str | None = None, **extra: Any) -> str:
            lp = _logprobs_json(req.chat, c.take()) if req.logprobs else None
            if req.chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": c.index, "text": text or "", "finish_reason": reason, "logprobs": lp}
            return "data: " + json.dumps({**head, "object": obj, "choices": [choice], **extra},
                                         ensure_ascii=False) + "\n\n"

        choices = [Choice(i, req.stops) for i in range(req.n)]
        try:
            first: dict[str, Any] = {}
            if req.denoise_events and live.tickets[0].trace is not None:
                first["denoise_header"] = live.tickets[0].trace.header
            for c in choices:
                if req.chat:
                    yield "data: " + json.dumps({**head, "object": obj, **first, "choices": [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}) + "\n\n"
                elif first:
                    yield chunk(c, "", **first)
            async for i, batch in live.batches():
                _seen(request, batch)
                c = choices[i]
                text = c.push(batch)
                if c.stop.hit:
                    live.cancel(i)
                extra = {"denoise_events": [e.to_json() for e in batch]} if req.denoise_events else {}
                if text or extra:
                    yield chunk(c, text, **extra)
            results = live.results()
            reasons = [_reason(c, r) for c, r in zip(choices, results)]
            _finished(request, results, reasons)
            for c, res, reason in zip(choices, results, reasons):
                tail = c.flush()
                last = {"denoise_summary": asdict(res.summary)} if req.denoise_events else {}
                yield chunk(c, tail or None, reason, **last) if req.chat else chunk(c, tail, reason, **last)
            if req.include_usage:
                yield "data: " + json.dumps({**head, "object": obj, "choices": [],
                                             "usage": usage(n_prompt, [r.summary for r in results])}) + "\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI-compatible servers do
            request.scope["state"]["log"]["finish_reason"] = "error"
            yield "data: " + json.dumps({"error": {"message": f"decoding failed: {e}", "type": "server_error"}}) + "\n\n"
        finally:
            live.cancel()  # the client went away (or we are done): its rows leave before the next forward

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    app.add_middleware(Surface, api_key=api_key, metrics=metrics,
                       routes={r.path for r in app.routes if hasattr(r, "path")})
    if allowed_origins:  # outermost: preflights are answered, and 401s carry the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_batch: int = MAX_BATCH, *,
          api_key: str | None = None, allowed_origins: list[str] | tuple[str, ...] = ()) -> None:
    """Run the server until interrupted (`python -m engine serve`)."""
    import uvicorn

    if not log.handlers:  # the per-request JSON lines, on stderr beside uvicorn's own
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    sched = Scheduler(engine, max_batch=max_batch)
    try:
        uvicorn.run(create_app(engine, sched, api_key=api_key, allowed_origins=allowed_origins), host=host, port=port,
                    log_level="info", access_log=False)  # our JSON line replaces uvicorn's access line
    finally:
        sched.close()
