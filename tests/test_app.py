"""The studio through its named API (gradio_client) and its HTML renderers, on the bundled default model."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app import plots, render
from app.card import front_matter, measured_for
from app.settings import BLOCK_SIZES, MAX_NEW_TOKENS, divisors, fit_sub_block, to_config
from app.traces import settings_label
from app.stream import cancel_event, decode_stream, release, request_stop
from app.traces import MAX_TRACE_BYTES, TraceError, parse_trace
from conftest_app import QUICK
from engine import Summary, Token, Trace
from engine.events import Event

XSS = "<img src=x onerror=alert(1)>"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def turn(client, server):
    """One chat turn through /generate: (answer text, trace JSON)."""
    return client.predict("What is the capital of France?", [], {**QUICK, "mode": server.mode}, api_name="/generate")


# ---------------------------------------------------------------- API
def test_api_lists_named_endpoints_only_with_types(client):
    api = client.view_api(return_format="dict", print_info=False)
    assert set(api["named_endpoints"]) == {"/generate", "/race", "/sweep", "/check_trace", "/info"}
    assert not api["unnamed_endpoints"]  # UI plumbing is private
    for name, ep in api["named_endpoints"].items():  # every output has a type, not "Any"
        assert ep["returns"] and all(r["python_type"]["type"] != "Any" for r in ep["returns"]), name
    assert api["named_endpoints"]["/sweep"]["returns"][0]["type"]["items"]["properties"]["tokens_per_second_min"]


def test_chat_turn_returns_text_and_trace(turn, server):
    text, trace_json = turn
    trace = Trace.loads(trace_json)
    assert isinstance(text, str) and trace.summary is not None
    assert trace.summary.text == text
    assert 1 <= trace.summary.answer_tokens <= QUICK["max_new_tokens"]
    assert trace.header["config"]["mode"] == server.mode
    assert trace.header["prompt"] == "What is the capital of France?"
    assert trace.events[-1].kind == "done"
    committed = sorted(t.pos for e in trace.events for t in e.committed)
    assert committed[: trace.summary.answer_tokens] == list(range(trace.summary.answer_tokens))


def test_multi_turn_history_is_in_the_prompt(client, server, turn):
    text, first = turn
    history = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": text}]
    _, second = client.predict("And of Italy?", history, {**QUICK, "mode": server.mode, "max_new_tokens": 8},
                               api_name="/generate")
    assert Trace.loads(second).header["prompt_len"] > Trace.loads(first).header["prompt_len"]


def test_every_cache_choice_of_the_ui_decodes_through_the_api(client, server):
    """The cache radio offers engine.CACHE_MODES; the newest, dual-sparse, goes through /generate like the others and
    its trace says so."""
    from engine import CACHE_MODES

    assert "dual-sparse" in CACHE_MODES
    text, trace_json = client.predict("What is the capital of France?", [],
                                      {**QUICK, "mode": server.mode, "cache": "dual-sparse", "max_new_tokens": 12},
                                      api_name="/generate")
    trace = Trace.loads(trace_json)
    assert trace.summary.text == text and trace.summary.answer_tokens >= 1
    assert server.mode == "diffusion" and trace.header["config"]["cache"] == "dual-sparse"


@pytest.mark.parametrize("settings, field, words", [
    ({"block_size": 32, "sub_block_size": 5}, "sub_block_size", "divide"),
    ({"threshold": 0}, "threshold", "(0, 1]"),
    ({"cache": "huge"}, "cache", "none, block, dual"),
    ({"blocksize": 32}, "blocksize", "unknown setting"),
    ({"block_size": 12, "sub_block_size": 4}, "block_size", "one of 8, 16, 32, 64"),  # the UI's choices
    ({"max_new_tokens": 4096}, "max_new_tokens", f"[1, {MAX_NEW_TOKENS}]"),  # the UI's slider range
])
def test_bad_settings_give_a_clear_error_naming_the_field(client, settings, field, words):
    with pytest.raises(Exception) as err:
        client.predict("hi", [], settings, api_name="/generate")
    msg = str(err.value)
    assert msg.startswith(f"{field}:") and words in msg, msg
    assert "Traceback" not in msg


def test_bad_history_is_rejected(client):
    with pytest.raises(Exception, match="history"):
        client.predict("hi", [{"role": "wizard", "content": "x"}], {**QUICK, "mode": "ar"}, api_name="/generate")


def test_race_and_sweep(client, server):
    if not server.engine.can_diffuse:
        with pytest.raises(Exception, match="mode"):
            client.predict("Hi", {"max_new_tokens": 8}, api_name="/race")
        pytest.skip("no Fast-dLLM v2 adapter: race and sweep need block diffusion")
    race = client.predict("Hi", {"max_new_tokens": 8}, 2, api_name="/race")
    assert race["order"].startswith("interleaved") and race["repeats"] == 2
    assert [len(race["runs"][m]) for m in ("diffusion", "ar")] == [2, 2]
    assert race["ar"]["tokens_per_forward"] == pytest.approx(1.0)
    ratios = sorted(d["tokens_per_second"] / a["tokens_per_second"] for d, a in zip(*race["runs"].values()))
    if race["comparable"]:  # tokens/s is compared only when every answer of both sides finished
        assert race["speedup"] == pytest.approx(sum(ratios) / 2)  # the median of two
        assert race["speedup_range"] == pytest.approx(ratios)
    else:
        assert race["speedup"] is None and "did not finish" in race["headline"]
    rows = client.predict("Hi", [0.5, 1.0], [16], {"max_new_tokens": 8}, 2, api_name="/sweep")
    assert [(r["threshold"], r["block_size"], r["runs"]) for r in rows] == [(0.5, 16, 2), (1.0, 16, 2)]
    for r in rows:
        assert 0 < r["tokens_per_second_min"] <= r["tokens_per_second"] <= r["tokens_per_second_max"] and r["nfe"] > 0
    assert client.predict("Hi", {"max_new_tokens": 4}, api_name="/race")["repeats"] == 1  # repeats is optional
    with pytest.raises(Exception, match=r"repeats: must be an integer in \[1, 5\]"):
        client.predict("Hi", {"max_new_tokens": 8}, 9, api_name="/race")


def test_one_rule_set_for_ui_and_api(server):
    """The UI's widgets go through the same to_config as the API: the same block sizes and token budget."""
    from app.settings import settings_from_widgets
    from engine import ConfigError

    eng = server.engine
    for bs in BLOCK_SIZES:
        assert to_config(eng, {"block_size": bs, "sub_block_size": 8 if bs >= 8 else bs})[0].block_size == bs
    widget_values = ["diffusion", 12.0, 4.0, 0.9, "threshold", 1.0, "dual", 64.0, 0.0, 1.0, -1, ""]
    with pytest.raises(ConfigError, match="block_size"):
        to_config(eng, settings_from_widgets(*widget_values))
    assert to_config(eng, {"max_new_tokens": float(MAX_NEW_TOKENS)})[0].max_new_tokens == MAX_NEW_TOKENS


def test_info(client, server):
    info = client.predict(api_name="/info")
    assert info["banner"] == server.engine.lm.banner()
    assert info["can_diffuse"] == server.engine.can_diffuse
    assert info["limits"] == {"block_sizes": list(BLOCK_SIZES), "max_new_tokens": MAX_NEW_TOKENS, "repeats": 5}


# ---------------------------------------------------------------- what the page says about the model and the speed
def test_model_card_numbers_are_the_measured_ones(engine):
    """The banner/presets read the card's front matter; it must match the benchmark file it cites, and apply only
    to the adapter it describes."""
    m = measured_for(engine.lm.source.adapter)
    assert m is not None
    results = json.loads((ROOT / m.source).read_text())["results"]
    ar = next(r for r in results if r["mode"] == "ar")
    assert m.ar_accuracy == pytest.approx(ar["accuracy"], abs=5e-4)
    diff = {r["threshold"]: r for r in results if r["mode"] == "diffusion"}
    assert set(m.by_threshold) == set(diff)
    for th, (acc, tpf) in m.by_threshold.items():
        assert acc == pytest.approx(diff[th]["accuracy"], abs=5e-4)
        assert tpf == pytest.approx(diff[th]["long_tokens_per_forward"], abs=5e-4)
    assert str(front_matter()["adapter_step"]) == json.loads((ROOT / m.source).read_text())["environment"][
        "adapter_meta"]["step"]


def test_card_numbers_are_not_lent_to_another_adapter(tmp_path):
    import torch
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(other), metadata={"format": "fastdllm-adapter-v1", "step": "7"})
    assert measured_for(other) is None and measured_for(None) is None


def test_banner_and_presets_say_what_was_measured(engine):
    m = measured_for(engine.lm.source.adapter)
    banner = render.banner_html(engine.lm, True, "t", m, 0.9)
    acc, tpf = m.at(0.9)
    assert f"{tpf:.2f} tokens per forward" in banner and f"{100 * acc / m.ar_accuracy:.0f}% of its AR base" in banner
    assert "arxiv.org/abs/2509.26328" in banner
    assert "weights</span>" not in banner  # fp32 weights: the dtype chip says it all
    from dataclasses import replace

    lm4 = replace(engine.lm, info={**engine.lm.info, "weights": "int4+bf16"})  # the CPU default's banner
    assert ">int4+bf16 weights</span>" in render.banner_html(lm4, True, "t", m, 0.9)
    from app.settings import PRESETS

    assert [(p["settings"]["strategy"], p["settings"].get("threshold", p["settings"].get("factor")))
            for p in PRESETS] == [("threshold", 1.0), ("threshold", 0.9), ("factor", 0.5), ("threshold", 0.7)]
    fast = render.presets_html(PRESETS, m, "threshold", 0.7)
    assert "Fast" in fast and f"{m.at(0.7)[1]:.2f} tokens/forward" in fast
    assert "Custom threshold 0.85" in render.presets_html(PRESETS, m, "threshold", 0.85)
    # the factor preset by its factor (measured in bench/results/studio_factor), whatever the threshold slider says
    factor = render.presets_html(PRESETS, m, "factor", 0.9, 0.5)
    assert 'data-preset="factor"' in factor and "Factor · 0.5" in factor and "tokens/forward," not in factor
    assert "data-preset" not in render.presets_html(PRESETS, m, "factor", 0.9, 1.0)  # another factor: no preset
    assert 'data-preset="paper"' not in render.presets_html(PRESETS, m, "factor", 0.9, 0.5)


def test_forwards_are_worded_the_right_way_round():
    def s(nfe: int, tps: float) -> Summary:
        return Summary(answer_tokens=17, nfe=nfe, tokens_per_forward=17 / nfe, seconds=1.0, tokens_per_second=tps,
                       ttft=0.1, stop_reason="stop_token", text="x", token_ids=[])

    more = render.race_html([s(18, 3.0)], [s(17, 6.0)], "done")
    assert "1.06×</b> more forwards than AR (18 vs 17)" in more and "fewer" not in more
    fewer = render.race_html([s(9, 6.0)], [s(18, 3.0)], "done")
    assert "2.00×</b> fewer forwards than AR (9 vs 18)" in fewer
    spread = render.race_html([s(9, 6.0), s(9, 2.0), s(9, 4.0)], [s(18, 2.0)] * 3, "done")
    assert "<b>2.00×</b> tokens/s (range 1.00–3.00× over 3 interleaved pairs)" in spread
    assert "2.0–6.0" in spread  # the diffusion tokens/s range


def test_stopped_answers_say_so():
    shown = render.chat_display([{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "partial", "stopped": True}])
    assert shown[1]["content"].startswith("partial") and "stopped" in shown[1]["content"]
    assert 'data-k="stop"' in render.meters_html(_summary("cancelled")) and ">stopped<" in \
        render.meters_html(_summary("cancelled"))


def test_replay_labels_name_every_differing_setting():
    from engine import DecodeConfig

    base = DecodeConfig().to_dict()
    assert settings_label(base) == "diffusion · block 32/8 · threshold 0.9"
    assert settings_label({**base, "cache": "block"}) == "diffusion · block 32/8 · threshold 0.9 · cache block"
    assert settings_label({**base, "mode": "ar", "cache": "block", "temperature": 0.5}) == "ar · temperature 0.5"


def test_plots_start_at_zero_and_count_from_one():
    rows = [{"threshold": t, "block_size": 32, "sub_block_size": 8, "runs": 2, "tokens_per_second": 5.0 + t,
             "tokens_per_second_min": 4.0, "tokens_per_second_max": 7.0, "tokens_per_forward": 1.0 + t, "nfe": 10,
             "answer_tokens": 12, "seconds": 1.0, "stop_reason": "stop_token"} for t in (0.5, 0.9)]
    fig = plots.sweep_figure(rows)
    assert fig.layout.yaxis.rangemode == "tozero" and fig.layout.yaxis2.rangemode == "tozero"
    assert list(fig.data[0].error_y.arrayminus) == pytest.approx([1.5, 1.9])
    heat = plots.heatmap_figure(_xss_trace())
    assert min(heat.data[0].x) == 1 and min(heat.data[1].x) == 1  # answer token 1 is the first


def test_check_trace_endpoint(client, turn):
    ok = client.predict(turn[1], api_name="/check_trace")
    assert ok["events"] == len(Trace.loads(turn[1]).events)
    with pytest.raises(Exception, match="not valid JSON"):
        client.predict("{nope", api_name="/check_trace")


# ---------------------------------------------------------------- stop
def test_stop_cancels_within_one_forward(server):
    eng = server.engine
    cfg, _ = to_config(eng, {"mode": server.mode, "max_new_tokens": 64, "threshold": 1.0})
    ids = eng.encode(eng.chat_prompt([{"role": "user", "content": "Count from one to fifty."}]))
    flag = cancel_event("test-stop")
    after, result = [], None
    try:
        for events, res in decode_stream(ids, cfg, "count", "test-stop", frame=0):
            result = res or result
            if flag.is_set():
                after.extend(e for e in events if e.kind != "done")
            elif any(e.kind == "step" for e in events):
                assert request_stop("test-stop")
    finally:
        release("test-stop", flag)
    assert result is not None and result.summary.stop_reason == "cancelled"
    assert len(after) <= 1  # at most the forward that was already running
    assert result.summary.answer_tokens < 64


def test_a_stop_between_two_runs_of_a_sweep_stops_the_next(server):
    """Race and sweep hold one stop flag for all their runs: a Stop that lands between two runs (the old
    per-run flags had none then, and it was lost) stops the next run at its first forward."""
    from app.stream import stop_scope

    eng = server.engine
    cfg, _ = to_config(eng, {"mode": server.mode, "max_new_tokens": 64, "threshold": 1.0})
    ids = eng.encode(eng.chat_prompt([{"role": "user", "content": "Count from one to fifty."}]))
    with stop_scope("test-scope"):
        first = [res for _, res in decode_stream(ids, cfg, "count", "test-scope", frame=0) if res][-1]
        assert request_stop("test-scope")  # between the runs
        second = [res for _, res in decode_stream(ids, cfg, "count", "test-scope", frame=0) if res][-1]
    assert first.summary.stop_reason != "cancelled" and second.summary.stop_reason == "cancelled"
    assert second.summary.nfe <= 1
    assert not request_stop("test-scope")  # the scope is over: nothing runs under the key


def test_stream_batches_fast_engines_into_frames(monkeypatch):
    """A fast engine (1000 forwards/s) reaches the UI in ~30 frames/s, every event once, in order."""
    import time

    from app import stream
    from engine import Result

    class FastEngine:
        def generate_ids(self, ids, cfg, *, listener, cancel, record, prompt_texts):
            for i in range(600):
                listener(Event("step", 0, i + 1, 0, 0, [Token(i, 1, "x", 0.9)], [], "x", i / 1000))
                time.sleep(0.001)
            return [Result(_summary(), None)]

    monkeypatch.setattr(stream, "_engine", FastEngine())
    t0 = time.perf_counter()
    batches = [evs for evs, res in decode_stream([1], None, None) if evs]
    seconds = time.perf_counter() - t0
    assert [e.nfe for b in batches for e in b] == list(range(1, 601))
    assert len(batches) <= seconds * 30 + 3, (len(batches), seconds)


# ---------------------------------------------------------------- untrusted text in every HTML renderer
def _summary(stop: str = "stop_token") -> Summary:
    return Summary(answer_tokens=3, nfe=2, tokens_per_forward=1.5, seconds=0.1, tokens_per_second=30.0, ttft=0.01,
                   stop_reason=stop, text=XSS, token_ids=[1, 2, 3])


def _xss_trace() -> Trace:
    cfg = {"mode": "diffusion", "block_size": 8, "sub_block_size": 4, "threshold": 0.9, "strategy": "threshold",
           "factor": 1.0, "cache": "dual", "max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None,
           "stop_token_ids": [2]}
    events = [Event("prefill", 0, 1, 0, 1, [Token(0, 5, XSS, 0.95)], [Token(1, 6, XSS, 0.4)], XSS, 0.01),
              Event("step", 0, 2, 0, 1, [Token(1, 6, "<script>x</script>", 0.97)], [], "", 0.02),
              Event("done", 0, 2, 0, -1, [], [], "", 0.03)]
    return Trace({"model": XSS, "source": XSS, "adapter": True, "device": "cpu", "dtype": "float32", "config": cfg,
                  "prompt": XSS, "prompt_len": 6, "mask_token_id": 7}, events, _summary(XSS))


def test_chat_escapes_model_html_but_keeps_code():
    shown = render.chat_display([{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"a {XSS} b"}])
    assert "<img" not in shown[1]["content"] and "&lt;img src=x onerror=alert(1)&gt;" in shown[1]["content"]
    code = render.escape_chat(f"see `{XSS}` and\n```html\n{XSS}\n```\nthen {XSS}")
    assert f"`{XSS}`" in code and f"```html\n{XSS}\n```" in code  # code is shown literally by markdown
    assert code.endswith("then &lt;img src=x onerror=alert(1)&gt;")


def test_server_html_renderers_escape():
    class Src:
        reason, adapter = XSS, True

    class LM:
        name, source, dtype = XSS, Src, "torch.float32"
        device = type("D", (), {"type": XSS})

    s = _summary(XSS)
    html = [render.banner_html(LM, False), render.meters_html(s, XSS, ar=s, note=XSS), render.race_html([s], [s], XSS)]
    for h in html:
        assert "<img" not in h and "&lt;img" in h


def test_replay_meta_line_is_escaped():
    from app.ui import _replay_outputs

    tr = _xss_trace()
    meta = _replay_outputs([{"label": "x", "json": tr.dumps(), "path": "/nonexistent.json"}], 0)[-1]
    assert "<img" not in meta and "&lt;img" in meta


def test_heatmap_hover_text_is_escaped():
    fig = plots.heatmap_figure(_xss_trace())
    texts = json.dumps([fig.data[0].customdata, fig.data[1].customdata, fig.layout.title.text])
    assert "<img" not in texts and "<script" not in texts and "&lt;img" in texts


def test_live_payload_is_json_and_renderer_never_uses_inner_html():
    tr = _xss_trace()
    d = json.loads(render.live_payload("r", 0, tr.events, header=tr.header, summary=tr.summary))
    assert d["ev"][0]["committed"][0][2] == XSS  # data, not markup: the browser sets it with textContent
    js = (ROOT / "static" / "studio.js").read_text()
    assert not re.search(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write|\beval\(", js)


# ---------------------------------------------------------------- uploaded traces
def test_uploaded_trace_round_trip_and_limits():
    good = _xss_trace().dumps()
    assert parse_trace(good.encode()).header["prompt"] == XSS
    bad = {
        "not json": "{",
        "wrong version": json.dumps({"version": 9}),
        "not utf-8": b"\xff\xfe{}",
        "deep": "[" * 100_000 + "]" * 100_000,
        "nan": good.replace('"t":0.01', '"t":NaN'),
        "pos out of range": good.replace('[[0,5,', '[[99,5,'),
        "bad kind": good.replace('"kind":"step"', '"kind":"boom"'),
        "bad config": good.replace('"sub_block_size":4', '"sub_block_size":3'),
        "extra summary key": good.replace('"stop_reason":', '"evil":1,"stop_reason":'),
        "negative cached_tokens": good.replace('"cached_tokens":0', '"cached_tokens":-1'),
    }
    assert '"cached_tokens":0' in good
    # a trace saved before summaries had cached_tokens (2026-11-28) still replays, as 0
    old = parse_trace(good.replace(',"cached_tokens":0', '').replace('"cached_tokens":0,', ''))
    assert old.summary is not None and old.summary.cached_tokens == 0
    for name, data in bad.items():
        with pytest.raises(TraceError) as err:
            parse_trace(data)
        assert str(err.value).startswith("trace:"), name
    # size: a valid trace (trailing whitespace is valid JSON) refused only for its size, with the limit named;
    # the same trace at exactly the limit is accepted
    at_limit = good.encode() + b" " * (MAX_TRACE_BYTES - len(good.encode()))
    assert parse_trace(at_limit).header["prompt"] == XSS
    with pytest.raises(TraceError, match=f"the limit is {MAX_TRACE_BYTES // 2**20} MiB"):
        parse_trace(at_limit + b" ")


def test_settings_helpers():
    assert divisors(32) == [1, 2, 4, 8, 16, 32]
    assert fit_sub_block(16, 8) == 8 and fit_sub_block(8, 16) == 8 and fit_sub_block(64, 5) == 4


def test_app_defaults(monkeypatch):
    import app as _  # noqa: F401  (the package, not app.py)
    import importlib.util

    spec = importlib.util.spec_from_file_location("app_main", ROOT / "app.py")
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    monkeypatch.delenv("FASTDLLM_MODEL", raising=False)
    assert main.parse_args([]).host == "127.0.0.1"
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert main.default_model() is None
    monkeypatch.setenv("SPACE_ID", "someone/studio")
    assert main.default_model() == "Efficient-Large-Model/Fast_dLLM_v2_1.5B"
    # int8 wide activations in the studio unless FASTDLLM_WIDE_ACTIVATIONS says otherwise; the engine's own default
    # (API, CLI) stays bf16
    from engine.runtime import Runtime
    from engine.weights.quant import WeightPolicy

    monkeypatch.delenv("FASTDLLM_WIDE_ACTIVATIONS", raising=False)
    monkeypatch.delenv("FASTDLLM_ACTIVATIONS", raising=False)
    assert main.studio_runtime().wide_activations == "int8" and Runtime.from_env().wide_activations is None
    assert WeightPolicy.of(main.studio_runtime()).wide_act == "int8" and WeightPolicy.of(Runtime.from_env()).wide_act == "bf16"
    # and the engine's default int8 one-token steps, so every product is int8 (the prepacked weights only); the
    # engine's own default has int8 one-token steps beside bf16 wide ones
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")  # (the suite's engine runs fp32 weights)
    assert main.studio_runtime().activations is None and Runtime.from_env().activations is None
    assert WeightPolicy.of(main.studio_runtime()).only_int8() and WeightPolicy.of(Runtime.from_env()).act == "int8"
    assert not WeightPolicy.of(Runtime.from_env()).only_int8()
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "bf16")
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "fp32")
    assert main.studio_runtime().wide_activations == "bf16" and main.studio_runtime().activations == "fp32"
