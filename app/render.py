"""HTML the server renders (banner, meters, chat text) and the live view's JSON payloads.

Model output and uploaded traces are untrusted: every string that reaches HTML goes through
html.escape here, and the browser-side renderer (static/studio.js) only ever uses textContent.
"""
from __future__ import annotations

import functools
import html
import json
import re
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

from engine import Event, Summary

from .card import PAPER_URL, LongAnswers, Measured
from .settings import knobs_summary
from .verdict import STOPPED, Verdict, finish_of, finish_phrase, race_verdict

EXPLAIN = Path(__file__).resolve().parent.parent / "static" / "explain.html"

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


def chat_display(convo: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The chatbot's messages: the raw conversation with HTML escaped for display; a stopped answer says so, and one
    that hit the length cap or loops carries a warning badge (the rule of engine/finish.py, kept in "finish")."""
    out = []
    for m in convo:
        if m["role"] == "system":
            continue
        text = escape_chat(m["content"]) if m["content"] else "*(empty answer)*"
        if m.get("stopped"):
            text += "\n\n*(stopped: Stop cut the answer off here)*"
        fin = m.get("finish") if isinstance(m.get("finish"), dict) else {}
        badges = [b for b in fin.get("badges", ()) if isinstance(b, str)]
        if badges:
            kind = "looping" if fin.get("label") == "looping" else "unfinished"
            text += "\n\n" + " ".join(f'<span class="fd-finish fd-finish-{kind}">{esc(b)}</span>' for b in badges)
        out.append({"role": m["role"], "content": text})
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def banner_html(lm: Any, can_diffuse: bool, title: str = "", measured: Measured | None = None,
                threshold: float = 0.9) -> str:
    """Which model, why it was chosen, where it runs, and how good it measured (from its model card)."""
    adapter = " + Fast-dLLM v2 adapter" if lm.source.adapter else ""
    dtype = str(lm.dtype).replace("torch.", "")
    weights = str((getattr(lm, "info", None) or {}).get("weights", dtype))  # e.g. the GGUF's 4-bit blocks on CPU
    parts = [f'<span class="fd-title">{esc(title)}</span>'] if title else []
    parts += [f'<span class="fd-model">{esc(lm.name + adapter)}</span>',
              f'<span class="fd-chip" title="why this model was chosen">{esc(lm.source.reason)}</span>',
              f'<span class="fd-chip">{esc(lm.device.type)}</span>', f'<span class="fd-chip">{esc(dtype)}</span>',
              *([f'<span class="fd-chip" title="how the weights are stored and multiplied (FASTDLLM_WEIGHTS)">'
                 f'{esc(weights)} weights</span>'] if weights != dtype else []),
              f'<a class="fd-chip fd-link" href="{PAPER_URL}" target="_blank" rel="noopener">'
              'paper: arXiv 2509.26328</a>']
    note = ""
    if not can_diffuse:
        note = ('<div class="fd-note">This model has no <code>|&lt;MASK&gt;|</code> token: block diffusion needs the '
                'Fast-dLLM v2 adapter (<code>assets/fastdllm_adapter.safetensors</code>) or a Fast-dLLM v2 '
                'checkpoint. Chat runs in AR mode.</div>')
    elif measured is not None and measured.at(threshold):
        acc, tpf = measured.at(threshold)
        trained = ""
        if measured.train_minutes is not None and measured.tokens_seen is not None:
            n = measured.tokens_seen
            count = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"
            trained = f" (trained {measured.train_minutes:.0f} min on {count} tokens; the paper used ~1B)"
        note = (f'<div class="fd-honest" id="fd-honest"><b>Honest numbers:</b> this small demo model{trained} '
                f'decodes <b>{tpf:.2f} tokens per forward</b> and keeps <b>{_pct(acc / measured.ar_accuracy)} of its '
                f'AR base\'s accuracy</b> at threshold {threshold:g} ({acc:.3f} vs {measured.ar_accuracy:.3f} on '
                f'{esc(measured.set.split(" (")[0])}; model card). It shows the mechanics, not the paper\'s '
                f'speed-ups: at {tpf:.2f} tokens per forward diffusion is still slower than AR on a CPU, where a '
                f'block-diffusion forward costs several AR steps (model card).{long_html(measured.long)}</div>')
    elif lm.source.adapter:
        note = ('<div class="fd-honest" id="fd-honest">This adapter has no measurements in '
                '<code>assets/MODEL_CARD.md</code>: run <code>python -m bench quality</code> to measure it.</div>')
    return f'<div class="fd-banner"><div class="fd-banner-row">{" ".join(parts)}</div>{note}</div>'


def long_html(la: LongAnswers | None) -> str:
    """The banner's long-answer line: how often answers finish and loop, dLLM vs AR, and tokens per forward over
    complete answers only (the parallelism that is not repetition)."""
    if la is None:
        return ""
    tpf = ""
    if la.tokens_per_forward_complete is not None:
        over = f"its {la.complete_n} complete, non-looping answers" if la.complete_n is not None else \
            "complete, non-looping answers"
        allx = la.tokens_per_forward_all
        # the loop remark only where the loops show: all answers decoding faster than the complete ones
        note = "" if allx is None else (
            f' ({allx:.2f} over all: loops are easy to predict several tokens at a time)'
            if allx > la.tokens_per_forward_complete + 0.005 else f' ({allx:.2f} over all)')
        tpf = f' Over {over} it decodes <b>{la.tokens_per_forward_complete:.2f} tokens per forward</b>{note}.'
    return (f'<span class="fd-long" id="fd-long"><b>Long answers:</b> it ends <b>{_pct(la.stop_rate)}</b> of them with '
            f'its stop token (AR base <b>{_pct(la.ar_stop_rate)}</b>) and loops on <b>{_pct(la.loop_rate)}</b> '
            f'(AR base <b>{_pct(la.ar_loop_rate)}</b>).{tpf} <span class="fd-long-src">({esc(la.set)}; '
            f'{esc(la.source)})</span></span>')


def explain_html() -> str:
    """The 30-second explanation of block diffusion (a trusted static fragment)."""
    return EXPLAIN.read_text(encoding="utf-8")


def presets_html(presets: list[dict[str, Any]], measured: Measured | None, strategy: str, threshold: float,
                 factor: float | None = None) -> str:
    """One line on what the current rule is expected to do: the matching preset's effect (a threshold preset by its
    threshold, a factor preset by its factor; else the custom value), with the bundled adapter's measured
    tokens/forward and accuracy at that threshold when known."""
    value = threshold if strategy == "threshold" else factor
    key = "threshold" if strategy == "threshold" else "factor"
    active = next((p for p in presets if p["settings"].get("strategy", "threshold") == strategy and value is not None
                   and abs(float(p["settings"].get(key, -1)) - value) < 1e-9), None)
    # the note is a column of lines (CSS): a name, then what it does; never a line that starts with punctuation
    if active is not None:
        head = f'<b>{esc(active["label"])}</b><span>{esc(active["effect"])}</span>'
    elif strategy == "factor":
        head = ("<b>Factor strategy</b><span>Commits the largest n tokens with (n+1)(1-c<sub>n</sub>) &lt; "
                "factor.</span>")
    else:
        head = (f"<b>Custom threshold {threshold:g}</b><span>Lower commits more tokens per forward; higher is more "
                "careful.</span>")
    m = measured.at(threshold) if measured is not None and strategy == "threshold" else None
    num = (f' <span class="fd-preset-num">Measured on this model: {m[1]:.2f} tokens/forward, '
           f'{_pct(m[0] / measured.ar_accuracy)} of AR accuracy.</span>') if m else ""
    data = f' data-preset="{esc(active["id"])}"' if active is not None else ""
    return f'<div class="fd-presets"{data}>{head}{num}</div>'


def field_error(e: Exception) -> str:
    """A refused setting or message, said inline beside the control (role=alert: read out at once); escaped, since
    the value quoted in it came from the browser."""
    field = getattr(e, "field", None)
    data = f' data-field="{esc(field)}"' if field else ""
    return f'<div class="fd-field-error" role="alert"{data}>⚠ {esc(e)}</div>'


def sweep_progress(point: int, points: int, run: int, runs: int, threshold: float, block_size: int,
                   seconds: float, chars: int) -> str:
    """The sweep's status while it runs: which point and run, how long this run has taken, the answer's length."""
    what = f"{chars} characters of answer so far" if chars else "no answer text yet"
    return (f'<div class="fd-sweep-progress" role="status" data-point="{point + 1}">Point {point + 1} of {points} '
            f'(threshold {threshold:g}, block {block_size}) · run {run + 1} of {runs} · {seconds:.0f} s · '
            f'{what}…</div>')


def knobs_html(settings: dict[str, Any]) -> str:
    """The settings summary line: which repetition knobs are on (escaped: values may come from a browser)."""
    line = knobs_summary(settings)
    on = "on" if line else "off"
    text = line or "Repetition knobs: all off (see Decoding settings)."
    return f'<div class="fd-knobs" data-knobs="{on}">{esc(text)}</div>'


def _as_dict(s: Summary | dict[str, Any]) -> dict[str, Any]:
    return s if isinstance(s, dict) else asdict(s)


def _fmt(v: float, digits: int = 2) -> str:
    return f"{v:,.{digits}f}"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of repeated measurements."""
    return statistics.median(values), min(values), max(values)


UNFINISHED_TIP = "not a speed: the answer did not finish (a loop is easy to predict several tokens at a time)"


def meter_cards(s: Summary | dict[str, Any], title: str = "", tps_runs: list[float] | None = None,
                knobs: str = "") -> str:
    """Engine-time meters of one run (never UI time); with repeats, tokens/s is the median and its range.
    An answer that did not finish (cut at the cap, looping, stopped) says so, and its tokens/s and tokens/forward
    are greyed out: they are not a speed."""
    d = _as_dict(s)
    f = finish_of(d)
    tps, tps_tip = _fmt(float(d["tokens_per_second"]), 1), "answer tokens per second of engine time"
    if tps_runs and len(tps_runs) > 1:
        med, lo, hi = spread(tps_runs)
        tps = f'{_fmt(med, 1)}<span class="fd-card-range">{_fmt(lo, 1)}–{_fmt(hi, 1)}</span>'
        tps_tip = f"median of {len(tps_runs)} runs, and their range (engine time)"
    stopped = d["stop_reason"] == STOPPED
    why = finish_phrase(f, int(d["answer_tokens"]))
    fin = "stopped" if stopped else f.label
    fin_tip = ("complete: ended with the stop token and does not loop" if f.complete else
               f"did not finish: {why} (stop reason: {str(d['stop_reason']).replace('_', ' ')})")
    speed_tip = "" if f.complete else UNFINISHED_TIP
    cards = [("tokens/s", tps, speed_tip or tps_tip),
             ("NFE", str(int(d["nfe"])), "forwards (network function evaluations), prefill and commits included"),
             ("tokens/forward", _fmt(float(d["tokens_per_forward"])),
              speed_tip or "answer tokens per forward: 1.0 for AR"),
             ("TTFT", _duration(float(d["ttft"])), "engine time to the first committed token" + (
                 f"; {int(d['cached_tokens'])} prompt tokens' K/V came from the prefix cache (earlier turns), not "
                 "prefilled" if d.get("cached_tokens") else "")),
             ("tokens", str(int(d["answer_tokens"])), "answer tokens, through the stop token"),
             ("time", _duration(float(d["seconds"])), "engine seconds (tokenisation and UI excluded)"),
             ("stop", esc(fin), fin_tip)]
    muted = ("tokens/s", "tokens/forward") if not f.complete else ()
    body = "".join(f'<div class="fd-card{" fd-card-muted" if k in muted else ""}" data-k="{esc(k)}" '
                   f'title="{esc(tip)}"><div class="fd-card-v">{v}</div>'
                   f'<div class="fd-card-k">{esc("finish" if k == "stop" else k)}</div></div>' for k, v, tip in cards)
    head = f'<div class="fd-meter-title">{esc(title)}</div>' if title else ""
    note = ""
    if not f.complete:
        note = (f'<div class="fd-unfinished-note" data-finish="{esc(fin)}">⚠ Did not finish ({esc(why)}): tokens/s '
                'and tokens/forward are greyed out; they are not a speed-up when the answer did not finish.</div>')
    if knobs:
        note += f'<div class="fd-knobs-line" data-knobs="on">{esc(knobs)}</div>'
    cls = "fd-meter" + (" fd-stopped" if stopped else "") + ("" if f.complete else " fd-unfinished")
    return f'<div class="{cls}" data-finish="{esc(fin)}">{head}<div class="fd-cards">{body}</div>{note}</div>'


def meters_html(summary: Summary | dict[str, Any] | None, title: str = "", ar: Summary | dict[str, Any] | None = None,
                note: str = "", knobs: str = "") -> str:
    """Meters of a run, plus the AR baseline and the comparison when one is known for the same prompt: time to a
    complete answer, and tokens/s only when both answers finished."""
    if summary is None:
        return '<div class="fd-meter fd-empty">Meters appear when an answer finishes.</div>'
    out = meter_cards(summary, title, knobs=knobs)
    if ar is not None:
        out += meter_cards(ar, "AR baseline (same prompt)")
        out += verdict_html(race_verdict([summary], [ar]), summary, ar)
    if note:
        out += f'<div class="fd-meter-note">{esc(note)}</div>'
    return out


def verdict_html(v: Verdict | None, d: Summary | dict[str, Any] | None = None,
                 a: Summary | dict[str, Any] | None = None) -> str:
    """The race headline: who finished, time to a complete answer; the tokens/s ratio only when both finished."""
    if v is None:
        return ""
    cls = "fd-verdict" + ("" if v.comparable else " fd-verdict-unfinished")
    out = f'<div class="{cls}" data-comparable="{str(v.comparable).lower()}">{esc(v.headline)}</div>'
    if v.comparable and v.speedup is not None and v.speedup_range is not None:
        lo, hi = v.speedup_range
        n = len(v.finished["diffusion"])
        rng = f" (range {lo:.2f}–{hi:.2f}× over {n} interleaved pairs)" if n > 1 else " (one run each)"
        fw = ""
        if d is not None and a is not None:
            fw = f" · {forwards_phrase(int(_as_dict(d)['nfe']), int(_as_dict(a)['nfe']))}"
        out += (f'<div class="fd-ratio">diffusion / AR speed: <b>{v.speedup:.2f}×</b> tokens/s{rng}{fw} · '
                f'engine time, same prompt and max tokens</div>')
    return out


def forwards_phrase(diff_nfe: int, ar_nfe: int) -> str:
    """Diffusion's forwards against AR's, worded the right way round."""
    if diff_nfe == ar_nfe:
        return f"the same number of forwards ({diff_nfe})"
    more = diff_nfe > ar_nfe
    ratio = diff_nfe / max(ar_nfe, 1) if more else ar_nfe / max(diff_nfe, 1)
    return (f"<b>{ratio:.2f}×</b> {'more' if more else 'fewer'} forwards than AR "
            f"({diff_nfe} vs {ar_nfe})")


def _median_run(runs: list[Summary]) -> Summary:
    """The run whose tokens/s is the median (lower middle for an even count): its cards are one real run."""
    return sorted(runs, key=lambda r: r.tokens_per_second)[(len(runs) - 1) // 2]


def race_html(diffs: list[Summary], ars: list[Summary], status: str, knobs: str = "") -> str:
    """Both meters (median run of the repeats, tokens/s range) and the race's verdict: time to a complete answer,
    which side did not finish, and the tokens/s ratio only when both finished. `knobs`: which repetition knobs
    both sides ran with (knobs_summary)."""
    out = [f'<div class="fd-race-status">{esc(status)}</div>']
    if knobs:
        out.append(f'<div class="fd-knobs-line" data-knobs="on">{esc(knobs)}</div>')
    n = min(len(diffs), len(ars))
    if n:
        out.append(verdict_html(race_verdict(diffs, ars), _median_run(diffs[:n]), _median_run(ars[:n])))
    if diffs:
        out.append(meter_cards(_median_run(diffs), f"Fast-dLLM v2 (block diffusion) · {len(diffs)} run(s)",
                               [r.tokens_per_second for r in diffs]))
    if ars:
        out.append(meter_cards(_median_run(ars), f"AR baseline · {len(ars)} run(s)",
                               [r.tokens_per_second for r in ars]))
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
        f = finish_of(summary)  # the live view's badge: complete, capped, looping, ...
        d["sum"]["finish"] = {"label": f.label, "complete": f.complete, "repeat_share": f.repeat_share,
                              "why": finish_phrase(f, summary.answer_tokens)}
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def live_clear(frame: int = 0, message: str = "") -> str:
    return json.dumps({"run": "", "clear": True, "frame": frame, "msg": message}, separators=(",", ":"))
