"""The dLLM's LoRA delta beside a bf16 product on AMX tiles (engine/weights/csrc/lora.cpp bf16_lora, amx.cpp
amx_bf16_panels): x A^T from the product's own bf16 rows of x, h B^T on tiles where B is bf16 with whole 32-rank
steps, the rest on the fp32 panels."""
from __future__ import annotations

import pytest
import torch

from engine.weights import kernels as cpu_kernels, quant

needs_amx = pytest.mark.skipif(
    cpu_kernels.load("ours") is None or not cpu_kernels.bf16_ok() or not cpu_kernels.load("ours").amx_bf16_ready(),
    reason="needs our kernels on a CPU with AVX-512 BF16 and AMX-BF16 (the delta then stays on the fp32 panels)")


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    outs, k_in = [64, 40, 48], 128  # 40, 48: a panel's tail past the outputs (and past 16)
    n = sum(outs)
    blocks = quant.Q4Blocks(torch.randint(0, 16, (n, k_in), dtype=torch.uint8, generator=g),
                            (torch.rand(n, k_in // 32, generator=g) * 0.01 + 0.002).half().float(),
                            (-torch.rand(n, k_in // 32, generator=g) * 0.05).half().float())
    ranks = [32, 64, 16]  # 16: not a whole k-step of a tile, so that part's B stays on the fp32 panels
    parts = [((torch.randn(r, k_in, generator=g) * 0.3).bfloat16(), (torch.randn(o, r, generator=g) * 0.3).bfloat16())
             for r, o in zip(ranks, outs)]
    return quant.Int4Weight(blocks, dense_bf16=True), parts, outs, torch.randn(n, generator=g), g


@needs_amx
def test_lora_delta_shares_the_products_bf16_rows_on_tiles():
    """The delta's numbers are those of bf16 x and bf16 h (the roundings the tiles take) up to fp32 summation order;
    a row's result is the same at every row count and thread count (exact batching); lora_add alone keeps the fp32
    panels; with the tiles off the call is q4_bf16 + bias + lora_add, bit for bit; the eager Int4Linear runs the same
    call as the fused layer step."""
    k = cpu_kernels.load("ours")
    w, parts, outs, bias, g = _setup()
    lora = quant.LoRA(parts, outs, 2.0, k)
    assert lora.a_t.dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in lora.b_list())
    x = torch.randn(100, 128, generator=g) * 2

    def call(rows: torch.Tensor) -> torch.Tensor:
        return k.q4_bf16_lora(rows.contiguous(), w.qs, w.dm, bias, lora.a_t, lora.b_list(), lora.bounds)

    threads = torch.get_num_threads()
    try:
        k.set_amx(True)
        y = call(x)
        base = (k.q4_bf16(x, w.qs, w.dm) + bias).double()
        # the reference: the same roundings (x, and h where B runs on tiles, to bf16), sums in float64
        want = base.clone()
        h = x.bfloat16().double() @ torch.cat([a for a, _ in parts]).double().t()
        r0 = o0 = 0
        for (a, b), o in zip(parts, outs):
            hp = h[:, r0:r0 + a.shape[0]]
            if a.shape[0] % 32 == 0:
                hp = hp.float().bfloat16().double()
            want[:, o0:o0 + o] += hp @ (b.double() * 2.0).t()
            r0, o0 = r0 + a.shape[0], o0 + o
        delta = float((want - base).abs().max())
        assert float((y.double() - want).abs().max()) < 1e-4 * delta
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (1, 2, 9, 15, 16, 17, 32, 33, 64, 100):
                assert torch.equal(call(x[:rows]), y[:rows]), (t, rows)
            assert torch.equal(call(x[37:38]), y[37:38])
        # lora_add alone (the fp32 and int8 products' delta) stays on the fp32 panels: their answers do not move
        panels = lora.add_to(k.q4_bf16(x, w.qs, w.dm) + bias, x)
        assert not torch.equal(panels, y) and float((panels - y).abs().max()) < 2e-2 * delta
        k.set_amx(False)
        off = call(x)
        assert torch.equal(off, lora.add_to(k.q4_bf16(x, w.qs, w.dm) + bias, x))  # the fp32 panels as before
        assert float((off - y).abs().max()) < 2e-2 * delta  # bf16 x in the delta: near, not equal
        assert not torch.equal(off, y)
        k.set_amx(True)
        lin = quant.Int4Linear(w, outs, wide_rows=2, lora=lora, bias=bias)
        with torch.inference_mode():
            assert torch.equal(lin(x[None, :9]), y[None, :9])  # a 9-wide eager call: the same kernel
    finally:
        torch.set_num_threads(threads)
        k.set_amx(True)


@needs_amx
def test_lora_delta_on_tiles_refuses_misfits():
    k = cpu_kernels.load("ours")
    w, parts, outs, bias, g = _setup(1)
    lora = quant.LoRA(parts, outs, 2.0, k)
    with pytest.raises(RuntimeError, match="A\\^T has 128 inputs, x 64"):
        k.q4_bf16_lora(torch.randn(3, 64), w.qs, w.dm, bias, lora.a_t, lora.b_list(), lora.bounds)
    with pytest.raises(RuntimeError, match="slice 0 does not fit"):
        k.q4_bf16_lora(torch.randn(3, 128), w.qs, w.dm, bias, lora.a_t, lora.b_list(), [0, 32, 0, 400] + lora.bounds[4:])


@needs_amx
def test_fused_layer_step_runs_the_delta_on_tiles(monkeypatch):
    """layer.cpp's wide bf16 projections call bf16_lora: with the adapter's A as bf16 panels the delta runs on tiles
    (other numbers than the same A as fp32 panels, which keep the FMAs); with the tiles off both give the same bits."""
    import copy

    from engine import Engine
    from engine.model import KVCache
    from engine.weights.layer_step import LayerSteps
    from engine.weights.lora import panels, unpanel

    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")  # the engine's default (tests default to fp32)
    monkeypatch.setenv("FASTDLLM_FUSED", "1")
    monkeypatch.delenv("FASTDLLM_WIDE_ACTIVATIONS", raising=False)
    k = cpu_kernels.load("ours")
    model = Engine.load().lm.dllm
    steps = model.steps
    assert steps is not None
    fp32_steps = []
    for s in steps:
        s2 = copy.copy(s)
        s2.lora_a = [None if a is None else panels(unpanel(a, a.shape[0] * 32).float()) for a in s.lora_a]
        fp32_steps.append(s2)
    fp32_a = LayerSteps(fp32_steps)
    assert all(a.dtype == torch.float32 for a in fp32_a[0].lora_a if a is not None)
    ids = torch.randint(0, 2000, (1, 41), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(41)[None]

    def nine_wide(via) -> torch.Tensor:
        model.steps = via
        cache = KVCache(model.cfg, 1, 64, torch.device("cpu"), torch.float32)
        model(ids[:, :32], pos[:, :32], cache=cache, start=0, causal=True)
        return model(ids[:, 32:41], pos[:, 32:41], cache=cache, start=32, causal=False)

    try:
        with torch.inference_mode():
            assert not torch.equal(nine_wide(steps), nine_wide(fp32_a))  # bf16 A: on the tiles
            k.set_amx(False)
            assert torch.equal(nine_wide(steps), nine_wide(fp32_a))  # both on the panels
    finally:
        model.steps = steps
        k.set_amx(True)
