"""4-bit weights at run time (engine/weights/quant.py) on the real bundled GGUF and adapter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.weights import kernels as cpu_kernels, quant
from engine.weights import BUNDLED_ADAPTER, bundled_base_dir, bundled_gguf_path, read_adapter_tensors, read_state_dict
from engine.weights.lora import panels as lora_panels, unpanel as lora_unpanel

PROMPTS = ["What is the capital of France?", "Give me three tips for staying healthy."]
HAS_OURS = all(f in cpu_kernels.cpu_flags() for f in cpu_kernels.NEEDS)
needs_ours = pytest.mark.skipif(not HAS_OURS, reason="our CPU kernels need AVX-512 VNNI, which this CPU lacks "
                                "(the engine falls back to torch's int4 kernel: the 'torch' cases)")


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("q4") / "q4_1_blocks.safetensors"


@pytest.fixture(scope="module")
def gguf(fresh_cache) -> quant.GGUFWeights:
    """The 4-bit blocks parsed from the GGUF itself into a fresh temporary cache (the engine's cached copy is checked
    against this parse, never used in its place)."""
    assert not fresh_cache.exists()
    return quant.cached_gguf(bundled_gguf_path(), 9, 3, fresh_cache)


def _same_weights(a: quant.GGUFWeights, b: quant.GGUFWeights) -> None:
    assert sorted(a.q4) == sorted(b.q4)
    for name in a.q4:
        x, y = a.q4[name], b.q4[name]
        assert torch.equal(x.q, y.q) and torch.equal(x.d, y.d) and torch.equal(x.m, y.m), name
    assert torch.equal(a.embed_q, b.embed_q) and torch.equal(a.embed_d, b.embed_d)


def test_q4_1_blocks_dequantise_to_the_converted_checkpoint(gguf, fresh_cache):
    """Our Q4_1 / Q8_0 reading of the GGUF (nibble order, q/k row order) == transformers' dequantised checkpoint,
    exactly; the safetensors cache reads back what was parsed, and the engine's cached copy (when there is one) is
    that same parse."""
    state = read_state_dict(bundled_base_dir())
    assert len(gguf.q4) == 30 * 7
    for name, blocks in gguf.q4.items():
        assert int(blocks.q.max()) <= 15
        assert torch.equal(blocks.dequantize(), state[name + ".weight"]), name
    emb = (gguf.embed_q.float().view(gguf.embed_q.shape[0], -1, 32) * gguf.embed_d[..., None]).flatten(1)
    assert torch.equal(emb, state["model.embed_tokens.weight"])
    assert fresh_cache.exists()
    _same_weights(quant.cached_gguf(bundled_gguf_path(), 9, 3, fresh_cache), gguf)  # the file the parse wrote reads back
    engine_cache = bundled_base_dir() / "q4_1_blocks.safetensors"
    if engine_cache.exists():
        _same_weights(quant.cached_gguf(bundled_gguf_path(), 9, 3, engine_cache), gguf)


@pytest.fixture(params=[pytest.param("ours", marks=needs_ours), "torch"])
def kernels(request, monkeypatch) -> str:
    """Both 4-bit backends: our AVX-512 kernels (engine/weights/csrc/q4.cpp, compiled once) and torch's int4 kernel."""
    monkeypatch.setenv("FASTDLLM_KERNELS", request.param)
    return request.param


def test_requantising_the_bundled_checkpoint_gives_the_gguf_blocks_exactly(gguf):
    """The bundled checkpoint holds the GGUF's dequantised weights: quantising it again at load (engine/weights/q4_quantize.py,
    the path of any other checkpoint) gives back every Q4_1 block and the Q8_0 embedding bit for bit (compared with
    the fresh parse of the GGUF, not the engine's cache); tests/test_q4_quantize.py decodes with them."""
    from engine.weights import q4_quantize

    ours = q4_quantize.quantize_checkpoint(bundled_base_dir(), 30, tied=True)
    assert len(ours.q4) == 7 * 30 and ours.head_q is None
    _same_weights(ours, gguf)


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_int4_linear_int4_and_dense_paths_and_lora(gguf, kernels, act):
    blocks = quant._fused_blocks(gguf, 3, "mlp", ("gate_proj", "up_proj"))
    weight = quant.Int4Weight(blocks, True, kernels)
    assert (weight.kernels is not None) == (kernels == "ours")
    ref_w = blocks.dequantize()
    a, b = torch.randn(8, 576) * 0.05, torch.randn(3072, 8) * 0.05
    lora = quant.LoRA([(a[:4], b[:1536, :4]), (a[4:], b[1536:, 4:])], [1536, 1536], 2.0)
    lin = quant.Int4Linear(weight, [1536, 1536], wide_rows=4, lora=lora, act=act)
    delta = 2.0 * torch.block_diag(b[:1536, :4], b[1536:, 4:]) @ a
    # fp32 activations on our kernels: the fp32 path's numbers up to summation order; int8 per 32-group and bf16
    # (torch's kernel, dense copy) round the activations
    narrow_tol = 1e-5 if (kernels, act) == ("ours", "fp32") else 2e-2
    for rows in (1, 3, 4, 9):  # below wide_rows: 4-bit kernel; from it: dense bf16
        x = torch.randn(1, rows, 576)
        ref = F.linear(x, ref_w + delta)
        got = lin(x)
        assert got.shape == (1, rows, 3072) and got.dtype == torch.float32
        assert (got - ref).abs().max() / ref.abs().max() < (narrow_tol if rows < 4 else 2e-2), rows
    assert weight.wide_bf16 == (kernels == "ours" and cpu_kernels.bf16_ok()) and (weight.dense is None) == weight.wide_bf16
    weight.wide_bf16, weight.dense = False, torch.zeros(3072, 576, dtype=torch.bfloat16)  # the switch: at wide_rows
    assert lin(torch.randn(1, 3, 576)).abs().max() > 0.1
    # it counts positions per sequence, not rows of the batch: 9 sequences of 1 position stay on the 4-bit kernel,
    # which computes each row alike at any batch size (the AR base has no LoRA; fp32 GEMMs are not row-exact)
    base = quant.Int4Linear(weight, [1536, 1536], wide_rows=4, act=act)
    xs = torch.randn(9, 1, 576)
    torch.testing.assert_close(base(xs), torch.cat([base(x[None]) for x in xs]), atol=0, rtol=0)
    assert base(xs).abs().max() > 0.1
    x = torch.randn(1, 4, 576)
    ref = F.linear(x, delta)  # the LoRA path alone (fp32, each part into its own output slice)
    torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-4)
    only_up = quant.LoRA([None, (a[4:], b[1536:, 4:])], [1536, 1536], 2.0)  # a part without an adapter adds nothing
    y = only_up.add_to(torch.zeros(4, 3072), x[0])
    assert y[:, :1536].abs().max() == 0
    torch.testing.assert_close(y[:, 1536:], ref[0, :, 1536:], atol=1e-4, rtol=1e-4)


@needs_ours
def test_our_kernels_match_the_dequantised_weights_row_by_row(gguf, monkeypatch):
    """engine/weights/csrc/q4.cpp on the real Q4_1 / Q8_0 weights: fp32 activations give the fp32 product (to summation
    order), int8 ones stay within llama.cpp-like error; every row equals itself computed alone, at any row count
    and thread count (exact batching); bad shapes are refused with the parameter named."""
    monkeypatch.setenv("FASTDLLM_KERNELS", "ours")
    k = cpu_kernels.load("ours")
    assert k is not None and cpu_kernels.status("ours").startswith("ours")
    down = gguf.q4["model.layers.5.mlp.down_proj"]  # K = 1536
    qkv = quant._fused_blocks(gguf, 7, "self_attn", ("q_proj", "k_proj", "v_proj"))
    head_q, head_d = gguf.embed_q[:8192], gguf.embed_d[:8192]
    # references from transformers' dequantised checkpoint, not from the blocks the kernels are built from
    state = read_state_dict(bundled_base_dir())
    attn = "model.layers.7.self_attn."
    refs = (state["model.layers.5.mlp.down_proj.weight"],
            torch.cat([state[attn + n + "_proj.weight"] for n in ("q", "k", "v")]))
    head_w = state["model.embed_tokens.weight"][:8192]
    cases = []
    for blocks, ref_w in zip((down, qkv), refs):
        w = quant.Int4Weight(blocks, dense_bf16=False)
        cases.append((ref_w, lambda x, w=w: k.q4_f32(x, w.qs, w.dm), lambda x, w=w: k.q4_i8w(x, w.qs, w.dm)))
    head = quant.Q8Head(head_q, head_d)
    cases.append((head_w, lambda x: k.q8_f32(x, head.u, head.d), lambda x: k.q8_i8w(x, head.u, head.d)))
    threads = torch.get_num_threads()
    try:
        for ref_w, f32, i8 in cases:
            x = torch.randn(11, ref_w.shape[1]) * torch.rand(1, ref_w.shape[1]) * 3  # uneven feature scales
            ref = x.double() @ ref_w.double().T
            for fn, tol in ((f32, 1e-6), (i8, 2e-2)):
                y = fn(x)
                assert (y.double() - ref).abs().max() / ref.abs().max() < tol
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for rows in (1, 3, 5, 6, 9):  # <= 4 rows: in registers; more: f32_unpack_tile (Q8: > 8)
                        torch.testing.assert_close(fn(x[:rows].contiguous()), y[:rows], atol=0, rtol=0)
                    torch.testing.assert_close(fn(x[7:8].contiguous()), y[7:8], atol=0, rtol=0)
    finally:
        torch.set_num_threads(threads)
    w = quant.Int4Weight(down, dense_bf16=False)
    with pytest.raises(RuntimeError, match="x has 576 features, the weight 1536"):
        k.q4_f32(torch.randn(2, 576), w.qs, w.dm)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        k.q4_f32(torch.randn(2, 1536).double(), w.qs, w.dm)
    monkeypatch.setenv("FASTDLLM_KERNELS", "fast")
    with pytest.raises(ValueError, match="FASTDLLM_KERNELS.*auto, ours, torch"):
        quant.WeightPolicy.from_env()  # what Engine.load reads
    with pytest.raises(ValueError, match="FASTDLLM_KERNELS.*auto, ours, torch"):
        cpu_kernels.load("fast")


@needs_ours
def test_wide_int8_kernels_on_the_interleave(gguf):
    """engine/weights/csrc/wide_i8.cpp (FASTDLLM_WIDE_ACTIVATIONS=int8, FASTDLLM_ACTIVATIONS=int8): on the real Q4_1 /
    Q8_0 weights, the exact product of the rows quantised per 32-group to int8 (up to fp32 summation), within
    llama.cpp-like error of the fp32 product; every row equals itself computed alone at any row count (register
    passes of up to 9 rows, split evenly) and thread count; output counts that are not a multiple of 16 (a tail block) too."""
    k = cpu_kernels.load("ours")
    down = gguf.q4["model.layers.5.mlp.down_proj"]  # K = 1536
    qkv = quant._fused_blocks(gguf, 7, "self_attn", ("q_proj", "k_proj", "v_proj"))  # 960 outputs
    small = _small_blocks(44, 128)  # 44 outputs: two blocks of 16 and a tail of 12
    cases = []
    for blocks in (down, qkv, small):
        w = quant.Int4Weight(blocks, dense_bf16=False)
        cases.append((blocks.dequantize(), lambda x, w=w: k.q4_i8w(x, w.qs, w.dm)))
    for q, d in ((gguf.embed_q[:8192], gguf.embed_d[:8192]), (gguf.embed_q[:20], gguf.embed_d[:20])):  # 20: a tail of 4
        head = quant.Q8Head(q, d)
        ref_w = (q.float().view(q.shape[0], -1, 32) * d.half().float()[..., None]).flatten(1)
        cases.append((ref_w, lambda x, h=head: k.q8_i8w(x, h.u, h.d)))
    threads = torch.get_num_threads()
    try:
        for ref_w, wide in cases:
            x = torch.randn(19, ref_w.shape[1]) * torch.rand(1, ref_w.shape[1]) * 3  # uneven feature scales
            ref = x.double() @ ref_w.double().T
            y = wide(x)
            assert (y.double() - ref).abs().max() / ref.abs().max() < 2e-2
            # the int8 rows exactly as the kernel makes them (fp32: d = amax / 127, q = round-to-even(x * (1 / d)))
            g = x.view(19, -1, 32)
            d = g.abs().amax(-1, keepdim=True) / 127
            xq = torch.round(g * torch.where(d > 0, 1 / d, torch.zeros_like(d))) * d
            exact = xq.flatten(1).double() @ ref_w.double().T  # sum_g d_w d_x sum(q_w q_x) + m_w d_x sum(q_x), in fp64
            assert (y.double() - exact).abs().max() / ref.abs().max() < 1e-5
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (1, 3, 8, 9, 17):
                    torch.testing.assert_close(wide(x[:rows].contiguous()), y[:rows], atol=0, rtol=0)
                torch.testing.assert_close(wide(x[11:12].contiguous()), y[11:12], atol=0, rtol=0)
    finally:
        torch.set_num_threads(threads)
    w = quant.Int4Weight(down, dense_bf16=False)
    with pytest.raises(RuntimeError, match="q4_i8w: x has 576 features, the weight 1536"):
        k.q4_i8w(torch.randn(2, 576), w.qs, w.dm)
    with pytest.raises(RuntimeError, match="q4_i8w: x must be a contiguous fp32"):
        k.q4_i8w(torch.randn(2, 1536).double(), w.qs, w.dm)
    # the switch: wide calls of int4+bf16 run these kernels, with no dense copy, whatever the CPU's bf16 support
    wide = quant.Int4Weight(down, True, "ours", "int8")
    assert wide.wide_int8 and not wide.wide_bf16 and wide.dense is None
    x = torch.randn(9, 1536)
    assert torch.equal(wide.wide(x), k.q4_i8w(x, wide.qs, wide.dm))
    head = quant.Q8Head(gguf.embed_q[:64], gguf.embed_d[:64], "ours", "int8")
    assert head.wide_int8 and not head.wide_bf16
    x = torch.randn(9, 576)
    assert torch.equal(head(x, 9, "fp32", wide=True), k.q8_i8w(x, head.u, head.d))
    assert torch.equal(head(x, 1, "fp32", wide=False), k.q8_f32(x, head.u, head.d))


@needs_ours
def test_lora_kernel_keeps_the_files_weights_and_sums_each_row_alone():
    """engine/weights/csrc/lora.cpp: the adapter's delta in one call, with its weights as exact as the file (bf16 where
    bf16 holds them, B times a power-of-two scale included; fp32 otherwise), equal to ATen's fp32 products up to
    summation order, each row the same whatever rows are beside it; a slice that does not fit is refused."""
    k = cpu_kernels.load("ours")
    g = torch.Generator().manual_seed(11)
    outs = [576, 192, 192, 40]  # 40: a partial 32-output chunk
    parts = [((torch.randn(32, 576, generator=g) * 0.05).bfloat16(), (torch.randn(o, 32, generator=g) * 0.05).bfloat16())
             for o in outs]
    parts[1] = None  # a part without an adapter
    threads = torch.get_num_threads()
    try:
        for scale, b_dtype in ((2.0, torch.bfloat16), (0.3, torch.float32)):
            ours, aten = quant.LoRA(parts, outs, scale, k), quant.LoRA(parts, outs, scale)
            assert ours.a_t.dtype == torch.bfloat16 and ours.b_t0.dtype == b_dtype and aten.a_t.dtype == torch.float32
            x, y0 = torch.randn(19, 576, generator=g), torch.randn(19, sum(outs), generator=g)
            want = aten.add_to(y0.clone(), x)
            got = ours.add_to(y0.clone(), x)
            assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())
            assert torch.equal(got[:, 576:768], y0[:, 576:768])  # the part without an adapter is untouched
            strided = ours.add_to(y0.clone().t().contiguous().t(), x)  # not contiguous: ATen's products on the panels
            assert float((strided - want).abs().max()) < 1e-5 * float(want.abs().max())
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (1, 3, 8, 9, 12, 13, 17):  # lora.cpp's passes: up to 12 rows, then equal halves
                    assert torch.equal(ours.add_to(y0[:rows].clone(), x[:rows].contiguous()), got[:rows])
    finally:
        torch.set_num_threads(threads)
    # the kernel's weights lie in 32-output panels, zero past the outputs; the ATen path reads them back
    t = torch.randn(70, 40, generator=g)
    for w in (t, t.bfloat16()):  # bf16: each k-pair's rows interleaved
        assert lora_panels(w).shape == (2, 70, 32) and torch.equal(lora_unpanel(lora_panels(w), 40), w)
    assert not lora_panels(t)[1, :, 8:].any()
    assert torch.equal(lora_panels(t.bfloat16())[0, 0, :4], t.bfloat16()[:2, :2].t().reshape(-1))
    # an odd rank cannot pair up: that B stays fp32 panels (exact), and the sums are the same
    odd = [((torch.randn(3, 576, generator=g) * 0.05).bfloat16(), (torch.randn(40, 3, generator=g) * 0.05).bfloat16())]
    ours, aten = quant.LoRA(odd, [40], 2.0, k), quant.LoRA(odd, [40], 2.0)
    assert ours.a_t.dtype == torch.bfloat16 and ours.b_t0.dtype == torch.float32
    x, y0 = torch.randn(5, 576, generator=g), torch.randn(5, 40, generator=g)
    want = aten.add_to(y0.clone(), x)
    assert float((ours.add_to(y0.clone(), x) - want).abs().max()) < 1e-5 * float(want.abs().max())
    fp32_a = quant.LoRA([(torch.randn(4, 64, generator=g), torch.randn(8, 4, generator=g))], [8], 1.0, k)
    assert fp32_a.a_t.dtype == torch.float32  # an fp32 adapter's values that bf16 cannot hold stay fp32
    with pytest.raises(RuntimeError, match="slice 0 does not fit"):
        k.lora_add(torch.zeros(2, 8), torch.randn(2, 64), fp32_a.a_t, [fp32_a.b_t0], [0, 4, 4, 12])
    with pytest.raises(RuntimeError, match="A\\^T has 64 inputs, x 32"):
        k.lora_add(torch.zeros(2, 8), torch.randn(2, 32), fp32_a.a_t, [fp32_a.b_t0], [0, 4, 0, 8])


def test_weight_policy_errors_name_the_setting(monkeypatch):
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int3")
    with pytest.raises(ValueError, match="FASTDLLM_WEIGHTS.*int4\\+bf16, int4, bf16, fp32"):
        quant.WeightPolicy.from_env()
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4")
    monkeypatch.setenv("FASTDLLM_INT4_WIDE_ROWS", "1")
    with pytest.raises(ValueError, match="FASTDLLM_INT4_WIDE_ROWS.*>= 2"):
        quant.WeightPolicy.from_env()
    monkeypatch.setenv("FASTDLLM_INT4_WIDE_ROWS", "many")
    with pytest.raises(ValueError, match="FASTDLLM_INT4_WIDE_ROWS"):
        quant.WeightPolicy.from_env()
    monkeypatch.setenv("FASTDLLM_INT4_WIDE_ROWS", "8")
    assert quant.WeightPolicy.from_env().switch(True) == quant.WeightPolicy.from_env().switch(False) == 8
    monkeypatch.delenv("FASTDLLM_INT4_WIDE_ROWS")  # unset: each backend's own switch
    assert (quant.WeightPolicy.from_env().switch(True), quant.WeightPolicy.from_env().switch(False)) == (2, 16)
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="FASTDLLM_ACTIVATIONS.*fp32, int8"):
        quant.WeightPolicy.from_env()
    monkeypatch.delenv("FASTDLLM_ACTIVATIONS")
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="FASTDLLM_WIDE_ACTIVATIONS.*bf16, int8"):
        quant.WeightPolicy.from_env()
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "int8")
    assert quant.WeightPolicy.from_env().wide_act == "int8"


@pytest.mark.timeout(600)  # a second engine load and batched 4-bit decodes
def test_default_engine_runs_the_gguf_4bit_weights_and_decodes_like_fp32(engine, monkeypatch):
    """Default load on CPU: int4+bf16 projections shared by base and dLLM, LoRA separate; greedy AR and diffusion
    answers start like the fp32 path's (`engine` is the suite's fp32 engine)."""
    from engine import Engine

    monkeypatch.delenv("FASTDLLM_WEIGHTS")
    q = Engine.load()
    assert q.lm.info["weights"] == "int4+bf16" and "int4+bf16 weights" in q.lm.banner()
    assert q.lm.info["kernels"] in q.lm.banner()
    tiles = " on AMX tiles" if HAS_OURS and cpu_kernels.load("ours").amx_bf16_ready() else ""  # amx.cpp
    assert (q.lm.info["kernels"] == f"ours (AVX-512 VNNI), int8 activations (bf16{tiles} from 2 positions)") == HAS_OURS
    base, dllm = q.lm.base.model.layers[0].mlp.gate_up, q.lm.dllm.model.layers[0].mlp.gate_up
    assert isinstance(base, quant.Int4Linear) and base.lora is None and base.wide_rows == \
        (quant.OURS_WIDE_ROWS if HAS_OURS else quant.TORCH_WIDE_ROWS)
    assert dllm.weight is base.weight and dllm.lora is not None  # one copy of the 4-bit weights
    assert q.lm.dllm.lm_head.core is q.lm.base.lm_head.core and (q.lm.base.lm_head.core.kernels is not None) == HAS_OURS
    assert read_adapter_tensors(BUNDLED_ADAPTER)[1] == 2.0
    for mode in ("ar", "diffusion"):
        cfg = q.decode_config(mode=mode, max_new_tokens=24, temperature=0.0)
        for prompt in PROMPTS:
            got = q.generate(prompt, cfg, record=False)[0].summary.token_ids
            ref = engine.generate(prompt, engine.decode_config(mode=mode, max_new_tokens=24, temperature=0.0),
                                  record=False)[0].summary.token_ids
            same = next((i for i, (u, v) in enumerate(zip(got, ref)) if u != v), min(len(got), len(ref)))
            if same < 6 and mode == "ar":
                # a near-tie of the exact path may flip (bf16 wide activations move logits by ~0.1-0.4: on AMX tiles
                # "What is the capital of France?" opens with "L" instead of "The", 0.05 apart in fp32): the 4-bit
                # token must then be within 0.25 of the fp32 path's best at that point, which broken weights are not
                ids = engine.encode(engine.chat_prompt([{"role": "user", "content": prompt}])) + ref[:same]
                with torch.inference_mode():
                    logits = engine.lm.base(torch.tensor([ids]), torch.arange(len(ids))[None], causal=True)[0, -1]
                assert float(logits[ref[same]] - logits[got[same]]) < 0.25, (mode, prompt, got, ref)
                continue
            assert same >= 6, (mode, prompt, got, ref)  # broken weights diverge at once
    # the static-shape stepper (engine/static.py, forced on for CPU) runs the same 4-bit modules
    static = Engine(q.lm, static=True)
    cfg = q.decode_config(mode="ar", max_new_tokens=12, temperature=0.0)
    assert static.generate(PROMPTS[0], cfg, record=False)[0].summary.token_ids == \
        q.generate(PROMPTS[0], cfg, record=False)[0].summary.token_ids
    # a batch's greedy AR answers are the single-user ones, as the scheduler admitting users needs: batched rows
    # run the kernels each runs alone (the 4-bit switch counts positions per sequence) and attention reads whole
    # key quanta (engine/model.py KEY_QUANTUM); without either, bf16 activations flip near-ties here
    prompts = [*PROMPTS, "Name three primary colors.", "Write a haiku about the sea.", "What is 12 times 7?"]
    cfg = q.decode_config(mode="ar", max_new_tokens=16, temperature=0.0)
    batch = [r.summary.token_ids for r in q.generate(prompts, cfg, record=False)]
    assert batch == [q.generate(p, cfg, record=False)[0].summary.token_ids for p in prompts]
    # and diffusion's, block and dual cache: every row also gets its single-user forwards there (rows grouped by
    # width), and our kernels' LoRA (lora.cpp) sums each row on its own (ATen's small GEMMs did not)
    if HAS_OURS:
        for cache in ("block", "dual"):
            cfg = q.decode_config(mode="diffusion", cache=cache, max_new_tokens=16, temperature=0.0)
            batch = [r.summary.token_ids for r in q.generate(prompts, cfg, record=False)]
            assert batch == [q.generate(p, cfg, record=False)[0].summary.token_ids for p in prompts], cache


def test_q8_lm_head_both_backends(gguf, kernels):
    """Ours: the Q8_0 head as stored. torch: q = 16 hi + lo, two int4 planes that add up to it exactly. Both give
    its logits, and each row's logits alike at any batch size."""
    q, d = gguf.embed_q[:4096], gguf.embed_d[:4096]
    exact = (q.float().view(4096, -1, 32) * d[..., None]).flatten(1)
    if kernels == "torch":
        hi, lo = quant.q8_planes(q, d)
        assert torch.equal(hi.dequantize() + lo.dequantize(), exact)
    core = quant.Q8Head(q, d, kernels)
    assert (core.kernels is not None) == (kernels == "ours")
    for act in quant.ACTS:
        head = quant.LMHead(core, None, act)
        tol = 1e-6 if (kernels, act) == ("ours", "fp32") else 2e-2
        for rows in (1, quant.HEAD_WIDE_ROWS, 9):
            x = torch.randn(1, rows, 576)
            ref = F.linear(x, exact)
            assert (head(x) - ref).abs().max() / ref.abs().max() < tol, rows
        xs = torch.randn(8, 1, 576)  # 8 sequences of one position: each as alone
        torch.testing.assert_close(head(xs), torch.cat([head(x[None]) for x in xs]), atol=0, rtol=0)


@needs_ours
@pytest.mark.timeout(600)  # three engine loads and 4-bit decodes: ~2 min on the shared box
def test_one_call_layer_step_matches_the_eager_layers(monkeypatch):
    """engine/weights/csrc/layer.cpp: a cached forward of up to a block runs each decoder layer as one call (AR base and dLLM
    with its LoRA; below the switch point fp32 activations, from it bf16 ones as the eager wide calls); its logits
    match the eager layers', greedy answers are the same, and wider forwards and AR prefills keep the eager path."""
    from engine import Engine
    from engine.model import KVCache, wide_calls

    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    monkeypatch.setenv("FASTDLLM_FUSED", "1")
    # switch 33 (the default before issue 23): every step fp32; at the default (2) the 31-wide prefill and the sub-block
    # and block steps run bf16 activations (fused and eager alike, in another order: logits up to ~1.1 % of the
    # largest apart over random ids), and the AR step inherits the prefill's K/V difference
    # without AVX-512 BF16 the bf16 block step runs a dense bf16 copy through torch instead of q4_bf16: measured
    # 2.8 % of the largest logit on an Intel Xeon with the step-816 adapter, 4.5 % with block 2's. With block 2's
    # adapter the dLLM's block step on Zen 4 (q4_bf16) measured 5.45 % (the AR base's 0.94 %, the narrow steps
    # <= 0.4 %): the adapter's LoRA path amplifies the bf16 rounding over random ids, on either kernel. One bound for
    # both CPUs; the greedy answers below are the quality check
    bf16_block_tol = 6e-2
    # int8 wide activations (wide_i8.cpp) in both paths: the same kernels, only attention's order differs, but a
    # rounding step of the int8 rows is coarser than bf16's, so the 31-wide prefill's K/V move the AR step by up to
    # ~1.4 % of the largest logit and the dLLM's block step by 8.4 % (measured on the Zen 4; 14.0 % on an Intel Xeon
    # with AMX, whose attention kernels round differently: the LoRA path amplifies it, as above).
    # The kernels themselves are checked row by row in test_wide_int8_kernels_on_the_interleave; here, that the
    # fused step runs them (wide_mode) and stays near the eager layers. The default (bf16) runs last: the engine the
    # answers below compare.
    # One-token steps: fp32 activations in the first three (exact up to a block with switch 33); the default (int8,
    # the same kernel as int8 wide calls) in the last, whose narrow error is int8 rounding of the 31-wide prefill's
    # K/V and of the step's own rows.
    for switch, wide_act, act, tol_narrow, tol_wide in (("33", "bf16", "fp32", 1e-4, 1e-4),
                                                        (None, "int8", "fp32", 3e-2, 1.6e-1),
                                                        (None, "bf16", "fp32", 5e-3, bf16_block_tol),
                                                        (None, "bf16", "", 3e-2, bf16_block_tol)):
        monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", wide_act)
        monkeypatch.setenv("FASTDLLM_ACTIVATIONS", act)
        if switch is None:
            monkeypatch.delenv("FASTDLLM_INT4_WIDE_ROWS", raising=False)
        else:
            monkeypatch.setenv("FASTDLLM_INT4_WIDE_ROWS", switch)
        q = Engine.load()
        steps_of = {id(m): m.steps for m in (q.lm.base, q.lm.dllm)}
        for model in (q.lm.base, q.lm.dllm):
            assert model.steps is not None and len(model.steps) == model.cfg.num_hidden_layers
            # up to a block when the CPU has AVX-512 BF16 (q4_bf16 wide calls); otherwise below the fp32/bf16 switch
            # (this test ran on an Intel Xeon without avx512_bf16 as well as on Zen 4)
            wide = quant.FUSED_MAX_WIDTH if cpu_kernels.bf16_ok() or wide_act == "int8" else model.steps[0].wide_rows - 1
            assert model.steps[0].max_width == wide and model.steps[0].wide_mode == (2 if wide_act == "int8" else 1)
            assert model.steps[0].wide_rows == (quant.OURS_WIDE_ROWS if switch is None else int(switch))
            ids = torch.randint(0, 2000, (2, 72), generator=torch.Generator().manual_seed(7))
            pos = torch.arange(72)[None].expand(2, 72)
            with torch.inference_mode():
                outs = []
                for steps in (model.steps, None):
                    model.steps = steps
                    cache = KVCache(model.cfg, 2, 128, torch.device("cpu"), torch.float32)
                    model(ids[:, :31], pos[:, :31], cache=cache, start=0, causal=True)  # 31 wide: fused / eager
                    one = model(ids[:, 31:32], pos[:, 31:32], cache=cache, start=31, causal=True)  # AR step
                    nine = model(ids[:, 32:41], pos[:, 32:41], cache=cache, start=32, causal=False)  # a sub-block step
                    block = model(ids[:, 40:72], pos[:, 40:72], cache=cache, start=40, causal=False)  # a block step
                    outs.append((one, nine, block))
                model.steps = steps_of[id(model)]
            for fused, eager in zip(*outs):
                err = float((fused - eager).abs().max() / eager.abs().max())
                assert err < (tol_wide if fused.shape[1] >= model.steps[0].wide_rows else tol_narrow), \
                    (switch, wide_act, fused.shape, err)
    monkeypatch.delenv("FASTDLLM_WIDE_ACTIVATIONS")
    monkeypatch.delenv("FASTDLLM_ACTIVATIONS")
    # The switch point (the default engine): a forward of exactly wide_rows positions runs the wide products, one
    # position fewer the one-token ones; the one-call stack of every layer gives what the layers' own steps give,
    # called one by one, on both sides of the switch (the stack takes its mode from the same rule)
    model, steps = q.lm.dllm, q.lm.dllm.steps
    step = steps[0]
    assert step.wide_mode != 0 and step.wide(step.wide_rows) == step.wide_mode and step.wide(step.wide_rows - 1) == 0

    class OneByOne:
        max_width = steps.max_width

        def __call__(self, x, cache_k, cache_v, shared):
            for i, s in enumerate(steps):
                x = s(x, cache_k[i], cache_v[i], shared)
            return x

    ids = torch.randint(0, 2000, (1, 40), generator=torch.Generator().manual_seed(9))
    pos = torch.arange(40)[None]
    with torch.inference_mode():
        outs = []
        for via in (steps, OneByOne()):
            model.steps = via
            cache = KVCache(model.cfg, 1, 64, torch.device("cpu"), torch.float32)
            model(ids[:, :32], pos[:, :32], cache=cache, start=0, causal=True)
            outs += [model(ids[:, 32:32 + w], pos[:, 32:32 + w], cache=cache, start=32, causal=True)
                     for w in (step.wide_rows - 1, step.wide_rows)]
        model.steps = steps
    assert all(torch.equal(a, b) for a, b in zip(outs[:2], outs[2:]))
    # The engine's key counts are whole 32-key quanta; the step also takes any count: 75 keys (a partial last
    # 16-key tile) give exactly what the same keys padded to 80 with the extra 5 masked give.
    m = q.lm.dllm
    g = torch.Generator().manual_seed(3)
    b, t, d = 2, 9, m.cfg.head_dim
    qpos = torch.arange(60, 69)[None].expand(b, t).contiguous()
    cos, sin = m.rope(qpos, torch.float32)
    rope = (cos.expand(b, 1, t, d).reshape(b * t, d).contiguous(), sin.expand(b, 1, t, d).reshape(b * t, d).contiguous())
    x = torch.randn(b, t, m.cfg.hidden_size, generator=g)
    kv = torch.randn(2, b, m.cfg.num_key_value_heads, 80, d, generator=g)
    vis = torch.rand(b, t, 80, generator=g) > 0.3
    vis[..., 75:] = False
    with torch.inference_mode():
        partial = m.steps[0](x, kv[0].clone(), kv[1].clone(), (*rope, qpos, vis[..., :75].contiguous(), None))
        whole = m.steps[0](x, kv[0].clone(), kv[1].clone(), (*rope, qpos, vis, None))
        # a part of a batch (cache_rows): rows 2 and 0 of a 3-row cache, read and written in place, as a compact copy
        big_k, big_v = torch.randn(2, 3, *kv.shape[2:], generator=g).unbind(0)
        big_k[[2, 0]], big_v[[2, 0]] = kv[0], kv[1]
        rows = torch.tensor([2, 0])
        k_in, v_in = big_k.clone(), big_v.clone()
        part = m.steps[0](x, big_k, big_v, (*rope, qpos, vis, rows))
    assert torch.equal(partial, whole) and torch.equal(part, whole)
    small_k, small_v = kv[0].clone(), kv[1].clone()
    m.steps[0](x, small_k, small_v, (*rope, qpos, vis, None))
    assert torch.equal(big_k[rows], small_k) and torch.equal(big_v[rows], small_v)  # its new K/V went to its rows
    assert torch.equal(big_k[1], k_in[1]) and torch.equal(big_v[1], v_in[1])  # and nowhere else
    with pytest.raises(RuntimeError, match="cache row 3 outside the cache"):
        m.steps[0](x, big_k, big_v, (*rope, qpos, vis, torch.tensor([3, 0])))
    # the switch: forwards wider than a block and AR prefills (wide_calls) never reach the steps, the others do
    model = q.lm.base
    saved = model.steps

    class Refuse:
        max_width = saved.max_width

        def __call__(self, *a):
            raise AssertionError("layer step called")

    model.steps = Refuse()
    try:
        with torch.inference_mode():
            cache = KVCache(model.cfg, 1, 96, torch.device("cpu"), torch.float32)
            model(torch.randint(0, 2000, (1, 40)), torch.arange(40)[None], cache=cache, start=0, causal=True)
            with wide_calls():
                model(torch.tensor([[5]]), torch.tensor([[40]]), cache=cache, start=40, causal=True)
            with pytest.raises(AssertionError, match="layer step called"):
                model(torch.tensor([[5]]), torch.tensor([[41]]), cache=cache, start=41, causal=True)
    finally:
        model.steps = saved
    # Greedy tokens, fused against eager, on fp32 one-token steps: the C++ step and torch's eager ops (norms, rope,
    # attention) round differently at 1e-7, which int8 activations (the default) can turn into a different int8 code
    # and a flipped near-tie (an AR answer here diverged at token 6 under one thread); their closeness on int8 is the
    # tolerance check above
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "fp32")
    q = Engine.load()
    monkeypatch.setenv("FASTDLLM_FUSED", "0")
    eager = Engine.load()
    assert eager.lm.base.steps is None and eager.lm.dllm.steps is None and q.lm.base.steps is not None
    for mode, cache in (("ar", "dual"), ("diffusion", "dual"), ("diffusion", "block"), ("diffusion", "none")):
        cfg = q.decode_config(mode=mode, cache=cache, max_new_tokens=24, temperature=0.0)
        for prompt in PROMPTS:
            assert q.generate(prompt, cfg, record=False)[0].summary.token_ids == \
                eager.generate(prompt, cfg, record=False)[0].summary.token_ids, (mode, cache, prompt)


def test_kernels_fall_back_to_torch_with_the_reason(monkeypatch):
    """Without AVX-512 VNNI (or a compiler) the engine uses torch's int4 kernel and says why; FASTDLLM_KERNELS=ours
    turns that into an error instead."""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma"})
    cpu_kernels._build.cache_clear()
    try:
        assert cpu_kernels.load("auto") is None
        assert cpu_kernels.status("auto").startswith("torch (this CPU lacks avx512f")
        blocks = quant.Q4Blocks(torch.randint(0, 16, (64, 128), dtype=torch.uint8), torch.rand(64, 4) * 0.01,
                                -torch.rand(64, 4) * 0.05)
        w = quant.Int4Weight(blocks, dense_bf16=False)
        assert w.kernels is None and hasattr(w, "packed")
        x = torch.randn(3, 128)
        assert (w.narrow(x, "fp32") - x @ blocks.dequantize().T).abs().max() < 0.05
        with pytest.raises(RuntimeError, match="FASTDLLM_KERNELS=ours: this CPU lacks"):
            cpu_kernels.load("ours")
    finally:
        cpu_kernels._build.cache_clear()


# ---------------------------------------------------------------- small synthetic weights: the unpacking and the layers
# A GGUF written by gguf-py with its own Q4_1 / Q8_0 quantisers is the reference for our reading of the blocks (nibble
# order, scales, q/k row order), and small random blocks for the 4-bit layers on both backends. Seconds in all: these
# are the mutation target `quant`'s test selection (scripts/mutation.sh).
N_HEAD, N_KV = 4, 2
SHAPES = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64), "ffn_gate": (96, 64),
          "ffn_up": (96, 64), "ffn_down": (64, 128)}


def _llama_cpp_rows(w, n_head: int):
    """convert_hf_to_gguf.py's permute of q/k rows (the rotary halves interleaved), which reading must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, tensors: dict) -> None:
    """tensors: name -> (float array, type), quantised by gguf-py."""
    import gguf as gg
    from gguf.quants import quantize

    w = gg.GGUFWriter(str(path), "llama")
    for name, (x, kind) in tensors.items():
        if kind == gg.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, expected): our parameter name -> the dequantised weight in transformers' row order (gguf-py's
    dequantize of gguf-py's quantize), plus 'embed' -> (q, dequantised) of the Q8_0 embedding."""
    import gguf as gg
    import numpy as np
    from gguf.quants import dequantize, quantize

    T = gg.GGMLQuantizationType
    rng = np.random.default_rng(0)
    # skipped, and first, as in a real GGUF (blk.0.attn_norm follows token_embd): a 1-D norm, a 2-D tensor outside the
    # blocks, a 2-D block tensor that is not a projection (mutation run: with them last, `break` for `continue` passed)
    tensors = {"blk.0.attn_norm.weight": (np.ones(64, np.float32), T.F32),
               "output.weight": ((rng.standard_normal((8, 64)) * 0.1).astype(np.float32), T.Q8_0),
               "blk.0.attn_q_norm.weight": (np.ones((4, 64), np.float32), T.F32)}
    expected = {}
    for layer in (0, 1):
        for key, shape in SHAPES.items():
            hf = (rng.standard_normal(shape) * 0.05 + rng.uniform(-0.02, 0.02, (shape[0], 1))).astype(np.float32)
            stored = _llama_cpp_rows(hf, N_HEAD if key == "attn_q" else N_KV) if key in ("attn_q", "attn_k") else hf
            tensors[f"blk.{layer}.{key}.weight"] = (stored, T.Q4_1)
            name = f"model.layers.{layer}.{quant.GGUF_NAMES[key]}"
            expected[name] = torch.from_numpy(dequantize(quantize(hf, T.Q4_1), T.Q4_1).copy())
    emb = (rng.standard_normal((8, 64)) * 0.1).astype(np.float32)
    emb[3, :32] *= 40  # a group with a large scale
    tensors["token_embd.weight"] = (emb, T.Q8_0)
    raw = quantize(emb, T.Q8_0).reshape(8, 2, 34)
    expected["embed"] = (torch.from_numpy(raw[..., 2:].copy()).view(torch.int8).reshape(8, 64),
                         torch.from_numpy(dequantize(quantize(emb, T.Q8_0), T.Q8_0).copy()))
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    _write_gguf(path, tensors)
    return path, expected


def _check_tiny(w: quant.GGUFWeights, expected: dict) -> None:
    assert sorted(w.q4) == sorted(k for k in expected if k != "embed")
    for name, blocks in w.q4.items():
        out, inp = expected[name].shape
        assert blocks.q.dtype == torch.uint8 and blocks.q.shape == (out, inp) and int(blocks.q.max()) <= 15
        assert blocks.d.shape == blocks.m.shape == (out, inp // 32) and blocks.d.dtype == torch.float32
        assert torch.equal(blocks.dequantize(), expected[name]), name
    q, deq = expected["embed"]
    assert torch.equal(w.embed_q, q) and w.embed_d.shape == (8, 2) and w.embed_d.dtype == torch.float32
    assert torch.equal((w.embed_q.float().view(8, 2, 32) * w.embed_d[..., None]).flatten(1), deq)
    assert w.head_q is None and w.head_d is None


def test_gguf_blocks_equal_gguf_pys_dequantised_weights(tiny_gguf):
    """Q4_1 nibbles (weight j low, j + 16 high), d and m, the q/k rows put back in transformers' order (4 query heads,
    2 key heads), and the Q8_0 embedding's int8 rows and scales: exactly gguf-py's dequantisation."""
    path, expected = tiny_gguf
    _check_tiny(quant.read_gguf(path, N_HEAD, N_KV), expected)


def test_gguf_refuses_unexpected_block_types(tmp_path):
    import gguf as gg
    import numpy as np

    T = gg.GGMLQuantizationType
    x = np.ones((4, 64), np.float32)
    cases = [({"token_embd.weight": (x, T.Q4_1)}, "gguf: token_embd is Q4_1, expected Q8_0"),
             ({"token_embd.weight": (x, T.Q8_0), "blk.0.ffn_up.weight": (x, T.Q8_0)},
              "gguf: blk.0.ffn_up.weight is Q8_0, expected Q4_1"),
             ({"blk.0.ffn_up.weight": (x, T.Q4_1)}, "gguf: {} has no token_embd.weight")]
    for i, (tensors, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        _write_gguf(path, tensors)
        with pytest.raises(ValueError) as e:
            quant.read_gguf(path, N_HEAD, N_KV)
        assert str(e.value) == message.format(path)


def test_block_cache_reads_back_what_was_parsed(tiny_gguf, tmp_path):
    """cached_gguf parses once and writes the cache atomically (a new folder made, no temporary file left); later
    calls read only the cache (the GGUF is not opened again), each projection on use, and an untied head too."""
    from engine.weights import gguf as gguf_blocks

    path, expected = tiny_gguf
    cache = tmp_path / "new" / "blocks.safetensors"
    _check_tiny(gguf_blocks.cached_gguf(path, N_HEAD, N_KV, cache), expected)
    assert [p.name for p in cache.parent.iterdir()] == ["blocks.safetensors"]
    again = gguf_blocks.cached_gguf(tmp_path / "absent.gguf", N_HEAD, N_KV, cache)
    assert isinstance(again.q4, gguf_blocks.CachedBlocks) and len(again.q4) == 14
    assert list(again.q4) == sorted(k for k in expected if k != "embed")
    _check_tiny(again, expected)
    with pytest.raises(KeyError):
        again.q4["model.layers.9.mlp.up_proj"]
    w = quant.read_gguf(path, N_HEAD, N_KV)
    head_q, head_d = torch.randint(-128, 128, (8, 64), dtype=torch.int8), torch.rand(8, 2).half().float()
    w.head_q, w.head_d = head_q, head_d
    gguf_blocks.save_blocks(w, tmp_path / "head.safetensors")
    back = gguf_blocks.load_blocks(tmp_path / "head.safetensors")
    assert torch.equal(back.head_q, head_q) and torch.equal(back.head_d, head_d) and back.head_d.dtype == torch.float32
    assert sorted(back.q4) == sorted(w.q4) and torch.equal(back.embed_q, w.embed_q)
    # a cache directory (a file per layer, the rows in another, as engine/weights/q4_quantize.py writes): the same
    # blocks, each projection read from its own file; a directory without the rows is refused by name
    split = tmp_path / "split"
    split.mkdir()
    names = sorted(w.q4)
    gguf_blocks.save_blocks(quant.GGUFWeights({n: w.q4[n] for n in names[:5]}, w.embed_q, w.embed_d, head_q, head_d),
                            split / "embed.safetensors")
    from safetensors.torch import save_file

    save_file(gguf_blocks.block_tensors({n: w.q4[n] for n in names[5:]}), str(split / "layer001.safetensors"))
    both = gguf_blocks.load_blocks(split)
    assert sorted(both.q4) == names and torch.equal(both.head_q, head_q) and torch.equal(both.embed_q, w.embed_q)
    assert both.q4.where[names[0]].name == "embed.safetensors" and both.q4.where[names[-1]].name == "layer001.safetensors"
    assert all(torch.equal(both.q4[n].dequantize(), expected[n]) for n in names)
    (split / "embed.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no embedding"):
        gguf_blocks.load_blocks(split)


def _small_blocks(n: int = 16, k: int = 128, seed: int = 0) -> quant.Q4Blocks:
    g = torch.Generator().manual_seed(seed)
    return quant.Q4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                          (torch.rand(n, k // 32, generator=g) * 0.01 + 0.002).half().float(),
                          (-torch.rand(n, k // 32, generator=g) * 0.05).half().float())


def test_pack_pairs_and_tiles_are_the_kernels_layout():
    from engine.weights.int4 import pack_pairs, tiled

    t = torch.arange(8 * 6).view(8, 6)
    want = torch.tensor([[t[r0 + r, c * 2 + j] for c in range(3) for r in range(4) for j in range(2)]
                         for r0 in (0, 4)]).view(8, 6)
    assert torch.equal(tiled(t, 3), want)  # [N/4, chunks, 4 rows, chunk]
    q = _small_blocks().q
    flat = torch.tensor([[q[r, p * 64 + b] | (q[r, p * 64 + 32 + b] << 4) for p in range(2) for b in range(32)]
                         for r in range(16)], dtype=torch.uint8)
    packed = pack_pairs(q)
    assert packed.dtype == torch.uint8 and torch.equal(packed, tiled(flat, 2))


def test_int4_weight_on_small_blocks(kernels):
    from engine.weights.int4 import MAX_K, _ours, pack_pairs, tiled

    blocks = _small_blocks()
    ref_w = blocks.dequantize()
    x = torch.randn(3, 128)
    ref = x @ ref_w.T
    rel = lambda y: float((y - ref).abs().max() / ref.abs().max())  # noqa: E731
    w = quant.Int4Weight(blocks, True, kernels)
    assert (w.out_features, w.in_features) == (16, 128)
    if kernels == "ours":
        assert torch.equal(w.qs, pack_pairs(blocks.q))
        assert torch.equal(w.dm, tiled(torch.stack([blocks.d, blocks.m], -1).half(), 4)) and w.dm.dtype == torch.float16
        assert w.wide_bf16 == cpu_kernels.bf16_ok() and (w.dense is None) == w.wide_bf16
        assert rel(w.narrow(x, "fp32")) < 1e-6 and rel(w.narrow(x, "int8")) < 2e-2
        if w.dense is not None:
            assert torch.equal(w.dense, ref_w.bfloat16())
        assert _ours(4, 64, kernels) is not None and _ours(8, MAX_K, kernels) is not None
        assert _ours(4, 96, kernels) is None and _ours(6, 64, kernels) is None and _ours(4, MAX_K + 64, kernels) is None
    else:
        assert w.kernels is None and not w.wide_bf16 and _ours(4, 64, kernels) is None
        sz = torch.stack([blocks.d, blocks.m + 8 * blocks.d], -1).transpose(0, 1).bfloat16()
        assert torch.equal(w.scale_zero, sz)
        s = sz.float().transpose(0, 1)
        assert torch.equal(w.dense, ((blocks.q.view(16, 4, 32).float() - 8) * s[..., 0:1] + s[..., 1:2]).view(16, 128).bfloat16())
        assert rel(w.narrow(x, "fp32")) < 2e-2
    assert rel(w.wide(x)) < 2e-2 and w.wide(x).dtype == torch.float32
    plain = quant.Int4Weight(blocks, False, kernels)
    assert plain.dense is None and not plain.wide_bf16


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_int4_linear_switch_bias_and_lora_on_small_blocks(kernels, act):
    """The switch counts positions per sequence (>= wide_rows, or inside wide_calls()); bias, then the LoRA delta of
    each fused part into its own slice; wide_rows None keeps 4-bit at every width."""
    from engine.model import wide_calls

    blocks = _small_blocks()
    w = quant.Int4Weight(blocks, True, kernels)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 128, generator=g) * 0.1, torch.randn(16, 4, generator=g) * 0.1
    bias = torch.randn(16, generator=g)
    lora = quant.LoRA([(a[:2], b[:6, :2]), (a[2:], b[6:, 2:])], [6, 10], 1.5)
    delta = 1.5 * torch.block_diag(b[:6, :2], b[6:, 2:]) @ a
    lin = quant.Int4Linear(w, [6, 10], wide_rows=3, lora=lora, act=act, bias=bias)
    tol = 1e-5 if (kernels, act) == ("ours", "fp32") else 2e-2
    for shape in ((1, 2, 128), (2, 1, 128), (2, 128), (1, 3, 128), (3, 128)):
        x = torch.randn(*shape, generator=g)
        ref = F.linear(x, blocks.dequantize() + delta, bias)
        y = lin(x)
        assert y.shape == (*shape[:-1], 16) and y.dtype == torch.float32
        wide = (shape[-2] if len(shape) > 2 else shape[0]) >= 3  # bf16 activations
        assert float((y - ref).abs().max() / ref.abs().max()) < (2e-2 if wide else tol), shape
    # which path ran: wide calls now compute with zero weights, so only the bias and the LoRA delta are left
    w.wide_bf16, w.dense = False, torch.zeros(16, 128, dtype=torch.bfloat16)
    only = lambda x: F.linear(x, delta, bias)  # noqa: E731
    x2, x3 = torch.randn(1, 2, 128, generator=g), torch.randn(1, 3, 128, generator=g)
    torch.testing.assert_close(lin(x3), only(x3))  # at wide_rows: wide
    assert (lin(x2) - only(x2)).abs().max() > 0.05  # below: 4-bit
    assert (lin(torch.randn(4, 1, 128)) - only(torch.randn(4, 1, 128))).abs().max() > 0.05  # 4 rows of 1 position
    with wide_calls():
        torch.testing.assert_close(lin(x2), only(x2))
    every = quant.Int4Linear(w, [6, 10], wide_rows=None, act=act)
    assert every.bias is None and every.lora is None
    torch.testing.assert_close(every(x3), F.linear(x3, blocks.dequantize()), atol=tol * 5, rtol=tol * 5)
    one = quant.LoRA([(a, b)], [16], 2.0)  # a single part: one addmm
    assert one.whole and not lora.whole and len(lora.slices) == 2
    torch.testing.assert_close(one.add_to(torch.ones(3, 16), x3[0]), 1 + 2.0 * x3[0] @ a.T @ b.T)
    skip = quant.LoRA([None, (a[2:], b[6:, 2:])], [6, 10], 1.5)
    y = skip.add_to(torch.zeros(3, 16), x3[0])
    assert y[:, :6].abs().max() == 0 and not skip.whole
    torch.testing.assert_close(y[:, 6:], (x3[0] @ delta.T)[:, 6:])
    # q|k|v: three parts of different ranks, each B reading its own rank slice of h (mutation run: a slice table
    # that restarted at the previous part's rank passed with two parts)
    a3, b3 = torch.randn(7, 128, generator=g) * 0.1, torch.randn(16, 7, generator=g) * 0.1
    parts = [(a3[:1], b3[:4, :1]), (a3[1:3], b3[4:9, 1:3]), (a3[3:], b3[9:, 3:])]
    three = quant.LoRA(parts, [4, 5, 7], 0.5)
    assert [sl[1:3] for sl in three.slices] == [(0, 1), (1, 3), (3, 7)]
    ref3 = 0.5 * x3[0] @ (torch.block_diag(b3[:4, :1], b3[4:9, 1:3], b3[9:, 3:]) @ a3).T
    torch.testing.assert_close(three.add_to(torch.zeros(3, 16), x3[0]), ref3)


def test_dense_bf16_linear():
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(8, 64, generator=g), torch.randn(8, generator=g)
    a, b = torch.randn(2, 64, generator=g), torch.randn(8, 2, generator=g)
    lin = quant.DenseBF16Linear(weight, [8], quant.LoRA([(a, b)], [8], 0.5), bias)
    assert lin.weight.dtype == torch.bfloat16 and lin.splits == [8]
    x = torch.randn(2, 3, 64, generator=g)
    ref = F.linear(x.bfloat16(), weight.bfloat16()).float() + bias + 0.5 * x @ a.T @ b.T
    y = lin(x)
    assert y.shape == (2, 3, 8) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(quant.DenseBF16Linear(weight, [8])(x), F.linear(x.bfloat16(), weight.bfloat16()).float())


def test_q8_head_embedding_and_planes_on_small_rows(kernels):
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (16, 128), dtype=torch.int8, generator=g)
    q[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    d = (torch.rand(16, 4, generator=g) * 0.01 + 0.001).half().float()
    exact = (q.float().view(16, 4, 32) * d[..., None]).flatten(1)
    hi, lo = quant.q8_planes(q, d)
    assert torch.equal(hi.dequantize() + lo.dequantize(), exact)
    assert int(hi.q.min()) >= 0 and int(hi.q.max()) <= 15 and int(lo.q.min()) >= 0 and int(lo.q.max()) <= 15
    head = quant.Q8Head(q, d, kernels)
    if kernels == "ours":
        from engine.weights.int4 import tiled

        assert torch.equal(head.u, tiled((q.int() + 128).to(torch.uint8), 2)) and head.weight is None
        assert torch.equal(head.d, tiled(d.half(), 4))
    else:
        assert head.kernels is None and torch.equal(head.weight, exact.bfloat16())
    extra = torch.randn(2, 128, generator=g)
    for act in quant.ACTS:
        tol = 1e-6 if (kernels, act) == ("ours", "fp32") else 2e-2
        lm = quant.LMHead(head, extra, act)
        for width in (1, 3, 4, 6):
            x = torch.randn(1, width, 128, generator=g)
            y = lm(x)
            assert y.shape == (1, width, 18) and y.dtype == torch.float32
            ref = F.linear(x, exact)
            assert float((y[..., :16] - ref).abs().max() / ref.abs().max()) < tol, (act, width)
            torch.testing.assert_close(y[..., 16:], F.linear(x, extra))
        assert quant.LMHead(head, None, act)(x).shape == (1, 6, 16)
    if kernels == "torch":  # below HEAD_WIDE_ROWS positions the two int4 planes, from it the dense bf16 copy
        head.weight = torch.zeros_like(head.weight)
        assert head(torch.randn(3, 128), 3, "fp32").abs().max() > 0.01
        assert head(torch.randn(4, 128), quant.HEAD_WIDE_ROWS, "fp32").abs().max() == 0
    emb = quant.Q8Embedding(q, d, extra, torch.float32)
    ids = torch.tensor([[0, 15, 16, 17], [3, 3, 17, 1]])
    table = torch.cat([exact, extra])
    assert torch.equal(emb(ids), table[ids])
    assert torch.equal(emb(ids[:, :2]), exact[ids[:, :2]])
    plain = quant.Q8Embedding(q, d, None, torch.bfloat16)
    assert plain(ids[:, :2]).dtype == torch.bfloat16
    torch.testing.assert_close(plain(ids[:, :2]).float(), exact[ids[:, :2]], atol=0, rtol=1e-2)


def test_fused_layer_step_switch(monkeypatch):
    from engine.runtime import Runtime

    monkeypatch.delenv("FASTDLLM_FUSED", raising=False)
    assert quant.WeightPolicy.from_env().fused and Runtime.from_env().fused
    monkeypatch.setenv("FASTDLLM_FUSED", "0")
    assert not quant.WeightPolicy.from_env().fused
    monkeypatch.setenv("FASTDLLM_FUSED", "1")
    assert quant.WeightPolicy.from_env().fused


@needs_ours
def test_wide_head_runs_the_q8_rows_in_bf16_from_the_switch():
    """int4+bf16's switch covers the LM head too: in forwards narrower than `wide_rows` positions per sequence its
    Q8_0 rows take fp32 activations (q8_f32, exact up to order), from it bf16 ones (q8_bf16: the Q8 rows dequantised
    to bf16 in L1, as a dense bf16 copy would hold them). The forward's width counts (engine/model.py HEAD_WIDTH), not
    the positions whose logits are read, which a batch pads to its widest row; a prefill (`wide_calls()`) keeps fp32."""
    from engine.model import HEAD_WIDTH, wide_calls

    if not cpu_kernels.bf16_ok():
        pytest.skip("this CPU lacks AVX-512 BF16: wide head calls stay fp32")
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (64, 192), dtype=torch.int8, generator=g)
    q[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    d = (torch.rand(64, 6, generator=g) * 0.01 + 0.001).half().float()
    exact = (q.float().view(64, 6, 32) * d[..., None]).flatten(1)
    head = quant.Q8Head(q, d, "ours")
    lm = quant.LMHead(head, None, "fp32", wide_rows=4)
    f32 = lambda x2: head.kernels.q8_f32(x2, head.u, head.d)  # noqa: E731
    bf16 = lambda x2: head.kernels.q8_bf16(x2, head.u, head.d)  # noqa: E731
    for width in (1, 3, 4, 9, 33):
        x = torch.randn(2, width, 192, generator=g)
        y = lm(x)
        x2 = x.reshape(-1, 192)
        assert torch.equal(y.reshape(-1, 64), (f32 if width < 4 else bf16)(x2)), width
        with wide_calls():
            assert torch.equal(lm(x).reshape(-1, 64), f32(x2)), width
        for forward in (3, 32):  # logits read at `width` positions of a forward this wide
            token = HEAD_WIDTH.set(forward)
            try:
                assert torch.equal(lm(x).reshape(-1, 64), (f32 if forward < 4 else bf16)(x2)), (width, forward)
            finally:
                HEAD_WIDTH.reset(token)
        # bf16 operands, fp32 sums: against double products of the bf16-rounded operands (fp32 ones: of the exact)
        ref = (x2.bfloat16().double() @ exact.bfloat16().double().t()) if width >= 4 else x2.double() @ exact.double().t()
        assert float((y.reshape(-1, 64) - ref).abs().max() / ref.abs().max()) < (1e-4 if width >= 4 else 1e-6), width
        each = torch.cat([lm(x[i:i + 1]) for i in range(2)])
        torch.testing.assert_close(y, each, atol=0, rtol=0)  # each sequence as alone
    x = torch.randn(1, 33, 192, generator=g)  # no switch (int4, bf16 and fp32 modes): fp32 activations at any width
    assert torch.equal(quant.LMHead(head, None, "fp32")(x)[0], f32(x[0]))


@needs_ours
def test_prepacked_int8_copy_gives_the_interleaves_numbers(gguf, monkeypatch):
    """wide_i8.cpp's prepacked copy (i8w_prepack, q4_i8p / q8_i8p): the int8 products of the per-call interleave
    (q4_i8w / q8_i8w) bit for bit, at every row count and thread count, tail blocks included; a copy that does not
    match the activations is refused. Engine.load makes it for the bundled model when int8 products run
    (FASTDLLM_INT8_PREPACK unset: the copy is small), not when the switch says 0 or the copy is over
    PREPACK_MAX_BYTES; a model's forwards are the same either way."""
    from engine import Engine
    from engine.model import KVCache

    k = cpu_kernels.load("ours")
    cases = []
    for blocks in (gguf.q4["model.layers.5.mlp.down_proj"], _small_blocks(44, 128)):
        w = quant.Int4Weight(blocks, dense_bf16=False)
        pk, ps = k.i8w_prepack(w.qs, w.dm, False)
        cases.append((blocks.q.shape[1], lambda x, w=w: k.q4_i8w(x, w.qs, w.dm),
                      lambda x, w=w, pk=pk, ps=ps: k.q4_i8p(x, pk, ps, w.out_features)))
    for q, d in ((gguf.embed_q[:4096], gguf.embed_d[:4096]), (gguf.embed_q[:20], gguf.embed_d[:20])):
        head = quant.Q8Head(q, d)
        pk, ps = k.i8w_prepack(head.u, head.d, True)
        cases.append((q.shape[1], lambda x, h=head: k.q8_i8w(x, h.u, h.d),
                      lambda x, h=head, pk=pk, ps=ps: k.q8_i8p(x, pk, ps, h.u.shape[0])))
    threads = torch.get_num_threads()
    try:
        for features, per_call, prepacked in cases:
            x = torch.randn(19, features) * torch.rand(1, features) * 3
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (1, 3, 8, 9, 10, 17, 19):
                    assert torch.equal(prepacked(x[:rows].contiguous()), per_call(x[:rows].contiguous())), (features, rows)
    finally:
        torch.set_num_threads(threads)
    w = quant.Int4Weight(_small_blocks(44, 128), dense_bf16=False)
    pk, ps = k.i8w_prepack(w.qs, w.dm, False)
    with pytest.raises(RuntimeError, match="q4_i8p: the prepacked weights do not match x's 64 features and 44 outputs"):
        k.q4_i8p(torch.randn(2, 64), pk, ps, 44)
    # the engine: made where int8 products run and the copy is small, the same forwards as without it
    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    monkeypatch.setenv("FASTDLLM_FUSED", "1")
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "int8")
    outs = {}
    for switch in ("", "0"):
        monkeypatch.setenv("FASTDLLM_INT8_PREPACK", switch)
        m = Engine.load().lm.dllm
        has = m.lm_head.core.pk is not None and len(m.steps[0].weights) == 16 \
            and all(layer.mlp.gate_up.weight.pk is not None for layer in m.model.layers)
        assert has == (switch == ""), switch
        ids = torch.randint(0, 2000, (1, 41), generator=torch.Generator().manual_seed(5))
        pos = torch.arange(41)[None]
        with torch.inference_mode():
            cache = KVCache(m.cfg, 1, 64, torch.device("cpu"), torch.float32)
            m(ids[:, :32], pos[:, :32], cache=cache, start=0, causal=True)
            outs[switch] = m(ids[:, 32:41], pos[:, 32:41], cache=cache, start=32, causal=False)  # a sub-block step
    assert torch.equal(outs[""], outs["0"])
    monkeypatch.setenv("FASTDLLM_INT8_PREPACK", "")
    monkeypatch.setattr(quant, "PREPACK_MAX_BYTES", 1 << 20)
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "fp32")  # a second copy (fp32 one-token steps need the tiled one) ...
    assert Engine.load().lm.dllm.lm_head.core.pk is None  # ... over the budget: the per-call interleave
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "int8")  # the default's int8 one-token steps beside bf16 wide ones
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "bf16")
    assert Engine.load().lm.dllm.lm_head.core.pk is None
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "int8")
    # every product int8 (the studio's): the prepacked copy replaces the tiled one, whatever the size; the same
    # forwards, one-token ones included, as the per-call interleave on the tiled copy
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "int8")
    for switch in ("", "0"):
        monkeypatch.setenv("FASTDLLM_INT8_PREPACK", switch)
        m = Engine.load().lm.dllm
        w = m.model.layers[0].mlp.gate_up.weight
        assert (w.pk is not None, w.qs.numel() == 0, m.lm_head.core.u.numel() == 0) == (switch == "",) * 3
        dropped = w if switch == "" else dropped
        with torch.inference_mode():
            cache = KVCache(m.cfg, 1, 64, torch.device("cpu"), torch.float32)
            m(ids[:, :32], pos[:, :32], cache=cache, start=0, causal=True)
            outs[switch] = (m(ids[:, 32:33], pos[:, 32:33], cache=cache, start=32, causal=True),
                            m(ids[:, 32:41], pos[:, 32:41], cache=cache, start=32, causal=False))
    assert all(torch.equal(a, b) for a, b in zip(outs[""], outs["0"]))
    with pytest.raises(RuntimeError, match="features"):  # the dropped tiled copy is refused, not misread
        k.q4_f32(torch.randn(1, dropped.in_features), dropped.qs, dropped.dm)
    monkeypatch.setenv("FASTDLLM_ACTIVATIONS", "fp32")
    monkeypatch.setenv("FASTDLLM_WIDE_ACTIVATIONS", "bf16")
    monkeypatch.setattr(quant, "PREPACK_MAX_BYTES", 1 << 40)
    assert Engine.load().lm.dllm.lm_head.core.pk is None  # no int8 products: no copy


@needs_ours
def test_bf16_products_on_amx_tiles(gguf):
    """engine/weights/csrc/amx.cpp (FASTDLLM_AMX, on by default): where the CPU has AMX-BF16, q4_bf16 / q8_bf16 run
    on tile products: the vdpbf16ps kernel's numbers up to fp32 summation order (the same bf16 weights and rows), a
    row's result the same at every row count and thread count (every count runs on tiles, so a row alone equals it
    in a batch; from 33 rows on two weight blocks by two row tiles at once, with the x tiles prefetched), tail
    blocks of 4 and 12 outputs; the switch turns the tiles off for the process, and the load line says when they
    run."""
    from dataclasses import replace

    from engine.loading import load
    from engine.runtime import Runtime

    k = cpu_kernels.load("ours")
    if not k.amx_bf16_ready():
        pytest.skip("this CPU has no AMX-BF16 (or the OS refused the tile state): bf16 products stay on vdpbf16ps")
    if not cpu_kernels.bf16_ok():
        pytest.skip("this CPU lacks AVX-512 BF16")
    cases = []
    for blocks in (gguf.q4["model.layers.5.mlp.down_proj"], quant._fused_blocks(gguf, 7, "self_attn", ("q_proj", "k_proj", "v_proj")),
                   _small_blocks(44, 128)):
        w = quant.Int4Weight(blocks, dense_bf16=False)
        cases.append((blocks.q.shape[1], lambda x, w=w: k.q4_bf16(x, w.qs, w.dm)))
    for q, d in ((gguf.embed_q[:4096], gguf.embed_d[:4096]), (gguf.embed_q[:20], gguf.embed_d[:20])):
        head = quant.Q8Head(q, d)
        cases.append((q.shape[1], lambda x, h=head: k.q8_bf16(x, h.u, h.d)))
    threads = torch.get_num_threads()
    try:
        for features, product in cases:
            x = torch.randn(100, features) * torch.rand(1, features) * 3
            k.set_amx(False)
            ref = product(x)
            k.set_amx(True)
            assert cpu_kernels.use_amx("ours", True)
            y = product(x)
            assert not torch.equal(y, ref)  # the tiles ran (another summation order)
            assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, features
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (1, 2, 3, 4, 9, 16, 17, 33, 40, 64, 81, 100):
                    assert torch.equal(product(x[:rows].contiguous()), y[:rows]), (features, rows, t)
                assert torch.equal(product(x[21:22].contiguous()), y[21:22])
        x = torch.randn(9, cases[0][0])
        on = cases[0][1](x)
        assert not cpu_kernels.use_amx("ours", False) and not k.amx_bf16_on()
        off = cases[0][1](x)  # the vdpbf16ps kernel again
        assert not torch.equal(off, on) and float((off - on).abs().max() / off.abs().max()) < 1e-5
        assert cpu_kernels.use_amx("ours", True) and torch.equal(cases[0][1](x), on)
        assert not cpu_kernels.use_amx("torch", True)
        four_bit = replace(Runtime.from_env(), weights="int4+bf16", wide_activations=None)  # the engine's default
        assert "(bf16 on AMX tiles from 2 positions)" in load(None, "cpu", None, four_bit).info["kernels"]
        assert k.amx_bf16_on()
        off = load(None, "cpu", None, replace(four_bit, amx=False))
        assert "(bf16 from 2 positions)" in off.info["kernels"] and not k.amx_bf16_on()
    finally:
        torch.set_num_threads(threads)
        k.set_amx(True)
