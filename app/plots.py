"""Plotly figures: the confidence heatmap of one trace and the threshold sweep."""
from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import Trace

MAX_HEATMAP_POSITIONS = 1024
MAX_HEATMAP_STEPS = 2000
_FONT = dict(family="ui-sans-serif, system-ui, sans-serif", size=12, color="#8a8f98")
_GRID = "rgba(128,128,128,0.18)"


# Viridis (perceptually uniform, readable with every common colour-vision deficiency): low confidence dark
# purple, high yellow. static/studio.js uses the same stops for the cells.
VIRIDIS = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")
COLOURSCALE = [[i / (len(VIRIDIS) - 1), c] for i, c in enumerate(VIRIDIS)]
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00")  # Okabe-Ito: colour-blind-safe lines


def visible_piece(text: str) -> str:
    """A token piece with its whitespace made visible and HTML escaped (plotly hover text is HTML-ish)."""
    shown = text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    return html.escape(shown or "∅", quote=True)


def _layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(title=dict(text=html.escape(title), x=0.01, font=dict(size=14)), height=height,
                      margin=dict(l=56, r=16, t=44, b=44), font=_FONT, paper_bgcolor="rgba(0,0,0,0)",
                      plot_bgcolor="rgba(0,0,0,0)", hoverlabel=dict(font_family="ui-monospace, monospace"))
    fig.update_xaxes(gridcolor=_GRID, zeroline=False)
    fig.update_yaxes(gridcolor=_GRID, zeroline=False)
    return fig


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=html.escape(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "", 260)


def heatmap_figure(trace: Trace | None) -> go.Figure:
    """Answer position × decoding step: the best candidate's confidence while masked; commits marked."""
    if trace is None or not trace.events:
        return empty_figure("Send a message (or upload a trace) to see its confidence heatmap.")
    steps = sorted({e.nfe for e in trace.events if e.kind != "done"})[:MAX_HEATMAP_STEPS]
    row = {s: i for i, s in enumerate(steps)}
    width = 0
    for e in trace.events:
        for t in (*e.committed, *e.masked):
            width = max(width, t.pos + 1)
    width = min(width, MAX_HEATMAP_POSITIONS)
    if not width:
        return empty_figure("This trace has no answer tokens.")
    z: list[list[float | None]] = [[None] * width for _ in steps]
    text: list[list[str]] = [[""] * width for _ in steps]
    cx: list[int] = []
    cy: list[int] = []
    ctext: list[str] = []
    for e in trace.events:
        i = row.get(e.nfe)
        if i is None:
            continue
        for t in e.masked:
            if t.pos < width:
                z[i][t.pos], text[i][t.pos] = t.conf, f"masked · best guess {visible_piece(t.text)}"
        for t in e.committed:
            if t.pos < width:
                z[i][t.pos], text[i][t.pos] = t.conf, f"committed {visible_piece(t.text)}"
                cx.append(t.pos + 1)
                cy.append(e.nfe)
                ctext.append(f"{visible_piece(t.text)} · {t.conf:.3f}")
    fig = go.Figure()
    fig.add_trace(go.Heatmap(
        z=z, x=list(range(1, width + 1)), y=steps, customdata=text, zmin=0, zmax=1, colorscale=COLOURSCALE,
        hovertemplate="answer token %{x} · forward %{y}<br>%{customdata}<br>confidence %{z:.3f}<extra></extra>",
        colorbar=dict(title=dict(text="confidence"), thickness=12), xgap=1, ygap=1, hoverongaps=False))
    fig.add_trace(go.Scatter(x=cx, y=cy, mode="markers", name="commit", customdata=ctext,
                             marker=dict(symbol="square-open", size=9, color="#e8413c", line=dict(width=1.5)),
                             hovertemplate="committed at forward %{y}: answer token %{x}<br>%{customdata}"
                                           "<extra></extra>"))
    cfg = trace.header.get("config", {})
    title = f"confidence while masked · {cfg.get('mode', '?')}"
    sub = (f"block {cfg.get('block_size')} / sub-block {cfg.get('sub_block_size')} · "
           f"threshold {cfg.get('threshold')}")
    fig = _layout(fig, title, 440)
    # two short lines just above the plot, clear of plotly's toolbar (top right), which covered one long line on a
    # phone; the config line is escaped as the title is (a trace may be an upload)
    fig.update_layout(title=dict(text=f"{html.escape(title)}<br><sup>{html.escape(sub)}</sup>", yref="paper", y=1,
                                 yanchor="bottom", pad=dict(b=10)), margin=dict(t=84))
    # tick spacing left to plotly, which spaces labels by the axis' drawn length, so a phone's do not overlap (a
    # fixed step of width/16 drew 16 rotated labels on a 250 px axis)
    fig.update_xaxes(title="answer token (1 = first)", tickformat="d")
    fig.update_yaxes(title="forward (NFE, 1 = first)", autorange="reversed", tickformat="d")
    fig.update_layout(showlegend=False)
    return fig


def sweep_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Median tokens/s (bars: the range over repeats) and tokens/forward against threshold, a line per block size.
    Both y-axes start at zero, so differences are not magnified. A point whose answer did not finish (cut at the
    cap, looping: engine/finish.py) is drawn as an open ✕ and says so on hover: its speed is not a speed-up."""
    if not rows:
        return empty_figure("Run a sweep to plot tokens/s and tokens/forward against threshold.")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s (engine time, median and range)",
                                                        "tokens per forward"), horizontal_spacing=0.1)
    for k, bs in enumerate(sorted({r["block_size"] for r in rows})):
        pts = sorted((r for r in rows if r["block_size"] == bs), key=lambda r: r["threshold"])
        colour = PALETTE[k % len(PALETTE)]
        done = [p.get("finish", "complete") == "complete" for p in pts]
        symbols = ["circle" if ok else "x-thin-open" for ok in done]
        notes = ["complete" if ok else f"did not finish ({html.escape(str(p.get('finish')))}): not a speed-up"
                 for ok, p in zip(done, pts)]
        for col, key in ((1, "tokens_per_second"), (2, "tokens_per_forward")):
            err = None
            if key == "tokens_per_second":
                err = dict(type="data", symmetric=False, thickness=1.5, width=4, color=colour,
                           array=[p["tokens_per_second_max"] - p[key] for p in pts],
                           arrayminus=[p[key] - p["tokens_per_second_min"] for p in pts])
            fig.add_trace(go.Scatter(
                x=[p["threshold"] for p in pts], y=[p[key] for p in pts], mode="lines+markers", error_y=err,
                name=f"block {bs}", legendgroup=str(bs), showlegend=col == 1, line=dict(color=colour),
                marker=dict(symbol=symbols, size=[7 if ok else 11 for ok in done], line=dict(width=2, color=colour)),
                customdata=[[p["nfe"], p["answer_tokens"], p["runs"], n] for p, n in zip(pts, notes)],
                hovertemplate=("threshold %{x}<br>%{y:.2f}<br>NFE %{customdata[0]} · %{customdata[1]} tokens · "
                               "%{customdata[2]} run(s)<br>%{customdata[3]}<extra>block " + str(bs) + "</extra>")),
                row=1, col=col)
    unfinished = sum(r.get("finish", "complete") != "complete" for r in rows)
    fig = _layout(fig, (f"✕ = the answer did not finish (cut at the token limit or looping) at {unfinished} of "
                        f"{len(rows)} points: its speed is not a speed-up") if unfinished else "", 400)
    fig.update_xaxes(title="threshold", range=[min(r["threshold"] for r in rows) - 0.05, 1.05])
    fig.update_yaxes(rangemode="tozero")
    return fig
