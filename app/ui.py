"""The Gradio Blocks studio: chat + live denoising view, replay, heatmap, race, sweep, and the named API."""
from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from contextlib import closing
from pathlib import Path
from typing import Any

import gradio as gr

from engine import CACHE_MODES, ConfigError, Event, Result, Trace

from . import api, plots, render
from .api import SLOTS, engine_slots, error
from .card import measured_for
from .settings import BLOCK_SIZES, EXAMPLES, INFO, KNOBS, MAX_NEW_TOKENS, MAX_REPEATS, PRESETS, SWEEP_THRESHOLDS, \
    WIDGET_KEYS, check_repeats, check_seed, defaults, divisors, fit_sub_block, knobs_on, knobs_summary, settings_from_widgets
from .stream import cancel_event, release, request_stop, stop_scope
from .studio import Prepared, Studio
from .traces import MAX_TRACE_BYTES, TraceError, parse_trace, trace_label
from .verdict import finish_record
from engine.runtime import Runtime

STATIC = Path(__file__).resolve().parent.parent / "static"
MAX_SESSION_TRACES = 24
QUEUE_SIZE = 16  # requests waiting for a decoding slot (FASTDLLM_QUEUE_SIZE); one more is refused at once
SWEEP_COLUMNS = ("threshold", "block_size", "sub_block_size", "runs", "tokens_per_second", "tokens_per_second_min",
                 "tokens_per_second_max", "tokens_per_forward", "nfe", "answer_tokens", "seconds", "stop_reason",
                 "finish")

LIVE_TEMPLATE = '<div class="fd-live-root"></div>'
PLAYER_TEMPLATE = '<div class="fd-player-root"></div>'


def _live_js(empty: str) -> str:
    return f"""
const root = element.querySelector('.fd-live-root');
let live = null; const early = [];
watch('value', () => (live ? live.feed(props.value) : early.push(props.value)));
const boot = () => {{
  if (!window.FDStudio) return setTimeout(boot, 30);
  live = root.fdLive = new window.FDStudio.Live(root, server, {json.dumps(empty)});
  if (early.length) early.forEach((v) => live.feed(v)); else live.feed(props.value);
}};
boot();
"""


PLAYER_JS = """
const root = element.querySelector('.fd-player-root');
const boot = () => {
  if (!window.FDStudio) return setTimeout(boot, 30);
  const player = new window.FDStudio.Player(root);
  player.load(props.value);
  watch('value', () => player.load(props.value));
};
boot();
"""


class LiveRuns:
    """Recent live runs' events, so a browser that missed a frame can fetch the gap (bounded memory)."""

    def __init__(self, keep: int = 32):
        self.keep, self.runs, self.lock = keep, OrderedDict(), threading.Lock()

    def start(self) -> str:
        run = uuid.uuid4().hex[:16]
        with self.lock:
            self.runs[run] = []
            while len(self.runs) > self.keep:
                self.runs.popitem(last=False)
        return run

    def extend(self, run: str, events: list[Event]) -> None:
        with self.lock:
            if run in self.runs:
                self.runs[run].extend(e.to_json() for e in events)

    def get(self, run: str, start: int, end: int) -> list[dict]:
        with self.lock:
            return list(self.runs.get(run, [])[max(0, start):max(0, end)])


LIVE_RUNS = LiveRuns()


def live_events(req: dict) -> list[dict]:
    """Server function of the live views ({run, start, end} from the browser): events [start, end) of a run."""
    try:
        return LIVE_RUNS.get(str(req["run"]), int(req["start"]), int(req["end"]))
    except (KeyError, TypeError, ValueError):
        return []


def _save(trace_json: str) -> str:
    """The trace as a file for the download button."""
    f = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="fastdllm-trace-", delete=False, encoding="utf-8")
    with f:
        f.write(trace_json)
    return f.name


def _entry(trace: Trace, traces: list[dict], tag: str, key: str = "") -> list[dict]:
    """The session's trace list with this trace added (newest last, bounded)."""
    text = trace.dumps()
    entry = {"label": trace_label(trace, len(traces) + 1, tag), "json": text, "path": _save(text), "key": key,
             "mode": trace.header.get("config", {}).get("mode")}
    return (traces + [entry])[-MAX_SESSION_TRACES:]


def run_key(request: gr.Request, panel: str) -> str:
    """Whose Stop flag a run uses: a tab's chat, race and sweep may decode at once, and each Stop stops its own."""
    return f"{request.session_hash}:{panel}"


def _key(prep: Prepared) -> str:
    """Runs with the same prompt ids, length budget and repetition knobs are comparable (AR vs diffusion meters)."""
    return f"{hash(tuple(prep.ids))}:{prep.cfg.max_new_tokens}:{sorted(knobs_on(prep.cfg).items())}"


def _replay_outputs(traces: list[dict], index: int) -> tuple[Any, str, Any, Any, str]:
    """dropdown, player value, heatmap, download path, meta line for trace `index` of the session."""
    e = traces[index]
    tr = Trace.loads(e["json"])
    h = tr.header
    cfg = h.get("config", {})
    meta = (f"<b>{render.esc(h.get('model'))}</b> · {render.esc(h.get('device'))} · {render.esc(cfg.get('mode'))} · "
            f"block {render.esc(cfg.get('block_size'))} / sub-block {render.esc(cfg.get('sub_block_size'))} · "
            f"threshold {render.esc(cfg.get('threshold'))} · cache {render.esc(cfg.get('cache'))} · "
            f"{len(tr.events)} events")
    choices = [(t["label"], i) for i, t in enumerate(traces)]
    return (gr.update(choices=choices, value=index), e["json"], plots.heatmap_figure(tr),
            gr.update(value=e["path"], interactive=True), meta)


def build(studio: Studio, slots: int = SLOTS) -> gr.Blocks:
    """The studio's Blocks; `slots` visitors decode at once (their rows batched by the scheduler)."""
    eng = studio.engine
    lm = eng.lm
    d = defaults(eng.can_diffuse, studio.default_block_size)
    measured = measured_for(lm.source.adapter) if eng.can_diffuse else None

    with gr.Blocks(title="Fast-dLLM v2 studio", fill_width=True) as demo:
        gr.HTML(render.banner_html(lm, eng.can_diffuse, "Fast-dLLM v2 studio", measured, d["threshold"]),
                js_on_load=None, elem_id="fd-banner")
        with gr.Accordion("How block diffusion decodes, in 30 seconds", open=True, elem_id="fd-explain-acc"):
            gr.HTML(render.explain_html(), js_on_load=None)
        convo = gr.State([])
        traces = gr.State([])

        with gr.Row(equal_height=False, elem_id="fd-main"):
            with gr.Column(scale=4, min_width=340, elem_id="fd-chat-col"):
                chatbot = gr.Chatbot(label="Chat", height=380, elem_id="fd-chat", buttons=["copy"],
                                     feedback_options=None, examples=[{"text": e} for e in EXAMPLES],
                                     placeholder="Ask something, or pick an example: the answer is decoded block "
                                                 "by block, several tokens per forward when the model is confident.")
                with gr.Row(elem_id="fd-compose"):
                    # no autofocus: it scrolls the page to the box on load (a phone lands mid-page); studio.js
                    # focuses it without scrolling where a keyboard is likely (a fine pointer, a wide window)
                    msg = gr.Textbox(placeholder="Message (Enter sends)", label="Message", show_label=False,
                                     scale=8, lines=1, max_lines=6, elem_id="fd-msg", container=False)
                    send = gr.Button("Send", variant="primary", scale=1, min_width=64, elem_id="fd-send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=64, interactive=False,
                                     elem_id="fd-stop")
                # a refused send says why here, naming the setting; the chat and the message stay as they were
                send_error = gr.HTML("", js_on_load=None, elem_id="fd-send-error")
                with gr.Row(elem_id="fd-preset-row"):
                    preset_btns = [gr.Button(p["label"], size="sm", scale=1, min_width=90,
                                             elem_id=f"fd-preset-{p['id']}", elem_classes=["fd-preset-btn"],
                                             interactive=eng.can_diffuse) for p in PRESETS]
                    clear = gr.Button("Clear chat", size="sm", scale=0, min_width=90, elem_id="fd-clear")
                presets_info = gr.HTML(render.presets_html(PRESETS, measured, d["strategy"], d["threshold"], d["factor"]),
                                       js_on_load=None, elem_id="fd-presets", visible=eng.can_diffuse)
                knobs_info = gr.HTML(render.knobs_html(d), js_on_load=None, elem_id="fd-knobs")
                with gr.Accordion("Decoding settings", open=False, elem_id="fd-settings"):
                    with gr.Row():
                        mode = gr.Radio(["diffusion", "ar"] if eng.can_diffuse else ["ar"], value=d["mode"],
                                        label="mode", info=INFO["mode"], elem_id="fd-mode")
                        cache = gr.Radio(list(CACHE_MODES), value=d["cache"], label="cache",
                                         info=INFO["cache"], elem_id="fd-cache")
                    with gr.Row():
                        block = gr.Dropdown(list(BLOCK_SIZES), value=d["block_size"], label="block size",
                                            info=INFO["block_size"])
                        sub = gr.Dropdown(divisors(d["block_size"]), value=d["sub_block_size"], label="sub-block size",
                                          info=INFO["sub_block_size"])
                    with gr.Row():
                        strategy = gr.Radio(["threshold", "factor"], value=d["strategy"], label="strategy",
                                            info=INFO["strategy"])
                        threshold = gr.Slider(0.05, 1.0, value=d["threshold"], step=0.01, label="threshold",
                                              info=INFO["threshold"], elem_id="fd-threshold")
                        factor = gr.Slider(0.1, 10.0, value=d["factor"], step=0.1, label="factor",
                                           info=INFO["factor"], visible=False)
                    with gr.Row():
                        max_new = gr.Slider(1, MAX_NEW_TOKENS, value=d["max_new_tokens"], step=1,
                                            label="max new tokens", info=INFO["max_new_tokens"], elem_id="fd-max-new")
                        temperature = gr.Slider(0.0, 2.0, value=d["temperature"], step=0.05, label="temperature",
                                                info=INFO["temperature"], elem_id="fd-temperature")
                    with gr.Row():
                        top_p = gr.Slider(0.05, 1.0, value=d["top_p"], step=0.01, label="top-p", info=INFO["top_p"])
                        with gr.Column(min_width=160):
                            # no minimum=: Gradio would refuse -5 only at Send, with its own words; seed_error
                            # says what is allowed as soon as the field changes (check_seed)
                            seed = gr.Number(value=d["seed"], precision=0, label="seed", info=INFO["seed"],
                                             elem_id="fd-seed")
                            seed_error = gr.HTML("", js_on_load=None, elem_id="fd-seed-error")
                    gr.Markdown("**Repetition knobs** (the studio starts with the measured defaults of app/presets.json; applied to every candidate a diffusion "
                                "step scores, and to AR)", elem_id="fd-knobs-head")
                    with gr.Row():
                        rep_pen = gr.Slider(0.5, 2.0, value=d["repetition_penalty"], step=0.05,
                                            label="repetition penalty", info=INFO["repetition_penalty"],
                                            elem_id="fd-repetition-penalty")
                        no_repeat = gr.Number(value=d["no_repeat_ngram_size"], precision=0,
                                              label="no-repeat n-gram size", info=INFO["no_repeat_ngram_size"],
                                              elem_id="fd-no-repeat-ngram-size")
                    with gr.Row():
                        freq_pen = gr.Slider(-2.0, 2.0, value=d["frequency_penalty"], step=0.05,
                                             label="frequency penalty", info=INFO["frequency_penalty"],
                                             elem_id="fd-frequency-penalty")
                        pres_pen = gr.Slider(-2.0, 2.0, value=d["presence_penalty"], step=0.05,
                                             label="presence penalty", info=INFO["presence_penalty"],
                                             elem_id="fd-presence-penalty")
                    stop_guard = gr.Checkbox(value=d["stop_guard"], label="stop guard", info=INFO["stop_guard"],
                                             elem_id="fd-stop-guard")
                    system = gr.Textbox(value=d["system_prompt"], label="system prompt", info=INFO["system_prompt"],
                                        lines=1)
            with gr.Column(scale=6, min_width=340, elem_id="fd-live-col"):
                live = gr.HTML(render.live_clear(), html_template=LIVE_TEMPLATE, elem_id="fd-live",
                               js_on_load=_live_js("Send a message to watch the blocks denoise."),
                               server_functions=[live_events], container=True, padding=True)
                meters = gr.HTML(render.meters_html(None), js_on_load=None, elem_id="fd-meters")

        with gr.Tabs(elem_id="fd-tabs"):
            with gr.Tab("Replay", id="replay", elem_id="fd-tab-replay"):
                with gr.Row():
                    replay_pick = gr.Dropdown(choices=[], label="Answers of this session", scale=4,
                                              info="Every answer keeps its trace (the last "
                                                   f"{MAX_SESSION_TRACES}); pick one to replay without the model.")
                    upload = gr.UploadButton("Upload trace", file_types=[".json"], scale=1, size="md")
                    download = gr.DownloadButton("Download trace", interactive=False, scale=1, size="md")
                replay_meta = gr.HTML("", js_on_load=None, elem_id="fd-replay-meta")
                player = gr.HTML("", html_template=PLAYER_TEMPLATE, js_on_load=PLAYER_JS, elem_id="fd-player",
                                 container=True, padding=True)
            with gr.Tab("Heatmap", id="heatmap", elem_id="fd-tab-heatmap"):
                gr.Markdown("Confidence of each answer position's best candidate at every forward while it was "
                            "masked; squares mark the forward that committed it. Follows the trace picked in Replay.")
                heatmap = gr.Plot(plots.heatmap_figure(None), show_label=False, elem_id="fd-heatmap")
            with gr.Tab("Race", id="race", elem_id="fd-tab-race"):
                gr.Markdown("One prompt decoded by **Fast-dLLM v2 block diffusion** and by the **AR baseline** (same "
                            "base weights, no adapter). The two never run side by side (so neither slows the other), the "
                            "runs **alternate: diffusion, AR, diffusion, AR, …**; the meters show the median run, the "
                            "tokens/s range over the repeats, all on engine time.")
                with gr.Row():
                    race_msg = gr.Textbox(value=EXAMPLES[1], label="Prompt to race", show_label=False, scale=6, placeholder="Prompt to race",
                                          elem_id="fd-race-msg")
                    race_reps = gr.Slider(1, MAX_REPEATS, value=3, step=1, label="runs each", scale=2,
                                          elem_id="fd-race-reps")
                    race_btn = gr.Button("Race", variant="primary", scale=1, interactive=eng.can_diffuse,
                                         elem_id="fd-race")
                    race_stop = gr.Button("Stop", variant="stop", scale=1, elem_id="fd-race-stop")
                race_meters = gr.HTML(render.race_html([], [], "Press Race: diffusion and AR alternate." if
                                                       eng.can_diffuse else "Race needs the Fast-dLLM v2 adapter."),
                                      js_on_load=None, elem_id="fd-race-meters")
                with gr.Row(equal_height=False):
                    with gr.Column():
                        gr.Markdown("**Fast-dLLM v2** (block diffusion)")
                        race_d = gr.HTML(render.live_clear(), html_template=LIVE_TEMPLATE, js_on_load=_live_js(
                            "Diffusion decoding appears here."), server_functions=[live_events], container=True,
                            padding=True, elem_id="fd-race-d")
                    with gr.Column():
                        gr.Markdown("**AR baseline** (one token per forward)")
                        race_ar = gr.HTML(render.live_clear(), html_template=LIVE_TEMPLATE, js_on_load=_live_js(
                            "AR decoding appears here."), server_functions=[live_events], container=True,
                            padding=True, elem_id="fd-race-ar")
            with gr.Tab("Sweep", id="sweep", elem_id="fd-tab-sweep"):
                gr.Markdown("One prompt across thresholds (and block sizes), threshold strategy, the other settings "
                            "as in Decoding settings: how tokens/s and tokens per forward move with the threshold. "
                            "Each point is the median of its runs; bars show the tokens/s range.")
                with gr.Row():
                    sweep_msg = gr.Textbox(value=EXAMPLES[0], label="Prompt to sweep", show_label=False, scale=4, placeholder="Prompt to sweep",
                                           elem_id="fd-sweep-msg")
                    sweep_th = gr.CheckboxGroup(list(SWEEP_THRESHOLDS), value=[0.5, 0.7, 0.9, 1.0], label="thresholds",
                                                scale=3)
                    sweep_bs = gr.CheckboxGroup(list(BLOCK_SIZES), value=[d["block_size"]], label="block sizes",
                                                scale=2)
                    sweep_reps = gr.Slider(1, MAX_REPEATS, value=2, step=1, label="runs per point", scale=2)
                with gr.Row():
                    sweep_btn = gr.Button("Run sweep", variant="primary", interactive=eng.can_diffuse,
                                          elem_id="fd-sweep")
                    sweep_stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="fd-sweep-stop")
                sweep_status = gr.HTML("", js_on_load=None, elem_id="fd-sweep-status")
                sweep_plot = gr.Plot(plots.sweep_figure([]), show_label=False, elem_id="fd-sweep-plot")
                sweep_table = gr.Dataframe(headers=list(SWEEP_COLUMNS), interactive=False, label="runs")

        knob_widgets = [rep_pen, freq_pen, pres_pen, no_repeat, stop_guard]
        widgets = [mode, block, sub, threshold, strategy, factor, cache, max_new, temperature, top_p, seed, system,
                   *knob_widgets]
        assert len(widgets) == len(WIDGET_KEYS)
        private = dict(api_visibility="private", queue=False)

        def at_once(check: Any, said: Any = render.field_error) -> Any:
            """A run's input check outside the engine's queue (a second listener on the same click, queue=False): a
            bad message, seed or threshold list is said beside its field at once, not after the decodes queued ahead
            of it (on a shared Space, other users' answers). A good input changes nothing here: the queued handler,
            which checks again, starts the run."""
            def run(*args: Any) -> Any:
                try:
                    check(*args)
                except ConfigError as e:
                    return said(e)
                return gr.update()
            return run

        # ------------------------------------------------------------------ settings plumbing (not API)
        block.change(lambda bs, s: gr.update(choices=divisors(int(bs)), value=fit_sub_block(int(bs), s)),
                     [block, sub], sub, **private)
        strategy.change(lambda s: (gr.update(visible=s == "threshold"), gr.update(visible=s == "factor")),
                        strategy, [threshold, factor], **private)
        gr.on([threshold.change, strategy.change, factor.change],
              lambda s, t, f: render.presets_html(PRESETS, measured, s, float(t), float(f)),
              [strategy, threshold, factor], presets_info, **private)
        for p, b in zip(PRESETS, preset_btns):  # a preset sets its rule and value, and any repetition knob it lists
            b.click(lambda p=p: (gr.update(value=p["settings"].get("strategy", "threshold")),
                                 *(gr.update(value=p["settings"][k]) if k in p["settings"] else gr.skip()
                                   for k in ("threshold", "factor")),
                                 gr.update(value="diffusion"),
                                 *(gr.update(value=p["settings"][k]) if k in p["settings"] else gr.skip()
                                   for k in KNOBS)),
                    None, [strategy, threshold, factor, mode, *knob_widgets], **private)
        def seed_check(v: Any) -> str:
            try:
                check_seed(v)
            except ConfigError as e:
                return render.field_error(e)
            return ""

        seed.change(seed_check, seed, seed_error, **private)
        gr.on([w.change for w in knob_widgets], lambda *v: render.knobs_html(dict(zip(KNOBS, v))), knob_widgets,
              knobs_info, **private)

        # ------------------------------------------------------------------ streaming one decode into a live view
        def live_run(prep: Prepared, key: str, view: gr.HTML, first: dict | None = None, extra=None,
                     scoped: bool = False):
            """Yield output dicts while decoding (the live view gets only new events); return (result, last frame).

            `first` joins the first frame; `extra(events)` adds outputs to each frame (the chat bubble);
            `scoped`: the caller holds a stop_scope for the key (several runs, one Stop), so no flag of its own.
            """
            flag = None if scoped else cancel_event(key)
            run, seq, frame, result = LIVE_RUNS.start(), 0, 0, None
            out = {**(first or {}), **(extra([]) if extra else {}),
                   view: render.live_payload(run, 0, [], header=studio.header(prep))}
            yield out
            try:
                with closing(studio.stream(prep, key)) as frames:  # closed (tab gone): the engine stops
                    for events, res in frames:
                        result = res or result
                        if not events:
                            continue
                        LIVE_RUNS.extend(run, events)
                        frame += 1
                        yield {**(extra(events) if extra else {}),
                               view: render.live_payload(run, seq, events, frame=frame)}
                        seq += len(events)
            except ConfigError as e:
                raise error(e) from None
            except Exception as e:  # an engine failure: say so; the conversation is kept
                raise gr.Error(f"decoding failed: {e}") from e
            finally:
                if flag is not None:
                    release(key, flag)
            assert result is not None and result.trace is not None
            return result, render.live_payload(run, seq, [], summary=result.summary, frame=frame + 1)

        # ------------------------------------------------------------------ chat
        chat_outputs = [msg, chatbot, convo, live, meters, traces, replay_pick, player, heatmap, download, replay_meta,
                        send, stop, send_error]

        def chat_ui(request: gr.Request, message: str, conv: list, trs: list, *values: Any):
            try:
                prep = studio.prepare(message, conv, settings_from_widgets(*values))
            except ConfigError as e:  # said beside the message box; a raised gr.Error would blank the whole chat
                yield {send_error: render.field_error(e)}
                return
            user = {"role": "user", "content": message}
            answer = ""

            def bubble(events: list[Event]) -> dict:
                nonlocal answer
                delta = "".join(e.text_delta for e in events)
                answer += delta
                shown = answer or "…"  # plain growth: Gradio then streams the bubble as appends
                return {chatbot: render.chat_display(conv + [user, {"role": "assistant", "content": shown}])} \
                    if delta or not events else {}

            start = {msg: "", send: gr.update(interactive=False), stop: gr.update(interactive=True), send_error: ""}
            result, last = yield from live_run(prep, run_key(request, "chat"), live, start, bubble)
            stopped = result.summary.stop_reason == render.STOPPED
            reply = {"role": "assistant", "content": result.text, **({"stopped": True} if stopped else {}),
                     "finish": finish_record(result.summary)}
            new_conv = conv + [user, reply]
            new_trs = _entry(result.trace, trs, "chat · ", _key(prep))
            ar = None
            if prep.cfg.mode == "diffusion":
                ar = next((Trace.loads(t["json"]).summary for t in reversed(new_trs)
                           if t["key"] == _key(prep) and t["mode"] == "ar"), None)
            note = "" if ar or prep.cfg.mode == "ar" else \
                "Race this prompt (Race tab) or send it in AR mode to compare."
            pick, pl, hm, dl, meta = _replay_outputs(new_trs, len(new_trs) - 1)
            yield {chatbot: render.chat_display(new_conv), convo: new_conv, live: last,
                   meters: render.meters_html(result.summary, f"{prep.cfg.mode} · engine time", ar, note,
                                              knobs=knobs_summary(prep.cfg)),
                   traces: new_trs, replay_pick: pick, player: pl, heatmap: hm, download: dl, replay_meta: meta}

        chat_args = ([msg, convo, traces, *widgets], chat_outputs)
        idle = (lambda: (gr.update(interactive=True), gr.update(interactive=False)), None, [send, stop])
        quiet = dict(api_visibility="private", show_progress="hidden", **engine_slots(slots))  # the live view shows progress
        # the check first: Gradio's page sends a trigger's listeners one after another in the order they were
        # added, each after the previous one has finished, so a check added after the queued run would wait for it
        gr.on([msg.submit, send.click], at_once(lambda m, c, t, *v: studio.prepare(m, c, settings_from_widgets(*v))),
              chat_args[0], send_error, **private)
        gr.on([msg.submit, send.click], chat_ui, *chat_args, **quiet).then(*idle, **private)

        def pick_example(e: gr.SelectData) -> str:
            return e.value["text"]

        # the examples shown in the empty chat: a click sends that message
        chatbot.example_select(pick_example, None, msg, **private).then(chat_ui, *chat_args, **quiet).then(
            *idle, **private)

        def stopper(panel: str):
            def stop_run(request: gr.Request) -> None:
                request_stop(run_key(request, panel))
            return stop_run

        for b, panel in ((stop, "chat"), (race_stop, "race"), (sweep_stop, "sweep")):
            b.click(stopper(panel), None, None, **private)

        # every way of clearing (our button, the chatbot's own trash icon) empties the conversation state too
        def clear_chat():
            return [], [], render.live_clear(message="Cleared."), render.meters_html(None), ""

        for ev in (clear.click, chatbot.clear):
            ev(clear_chat, None, [chatbot, convo, live, meters, msg], **private)

        # ------------------------------------------------------------------ replay
        replay_outputs = [replay_pick, player, heatmap, download, replay_meta]

        def pick_trace(i: Any, trs: list):
            if i is None or not trs or not isinstance(i, int) or not 0 <= i < len(trs):
                return [gr.skip()] * len(replay_outputs)
            return _replay_outputs(trs, i)

        replay_pick.input(pick_trace, [replay_pick, traces], replay_outputs, api_visibility="private")

        def upload_trace(path: str | None, trs: list):
            try:
                if not path:
                    raise TraceError("trace: no file received")
                p = Path(path)
                if p.stat().st_size > MAX_TRACE_BYTES:
                    raise TraceError(f"trace: file is larger than {MAX_TRACE_BYTES // 2**20} MiB")
                tr = parse_trace(p.read_bytes())
            except TraceError as e:
                gr.Warning(str(e), title="Trace rejected")
                return [trs, *[gr.skip()] * (len(replay_outputs) - 1),
                        f'<span class="fd-note">Trace rejected: {render.esc(e)}</span>']
            new_trs = _entry(tr, trs, "uploaded · ")
            return [new_trs, *_replay_outputs(new_trs, len(new_trs) - 1)]

        upload.upload(upload_trace, [upload, traces], [traces, *replay_outputs], api_visibility="private")

        # ------------------------------------------------------------------ race
        race_outputs = [race_meters, race_d, race_ar, traces, replay_pick, player, heatmap, download, replay_meta,
                        race_btn]

        def race_ui(request: gr.Request, message: str, reps: Any, trs: list, *values: Any):
            try:
                preps = studio.race_preps(message, settings_from_widgets(*values))
                reps = check_repeats(reps)
            except ConfigError as e:  # inline, above the race's views: they keep the last race
                yield {race_meters: render.race_html([], [], "Not started.") + render.field_error(e)}
                return
            runs: dict[str, list[Result]] = {"diffusion": [], "ar": []}
            views = {"diffusion": race_d, "ar": race_ar}
            # one stop flag for all the runs, made before the first frame: a Stop between two runs is kept
            with stop_scope(run_key(request, "race")):
                yield {race_btn: gr.update(interactive=False), race_d: render.live_clear(message="Starting…"),
                       race_ar: render.live_clear(message="Runs after each diffusion run."),
                       race_meters: render.race_html([], [], f"Run 1/{reps}: Fast-dLLM v2…")}
                stopped = False
                for n in range(reps):
                    for prep in preps:
                        mode = prep.cfg.mode
                        result, last = yield from live_run(prep, run_key(request, "race"), views[mode], scoped=True)
                        runs[mode].append(result)
                        stopped = result.summary.stop_reason == render.STOPPED
                        if stopped:
                            which = "the diffusion" if mode == "diffusion" else "the AR"
                            status = f"Stopped during {which} run {n + 1}."
                        elif mode == "diffusion":
                            status = f"Run {n + 1}/{reps}: AR baseline…"
                        elif n + 1 < reps:
                            status = f"Run {n + 2}/{reps}: Fast-dLLM v2…"
                        else:
                            status = f"Done: {reps} interleaved run(s) each."
                        out = {views[mode]: last, race_meters: render.race_html(
                            [r.summary for r in runs["diffusion"]], [r.summary for r in runs["ar"]], status,
                            knobs_summary(prep.cfg))}
                        if stopped and mode == "diffusion" and not runs["ar"]:
                            out[race_ar] = render.live_clear(message="Not run: the race was stopped during the "
                                                                     "diffusion run.")
                        yield out
                        if stopped:
                            break
                    if stopped:
                        break
            new_trs = trs
            for r in (x for pair in zip(runs["diffusion"], runs["ar"] + [None]) for x in pair if x is not None):
                new_trs = _entry(r.trace, new_trs, "race · ", _key(preps[0]))
            yield {traces: new_trs, **dict(zip(replay_outputs, _replay_outputs(new_trs, len(new_trs) - 1)))}

        race_btn.click(at_once(lambda m, r, *v: (studio.race_preps(m, settings_from_widgets(*v)), check_repeats(r)),
                               lambda e: render.race_html([], [], "Not started.") + render.field_error(e)),
                       [race_msg, race_reps, *widgets], race_meters, **private)  # first: see the chat's check
        race_btn.click(race_ui, [race_msg, race_reps, traces, *widgets], race_outputs, **quiet).then(
            lambda: gr.update(interactive=True), None, race_btn, **private)

        # ------------------------------------------------------------------ sweep
        def sweep_ui(request: gr.Request, message: str, ths: list, bss: list, reps: Any, *values: Any):
            try:
                plan = studio.sweep_plan(message, ths, bss, settings_from_widgets(*values))
                reps = check_repeats(reps)
            except ConfigError as e:  # inline: the plot and table keep the last sweep
                yield {sweep_status: render.field_error(e)}
                return
            key, rows = run_key(request, "sweep"), []
            total = len(plan) * reps
            with stop_scope(key):  # one flag for the whole sweep, before Stop is enabled: none lost between points
                knobs = render.knobs_html(plan[0].cfg.to_dict()) if knobs_on(plan[0].cfg) else ""

                def progress(i: int, k: int, t0: float, text: str = "") -> str:
                    return render.sweep_progress(i, len(plan), k, reps, plan[i].cfg.threshold,
                                                 plan[i].cfg.block_size, time.perf_counter() - t0, len(text)) + knobs

                t0 = time.perf_counter()
                yield {sweep_btn: gr.update(interactive=False, value=f"Running 0/{total}…"),
                       sweep_stop: gr.update(interactive=True), sweep_status: progress(0, 0, t0)}
                for i, prep in enumerate(plan):
                    results: list[Result] = []
                    for k in range(reps):
                        res, t0, shown = None, time.perf_counter(), 0.0
                        if i or k:
                            yield {sweep_status: progress(i, k, t0)}
                        try:
                            with closing(studio.steps(prep, key)) as steps:
                                for x in steps:
                                    if isinstance(x, Result):
                                        res = x
                                    elif time.perf_counter() - shown >= 0.5:  # the status, twice a second
                                        shown = time.perf_counter()
                                        yield {sweep_status: progress(i, k, t0, x)}
                                    else:  # an empty frame: a closed tab ends the generator here, within one forward
                                        yield gr.skip()
                        except Exception as e:
                            raise gr.Error(f"decoding failed: {e}") from e
                        assert res is not None
                        if res.summary.stop_reason == render.STOPPED:
                            yield {sweep_status: f'<div class="fd-stopped-note">Stopped after {len(rows)} of '
                                                 f'{len(plan)} points: the plot shows the finished ones.</div>'}
                            return
                        results.append(res)
                        yield {sweep_btn: gr.update(value=f"Running {i * reps + k + 1}/{total}…")}
                    rows.append(studio.sweep_row(prep, results))
                    yield {sweep_plot: plots.sweep_figure(rows),
                           sweep_table: [[r[c] for c in SWEEP_COLUMNS] for r in rows]}
                yield {sweep_status: f'<div class="fd-sweep-progress" role="status">Done: {len(plan)} point(s), '
                                     f'{reps} run(s) each.</div>{knobs}'}

        sweep_btn.click(at_once(lambda m, t, b, r, *v: (studio.sweep_plan(m, t, b, settings_from_widgets(*v)),
                                                        check_repeats(r))),
                        [sweep_msg, sweep_th, sweep_bs, sweep_reps, *widgets], sweep_status, **private)  # first
        sweep_btn.click(sweep_ui, [sweep_msg, sweep_th, sweep_bs, sweep_reps, *widgets],
                        [sweep_plot, sweep_table, sweep_btn, sweep_stop, sweep_status], **quiet).then(
            lambda: (gr.update(interactive=True, value="Run sweep"), gr.update(interactive=False)), None,
            [sweep_btn, sweep_stop], **private)

        api.register(studio, d, slots)
    return demo


def queue_kwargs(max_size: int | None = None) -> dict[str, Any]:
    """The queue's bound: `max_size` requests may wait (else FASTDLLM_QUEUE_SIZE, else QUEUE_SIZE); one more is
    refused at once with Gradio's "queue is full" / "currently busy" message. Waiting clients see their position."""
    if max_size is None:
        max_size = Runtime.from_env().queue_size or QUEUE_SIZE
    if max_size < 1:
        raise ValueError(f"the queue size must be at least 1 (got {max_size})")
    return {"max_size": max_size}


def launch_kwargs() -> dict[str, Any]:
    """css / head / theme for launch() (Gradio 6 takes them there, not in Blocks)."""
    js = (STATIC / "studio.js").read_text(encoding="utf-8")
    # indigo accent on slate: the banner, the active sub-block and the buttons share it; dark surfaces are
    # stepped (page < panel < card) so panels read as panels in both themes
    theme = gr.themes.Soft(primary_hue="indigo", secondary_hue="indigo", neutral_hue="slate", radius_size="md",
                           font=["ui-sans-serif", "system-ui", "sans-serif"],
                           font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]).set(
        body_background_fill="*neutral_50", body_background_fill_dark="#0b1120",
        block_background_fill_dark="*neutral_900", background_fill_secondary_dark="#141c2f",
        block_border_width="1px", block_shadow="0 1px 2px rgba(15, 23, 42, 0.06)", block_shadow_dark="none")
    return {"css": (STATIC / "studio.css").read_text(encoding="utf-8"), "head": f"<script>{js}</script>",
            "theme": theme, "footer_links": ["api", "gradio"], "max_file_size": MAX_TRACE_BYTES + 2**20}
