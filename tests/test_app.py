"""The studio through its named API (gradio_client) and its HTML renderers, on the bundled default model."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app import plots, render
from app.settings import divisors, fit_sub_block, to_config
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
def test_api_lists_named_endpoints_only(client):
    api = client.view_api(return_format="dict", print_info=False)
    assert {"/generate", "/race", "/sweep", "/check_trace", "/info"} <= set(api["named_endpoints"])
    assert not api["unnamed_endpoints"]  # UI plumbing is private


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


@pytest.mark.parametrize("settings, field, words", [
    ({"block_size": 32, "sub_block_size": 5}, "sub_block_size", "divide"),
    ({"threshold": 0}, "threshold", "(0, 1]"),
    ({"cache": "huge"}, "cache", "none, block, dual"),
    ({"blocksize": 32}, "blocksize", "unknown setting"),
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
    race = client.predict("Hi", {"max_new_tokens": 16}, api_name="/race")
    assert race["order"].startswith("sequential")
    assert race["ar"]["tokens_per_forward"] == pytest.approx(1.0)
    assert race["speedup"] == pytest.approx(race["diffusion"]["tokens_per_second"] / race["ar"]["tokens_per_second"])
    rows = client.predict("Hi", [0.5, 1.0], [16], {"max_new_tokens": 16}, api_name="/sweep")
    assert [(r["threshold"], r["block_size"]) for r in rows] == [(0.5, 16), (1.0, 16)]
    assert all(r["tokens_per_second"] > 0 and r["nfe"] > 0 for r in rows)


def test_info(client, server):
    info = client.predict(api_name="/info")
    assert info["banner"] == server.engine.lm.banner()
    assert info["can_diffuse"] == server.engine.can_diffuse


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
    html = [render.banner_html(LM, False), render.meters_html(s, XSS, ar=s, note=XSS), render.race_html(s, s, XSS)]
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
        "huge": b" " * (MAX_TRACE_BYTES + 1),
    }
    for name, data in bad.items():
        with pytest.raises(TraceError) as err:
            parse_trace(data)
        assert str(err.value).startswith("trace:"), name


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
