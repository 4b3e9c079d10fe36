"""The static-shape decode path (engine/static.py) on CPU, graphs off: the same tokens as CausalLM.forward.

On CUDA the same stepper replays captured graphs (tests/test_cuda.py); here it runs eagerly, so a bug in
the padding, the trash slot, the per-row key mask or the in-place row compaction shows up in CI.
"""
from __future__ import annotations

import pytest
import torch

from engine import Engine

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
