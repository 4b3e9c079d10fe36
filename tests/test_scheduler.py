"""The scheduler decides, the driver runs (issue 24's "one front door").

Policy, without a model: engine/scheduler.py's plans (admission, grouping by batch key, chunked-prefill order,
delivery) from tickets of plain token ids, and it imports neither the engine nor the driver. Through the engine's
driver on the bundled model (fp32): rows that join a running batch, one of them a chunk-prefilled long prompt, give
their single-user answers; the static stepper of each key is Engine.new_stepper's; the CLI decodes through the
same driver.
"""
from __future__ import annotations

import ast
import json
import threading
from pathlib import Path

import pytest

from engine.config import DecodeConfig
from engine.decode import decoder_for, keeps_cache
from engine.driver import Driver
from engine.events import Summary
from engine.scheduler import Scheduler, SchedulerBusy, Ticket, batch_key

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

ROOT = Path(__file__).resolve().parents[1]
AR = DecodeConfig(mode="ar", max_new_tokens=8)
BLOCK = DecodeConfig(mode="diffusion", cache="block", max_new_tokens=8)


def ticket(n: int, cfg: DecodeConfig = AR) -> Ticket:
    return Ticket(list(range(n)), cfg, None, None)


def finished_row(t: Ticket) -> None:
    """What the driver leaves on a ticket whose row left its batch: a row with a summary."""
    from types import SimpleNamespace

    t.row = SimpleNamespace(summary=Summary(1, 1, 1.0, 0.1, 10.0, 0.1, "max_new_tokens", "x", [7]))


# ---------------------------------------------------------------- policy, no model
def test_the_scheduler_imports_neither_the_engine_nor_the_driver():
    tree = ast.parse((ROOT / "engine" / "scheduler.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"engine", "driver", "engine.engine", "engine.driver"}, imported
    assert "torch" not in imported  # no tensors: it decides, the driver runs


def test_admission_is_fifo_per_key_and_a_full_batch_holds_back_only_its_own_key():
    s = Scheduler(max_batch=2)
    a1, a2, a3 = ticket(5), ticket(6), ticket(7)
    b1 = ticket(5, BLOCK)
    gone = ticket(5)
    gone.cancel()
    for t in (a1, a2, a3, b1, gone):
        s.add(t)
    plan = s.schedule()
    assert plan.join == {batch_key(AR): [a1, a2], batch_key(BLOCK): [b1]}  # one prefill per key
    assert plan.unstarted == [gone]  # cancelled while waiting: admitted past a full batch, finished unstarted
    assert list(s.waiting) == [a3] and plan.step == [batch_key(AR), batch_key(BLOCK)]
    assert s.schedule().join == {}  # the AR batch is still full
    finished_row(a1)
    s.retire()
    assert a1.finished.is_set() and a1.wait(0).summary.token_ids == [7]
    assert s.schedule().join == {batch_key(AR): [a3]}  # a row left: the next one joins the running batch
    assert s.groups[batch_key(AR)] == [a2, a3]


def test_keys_differ_by_forward_settings_only():
    seeded = DecodeConfig(mode="ar", max_new_tokens=99, seed=3, repetition_penalty=1.2, no_repeat_ngram_size=2)
    assert batch_key(seeded) == batch_key(AR) != batch_key(BLOCK)  # per-row knobs share a batch


def test_a_long_prompt_is_chunked_after_the_driver_opens_it_then_joins_its_batch():
    s = Scheduler(prefill_chunk=64)
    long, short = ticket(200), ticket(10)
    s.add(long)
    s.add(short)
    plan = s.schedule()
    [p] = plan.open
    assert p.ticket is long and plan.join == {batch_key(AR): [short]} and plan.chunk is None  # not opened yet
    p.limit = 199  # the driver opened its row: AR may cache up to the last prompt position
    pieces = []
    for _ in range(3):
        plan = s.schedule()
        pieces.append(plan.chunk[1:])
        assert plan.final is None and plan.step == [batch_key(AR)]
    assert pieces == [(0, 64), (64, 128), (128, 192)]  # one chunk a pass, between the batch's steps
    plan = s.schedule()
    assert plan.chunk is None and plan.final is p and p.done == 192  # the rest fits one forward: the final prefill
    assert s.groups[batch_key(AR)] == [short, long] and not s.prefills


def test_a_cancelled_or_failed_prefill_leaves_and_the_none_cache_is_never_chunked():
    s = Scheduler(prefill_chunk=64)
    none = DecodeConfig(mode="diffusion", cache="none", max_new_tokens=8)
    a, b, c = ticket(300), ticket(300), ticket(300, none)
    for t in (a, b, c):
        s.add(t)
    plan = s.schedule()
    assert [p.ticket for p in plan.open] == [a, b] and plan.join == {batch_key(none): [c]}
    for p in plan.open:
        p.limit = 299
    a.cancel()
    assert s.schedule().unstarted == [a]  # cancelled mid-prefill: no answer was started
    s.fail([b], RuntimeError("boom"))
    assert not s.prefills and b.finished.is_set()
    with pytest.raises(RuntimeError, match="boom"):
        b.wait(0)


def test_delivery_counts_in_flight_and_a_fault_keeps_answers_already_finished():
    s = Scheduler(max_waiting=2)
    t1, t2 = ticket(5), ticket(6)
    s.add(t1)
    s.add(t2)
    with pytest.raises(SchedulerBusy, match="2 requests are waiting"):
        s.add(ticket(7))
    s.schedule()
    assert s.live == 2 and s.has_work()
    finished_row(t1)
    s.fail(list(s.groups[batch_key(AR)]), RuntimeError("engine fault"))
    assert t1.wait(0).summary.token_ids == [7]  # its row had finished: that answer stands
    with pytest.raises(RuntimeError, match="engine fault"):
        t2.wait(0)
    assert s.live == 0 and not s.has_work()


@pytest.mark.parametrize("cfg", [AR, BLOCK, DecodeConfig(mode="diffusion", cache="dual"),
                                 DecodeConfig(mode="diffusion", cache="none")])
def test_keeps_cache_is_the_decoders_own_answer(cfg):
    from test_oracle import MASK, tiny

    assert keeps_cache(cfg) == decoder_for(tiny(1), cfg, MASK, None).uses_cache()


# ---------------------------------------------------------------- the driver, on the bundled model

def chat(engine, text: str) -> list[int]:
    return engine.encode(engine.chat_prompt([{"role": "user", "content": text}]))


def test_a_request_is_in_flight_from_submit_to_result_also_while_it_prefills(engine):
    """A row being prefilled has left `waiting`; a caller asking "is the engine busy?" must still see it (reading
    the lines raced with admission: a CI failure of the disconnect test)."""
    ids = chat(engine, "Name three animals.")
    cfg = engine.decode_config(mode="diffusion", cache="block", max_new_tokens=8, temperature=0.0)
    seen: list[tuple[int, int]] = []
    sched = Driver(engine)
    try:
        def listener(_event) -> None:  # runs on the worker thread; the first call comes from the prefill
            if not seen:
                seen.append((sched.in_flight, len(sched.waiting)))
        t = sched.submit(ids, cfg, listener=listener, record=False)
        t.wait(120)
        assert seen == [(1, 0)]  # mid-admission: out of the waiting line, still in flight
        assert sched.in_flight == 0
        with sched._cv:  # a request cancelled before admission finishes without decoding, and is counted out
            c = sched.submit(ids, cfg, record=False)
            c.cancel()
            assert sched.in_flight == 1
        assert c.wait(60).summary.stop_reason == "cancelled" and sched.in_flight == 0
    finally:
        sched.close()


@pytest.mark.parametrize("mode,cache", [("ar", "dual"), ("diffusion", "block")])
def test_rows_joining_mid_batch_through_the_driver_decode_as_alone(engine, mode, cache):
    """While a first row decodes, a short request and a chunk-prefilled long prompt arrive: both join its running
    batch, and every answer (tokens and NFE) is its single-user one; the rows shared forwards."""
    first, short = chat(engine, "Write a long story about a dragon."), chat(engine, "Name three colors.")
    long = chat(engine, "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 25)
    assert len(long) > 192
    cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=24)
    alone = [engine.generate_ids([i], cfg, record=False)[0].summary for i in (first, short, long)]
    sched = Driver(engine, prefill_chunk=64)
    tickets: list[Ticket] = []
    joined = threading.Event()

    def on_first(e) -> None:  # on the worker thread, between forwards: the others arrive mid-batch
        if e.nfe == 2 and not joined.is_set():
            joined.set()
            tickets.extend(sched.submit(i, cfg, record=False) for i in (short, long))

    try:
        tickets.insert(0, sched.submit(first, cfg, listener=on_first, record=False))
        got = [tickets[0].wait(300).summary] + [t.wait(300).summary for t in tickets[1:]]
        forwards = sched.forwards
    finally:
        sched.close()
    assert joined.is_set() and alone[0].nfe > 3
    for g, a in zip(got, alone):
        assert (g.token_ids, g.nfe) == (a.token_ids, a.nfe)
    assert forwards < sum(a.nfe for a in alone) + len(long) // 64, "the rows shared forwards"


def test_the_driver_asks_engine_new_stepper_once_per_batch_key(engine, monkeypatch):
    from engine import Engine

    e = Engine(engine.lm)
    asked = []
    monkeypatch.setattr(e, "new_stepper", lambda model: asked.append(model))  # decides "no static path" here
    cfgs = [engine.decode_config(mode="ar", max_new_tokens=3), engine.decode_config(mode="ar", max_new_tokens=5),
            engine.decode_config(mode="diffusion", cache="block", max_new_tokens=3)]
    sched = e.start_scheduler()
    try:
        for c in cfgs:
            sched.generate_ids(chat(engine, "Hi"), c, record=False)
    finally:
        e.close_scheduler()
    assert asked == [engine.lm.base, engine.lm.dllm]  # one per key (the two AR configs share one)
    assert set(sched.steppers) == {batch_key(cfgs[0]), batch_key(cfgs[2])}


def test_the_cli_decodes_through_the_engines_driver(engine, monkeypatch, capsys):
    """`python -m engine generate` submits to Engine.scheduler (the server's and studio's front door) and prints
    the single-user answer."""
    from engine import Engine
    from engine.__main__ import main

    e = Engine(engine.lm)
    submitted = []
    real = Driver.submit
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: e))
    monkeypatch.setattr(Driver, "submit", lambda self, *a, **k: submitted.append(self) or real(self, *a, **k))
    assert main(["generate", "--prompt", "Name three colors.", "--json", "--mode", "ar", "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = engine.decode_config(mode="ar", max_new_tokens=6)
    direct = engine.generate_ids([chat(engine, "Name three colors.")], cfg, record=False)[0].summary
    assert len(submitted) == 1 and out["token_ids"] == direct.token_ids
    assert e._scheduler is None  # the CLI closed its driver


@pytest.mark.parametrize("mode,cache", [("ar", "dual"), ("diffusion", "dual")])
def test_prompts_admitted_together_are_prefilled_by_length(engine, mode, cache, monkeypatch):
    """Requests that join in one pass with prompts of unlike lengths get prefill forwards of their own (driver.py
    PREFILL_BUCKET), shortest first, instead of one forward padded to the longest prompt; every answer is still its
    single-user one."""
    from engine.decode import Decoder

    short = [chat(engine, "Name three colors."), chat(engine, "Name two animals.")]
    long = chat(engine, "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 8)
    assert len(long) // 32 > max(len(s) for s in short) // 32 + 1
    cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=12)
    alone = [engine.generate_ids([i], cfg, record=False)[0].summary for i in (*short, long)]
    prefills: list[tuple[int, int]] = []
    real = Decoder.prefill

    def prefill(self, prompts, rows, batch=None, cached=0):
        prefills.append((len(prompts), max(len(p) for p in prompts)))
        return real(self, prompts, rows, batch, cached)

    monkeypatch.setattr(Decoder, "prefill", prefill)
    sched = Driver(engine)
    try:
        with sched._cv:  # admitted in one pass
            tickets = [sched.submit(i, cfg, record=False) for i in (*short, long)]
        got = [t.wait(300).summary for t in tickets]
    finally:
        sched.close()
    assert prefills == [(2, max(len(s) for s in short)), (1, len(long))]
    for g, a in zip(got, alone):
        assert (g.token_ids, g.nfe) == (a.token_ids, a.nfe)
