"""The forward (engine/model.py) on a tiny random Qwen2 checkpoint: transformers' pieces as the reference for the
math (RMSNorm in fp32 and bf16, RoPE at any position, the whole causal forward), and the uncached forward as the
reference for every cached path (a slice at `start`, rows at their own positions, block-causal steps, explicit and
callable masks, the key quanta, logits_idx, the KV cache's row operations). Seconds in all: this file is the mutation
target `model`'s test selection (scripts/mutation.sh), with the 4-bit one-call layer step's test.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from engine.weights import build_model
from engine.model import (KEY_QUANTUM, WIDE_CALLS, KVCache, RMSNorm, Rope, _quantum_mask, block_causal_mask,
                          causal_mask, rotary, whole_key_quanta, wide_calls)

CPU = torch.device("cpu")
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ours, transformers'): 4 query heads over 2 K/V heads (GQA), q/k/v biases, an untied head, rope theta 5e4."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rope_theta=50000.0, tie_word_embeddings=False, max_position_embeddings=4096,
                      rms_norm_eps=1e-5)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.1)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
        hf.model.norm.weight.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    hf.save_pretrained(path)
    return build_model(path, CPU, torch.float32), hf


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_forward_equals_transformers_at_any_offset(tiny):
    ours, hf = tiny
    ids = _ids(2, 40)
    torch.testing.assert_close(ours(ids, torch.arange(40)[None].expand(2, -1), causal=True), hf(ids).logits, **TOL)
    pos = torch.arange(1000, 1040)[None].expand(2, -1)  # past the first rope table (1024 positions)
    torch.testing.assert_close(ours(ids, pos, causal=True), hf(ids, position_ids=pos).logits, **TOL)
    pos = torch.arange(3000, 3040)[None].expand(2, -1)  # the table grows again
    torch.testing.assert_close(ours(ids, pos, causal=True), hf(ids, position_ids=pos).logits, **TOL)


def test_rms_norm_equals_transformers_in_fp32_and_bf16():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 64, generator=g) * 3, torch.rand(64, generator=g) + 0.5
    for eps in (1e-6, 0.5):
        ours, ref = RMSNorm(64, eps), Qwen2RMSNorm(64, eps)
        with torch.no_grad():
            ours.weight.copy_(w)
            ref.weight.copy_(w)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
        ours, ref = ours.bfloat16(), ref.bfloat16()  # the unfused path: same numbers as transformers' bit for bit
        y = ours(x.bfloat16())
        assert y.dtype == torch.bfloat16 and torch.equal(y, ref(x.bfloat16()))


def test_rope_equals_the_textbook_rotation_at_any_position_and_dtype():
    d, theta = 16, 10000.0
    rope = Rope(d, theta)
    g = torch.Generator().manual_seed(2)
    for pos in (torch.tensor([[0, 1, 7, 1023]]), torch.tensor([[5, 2500, 40]]), torch.tensor([[3, 9]])):
        q, k = torch.randn(1, 2, pos.shape[1], d, generator=g), torch.randn(1, 1, pos.shape[1], d, generator=g)
        inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
        ang = pos[0].double()[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        rq, rk = apply_rotary_pos_emb(q.double(), k.double(), emb.cos()[None], emb.sin()[None])
        cos, sin = rope(pos, torch.float32)
        assert cos.shape == (1, 1, pos.shape[1], d) and cos.dtype == torch.float32
        torch.testing.assert_close(rotary(q, cos, sin), rq.float(), atol=2e-4, rtol=0)  # fp32 angles at 2500
        torch.testing.assert_close(rotary(k, cos, sin), rk.float(), atol=2e-4, rtol=0)
    assert rope._cos.shape[0] >= 2501
    cos, sin = rope(torch.tensor([[2500]]), torch.bfloat16)  # a new dtype: tables rebuilt from fp32 angles
    assert cos.dtype == sin.dtype == torch.bfloat16
    ang = torch.tensor(2500.0, dtype=torch.float64) * (1.0 / theta ** (torch.arange(0, d, 2).double() / d))
    torch.testing.assert_close(cos[0, 0, 0].double(), torch.cat([ang, ang]).cos(), atol=1e-2, rtol=0)
    # a first position past twice the default table (a long prompt's last token): the table must reach it exactly
    for p in (5000, 2048, 2049):
        fresh = Rope(d, theta)
        cos, _ = fresh(torch.tensor([[p]]), torch.float32)
        assert fresh._cos.shape[0] >= p + 1
        ang = torch.tensor(float(p), dtype=torch.float64) * (1.0 / theta ** (torch.arange(0, d, 2).double() / d))
        torch.testing.assert_close(cos[0, 0, 0].double(), torch.cat([ang, ang]).cos(), atol=2e-4, rtol=0)


def test_masks_and_key_quanta():
    q = torch.tensor([[0, 3, 4, 9], [2, 5, 6, 7]])
    valid = torch.tensor([6, 9])
    bc, cm = block_causal_mask(q, 12, 4, valid), causal_mask(q, 12, valid)
    assert bc.shape == cm.shape == (2, 1, 4, 12) and bc.dtype == torch.bool
    for b in range(2):
        for i in range(4):
            for k in range(12):
                assert bool(bc[b, 0, i, k]) == (k // 4 <= int(q[b, i]) // 4 and k < int(valid[b]))
                assert bool(cm[b, 0, i, k]) == (k <= int(q[b, i]) and k < int(valid[b]))
    assert torch.equal(block_causal_mask(q, 12, 4), block_causal_mask(q, 12, 4, torch.tensor([12, 12])))
    assert torch.equal(causal_mask(q, 12), causal_mask(q, 12, torch.tensor([12, 12])))
    assert [whole_key_quanta(n) for n in (0, 1, 31, 32, 33, 64, 65)] == [0, 32, 32, 32, 64, 64, 96]
    assert KEY_QUANTUM == 32
    m, n = _quantum_mask(q, None, True, 10, 64)
    assert n == 32 and torch.equal(m, causal_mask(q, 32))
    m, n = _quantum_mask(q, None, False, 10, 64)
    assert n == 32 and m.shape == (1, 1, 1, 32) and m[0, 0, 0].tolist() == [k < 10 for k in range(32)]
    m, n = _quantum_mask(q, None, False, 40, 48)  # the cache's room caps the quanta
    assert n == 48 and m[0, 0, 0].tolist() == [k < 40 for k in range(48)]
    given = causal_mask(q, 10)
    m, n = _quantum_mask(q, given, False, 10, 64)
    assert n == 32 and torch.equal(m[..., :10], given) and not m[..., 10:].any()


def test_wide_calls_is_scoped():
    assert WIDE_CALLS.get() is False
    with wide_calls():
        assert WIDE_CALLS.get() is True
    assert WIDE_CALLS.get() is False
    with pytest.raises(KeyError):
        with wide_calls():
            raise KeyError
    assert WIDE_CALLS.get() is False


@torch.no_grad()
def test_cached_ar_steps_equal_the_uncached_forward(tiny):
    """Prefill, then one-token steps at a shared `start` and at per-row positions (start None), kv_len implied."""
    ours, _ = tiny
    ids = _ids(2, 24, 3)
    pos = torch.arange(24)[None].expand(2, -1)
    ref = ours(ids, pos, causal=True)
    cache = KVCache(ours.cfg, 2, 40, CPU, torch.float32)
    assert cache.max_len == 64 and cache.k.shape == (2, 2, 2, 64, 16) and cache.k.dtype == torch.float32
    torch.testing.assert_close(ours(ids[:, :20], pos[:, :20], cache, start=0, causal=True), ref[:, :20], **TOL)
    torch.testing.assert_close(ours(ids[:, 20:21], pos[:, 20:21], cache, start=20), ref[:, 20:21], **TOL)
    torch.testing.assert_close(ours(ids[:, 21:22], pos[:, 21:22], cache, causal=True), ref[:, 21:22], **TOL)
    torch.testing.assert_close(ours(ids[:, 22:24], pos[:, 22:24], cache, causal=True, kv_len=24), ref[:, 22:24], **TOL)
    idx = torch.tensor([[0, 1], [1, 0]])
    got = ours(ids[:, 22:24], pos[:, 22:24], cache, causal=True, logits_idx=idx)
    torch.testing.assert_close(got, torch.stack([ref[0, [22, 23]], ref[1, [23, 22]]]), **TOL)
    # rows at their own positions: row 0 is 3 tokens behind row 1 (its later keys masked by the causal rule)
    cache = KVCache(ours.cfg, 2, 32, CPU, torch.float32)
    ours(ids[:, :20], pos[:, :20], cache, start=0, causal=True)
    rpos = torch.tensor([[17], [20]])
    got = ours(ids.gather(1, rpos), rpos, cache, causal=True)
    torch.testing.assert_close(got[0, 0], ref[0, 17], **TOL)
    torch.testing.assert_close(got[1, 0], ref[1, 20], **TOL)
    assert not cache.k[:, 0, :, 20].any() and cache.k[:, 1, :, 20].abs().sum() > 0  # each row wrote its own slot


@torch.no_grad()
def test_cached_block_steps_equal_the_block_causal_forward(tiny):
    """Block diffusion's cache: a block-causal prefix, then a block step that sees every key up to its block's end
    (mask None, causal False), and one with an explicit mask; a callable mask (training's attention) gives SDPA's."""
    ours, _ = tiny
    ids = _ids(2, 32, 4)
    pos = torch.arange(32)[None].expand(2, -1)
    ref = ours(ids, pos, mask=block_causal_mask(pos, 32, 8))
    cache = KVCache(ours.cfg, 2, 32, CPU, torch.float32)
    torch.testing.assert_close(ours(ids[:, :24], pos[:, :24], cache, start=0, mask=block_causal_mask(pos[:, :24], 24, 8)),
                               ref[:, :24], **TOL)
    torch.testing.assert_close(ours(ids[:, 24:], pos[:, 24:], cache, start=24), ref[:, 24:], **TOL)
    m = block_causal_mask(pos[:, 24:], 32, 8)
    torch.testing.assert_close(ours(ids[:, 24:], pos[:, 24:], cache, start=24, mask=m), ref[:, 24:], **TOL)
    causal = ours(ids, pos, causal=True)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    torch.testing.assert_close(ours(ids, pos, mask=sdpa), causal, **TOL)
    assert (ours(ids, pos) - causal).abs().max() > 1e-3  # no mask, not causal: every key visible


@torch.no_grad()
def test_packed_layout_and_its_cached_steps_equal_the_plain_forward(tiny):
    from engine.weights.packing import pack_for_decode

    ours, _ = tiny
    packed = pack_for_decode(copy.deepcopy(ours))
    assert packed.model.layers[0].self_attn.qkv is not None and packed.model.layers[0].mlp.gate_up is not None
    ids = _ids(2, 20, 5)
    pos = torch.arange(20)[None].expand(2, -1)
    torch.testing.assert_close(packed(ids, pos, causal=True), ours(ids, pos, causal=True), **TOL)
    cache = KVCache(ours.cfg, 2, 32, CPU, torch.float32)
    packed(ids[:, :19], pos[:, :19], cache, start=0, causal=True)
    torch.testing.assert_close(packed(ids[:, 19:], pos[:, 19:], cache, start=19), ours(ids, pos, causal=True)[:, 19:],
                               **TOL)


@torch.no_grad()
def test_kv_cache_row_operations(tiny):
    """keep_rows drops rows, merged stacks two caches (padded to the longer room), take/put run some rows alone."""
    ours, _ = tiny
    ids = _ids(3, 20, 6)
    pos = torch.arange(20)[None].expand(3, -1)
    ref = ours(ids, pos, causal=True)
    full = KVCache(ours.cfg, 3, 32, CPU, torch.float32)
    ours(ids[:, :16], pos[:, :16], full, start=0, causal=True)
    kept = KVCache(ours.cfg, 3, 32, CPU, torch.float32)
    ours(ids[:, :16], pos[:, :16], kept, start=0, causal=True)
    kept.keep_rows(torch.tensor([2, 0]))
    assert kept.k.shape[1] == 2 and torch.equal(kept.k, full.k[:, [2, 0]]) and torch.equal(kept.v, full.v[:, [2, 0]])
    torch.testing.assert_close(ours(ids[[2, 0], 16:17], pos[:2, 16:17], kept, start=16), ref[[2, 0], 16:17], **TOL)
    # merged: a cache with more room first, a shorter one appended (in place: the first cache holds both after)
    def pair():
        a, b = KVCache(ours.cfg, 2, 64, CPU, torch.float32), KVCache(ours.cfg, 1, 20, CPU, torch.float32)
        ours(ids[:2, :16], pos[:2, :16], a, start=0, causal=True)
        ours(ids[2:, :16], pos[2:, :16], b, start=0, causal=True)
        return a, b

    for swap in (False, True):
        a, b = pair()
        first, second = (b, a) if swap else (a, b)
        fk, sv, fl, sl, fn = first.k.clone(), second.v.clone(), first.max_len, second.max_len, first.k.shape[1]
        m = first.merged(second)
        assert m is first and m.max_len == 64 and m.k.shape == (2, 3, 2, 64, 16) and m.v.shape == m.k.shape
        assert torch.equal(m.k[:, :fn, :, :fl], fk) and torch.equal(m.v[:, fn:, :, :sl], sv)
        assert not m.k[:, :, :, 32:].any() and not m.v[:, :, :, 32:].any()
    a, b = pair()
    m = a.merged(b)
    torch.testing.assert_close(ours(ids[:, 16:17], pos[:, 16:17], m, start=16), ref[:, 16:17], **TOL)
    # compact: finished rows' places taken by the last rows, one row copied per finished row; a later join lands in a
    # spare row (no new storage) whose old contents are cleared past the joining row's room
    before_k = m.k.clone()
    assert m.compact([1, 2]) == [2, 1]  # row 0 finished: the last row (2) moves into its place
    assert m.k.shape[1] == 2 and torch.equal(m.k, before_k[:, [2, 1]])
    store = m.store_k
    assert store.shape[1] == 4  # 3 rows and one spare (half as many again, at least the joining row again)
    c = KVCache(ours.cfg, 1, 20, CPU, torch.float32)
    ours(ids[:1, :16], pos[:1, :16], c, start=0, causal=True)
    m.store_k[:, 2].fill_(1.0)  # as if a finished row's K/V were still in the spare row
    m.merged(c)
    assert m.store_k is store and m.k.shape[1] == 3 and torch.equal(m.k[:, 2, :, :c.max_len], c.k[:, 0])
    assert not m.k[:, 2, :, c.max_len:].any()  # cleared past the joining row's room
    torch.testing.assert_close(ours(ids[[2, 1, 0], 16:17], pos[:, 16:17], m, start=16), ref[[2, 1, 0], 16:17], **TOL)
    # a storage at most a quarter used gives its memory back, keeping the live rows
    big = KVCache(ours.cfg, 12, 32, CPU, torch.float32)
    big.k.normal_()
    before = big.k[:, [3, 11]].clone()
    assert big.compact([3, 11]) == [3, 11]  # rows 3 and 11 move into places 0 and 1
    assert big.store_k.shape[1] == 4 and big.k.shape[1] == 2 and torch.equal(big.k, before)
    # take / put: row 1 alone over its first 32 positions, its new K/V copied back
    part = full.take(torch.tensor([1]), 32)
    assert part.max_len == 32 and part.k.shape == (2, 1, 2, 32, 16) and torch.equal(part.v, full.v[:, [1], :, :32])
    part = KVCache.take(full, torch.tensor([1]), 32)
    part.k, part.v = part.k.clone(), part.v.clone()
    torch.testing.assert_close(ours(ids[1:2, 16:18], pos[1:2, 16:18], part, start=16, causal=True), ref[1:2, 16:18],
                               **TOL)
    before = full.k.clone()
    full.put(torch.tensor([1]), part, 16, 18)
    assert torch.equal(full.k[:, 1, :, 16:18], part.k[:, 0, :, 16:18]) and torch.equal(full.v[:, 1, :, 16:18],
                                                                                       part.v[:, 0, :, 16:18])
    assert torch.equal(full.k[:, [0, 2]], before[:, [0, 2]]) and torch.equal(full.k[:, 1, :, :16], before[:, 1, :, :16])
    assert not full.k[:, 1, :, 18:].any()


@torch.no_grad()
def test_rows_read_whole_key_quanta_so_a_row_ignores_its_batch(tiny):
    """A cached step over its own 22 keys == over a batch's 40 keys with the extra ones masked, bit for bit: the CPU
    attention reads whole KEY_QUANTUM multiples (32 and 64 here), so the masked keys add exact zeros."""
    ours, _ = tiny
    ids = _ids(1, 22, 7)
    pos = torch.arange(22)[None]
    outs = []
    for kv_len in (None, 40):
        cache = KVCache(ours.cfg, 1, 64, CPU, torch.float32)
        ours(ids[:, :21], pos[:, :21], cache, start=0, causal=True)
        mask = None if kv_len is None else causal_mask(pos[:, 21:], 40)
        outs.append(ours(ids[:, 21:], pos[:, 21:], cache, start=21, kv_len=kv_len, mask=mask))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("head_dim", [16, 80])
def test_the_one_call_layer_step_takes_cached_forwards_up_to_a_block(tiny_fast_dllm, tmp_path, monkeypatch, head_dim):
    """At 4-bit on our kernels a cached forward of up to 32 positions runs every decoder layer in one call (the logits
    of the layers' steps called one by one, bit for bit, and near the eager layers'); wider forwards, wide_calls()
    (AR prefills), uncached forwards, callable masks and forwards that keep gradients take the eager layers. Head dims
    16 and 80: RoPE's halves (8 and 40 lanes) end in a part of a 16-lane vector (layer.cpp rotates 16 lanes a time)."""
    from checkpoints import build_fast_dllm_checkpoint
    from engine import Engine
    from engine.weights import kernels as cpu_kernels

    if not all(f in cpu_kernels.cpu_flags() for f in cpu_kernels.NEEDS):
        pytest.skip("our CPU kernels need AVX-512 VNNI")
    if head_dim != 16:
        tiny_fast_dllm = build_fast_dllm_checkpoint(tmp_path / "ckpt", hidden=4 * head_dim, heads=4)
    monkeypatch.setenv("FASTDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    # fp32 activations at every width up to the block, so fused and eager agree to 1e-4 (at the default switch, 2,
    # both run bf16 ones in another order: tests/test_quant.py bounds that). FASTDLLM_ACTIVATIONS too: with the default
    # int8 one-token products an ulp between the two paths' norms can move one int8 step of a row (~1e-3 of the
    # logits; seen at head dims 32, 80 and 128), which only luck kept out of this check before
    monkeypatch.setenv("FASTDLLM_INT4_WIDE_ROWS", "33")
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "fp32")
    model = Engine.load(str(tiny_fast_dllm), device="cpu").lm.base
    steps, calls = model.steps, []
    assert steps is not None and len(steps) == model.cfg.num_hidden_layers and steps[0].max_width == 32

    class Counted:  # the real layer steps (one call for every layer), each forward's width recorded
        max_width = steps.max_width

        def __call__(self, x, *rest):
            calls.append(x.shape[1])
            return steps(x, *rest)

    ids = torch.randint(0, 500, (2, 80), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(80)[None].expand(2, -1)

    class OneByOne:  # each layer's step called from Python, as before the stack (layer.cpp's LayerStack)
        max_width = steps.max_width

        def __call__(self, x, cache_k, cache_v, shared):
            for i, step in enumerate(steps):
                x = step(x, cache_k[i], cache_v[i], shared)
            return x

    def run(fused: bool, grad: bool = False, via=None) -> list[torch.Tensor]:
        model.steps = (via or Counted()) if fused else None
        cache = KVCache(model.cfg, 2, 96, CPU, torch.float32)
        with torch.set_grad_enabled(grad):
            out = [model(ids[:, :20], pos[:, :20], cache, start=0, causal=True),  # 20 wide: one call per layer
                   model(ids[:, 20:21], pos[:, 20:21], cache, start=20, causal=True)]
            with wide_calls():
                out.append(model(ids[:, 21:22], pos[:, 21:22], cache, start=21, causal=True))
            out.append(model(ids[:, 22:54], pos[:, 22:54], cache, start=22, mask=block_causal_mask(pos[:, 22:54], 54, 32)))
            out.append(model(ids[:, 54:80], pos[:, 54:80], cache, causal=True))  # rows' own positions (start None)
            out.append(model(ids[:, :33], pos[:, :33], KVCache(model.cfg, 2, 64, CPU, torch.float32), start=0,
                             causal=True))  # 33 wide: eager
            out.append(model(ids[:, :8], pos[:, :8], causal=True))  # no cache: eager
        model.steps = steps
        return out

    fused = run(True)
    assert calls == [20, 1, 32, 26], calls
    assert all(torch.equal(f, o) for f, o in zip(fused, run(True, via=OneByOne())))  # one call: the same numbers
    short = KVCache(model.cfg, 1, 32, CPU, torch.float32)  # a cache for fewer layers than the model has: refused
    x, rows = torch.zeros(1, 1, model.cfg.hidden_size), torch.zeros(1, 32, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="layers"):
        steps.stack.forward(x, 0, short.k[:1], short.v[:1], *(torch.zeros(1, model.cfg.head_dim),) * 2,
                            torch.zeros(1, 1, dtype=torch.long), rows[None], None)
    for i, (f, e) in enumerate(zip(fused, run(False))):
        assert float((f - e).abs().max()) < 1e-4 * float(e.abs().max()), i
    calls.clear()
    run(True, grad=True)
    assert calls == []


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_rows_logits_do_not_depend_on_the_positions_its_batch_reads(tiny_fast_dllm, tmp_path, monkeypatch, kernels):
    """A batch reads logits at each row's masked positions, padded to its widest row (`logits_idx`). At 4-bit the
    head's kernels follow the forward's width (engine/model.py HEAD_WIDTH), not the padded count, so a row's logits
    are the same whichever rows it shares a step with: at the default switch a 9-wide step's head runs bf16
    activations (ours) or the dense bf16 copy (torch's backend, whose planes serve narrower reads) whether it reads 1
    or 5 positions."""
    from engine import Engine

    monkeypatch.setenv("FASTDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    monkeypatch.setenv("FASTDLLM_KERNELS", kernels)
    monkeypatch.delenv("FASTDLLM_INT4_WIDE_ROWS", raising=False)
    model = Engine.load(str(tiny_fast_dllm), device="cpu").lm.base
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(9)[None]
    with torch.inference_mode():
        alone = model(ids, pos, causal=True, logits_idx=torch.tensor([[8]]))
        padded = model(ids, pos, causal=True, logits_idx=torch.tensor([[8, 0, 0, 0, 0]]))
        whole = model(ids, pos, causal=True)
    assert torch.equal(alone[:, 0], padded[:, 0])
    assert torch.equal(alone[:, 0], whole[:, 8])


def test_tied_embeddings_share_one_tensor_and_projections_have_the_configs_biases():
    """tie_word_embeddings (SmolLM2, the bundled base) makes the LM head read the embedding's tensor itself, so a
    checkpoint without lm_head.weight loads and a trained embedding row is also a head row; q/k/v carry biases
    exactly when attention_bias says (Qwen2), the other projections never."""
    from engine.config import ModelConfig
    from engine.model import CausalLM

    for tied, bias in ((True, False), (False, True)):
        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, attention_bias=bias, tie_word_embeddings=tied)
        m = CausalLM(cfg)
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
        assert m.lm_head.weight.shape == (64, 32) and m.lm_head.bias is None and not m.packed
        att, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
        assert all((p.bias is not None) == bias for p in (att.q_proj, att.k_proj, att.v_proj))
        assert all(p.bias is None for p in (att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
