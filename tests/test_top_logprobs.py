"""top_logprobs (issue 24): every committed token can carry the k most likely tokens of the distribution it was
committed from (DecodeConfig.top_logprobs, Token.top), after the repetition knobs, temperature and top-p, as vLLM's
`processed_logprobs`. Real bundled model (fp32 weights in the suite)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine.config import ConfigError, DecodeConfig
from engine.driver import Driver
from engine.events import Token
from engine.likelihood import token_logprobs
from engine.scheduler import batch_key
from engine.sampling import LOGPROB_FLOOR, alternatives

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def ids(engine, text: str) -> list[int]:
    return engine.encode(engine.chat_prompt([{"role": "user", "content": text}]))


def committed(engine, p: list[int], cfg) -> tuple[list[Token], list[int]]:
    """The answer's committed tokens in answer order (through the stop token), and its token ids."""
    seen: dict[int, Token] = {}
    res = engine.generate_ids([p], cfg, listener=lambda e: seen.update({t.pos: t for t in e.committed}),
                              record=False)[0]
    ans = res.summary.token_ids
    return [seen[i] for i in range(len(ans))], ans


def ordered(t: Token, k: int) -> None:
    """k distinct alternatives, most likely first, each with its own piece of text; never the mask token."""
    assert t.top is not None and len(t.top) == k
    assert len({i for i, _, _ in t.top}) == k
    assert [v for *_, v in t.top] == sorted((v for *_, v in t.top), reverse=True)


def test_ar_alternatives_are_the_models_next_token_distribution(engine):
    """AR, greedy: the alternatives at each answer token are the model's own top 5 of p(x_q | x_<q), as scoring the
    finished sequence in one causal forward gives them (engine/likelihood.py), and the committed token is the first,
    with ln(its confidence)."""
    p = ids(engine, "Name three colors.")
    toks, ans = committed(engine, p, engine.decode_config(mode="ar", max_new_tokens=12, top_logprobs=5))
    want = token_logprobs(engine.lm, p + ans, len(p), "ar", top=5)
    assert len(toks) == len(want) == len(ans) > 3
    for t, w in zip(toks, want):
        ordered(t, 5)
        assert [i for i, _, _ in t.top] == [i for i, _ in w.top]
        assert [v for *_, v in t.top] == pytest.approx([v for _, v in w.top], abs=1e-3)
        assert t.top[0][0] == t.id and t.top[0][2] == pytest.approx(math.log(t.conf), abs=1e-6)
        assert [s for _, s, _ in t.top] == [engine.tb.piece(i) for i, _, _ in t.top]


def test_diffusion_alternatives_batched_as_alone_and_only_where_asked(engine):
    """Block diffusion on the dual cache: each committed token heads its own alternatives. top_logprobs is a row's
    own setting (not in the batch key): a row that asks for 4 batched beside one that asks for none gets the same
    tokens and alternatives as alone, and the other row carries none."""
    p, q = ids(engine, "List the days of the week."), ids(engine, "Name three animals.")
    cfg = engine.decode_config(mode="diffusion", max_new_tokens=24, top_logprobs=4)
    alone, ans = committed(engine, p, cfg)
    assert len(alone) > 4 and engine.lm.mask_token_id not in {i for t in alone for i, _, _ in t.top}
    for t in alone:
        ordered(t, 4)
        assert t.top[0][0] == t.id and t.top[0][2] == pytest.approx(math.log(t.conf), abs=1e-6)
    got: dict[int, dict[int, Token]] = {0: {}, 1: {}}
    sched = Driver(engine)
    try:
        with sched._cv:  # both in the waiting line before the worker looks: one admission, one batch
            tickets = [sched.submit(x, c, listener=lambda e, k=k: got[k].update({t.pos: t for t in e.committed}),
                                    record=False)
                       for k, (x, c) in enumerate(((p, cfg), (q, replace(cfg, top_logprobs=0))))]
        results = [t.wait(120) for t in tickets]
    finally:
        sched.close()
    assert results[0].summary.token_ids == ans
    batched = [got[0][i] for i in range(len(ans))]
    for a, b in zip(alone, batched):
        assert [i for i, _, _ in a.top] == [i for i, _, _ in b.top]
        assert [v for *_, v in a.top] == pytest.approx([v for *_, v in b.top], abs=1e-4)
    assert all(t.top is None for t in got[1].values()) and got[1]
    assert batch_key(cfg) == batch_key(replace(cfg, top_logprobs=0))  # one key: the two shared the batch


def test_alternatives_follow_the_repetition_knobs(engine):
    """A penalty changes the distribution tokens are committed from; the alternatives are read from that one, so
    greedy answers still head their own lists where the penalty moved the argmax (the answers differ)."""
    p = ids(engine, "Repeat the word 'cat' ten times.")
    plain = engine.decode_config(mode="ar", max_new_tokens=16, top_logprobs=2)
    _, ans_plain = committed(engine, p, plain)
    toks, ans = committed(engine, p, engine.decode_config(mode="ar", max_new_tokens=16, top_logprobs=2,
                                                          frequency_penalty=2.0))
    assert ans != ans_plain  # the penalty moved at least one argmax
    assert all(t.top[0][0] == t.id and t.top[0][2] == pytest.approx(math.log(t.conf), abs=1e-6) for t in toks)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_sampled_alternatives_are_the_nucleus(engine, mode):
    """temperature and top_p: the alternatives are the tempered nucleus, renormalised; tokens outside it have
    probability 0, written as LOGPROB_FLOOR (vLLM's -9999, JSON has no -inf), and the sampled token is inside it."""
    p = ids(engine, "Write a short poem about rain.")
    k = 20
    toks, _ = committed(engine, p, engine.decode_config(mode=mode, max_new_tokens=16, temperature=0.8, top_p=0.5,
                                                        seed=5, top_logprobs=k))
    cut = 0
    for t in toks:
        ordered(t, k)
        inside = [(i, v) for i, _, v in t.top if v > LOGPROB_FLOOR]
        assert t.id in {i for i, _ in inside}
        assert dict(inside)[t.id] == pytest.approx(math.log(t.conf), abs=1e-5)
        if len(inside) < k:  # the whole nucleus is listed: its probabilities sum to 1
            cut += 1
            assert sum(math.exp(v) for _, v in inside) == pytest.approx(1.0, abs=1e-4)
            assert all(v == LOGPROB_FLOOR for i, _, v in t.top[len(inside):])
    assert cut > 0


def test_outside_the_nucleus_the_next_most_likely_tokens_follow():
    """softmax(5, 4, 3, 2, 1, -inf) = .636, .234, .086, .032, .012, 0: top_p 0.5 keeps token 0 alone (probability 1);
    the alternatives after it are tokens 1 and 2 at LOGPROB_FLOOR, in the tempered order, not any floor token."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, float("-inf")], [1.0, 5.0, 4.0, 3.0, 2.0, 0.0]])
    ids_, lps = alternatives(logits, 1.0, 0.5, 3)
    assert ids_.tolist() == [[0, 1, 2], [1, 2, 3]]
    assert lps.tolist() == [[0.0, LOGPROB_FLOOR, LOGPROB_FLOOR]] * 2
    ids_, lps = alternatives(logits, 1.0, 0.9, 4)  # 0.636 + 0.234 + 0.086 reaches 0.9: three in the nucleus
    assert ids_[0].tolist() == [0, 1, 2, 3] and lps[0, 3] == LOGPROB_FLOOR
    assert float(lps[0, :3].exp().sum()) == pytest.approx(1.0, abs=1e-6)
    ids_, lps = alternatives(logits, 0.0, 1.0, 2)  # greedy: the plain softmax
    assert ids_[0].tolist() == [0, 1] and lps[0].tolist() == pytest.approx(torch.log_softmax(logits[0], -1)[:2].tolist(), abs=1e-6)


def test_the_cli_prints_them_with_json(engine, monkeypatch, capsys):
    """`python -m engine generate --json --top-logprobs K`: every answer token, through the stop token, with its
    log-probability and K alternatives headed by itself (greedy); refused without --json and out of range."""
    import json

    from engine import Engine
    from engine.__main__ import main

    e = Engine(engine.lm)
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: e))
    args = ["generate", "--prompt", "Name three colors.", "--mode", "ar", "--max-new-tokens", "8"]
    assert main([*args, "--json", "--top-logprobs", "3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [x["id"] for x in out["logprobs"]] == out["token_ids"] and len(out["token_ids"]) == out["tokens"] > 0
    for x in out["logprobs"]:
        assert len(x["top_logprobs"]) == 3 and x["top_logprobs"][0] == {"token": x["token"], "id": x["id"],
                                                                          "logprob": x["logprob"]}
    assert main([*args, "--json"]) == 0
    assert "logprobs" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--top-logprobs", "3"]) == 2 and "needs --json" in capsys.readouterr().err
    assert main([*args, "--json", "--top-logprobs", "21"]) == 2 and "top_logprobs" in capsys.readouterr().err


def test_top_logprobs_range_is_checked():
    assert DecodeConfig(top_logprobs=20).validate().top_logprobs == 20
    for v in (21, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"top_logprobs: must be an integer in \[0, 20\]"):
            DecodeConfig(top_logprobs=v).validate()


@pytest.mark.parametrize("mode,cache", [("ar", "dual"), ("diffusion", "block")])
def test_the_static_stepper_gives_the_same_alternatives(engine, mode, cache):
    """On the static-shape path (CUDA graphs on a GPU; forced here on the CPU) the alternatives are read from the
    stepper's logits the same way: the same tokens and alternatives as the dynamic path."""
    from engine import Engine

    p = ids(engine, "Name three colors.")
    cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=12, top_logprobs=3)
    dynamic, ans = committed(engine, p, cfg)
    eng = Engine(engine.lm, static=True)
    assert eng.stepper(engine.lm.dllm if mode == "diffusion" else engine.lm.base) is not None
    static, ans_s = committed(eng, p, cfg)
    assert ans_s == ans
    for a, b in zip(dynamic, static):
        assert [i for i, _, _ in a.top] == [i for i, _, _ in b.top]
        assert [v for *_, v in a.top] == pytest.approx([v for *_, v in b.top], abs=1e-4)
