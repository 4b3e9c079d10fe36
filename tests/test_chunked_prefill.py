"""Chunked prefill (issue 24): a long prompt prefilled a chunk per scheduler pass, so it delays the running batches
by one chunk's forward instead of its whole prefill.

Decoder level, exact: on random fp32 models (tests/test_oracle.py's) a prompt prefilled in whole-block chunks and
then by `prefill(..., cached=n)` decodes to the same committed tokens at every forward as one prefill, AR and block
diffusion (block and dual cache), prompts on and off the block grid. Scheduler level, on the bundled model: a short
request sent beside a long prompt gets its first token before the long prompt's prefill has finished, and the long
one's answer is its single-user answer.
"""
from __future__ import annotations

import threading

import pytest
import torch

from engine.config import DecodeConfig
from engine.decode import decoder_for
from engine.driver import Driver
from test_oracle import MASK, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def decode(model, prompt: list[int], cfg: DecodeConfig, tb, chunks: list[int] | None):
    """Committed (forward kind, [(position, token)]) per forward and the summary; `chunks`: prefill_chunk ends."""
    events = []
    dec = decoder_for(model, cfg, MASK, tb, listener=lambda e: events.append((e.kind, [(t.pos, t.id) for t in e.committed])))
    rows = dec.new_rows([prompt])
    with torch.inference_mode():
        batch, done = dec.open_batch([prompt], rows), 0
        for end in chunks or []:
            dec.prefill_chunk(batch, done, end)
            done = end
        batch = dec.prefill([prompt], rows, batch=batch, cached=done)
        while batch.rows:
            batch = dec.step(batch)
    return events, rows[0].summary


@pytest.fixture(scope="module")
def tb():
    from transformers import AutoTokenizer

    from engine.weights import bundled_base_dir
    from engine.text import TokenBytes

    return TokenBytes(AutoTokenizer.from_pretrained(str(bundled_base_dir())))


@pytest.mark.parametrize("mode,cache,length", [("ar", "dual", 77), ("diffusion", "block", 77), ("diffusion", "dual", 77),
                                               ("diffusion", "dual", 96), ("diffusion", "block", 65)])
def test_chunked_prefill_decodes_exactly_as_one_prefill(tb, mode, cache, length):
    model = tiny(1)
    prompt = torch.randint(0, MASK, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    cfg = DecodeConfig(mode=mode, cache=cache, block_size=16, sub_block_size=4, threshold=0.5, max_new_tokens=24,
                       stop_token_ids=())
    dec = decoder_for(model, cfg, MASK, tb)
    limit = dec.chunk_limit(dec.new_rows([prompt]))
    assert limit == (length - 1 if mode == "ar" else (length - 1) // 16 * 16)
    whole_events, whole = decode(model, prompt, cfg, tb, None)
    pieces = [e for e in (16, 32, 48, 64) if e <= limit]
    chunked_events, chunked = decode(model, prompt, cfg, tb, pieces)
    assert chunked.token_ids == whole.token_ids and len(whole.token_ids) == 24
    assert chunked_events == whole_events  # every forward commits the same tokens
    assert chunked.nfe == whole.nfe  # the chunks are one logical prefill


def test_prefill_chunk_refuses_pieces_off_the_grid_or_past_the_limit(tb):
    cfg = DecodeConfig(mode="diffusion", cache="block", block_size=16, sub_block_size=4, max_new_tokens=8)
    dec = decoder_for(tiny(1), cfg, MASK, tb)
    prompt = list(range(40))
    rows = dec.new_rows([prompt])
    with torch.inference_mode():
        batch = dec.open_batch([prompt], rows)
        for start, end in ((0, 8), (0, 48), (8, 16)):
            with pytest.raises(ValueError, match="prefill_chunk"):
                dec.prefill_chunk(batch, start, end)
    none = decoder_for(tiny(1), DecodeConfig(mode="diffusion", cache="none", block_size=16, sub_block_size=4), MASK, tb)
    assert not none.uses_cache()  # the scheduler never chunks a cache-less decode


def test_a_short_request_is_not_stuck_behind_a_long_prompt(engine):
    """The scheduler prefills a ~800-token prompt in 256-token chunks; a short request sent with it starts
    answering while the long one is still prefilling, and each answer equals its single-user answer."""
    long_ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Summarise this text. " +
                                                  "The quick brown fox jumps over the lazy dog. " * 80}]))
    short_ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Name three colors."}]))
    assert len(long_ids) > 700
    cfg = engine.decode_config(mode="ar", max_new_tokens=8)
    alone = {n: engine.generate_ids([i], cfg, record=False)[0].summary.token_ids
             for n, i in (("long", long_ids), ("short", short_ids))}
    order: list[str] = []
    lock = threading.Lock()

    def mark(name: str):
        def on(e) -> None:
            with lock:
                if name not in order:
                    order.append(name)
        return on

    sched = Driver(engine, prefill_chunk=256)
    try:
        with sched._cv:  # both admitted in one pass
            long = sched.submit(long_ids, cfg, listener=mark("long"), record=False)
            short = sched.submit(short_ids, cfg, listener=mark("short"), record=False)
        got = {"long": long.wait(300).summary.token_ids, "short": short.wait(300).summary.token_ids}
    finally:
        sched.close()
    assert order == ["short", "long"]  # the short answer's first token came while the long prompt prefilled
    assert got == alone
    assert sched.forwards >= 1 + len(long_ids) // 256  # the long prompt's chunks were forwards of their own


def test_a_long_prompt_cancelled_while_it_prefills_leaves_at_once(engine):
    """Stop during the chunks: the request ends 'cancelled' before its first token, no further chunk runs."""
    long_ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Summarise: " + "lorem ipsum " * 300}]))
    cfg = engine.decode_config(mode="ar", max_new_tokens=8)
    sched = Driver(engine, prefill_chunk=64)
    try:
        t = sched.submit(long_ids, cfg, record=False)
        while sched.forwards < 2:  # two chunks in, many to go
            t.finished.wait(0.01)
        t.cancel()
        res = t.wait(60).summary
        forwards = sched.forwards
    finally:
        sched.close()
    assert res.stop_reason == "cancelled" and res.answer_tokens == 0 and res.nfe == 0
    assert forwards < len(long_ids) // 64  # it did not prefill to the end
    assert sched.in_flight == 0
