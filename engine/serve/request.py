"""Requests in: limits, OpenAI-shaped errors, and parsing a body into an ApiRequest (every field validated)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from ..config import MAX_TOP_LOGPROBS, ConfigError, DecodeConfig
from ..engine import Engine
from ..weights import MASK_TOKEN

KNOBS = ("mode", "block_size", "sub_block_size", "threshold", "strategy", "factor", "cache", "stop_guard")
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "no_repeat_ngram_size")
# What `--override-generation-config` (vLLM's name) may set: the server's defaults for requests that leave them out
DEFAULTABLE = KNOBS + PENALTIES + ("temperature", "top_p", "max_new_tokens")
MAX_N = 16  # choices per request (n): each is a scheduler row
MAX_ECHO_DIFFUSION_TOKENS = 512  # echo + logprobs under diffusion: one forward per prompt token (engine/likelihood.py)
MAX_PROMPT_CHARS = 200_000  # tokenising is cheap, not free: bound it before the context check
MAX_BODY_BYTES = 8 << 20  # a request body larger than this gets 413 before it is parsed
MAX_JSON_DEPTH = 32  # the deepest real request nests 4 levels (messages -> message -> content parts -> part)
MAX_MESSAGE_CHARS = 1000  # error messages quote the bad value, cut to this
MAX_STOPS = 4
FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_busy"}

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


def _blame_block_size(e: ConfigError, given: dict[str, Any], sub: int) -> ConfigError:
    """block_size given without sub_block_size: the sub-block error is block_size's (the other was a default)."""
    if e.field != "sub_block_size" or given.get("sub_block_size") is not None:
        return e
    return ConfigError("block_size", f"must be a multiple of sub_block_size={sub} (its default; send sub_block_size "
                                     f"too to change it) (got {_show(given.get('block_size'))})")


def generation_defaults(spec: str | dict[str, Any] | None) -> dict[str, Any]:
    """`--override-generation-config`: a JSON object of decoding settings (DEFAULTABLE) that a request gets when it
    does not send them (or sends null), as vLLM's option does; a request's own values win. Validated as a request's
    settings would be; ConfigError names the bad key."""
    name = "override_generation_config"
    if spec is None:
        return {}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ConfigError(name, f"must be a JSON object, e.g. '{{\"frequency_penalty\": 0.3}}' (got {_show(spec)})"
                              ) from None
    if not isinstance(spec, dict):
        raise ConfigError(name, f"must be a JSON object of decoding settings (got {_show(spec)})")
    unknown = sorted(set(spec) - set(DEFAULTABLE))
    if unknown:
        raise ConfigError(name, f"{unknown[0]!r} is not a decoding setting; allowed: {', '.join(DEFAULTABLE)}")
    try:
        DecodeConfig(**spec).validate()
    except ConfigError as e:
        raise ConfigError(name, str(_blame_block_size(e, spec, DecodeConfig().sub_block_size))) from None
    except TypeError as e:  # a value of the wrong type that the dataclass itself refuses
        raise ConfigError(name, str(e)) from None
    return dict(spec)


def parse(body: Any, chat: bool, engine: Engine, model_id: str, defaults: dict[str, Any] | None = None) -> ApiRequest:
    """Validate a request body; ApiError names the first bad parameter. `defaults` (generation_defaults): the
    server's settings for what the body leaves out."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") != model_id:
        raise ApiError(404, f"model: {_show(body.get('model'))} is not served here; this server serves {model_id!r}",
                       "model", "model_not_found")
    n = 1 if body.get("n") is None else body["n"]
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n: must be an integer in [1, {MAX_N}] (got {_show(n)})", "n")
    echo = False if chat else _bool(body, "echo")
    logprobs, top = _logprobs(body, chat)
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
    knobs = {"mode": "diffusion" if engine.can_diffuse else "ar"} | (defaults or {}) | \
        {k: body[k] for k in KNOBS if body.get(k) is not None}
    for k in ("temperature", "top_p", "seed") + PENALTIES:
        if body.get(k) is not None:
            knobs[k] = body[k]
    if body.get(name) is not None:
        knobs["max_new_tokens"] = body[name]
    if logprobs and top:
        knobs["top_logprobs"] = top
    try:
        cfg = engine.decode_config(**knobs)
        if cfg.mode == "diffusion" and not engine.can_diffuse:
            raise ConfigError("mode", "this model has no |<MASK>| token and cannot decode by block diffusion; use 'ar'")
    except ConfigError as e:
        # the client sent block_size alone: the sub-block size it meets is the server's default, or the engine's
        e = _blame_block_size(e, body, knobs.get("sub_block_size", DecodeConfig().sub_block_size))
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


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """(logprobs on, alternatives per token), with vLLM's names and limit: chat takes logprobs true/false and
    top_logprobs in [0, MAX_TOP_LOGPROBS] (only with logprobs true); completions take logprobs as that count (OpenAI
    allows 5, vLLM 20), which with echo covers the prompt's tokens too (scored afresh by engine/likelihood.py)."""
    v, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if v is not None and not isinstance(v, bool):
            raise ApiError(400, f"logprobs: must be true or false (got {_show(v)})", "logprobs")
        if top is None:
            return bool(v), 0
        if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}] (got {_show(top)})",
                           "top_logprobs")
        if top and not v:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        return bool(v), top
    if top is not None and top != 0:
        raise ApiError(400, f"top_logprobs: a chat parameter; completions take the number of alternatives as "
                            f"logprobs, an integer in [0, {MAX_TOP_LOGPROBS}] (got {_show(top)})", "top_logprobs")
    if v is None:
        return False, 0
    if type(v) is not int or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"logprobs: an integer in [0, {MAX_TOP_LOGPROBS}], the alternatives kept per token "
                            f"(0: each token's own log-probability only) (got {_show(v)})", "logprobs")
    return True, v


def _token_ids(ids: list[int], engine: Engine) -> list[int]:
    vocab = engine.lm.cfg.vocab_size
    if not all(0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
    mask = engine.lm.mask_token_id
    if mask is not None and mask in ids:
        raise ApiError(400, f"prompt: contains the mask token id {mask} ({MASK_TOKEN}), which only the decoder may "
                            f"place (at position {ids.index(mask)})", "prompt")
    return ids



def _depth(obj: Any) -> int:
    """How deeply lists and objects nest (iteratively: no recursion on what a client sent); a scalar (a string, a
    number, true/false, null) nests 0 levels."""
    if not isinstance(obj, (dict, list)):
        return 0
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_JSON_DEPTH:
            break
        stack += [(x, d + 1) for x in (o.values() if isinstance(o, dict) else o) if isinstance(x, (dict, list))]
    return deepest

