"""The OpenAI-compatible server (engine/serve.py) and its scheduler (engine/scheduler.py), on the real bundled model.

A real uvicorn server on 127.0.0.1 (a free port) and the official `openai` client. Exactness is checked for AR and
block diffusion with the block cache (the dual cache's batches are exact too, tested in tests/test_dual_batching.py
on the scheduler without HTTP, to keep this file's time down). Every decode is
short (4 to 12 tokens; 48 only where a request must be cancelled part-way).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from conftest_app import free_port
from engine import Event, Trace
from engine.driver import Driver
from engine.serve import create_app
from test_reliability import PROMPTS, rss_mb, wait_until

EXACT = [{"mode": "ar"}, {"mode": "diffusion", "cache": "block"}]  # batch == single rows, token for token


@dataclass
class Api:
    url: str
    engine: object
    scheduler: Driver

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120, **kw)

    @property
    def model(self) -> str:
        return self.engine.lm.name


@pytest.fixture(scope="module")
def api(engine):
    import torch
    import uvicorn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two contended cores: one intra-op thread is several times faster here
    sched = Driver(engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, sched), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    th.start()
    wait_until(lambda: server.started, 30)
    yield Api(f"http://127.0.0.1:{port}/v1", engine, sched)
    server.should_exit = True
    th.join(10)
    sched.close()
    torch.set_num_threads(threads)


def single(engine, prompt: str, knobs: dict, max_tokens: int, chat: bool = True):
    """The single-user run of the same request, straight through the engine (no server, no scheduler)."""
    text = engine.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
    cfg = engine.decode_config(**knobs, max_new_tokens=max_tokens)
    [res] = engine.generate_ids([engine.encode(text)], cfg, record=False)
    return res.summary


def chat_stream(client, model: str, prompt: str, knobs: dict, max_tokens: int, **kw):
    """(text, finish_reason, usage, chunks) of a streamed chat completion."""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}, extra_body=knobs, **kw)
    text, reason, usage, chunks = "", None, None, []
    for ch in stream:
        chunks.append(ch)
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            reason = ch.choices[0].finish_reason or reason
        if ch.usage is not None:
            usage = ch.usage
    return text, reason, usage, chunks


# ---------------------------------------------------------------- the API surface
@pytest.mark.parametrize("knobs", EXACT, ids=["ar", "diffusion-block"])
def test_chat_stream_and_non_stream_equal_the_engine(api, knobs):
    c = api.client()
    [m] = c.models.list().data
    assert m.id == api.model and m.model_extra["can_diffuse"]
    ref = single(api.engine, PROMPTS[0], knobs, 8)
    r = c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8,
                                  extra_body=knobs)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.stop_reason == "max_new_tokens" else "stop")
    u = r.usage
    assert (u.completion_tokens, u.model_extra["nfe"]) == (ref.answer_tokens, ref.nfe)
    assert u.model_extra["tokens_per_forward"] == pytest.approx(ref.tokens_per_forward, abs=1e-3)
    assert u.model_extra["engine_seconds"] > 0 and u.prompt_tokens > 0
    text, reason, usage, chunks = chat_stream(c, api.model, PROMPTS[0], knobs, 8)
    assert text == ref.text and reason == r.choices[0].finish_reason
    assert usage.completion_tokens == ref.answer_tokens and usage.model_extra["nfe"] == ref.nfe
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []


def test_completions_stream_and_non_stream(api):
    c, prompt = api.client(), "The capital of France is"
    ref = single(api.engine, prompt, {"mode": "ar"}, 6, chat=False)
    r = c.completions.create(model=api.model, prompt=prompt, max_tokens=6, extra_body={"mode": "ar"})
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == ref.answer_tokens
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=api.model, prompt=prompt, max_tokens=6, stream=True, extra_body={"mode": "ar"}) if ch.choices)
    assert streamed == ref.text
    word = ref.text.split()[0]  # a stop string the answer is known to contain: the text ends before it
    r = c.completions.create(model=api.model, prompt=prompt, max_tokens=6, stop=[word], extra_body={"mode": "ar"})
    assert r.choices[0].text == ref.text[:ref.text.index(word)] and r.choices[0].finish_reason == "stop"


def test_denoise_events_stream_draws_the_live_view(api):
    """Opt-in per-forward events in the trace's schema: they rebuild the text, the NFE and a replayable trace."""
    c = api.client()
    knobs = {"mode": "diffusion", "cache": "block", "denoise_events": True}
    text, _, usage, chunks = chat_stream(c, api.model, PROMPTS[1], knobs, 8)
    header = chunks[0].model_extra["denoise_header"]
    events = [Event.from_json(e) for ch in chunks for e in (ch.model_extra or {}).get("denoise_events", [])]
    assert header["config"]["mode"] == "diffusion" and header["prompt"] == PROMPTS[1] and header["prompt_len"] > 0
    assert events[0].kind == "prefill" and events[-1].kind == "done"
    assert "".join(e.text_delta for e in events) == text
    assert events[-2].nfe == usage.model_extra["nfe"] and any(e.masked for e in events)
    r = c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8,
                                  extra_body=knobs)
    tr = Trace.from_json(r.model_extra["trace"])  # non-streaming: the whole trace, as the studio downloads it
    assert tr.summary.text == r.choices[0].message.content == text
    plain = c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8,
                                      stream=True, extra_body={"mode": "ar"})
    assert not any((ch.model_extra or {}).get("denoise_events") for ch in plain)  # opt-in only


@pytest.mark.parametrize("body, param, needle", [
    ({"threshold": 1.5}, "threshold", "(0, 1]"),
    ({"sub_block_size": 5}, "sub_block_size", "must divide block_size=32"),
    ({"cache": "paged"}, "cache", "none, block, dual"),
    ({"mode": "beam"}, "mode", "diffusion, ar"),
    ({"block_size": 0}, "block_size", "[1, 256]"),
    ({"strategy": "greedy"}, "strategy", "threshold, factor"),
    ({"factor": -1}, "factor", "(0, 100]"),
    ({"max_tokens": 0}, "max_tokens", "[1, 4096]"),
    ({"max_completion_tokens": 10**9}, "max_completion_tokens", "[1, 4096]"),
    ({"temperature": "hot"}, "temperature", "[0, 10]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"seed": -3}, "seed", "[0, 2^63)"),
    ({"n": 0}, "n", "[1, 16]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20]"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"denoise_events": "yes"}, "denoise_events", "true or false"),
    ({"stream": 1}, "stream", "true or false"),
    ({"num_beams": 4}, "num_beams", "unknown parameter"),
])
def test_bad_knobs_get_400_naming_the_parameter(api, body, param, needle):
    with httpx.Client(base_url=api.url, timeout=30) as h:
        r = h.post("/chat/completions", json={"model": api.model, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param) and needle in err["message"], err


def test_client_errors_through_the_official_client(api):
    c = api.client()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="threshold: must be a number in"):
        c.chat.completions.create(model=api.model, messages=msgs, extra_body={"threshold": 0})
    with pytest.raises(openai.NotFoundError, match="not served here") as e:
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match=r"messages: the prompt has \d+ tokens; the model's context is 8192"):
        c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "hello " * 9000}])
    with pytest.raises(openai.BadRequestError, match="messages: longer than"):
        c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "x" * 200_001}])
    with pytest.raises(openai.BadRequestError, match="messages: each message needs role"):
        c.chat.completions.create(model=api.model, messages=[{"role": "tool", "content": "x"}])
    with httpx.Client(base_url=api.url, timeout=30) as h:
        assert h.post("/completions", content=b"{nope", headers={"content-type": "application/json"}).status_code == 400
        r = h.post("/completions", content=b'{"model": "%s", "prompt": "a\\ud800b"}' % api.model.encode(),
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "prompt: not valid Unicode" in r.json()["error"]["message"], r.text


def test_serve_cli_rejects_bad_options_before_loading_the_model():
    import subprocess
    import sys

    for args, needle in [(["--max-batch", "0"], "max_batch: must be an integer in [1, 256]"),
                         (["--port", "70000"], "port: must be in [1, 65535]"),
                         (["--prefix-cache-mib", "-1"], "prefix_cache_mib: must be an integer in [0, 1048576]")]:
        r = subprocess.run([sys.executable, "-m", "engine", "serve", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr, r.stderr


# ---------------------------------------------------------------- batching across users
@pytest.mark.parametrize("knobs", EXACT, ids=["ar", "diffusion-block"])
def test_eight_concurrent_streaming_clients_get_their_single_user_answers(api, knobs):
    refs = [single(api.engine, p, knobs, 8) for p in PROMPTS]
    before = api.scheduler.forwards
    got: dict[int, tuple] = {}
    start = threading.Barrier(len(PROMPTS))

    def user(i: int) -> None:
        start.wait()
        try:
            got[i] = chat_stream(api.client(), api.model, PROMPTS[i], knobs, 8)
        except Exception as e:  # noqa: BLE001 - reported below with the user's index
            got[i] = (e,)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert len(got) == len(PROMPTS) and all(len(g) == 4 for g in got.values()), got
    for i, (text, _, usage, _) in got.items():
        assert text == refs[i].text, (i, text, refs[i].text)
        assert usage.completion_tokens == refs[i].answer_tokens and usage.model_extra["nfe"] == refs[i].nfe
    forwards, rows = api.scheduler.forwards - before, sum(r.nfe for r in refs)
    assert forwards < rows / 2, (forwards, rows)  # the clients shared forwards
    print(f"\n[serve] 8 concurrent clients {knobs}: {forwards} forwards for {rows} row-forwards")


def test_late_arrivals_are_admitted_mid_batch_and_settings_are_grouped(api):
    """A request that arrives while a long one decodes finishes first; different settings get their own batch."""
    eng, sched = api.engine, api.scheduler
    encode = lambda p: eng.encode(eng.chat_prompt([{"role": "user", "content": p}]))  # noqa: E731
    long_cfg = eng.decode_config(mode="ar", max_new_tokens=48)
    late = [eng.decode_config(mode="ar", max_new_tokens=4),  # joins the running AR batch
            eng.decode_config(mode="diffusion", cache="block", threshold=0.7, max_new_tokens=8),
            eng.decode_config(mode="diffusion", cache="block", block_size=16, sub_block_size=4, max_new_tokens=8)]
    count = "Write a long story about a dragon."
    refs = [eng.generate_ids([encode(count)], long_cfg, record=False)[0].summary] + \
        [eng.generate_ids([encode(PROMPTS[i])], c, record=False)[0].summary for i, c in enumerate(late)]
    assert refs[0].answer_tokens == 48  # long enough to be running when the others arrive
    first = sched.submit(encode(count), long_cfg, record=False)
    wait_until(lambda: first.row is not None and first.row.nfe >= 3, 60)
    others = [sched.submit(encode(PROMPTS[i]), c, record=False) for i, c in enumerate(late)]
    for t in others:
        t.wait(120)
    assert not first.finished.is_set(), "the long request finished first: the late ones were not admitted mid-batch"
    results = [first.wait(120)] + [t.wait(0) for t in others]
    for got, ref in zip(results, refs):
        assert got.summary.token_ids == ref.token_ids


def test_full_batches_queue_and_a_full_waiting_line_refuses(engine):
    """max_batch rows decode, later requests wait (FIFO), and past max_waiting submit() refuses at once (HTTP 503)."""
    from engine.scheduler import SchedulerBusy

    sched = Driver(engine, max_batch=1, max_waiting=1)
    try:
        ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Write a long story about a dragon."}]))
        cfg = engine.decode_config(mode="ar", max_new_tokens=48)
        running = sched.submit(ids, cfg, record=False)
        wait_until(lambda: sched.running == 1, 60)  # admitted and prefilled: the batch is full
        waiting = sched.submit(ids, cfg, record=False)
        with pytest.raises(SchedulerBusy, match="1 requests are waiting"):
            sched.submit(ids, cfg, record=False)
        time.sleep(0.5)  # a few forwards: the waiting request stays out of the full batch
        assert waiting.row is None and sched.running == 1 and not running.finished.is_set()
        waiting.cancel()  # cancelled before admission: finishes without a forward
        running.cancel()
        assert waiting.wait(60).summary.stop_reason == running.wait(60).summary.stop_reason == "cancelled"
        assert waiting.wait(0).summary.nfe == 0
    finally:
        sched.close()


def test_a_disconnect_frees_its_row_within_one_forward_and_the_others_carry_on(api, monkeypatch):
    tickets = []
    real_submit = api.scheduler.submit

    def submit(ids, cfg, *, listener=None, **kw):  # observe each ticket: events emitted after its stop flag
        box: dict = {"after_stop": 0}

        def on_event(e):
            if box["t"].stop.is_set() and e.kind != "done":
                box["after_stop"] += 1
            listener(e)

        box["t"] = real_submit(ids, cfg, listener=on_event, **kw)
        tickets.append(box)
        return box["t"]

    monkeypatch.setattr(api.scheduler, "submit", submit)
    knobs = {"mode": "ar"}
    ref = single(api.engine, PROMPTS[2], knobs, 12)
    stay: dict = {}
    stayer = threading.Thread(target=lambda: stay.update(r=chat_stream(api.client(), api.model, PROMPTS[2], knobs, 12)))
    stayer.start()
    body = {"model": api.model, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 48, "stream": True, "mode": "ar"}
    before = rss_mb()
    with httpx.Client(base_url=api.url, timeout=60) as h, h.stream("POST", "/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content":' in line and '"content":""' not in line.replace(" ", ""):
                break  # the answer is streaming: go away without a word
    leaver = next(b for b in tickets if b["t"].cfg.max_new_tokens == 48)
    wait_until(lambda: leaver["t"].finished.is_set(), 15)
    s = leaver["t"].wait(0).summary
    assert s.stop_reason == "cancelled" and s.answer_tokens < 48
    assert leaver["after_stop"] <= 1  # at most the forward that was already running
    stayer.join(120)
    assert stay["r"][0] == ref.text  # the other client's row was untouched
    wait_until(lambda: api.scheduler.running == 0, 30)
    assert rss_mb() - before < 50


def test_bounded_soak_keeps_memory_flat(api):
    """60 short requests from 4 clients (streams, non-streams, mixed settings, a quarter abandoned mid-stream)."""
    settings = [{"mode": "ar"}, {"mode": "diffusion", "cache": "block"}, {"mode": "diffusion", "cache": "dual"},
                {"mode": "diffusion", "cache": "none", "block_size": 16, "sub_block_size": 4, "threshold": 0.7}]

    def client_loop(k: int, n: int) -> None:
        c = api.client()
        for i in range(n):
            knobs, prompt = settings[(i + k) % len(settings)], PROMPTS[(i * 3 + k) % len(PROMPTS)]
            if i % 4 == 3:
                with c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=16, stream=True, extra_body=knobs) as s:
                    next(iter(s))  # abandon the stream after its first chunk
            elif i % 2:
                chat_stream(c, api.model, prompt, knobs, 2)
            else:
                c.chat.completions.create(model=api.model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=2, extra_body=knobs)

    def run(n: int) -> None:
        ts = [threading.Thread(target=client_loop, args=(k, n)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)

    run(4)  # warm-up: allocator pools, every setting's batch shapes
    wait_until(lambda: api.scheduler.running == 0, 30)
    before, threads_before, t0 = rss_mb(), threading.active_count(), time.perf_counter()
    run(15)
    wait_until(lambda: api.scheduler.running == 0 and not api.scheduler.waiting, 30)
    after = rss_mb()
    assert after - before < 100, (before, after)
    assert threading.active_count() <= threads_before + 2
    print(f"\n[serve] soak: 60 requests in {time.perf_counter() - t0:.0f} s; RSS {before:.0f} -> {after:.0f} MB")


# ---------------------------------------------------------------- the studio on a remote engine
def test_the_studio_on_a_remote_engine_sees_the_same_runs(api):
    """app.backend.RemoteEngine behind the studio's own operations: same answers, events, traces, and its Stop."""
    from app import stream
    from app.backend import RemoteEngine
    from app.studio import Studio
    from engine import ConfigError

    previous = stream._engine
    remote = RemoteEngine(api.url)
    try:
        assert remote.can_diffuse and remote.max_context == api.engine.max_context
        assert remote.encode(remote.chat_prompt([{"role": "user", "content": "hi"}])) == \
            api.engine.encode(api.engine.chat_prompt([{"role": "user", "content": "hi"}]))
        settings = {"mode": "diffusion", "cache": "block", "max_new_tokens": 8}
        *_, (text, trace_json) = Studio(remote).generate(PROMPTS[4], None, settings)
        *_, (ref_text, ref_json) = Studio(api.engine).generate(PROMPTS[4], None, settings)
        tr, ref = Trace.loads(trace_json), Trace.loads(ref_json)
        assert text == ref_text and tr.summary.token_ids == ref.summary.token_ids
        assert [(e.kind, e.nfe, e.block, e.sub_block, [t.id for t in e.committed]) for e in tr.events] == \
            [(e.kind, e.nfe, e.block, e.sub_block, [t.id for t in e.committed]) for e in ref.events]
        assert tr.header == ref.header
        studio = Studio(remote)
        *_, rows = studio.sweep(PROMPTS[4], [0.9, 1.0], [32], {"cache": "block", "max_new_tokens": 4})
        assert [r["threshold"] for r in rows] == [0.9, 1.0] and all(r["nfe"] > 0 for r in rows)
        *_, race = studio.race(PROMPTS[4], {"cache": "block", "max_new_tokens": 4})
        assert race["ar"]["answer_tokens"] > 0 and race["diffusion"]["answer_tokens"] > 0
        with pytest.raises(ConfigError, match=r"prompt: token ids must be in \[0, "):  # the server's 400, named
            remote.generate_ids([[10**7]], remote.decode_config(mode="ar", max_new_tokens=2))
        stop = threading.Event()
        seen = []

        def listener(e):
            seen.append(e)
            if len(seen) == 2:
                stop.set()  # the studio's Stop button

        ids = remote.encode(remote.chat_prompt([{"role": "user", "content": "Write a long story about a dragon."}]))
        [res] = remote.generate_ids([ids], remote.decode_config(mode="ar", max_new_tokens=48), listener=listener,
                                    cancel=stop)
        assert res.summary.stop_reason == "cancelled" and res.summary.answer_tokens < 48
        wait_until(lambda: api.scheduler.running == 0, 10)  # the server dropped the row when the stream closed
        # A plain OpenAI-compatible server (vLLM, SGLang): /tokenize, token-id prompts, text only, the server's knobs
        plain = RemoteEngine(api.url, plain=True)
        *_, (text, trace_json) = Studio(plain).generate(PROMPTS[5], None, {"max_new_tokens": 6})
        ref = single(api.engine, PROMPTS[5], {}, 6)  # the server's defaults decide (no knobs are sent)
        tr = Trace.loads(trace_json)
        assert text == ref.text == tr.summary.text and tr.summary.answer_tokens == ref.answer_tokens
        assert tr.summary.nfe == 0 and tr.events[-1].kind == "done" and not any(e.committed for e in tr.events)
    finally:
        stream._engine = previous  # the studio module keeps one engine: give the other test modules theirs back
        api.engine.close_scheduler()  # and the scheduler the local Studio started on this one


def test_app_py_engine_url_builds_the_studio_on_the_server(api, monkeypatch):
    """`python app.py --engine-url URL` loads no model and builds the whole UI on the remote engine."""
    import importlib.util
    from pathlib import Path

    import gradio as gr

    import engine
    from app import stream

    spec = importlib.util.spec_from_file_location("app_main", Path(__file__).resolve().parent.parent / "app.py")
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    launched: list = []
    monkeypatch.setattr(engine.Engine, "load", classmethod(lambda cls, *a, **k: pytest.fail("loaded a model")))
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: launched.append(self))
    previous = stream._engine
    try:
        main.main(["--engine-url", api.url.removesuffix("/v1")])
        assert launched and stream.get_engine().lm.banner().endswith("remote " + api.url.removesuffix("/v1"))
    finally:
        stream._engine = previous


def test_bench_serve_writes_its_results(api, tmp_path):
    """`python -m bench serve --url`: both phases, the ratio and the same-answers check land in results.json; with
    `--system` every request carries the shared document, whose chunks the server's prefix cache serves."""
    import json

    from bench.__main__ import main

    assert main(["serve", "--url", api.url, "--clients", "2", "--repeats", "1", "--max-tokens", "3",
                 "--settings", "ar", "--out", str(tmp_path), "--system", "bench/data/system_document.txt"]) == 0
    [r] = json.loads((tmp_path / "results.json").read_text())["results"]
    assert r["setting"] == "ar" and r["same_answers"] and r["aggregate_speedup"] > 0
    assert r["one_client"]["requests"] == r["concurrent"]["requests"] == 2
    assert r["concurrent"]["answer_tokens"] == r["one_client"]["answer_tokens"] > 0
    # the ~715-token document: its whole 64-token grains (the CPU's) come from the cache in every request after the
    # first
    cached = [q["cached_tokens"] for q in r["concurrent"]["requests_detail"]]
    assert cached[0] == cached[1] >= 640 and cached[0] % 64 == 0 and r["concurrent"]["cached_tokens"] == 2 * cached[0]
