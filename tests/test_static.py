"""The static-shape decode path (engine/static.py) on CPU, graphs off: the same tokens as CausalLM.forward.

On CUDA the same stepper replays captured graphs (tests/test_cuda.py); here it runs eagerly, so a bug in
the padding, the trash slot, the per-row key mask or the in-place row compaction shows up in CI.
"""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.static import StaticStepper, static_layer

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a short poem about the sea."]


@pytest.fixture(scope="module")
def static_engine(engine):
    """The session's bundled engine with the static stepper switched on (same loaded weights)."""
    return Engine(engine.lm, static=True)


@pytest.mark.parametrize("mode,cache,prompts", [("ar", "dual", PROMPTS), ("diffusion", "dual", PROMPTS),
                                                 ("diffusion", "block", PROMPTS[1:2])])
def test_static_path_gives_the_eager_tokens(engine, static_engine, mode, cache, prompts):
    """Greedy; a batch of prompts of different lengths exercises per-row windows and key masks, and rows that
    stop early leave the batch by in-place compaction: tokens, NFE and committed ids per event are the eager
    path's (confidences may differ in the last bits: attention runs over the padded capacity)."""
    assert not engine.static and engine.stepper(engine.lm.dllm) is None
    cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=24)
    eager = engine.generate(prompts, cfg)
    static = static_engine.generate(prompts, cfg)
    assert [r.summary.token_ids for r in static] == [r.summary.token_ids for r in eager]
    assert [r.summary.nfe for r in static] == [r.summary.nfe for r in eager]
    if len(prompts) > 1:
        assert len({len(r.summary.token_ids) for r in eager}) > 1, "rows must finish at different forwards"
    for s, e in zip(static, eager):
        assert [(x.kind, [t.id for t in x.committed]) for x in s.trace.events] == \
            [(x.kind, [t.id for t in x.committed]) for x in e.trace.events]
    stepper = static_engine.stepper(static_engine.lm.base if mode == "ar" else static_engine.lm.dllm)
    widths = {w for (_, w, _) in stepper.shapes}  # (rows, width, logit rows) of every step so far
    assert widths == {1} if mode == "ar" else {9, 32} <= widths if cache == "dual" else 32 in widths, widths


def test_static_cache_is_reused_and_compacts_in_place(static_engine):
    """A second decode reuses the storage (what keeps captured graphs valid); keep_rows moves rows, not memory."""
    stepper = static_engine.stepper(static_engine.lm.dllm)
    cache = stepper.new_cache(3, 100)
    assert cache.k.shape[1] == 3 and cache.max_len >= 100 and stepper.capacity % stepper.quantum == 0
    ptr = stepper.k.data_ptr()
    with torch.inference_mode():  # as in Decoder.run: the storage is an inference tensor
        cache.k[:, 2].fill_(7.0)
        cache.keep_rows(torch.tensor([2]))
    assert cache.k.shape[1] == 1 and cache.k.data_ptr() == ptr and bool((cache.k == 7.0).all())
    many = stepper.new_cache(12, 100)  # what Decoder._retire calls: the last rows move in, the storage stays
    ptr = stepper.k.data_ptr()  # (12 rows grew it to a larger row bucket)
    with torch.inference_mode():
        many.k[:, 11].fill_(5.0)
        assert many.compact([11]) == [11]
    assert many.k.shape[1] == 1 and many.store_k.data_ptr() == ptr and many.store_k is stepper.k
    assert bool((many.k == 5.0).all())
    again = stepper.new_cache(2, 50)
    assert again.k.data_ptr() == ptr, "storage big enough: no reallocation"
    ids = torch.zeros((1, 5), dtype=torch.long)
    with pytest.raises(ValueError, match="width"):
        stepper.step(ids, ids, stepper.new_cache(1, 50), [5], torch.zeros((1, 1), dtype=torch.long), width=4)


def test_static_path_env_default(monkeypatch):
    from engine.static import graphs_wanted, wanted

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("FASTDLLM_STATIC", raising=False)
    assert not wanted(cpu) and wanted(cuda)
    monkeypatch.setenv("FASTDLLM_STATIC", "1")
    assert wanted(cpu)
    monkeypatch.setenv("FASTDLLM_STATIC", "0")
    assert not wanted(cuda)
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    monkeypatch.delenv("FASTDLLM_GRAPHS", raising=False)
    assert not graphs_wanted(cpu) and graphs_wanted(cuda)
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    assert not graphs_wanted(cuda)
    monkeypatch.delenv("SPACES_ZERO_GPU")
    monkeypatch.setenv("FASTDLLM_GRAPHS", "0")
    assert not graphs_wanted(cuda)


@pytest.mark.parametrize("prompt_len,block,sub,cache", [
    (5, 16, 4, "dual"), (16, 16, 4, "dual"), (17, 16, 4, "dual"), (17, 16, 16, "dual"), (32, 32, 8, "dual"),
    (16, 16, 4, "block"), (17, 16, 8, "block"),
])
def test_static_path_on_the_block_grid(tiny_fast_dllm, prompt_len, block, sub, cache):
    """Toy Fast-dLLM checkpoint (random weights, seconds): prompts shorter than, equal to and one past a block,
    sub-block = block (the sub-step window then needs a pad slot), several blocks: the eager path's tokens
    and forward counts, through both the static path's pads and its trash slot."""
    from engine.loading import load

    lm = load(str(tiny_fast_dllm), "cpu", "float32")
    eager, static = Engine(lm, static=False), Engine(lm, static=True)
    ids = [[100 + (7 * i) % 900 for i in range(prompt_len)], [200 + i for i in range(prompt_len + 3)]]
    cfg = eager.decode_config(mode="diffusion", cache=cache, block_size=block, sub_block_size=sub,
                              max_new_tokens=37, stop_token_ids=(2**31 - 1,))
    a = [r.summary for r in eager.generate_ids(ids, cfg, record=False)]
    b = [r.summary for r in static.generate_ids(ids, cfg, record=False)]
    assert [s.token_ids for s in b] == [s.token_ids for s in a]
    assert [s.nfe for s in b] == [s.nfe for s in a] and all(s.answer_tokens == 37 for s in b)


def test_big_batches_pad_to_row_buckets_and_keep_every_answer(engine, static_engine):
    """12 rows of the bundled model that finish at different forwards: steps run at 16 rows while more than
    EXACT_ROWS are live (pad rows write only the trash slot), then at the exact count; every answer is the
    eager path's."""
    from engine.static import EXACT_ROWS, row_bucket

    prompts = [f"Name {n} colors, one per line." for n in range(2, 2 + EXACT_ROWS + 4)]
    cfg = engine.decode_config(mode="ar", max_new_tokens=32)
    eager = [r.summary.token_ids for r in engine.generate(prompts, cfg, record=False)]
    static = [r.summary.token_ids for r in static_engine.generate(prompts, cfg, record=False)]
    assert static == eager
    assert len({len(t) for t in eager}) > 1, "rows must finish at different forwards"
    rows = {r for (r, _, _) in static_engine.stepper(static_engine.lm.base).shapes}
    assert row_bucket(len(prompts)) == 16 and 16 in rows and not any(EXACT_ROWS < r < 16 for r in rows)


def test_compiled_layers_give_the_uncompiled_tokens_and_one_graph_serves_every_layer(engine):
    """FASTDLLM_COMPILE: the layer step under torch.compile. Backend "eager" runs dynamo's tracing and guards
    without code generation (inductor's C++ build would cost ~35 s of CI): same tokens and events as the
    uncompiled static path, and the 30 layers share one compiled graph (regional compilation; a graph per layer
    would compile 30 times and hit dynamo's recompile limit)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plain, compiled = Engine(engine.lm, static=True), Engine(engine.lm, static=True)
    compiled._steppers[id(engine.lm.dllm)] = StaticStepper(engine.lm.dllm, quantum=32, compile="eager")
    cfg = engine.decode_config(mode="diffusion", cache="dual", max_new_tokens=16)
    a, b = plain.generate(PROMPTS[:2], cfg), compiled.generate(PROMPTS[:2], cfg)
    assert [r.summary.token_ids for r in b] == [r.summary.token_ids for r in a]
    assert [[[t.id for t in x.committed] for x in r.trace.events] for r in b] == \
        [[[t.id for t in x.committed] for x in r.trace.events] for r in a]
    stepper = compiled._steppers[id(engine.lm.dllm)]
    assert stepper.compile_error is None and compiled.graphs_report()["compiled"]
    # one graph per (rows, width) the layers saw (the logit rows are picked after the layers), not one per layer
    assert counters["stats"]["unique_graphs"] == len({(r, w) for (r, w, _) in stepper.shapes}) >= 2


def test_a_layer_that_cannot_compile_falls_back_and_says_why(engine):
    """A backend failure must not stop decoding: the step runs the plain layers and the report names the error."""
    import torch._dynamo

    def broken(gm, example_inputs):  # a real backend that fails, as a compiler bug on a new GPU would
        raise RuntimeError("no kernel for this op")

    torch._dynamo.reset()
    e = Engine(engine.lm, static=True)
    e._steppers[id(engine.lm.base)] = StaticStepper(engine.lm.base, quantum=32, compile=True)
    e._steppers[id(engine.lm.base)].layer_fn = torch.compile(static_layer, backend=broken, dynamic=False)
    cfg = engine.decode_config(mode="ar", max_new_tokens=6)
    with pytest.warns(UserWarning, match="torch.compile of the static layer failed"):
        got = e.generate(PROMPTS[:1], cfg)[0].summary.token_ids
    assert got == engine.generate(PROMPTS[:1], cfg)[0].summary.token_ids
    report = e.graphs_report()
    assert not report["compiled"] and "no kernel for this op" in report["compile_error"]


@pytest.mark.parametrize("mode,cache", [("ar", "dual"), ("diffusion", "block"), ("diffusion", "dual")])
def test_scheduler_batches_on_the_static_path_as_rows_join_mid_batch(engine, mode, cache):
    """Continuous batching on static shapes (issue 24): the scheduler's batches step through a static stepper of
    their own; a row that joins mid-batch has its prefilled K/V copied into the stepper's storage (which grows,
    keeping the running rows', when it must). Each answer is the row's single-user answer (dual too: each row's
    narrower window is padded to the step's width with pads that write only the trash slot)."""
    from engine.driver import Driver
    from engine.scheduler import batch_key

    prompts = [engine.encode(engine.chat_prompt([{"role": "user", "content": p}])) for p in PROMPTS]
    cfg = engine.decode_config(mode=mode, cache=cache, max_new_tokens=24)
    single = [engine.generate_ids([p], cfg, record=False)[0].summary.token_ids for p in prompts]
    static = Engine(engine.lm, static=True)
    sched = Driver(static)
    tickets: list = []
    events = [0] * len(prompts)

    def listener(i: int):
        def on(_e) -> None:  # on the worker thread: each row's second event sends the next prompt
            events[i] += 1
            if events[i] == 2 and i + 1 < len(prompts):
                tickets.append(sched.submit(prompts[i + 1], cfg, listener=listener(i + 1), record=False))
        return on

    try:
        tickets.append(sched.submit(prompts[0], cfg, listener=listener(0), record=False))
        for i in range(len(prompts)):  # each submitted by its predecessor's listener while that one decodes
            tickets[i].wait(300)
        got = [t.wait(300).summary for t in tickets]
        assert len(got) == len(prompts)
    finally:
        sched.close()
    stepper = sched.steppers[batch_key(cfg)]
    assert stepper is not None and stepper.shapes, "the batches stepped through the scheduler's static stepper"
    assert stepper.rows >= 2 and {r for (r, _, _) in stepper.shapes} >= {1, 2}, "rows joined a running batch"
    assert [s.token_ids for s in got] == single


def test_scheduler_keeps_few_idle_static_steppers(engine):
    """Each batch key gets its own static storage; keys with no batch now are dropped beyond IDLE_STEPPERS, so
    clients that each send other settings do not pile up K/V storage (and graphs) on the GPU."""
    from engine.driver import Driver
    from engine.scheduler import IDLE_STEPPERS

    import gc

    static = Engine(engine.lm, static=True)
    sched = Driver(static)
    ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Hi"}]))
    try:
        for i in range(IDLE_STEPPERS + 3):  # distinct thresholds: distinct batch keys, one after the other
            sched.submit(ids, engine.decode_config(mode="ar", max_new_tokens=2, threshold=0.5 + 0.05 * i),
                         record=False).wait(120)
            assert len(sched.steppers) <= IDLE_STEPPERS + 1
    finally:
        sched.close()
    gc.collect()
    assert len(list(static._all_steppers)) == len(sched.steppers)  # a dropped stepper is gone, storage and all
    assert all(s is not None for s in sched.steppers.values())
