"""The dual cache under batching: every row of a batch decodes exactly as it would alone.

A dual-cache row runs a whole-block forward (the refresh at a new sub-block, or the commit) or a sub-block step over
the block K/V its refresh wrote. A batch that ran one whole-block forward for every row whenever any row needed one
refreshed the others' K/V too, and their answers drifted from their single-user ones (issue 24: 10 of 16 served
answers differed). The decoder now groups the rows of a step by the width of their own forward
(engine/decode/diffusion.py, `_forwards`); these tests check the answers, forward by forward, with fp32 weights
(conftest.py), in a batch whose rows sit at different block starts and sub-blocks, and through the scheduler with
rows joining a running batch.
"""
from __future__ import annotations

import threading

import pytest

from engine.driver import Driver

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

LONG = ("Read this and tell me its main point in one sentence: the quick brown fox jumps over the lazy dog while the "
        "farmer watches from the porch, wondering why foxes ever bother with dogs that never move at all.")
MESSAGES = ["Name three colors.", "List five fruits and say which one is the sweetest.", LONG,
            "Explain photosynthesis in two sentences for a child of ten who likes plants and gardens and wants to know "
            "how leaves make food from light."]


def chat_ids(engine, messages: list[str]) -> list[list[int]]:
    return [engine.encode(engine.chat_prompt([{"role": "user", "content": m}])) for m in messages]


def forwards_of(result) -> list[tuple[str, list[int]]]:
    """(event kind, committed token ids) per forward of one row: its decode, step by step."""
    return [(e.kind, [t.id for t in e.committed]) for e in result.trace.events]


def batch_against_alone(engine, monkeypatch, ids: list[list[int]], cfg) -> tuple[list, list[tuple[int, int]]]:
    """Each prompt decoded alone, then all as one batch whose forward shapes are recorded; asserts every row of the
    batch made the same commits at every forward, the same tokens and NFE as alone. Returns (alone, shapes)."""
    alone = [engine.generate_ids([i], cfg)[0] for i in ids]
    shapes: list[tuple[int, int]] = []
    real = engine.lm.dllm.forward
    monkeypatch.setattr(engine.lm.dllm, "forward", lambda x, *a, **k: shapes.append(tuple(x.shape)) or real(x, *a, **k))
    batch = engine.generate_ids(ids, cfg)
    monkeypatch.undo()
    for i, (b, a) in enumerate(zip(batch, alone)):
        assert forwards_of(b) == forwards_of(a), f"row {i} ({len(ids[i])} prompt tokens)"
        assert b.summary.token_ids == a.summary.token_ids and b.summary.nfe == a.summary.nfe
    return alone, shapes


def test_a_dual_batch_gives_every_row_its_single_row_forwards(engine, monkeypatch):
    """Four rows at different block starts and sub-blocks: the same commits at every forward, tokens and NFE as
    each row alone; the batch ran whole-block and both sub-block widths, several in one step where rows differed."""
    ids = chat_ids(engine, MESSAGES)
    bs = 32
    assert len({len(i) // bs for i in ids}) > 1 and len({len(i) % bs // 8 for i in ids}) > 2, [len(i) for i in ids]
    cfg = engine.decode_config(mode="diffusion", cache="dual", block_size=bs, sub_block_size=8, threshold=0.9,
                               max_new_tokens=40)
    alone, shapes = batch_against_alone(engine, monkeypatch, ids, cfg)
    assert len({len(a.summary.token_ids) for a in alone}) > 1, "rows must finish at different forwards"
    steps = shapes[1:]  # after the prefill
    assert {w for _, w in steps} >= {8, 9, bs}, "whole-block forwards and both sub-block widths"
    assert len(steps) > max(a.summary.nfe for a in alone) - 1, "some step ran one forward per width"
    assert any(n < len(ids) for n, _ in steps), "some forward ran a part of the batch"


def test_rows_joining_a_running_dual_batch_decode_as_alone(engine):
    """Continuous batching: three requests submitted while a first one decodes join its batch (prefilled together,
    merged before its next forward) at other block positions; each answer equals its single-user one, and the four
    rows shared forwards. (Under the old policy three of the four answers here differed from their single-user ones.)"""
    first, *late = chat_ids(engine, [LONG, MESSAGES[0], MESSAGES[1], MESSAGES[3]])
    cfg = engine.decode_config(mode="diffusion", cache="dual", max_new_tokens=40)
    alone = [engine.generate_ids([i], cfg)[0] for i in [first, *late]]
    sched = Driver(engine)
    tickets: list = []
    joined = threading.Event()

    def on_first(e) -> None:  # on the worker thread: after the first row's second forward, the others arrive
        if e.nfe == 2 and not joined.is_set():
            joined.set()
            tickets.extend(sched.submit(i, cfg) for i in late)

    try:
        tickets.insert(0, sched.submit(first, cfg, listener=on_first))
        got = [t.wait(300) for t in [tickets[0]]] + [t.wait(300) for t in tickets[1:]]
        forwards = sched.forwards
    finally:
        sched.close()
    assert joined.is_set() and len(got) == 4
    for i, (g, a) in enumerate(zip(got, alone)):
        assert forwards_of(g) == forwards_of(a), f"request {i}"
        assert g.summary.token_ids == a.summary.token_ids and g.summary.nfe == a.summary.nfe
    assert got[0].summary.nfe > 4, "the first row was still decoding when the others joined"
    assert forwards < sum(a.summary.nfe for a in alone), "the rows shared forwards"


def test_dual_sparse_batches_decode_as_alone_with_narrower_sub_steps(engine, monkeypatch):
    """cache "dual-sparse" (its rule is tests/oracle.py's, checked in test_oracle.py): sub-block steps over only the
    positions they need, so forwards narrower than the dual window (sub-block + 1); rows of a batch grouped by
    those widths still get exactly their single-row forwards. The static path refuses it by name."""
    from engine import ConfigError, Engine

    ids = chat_ids(engine, MESSAGES)
    cfg = engine.decode_config(mode="diffusion", cache="dual-sparse", threshold=0.9, max_new_tokens=32)
    _, shapes = batch_against_alone(engine, monkeypatch, ids, cfg)
    widths = [w for _, w in shapes[1:]]
    assert min(widths) < 8 and 32 in widths, sorted(set(widths))
    with pytest.raises(ConfigError, match="cache.*dual-sparse.*dynamic path"):
        Engine(engine.lm, static=True).generate_ids([ids[0]], cfg)
