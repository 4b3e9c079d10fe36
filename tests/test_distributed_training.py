"""The recipe under accelerate (training/distributed.py), on the CPU with gloo at toy size: two processes train
like one with the same global batch, a killed run resumes exactly, full fine-tuning trains and exports the base,
and the data stream reads what the list reads without holding it.

The processes are real (torchrun, tests/dist_worker.py): DDP's gradient all-reduce, the per-rank data slices
and accelerate's per-process checkpoint files are what is under test, and a mocked world would skip them.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_training import MASK, PAD, VOCAB, cfg, examples, tiny_model
from training.examples import PAIR_READERS, load_data
from training.stream import ExampleStream, shuffled
from training.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "dist_worker.py"
REL_TOL = 1e-3  # the target: loss at each of 10 steps within 1e-3 relative


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(procs: int, run: Path, out: Path, *args: str) -> subprocess.Popen:
    """tests/dist_worker.py as one process, or as `procs` ranks under torchrun (gloo on the CPU)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    head = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                 str(procs), "--master_addr", "127.0.0.1", "--master_port", str(_port())]
    cmd = [*head, str(WORKER), "--run-dir", str(run), "--out", str(out), *args]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def launch(procs: int, run: Path, out: Path, *args: str) -> int:
    return start(procs, run, out, *args).wait(timeout=300)


def result(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 10
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The same 10 steps (global batch 8 in micro-batches of 2, fp32) by 1 and by 2 processes, list and stream."""
    root = tmp_path_factory.mktemp("dist")
    singles = [start(1, root / name, root / f"{name}.out", *extra) for name, extra in (("list1", []), ("stream1", ["--stream"]))]
    assert [p.wait(timeout=300) for p in singles] == [0, 0]  # one thread each: the two cores run them side by side
    assert launch(2, root / "stream2", root / "stream2.out", "--stream") == 0
    return root


def test_two_processes_train_like_one_with_the_same_global_batch(runs):
    one, two, two_b = result(runs / "stream1.out"), result(runs / "stream2.out"), result(runs / "stream2.out", 1)
    assert (one["launch"].processes, two["launch"].processes, two["launch"].kind) == (1, 2, "MULTI_CPU")
    assert rel(one["losses"], two["losses"]) <= REL_TOL, (one["losses"], two["losses"])
    # the gradient itself, before clipping: AdamW and the clip would hide a loss scale off by the process count
    assert rel(one["grad_norms"], two["grad_norms"]) <= REL_TOL, (one["grad_norms"], two["grad_norms"])
    # DDP keeps the ranks' weights identical, and they are the one-process weights: a rank that stepped on its
    # own half-batch gradient (no all-reduce, or a wrong loss scale) lands elsewhere
    for n, p in one["params"].items():
        assert torch.equal(two["params"][n], two_b["params"][n]), n
        # fp32 sums in another order (the all-reduce adds two half-batch gradients), amplified by AdamW at lr 3e-2 over
        # 10 steps: up to 3.1e-5 on weights of ~0.3 on an Intel Xeon with AMX (2026-11-28), less on the Zen 4
        torch.testing.assert_close(two["params"][n], p, rtol=1e-4, atol=1e-4, msg=n)
    # the tolerance can tell a different global batch apart: half of it, one process, moves the losses by far more
    exs = examples(24)
    kw = dict(micro_batch=2, max_steps=10)
    half = Trainer(cfg(runs / "half", batch_size=4, **kw), tiny_model(), exs, MASK, PAD)
    half.run(runs / "half" / "run")
    full = Trainer(cfg(runs / "plain", batch_size=8, **kw), tiny_model(), exs, MASK, PAD)
    full.run(runs / "plain" / "run")
    assert rel([h["loss"] for h in half.history], [h["loss"] for h in full.history]) > 20 * REL_TOL
    # and the accelerated single process is the plain trainer's run, loss for loss (list data: its permutation)
    assert result(runs / "list1.out")["losses"] == [h["loss"] for h in full.history]


def test_resume_after_a_kill_is_exact(runs):
    run, out = runs / "killed", runs / "killed.out"
    assert launch(2, run, out, "--stream", "--save-every-steps", "1", "--die-after", "4") != 0  # the kill
    assert (run / "latest_state").read_text() == "state-000004" and not out.exists()
    assert launch(2, run, out, "--stream") == 0
    got, want = result(out), result(runs / "stream2.out")
    assert got["resumed_at"] == 4  # resumed, not started again
    assert got["losses"] == want["losses"]
    for n, p in want["params"].items():
        assert torch.equal(got["params"][n], p), n
    # the slim checkpoint beside the accelerate state is what `python -m training export` reads
    from training.export import export

    meta = export(run, runs / "killed.safetensors")
    assert meta["step"] == "10" and meta["loss_last10"] == f"{sum(want['losses']) / 10:.4f}"


def test_full_finetune_trains_every_tensor_and_exports_a_checkpoint_the_engine_loads(tiny_fast_dllm, tmp_path):
    from engine import Engine
    from engine.weights import build_model
    from training.__main__ import main

    rows = [{"messages": [{"role": "user", "content": f"Count from {i}."},
                          {"role": "assistant", "content": " ".join(str(i + k) for k in range(6)) + "."}]}
            for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, out = tmp_path / "run", tmp_path / "model"
    cmd = [sys.executable, "-m", "training", "train", "--accelerate", "--full", "--model", str(tiny_fast_dllm),
           "--data", str(data), "--run", str(run), "--max-steps", "2", "--batch-size", "2", "--max-len", "64",
           "--fp32", "--warmup-steps", "1", "--epochs", "1", "--lr", "1e-3"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "latest_state").exists() and (run / "latest").read_text() == "ckpt-000002.pt"
    main(["export", "--run", str(run), "--merge-to", str(out), "--merge-dtype", "float32"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "Fast_dLLM_Qwen"
    base = dict(build_model(tiny_fast_dllm, torch.device("cpu"), torch.float32).named_parameters())
    tuned = dict(build_model(out, torch.device("cpu"), torch.float32).named_parameters())
    trained = torch.load(run / "ckpt-000002.pt", weights_only=False)["trainable"]
    assert set(trained) == set(base)  # every tensor was trainable, the embedding's spare mask row included
    for n, p in base.items():
        assert torch.equal(tuned[n], trained[n]), n  # the export is the trained model, bit for bit in fp32
        assert not torch.equal(tuned[n], p), f"{n} did not change"
    eng = Engine.load(str(out))
    assert eng.lm.info["model_type"] == "Fast_dLLM_Qwen" and eng.can_diffuse


def test_full_finetune_appends_a_mask_row_to_an_unpadded_vocabulary(tmp_path):
    """SmolLM2's case (the mask id is one past the embedding): a plain, tied CausalLM one row larger, all trained."""
    from training.lora import LoRALinear

    model, start = tiny_model(), tiny_model()
    tr = Trainer(cfg(tmp_path, full=True, max_steps=3, lr=1e-2), model, examples(8), MASK, PAD)
    emb = model.model.embed_tokens
    assert emb.num_embeddings == model.cfg.vocab_size == VOCAB + 1 and model.lm_head.weight is emb.weight
    torch.testing.assert_close(emb.weight[MASK].detach(), start.model.embed_tokens.weight.mean(0))
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    tr.run(tmp_path / "run")
    for n, p in start.named_parameters():
        assert not torch.equal(dict(model.named_parameters())[n][:p.shape[0]], p), n


def _pairs(path: Path, exs) -> Path:
    path.write_text("".join(json.dumps([ex.ids[:ex.prompt_len], ex.ids[ex.prompt_len:]]) + "\n" for ex in exs))
    return path


def test_stream_reads_what_the_list_reads_in_bounded_memory_and_resumes_mid_epoch(tmp_path, monkeypatch):
    monkeypatch.setitem(PAIR_READERS, ".pairs", lambda p: (json.loads(line) for line in p.open()))
    exs = examples(30, seed=5)
    path = _pairs(tmp_path / "d.pairs", exs)
    listed, _ = load_data(path, None, 0, 16, "keep")
    stream = ExampleStream(path, None, 0, 16, "keep", seed=3, buffer=4)
    assert len(stream) == len(listed) == 30
    assert [ex.ids for ex in stream.source()] == [ex.ids for ex in listed]
    epoch = [ex.ids for b in stream.batches(1, 6) for ex in b]
    assert sorted(epoch) == sorted(ex.ids for ex in listed) and epoch != [ex.ids for ex in listed]
    assert epoch != [ex.ids for b in stream.batches(2, 6) for ex in b]  # each epoch its own order
    assert [b for b in stream.batches(1, 6, skip=3)] == list(stream.batches(1, 6))[3:]  # a resume replays to its step
    pulled = []

    def counting():
        for ex in listed:
            pulled.append(ex)
            yield ex

    for i, _ in enumerate(shuffled(counting(), 4, seed=0)):
        assert len(pulled) - i <= 5  # never more than the buffer (+ the item in hand) read ahead
