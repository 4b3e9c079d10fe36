"""An engine for the studio: the in-process Engine, or a remote OpenAI-compatible server driven over HTTP.

The studio calls the engine through a few methods (chat_prompt, encode, decode_config, trace_header, check_ids,
generate_ids with a listener and a stop flag). RemoteEngine implements them against `python -m engine serve`:
tokens from its /tokenize, the decode from a streamed /v1/completions of those token ids with
`denoise_events: true`, so the live view, meters, replay, race and sweep see the same events and traces as
in-process. Against other OpenAI-compatible servers (vLLM, SGLang: they have /tokenize and token-id prompts but no
denoise events) it streams text only: the chat and the token/time meters work, the denoising view stays empty,
NFE is unknown (0), and the decoding knobs are the server's own (README, Serving).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import httpx

from engine import ConfigError, DecodeConfig, Event, Result, Summary, Trace
from engine.config import fit_to_context
from engine.decode import Cancel
from engine.events import Listener

KNOBS = ("mode", "block_size", "sub_block_size", "threshold", "strategy", "factor", "cache", "stop_guard")
MESSAGES = "\x00messages:"  # chat_prompt's result on a plain server: the messages, templated by its /tokenize


class RemoteError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass
class RemoteLM:
    """The model facts the studio shows (banner, trace header), as the server's /v1/models reports them."""

    name: str
    source: Any  # .reason, .adapter
    device: Any  # .type
    dtype: str
    mask_token_id: int | None
    cfg: Any  # .bd_size
    url: str

    def banner(self) -> str:
        adapter = " + Fast-dLLM v2 adapter" if self.source.adapter else ""
        return f"{self.name}{adapter} · {self.source.reason} · {self.device.type} · {self.dtype} · remote {self.url}"


class RemoteEngine:
    """Engine's studio-facing methods over `python -m engine serve` at url (…/v1 or the server root)."""

    def __init__(self, url: str, timeout: float = 600.0, plain: bool | None = None):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(base_url=self.base, timeout=timeout)
        try:
            r = self.http.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise RemoteError(f"engine url: {self.base}/v1/models did not answer ({e})") from None
        m = r.json()["data"][0]
        self.plain = "can_diffuse" not in m if plain is None else plain  # not our server: text only
        self.model_id = m["id"]
        self.can_diffuse = bool(m.get("can_diffuse", True))  # a plain server decodes however it is configured
        self.max_context = int(m.get("max_model_len", 8192))
        # the adapter as a URL: truthy for the banner, never a local file whose measurements would be shown as the server's
        adapter = f"{self.base}/{m['adapter']}" if m.get("adapter") else None
        self.lm = RemoteLM(m["id"], SimpleNamespace(reason=m.get("source", "remote"), adapter=adapter),
                           SimpleNamespace(type=m.get("device", "remote")), m.get("dtype", "?"),
                           m.get("mask_token_id"), SimpleNamespace(bd_size=int(m.get("bd_size", 32))), self.base)
        self.stop_token_ids = tuple(m.get("stop_token_ids", ()))

    # ---------------------------------------------------------------- text and settings
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            raise _error(r.status_code, r.text)
        return r.json()

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if self.plain:  # vLLM's /tokenize applies the chat template but does not return the text
            return MESSAGES + json.dumps(messages)
        return self._post("/tokenize", {"model": self.model_id, "messages": messages})["prompt"]

    def encode(self, text: str) -> list[int]:
        if text.startswith(MESSAGES):
            body = {"model": self.model_id, "messages": json.loads(text[len(MESSAGES):]), "add_generation_prompt": True}
        else:
            body = {"model": self.model_id, "prompt": text}
        return self._post("/tokenize", body)["tokens"]

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """Validated here with the same rules, the server model's stop tokens filled in (as Engine does)."""
        cfg = DecodeConfig(**overrides)
        if not cfg.stop_token_ids:
            cfg = replace(cfg, stop_token_ids=self.stop_token_ids)
        return cfg.validate()

    def check_ids(self, ids: list[list[int]], cfg: DecodeConfig) -> DecodeConfig:
        return fit_to_context(ids, cfg, self.max_context).validate()

    def trace_header(self, ids: list[int], cfg: DecodeConfig, prompt: str | None) -> dict[str, Any]:
        lm = self.lm
        return {"model": lm.name, "source": lm.source.reason, "adapter": bool(lm.source.adapter),
                "device": lm.device.type, "dtype": lm.dtype, "config": cfg.to_dict(), "prompt": prompt,
                "prompt_len": len(ids), "mask_token_id": lm.mask_token_id}

    # ---------------------------------------------------------------- decoding
    def generate_ids(self, ids: list[list[int]], cfg: DecodeConfig, *, listener: Listener | None = None,
                     cancel: Cancel | None = None, record: bool = True,
                     prompt_texts: list[str] | None = None) -> list[Result]:
        """One streamed request per prompt (the server batches them with everyone else's)."""
        return [self._one(p, self.check_ids([p], cfg), listener, cancel, record,
                          prompt_texts[i] if prompt_texts else None) for i, p in enumerate(ids)]

    def _one(self, ids: list[int], cfg: DecodeConfig, listener: Listener | None, cancel: Cancel | None,
             record: bool, prompt_text: str | None) -> Result:
        body = {"model": self.model_id, "prompt": ids, "stream": True, "max_tokens": cfg.max_new_tokens,
                "temperature": cfg.temperature, "top_p": cfg.top_p, **({"seed": cfg.seed} if cfg.seed is not None else {})}
        trace = Trace(self.trace_header(ids, cfg, prompt_text))
        if self.plain:
            return self._plain(body, trace, listener, cancel, record)
        body |= {"denoise_events": True, **{k: getattr(cfg, k) for k in KNOBS}}
        summary: Summary | None = None
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code >= 400:
                raise _error(r.status_code, r.read().decode("utf-8", "replace"))
            for line in r.iter_lines():
                if cancel is not None and cancel.is_set():
                    break  # closing the stream drops our row on the server before its next forward
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RemoteError(chunk["error"].get("message", "decoding failed"))
                for d in chunk.get("denoise_events", []):
                    e = Event.from_json(d)
                    trace.events.append(e)
                    if listener is not None:
                        listener(e)
                if chunk.get("denoise_summary"):
                    summary = Summary(**chunk["denoise_summary"])
        if summary is None:  # we stopped reading: the run ends where the events we saw end
            summary = _cancelled(trace)
        trace.summary = summary
        return Result(summary, trace if record else None)


    def _plain(self, body: dict[str, Any], trace: Trace, listener: Listener | None, cancel: Cancel | None,
               record: bool) -> Result:
        """Text only: one event per streamed chunk (no tokens, no masks); the meters from usage and client time."""
        t0, text, ttft, tokens, reason = time.perf_counter(), "", None, 0, "max_new_tokens"

        def emit(kind: str, delta: str) -> None:
            e = Event(kind, 0, 0, 0, -1, [], [], delta, time.perf_counter() - t0)
            trace.events.append(e)
            if listener is not None:
                listener(e)

        body = {**body, "stream_options": {"include_usage": True}}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code >= 400:
                raise _error(r.status_code, r.read().decode("utf-8", "replace"))
            for line in r.iter_lines():
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RemoteError(chunk["error"].get("message", "decoding failed"))
                for c in chunk.get("choices") or []:
                    if c.get("text"):
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text += c["text"]
                        emit("step", c["text"])
                    if c.get("finish_reason"):
                        reason = "max_new_tokens" if c["finish_reason"] == "length" else "stop_token"
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
        emit("done", "")
        secs = time.perf_counter() - t0
        trace.summary = Summary(answer_tokens=tokens, nfe=0, tokens_per_forward=0.0, seconds=secs,
                                tokens_per_second=tokens / secs if secs > 0 else 0.0,
                                ttft=ttft if ttft is not None else secs, stop_reason=reason, text=text, token_ids=[])
        return Result(trace.summary, trace if record else None)


def _cancelled(trace: Trace) -> Summary:
    """A run the studio stopped (the server's own summary never came): the contiguous committed prefix so far."""
    got = {t.pos: (t.id, e.t) for e in trace.events for t in e.committed}
    ids = []
    while len(ids) in got:
        ids.append(got[len(ids)][0])
    last = trace.events[-1] if trace.events else None
    nfe, secs = (last.nfe, last.t) if last else (0, 0.0)
    return Summary(answer_tokens=len(ids), nfe=nfe, tokens_per_forward=len(ids) / max(nfe, 1), seconds=secs,
                   tokens_per_second=len(ids) / secs if secs > 0 else 0.0, ttft=got[0][1] if 0 in got else secs,
                   stop_reason="cancelled", text="".join(e.text_delta for e in trace.events), token_ids=ids)


def _error(status: int, text: str) -> Exception:
    """The server's OpenAI-style error: a bad setting becomes the studio's ConfigError naming it."""
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return RemoteError(f"engine server: HTTP {status}: {text[:300]}")
    if status == 400 and err.get("param"):
        msg = str(err.get("message", ""))
        return ConfigError(err["param"], msg.split(": ", 1)[1] if msg.startswith(err["param"] + ": ") else msg)
    return RemoteError(f"engine server: {err.get('message', text[:300])}")
