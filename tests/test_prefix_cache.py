"""Prefix caching (engine/prefix_cache.py): K/V of prompt chunks already prefilled, reused by prompts that start with
the same tokens, with answers unchanged.

Decoder level, bit for bit: on a random fp32 model a prompt whose first chunks come from another prompt's prefill
holds the same K/V at every prompt position, and commits the same tokens at every forward, as when it prefills them
itself; AR and block diffusion. The store: the chunks it reuses are exactly those the scheduler would run as chunk
pieces (never the final piece's span), scopes (model, attention rule) never mix, a token mismatch is a miss, and
eviction keeps memory under the capacity, deepest chunk first. Scheduler level, on the bundled model: a
conversation's next turn reuses the previous turn's chunks (fewer forwards) and gets the answer it gets without a
prefix cache, AR and diffusion; /metrics reports the hits.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import DecodeConfig
from engine.decode import decoder_for
from engine.driver import Driver
from engine.model import KVCache
from engine.prefix_cache import PrefixCache, reusable
from engine.scheduler import Plan, Prefill, Scheduler, Ticket
from test_oracle import MASK, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tb():
    from transformers import AutoTokenizer

    from engine.text import TokenBytes
    from engine.weights import bundled_base_dir

    return TokenBytes(AutoTokenizer.from_pretrained(str(bundled_base_dir())))


# ---------------------------------------------------------------- which chunks may be reused
@pytest.mark.parametrize("chunk,grain", [(64, 64), (256, 256), (256, 64)])
def test_reusable_grains_are_the_schedulers_chunk_pieces(chunk, grain):
    """For every limit, reusable() counts exactly the grains the real scheduler plans (a pass's chunk is at most
    `chunk` positions of whole grains, the driver running one forward per grain) before its final piece."""
    for limit in range(1, 5 * chunk + 3):
        s = Scheduler(prefill_chunk=chunk, prefill_grain=grain)
        p = Prefill(("k",), Ticket([0], DecodeConfig(), None, None), limit=limit)
        s.prefills.append(p)
        grains, done = [], 0
        while True:
            plan = Plan()
            s._next_piece(plan)
            if plan.final is not None:
                break
            _, start, end = plan.chunk
            assert start == done and 0 < end - start <= chunk and (end - start) % grain == 0
            grains += [(lo, lo + grain) for lo in range(start, end, grain)]
            done = end
        assert grains == [(i * grain, (i + 1) * grain) for i in range(len(grains))]
        assert limit - done <= grain  # the final piece: at most a grain of prompt blocks, then the prompt's tail
        assert reusable(limit, grain) == len(grains), limit


# ---------------------------------------------------------------- decoder level, bit for bit
def prefill_and_decode(model, prompt, cfg, tb, store: PrefixCache, scope):
    """Prefill as the driver does (restore, chunk pieces saved, final piece), decode to the end; (events, K/V of
    the prompt positions after the prefill, positions restored)."""
    events = []
    dec = decoder_for(model, cfg, MASK, tb, listener=lambda e: events.append((e.kind, [(t.pos, t.id) for t in e.committed])))
    rows = dec.new_rows([prompt])
    c = store.chunk
    with torch.inference_mode():
        batch = dec.open_batch([prompt], rows)
        limit = dec.chunk_limit(rows)
        done = restored = store.restore(scope, prompt, limit, batch.cache)
        while limit - done > c:
            dec.prefill_chunk(batch, done, done + c)
            store.save(scope, prompt, done, batch.cache)
            done += c
        kv = (batch.cache.k[:, 0, :, :done].clone(), batch.cache.v[:, 0, :, :done].clone())
        batch = dec.prefill([prompt], rows, batch=batch, cached=done)
        while batch.rows:
            batch = dec.step(batch)
    return events, kv, restored


@pytest.mark.parametrize("mode,cache", [("ar", "dual"), ("diffusion", "block"), ("diffusion", "dual")])
def test_a_restored_prefix_is_bit_identical_and_decodes_the_same(tb, mode, cache):
    model = tiny(1)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, MASK, (100,), generator=g).tolist()
    a = shared + torch.randint(0, MASK, (41,), generator=g).tolist()
    b = shared + torch.randint(0, MASK, (67,), generator=g).tolist()
    cfg = DecodeConfig(mode=mode, cache=cache, block_size=16, sub_block_size=4, threshold=0.5, max_new_tokens=24,
                       stop_token_ids=())
    scope = (mode, 16)
    warm = PrefixCache(1 << 30, 32)
    prefill_and_decode(model, a, cfg, tb, warm, scope)  # fills chunks [0, 32), [32, 64), [64, 96), [96, 128)
    got, got_kv, restored = prefill_and_decode(model, b, cfg, tb, warm, scope)
    want, want_kv, none = prefill_and_decode(model, b, cfg, tb, PrefixCache(1 << 30, 32), scope)
    assert restored == 96 and none == 0  # b shares 100 tokens with a: three whole chunks
    assert warm.hit_tokens == 96
    assert torch.equal(got_kv[0], want_kv[0]) and torch.equal(got_kv[1], want_kv[1])  # every prompt position's K/V
    assert got == want and len([t for _, c in got for t in c]) == 24  # the same tokens at every forward


def test_scopes_do_not_mix_and_tokens_are_checked(tb):
    """Chunks of the AR causal prefill never serve a block-causal one (nor another model's); a stored chunk whose
    digest matched but whose tokens differ (a collision) is a miss."""
    model = tiny(1)
    prompt = list(range(5, 105))
    ar = DecodeConfig(mode="ar", block_size=16, sub_block_size=4, max_new_tokens=4, stop_token_ids=())
    store = PrefixCache(1 << 30, 32)
    prefill_and_decode(model, prompt, ar, tb, store, (id(model), "ARDecoder", 1))
    assert len(store.chunks) == 3
    room = KVCache(model.cfg, 1, 128, torch.device("cpu"), torch.float32)
    assert store.restore((id(model), "DiffusionDecoder", 16), prompt, 99, room) == 0
    assert store.restore((id(tiny(2)), "ARDecoder", 1), prompt, 99, room) == 0
    assert store.restore((id(model), "ARDecoder", 1), prompt, 99, room) == 96
    first = next(c for c in store.chunks.values() if c.tokens == tuple(prompt[:32]))
    first.tokens = (0,) + first.tokens[1:]  # as if another prefix had hashed to this digest
    assert store.restore((id(model), "ARDecoder", 1), prompt, 99, room) == 0


def test_eviction_keeps_under_capacity_deepest_chunk_first():
    cfg = tiny(1).cfg
    cache = KVCache(cfg, 1, 256, torch.device("cpu"), torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    one = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * cfg.head_dim * 4  # bytes of a 32-token chunk
    store = PrefixCache(3 * one, 32)
    x, y = list(range(160)), list(range(1000, 1160))
    for start in (0, 32, 64, 96):
        store.save("s", x, start, cache)
        assert store.bytes <= store.capacity
    assert store.evicted == 1 and store.restore("s", x, 159, cache) == 96  # the deepest chunk left, not the first
    store.save("s", y, 0, cache)  # another prompt's first chunk: x's deepest remaining chunk makes room
    assert store.evicted == 2 and store.restore("s", x, 159, cache) == 64
    assert store.restore("s", y, 159, cache) == 32
    with pytest.raises(ValueError, match="whole chunk"):
        store.save("s", x, 16, cache)
    assert PrefixCache(one - 1, 32).save("s", x, 0, cache) is None  # a chunk larger than the cache is not kept


# ---------------------------------------------------------------- scheduler level, the bundled model
def turn_prompts(engine) -> tuple[list[int], list[int]]:
    first = [{"role": "user", "content": "Here are my notes. " + "The meeting moved to Tuesday at ten. " * 40 +
              "What day is the meeting?"}]
    second = first + [{"role": "assistant", "content": "The meeting is on Tuesday at ten."},
                      {"role": "user", "content": "And what time?"}]
    return engine.encode(engine.chat_prompt(first)), engine.encode(engine.chat_prompt(second))


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_the_next_turn_reuses_the_last_turns_chunks_with_the_same_answer(engine, mode):
    one, two = turn_prompts(engine)
    assert two[:len(one)] == one and len(one) > 5 * 64
    cfg = engine.decode_config(mode=mode, max_new_tokens=12)
    answers, forwards = {}, {}
    for mib in (0, 64):
        d = Driver(engine, prefill_chunk=64, prefix_cache_mib=mib)
        try:
            d.generate_ids(one, cfg, record=False)
            before = d.forwards
            answers[mib] = d.generate_ids(two, cfg, record=False).summary
            forwards[mib] = d.forwards - before
            if mib:
                limit = len(one) - 1 if mode == "ar" else (len(one) - 1) // 32 * 32  # Decoder.chunk_limit
                assert d.prefixes.hit_tokens == reusable(limit, 64) * 64 > 0  # every chunk the first turn ran
                assert answers[mib].cached_tokens == d.prefixes.hit_tokens
                assert 0 < d.prefixes.bytes <= 64 << 20
            else:
                assert d.prefixes is None
        finally:
            d.close()
    assert answers[64].token_ids == answers[0].token_ids and answers[64].nfe == answers[0].nfe
    assert forwards[0] - forwards[64] == d.prefixes.hit_tokens // 64  # each reused chunk is a forward not run


def test_usage_and_metrics_report_prefix_cache_hits(engine):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's and vLLM's field) per request, and /metrics in total:
    a request after the same prompt, and n = 2 choices of one prompt (the second row's prefill finds the first's
    chunks), copy every reusable chunk."""
    from fastapi.testclient import TestClient

    from engine.serve import create_app
    from test_serve_surface import prom

    one, _ = turn_prompts(engine)
    d = Driver(engine, prefill_chunk=64, prefix_cache_mib=32)
    body = {"model": engine.lm.name, "prompt": one, "mode": "ar", "max_tokens": 2}
    try:
        with TestClient(create_app(engine, d)) as c:
            r = [c.post("/v1/completions", json=body) for _ in range(2)]
            assert all(x.status_code == 200 for x in r), r[0].text
            p = prom(c.get("/metrics").text)
            d.prefixes.clear()
            both = c.post("/v1/completions", json={**body, "n": 2})
            assert both.status_code == 200, both.text
    finally:
        d.close()
    reused = reusable(len(one) - 1, 64) * 64
    assert [x.json()["usage"]["prompt_tokens_details"] for x in r] == [{"cached_tokens": 0}, {"cached_tokens": reused}]
    assert p["fastdllm_prefix_cache_queried_tokens_total"] == 2 * reused
    assert p["fastdllm_prefix_cache_hit_tokens_total"] == reused  # the second request copied every reusable chunk
    assert 0 < p["fastdllm_prefix_cache_bytes"] <= 32 << 20
    assert both.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": reused}
    assert [ch["text"] for ch in both.json()["choices"]] == [r[0].json()["choices"][0]["text"]] * 2


def test_prompts_sent_together_share_their_chunks(engine):
    """Identical long prompts submitted in one pass: the first prefills the chunks, the others copy them when their
    own prefill starts; every answer is the one without a prefix cache."""
    one, _ = turn_prompts(engine)
    cfg = engine.decode_config(mode="diffusion", max_new_tokens=8)
    got = {}
    for mib in (0, 64):
        d = Driver(engine, prefill_chunk=64, prefix_cache_mib=mib)
        try:
            with d._cv:  # all admitted in one pass
                ts = [d.submit(one, cfg, record=False) for _ in range(3)]
            got[mib] = [t.wait(300).summary for t in ts]
        finally:
            d.close()
    reused = reusable((len(one) - 1) // 32 * 32, 64) * 64
    assert [s.cached_tokens for s in got[64]] == [0, reused, reused] and reused > 0
    assert [s.cached_tokens for s in got[0]] == [0, 0, 0]
    assert [s.token_ids for s in got[64]] == [s.token_ids for s in got[0]] == [got[0][0].token_ids] * 3


def test_the_driver_keeps_modes_models_and_block_sizes_apart(engine):
    """AR (the base, causal), diffusion at block 32 and at block 16 (the dLLM, block-causal) each prefill the same
    prompt's chunks themselves; the same settings again reuse theirs."""
    one, _ = turn_prompts(engine)
    d = Driver(engine, prefill_chunk=64, prefix_cache_mib=64)
    try:
        for cfg in (engine.decode_config(mode="ar", max_new_tokens=1),
                    engine.decode_config(mode="diffusion", max_new_tokens=1),
                    engine.decode_config(mode="diffusion", block_size=16, sub_block_size=8, max_new_tokens=1)):
            d.generate_ids(one, cfg, record=False)
            assert d.prefixes.hit_tokens == 0
        d.generate_ids(one, engine.decode_config(mode="diffusion", block_size=16, sub_block_size=8, max_new_tokens=1),
                       record=False)
        assert d.prefixes.hit_tokens == reusable((len(one) - 1) // 16 * 16, 64) * 64 > 0
    finally:
        d.close()


def test_the_engines_scheduler_reads_its_runtime_switch(engine, monkeypatch):
    """FASTDLLM_PREFIX_CACHE_MIB (the studio's only way to set it): 0 turns the cache off, N sets its capacity,
    unset gives the default; a bad value names the switch."""
    from dataclasses import replace

    from engine import Engine
    from engine.prefix_cache import PREFIX_CACHE_MIB
    from engine.runtime import Runtime, RuntimeConfigError

    for mib, want in ((0, None), (7, 7 << 20), (None, PREFIX_CACHE_MIB << 20)):
        e = Engine(engine.lm, runtime=replace(engine.runtime, prefix_cache_mib=mib))
        try:
            got = e.scheduler.prefixes
            assert (got.capacity if got else None) == want
        finally:
            e.close_scheduler()
    monkeypatch.setenv("FASTDLLM_PREFIX_CACHE_MIB", "-3")
    with pytest.raises(RuntimeConfigError, match="FASTDLLM_PREFIX_CACHE_MIB"):
        Runtime.from_env()
    monkeypatch.setenv("FASTDLLM_PREFIX_CACHE_MIB", "64")
    assert Runtime.from_env().prefix_cache_mib == 64


def test_the_engines_scheduler_reads_its_prefill_chunk_switch(engine, monkeypatch):
    """FASTDLLM_PREFILL_CHUNK sets the chunk of the engine's scheduler (on a CPU its forwards, and the cache's grain,
    stay 64 positions); not a multiple of 64 is refused naming the switch."""
    from dataclasses import replace

    from engine import Engine
    from engine.runtime import Runtime, RuntimeConfigError

    e = Engine(engine.lm, runtime=replace(engine.runtime, prefill_chunk=128))
    try:
        assert e.scheduler.prefill_chunk == 128 and e.scheduler.prefixes.chunk == e.scheduler.scheduler.prefill_grain == 64
    finally:
        e.close_scheduler()
    monkeypatch.setenv("FASTDLLM_PREFILL_CHUNK", "100")
    with pytest.raises(RuntimeConfigError, match="FASTDLLM_PREFILL_CHUNK: 100 must be a multiple of 64"):
        Runtime.from_env()
