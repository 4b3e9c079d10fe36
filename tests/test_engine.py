"""Engine tests on real weights: the bundled SmolLM2-135M (+ adapter) and tiny checkpoints built on disk."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from engine import ConfigError, DecodeConfig, Trace
from engine.weights import build_model, bundled_base_dir
from engine.model import block_causal_mask
from engine.sampling import sample, select_commits
from engine.text import IncrementalDetokenizer, TokenBytes

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a short poem about the sea."]


def committed_positions(trace: Trace) -> list[int]:
    return [t.pos for e in trace.events for t in e.committed]


# ------------------------------------------------------------------ forward vs transformers
def test_forward_matches_transformers_tiny_qwen2(tmp_path):
    """QKV bias, GQA, untied head, rope theta: our forward == transformers' Qwen2 on causal input."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, rope_theta=50000.0, tie_word_embeddings=False,
                         max_position_embeddings=512)
    hf = Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random biases (zero by default) so the bias path is exercised
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = build_model(tmp_path, torch.device("cpu"), torch.float32)
    assert ours.cfg.attention_bias and not ours.cfg.tie_word_embeddings
    ids = torch.randint(0, 320, (2, 40))
    pos = torch.arange(40)[None].expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, pos, causal=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_cpu_decode_layout_computes_the_same_forward(tmp_path):
    """Packed (transposed, fused q|k|v and gate|up, untied head) == plain nn.Linear forward, with a cache."""
    import copy

    from engine.model import KVCache
    from engine.weights.packing import PackedLinear, pack_for_decode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    plain = build_model(tmp_path, torch.device("cpu"), torch.float32)
    packed = pack_for_decode(copy.deepcopy(plain))
    att = packed.model.layers[0].self_attn
    assert isinstance(att.qkv, PackedLinear) and att.qkv.splits == [64, 16, 16] and att.q_proj is None
    assert isinstance(packed.lm_head, PackedLinear) and packed.model.embed_tokens.weight.shape == (320, 64)
    ids = torch.randint(0, 320, (2, 24))
    pos = torch.arange(24)[None].expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(packed(ids, pos, causal=True), plain(ids, pos, causal=True), atol=1e-5, rtol=1e-5)
        outs = []
        for m in (plain, packed):  # prefill 20, then one cached AR step
            cache = KVCache(m.cfg, 2, 32, torch.device("cpu"), torch.float32)
            m(ids[:, :20], pos[:, :20], cache, start=0, kv_len=20, causal=True)
            outs.append(m(ids[:, 20:21], pos[:, 20:21], cache, start=20, kv_len=21))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_engine_packs_the_ar_model_only(engine):
    """CPU: the AR base gets the decode layout (1-token steps), the separate dLLM keeps nn.Linear (multi-token)."""
    from engine.weights.packing import PackedLinear

    base, dllm = engine.lm.base, engine.lm.dllm
    assert base.packed and isinstance(base.model.layers[0].mlp.gate_up, PackedLinear)
    assert dllm is not base and not dllm.packed and dllm.model.layers[0].mlp.gate_up is None
    assert isinstance(dllm.model.layers[0].mlp.gate_proj, torch.nn.Linear)


def test_forward_matches_transformers_bundled_base():
    from transformers import AutoModelForCausalLM

    path = bundled_base_dir()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = build_model(path, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 49152, (1, 48))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, torch.arange(48)[None], causal=True)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)


def test_ar_greedy_matches_transformers_generate(engine):
    """Our AR decoder (KV cache, one token per forward) == transformers' generate(), token for token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled_base_dir(), dtype=torch.float32).eval()
    cfg = engine.decode_config(mode="ar", max_new_tokens=24)
    for prompt in PROMPTS[:2]:
        ids = engine.encode(engine.chat_prompt([{"role": "user", "content": prompt}]))
        [res] = engine.generate_ids([ids], cfg, record=False)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                              eos_token_id=list(cfg.stop_token_ids), pad_token_id=0)
        assert res.summary.token_ids == out[0, len(ids):].tolist()


# ------------------------------------------------------------------ block diffusion
def test_cache_none_and_block_are_identical_dual_follows_its_rule(engine):
    """The block cache is exact: none and block give the same greedy tokens. dual is an approximation (stale K/V of
    the block's later sub-blocks); its answer must be exactly what the reference decoder's dual rule gives
    (tests/oracle.py), and with one sub-block per block it must equal block."""
    import oracle

    prompt = PROMPTS[1]  # (more prompts: tests/test_oracle.py, every cache mode against the reference decoder)
    base = engine.decode_config(mode="diffusion", max_new_tokens=32, threshold=0.9)
    none = engine.generate(prompt, replace(base, cache="none"), record=False)[0].summary
    block = engine.generate(prompt, replace(base, cache="block"), record=False)[0].summary
    dual = engine.generate(prompt, replace(base, cache="dual"), record=False)[0].summary
    assert none.token_ids == block.token_ids and none.nfe == block.nfe
    ids = engine.encode(engine.chat_prompt([{"role": "user", "content": prompt}]))
    [ref] = oracle.decode(engine.lm.dllm, [ids], mask_id=engine.lm.mask_token_id, stop_ids=set(base.stop_token_ids),
                          max_new_tokens=32, threshold=0.9, cache="dual")
    assert dual.token_ids == ref.answer and dual.nfe == len(ref.steps) and len(dual.token_ids) > 8  # past a sub-block
    whole = engine.decode_config(mode="diffusion", max_new_tokens=32, sub_block_size=32)
    assert (engine.generate(PROMPTS[2], replace(whole, cache="dual"), record=False)[0].summary.token_ids
            == engine.generate(PROMPTS[2], replace(whole, cache="block"), record=False)[0].summary.token_ids)


def test_threshold_one_commits_exactly_one_token_per_step(engine):
    cfg = engine.decode_config(mode="diffusion", threshold=1.0, max_new_tokens=24, cache="dual")
    [res] = engine.generate(PROMPTS[1], cfg)
    for e in res.trace.events:
        if e.kind in ("prefill", "step"):
            assert len(e.committed) == 1
        elif e.kind == "commit":
            assert len(e.committed) <= 1


def test_lower_threshold_never_commits_fewer():
    """Same confidences: each threshold commits exactly the positions above it plus the most confident one (so an
    argmax-only rule fails), a lower threshold's set contains a higher one's; factor rule by hand."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        conf = torch.rand(8, generator=g)
        sets = [select_commits(conf, "threshold", t, 1.0) for t in (1.0, 0.9, 0.7, 0.5, 0.1)]
        assert sets[0].sum() == 1 and sets[0][conf.argmax()]
        for t, chosen in zip((1.0, 0.9, 0.7, 0.5, 0.1), sets):
            want = conf > t
            want[conf.argmax()] = True
            assert torch.equal(chosen, want), (t, conf, chosen)
        for hi, lo in zip(sets, sets[1:]):
            assert bool((lo | ~hi).all())
        assert int(sets[-1].sum()) == max(1, int((conf > 0.1).sum())) > 1  # most of U(0,1) draws are above 0.1
    conf = torch.tensor([0.99, 0.95, 0.9, 0.5])
    # (n+1)(1-c_n) < f: n=1: 2*0.01=.02, n=2: 3*.05=.15, n=3: 4*.1=.4, n=4: 5*.5=2.5
    assert select_commits(conf, "factor", 0, 0.5).tolist() == [True, True, True, False]
    assert select_commits(conf, "factor", 0, 0.01).tolist() == [True, False, False, False]
    assert select_commits(conf, "factor", 0, 3.0).tolist() == [True, True, True, True]
    # by rank, not by index: sorted 0.99, 0.7, 0.5: n=2 holds (3*0.3 = 0.9 < 1.5), n=3 does not (4*0.5)
    assert select_commits(torch.tensor([0.99, 0.5, 0.7]), "factor", 0, 1.5).tolist() == [True, False, True]
    # the bound is strict: n = 2 gives (2 + 1) * (1 - 0.75) = 0.75, not < 0.75 (all exact in float32)
    assert select_commits(torch.tensor([0.75, 0.75]), "factor", 0, 0.75).tolist() == [True, False]
    assert select_commits(torch.tensor([0.75, 0.75]), "factor", 0, 0.76).tolist() == [True, True]


def test_lower_threshold_more_tokens_per_forward(engine):
    res = {t: engine.generate(PROMPTS[2], engine.decode_config(threshold=t, max_new_tokens=40), record=False)[0].summary
           for t in (1.0, 0.5)}
    assert res[1.0].tokens_per_forward <= 1.0  # commit forwards add a forward without a parallel token
    assert res[0.5].tokens_per_forward > 1.1 and res[0.5].nfe < res[1.0].nfe, (res[0.5], res[1.0])


@pytest.mark.parametrize("prompt_len,cache", [
    (5, "dual"), (15, "dual"), (16, "dual"), (32, "dual"), (17, "dual"),
    (5, "block"), (16, "block"), (17, "block"), (16, "none"), (17, "none"),
])
def test_prompt_lengths_on_the_block_grid(engine, prompt_len, cache):
    """Shorter than a block, one short, exactly one, a multiple, one over: every answer position once."""
    ids = engine.encode(" ".join(["hello"] * 80))[:prompt_len]
    assert len(ids) == prompt_len
    never = engine.lm.mask_token_id  # a stop id that is never committed: the answer runs to max_new_tokens
    n = 21  # crosses two block boundaries at block size 16
    cfg = engine.decode_config(mode="diffusion", cache=cache, block_size=16, sub_block_size=4, max_new_tokens=n,
                               stop_token_ids=(never,))
    [res] = engine.generate_ids([ids], cfg)
    pos = committed_positions(res.trace)
    assert sorted(pos) == list(range(n)), "each answer position committed exactly once"
    assert res.summary.answer_tokens == n and res.summary.stop_reason == "max_new_tokens"
    assert never not in res.summary.token_ids, "the mask token is never committed"
    by_pos = {t.pos: t.id for e in res.trace.events for t in e.committed}
    assert [by_pos[p] for p in range(n)] == res.summary.token_ids
    assert res.trace.events[0].kind == "prefill" and res.trace.events[-1].kind == "done"
    assert [e.nfe for e in res.trace.events[:-1]] == list(range(1, res.summary.nfe + 1))
    commits = [e for e in res.trace.events if e.kind == "commit"]
    first_block_end = (prompt_len // 16 + 1) * 16
    assert len(commits) == len(range(first_block_end, prompt_len + n, 16)), "one commit forward per finished block"


def test_max_new_tokens_exact_and_stop_token(engine):
    never = (engine.lm.mask_token_id,)  # a stop id that is never committed: every answer runs to the cap
    for n in (1, 3, 17, 33):
        [res] = engine.generate(PROMPTS[2], engine.decode_config(max_new_tokens=n, stop_token_ids=never))
        assert res.summary.answer_tokens == n == len(res.summary.token_ids)
        assert res.summary.stop_reason == "max_new_tokens"
        assert sorted(t.pos for e in res.trace.events for t in e.committed) == list(range(n))
    stops = engine.lm.stop_token_ids
    for cache in ("dual", "block", "none"):
        [res] = engine.generate(PROMPTS[0], engine.decode_config(max_new_tokens=64, cache=cache))
        s = res.summary
        assert s.stop_reason == "stop_token", (cache, s.text)
        assert s.token_ids[-1] in stops and not any(t in stops for t in s.token_ids[:-1])
        assert s.answer_tokens == len(s.token_ids) < 64 and "Paris" in s.text
        last = res.trace.events[-2]  # the forward that ended the answer: nothing decoded after it
        assert res.trace.events[-1].kind == "done" and last.nfe == s.nfe
        assert max(t.pos for e in res.trace.events for t in e.committed) < 64


def test_batch_matches_single_rows(engine):
    """Prompts of different lengths in one batch decode exactly as they do alone (AR, the block cache and the dual
    cache, whose batches give each row the forward it would get alone: tests/test_dual_batching.py); finished
    rows leave the batch."""
    for mode, cache in (("ar", "dual"), ("diffusion", "block"), ("diffusion", "dual")):
        cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=24)
        batch = engine.generate(PROMPTS, cfg, record=False)
        assert len({len(x.summary.token_ids) for x in batch}) > 1, "rows must finish at different forwards"
        single = [engine.generate(p, cfg, record=False)[0] for p in PROMPTS]
        assert [x.summary.token_ids for x in batch] == [y.summary.token_ids for y in single], (mode, cache)
        assert [x.summary.nfe for x in batch] == [y.summary.nfe for y in single], (mode, cache)


@pytest.mark.timeout(300)
def test_ar_batch_answers_are_single_user_ones_on_the_4bit_default(monkeypatch):
    """On the default 4-bit weights (bf16 wide and int8 one-token activations) a batch's greedy AR answers are the
    single-user ones: prompts of unequal length are prefilled one at a time, in the forward each gets alone. A
    padded batch prefill (and before it, a shared system turn prefilled once) ran a row's attention with more query
    rows, where torch's CPU attention gives other last bits, and the wide activations turned those into other
    answers: two of these four diverged at tokens 10 and 28."""
    from engine import Engine

    monkeypatch.delenv("FASTDLLM_WEIGHTS", raising=False)
    q = Engine.load()
    assert q.lm.info["weights"] == "int4+bf16"
    prompts = ["List ten fruits.", "Solve step by step: a shop sells notebooks for 3 dollars each and pens for 2 "
               "dollars each. How much do 4 notebooks and 5 pens cost in total?", "Name three colors.",
               "Write a haiku about the sea."]
    ids = [q.encode(q.chat_prompt([{"role": "user", "content": p}])) for p in prompts]
    cfg = q.decode_config(mode="ar", max_new_tokens=32)
    single = [q.generate_ids([i], cfg, record=False)[0].summary.token_ids for i in ids]
    widths: list[tuple[int, int]] = []
    real = q.lm.base.forward
    monkeypatch.setattr(q.lm.base, "forward", lambda ids_, *a, **k: k.get("cache_rows") is None and
                        widths.append(tuple(ids_.shape)) or real(ids_, *a, **k))
    batch = [r.summary.token_ids for r in q.generate_ids(ids, cfg, record=False)]
    assert batch == single
    assert widths[:len(ids)] == [(1, len(i)) for i in ids]


def test_per_row_top_p():
    """Each row samples from its own nucleus (the reference used row 0's for every row)."""
    logits = torch.full((2, 6), -20.0)
    logits[0, 0] = 10.0  # row 0: all mass on token 0
    logits[1, 3] = logits[1, 4] = 10.0  # row 1: mass split between 3 and 4
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(40):
        tok, conf = sample(logits, 1.0, 0.9, g)
        assert tok[0] == 0 and tok[1] in (3, 4)
        seen.add(int(tok[1]))
    assert seen == {3, 4}


def test_sampling_is_seeded(engine):
    cfg = engine.decode_config(mode="diffusion", temperature=0.8, top_p=0.9, seed=123, max_new_tokens=24)
    a = engine.generate(PROMPTS[2], cfg, record=False)[0].summary.token_ids
    b = engine.generate(PROMPTS[2], cfg, record=False)[0].summary.token_ids
    assert a == b


def test_events_feed_heatmap_and_text(engine):
    cfg = engine.decode_config(mode="diffusion", max_new_tokens=32, threshold=0.9, cache="block")
    [res] = engine.generate(PROMPTS[2], cfg)
    steps = [e for e in res.trace.events if e.kind in ("prefill", "step")]
    assert any(e.masked for e in steps), "masked positions carry their current best token and confidence"
    for e in steps:
        for t in e.masked + e.committed:
            assert 0.0 <= t.conf <= 1.0 and 0 <= t.pos < 32
    assert "".join(e.text_delta for e in res.trace.events) == res.summary.text
    assert res.summary.tokens_per_forward == pytest.approx(res.summary.answer_tokens / res.summary.nfe)


def test_trace_round_trips_through_json(engine):
    [res] = engine.generate(PROMPTS[0], engine.decode_config(max_new_tokens=24))
    text = res.trace.dumps()
    back = Trace.loads(text)
    assert back.to_json() == json.loads(text)
    assert back.summary.token_ids == res.summary.token_ids and len(back.events) == len(res.trace.events)
    assert back.header["config"]["block_size"] == 32 and back.header["prompt"] == PROMPTS[0]
    with pytest.raises(ValueError, match="version"):
        Trace.loads('{"version": 99}')


# ------------------------------------------------------------------ config validation
@pytest.mark.parametrize("field,value,needle", [
    ("sub_block_size", 5, "must divide block_size=32"),
    ("sub_block_size", 0, "sub_block_size"),
    ("block_size", 0, "block_size"),
    ("threshold", 0.0, "threshold: must be a number in (0, 1]"),
    ("threshold", 1.5, "threshold"),
    ("cache", "disk", "cache: must be one of none, block, dual"),
    ("mode", "beam", "mode"),
    ("strategy", "greedy", "strategy"),
    ("max_new_tokens", 0, "max_new_tokens"),
    ("temperature", -1.0, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("seed", -3, "seed"),
    ("threshold", "high", "threshold"),
])
def test_invalid_configs_are_rejected(field, value, needle):
    with pytest.raises(ConfigError) as err:
        DecodeConfig(**{field: value}).validate()
    assert needle in str(err.value) and err.value.field == field


def test_prompt_longer_than_context_is_rejected(engine):
    with pytest.raises(ConfigError, match="prompt"):
        engine.generate_ids([[1] * (engine.max_context + 1)], engine.decode_config(max_new_tokens=4))


# ------------------------------------------------------------------ text
def test_incremental_detokenizer_handles_split_characters(engine):
    tok = engine.lm.tokenizer
    text = "naïve café 🙂 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    tb = TokenBytes(tok)
    assert any("<0x" in tb.piece(i) for i in ids), "some token holds a partial UTF-8 character"
    d = IncrementalDetokenizer(tb)
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) + d.flush() == text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_block_causal_mask_rule():
    pos = torch.arange(10)[None]
    m = block_causal_mask(pos, 10, 4)[0, 0]
    for q in range(10):
        for k in range(10):
            assert bool(m[q, k]) == (k // 4 <= q // 4)


def test_cached_attention_reads_whole_key_quanta_so_a_row_ignores_its_batch(engine):
    """A row attending over its own n keys == over a batch's longer key range with the extra keys masked, bit for
    bit: attention over a cache reads whole KEY_QUANTUM multiples of keys (the rest masked), so the length a batch
    pads to does not change a row's sums (with 1 instead of 32, SDPA's tail rounds differently and this fails)."""
    from engine.model import KEY_QUANTUM, KVCache, causal_mask

    m = engine.lm.base
    ids = engine.encode("Tell me a long story about a dragon and a small town.")
    n = len(ids)
    assert n % KEY_QUANTUM
    pos = torch.arange(n)[None]
    out = {}
    with torch.no_grad():
        for keys in (n, n + 7, 2 * KEY_QUANTUM + 5):  # the row alone; padded as in a batch with longer rows
            cache = KVCache(m.cfg, 1, 3 * KEY_QUANTUM, torch.device("cpu"), torch.float32)
            assert cache.k.shape[3] % KEY_QUANTUM == 0
            cache.k.normal_(), cache.v.normal_()  # stale keys past the row must not count
            out[keys] = m(torch.tensor([ids]), pos, cache, start=0, kv_len=keys, mask=causal_mask(pos, keys))
    assert torch.equal(out[n], out[n + 7]) and torch.equal(out[n], out[2 * KEY_QUANTUM + 5])
