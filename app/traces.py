"""Uploaded traces are untrusted: parse with limits, check every field, keep only typed data."""
from __future__ import annotations

import json
import math
from typing import Any

from engine import ConfigError, DecodeConfig, Summary, Trace
from engine.events import EVENT_KINDS, TRACE_VERSION

MAX_TRACE_BYTES = 20 * 1024 * 1024
MAX_EVENTS = 100_000
MAX_TOKENS_PER_EVENT = 4096
MAX_PIECE_CHARS = 256
MAX_TEXT_CHARS = 200_000
MAX_PROMPT_LEN = 10_000_000
OPTIONAL = {"cached_tokens"}  # summary fields newer than some saved traces (2026-11-28): absent reads as 0


class TraceError(ValueError):
    """Why an uploaded trace was rejected, in words for the user."""


def _reject_constant(name: str) -> float:
    raise TraceError(f"trace: {name} is not a valid number here")


def _str(v: Any, where: str, limit: int, none_ok: bool = False) -> str | None:
    if v is None and none_ok:
        return None
    if not isinstance(v, str):
        raise TraceError(f"trace: {where} must be a string")
    if len(v) > limit:
        raise TraceError(f"trace: {where} is longer than {limit} characters")
    return v


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise TraceError(f"trace: {where} must be an integer in [{lo}, {hi}]")
    return v


def _num(v: Any, where: str, lo: float = 0.0, hi: float = math.inf) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
        raise TraceError(f"trace: {where} must be a finite number in [{lo}, {hi}]")
    return float(v)


def _tokens(xs: Any, where: str, limit: int) -> None:
    if not isinstance(xs, list) or len(xs) > MAX_TOKENS_PER_EVENT:
        raise TraceError(f"trace: {where} must be a list of at most {MAX_TOKENS_PER_EVENT} tokens")
    for t in xs:
        if not isinstance(t, list) or len(t) != 4:
            raise TraceError(f"trace: {where} entries must be [pos, id, text, conf]")
        _int(t[0], f"{where} pos", 0, limit - 1)
        _int(t[1], f"{where} id", 0, 10**9)
        _str(t[2], f"{where} text", MAX_PIECE_CHARS)
        _num(t[3], f"{where} conf", 0.0, 1.0)


def _header(h: Any) -> tuple[dict[str, Any], DecodeConfig]:
    if not isinstance(h, dict):
        raise TraceError("trace: 'header' must be an object")
    try:
        cfg = DecodeConfig.from_dict(h.get("config")).validate() if isinstance(h.get("config"), dict) else None
    except (ConfigError, TypeError) as e:
        raise TraceError(f"trace: header.config: {e}") from None
    if cfg is None:
        raise TraceError("trace: header.config must be an object of decoding settings")
    mask = h.get("mask_token_id")
    clean = {
        "model": _str(h.get("model", "?"), "header.model", 200),
        "source": _str(h.get("source", "?"), "header.source", 200),
        "adapter": bool(h.get("adapter", False)),
        "device": _str(h.get("device", "?"), "header.device", 40),
        "dtype": _str(h.get("dtype", "?"), "header.dtype", 40),
        "config": cfg.to_dict(),
        "prompt": _str(h.get("prompt"), "header.prompt", MAX_TEXT_CHARS, none_ok=True),
        "prompt_len": _int(h.get("prompt_len"), "header.prompt_len", 1, MAX_PROMPT_LEN),
        "mask_token_id": None if mask is None else _int(mask, "header.mask_token_id", 0, 10**9),
    }
    return clean, cfg


def _summary(s: Any) -> None:
    if s is None:
        return
    if not isinstance(s, dict) or set(s) - OPTIONAL != set(Summary.__dataclass_fields__) - OPTIONAL:
        raise TraceError(f"trace: 'summary' must be null or an object with {', '.join(Summary.__dataclass_fields__)}")
    if "cached_tokens" in s:
        _int(s["cached_tokens"], "summary.cached_tokens", 0, 10**9)
    for k in ("answer_tokens", "nfe"):
        _int(s[k], f"summary.{k}", 0, 10**9)
    for k in ("tokens_per_forward", "seconds", "tokens_per_second", "ttft"):
        _num(s[k], f"summary.{k}")
    _str(s["stop_reason"], "summary.stop_reason", 40)
    _str(s["text"], "summary.text", MAX_TEXT_CHARS)
    if not isinstance(s["token_ids"], list) or len(s["token_ids"]) > 10**6:
        raise TraceError("trace: summary.token_ids must be a list")
    for t in s["token_ids"]:
        _int(t, "summary.token_ids", 0, 10**9)


def parse_trace(data: bytes | str) -> Trace:
    """A Trace from untrusted JSON text, or TraceError saying what is wrong."""
    if len(data) > MAX_TRACE_BYTES:
        raise TraceError(f"trace: file is {len(data) / 1e6:.1f} MB; the limit is {MAX_TRACE_BYTES // 2**20} MiB")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError("trace: not UTF-8 text (expected a JSON trace saved by the studio or the CLI)") from None
    try:
        d = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise TraceError("trace: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"trace: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(d, dict) or d.get("version") != TRACE_VERSION:
        raise TraceError(f"trace: expected a JSON object with \"version\": {TRACE_VERSION}")
    header, cfg = _header(d.get("header"))
    events = d.get("events")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise TraceError(f"trace: 'events' must be a list of at most {MAX_EVENTS} events")
    limit = cfg.max_new_tokens
    n_sub = cfg.block_size // cfg.sub_block_size
    for i, e in enumerate(events):
        w = f"events[{i}]"
        if not isinstance(e, dict):
            raise TraceError(f"trace: {w} must be an object")
        if e.get("kind") not in EVENT_KINDS:
            raise TraceError(f"trace: {w}.kind must be one of {', '.join(EVENT_KINDS)}")
        _int(e.get("row"), f"{w}.row", 0, 10**6)
        _int(e.get("nfe"), f"{w}.nfe", 0, 10**9)
        _int(e.get("block"), f"{w}.block", 0, 10**9)
        _int(e.get("sub_block"), f"{w}.sub_block", -1, n_sub - 1)
        _tokens(e.get("committed"), f"{w}.committed", limit)
        _tokens(e.get("masked"), f"{w}.masked", limit)
        _str(e.get("text_delta"), f"{w}.text_delta", MAX_TEXT_CHARS)
        _num(e.get("t"), f"{w}.t")
    _summary(d.get("summary"))
    try:
        trace = Trace.from_json({**d, "header": header})
    except (KeyError, TypeError, ValueError) as e:  # pragma: no cover - the checks above cover the schema
        raise TraceError(f"trace: {e}") from None
    return trace


# how each setting is named in replay labels; the diffusion-only ones are left out of AR runs' labels
LABEL_NAMES = {"block_size": "block", "sub_block_size": "sub-block", "threshold": "threshold", "strategy": "strategy",
               "factor": "factor", "cache": "cache", "max_new_tokens": "max tokens", "temperature": "temperature",
               "top_p": "top-p", "seed": "seed", "repetition_penalty": "repetition penalty",
               "frequency_penalty": "frequency penalty", "presence_penalty": "presence penalty",
               "no_repeat_ngram_size": "no-repeat n-gram", "stop_guard": "stop guard"}
DIFFUSION_ONLY = ("block_size", "sub_block_size", "threshold", "strategy", "factor", "cache", "stop_guard")


def settings_label(cfg: dict[str, Any]) -> str:
    """Mode, block/sub-block and threshold, then every other setting that differs from the engine's default
    (so two runs that differ only in, say, cache are told apart)."""
    mode = cfg.get("mode", "?")
    base = DecodeConfig().to_dict()
    keys = [k for k in LABEL_NAMES if cfg.get(k) != base.get(k) or k in ("block_size", "threshold")]
    if mode != "diffusion":
        keys = [k for k in keys if k not in DIFFUSION_ONLY]
    elif cfg.get("strategy") == "factor":
        keys = [k for k in keys if k != "threshold"]
    else:
        keys = [k for k in keys if k != "factor"]
    parts = [LABEL_NAMES[k] if cfg.get(k) is True else f"{LABEL_NAMES[k]} {cfg.get(k)}" for k in keys]
    if "block_size" in keys:  # "block 32/8" reads better than two items
        parts = [f"block {cfg.get('block_size')}/{cfg.get('sub_block_size')}"] + \
                [x for k, x in zip(keys, parts) if k not in ("block_size", "sub_block_size")]
    return " · ".join([mode, *parts])


def trace_label(trace: Trace, index: int, tag: str = "") -> str:
    """A short name for the replay list: number, origin, settings, speed, prompt."""
    prompt = (trace.header.get("prompt") or "").strip().replace("\n", " ")
    prompt = prompt[:40] + ("…" if len(prompt) > 40 else "")
    tps = f" · {trace.summary.tokens_per_second:.1f} tok/s" if trace.summary else ""
    stopped = " · stopped" if trace.summary and trace.summary.stop_reason == "cancelled" else ""
    return f"#{index} {tag}{settings_label(trace.header.get('config', {}))}{tps}{stopped} · {prompt}"
