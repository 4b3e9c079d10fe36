"""Repetition knobs (engine/penalties.py): exact against transformers and OpenAI's formula, then in the real engine
(bundled model, AR and block diffusion), the batch, the scheduler, the CLI and the OpenAI-compatible server.

Decodes are short (12 to 48 tokens) except the one that must show a loop going away (128, the issue's setting).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from engine.config import ConfigError, DecodeConfig
from engine.decode import decoder_for
from engine.finish import repeated_ngram_share
from engine.penalties import OFF, NgramIndex, Penalties, apply_scales, ban

KNOB_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size")
LOOPS = "Give me a simple recipe for pancakes, with ingredients and steps."  # loops at the paper's defaults (2 cups sugar, 2 cups sugar, ...; the step-816 adapter looped on a haiku too, the step-522 one ends it)
PROMPTS = ["List the days of the week in order.", "Name a colour.", "What is the capital of Italy?"]


def chat_ids(engine, prompt: str) -> list[int]:
    return engine.encode(engine.chat_prompt([{"role": "user", "content": prompt}]))


def repeated_ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    grams = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return [g for g, c in grams.items() if c > 1]


# ------------------------------------------------------------------ the logits processor, exactly
@pytest.mark.parametrize("p", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(p):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    v, b = 50, 3
    logits = torch.randn(b, v, generator=g) * 3
    prompt = torch.randint(0, v, (b, 7), generator=g)
    answer = torch.randint(0, v, (b, 5), generator=g)
    ref = RepetitionPenaltyLogitsProcessor(p)(torch.cat([prompt, answer], 1), logits.clone())
    got = apply_scales(logits[:, None], prompt.tolist(), answer.tolist(), [Penalties(repetition=p)] * b)[:, 0]
    assert torch.equal(got, ref)
    if p != 1.0:
        assert not torch.equal(got, logits)


def test_frequency_and_presence_follow_openai():
    """logit - count * frequency - (count > 0) * presence, over the answer's tokens only (prompt tokens are free);
    with a repetition penalty too, it comes first (vLLM's order)."""
    g = torch.Generator().manual_seed(1)
    v = 40
    logits = torch.randn(2, 3, v, generator=g)  # 2 rows, 3 candidate positions each
    prompt = [[1, 2, 3], [4, 4]]
    answer = [[5, 5, 5, 6, 1], [7]]
    pens = [Penalties(frequency=0.5, presence=0.3), Penalties(frequency=-0.4, presence=1.5)]
    got = apply_scales(logits, prompt, answer, pens)
    want = logits.clone()
    for r, (ans, pen) in enumerate(zip(answer, pens)):
        for t, c in Counter(ans).items():
            want[r, :, t] = want[r, :, t] - c * pen.frequency - float(c > 0) * pen.presence
    assert torch.equal(got, want)
    assert got[0, :, 2].equal(logits[0, :, 2])  # a prompt-only token: untouched
    both = apply_scales(logits, prompt, answer, [Penalties(1.5, 0.5, 0.3), OFF])
    rep = apply_scales(logits, prompt, answer, [Penalties(repetition=1.5), OFF])
    assert torch.equal(both[0], apply_scales(rep[:1], prompt[:1], answer[:1], [Penalties(frequency=0.5, presence=0.3)])[0])
    assert torch.equal(both[1], logits[1])  # a row with every knob off is untouched, bit for bit


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ngram_bans_equal_transformers_left_to_right(n):
    """AR: the index built from a prompt and grown token by token bans what NoRepeatNGramLogitsProcessor bans."""
    from transformers import NoRepeatNGramLogitsProcessor

    rng = random.Random(n)
    v = 6  # a small vocabulary: n-grams repeat often
    seq = [rng.randrange(v) for _ in range(40)]
    idx = NgramIndex(n, seq[:10], 40)
    for cur in range(10, 40):
        ref = NoRepeatNGramLogitsProcessor(n)(torch.tensor([seq[:cur]]), torch.zeros(1, v))
        assert {t for t in range(v) if ref[0, t] == float("-inf")} == idx.banned(cur), cur
        idx.add(cur, seq[cur])


def test_ngram_bans_any_window_of_known_tokens():
    """Diffusion: tokens known on either side of a masked position. banned(q) is exactly the set of tokens whose
    placing at q makes some complete n-gram repeat (brute force); creates_repeat agrees; committing out of order
    builds the same index as committing left to right."""
    rng = random.Random(7)
    v, n, length = 5, 3, 30
    for trial in range(30):
        full = [rng.randrange(v) for _ in range(length)]
        known = [t if (i < 6 or rng.random() < 0.6) else None for i, t in enumerate(full)]
        idx = NgramIndex(n, full[:6], length)
        order = [i for i in range(6, length) if known[i] is not None]
        rng.shuffle(order)
        for i in order:
            idx.add(i, known[i])
        assert idx.grams == {tuple(known[s:s + n]) for s in range(length - n + 1) if None not in known[s:s + n]}
        for q in (i for i in range(length) if known[i] is None):
            def repeats(t: int) -> bool:
                seq = known[:q] + [t] + known[q + 1:]
                new = [tuple(seq[s:s + n]) for s in range(max(0, q - n + 1), min(q, length - n) + 1)
                       if None not in seq[s:s + n]]
                return any(g in idx.grams for g in new) or len(set(new)) < len(new)
            want = {t for t in range(v) if repeats(t)}
            assert idx.banned(q) == want, (trial, q, known)
            assert all(idx.creates_repeat(q, t) == (t in want) for t in range(v))


def test_ban_sets_minus_inf_only_where_asked():
    x = torch.zeros(2, 3, 5)
    ban(x, [(0, 1, {2, 4}), (1, 2, {0}), (1, 0, {99})])  # 99: past the vocabulary, ignored
    assert sorted(map(tuple, torch.nonzero(x == float("-inf")).tolist())) == [(0, 1, 2), (0, 1, 4), (1, 2, 0)]


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize("field,value,needle", [
    ("repetition_penalty", 0, "(0, 10]"), ("repetition_penalty", 10.5, "(0, 10]"),
    ("repetition_penalty", "1.2", "(0, 10]"), ("frequency_penalty", -2.1, "[-2, 2]"),
    ("presence_penalty", 3, "[-2, 2]"), ("presence_penalty", float("nan"), "[-2, 2]"),
    ("no_repeat_ngram_size", -1, "[0, 64]"), ("no_repeat_ngram_size", 2.0, "[0, 64]"),
    ("no_repeat_ngram_size", True, "[0, 64]"), ("no_repeat_ngram_size", 65, "[0, 64]"),
])
def test_bad_values_name_the_field_and_range(field, value, needle):
    with pytest.raises(ConfigError) as e:
        DecodeConfig(**{field: value}).validate()
    assert e.value.field == field and str(e.value).startswith(field) and needle in str(e.value)


def test_defaults_off_and_round_trip(engine):
    d = DecodeConfig()
    assert (d.repetition_penalty, d.frequency_penalty, d.presence_penalty, d.no_repeat_ngram_size) == (1.0, 0.0, 0.0, 0)
    assert not Penalties.of(d).active
    cfg = DecodeConfig(repetition_penalty=1.2, frequency_penalty=-0.5, presence_penalty=2, no_repeat_ngram_size=3)
    assert DecodeConfig.from_dict(cfg.to_dict()) == cfg.validate()
    header = engine.trace_header([1, 2, 3], cfg, "p")
    assert DecodeConfig.from_dict(header["config"]) == cfg
    old = {k: v for k, v in DecodeConfig().to_dict().items() if k not in KNOB_FIELDS}  # a trace from before
    assert DecodeConfig.from_dict(old) == DecodeConfig()


# ------------------------------------------------------------------ the engine
def decoder_before_knobs(model, cfg, mask_id, tb):
    """The decoder as it was before the knobs: logits go straight to sampling."""
    dec = decoder_for(model, cfg, mask_id, tb)
    dec._penalised = lambda rows, logits, targets: logits
    return dec


def test_defaults_are_token_identical_to_before(engine, one_thread):
    """At the defaults nothing changes, token for token, AR and diffusion; and a knob set so it can never act
    (no 64-gram repeats in 10 tokens) also leaves the output alone, though it takes the penalised path."""
    for mode in ("ar", "diffusion"):
        cfg = engine.decode_config(mode=mode, max_new_tokens=10)
        model = engine.lm.dllm if mode == "diffusion" else engine.lm.base
        ids = [chat_ids(engine, p) for p in PROMPTS[:2]]
        now = [r.summary.token_ids for r in engine.generate_ids(ids, cfg, record=False)]
        before = [s.token_ids for s in decoder_before_knobs(model, cfg, engine.lm.mask_token_id, engine.tb).run(ids)]
        inert = decoder_for(model, cfg, engine.lm.mask_token_id, engine.tb).run(ids, [Penalties(no_repeat_ngram=64)] * 2)
        assert now == before == [s.token_ids for s in inert], mode


def test_ar_equals_transformers_generate_with_the_knobs(engine, one_thread):
    """AR decoding with repetition_penalty and no_repeat_ngram_size == transformers' generate() with the same
    arguments, token for token (their processors see prompt + output, as ours do)."""
    from transformers import AutoModelForCausalLM

    from engine.weights import bundled_base_dir

    hf = AutoModelForCausalLM.from_pretrained(bundled_base_dir(), dtype=torch.float32).eval()
    for kw in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 3}, {"repetition_penalty": 0.8, "no_repeat_ngram_size": 2}):
        cfg = engine.decode_config(mode="ar", max_new_tokens=20, **kw)
        ids = chat_ids(engine, PROMPTS[0])
        [res] = engine.generate_ids([ids], cfg, record=False)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=list(cfg.stop_token_ids),
                              pad_token_id=0, **kw)
        assert res.summary.token_ids == out[0, len(ids):].tolist(), kw
    plain = engine.generate_ids([ids], engine.decode_config(mode="ar", max_new_tokens=20), record=False)[0]
    assert plain.summary.token_ids != res.summary.token_ids  # the knobs did change this answer


@pytest.mark.parametrize("mode,extra", [("ar", {}), ("diffusion", {}), ("diffusion", {"threshold": 0.5, "cache": "block"})])
def test_no_repeat_ngram_3_never_repeats_a_token_trigram(engine, one_thread, mode, extra):
    """Prompt + answer hold no 3-gram twice that the answer takes part in, whatever order diffusion commits in
    (threshold 0.5 commits several tokens per step: their n-grams with each other are checked too); and without
    the knob the same decode does repeat one, so the test can fail."""
    ids = chat_ids(engine, PROMPTS[0])
    plen = len(ids)
    cfg = engine.decode_config(mode=mode, max_new_tokens=32, **extra)
    plain = engine.generate_ids([ids], cfg, record=False)[0].summary
    got = engine.generate_ids([ids], replace(cfg, no_repeat_ngram_size=3), record=False)[0].summary
    assert repeated_ngrams(ids + plain.token_ids, 3), "the plain decode should repeat a 3-gram on this prompt"
    seq = ids + got.token_ids
    prompt_grams = {tuple(ids[i:i + 3]) for i in range(plen - 2)}
    answer_grams = [tuple(seq[i:i + 3]) for i in range(max(0, plen - 2), len(seq) - 2)]
    assert len(got.token_ids) >= 8
    assert len(set(answer_grams)) == len(answer_grams) and not set(answer_grams) & prompt_grams, got.text


def test_repetition_penalty_breaks_a_loop(engine, one_thread):
    """A prompt the shipped adapter loops on, at the paper's settings (block 32, sub-block 8, threshold 0.9, dual cache, 128
    tokens): repetition_penalty 1.2 lowers the share of repeated word 4-grams."""
    cfg = engine.decode_config(block_size=32, sub_block_size=8, threshold=0.9, cache="dual", max_new_tokens=128)
    plain = engine.generate(LOOPS, cfg, record=False)[0].summary
    pen = engine.generate(LOOPS, replace(cfg, repetition_penalty=1.2), record=False)[0].summary
    before, after = repeated_ngram_share(plain.text), repeated_ngram_share(pen.text)
    print("repeated 4-gram share", before, "->", after, repr(pen.text))
    assert before > 0.3 and after < before / 2


@pytest.mark.parametrize("mode,cache", [("ar", "dual"), ("diffusion", "block")])
def test_batch_rows_with_different_knobs_equal_single_rows(engine, one_thread, mode, cache):
    """Each row of one batch applies its own knobs: equal to decoding it alone with those knobs (AR and the
    block-cache diffusion are exact batch == single; tests/test_serve.py)."""
    cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=12)
    model = engine.lm.dllm if mode == "diffusion" else engine.lm.base
    ids = [chat_ids(engine, p) for p in PROMPTS]
    pens = [Penalties(repetition=1.3), OFF, Penalties(frequency=0.7, presence=0.5, no_repeat_ngram=2)]
    dec = lambda: decoder_for(model, cfg, engine.lm.mask_token_id, engine.tb)  # noqa: E731
    batch = [s.token_ids for s in dec().run(ids, pens)]
    single = [dec().run([i], [p])[0].token_ids for i, p in zip(ids, pens)]
    assert batch == single
    assert batch[0] != dec().run(ids[:1])[0].token_ids  # the knob changed row 0, not only by coincidence


def test_scheduler_batches_rows_with_different_knobs(engine, one_thread):
    """Requests differing only in their knobs share forwards and each gets its own knobs' answer."""
    from engine.driver import Driver
    from engine.scheduler import batch_key

    base = engine.decode_config(mode="ar", max_new_tokens=12)
    cfgs = [base, replace(base, repetition_penalty=1.5, no_repeat_ngram_size=2)]
    assert batch_key(cfgs[0]) == batch_key(cfgs[1])
    ids = chat_ids(engine, PROMPTS[0])
    alone = [engine.generate_ids([ids], c, record=False)[0].summary.token_ids for c in cfgs]
    assert alone[0] != alone[1]
    sched = Driver(engine)
    try:
        with engine.lock:  # hold the worker until both are queued, so they are admitted together
            tickets = [sched.submit(ids, c) for c in cfgs]
        got = [t.wait(120).summary.token_ids for t in tickets]
        assert got == alone
        assert sched.forwards <= max(map(len, alone)) + 2  # shared steps, not two decodes
        assert [t.result.trace.header["config"]["repetition_penalty"] for t in tickets] == [1.0, 1.5]
    finally:
        sched.close()


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_static_stepper_honours_the_knobs(engine, one_thread, mode):
    """The static-shape (CUDA graph) stepper returns logits and the decoder penalises them as it does eager ones:
    same tokens with the knobs on, and different from the same static decode without them (on CPU the stepper
    runs eagerly; on CUDA the same code runs through graphs)."""
    from engine import Engine

    static = Engine(engine.lm, static=True)
    cfg = engine.decode_config(mode=mode, max_new_tokens=12)
    knobs = replace(cfg, repetition_penalty=1.3, frequency_penalty=0.3, no_repeat_ngram_size=2)
    eager = engine.generate(PROMPTS[0], knobs, record=False)[0].summary.token_ids
    got = static.generate(PROMPTS[0], knobs, record=False)[0].summary.token_ids
    assert static.stepper(engine.lm.base if mode == "ar" else engine.lm.dllm).shapes, "the static path was not used"
    assert got == eager
    assert got != static.generate(PROMPTS[0], cfg, record=False)[0].summary.token_ids


# ------------------------------------------------------------------ CLI and server
def test_cli_flags(engine, capsys):
    from engine.__main__ import _config, main, parser

    a = parser().parse_args(["generate", "--prompt", "x", "--repetition-penalty", "1.2", "--frequency-penalty", "0.5",
                             "--presence-penalty", "-0.25", "--no-repeat-ngram-size", "3"])
    cfg = _config(engine, a)
    assert (cfg.repetition_penalty, cfg.frequency_penalty, cfg.presence_penalty, cfg.no_repeat_ngram_size) == (1.2, 0.5, -0.25, 3)
    d = _config(engine, parser().parse_args(["generate", "--prompt", "x"]))
    assert not Penalties.of(d).active
    assert main(["generate", "--prompt", "x", "--no-repeat-ngram-size", "-2"]) == 2  # refused before loading weights
    assert "no_repeat_ngram_size: must be an integer in [0, 64]" in capsys.readouterr().err


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from engine.driver import Driver
    from engine.serve import create_app

    sched = Driver(engine)
    with TestClient(create_app(engine, sched)) as c:
        yield c
    sched.close()


@pytest.mark.parametrize("chat", [True, False])
def test_server_accepts_the_knobs(engine, client, one_thread, chat):
    body = {"model": engine.lm.name, "max_tokens": 8, "denoise_events": True, "frequency_penalty": 0.5,
            "presence_penalty": 0.25, "repetition_penalty": 1.1, "no_repeat_ngram_size": 3}
    body |= {"messages": [{"role": "user", "content": PROMPTS[0]}]} if chat else {"prompt": PROMPTS[0]}
    r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    header = r.json()["trace"]["header"]["config"]
    assert {k: header[k] for k in KNOB_FIELDS} == {k: body[k] for k in KNOB_FIELDS}
    nulls = {k: None for k in KNOB_FIELDS}  # null = the default (OpenAI clients may send it)
    r = client.post("/v1/chat/completions" if chat else "/v1/completions", json={**body, **nulls})
    assert r.status_code == 200 and not Penalties.of(DecodeConfig.from_dict(r.json()["trace"]["header"]["config"])).active


STUDIO = {"frequency_penalty": 0.3, "no_repeat_ngram_size": 4, "stop_guard": True}


def test_server_defaults_fill_what_a_request_leaves_out(engine, one_thread):
    """`serve --override-generation-config` (vLLM's option): a request without the knobs gets the server's; its own
    values win; null means "not given"."""
    from fastapi.testclient import TestClient

    from engine.driver import Driver
    from engine.serve import create_app

    sched = Driver(engine)
    try:
        with TestClient(create_app(engine, sched, defaults={**STUDIO, "max_new_tokens": 6})) as c:
            def config(**extra):
                body = {"model": engine.lm.name, "denoise_events": True, "prompt": PROMPTS[0], **extra}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["trace"]["header"]["config"], r.json()["usage"]["completion_tokens"]
            cfg, used = config()
            assert {k: cfg[k] for k in STUDIO} == STUDIO and cfg["max_new_tokens"] == 6 and used <= 6
            cfg, _ = config(frequency_penalty=0.0, stop_guard=False, max_tokens=4)  # the request's own win
            assert (cfg["frequency_penalty"], cfg["stop_guard"], cfg["no_repeat_ngram_size"], cfg["max_new_tokens"]) == \
                (0.0, False, 4, 4)
            cfg, _ = config(frequency_penalty=None, stop_guard=None)  # null: not given, so the server's
            assert {k: cfg[k] for k in STUDIO} == STUDIO
        from engine.serve import ApiError, parse

        with pytest.raises(ApiError, match=r"block_size: must be a multiple of sub_block_size=16 \(its default"):
            parse({"model": engine.lm.name, "prompt": "hi", "block_size": 24}, False, engine, engine.lm.name,
                  {"sub_block_size": 16})  # the sub-block size it meets is the server's default, named as such
        for bad, words in [({"frequency_penalty": 3}, "override_generation_config: frequency_penalty: must be a number"),
                           ({"temprature": 0.5}, "override_generation_config: 'temprature' is not a decoding setting"),
                           ({"block_size": 12}, "override_generation_config: block_size: must be a multiple"),
                           ("[1]", "override_generation_config: must be a JSON object")]:
            with pytest.raises(ConfigError, match=words):
                create_app(engine, sched, defaults=bad)
    finally:
        sched.close()


def test_serve_cli_refuses_bad_defaults_before_loading(capsys):
    from engine.__main__ import main

    assert main(["serve", "--override-generation-config", "{not json"]) == 2
    assert "error: override_generation_config: must be a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("field,value,needle", [
    ("frequency_penalty", 2.5, "[-2, 2]"), ("presence_penalty", -3, "[-2, 2]"),
    ("repetition_penalty", 0, "(0, 10]"), ("no_repeat_ngram_size", 1.5, "[0, 64]"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_server_400_on_bad_knobs(engine, client, field, value, needle, chat):
    body = {"model": engine.lm.name, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field
    assert err["message"].startswith(field) and needle in err["message"], err
