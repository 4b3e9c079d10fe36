"""--distill-kl (training/recipe.py): KL(base || dLLM) at every masked answer position, the teacher being the same
weights with the adapter off (causal, on the clean copy). Checked against the definition computed from separate
forwards of a plain base model; the teacher carries no gradient; the adapter switches back on; a run with the term
moves the dLLM's distribution toward the base's; settings that have no separable base are refused."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training.lora import LoRALinear, adapter_off
from training.recipe import IGNORE, LossConfig, build_batch, draw_noise, loss_parts, teacher_logits
from training.train import TrainConfig, Trainer

from test_training import BS, MASK, PAD, cfg, examples, tiny_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _batch(exs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return build_batch(exs, [draw_noise(ex, BS, gen) for ex in exs], recipe="full", block_size=BS, mask_id=MASK,
                       pad_id=PAD)


def _adapted(seed=0):
    """The trainer's model (LoRA + mask row) with B != 0, and a plain copy of its base taken before."""
    base = tiny_model(seed).double()
    tr = Trainer(cfg(Path("unused")), copy.deepcopy(base).float(), examples(4), MASK, PAD)
    model = tr.model.double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05)
    return model, base


def test_kl_term_is_the_definition_and_the_teacher_is_the_base():
    model, base = _adapted()
    exs = examples(5, seed=3)
    b = _batch(exs)
    keep = b.targets.flatten() != IGNORE
    # the teacher: the plain base, causal, on each example's clean ids; position i - 1 predicts token i
    rows = []
    for r, ex in enumerate(exs):
        with torch.no_grad():
            logits = base(torch.tensor([ex.ids]), torch.arange(len(ex.ids))[None], causal=True)[0]
        idx = b.logits_idx[r] % b.length
        rows.append(logits[idx.clamp(max=len(ex.ids) - 1)])
    want_teacher = torch.stack(rows).flatten(0, 1)[keep]
    got_teacher = teacher_logits(model, b).flatten(0, 1)[keep]
    torch.testing.assert_close(got_teacher, want_teacher)
    assert not got_teacher.requires_grad
    assert all(not m.off for m in model.modules() if isinstance(m, LoRALinear))  # switched back on

    student = model(b.ids, b.pos, mask=b.mask, logits_idx=b.logits_idx).flatten(0, 1)[keep]
    p = torch.softmax(want_teacher, -1)
    want_kl = ((p * (p.log() - torch.log_softmax(student, -1))).sum(-1).sum() / b.loss_tokens).detach()
    plain = loss_parts(model, b, "dense")
    for w in (0.5, 2.0):
        got = loss_parts(model, b, "dense", LossConfig(kl_weight=w))
        assert float(got["kl"].detach()) > 0.01  # the losses run in fp32 (loss_parts), the definition here in fp64
        torch.testing.assert_close(got["kl"].double(), want_kl, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["ce"], plain["ce"])
        torch.testing.assert_close(got["loss"].double(), plain["ce"].double() + w * want_kl, rtol=1e-5, atol=1e-6)
    assert "kl" not in plain
    # gradients reach the adapter through the student only (the teacher is under no_grad)
    model.zero_grad()
    loss_parts(model, b, "dense", LossConfig(kl_weight=1.0))["kl"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("lora_B"))


def test_adapter_off_needs_lora_and_restores_on_error():
    with pytest.raises(ValueError, match="no LoRA layers"):
        with adapter_off(tiny_model()):
            pass
    model, _ = _adapted()
    with pytest.raises(RuntimeError, match="inside"):
        with adapter_off(model):
            raise RuntimeError("inside")
    assert all(not m.off for m in model.modules() if isinstance(m, LoRALinear))


def test_a_run_with_the_term_moves_toward_the_base(tmp_path):
    """Same data, seeds and steps; the KL to the base at the end is lower with the term than without it."""
    exs = examples(8)
    kl = {}
    for w in (0.0, 2.0):
        tr = Trainer(cfg(tmp_path / str(w), max_steps=20, distill_kl=w, train_norms=False), tiny_model(), exs, MASK, PAD)
        tr.run(tmp_path / str(w) / "run")
        if w:
            assert "kl" in tr.history[-1] and "ce" in tr.history[-1]
        with torch.no_grad():
            kl[w] = float(loss_parts(tr.model, _batch(exs), "dense", LossConfig(kl_weight=1.0))["kl"])
    assert kl[2.0] < 0.9 * kl[0.0], kl


def test_settings_without_a_separable_base_are_refused():
    for kw in ({"full": True}, {"train_norms": True}):
        with pytest.raises(ValueError, match="distill_kl: the teacher is the base with the adapter off"):
            TrainConfig(distill_kl=1.0, **kw)  # the teacher would carry trained weights
    with pytest.raises(ValueError, match=r"kl_weight \(--distill-kl\) must be >= 0"):
        TrainConfig(distill_kl=-1.0)
    assert TrainConfig(distill_kl=0.5).loss_config().kl_weight == 0.5
