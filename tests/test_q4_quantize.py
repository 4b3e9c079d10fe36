"""Any checkpoint at 4-bit on the CPU (engine/weights/q4_quantize.py): llama.cpp's rounding, exact round trips through the
bundled GGUF, Qwen2's biases and an untied head, the cache, and our kernels at the 1.5B/7B input widths."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.weights import kernels as cpu_kernels, q4_quantize, quant
from engine.weights.gguf import GROUP
from engine.weights.int4 import Int4Linear, pack_pairs, tiled
from engine.weights import bundled_base_dir, build_model
from engine.model import KVCache

HAS_OURS = all(f in cpu_kernels.cpu_flags() for f in cpu_kernels.NEEDS)
needs_ours = pytest.mark.skipif(not HAS_OURS, reason="our CPU kernels need AVX-512 VNNI, which this CPU lacks")
PROMPTS = ["List the days of the week.", "What is 12 times 7?"]


def test_quantisers_follow_llama_cpps_rounding():
    # Q4_1: the group's minimum is m (q 0), its maximum q 15, d = (max - min) / 15, q = trunc(x / d + 0.5) above m
    w = torch.cat([torch.arange(32.0) * 0.5 - 3, torch.full((32,), 2.0)])[None]  # a ramp and a constant group
    b = q4_quantize.quantize_q4_1(w)
    d = 15.5 / 15
    assert b.m[0, 0] == -3 and b.d[0, 0] == torch.tensor(d).half().float() and b.d[0, 1] == 0 and b.m[0, 1] == 2
    expect = ((torch.arange(32.0) * 0.5) * torch.tensor(1 / d, dtype=torch.float32) + 0.5).trunc().clamp(max=15)
    assert torch.equal(b.q[0, :32].float(), expect) and b.q[0, 0] == 0 and b.q[0, 31] == 15
    assert torch.equal(b.q[0, 32:], torch.zeros(32, dtype=torch.uint8))
    # Q8_0: d = max|x| / 127, q = round half away from zero (torch.round would give 2 -> 2 and -2.5 -> -2)
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, -2.5, 2.5, 1.5])
    q, dq = q4_quantize.quantize_q8_0(x)
    assert dq[0, 0] == 1 and q[0, :4].tolist() == [127, -3, 3, 2]
    # the error bound of both on random weights: half a step, plus fp16's rounding of d (and m) times q
    r = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    b = q4_quantize.quantize_q4_1(r)
    step, low = b.d.repeat_interleave(GROUP, 1), b.m.repeat_interleave(GROUP, 1)
    assert bool(((b.dequantize() - r).abs() <= step / 2 + (15 * step + low.abs()) * 2 ** -11 + 1e-6).all())
    q, dq = q4_quantize.quantize_q8_0(r)
    step = dq.repeat_interleave(GROUP, 1)
    assert bool(((q.float() * step - r).abs() <= step / 2 + 127 * step * 2 ** -11 + 1e-6).all())
    with pytest.raises(ValueError, match="q4_1: input features 48 must be a multiple of 32"):
        q4_quantize.quantize_q4_1(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="q8_0: input features 40"):
        q4_quantize.quantize_q8_0(torch.zeros(4, 40))


def test_a_checkpoint_dequantised_from_the_gguf_decodes_with_the_gguf_paths_tokens(tmp_path, monkeypatch):
    """The bundled base as a plain local checkpoint takes the quantise-at-load path, then the cache; its greedy
    tokens are the GGUF path's."""
    local = tmp_path / "smollm2"
    shutil.copytree(bundled_base_dir(), local, ignore=shutil.ignore_patterns("q4_1_blocks*"))
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    gguf = Engine.load("bundled-base", device="cpu")  # from the usual cache (a fresh one would convert the GGUF again)
    monkeypatch.setenv("FASTDLLM_CACHE", str(tmp_path / "cache"))
    first = Engine.load(str(local), device="cpu")
    assert "quantised at load" in first.lm.info["quantised"] and first.lm.info["weights"] == "int4+bf16"
    again = Engine.load(str(local), device="cpu")
    assert "from the cache" in again.lm.info["quantised"]
    (cache,) = (tmp_path / "cache" / "q4").iterdir()  # one directory: a file per layer (written as made), then the rows
    assert sorted(p.name for p in cache.iterdir()) == ["embed.safetensors"] + [f"layer{i:03d}.safetensors" for i in range(30)]
    for prompt in PROMPTS:
        p = gguf.chat_prompt([{"role": "user", "content": prompt}])
        cfg = gguf.decode_config(mode="ar", max_new_tokens=24)
        want = gguf.generate(p, cfg, record=False)[0].summary.token_ids
        assert first.generate(p, cfg, record=False)[0].summary.token_ids == want, prompt
        assert again.generate(p, cfg, record=False)[0].summary.token_ids == want, prompt
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "fp32")  # the flag that keeps the dense path
    dense = Engine.load(str(local), device="cpu")
    assert dense.lm.info["weights"] == "float32" and "quantised" not in dense.lm.info


def _dequantised_reference(path, w: quant.GGUFWeights) -> torch.nn.Module:
    """The dense fp32 model with every quantised tensor replaced by its dequantised blocks: the 4-bit model's
    numbers up to summation order."""
    model = build_model(path, torch.device("cpu"), torch.float32)
    for name, b in w.q4.items():
        mod = model.get_submodule(name)
        mod.weight = torch.nn.Parameter(b.dequantize(), requires_grad=False)
    embed = (w.embed_q.float().view(w.embed_q.shape[0], -1, GROUP) * w.embed_d[..., None]).flatten(1)
    model.model.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
    if w.head_q is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        head = (w.head_q.float().view(w.head_q.shape[0], -1, GROUP) * w.head_d[..., None]).flatten(1)
        model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    return model


def _logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """A 20-token prefill, then an AR step and a 9-wide step over the cache (the layer step's widths)."""
    pos = torch.arange(ids.shape[1])[None]
    cache = KVCache(model.cfg, 1, 64, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        return [model(ids[:, :20], pos[:, :20], cache=cache, start=0, causal=True),
                model(ids[:, 20:21], pos[:, 20:21], cache=cache, start=20, causal=True),
                model(ids[:, 21:30], pos[:, 21:30], cache=cache, start=21, causal=False)]


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_checkpoint_at_4bit_keeps_its_biases_and_head(tmp_path, tiny_fast_dllm, monkeypatch, tied):
    """A Fast_dLLM_v2-format checkpoint (q/k/v biases, GQA) at 4-bit equals the dense model on its dequantised
    weights, with the one-call layer step and without it; an untied head is quantised from its own rows."""
    path = tiny_fast_dllm
    if not tied:
        path = tmp_path / "untied"
        shutil.copytree(tiny_fast_dllm, path)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
        state = load_file(str(path / "model.safetensors"))
        g = torch.Generator().manual_seed(5)
        state["lm_head.weight"] = (torch.randn(state["model.embed_tokens.weight"].shape, generator=g) * 0.05).bfloat16()
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setenv("FASTDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    monkeypatch.setenv("FASTDLLM_INT4_WIDE_ROWS", "33")  # fp32 activations up to a block: the dense model's numbers
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "fp32")
    eng = Engine.load(str(path), device="cpu")
    model = eng.lm.base
    assert eng.lm.dllm is model and model.packed
    qkv = model.model.layers[0].self_attn.qkv
    state = load_file(str(path / "model.safetensors"))
    assert isinstance(qkv, Int4Linear) and torch.equal(qkv.bias, torch.cat(
        [state[f"model.layers.0.self_attn.{n}_proj.bias"].float() for n in "qkv"]))
    w, cached = q4_quantize.cached_checkpoint(path, model.cfg.num_hidden_layers, tied, tmp_path / "cache")
    assert cached and (w.head_q is None) == tied
    ref = _logits(_dequantised_reference(path, w), ids := torch.randint(0, 500, (1, 30), generator=torch.Generator().manual_seed(1)))
    if HAS_OURS:
        assert model.steps is not None and model.steps[0].qkv_bias is qkv.bias  # the layer step with the bias
    fused = _logits(model, ids)
    saved, model.steps = model.steps, None
    eager = _logits(model, ids)
    model.steps = saved
    for f, e, r in zip(fused, eager, ref):
        scale = float(r.abs().max())
        assert float((e - r).abs().max()) < 1e-4 * scale
        assert float((f - r).abs().max()) < 1e-4 * scale


@needs_ours
@pytest.mark.parametrize("k", [2112, 8960])
def test_our_kernels_take_inputs_wider_than_2048(k):
    """Qwen2.5-1.5B's down projection has 8,960 inputs (7B: 18,944): every product of our kernels at such widths,
    narrow and wide rows, fp32 / int8 / bf16 activations, against the dequantised weights."""
    kern = cpu_kernels.load()
    g = torch.Generator().manual_seed(k)
    b = q4_quantize.quantize_q4_1(torch.randn(64, k, generator=g) * 0.05)
    qs = pack_pairs(b.q)
    dm = tiled(torch.stack([b.d, b.m], -1).half(), k // GROUP)
    w = b.dequantize()
    for rows in (1, 9):
        x = torch.randn(rows, k, generator=g)
        ref = x.double() @ w.double().t()
        scale = float(ref.abs().max())
        assert float((kern.q4_f32(x, qs, dm) - ref).abs().max()) < 1e-4 * scale, rows
        assert float((kern.q4_i8w(x, qs, dm) - ref).abs().max()) < 3e-2 * scale, rows
        if cpu_kernels.bf16_ok():
            assert float((kern.q4_bf16(x, qs, dm) - ref).abs().max()) < 3e-2 * scale, rows
