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
seed + i); `logprobs` serves each answer token's committed probability and `top_logprobs` the most likely tokens of
the distribution it was committed from (Token.top); `echo` (completions) returns the
prompt scored by engine/likelihood.py, which with /tokenizer_info and /detokenize lets lm-eval's own OpenAI client
score log-likelihood tasks against the server (docs/serving.md).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ConfigError
from ..engine import Engine, Result
from ..events import Event
from ..weights import MASK_TOKEN
from ..driver import Driver
from ..scheduler import MAX_BATCH, SchedulerBusy
from .request import (FINISH, MAX_BODY_BYTES, MAX_ECHO_DIFFUSION_TOKENS, MAX_JSON_DEPTH, MAX_PROMPT_CHARS, ApiError,
                      ApiRequest, _depth, _messages, _text, generation_defaults, parse)
from .response import Choice, LiveGroup, _echo_logprobs, _logprobs_json, usage
from .surface import Metrics, Surface, log

# Server-sent events pass through a reverse proxy as they are written: nginx buffers a response unless it says
# X-Accel-Buffering: no (docs/serving.md, "Behind a reverse proxy")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(engine: Engine, scheduler: Driver, model_id: str | None = None, *, api_key: str | None = None,
               allowed_origins: list[str] | tuple[str, ...] = (), defaults: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app; the caller owns the scheduler (and closes it). api_key: every route but /health needs
    `Authorization: Bearer <api_key>`; allowed_origins: browsers on these origins may call it (CORS; none by default);
    defaults: decoding settings for what a request leaves out (request.generation_defaults)."""
    defaults = generation_defaults(defaults)
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
        if not scheduler.alive:
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
        req = parse(await _json(request), chat, engine, model_id, defaults)
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
                                     headers=STREAM_HEADERS)
        echo = None
        if req.echo and req.logprobs and req.cfg.mode == "diffusion" and len(ids) > MAX_ECHO_DIFFUSION_TOKENS:
            raise ApiError(400, f"echo: scoring a prompt under block diffusion costs one forward per token; at most "
                                f"{MAX_ECHO_DIFFUSION_TOKENS} prompt tokens (got {len(ids)}; mode 'ar' scores any "
                                f"length in one forward)", "echo")
        if req.echo:  # scored before decoding starts, off the event loop
            ptoks = [engine.lm.tokenizer.decode([t]) for t in ids]
            scored = None
            if req.logprobs:
                from ..likelihood import token_logprobs

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
                                             cached_tokens=max(r.summary.cached_tokens for r in results),
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
            lp = _logprobs_json(req.chat, c.take(), req.top) if req.logprobs else None
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
            lp = _logprobs_json(req.chat, c.take(), req.top) if req.logprobs else None
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
          api_key: str | None = None, allowed_origins: list[str] | tuple[str, ...] = (),
          prefill_chunk: int | None = None, prefix_cache_mib: int | None = None,
          defaults: dict[str, Any] | None = None) -> None:
    """Run the server until interrupted (`python -m engine serve`); prefill_chunk / prefix_cache_mib None: the
    engine's runtime's (FASTDLLM_PREFILL_CHUNK / FASTDLLM_PREFIX_CACHE_MIB), else the scheduler's defaults."""
    import uvicorn

    if not log.handlers:  # the per-request JSON lines, on stderr beside uvicorn's own
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    given = {"prefill_chunk": prefill_chunk, "prefix_cache_mib": prefix_cache_mib}
    sched = engine.start_scheduler(max_batch=max_batch, **{k: v for k, v in given.items() if v is not None})
    try:
        uvicorn.run(create_app(engine, sched, api_key=api_key, allowed_origins=allowed_origins, defaults=defaults),
                    host=host, port=port,
                    log_level="info", access_log=False)  # our JSON line replaces uvicorn's access line
    finally:
        engine.close_scheduler()
