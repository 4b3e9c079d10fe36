"""The OpenAI-compatible HTTP layer over the scheduler: /v1/models, /v1/chat/completions, /v1/completions.

Decoding knobs ride as extra body fields (mode, threshold, strategy, factor, block_size, sub_block_size, cache)
and are validated by DecodeConfig, so a bad one gets HTTP 400 naming it, as in the CLI and the studio. The
repetition knobs: OpenAI's frequency_penalty and presence_penalty, and vLLM's extra repetition_penalty and
no_repeat_ngram_size (engine/penalties.py has their meanings); null means the default, off. `usage`
adds NFE, tokens per forward and engine seconds; `denoise_events: true` streams the trace's per-forward events
(engine/events.py) with the text, so any client can draw the live denoising view.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .config import ConfigError, DecodeConfig
from .engine import Engine, Result
from .events import Event, Summary
from .scheduler import MAX_BATCH, Scheduler, SchedulerBusy, Ticket

KNOBS = ("mode", "block_size", "sub_block_size", "threshold", "strategy", "factor", "cache", "stop_guard")
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "no_repeat_ngram_size")
AT_DEFAULT = {"n": 1, "logprobs": False}  # accepted, not implemented
MAX_PROMPT_CHARS = 200_000  # tokenising is cheap, not free: bound it before the context check
MAX_STOPS = 4
FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop"}


class ApiError(Exception):
    """An OpenAI-style error: status, message, and the request parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 404: "not_found_error", 503: "server_busy"}.get(self.status, "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status)


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


def parse(body: Any, chat: bool, engine: Engine, model_id: str) -> ApiRequest:
    """Validate a request body; ApiError names the first bad parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") != model_id:
        raise ApiError(404, f"model: {body.get('model')!r} is not served here; this server serves {model_id!r}",
                       "model", "model_not_found")
    for k, default in AT_DEFAULT.items():
        if body.get(k) not in (None, default):
            raise ApiError(400, f"{k}: not supported; only {k} = {json.dumps(default)} (got {body[k]!r})", k)
    known = set(KNOBS) | set(PENALTIES) | set(AT_DEFAULT) | {
        "model", "messages", "prompt", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "seed", "stop", "denoise_events"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown parameter; decoding knobs: {', '.join(KNOBS + PENALTIES)}",
                       unknown[0])
    where = "messages" if chat else "prompt"
    ids, prompt, user_text = None, "", None
    if chat:
        msgs = _messages(body.get("messages"))
        prompt, user_text = engine.chat_prompt(msgs), msgs[-1]["content"]
    elif isinstance(body.get("prompt"), list) and body["prompt"] and all(type(t) is int for t in body["prompt"]):
        ids = _token_ids(body["prompt"], engine)
    else:
        prompt = user_text = _text(body.get("prompt"), "prompt")
    if ids is None and not prompt.strip():
        raise ApiError(400, f"{where}: the prompt must not be empty", where)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ApiError(400, f"{where}: longer than {MAX_PROMPT_CHARS} characters", where)
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
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
        param = name if e.field == "max_new_tokens" else e.field
        raise ApiError(400, str(e).replace("max_new_tokens", param, 1), param) from None
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options: must be an object", "stream_options")
    return ApiRequest(chat, prompt, user_text, ids, cfg, _bool(body, "stream"), bool(opts.get("include_usage")),
                      _bool(body, "denoise_events"), _stops(body.get("stop")), name)


def _token_ids(ids: list[int], engine: Engine) -> list[int]:
    vocab = engine.lm.cfg.vocab_size
    if not all(0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
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


class LiveTicket:
    """A scheduler ticket seen from asyncio: batches of events as the forwards run, then the Result."""

    def __init__(self, sched: Scheduler, ids: list[int], cfg: DecodeConfig, prompt_text: str, record: bool):
        loop = asyncio.get_running_loop()
        self.q: asyncio.Queue[Event | None] = asyncio.Queue()
        put = lambda x: loop.call_soon_threadsafe(self.q.put_nowait, x)  # noqa: E731 - called on the decoding thread
        self.ticket: Ticket = sched.submit(ids, cfg, listener=put, prompt_text=prompt_text, record=record,
                                           on_finish=lambda _: put(None))

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Every event in order, grouped by what arrived together; ends when the request is finished."""
        done = False
        while not done:
            batch = [await self.q.get()]
            while not self.q.empty():
                batch.append(self.q.get_nowait())
            done = batch[-1] is None
            events = [e for e in batch if e is not None]
            if events:
                yield events

    def result(self) -> Result:
        return self.ticket.wait(0)


def usage(prompt_tokens: int, s: Summary) -> dict[str, Any]:
    """OpenAI's usage, plus what a dLLM run is measured by (completion tokens count through the stop token)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": s.answer_tokens,
            "total_tokens": prompt_tokens + s.answer_tokens, "nfe": s.nfe,
            "tokens_per_forward": round(s.tokens_per_forward, 4), "engine_seconds": round(s.seconds, 6),
            "engine_ttft": round(s.ttft, 6)}


def create_app(engine: Engine, scheduler: Scheduler, model_id: str | None = None) -> FastAPI:
    """The FastAPI app; the caller owns the scheduler (and closes it)."""
    model_id = model_id or engine.lm.name
    created = int(time.time())
    app = FastAPI(title="Fast-dLLM v2 (OpenAI-compatible)")

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    lm = engine.lm
    about = {"banner": lm.banner(), "can_diffuse": engine.can_diffuse, "max_model_len": engine.max_context,
             "bd_size": lm.cfg.bd_size, "source": lm.source.reason,
             "adapter": Path(lm.source.adapter).name if lm.source.adapter else None,
             "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""),
             "mask_token_id": lm.mask_token_id, "stop_token_ids": list(lm.stop_token_ids)}  # what a remote studio
    # shows, lays its live view out by, and writes into trace headers

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

    async def _json(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def complete(request: Request, chat: bool):
        req = parse(await _json(request), chat, engine, model_id)
        ids = req.ids or engine.encode(req.prompt)
        try:
            live = LiveTicket(scheduler, ids, req.cfg, req.user_text, record=req.denoise_events)
        except ConfigError:  # the only check left after parse(): the prompt does not fit the context
            param = "messages" if chat else "prompt"
            raise ApiError(400, f"{param}: the prompt has {len(ids)} tokens; the model's context is "
                                f"{engine.max_context} tokens (prompt and answer together)", param) from None
        except SchedulerBusy as e:
            raise ApiError(503, str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_id}
        if req.stream:
            return StreamingResponse(_stream(live, req, head, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(request, live, req, head, len(ids))

    async def _whole(request: Request, live: LiveTicket, req: ApiRequest, head: dict, n_prompt: int) -> dict:
        stop, text, events = StopMatcher(req.stops), "", []
        try:
            async for batch in live.batches():
                text += stop.push("".join(e.text_delta for e in batch))
                if stop.hit:
                    live.ticket.cancel()
                if await request.is_disconnected():
                    live.ticket.cancel()
            text += stop.flush()
        finally:
            live.ticket.cancel()  # no-op once finished; frees the row if this handler is torn down early
        try:
            res = live.result()
        except Exception as e:  # noqa: BLE001 - an engine fault: this request fails, the server keeps serving
            raise ApiError(500, f"decoding failed: {e}") from None
        reason = "stop" if stop.hit else FINISH.get(res.summary.stop_reason, "stop")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                  if req.chat else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        out = {**head, "choices": [choice], "usage": usage(n_prompt, res.summary)}
        if req.denoise_events and res.trace is not None:
            out["trace"] = res.trace.to_json()
        return out

    async def _stream(live: LiveTicket, req: ApiRequest, head: dict, n_prompt: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if req.chat else "text_completion"

        def chunk(text: str | None, reason: str | None = None, **extra: Any) -> str:
            if req.chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            return "data: " + json.dumps({**head, "object": obj, "choices": [choice], **extra},
                                         ensure_ascii=False) + "\n\n"

        stop = StopMatcher(req.stops)
        try:
            first: dict[str, Any] = {}
            if req.denoise_events and live.ticket.trace is not None:
                first["denoise_header"] = live.ticket.trace.header
            if req.chat:
                yield "data: " + json.dumps({**head, "object": obj, **first, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
            elif first:
                yield chunk("", **first)
            async for batch in live.batches():
                text = stop.push("".join(e.text_delta for e in batch))
                if stop.hit:
                    live.ticket.cancel()
                extra = {"denoise_events": [e.to_json() for e in batch]} if req.denoise_events else {}
                if text or extra:
                    yield chunk(text, **extra)
            res = live.result()
            tail = stop.flush()
            reason = "stop" if stop.hit else FINISH.get(res.summary.stop_reason, "stop")
            last = {"denoise_summary": asdict(res.summary)} if req.denoise_events else {}
            yield chunk(tail or None, reason, **last) if req.chat else chunk(tail, reason, **last)
            if req.include_usage:
                yield "data: " + json.dumps({**head, "object": obj, "choices": [],
                                             "usage": usage(n_prompt, res.summary)}) + "\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI-compatible servers do
            yield "data: " + json.dumps({"error": {"message": f"decoding failed: {e}", "type": "server_error"}}) + "\n\n"
        finally:
            live.ticket.cancel()  # the client went away (or we are done): its row leaves before the next forward

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_batch: int = MAX_BATCH) -> None:
    """Run the server until interrupted (`python -m engine serve`)."""
    import uvicorn

    sched = Scheduler(engine, max_batch=max_batch)
    try:
        uvicorn.run(create_app(engine, sched), host=host, port=port, log_level="info")
    finally:
        sched.close()
