"""HTML the server renders (banner, meters, chat text) and the live view's JSON payloads.

Model output and uploaded traces are untrusted: every string that reaches HTML goes through
html.escape here, and the browser-side renderer (static/studio.js) only ever uses textContent.
"""
from __future__ import annotations

import functools
import html
import json
import re
from dataclasses import asdict
from typing import Any

from markdown_it import MarkdownIt

from engine import Event, Summary

_FENCE = re.compile(r"(```.*?(?:```|$)|`[^`\n]*`)", re.S)
_MD = MarkdownIt("commonmark")  # raw HTML on, as in the chatbot's markdown renderer


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _raw_html(markdown: str) -> bool:
    """Whether a CommonMark renderer would pass some of this text through as raw HTML."""
    return any(t.type == "html_block" or any(c.type == "html_inline" for c in t.children or ())
               for t in _MD.parse(markdown))


@functools.lru_cache(maxsize=1024)  # the chat re-renders every finished message on each frame
def escape_chat(text: str) -> str:
    """Markdown for the chat bubble with any HTML in the model's prose shown as text, not rendered.

    Code spans and fenced blocks are left alone: the markdown renderer already shows their content
    literally (escaping them too would print '&lt;' inside code). Where the split above disagrees
    with markdown (a backslash before a backtick, unequal backtick runs, a fence opened mid-line),
    raw HTML would survive it: then everything is escaped, code included.
    """
    parts = _FENCE.split(text)
    out = "".join(p if i % 2 else esc(p) for i, p in enumerate(parts))
    return esc(text) if _raw_html(out) else out


def chat_display(convo: list[dict[str, str]]) -> list[dict[str, str]]:
    """The chatbot's messages: the raw conversation with HTML escaped for display."""
    return [{"role": m["role"], "content": escape_chat(m["content"]) if m["content"] else "*(empty answer)*"}
            for m in convo if m["role"] != "system"]


def banner_html(lm: Any, can_diffuse: bool, title: str = "") -> str:
    """Which model, why it was chosen, where it runs."""
    adapter = " + Fast-dLLM v2 adapter" if lm.source.adapter else ""
    dtype = str(lm.dtype).replace("torch.", "")
    parts = [f'<span class="fd-title">{esc(title)}</span>'] if title else []
    parts += [f'<span class="fd-model">{esc(lm.name + adapter)}</span>',
             f'<span class="fd-chip" title="why this model was chosen">{esc(lm.source.reason)}</span>',
             f'<span class="fd-chip">{esc(lm.device.type)}</span>', f'<span class="fd-chip">{esc(dtype)}</span>']
    note = ""
    if not can_diffuse:
        note = ('<div class="fd-note">This model has no <code>|&lt;MASK&gt;|</code> token: block diffusion needs the '
                'Fast-dLLM v2 adapter (<code>assets/fastdllm_adapter.safetensors</code>) or a Fast-dLLM v2 '
                'checkpoint. Chat runs in AR mode.</div>')
    return f'<div class="fd-banner">{" ".join(parts)}{note}</div>'


def _as_dict(s: Summary | dict[str, Any]) -> dict[str, Any]:
    return s if isinstance(s, dict) else asdict(s)


def _fmt(v: float, digits: int = 2) -> str:
    return f"{v:,.{digits}f}"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def meter_cards(s: Summary | dict[str, Any], title: str = "") -> str:
    """Engine-time meters of one run (never UI time)."""
    d = _as_dict(s)
    cards = [("tokens/s", _fmt(float(d["tokens_per_second"]), 1), "answer tokens per second of engine time"),
             ("NFE", str(int(d["nfe"])), "forwards (network function evaluations), prefill and commits included"),
             ("tokens/forward", _fmt(float(d["tokens_per_forward"])), "answer tokens per forward: 1.0 for AR"),
             ("TTFT", _duration(float(d["ttft"])), "engine time to the first committed token"),
             ("tokens", str(int(d["answer_tokens"])), "answer tokens, through the stop token"),
             ("time", _duration(float(d["seconds"])), "engine seconds (tokenisation and UI excluded)"),
             ("stop", esc(str(d["stop_reason"]).replace("_", " ")), "why decoding ended")]
    body = "".join(f'<div class="fd-card" data-k="{esc(k)}" title="{esc(tip)}"><div class="fd-card-v">{v}</div>'
                   f'<div class="fd-card-k">{esc(k)}</div></div>' for k, v, tip in cards)
    head = f'<div class="fd-meter-title">{esc(title)}</div>' if title else ""
    return f'<div class="fd-meter">{head}<div class="fd-cards">{body}</div></div>'


def meters_html(summary: Summary | dict[str, Any] | None, title: str = "", ar: Summary | dict[str, Any] | None = None,
                note: str = "") -> str:
    """Meters of a run, plus the AR baseline and the speed ratio when one is known for the same prompt."""
    if summary is None:
        return '<div class="fd-meter fd-empty">Meters appear when an answer finishes.</div>'
    out = meter_cards(summary, title)
    if ar is not None:
        ratio = float(_as_dict(summary)["tokens_per_second"]) / max(float(_as_dict(ar)["tokens_per_second"]), 1e-9)
        out += meter_cards(ar, "AR baseline (same prompt)")
        out += f'<div class="fd-ratio">diffusion / AR speed: <b>{ratio:.2f}×</b> tokens/s (engine time)</div>'
    if note:
        out += f'<div class="fd-meter-note">{esc(note)}</div>'
    return out


def race_html(diff: Summary | None, ar: Summary | None, status: str) -> str:
    """Both meters and the speed ratio of a race."""
    out = [f'<div class="fd-race-status">{esc(status)}</div>']
    if diff is not None:
        out.append(meter_cards(diff, "Fast-dLLM v2 (block diffusion)"))
    if ar is not None:
        out.append(meter_cards(ar, "AR baseline"))
    if diff is not None and ar is not None:
        ratio = diff.tokens_per_second / max(ar.tokens_per_second, 1e-9)
        nfe = ar.nfe / max(diff.nfe, 1)
        out.append(f'<div class="fd-ratio">speed-up: <b>{ratio:.2f}×</b> tokens/s · <b>{nfe:.2f}×</b> fewer '
                   f'forwards (engine time, same prompt and max tokens)</div>')
    return "".join(out)


# ---------------------------------------------------------------- live view payloads (parsed by static/studio.js)
def live_payload(run: str, seq: int, events: list[Event], header: dict[str, Any] | None = None,
                 summary: Summary | None = None, frame: int = 0) -> str:
    """One frame for the live view: the events new since the last frame (never the whole answer again)."""
    d: dict[str, Any] = {"run": run, "seq": seq, "frame": frame, "ev": [e.to_json() for e in events]}
    if header is not None:
        d["head"] = header
    if summary is not None:
        d["sum"] = {k: v for k, v in asdict(summary).items() if k not in ("text", "token_ids")}
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def live_clear(frame: int = 0, message: str = "") -> str:
    return json.dumps({"run": "", "clear": True, "frame": frame, "msg": message}, separators=(",", ":"))
