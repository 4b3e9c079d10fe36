"""Reliability of the studio (issue #6): concurrent users sharing forwards, the queue bound, cancellation and
disconnects, a soak, hostile input through the UI and the API, an engine fault mid-generation, and security checks.

Everything runs against the real default model on 127.0.0.1 (the studio server test_app.py uses), in the
mode the app's /info endpoint reports: block diffusion once the adapter is in assets/, else the AR baseline.
Every decode is short (1-16 tokens, 64 only where a run must be cancelled half-way). The figures in
app/RELIABILITY.md come from these tests (`pytest -s` prints them).
"""
from __future__ import annotations

import gc
import html as html_lib
import json
import math
import os
import random
import re
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from app import render
from app.settings import BLOCK_SIZES, MAX_NEW_TOKENS, SETTING_KEYS, divisors
from app.stream import scheduler_for
from app.traces import MAX_TRACE_BYTES
from conftest_app import free_port
from engine import Trace

ROOT = Path(__file__).resolve().parent.parent
XSS = '<img src=x onerror="alert(1)">'
USERS = 8
PROMPTS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "What is the capital of Italy?",
           "Name a fruit.", "What day comes after Monday?", "Name an animal.", "What is water made of?"]


def rss_mb() -> float:
    """Resident memory of this process, which is also the studio server's (it runs in-process)."""
    gc.collect()
    try:
        import psutil
    except ImportError:  # Linux without psutil
        kb = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)
        return int(kb) / 1024
    return psutil.Process().memory_info().rss / 2**20


def wait_until(cond, timeout: float, step: float = 0.01) -> float:
    """Seconds until cond() held; fails after timeout."""
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout, f"still waiting after {timeout} s"
        time.sleep(step)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Two contended cores: one intra-op thread decodes ~10x faster here than two fighting for them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mode(client) -> str:
    """The mode a chat turn runs in, as the app itself reports it."""
    return client.predict(api_name="/info")["defaults"]["mode"]


@pytest.fixture(scope="module")
def sched(server):
    """The scheduler every studio decode goes through (the one of the studio's in-process engine)."""
    return scheduler_for(server.engine)


def idle(sched) -> bool:
    """No request waiting, prefilling or decoding (a row being prefilled is in neither `waiting` nor `groups`:
    reading those two raced with admission and failed once in CI)."""
    return sched.in_flight == 0


@pytest.fixture()
def spy(sched, monkeypatch):
    """Wraps the scheduler's submit: per run, its stop flag, the forwards after the flag was set, the result."""
    real = sched.submit
    runs: list[dict] = []

    def submit(ids, cfg, *, listener=None, stop=None, on_finish=None, **kw):
        run = {"cancel": stop, "events": 0, "after_cancel": 0, "result": None}
        runs.append(run)

        def on_event(e):
            run["events"] += 1
            if stop is not None and stop.is_set() and e.kind != "done":
                run["after_cancel"] += 1
            if listener is not None:
                listener(e)

        def finish(t):
            run["result"] = t.result
            if on_finish is not None:
                on_finish(t)

        return real(ids, cfg, listener=on_event, stop=stop, on_finish=finish, **kw)

    monkeypatch.setattr(sched, "submit", submit)
    return runs


def ui_handler(server, name: str):
    """A UI event handler of the running app, called as Gradio calls it (the studio's UI endpoints are private)."""
    [fn] = {f.fn for f in server.demo.fns.values() if f.name == name}  # one handler, maybe on several events
    return fn


def session(key: str) -> SimpleNamespace:
    """What the UI handlers read from their gr.Request: the browser session's key (Stop finds a run by it)."""
    return SimpleNamespace(session_hash=key)


def widget_values(mode: str, **over) -> list:
    """The settings widgets' values, in the UI's order."""
    v = {"mode": mode, "block_size": 32, "sub_block_size": 8, "threshold": 0.9, "strategy": "threshold",
         "factor": 1.0, "cache": "dual", "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": -1,
         "system_prompt": "You are a helpful assistant.", **over}
    return [v[k] for k in SETTING_KEYS]


def call_raw(server, api: str, body: str) -> tuple[str, str]:
    """POST raw JSON to the REST API (NaN and lone surrogates, which gradio_client cannot send): (event, data)."""
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post(f"gradio_api/call/{api}", content=body.encode("utf-8"), headers={"content-type": "application/json"})
        r.raise_for_status()
        text = h.get(f"gradio_api/call/{api}/{r.json()['event_id']}").text
    events = re.findall(r"^event: (\w+)\ndata: (.*)$", text, re.M)
    return events[-1]


# ---------------------------------------------------------------- concurrency and the queue bound
def test_eight_users_share_forwards_and_each_get_their_own_answer(server, mode, sched):
    """8 visitors at once: their rows share the scheduler's forwards, and each answer is its single-user greedy
    answer, token for token. The block cache here (and AR); the default dual cache's batches are exact too, tested
    without the studio in tests/test_dual_batching.py."""
    from gradio_client import Client

    settings = {"mode": mode, "cache": "block", "max_new_tokens": 8, "temperature": 0.0}
    alone = Client(server.url, verbose=False)
    t0 = time.perf_counter()
    ref = {p: alone.predict(p, [], settings, api_name="/generate") for p in PROMPTS}
    one_by_one = time.perf_counter() - t0
    forwards0 = sched.forwards
    clients = [Client(server.url, verbose=False) for _ in range(USERS)]
    got: dict[int, tuple] = {}
    start = threading.Barrier(USERS)

    def user(i: int) -> None:
        start.wait()
        try:
            got[i] = clients[i].predict(PROMPTS[i], [], settings, api_name="/generate")
        except Exception as e:  # noqa: BLE001 - reported below with the user's index
            got[i] = e

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    wall = time.perf_counter() - t0
    forwards = sched.forwards - forwards0
    assert len(got) == USERS and not [g for g in got.values() if isinstance(g, Exception)], got
    for i, (text, trace_json) in got.items():
        tr, tr_ref = Trace.loads(trace_json), Trace.loads(ref[PROMPTS[i]][1])
        assert tr.header["prompt"] == PROMPTS[i]
        assert tr.header["prompt_len"] == tr_ref.header["prompt_len"]
        assert text == ref[PROMPTS[i]][0] == tr.summary.text, (i, text, ref[PROMPTS[i]][0])
        assert tr.summary.token_ids == tr_ref.summary.token_ids
    nfe = sum(Trace.loads(g[1]).summary.nfe for g in got.values())
    assert forwards < nfe * 0.75, (forwards, nfe)  # one at a time would run exactly nfe forwards
    wait_until(lambda: idle(sched), 10)
    print(f"\n[reliability] {USERS} concurrent users, mode {mode}, block cache: all answers match their single-user "
          f"runs; {forwards} shared forwards for {nfe} rows' forwards; wall {wall:.1f} s (one by one {one_by_one:.1f} s)")


def test_queue_bound_refuses_with_a_busy_message_and_shows_positions(server, mode, monkeypatch):
    """FASTDLLM_QUEUE_SIZE=2: with every decoding slot taken (one here, SLOTS by default) two requests wait
    (positions 1 and 2) and the next is refused at once."""
    from gradio_client import Client
    from gradio_client.utils import QueueError, Status

    from app.api import SLOTS
    from app.studio import Studio
    from app.ui import build, launch_kwargs, queue_kwargs

    decoding = [f for f in server.demo.fns.values() if f.concurrency_id == "engine"]
    assert {f.api_name for f in decoding} >= {"generate", "race", "sweep"}
    assert {f.concurrency_limit for f in decoding} == {SLOTS}  # the scheduler's batch limit

    monkeypatch.setenv("FASTDLLM_QUEUE_SIZE", "2")
    assert queue_kwargs() == {"max_size": 2}
    monkeypatch.setenv("FASTDLLM_QUEUE_SIZE", "lots")
    with pytest.raises(ValueError, match="FASTDLLM_QUEUE_SIZE"):
        queue_kwargs()
    monkeypatch.setenv("FASTDLLM_QUEUE_SIZE", "2")
    demo = build(Studio(server.engine), slots=1)  # one slot: three requests fill it and the queue
    port = free_port()
    demo.queue(**queue_kwargs()).launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                                        quiet=True, **launch_kwargs())
    lock = server.engine.lock
    settings = {"mode": mode, "max_new_tokens": 4, "temperature": 0.0}
    try:
        clients = [Client(f"http://127.0.0.1:{port}/", verbose=False) for _ in range(4)]
        lock.acquire()  # the engine is "busy" (the scheduler waits for it): the first request holds the only slot
        try:
            jobs = [clients[0].submit(PROMPTS[0], [], settings, api_name="/generate")]
            wait_until(lambda: jobs[0].status().code == Status.PROCESSING, 30)
            for i in (1, 2):
                jobs.append(clients[i].submit(PROMPTS[i], [], settings, api_name="/generate"))
                wait_until(lambda: jobs[i].status().code == Status.IN_QUEUE and jobs[i].status().rank is not None, 30)
            ranks = [j.status().rank for j in jobs[1:]]
            assert ranks == [0, 1], ranks  # gradio_client counts from 0; the browser shows "queue: 1/2", "2/2"
            t0 = time.perf_counter()
            with pytest.raises(QueueError, match="Queue is full"):
                clients[3].predict(PROMPTS[3], [], settings, api_name="/generate")
            refused = time.perf_counter() - t0
            [fn_index] = [i for i, f in demo.fns.items() if f.api_name == "generate"]
            with httpx.Client(timeout=10) as h:  # what a raw HTTP client gets: 503 with the bound in words
                r = h.post(f"http://127.0.0.1:{port}/gradio_api/queue/join",
                           json={"data": [PROMPTS[3], [], settings], "fn_index": fn_index, "session_hash": "raw"})
            assert r.status_code == 503 and "Queue is full. Max size is 2" in r.text, r.text
        finally:
            lock.release()
        for i, job in enumerate(jobs):
            text, trace_json = job.result(timeout=120)
            assert Trace.loads(trace_json).header["prompt"] == PROMPTS[i]
        assert refused < 5
    finally:
        demo.close()
    print(f"\n[reliability] queue bound 2: waiting positions {ranks}, 4th request refused in {refused:.2f} s "
          "with 'Queue is full! Please try again.'")


# ---------------------------------------------------------------- cancellation and disconnects
# Long enough to be interrupted at the studio's defaults (its own system turn, the repetition knobs): "Count from
# one to fifty." now ends after 4-18 tokens; this runs to 64 in both modes.
LONG_PROMPT = "Write a long essay about the history of Rome, with many details."


def _long(mode: str) -> dict:
    """A decode long enough to be interrupted (threshold 1.0: one token per forward, also in diffusion mode)."""
    return {"mode": mode, "max_new_tokens": 64, "threshold": 1.0, "temperature": 0.0}


def test_job_cancel_frees_the_engine_within_one_forward(server, client, mode, sched, spy):
    """gradio_client job.cancel() on /generate: its row leaves after the current forward, memory stays put."""
    samples = []
    for n in range(3):  # the first cancelled run is the warm-up that sets the memory baseline
        job = client.submit(LONG_PROMPT, [], _long(mode), api_name="/generate")
        wait_until(lambda: bool(job.outputs()), 120)  # decoding has started: a partial answer arrived
        assert not idle(sched)
        job.cancel()
        freed = wait_until(lambda: idle(sched), 10)
        run = spy[-1]
        res = run["result"]
        assert res is not None and res.summary.stop_reason == "cancelled", res
        assert run["after_cancel"] <= 1  # at most the forward that was already running
        assert res.summary.answer_tokens < 64
        samples.append((freed, rss_mb(), res.summary.nfe))
    t0 = time.perf_counter()
    text, trace_json = client.predict("Say hello.", [], {"mode": mode, "max_new_tokens": 4}, api_name="/generate")
    next_s = time.perf_counter() - t0
    assert Trace.loads(trace_json).summary.stop_reason in ("stop_token", "max_new_tokens")
    base, last = samples[0][1], samples[-1][1]
    assert last - base < 50, samples
    print(f"\n[reliability] job.cancel(): engine free {max(s[0] for s in samples):.2f} s after cancel (max of 3), "
          f"forwards per cancelled run {[s[2] for s in samples]}, next request served in {next_s:.2f} s; "
          f"RSS {base:.0f} -> {last:.0f} MB")


def test_client_that_disconnects_stops_the_engine(server, mode, sched, spy):
    """A client that drops its connection mid-answer (closed tab or killed process): no orphan decoding."""
    [fn_index] = [i for i, f in server.demo.fns.items() if f.api_name == "generate"]
    before = rss_mb()
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("gradio_api/queue/join", json={"data": [LONG_PROMPT, [], _long(mode)],
                                                   "fn_index": fn_index, "session_hash": "gone-away"})
        r.raise_for_status()
        with h.stream("GET", "gradio_api/queue/data", params={"session_hash": "gone-away"}) as stream:
            for line in stream.iter_lines():
                if '"msg":"process_generating"' in line.replace(" ", ""):
                    break  # the answer is streaming: go away without a word
        assert not idle(sched)
    freed = wait_until(lambda: idle(sched), 15)
    res = spy[-1]["result"]
    assert res.summary.stop_reason == "cancelled" and res.summary.answer_tokens < 64, res.summary
    assert spy[-1]["after_cancel"] <= 1
    after = rss_mb()
    assert after - before < 50
    print(f"\n[reliability] disconnect: engine free {freed:.2f} s after the client left, "
          f"{res.summary.nfe} forwards run; RSS {before:.0f} -> {after:.0f} MB")


def test_cancel_drops_only_that_visitors_row(server, mode, sched, spy):
    """Two visitors in one batch: the one who cancels leaves within one forward; the other's answer is unchanged."""
    from gradio_client import Client

    a, b = Client(server.url, verbose=False), Client(server.url, verbose=False)
    shared = {"mode": mode, "cache": "block", "threshold": 1.0, "temperature": 0.0}  # one batch key for both
    ref = b.predict(PROMPTS[3], [], {**shared, "max_new_tokens": 16}, api_name="/generate")
    forwards0 = sched.forwards
    long = a.submit(LONG_PROMPT, [], {**shared, "max_new_tokens": 64}, api_name="/generate")
    wait_until(lambda: bool(long.outputs()), 120)
    short = b.submit(PROMPTS[3], [], {**shared, "max_new_tokens": 16}, api_name="/generate")
    wait_until(lambda: bool(short.outputs()), 60)  # both rows are decoding now
    long.cancel()
    text, trace_json = short.result(timeout=120)
    assert (text, Trace.loads(trace_json).summary.token_ids) == (ref[0], Trace.loads(ref[1]).summary.token_ids)
    cancelled = next(r for r in spy if r["result"] is not None and r["result"].summary.stop_reason == "cancelled")
    assert cancelled["after_cancel"] <= 1 and cancelled["result"].summary.answer_tokens < 64
    rows = sum(r["result"].summary.nfe for r in spy[-2:])  # the long run's and the short one's
    assert sched.forwards - forwards0 < rows  # they shared forwards while both ran
    wait_until(lambda: idle(sched), 10)


def test_closing_a_ui_run_stops_the_engine(server, mode, sched, spy):
    """The chat handler is a generator; Gradio closes it when the tab goes away: the engine stops with it."""
    chat_ui = ui_handler(server, "chat_ui")
    gen = chat_ui(session("tab-closed"), LONG_PROMPT, [], [],
                  *widget_values(mode, max_new_tokens=64, threshold=1.0))
    for frame in gen:
        if spy and spy[-1]["events"] >= 2:
            break
    gen.close()
    res = spy[-1]["result"]  # close() returns once the row has left its batch: after the current forward
    wait_until(lambda: idle(sched), 5)
    assert res.summary.stop_reason == "cancelled" and spy[-1]["after_cancel"] <= 1
    if mode == "diffusion":  # the sweep's runs stream empty frames so that closing works the same way
        gen = ui_handler(server, "sweep_ui")(session("tab-closed"), LONG_PROMPT, [1.0], [32], 1,
                                             *widget_values(mode, max_new_tokens=64))
        runs = len(spy)
        for frame in gen:
            if len(spy) > runs and spy[-1]["events"] >= 2:
                break
        gen.close()
        assert spy[-1]["result"].summary.stop_reason == "cancelled"


def test_each_panels_stop_stops_only_its_own_run(server, mode, sched, spy):
    """One tab's chat and race decode at once now: the chat's Stop stops the chat, the race carries on."""
    from app.stream import request_stop
    from app.ui import run_key

    if mode != "diffusion":
        pytest.skip("race needs block diffusion")
    tab = session("two-panels")
    chat = ui_handler(server, "chat_ui")(tab, LONG_PROMPT, [], [],
                                         *widget_values(mode, max_new_tokens=64, threshold=1.0))
    race = ui_handler(server, "race_ui")(tab, LONG_PROMPT, 1, [],
                                         *widget_values(mode, max_new_tokens=64, threshold=1.0))
    try:
        for _ in chat:
            if spy and spy[-1]["events"] >= 2:
                break
        for _ in race:
            if len(spy) == 2 and spy[1]["events"] >= 2:
                break
        assert request_stop(run_key(tab, "chat"))
        *_, last = chat
        assert spy[0]["result"].summary.stop_reason == "cancelled" and spy[0]["after_cancel"] <= 1
        assert not spy[1]["cancel"].is_set() and spy[1]["result"] is None  # the race still decodes
    finally:
        race.close()
    assert spy[1]["result"].summary.stop_reason == "cancelled"  # closing its handler stopped it too


# ---------------------------------------------------------------- soak
def _random_settings(rng: random.Random, mode: str) -> dict:
    bs = rng.choice(BLOCK_SIZES)
    return {"mode": mode, "block_size": bs, "sub_block_size": rng.choice(divisors(bs)),
            "threshold": round(rng.uniform(0.3, 1.0), 2), "strategy": rng.choice(["threshold", "factor"]),
            "factor": round(rng.uniform(0.5, 4.0), 2), "cache": rng.choice(["none", "block", "dual"]),
            "max_new_tokens": rng.randint(1, 2), "temperature": rng.choice([0.0, 0.0, 0.7, 1.3]),
            "top_p": round(rng.uniform(0.3, 1.0), 2), "seed": rng.choice([-1, rng.randrange(2**31)]),
            "system_prompt": rng.choice(["", "You are a helpful assistant.", "Answer in one word."])}


def test_soak_sequential_generations(server, client, mode, sched):
    n = 120  # (200 until the suite neared its 15 minutes; RSS and threads settle within the first few dozen)
    rng = random.Random(6)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for _ in range(3):  # warm-up: allocator pools, the tokenizer, Gradio's per-session state
        client.predict("Hi", [], {"mode": mode, "max_new_tokens": 4}, api_name="/generate")
    before, threads_before = rss_mb(), threading.active_count()
    t0, peak = time.perf_counter(), before
    for i in range(n):
        s = _random_settings(rng, mode)
        turns = rng.choice([[], [], [], history])
        text, trace_json = client.predict(rng.choice(PROMPTS), turns, s, api_name="/generate")
        summary = Trace.loads(trace_json).summary
        assert summary.text == text and 1 <= summary.answer_tokens <= s["max_new_tokens"], (i, s, summary)
        if i % 25 == 24:
            peak = max(peak, rss_mb())
    seconds = time.perf_counter() - t0
    after = rss_mb()
    wait_until(lambda: idle(sched), 5)
    assert threading.active_count() <= threads_before + 2  # no decode worker left behind
    assert after - before < 200, (before, after)
    print(f"\n[reliability] soak: {n} generations in {seconds:.0f} s ({seconds / n * 1000:.0f} ms each); "
          f"RSS {before:.0f} -> {after:.0f} MB (peak {peak:.0f}, growth {after - before:+.1f} MB); "
          f"threads {threads_before} -> {threading.active_count()}")


# ---------------------------------------------------------------- bad input through the API
BAD_API = [
    # (message, history, settings, error text)
    ("", [], {}, "message: type a message first"),
    (" \n\t ", [], {}, "message: type a message first"),
    (None, [], {}, "message: must be text"),
    (42, [], {}, "message: must be text"),
    ("x" * 20_001, [], {}, "message: is longer than 20000 characters"),
    ("hi", "not a list", {}, "history: must be a list"),
    ("hi", [{"role": "user", "content": None}], {}, "history: message content must be text"),
    ("hi", [{"role": "system", "content": "obey"}], {}, "history: each message must be an object"),
    ("hi", [{"role": "user", "content": "y" * 19_999}] * 11, {}, "history: has more than 200000 characters"),
    ("hi", [], "fast please", "settings: must be an object"),
    ("hi", [], {"max_new_tokens": "8"}, "max_new_tokens: must be an integer"),
    ("hi", [], {"max_new_tokens": 10**9}, f"max_new_tokens: must be an integer in [1, {MAX_NEW_TOKENS}]"),
    ("hi", [], {"block_size": 12, "sub_block_size": 4}, "block_size: must be one of 8, 16, 32, 64"),
    ("hi", [], {"max_new_tokens": -1}, "max_new_tokens: must be an integer"),
    ("hi", [], {"threshold": "high"}, "threshold: must be a number"),
    ("hi", [], {"temperature": None}, "temperature: must be a number"),
    ("hi", [], {"top_p": 1.5}, "top_p: must be a number in (0, 1]"),
    ("hi", [], {"seed": 1.5}, "seed: must be -1 (a fresh random seed each run) or an integer in [0, 2^63)"),
    ("hi", [], {"seed": "abc"}, "seed: must be -1 (a fresh random seed each run) or an integer in [0, 2^63)"),
    ("hi", [], {"mode": None}, "mode: must be one of"),
    ("hi", [], {"cache": 3}, "cache: must be one of"),
    ("hi", [], {"block_size": 32, "sub_block_size": 0}, "sub_block_size: must be an integer"),
    ("hi", [], {"system_prompt": 7}, "system_prompt: must be a string"),
    ("hi", [], {"system_prompt": "s" * 20_001}, "system_prompt: is longer than 20000 characters"),
    ("hi", [], {"stop_token_ids": [2]}, "stop_token_ids: unknown setting"),
]


def test_bad_input_through_the_api_gets_a_clear_message(server, client, mode):
    from gradio_client.exceptions import AppError

    for message, history, settings, words in BAD_API:
        if isinstance(settings, dict) and "mode" not in settings:
            settings = {**settings, "mode": mode}
        with pytest.raises(AppError) as err:
            client.predict(message, history, settings, api_name="/generate")
        assert words in str(err.value) and "Traceback" not in str(err.value), (words, str(err.value))
    # longer than the model's context although under the character limit: the context in words
    big = "日本語の文章。" * 2_800  # 19,600 characters, well over 8,192 tokens
    with pytest.raises(AppError, match=r"message: the conversation has \d+ tokens; the model's context is \d+"):
        client.predict(big, [], {"mode": mode}, api_name="/generate")
    # what gradio_client cannot even send: NaN, infinities, lone surrogates (raw JSON on the REST API)
    raw = [('["hi", [], {"threshold": NaN}]', "threshold: must be a number"),
           ('["hi", [], {"max_new_tokens": Infinity}]', "max_new_tokens: must be an integer"),
           ('["hi", [], {"temperature": -Infinity}]', "temperature: must be a number"),
           ('["a\\ud800b", [], {}]', "message: is not valid Unicode (a lone surrogate at character 1)"),
           ('["hi", [{"role": "user", "content": "\\udfff"}], {}]', "history: is not valid Unicode"),
           ('["hi", [], {"system_prompt": "\\ud83d"}]', "system_prompt: is not valid Unicode")]
    for body, words in raw:
        event, data = call_raw(server, "generate", '{"data": ' + body + "}")
        assert event == "error" and words in data, (body, event, data)
    # the app keeps serving, and a conversation sent after the failures still works
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text, trace_json = client.predict("Say hello.", history, {"mode": mode, "max_new_tokens": 4}, api_name="/generate")
    assert Trace.loads(trace_json).summary.text == text
    print(f"\n[reliability] API: {len(BAD_API) + 1 + len(raw)} bad inputs, each refused with a message naming "
          "the field; the next request served")


def test_control_characters_and_markup_are_just_text(client, mode):
    message = "Repeat: \x00\x07\x1b[31mred\x1b[0m \u202eevil\u202c \u200b\r\n<script>alert(1)</script> |<MASK>| 🙂"
    text, trace_json = client.predict(message, [], {"mode": mode, "max_new_tokens": 4}, api_name="/generate")
    tr = Trace.loads(trace_json)
    assert tr.header["prompt"] == message and tr.summary.text == text
    assert Trace.loads(tr.dumps()).header["prompt"] == message  # the trace round-trips exactly


def test_hostile_traces_through_the_api(client):
    from gradio_client.exceptions import AppError

    cases = {
        '{"version": 1, "header": "nope"}': "trace:",
        '{"version": 1, "header": {"config": {"sub_block_size": 5}}, "events": []}': "trace: header.config",
        "[" * 50_000 + "]" * 50_000: "trace:",
        "<script>alert(1)</script>": "trace: not valid JSON",
        " " * (MAX_TRACE_BYTES + 1): "trace: file is",
    }
    for text, words in cases.items():
        with pytest.raises(AppError) as err:
            client.predict(text, api_name="/check_trace")
        assert str(err.value).startswith(words) and "Traceback" not in str(err.value), str(err.value)[:200]
    assert client.predict(api_name="/info")["banner"]  # still serving


# ---------------------------------------------------------------- bad input through the UI
def test_bad_input_through_the_ui_keeps_the_conversation(server, mode, tmp_path):
    import gradio as gr

    chat_ui = ui_handler(server, "chat_ui")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    kept = json.dumps(conv)
    bad = [("", {}, "message: type a message first"), ("   ", {}, "message: type a message first"),
           ("x" * 20_001, {}, "longer than 20000"), ("a\ud800b", {}, "not valid Unicode"),
           ("hi", {"max_new_tokens": "abc"}, "max_new_tokens"), ("hi", {"threshold": math.nan}, "threshold"),
           ("hi", {"seed": "x"}, "seed"), ("hi", {"temperature": None}, "temperature"),
           ("hi", {"block_size": 32, "sub_block_size": 5}, "sub_block_size: must divide"),
           ("hi", {"system_prompt": "\udc80"}, "system_prompt: is not valid Unicode"),
           ("日本語の文章。" * 2_800, {}, "the model's context is")]
    for message, over, words in bad:  # said inline beside the message box (#fd-send-error), nothing raised
        [out] = list(chat_ui(session("ui-bad"), message, conv, [], *widget_values(mode, **over)))
        [html] = [v for k, v in out.items() if getattr(k, "elem_id", None) == "fd-send-error"]
        assert 'class="fd-field-error"' in html and html_lib.escape(words, quote=True) in html, (words, html)
        assert not any(isinstance(k, gr.State) for k in out)  # the conversation state is not touched
    assert json.dumps(conv) == kept  # the conversation is untouched: the next turn continues it
    last = list(chat_ui(session("ui-bad"), "Say hello.", conv, [], *widget_values(mode)))[-1]
    [new_conv] = [v for k, v in last.items() if isinstance(k, gr.State) and v and "role" in v[0]]
    assert new_conv[:2] == conv and new_conv[2]["content"] == "Say hello." and len(new_conv) == 4

    upload = ui_handler(server, "upload_trace")
    good = json.loads(Trace.loads(json.dumps(_small_trace())).dumps())
    files = {
        "wrong schema": json.dumps({"version": 1, "header": {"prompt": XSS}, "events": "all of them"}),
        "not json": "<html><script>alert(1)</script></html>",
        "not utf-8": b"\xff\xfe\x00<",
        "bad number": json.dumps(good).replace('"t": 0.01', '"t": 1e999'),
    }
    traces = [{"label": "earlier", "json": json.dumps(good), "path": "", "key": "", "mode": "ar"}]
    for name, data in files.items():
        p = tmp_path / f"{name}.json"
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        out = upload(str(p), traces)
        assert out[0] is traces and "Trace rejected: trace:" in out[-1] and "<script" not in out[-1], (name, out[-1])
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: no disk used
        f.truncate(MAX_TRACE_BYTES + 1)
    assert "larger than 20 MiB" in upload(str(huge), traces)[-1]
    assert "no file" in upload(None, traces)[-1]
    # a valid trace full of markup is accepted and shown as text
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(_small_trace(XSS)))
    out = upload(str(hostile), traces)
    new_traces, meta = out[0], out[-1]
    assert len(new_traces) == 2 and "<img" not in meta and "&lt;img" in meta
    path = Path(new_traces[-1]["path"]).resolve()
    assert path.parent == Path(tempfile.gettempdir()).resolve() and re.fullmatch(r"fastdllm-trace-\w+\.json", path.name)


def _small_trace(text: str = "ok") -> dict:
    cfg = {"mode": "ar", "block_size": 32, "sub_block_size": 8, "threshold": 0.9, "strategy": "threshold",
           "factor": 1.0, "cache": "dual", "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None,
           "stop_token_ids": [2]}
    ev = {"kind": "prefill", "row": 0, "nfe": 1, "block": 0, "sub_block": -1, "committed": [[0, 5, text, 0.9]],
          "masked": [], "text_delta": text, "t": 0.01}
    return {"version": 1, "header": {"model": text, "source": text, "adapter": False, "device": "cpu",
                                     "dtype": "float32", "config": cfg, "prompt": f"../../etc/{text}",
                                     "prompt_len": 5, "mask_token_id": None},
            "events": [ev], "summary": None}


# ---------------------------------------------------------------- fault injection
def test_engine_fault_mid_generation_is_reported_and_the_next_request_works(server, client, mode, sched,
                                                                           monkeypatch):
    import gradio as gr
    from gradio_client.exceptions import AppError

    from engine.decode import Decoder

    real = Decoder.step

    def faulty(self, batch):  # a decode step that fails on the scheduler's thread, after the prefill forward
        raise RuntimeError("injected engine fault")

    monkeypatch.setattr(Decoder, "step", faulty)
    with pytest.raises(AppError, match="decoding failed: injected engine fault"):
        client.predict("Count to ten.", [], {"mode": mode, "max_new_tokens": 8}, api_name="/generate")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    with pytest.raises(gr.Error, match="decoding failed: injected engine fault"):
        list(ui_handler(server, "chat_ui")(session("fault"), "Count to ten.", conv, [],
                                           *widget_values(mode, max_new_tokens=8)))
    assert len(conv) == 2
    wait_until(lambda: idle(sched), 5)
    monkeypatch.setattr(Decoder, "step", real)
    text, trace_json = client.predict("Say hello.", [], {"mode": mode, "max_new_tokens": 4}, api_name="/generate")
    assert Trace.loads(trace_json).summary.text == text


# ---------------------------------------------------------------- security
def test_no_trust_remote_code_anywhere():
    # any value but an explicit False; split so this file does not match itself
    needle = re.compile(r"trust_remote" + r"_code\s*=\s*(?!False\b)")
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in ROOT.rglob("*.py") if ".venv" not in p.parts
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if needle.search(line)]
    assert not hits, hits


def test_binds_to_loopback_unless_told_otherwise(server, monkeypatch):
    import importlib.util

    import gradio as gr

    import engine

    spec = importlib.util.spec_from_file_location("app_main", ROOT / "app.py")
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    launched: list[dict] = []
    queued: list[dict] = []
    monkeypatch.setattr(engine.Engine, "load", classmethod(lambda cls, *a, **k: server.engine))
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: launched.append(kw))
    real_queue = gr.Blocks.queue
    monkeypatch.setattr(gr.Blocks, "queue", lambda self, **kw: queued.append(kw) or real_queue(self, **kw))
    for var in ("GRADIO_SERVER_NAME", "FASTDLLM_QUEUE_SIZE", "GRADIO_SHARE"):
        monkeypatch.delenv(var, raising=False)
    main.main([])
    main.main(["--host", "0.0.0.0", "--queue-size", "3"])
    assert launched[0]["server_name"] == "127.0.0.1" and not launched[0].get("share")
    assert launched[1]["server_name"] == "0.0.0.0"
    assert [q for q in queued if q] == [{"max_size": 16}, {"max_size": 3}]  # Blocks() itself queues with {}
    assert server.url.startswith("http://127.0.0.1:")


def test_chat_escaping_has_no_markdown_gaps(server):
    """Backtick tricks that a regex split misreads must not let model HTML through the markdown renderer."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark")
    tricky = [f"`{XSS}``", f"\\`{XSS}`", "x ```\n<div onmouseover=alert(1)>hi</div>\n```", f"a ```{XSS}````",
              f"````\n{XSS}\n```", "<details open ontoggle=alert(1)>", f"[x](javascript:alert(1)) {XSS}",
              f"*{XSS}*", f"> {XSS}", f"    {XSS}", f"<!-- {XSS} -->", f"``{XSS}`"]
    for t in tricky:
        shown = render.chat_display([{"role": "assistant", "content": t}])[0]["content"]
        html = md.render(shown)
        assert not re.search(r"<(img|div|details|script)\b|href=\"javascript", html), (t, shown, html)
    kept = render.escape_chat(f"see `a<b>` and\n```html\n{XSS}\n```\n")
    assert f"```html\n{XSS}\n```" in kept  # well-formed code is still shown literally, not as &lt;
    chatbot = [b for b in server.demo.blocks.values() if getattr(b, "elem_id", None) == "fd-chat"][0]
    assert chatbot.sanitize_html  # Gradio's own sanitiser stays on behind the escaping


def test_download_names_never_come_from_user_input():
    from app.ui import _entry

    tr = Trace.loads(json.dumps(_small_trace("../../../../tmp/evil")))
    [e] = _entry(tr, [], "chat · ")
    path = Path(e["path"]).resolve()
    assert path.parent == Path(tempfile.gettempdir()).resolve() and re.fullmatch(r"fastdllm-trace-\w+\.json", path.name)
    assert json.loads(path.read_text())["header"]["prompt"] == "../../etc/../../../../tmp/evil"
    os.unlink(path)
