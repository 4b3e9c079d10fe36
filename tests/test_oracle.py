"""Differential tests: the engine's decoder against the plain reference decoder in tests/oracle.py.

Every committed token of every forward (Event.committed), the answers and the stop reasons must be the oracle's,
exactly: cache "none" and "block" against the oracle without cache, "dual" and "dual-sparse" against the oracle's
stale-K/V rules,
in batches whose rows sit at different block starts (prompts of 5, 31, 32, 33 and 64 tokens), on small random
models over several seeds and on the bundled model. Random models are tiny (2 layers, vocab 128) with a sharpened
LM head, so confidences spread over (0, 1) and every threshold and the factor rule commit different sets.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings, strategies as st

import oracle
from engine.config import DecodeConfig, ModelConfig
from engine.decode import decoder_for
from engine.model import CausalLM
from engine.sampling import select_commits
from engine.text import TokenBytes

V = 128  # random models' vocabulary; the last row is the mask token
MASK = V - 1
LENGTHS = (5, 31, 32, 33, 64)  # before, at and after block boundaries of every block size used here
GRID = [(32, 8), (16, 4), (8, 8), (4, 2)]
RULES = [("threshold", 0.5, 1.0), ("threshold", 0.9, 1.0), ("threshold", 1.0, 1.0), ("factor", 0.9, 1.0),
         ("factor", 0.9, 3.0)]


@pytest.fixture(scope="module")
def tb():
    from transformers import AutoTokenizer

    from engine.weights import bundled_base_dir

    return TokenBytes(AutoTokenizer.from_pretrained(str(bundled_base_dir())))


@lru_cache(maxsize=None)
def tiny(seed: int) -> CausalLM:
    """A random 2-layer Qwen2-style model (QKV bias, GQA); the LM head is scaled up so some positions are
    confident (median max-probability ~0.7) and the commit rules have something to choose between."""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, attention_bias=True, rope_theta=10000.0)
    g = torch.Generator().manual_seed(seed)
    m = CausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))
        m.lm_head.weight.mul_(3.0)
    return m.eval()


@lru_cache(maxsize=None)
def tiny_case(seed: int) -> tuple[list[list[int]], int]:
    """Prompts of LENGTHS random tokens, and a stop token the model often predicts (so rows stop at different
    points, some with masks still before the stop token)."""
    g = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(0, MASK, (n,), generator=g).tolist() for n in LENGTHS]
    with torch.no_grad():
        top = tiny(seed)(torch.tensor([prompts[-1]]), torch.arange(64)[None], causal=True)[0, :, :MASK].argmax(-1)
    return prompts, int(top.mode().values)


def engine_run(model, prompts, cfg: DecodeConfig, mask_id: int, tb: TokenBytes, stepper=None):
    """The engine's decoder on a batch: summaries and, per row, (event kind, [(answer pos, token)]) per forward."""
    events: dict[int, list] = {}
    dec = decoder_for(model, cfg, mask_id, tb, listener=lambda e: events.setdefault(e.row, []).append(e), stepper=stepper)
    summaries = dec.run(prompts)
    steps = [[(e.kind, [(t.pos, t.id) for t in e.committed]) for e in events[i] if e.kind != "done"]
             for i in range(len(prompts))]
    for i, s in enumerate(summaries):  # never a position twice, never outside the answer, one event per forward
        pos = [p for _, c in steps[i] for p, _ in c]
        assert len(pos) == len(set(pos)) and all(0 <= p < cfg.max_new_tokens for p in pos), steps[i]
        assert len(steps[i]) == s.nfe and events[i][-1].kind == "done"
    return summaries, steps


def assert_matches_oracle(model, prompts, cfg: DecodeConfig, mask_id: int, tb: TokenBytes, stepper=None) -> list:
    summaries, steps = engine_run(model, prompts, cfg, mask_id, tb, stepper)
    runs = oracle.decode(model, prompts, mask_id=mask_id, stop_ids=set(cfg.stop_token_ids), block_size=cfg.block_size,
                         sub_block_size=cfg.sub_block_size, threshold=cfg.threshold, strategy=cfg.strategy,
                         factor=cfg.factor, max_new_tokens=cfg.max_new_tokens,
                         cache=cfg.cache if cfg.cache in ("dual", "dual-sparse") else "none")
    for i, (s, got, run) in enumerate(zip(summaries, steps, runs)):
        where = f"row {i} (prompt {len(prompts[i])} tokens), {cfg.cache} {cfg.block_size}/{cfg.sub_block_size} " \
                f"{cfg.strategy} {cfg.threshold} {cfg.factor}"
        first = next((j for j, (a, b) in enumerate(zip(got, run.steps)) if a != b), min(len(got), len(run.steps)))
        assert got == run.steps, f"{where}: forward {first}: engine {got[first:first + 1]} oracle {run.steps[first:first + 1]}"
        assert s.token_ids == run.answer and s.stop_reason == run.stop_reason, where
        assert s.answer_tokens == len(run.answer) and s.nfe == len(run.steps), where
    return runs


def coverage(runs, prompts, stop_id: int) -> dict[str, int]:
    """What a case exercised: parallel commits, stop tokens, stop tokens committed with masks before them."""
    out = {"multi": 0, "stop": 0, "stop_early": 0}
    for run, p in zip(runs, prompts):
        done: set[int] = set()
        for _, c in run.steps:
            out["multi"] += len(c) > 1
            for pos, tok in c:
                if tok == stop_id and any(q not in done and q not in {x for x, _ in c} for q in range(pos)):
                    out["stop_early"] += 1
            done |= {x for x, _ in c}
        out["stop"] += run.stop_reason == "stop_token"
    return out


# ------------------------------------------------------------------ random models: the whole matrix
@pytest.mark.parametrize("seed,grid,caches", [(0, GRID, ("none", "block", "dual", "dual-sparse")),
                                               (1, GRID[0::3], ("block", "dual", "dual-sparse")),
                                               (2, GRID[1:3], ("block", "dual"))])
def test_engine_equals_oracle_on_random_models(tb, one_thread, seed, grid, caches):
    """Cache modes x block/sub-block grids x commit rules, one batch of 5 rows at different block starts (seed 0
    runs the whole matrix; seeds 1 and 2 half the grids each, the cached modes)."""
    prompts, stop = tiny_case(seed)
    model = tiny(seed)
    total = {"multi": 0, "stop": 0, "stop_early": 0}
    for (bs, sbs) in grid:
        for strategy, threshold, factor in RULES:
            for cache in caches:
                cfg = DecodeConfig(block_size=bs, sub_block_size=sbs, strategy=strategy, threshold=threshold,
                                   factor=factor, cache=cache, max_new_tokens=40, stop_token_ids=(stop,)).validate()
                runs = assert_matches_oracle(model, prompts, cfg, MASK, tb)
                for k, v in coverage(runs, prompts, stop).items():
                    total[k] += v
    # the matrix must reach what it claims to test (else a broken rule could hide behind one-token steps)
    assert total["multi"] > 50 and total["stop"] > 5 and total["stop_early"] > 0, total


def test_static_stepper_equals_oracle_on_a_random_model(tb, one_thread):
    """engine/static.py's fixed-shape steps (CUDA graphs on GPUs, eager here): the same commits as the oracle."""
    from engine.static import StaticStepper

    prompts, stop = tiny_case(0)
    model = tiny(0)
    for cache, (bs, sbs) in (("block", (32, 8)), ("dual", (32, 8)), ("dual", (16, 4))):
        cfg = DecodeConfig(block_size=bs, sub_block_size=sbs, threshold=0.7, cache=cache, max_new_tokens=40,
                           stop_token_ids=(stop,)).validate()
        assert_matches_oracle(model, prompts, cfg, MASK, tb, stepper=StaticStepper(model, graphs=False, quantum=32))


def test_ar_equals_oracle_ar_on_random_models(tb, one_thread):
    """AR batches with rows at different positions: cached one-token steps == a full causal forward per token."""
    for seed in (0, 1):
        prompts, stop = tiny_case(seed)
        cfg = DecodeConfig(mode="ar", max_new_tokens=24, stop_token_ids=(stop,)).validate()
        summaries, steps = engine_run(tiny(seed), prompts, cfg, MASK, tb)
        for p, s, st_ in zip(prompts, summaries, steps):
            want = oracle.decode_ar(tiny(seed), p, stop_ids={stop}, max_new_tokens=24, mask_id=MASK)
            assert s.token_ids == want and [c for _, c in st_] == [[(i, t)] for i, t in enumerate(want)]
            assert s.stop_reason == ("stop_token" if want[-1] == stop else "max_new_tokens")


# ------------------------------------------------------------------ the bundled model
def bundled_prompts(engine) -> list[list[int]]:
    chat = engine.encode(engine.chat_prompt([{"role": "user", "content": "Count from 1 to 20: 1, 2, 3,"}]))
    text = engine.encode("The quick brown fox jumps over the lazy dog. " * 12)
    return [text[:5], chat[:31], chat[:32], chat[:33], text[:64]]


@pytest.mark.parametrize("cache,bs,sbs,threshold", [("none", 16, 4, 0.5), ("block", 32, 8, 0.9), ("dual", 16, 4, 0.7)])
def test_engine_equals_oracle_on_the_bundled_model(engine, one_thread, cache, bs, sbs, threshold):
    """The bundled dLLM (30 layers, its trained adapter): a few tokens per row, five rows at different block starts."""
    prompts = bundled_prompts(engine)
    assert [len(p) for p in prompts] == list(LENGTHS)
    cfg = engine.decode_config(block_size=bs, sub_block_size=sbs, threshold=threshold, cache=cache, max_new_tokens=10)
    runs = assert_matches_oracle(engine.lm.dllm, prompts, cfg, engine.lm.mask_token_id, engine.tb)
    assert any(len(c) > 1 for r in runs for _, c in r.steps), "some forward commits several tokens"


def test_dual_with_one_sub_block_per_block_is_the_block_cache(engine, one_thread):
    """sub_block_size == block_size: every dual step is a whole-block step, so dual must equal block exactly."""
    prompts = bundled_prompts(engine)[1:4]
    base = engine.decode_config(block_size=16, sub_block_size=16, threshold=0.7, max_new_tokens=12)
    dual = engine_run(engine.lm.dllm, prompts, replace(base, cache="dual"), engine.lm.mask_token_id, engine.tb)
    block = engine_run(engine.lm.dllm, prompts, replace(base, cache="block"), engine.lm.mask_token_id, engine.tb)
    assert dual[1] == block[1]


def test_diffusion_commits_several_tokens_per_forward_where_confident(engine, one_thread):
    """The point of the method, on CPU: at threshold 0.9 a counting list commits several tokens per forward, so
    fewer forwards than answer tokens (at threshold 1.0 there are more: one token per forward plus the commit
    forwards), with some single forwards committing 2 or more tokens (3 with the step-816 adapter, whose counting
    list was right; block 2's counts "1, 3, 5, ..." and commits at most 2 at once)."""
    prompt = engine.chat_prompt([{"role": "user", "content": "Count from 1 to 30, separated by commas."}])
    cfg = engine.decode_config(threshold=0.9, cache="dual", max_new_tokens=32)
    [res] = engine.generate_ids([engine.encode(prompt)], cfg)
    s = res.summary
    widest = max(len(e.committed) for e in res.trace.events)
    assert s.nfe < s.answer_tokens and s.tokens_per_forward > 1.1, (s.nfe, s.answer_tokens, s.text)
    assert widest >= 2, widest


# ------------------------------------------------------------------ the commit rules, as properties
# float32 values (what the engine's confidences are), so a comparison means the same in torch and in Python
confs = st.lists(st.floats(0.0, 1.0, allow_nan=False, width=32), min_size=1, max_size=16)
f32 = lambda lo, hi: st.floats(lo, hi, allow_nan=False, width=32)  # noqa: E731


@settings(max_examples=300, deadline=None, database=None)
@given(conf=confs, threshold=f32(0.015625, 1.0))
def test_threshold_rule_is_above_threshold_plus_the_most_confident(conf, threshold):
    c = torch.tensor(conf, dtype=torch.float32)
    got = select_commits(c, "threshold", threshold, 1.0).tolist()
    best = int(c.argmax())
    want = [bool(x > threshold) or i == best for i, x in enumerate(c.tolist())]
    assert got == want
    assert sum(got) >= 1


@settings(max_examples=300, deadline=None, database=None)
@given(conf=confs, factor=f32(0.015625, 20.0))
def test_factor_rule_is_the_largest_n_with_the_bound(conf, factor):
    c = torch.tensor(conf, dtype=torch.float32)
    got = select_commits(c, "factor", 0.9, factor).tolist()
    cs = sorted(c.tolist(), reverse=True)
    n = max([k for k in range(1, len(cs) + 1) if (k + 1) * (1 - cs[k - 1]) < factor], default=0)
    assert sum(got) == max(n, 1)
    chosen = sorted((x for x, g in zip(c.tolist(), got) if g), reverse=True)
    assert chosen == cs[:max(n, 1)], "the n most confident positions"
    assert got == oracle.commit_rule(c.tolist(), "factor", 0.9, factor) or len(set(cs)) < len(cs)  # ties: any order


@settings(max_examples=100, deadline=None, database=None)
@given(conf=confs, threshold=f32(0.015625, 1.0), factor=f32(0.015625, 20.0))
def test_commit_rules_always_commit_the_most_confident(conf, threshold, factor):
    c = torch.tensor(conf, dtype=torch.float32)
    for strategy in ("threshold", "factor"):
        got = select_commits(c, strategy, threshold, factor)
        assert got.dtype == torch.bool and got.shape == c.shape and bool(got[c.argmax()])
    assert select_commits(torch.tensor([]), "threshold", 0.5, 1.0).numel() == 0


# ------------------------------------------------------------------ sampling (engine/sampling.py sample)
def _nucleus(p: list[float], top_p: float) -> list[float]:
    """The top-p distribution written plainly: the most probable tokens while the mass before them is < top_p."""
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        keep.add(i)
        mass += p[i]
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in range(len(p))]


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.5, 1.0), (0.7, 0.8), (1.0, 0.5)])
def test_sample_returns_the_probability_of_the_token_under_the_tempered_nucleus(temperature, top_p):
    """Logits [rows, positions, V] as the decoder passes them: every (row, position) has its own distribution; the
    confidence is the chosen token's probability under softmax(logits / T) cut to its own nucleus; greedy at T = 0."""
    from engine.sampling import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 12, generator=g) * 3
    tok, conf = sample(logits.clone(), temperature, top_p, torch.Generator().manual_seed(1))
    assert tok.shape == conf.shape == (2, 3)
    for b in range(2):
        for j in range(3):
            if temperature == 0:
                p = torch.softmax(logits[b, j].double(), -1)
                assert int(tok[b, j]) == int(p.argmax()) and float(conf[b, j]) == pytest.approx(float(p.max()), rel=1e-5)
                continue
            p = _nucleus(torch.softmax(logits[b, j].double() / temperature, -1).tolist(), top_p)
            assert p[int(tok[b, j])] > 0, "sampled outside the nucleus"
            assert float(conf[b, j]) == pytest.approx(p[int(tok[b, j])], rel=1e-4)


def test_sample_draws_from_the_tempered_nucleus():
    """Frequencies over many draws follow the plain distribution (so a reversed sort, a wrong temperature or a
    nucleus of the least likely tokens fails), and a seeded generator repeats its draws."""
    from engine.sampling import sample

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(4000, -1)
    for temperature, top_p in ((0.5, 1.0), (2.0, 1.0), (1.0, 0.7)):
        want = _nucleus(torch.softmax(logits[0].double() / temperature, -1).tolist(), top_p)
        tok, _ = sample(logits.clone(), temperature, top_p, torch.Generator().manual_seed(2))
        freq = torch.bincount(tok, minlength=6).double() / len(tok)
        assert max(abs(f - w) for f, w in zip(freq.tolist(), want)) < 0.03, (temperature, top_p, freq, want)
        again, _ = sample(logits.clone(), temperature, top_p, torch.Generator().manual_seed(2))
        assert torch.equal(tok, again)
    # the nucleus is the smallest prefix whose mass reaches top_p: two equal tokens at top_p = 0.5 keep one
    _, conf = sample(torch.zeros(3, 2), 1.0, 0.5, torch.Generator().manual_seed(0))
    assert conf.tolist() == [1.0, 1.0, 1.0]
