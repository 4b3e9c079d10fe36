"""The recipe's pieces pinned exactly (issue 28: `bash scripts/mutation.sh recipe` left 89 of the first 194 mutants
of training/recipe.py alive): block noise draw for draw, the mask-later ramp, the views, padding, and every tensor
of a built batch for each recipe on a hand-made example."""
from __future__ import annotations

import pytest
import torch

from training.attention import Blockwise, dense_mask
from training.examples import Example
from training.recipe import IGNORE, Batch, build_batch, draw_noise, padded_len, views_for

M, P = 99, 0  # mask id, pad id


def test_block_noise_is_the_papers_draw_for_draw():
    """t ~ U(0,1) per block, then u ~ U(0,1) per position, masked where u < t of its block; never the prompt."""
    ex = Example(list(range(1, 12)), prompt_len=3)  # 11 tokens: blocks [0,4) [4,8) [8,11) at block size 4
    got = draw_noise(ex, 4, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    t, u = torch.rand(3, generator=g), torch.rand(11, generator=g)
    want = torch.tensor([bool(u[i] < t[i // 4]) for i in range(11)])
    want[:3] = False
    assert got.dtype == torch.bool and torch.equal(got, want)


def test_mask_later_ramp_is_exact_and_clamped():
    """later = l: rate t * (1 + l (2j/(s-1) - 1)) at position j of its sub-block, clamped to [0, 1]."""
    ex = Example(list(range(1, 17)), prompt_len=1)
    for later in (0.5, 1.0):
        got = draw_noise(ex, 8, torch.Generator().manual_seed(2), later=later, sub_block_size=4)
        g = torch.Generator().manual_seed(2)
        t, u = torch.rand(2, generator=g), torch.rand(16, generator=g)
        rate = [min(1.0, max(0.0, float(t[i // 8]) * (1 + later * (2 * (i % 8 % 4) / 3 - 1)))) for i in range(16)]
        want = torch.tensor([float(u[i]) < rate[i] for i in range(16)])
        want[:1] = False
        assert torch.equal(got, want), later
    # many draws: at l = 1 the first position of a sub-block is never masked, the last twice as often as t says
    ex = Example([1] * 33, prompt_len=1)
    draws = torch.stack([draw_noise(ex, 32, torch.Generator().manual_seed(s), later=1.0, sub_block_size=8)
                         for s in range(300)]).float()
    j = (torch.arange(33) - 0) % 32 % 8
    assert draws[:, 1:][:, (j[1:] == 0)].sum() == 0
    assert draws[:, 1:][:, (j[1:] == 7)].mean() > 0.55 > draws[:, 1:][:, (j[1:] == 3)].mean()


def test_noise_arguments_are_checked_with_their_names():
    ex = Example([1, 2, 3, 4], prompt_len=1)
    for later in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"later \(mask-later bias\) must be in \[0, 1\]"):
            draw_noise(ex, 4, torch.Generator(), later=later)
    for sub in (1, 3):
        with pytest.raises(ValueError, match="sub_block_size must be >= 2 and divide block_size 4"):
            draw_noise(ex, 4, torch.Generator(), later=0.5, sub_block_size=sub)
    draw_noise(Example([1] * 40, prompt_len=1), 32, torch.Generator(), later=0.5)  # the default sub-block (8) divides 32
    draw_noise(ex, 4, torch.Generator(), later=0.5, sub_block_size=2)  # the smallest sub-block is allowed
    assert torch.equal(draw_noise(ex, 4, torch.Generator().manual_seed(0), later=0.0, sub_block_size=3),
                       draw_noise(ex, 4, torch.Generator().manual_seed(0)))  # l = 0 never looks at the sub-block


def test_views_and_padding():
    ex = Example([5, 6, 7, 8, 9], prompt_len=2)
    m = torch.tensor([False, False, True, False, True])
    assert [v.tolist() for v in views_for(ex, m, False)] == [m.tolist()]
    noisy, comp = views_for(ex, m, True)
    assert noisy.tolist() == m.tolist() and comp.tolist() == [False, False, False, True, False]
    assert [padded_len(n, 4, True) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert [padded_len(n, 4, False) for n in (1, 4, 5)] == [1, 4, 5]


EX = [Example([11, 12, 13, 14, 15], prompt_len=2), Example([21, 22, 23], prompt_len=1)]
NOISE = [torch.tensor([False, False, True, False, True]), torch.tensor([False, True, True])]


def test_build_batch_naive_exactly():
    b = build_batch(EX, NOISE, recipe="naive", block_size=4, mask_id=M, pad_id=P)
    # L = 8 (the longest visible length, 5, rounded up to the block); one noisy view + the clean copy
    assert (b.views, b.length, b.block_size) == (1, 8, 4) and b.visible.tolist() == [5, 3]
    assert b.ids.tolist() == [[11, 12, M, 14, M, P, P, P, 11, 12, 13, 14, 15, P, P, P],
                              [21, M, M, P, P, P, P, P, 21, 22, 23, P, P, P, P, P]]
    assert b.pos.tolist() == [list(range(8)) * 2] * 2
    # token shift: the logits at i - 1 of the noisy view predict the masked token i
    assert b.logits_idx.tolist() == [[1, 3], [0, 1]] and b.targets.tolist() == [[13, 15], [22, 23]]
    assert (b.seq_tokens, b.answer_tokens, b.loss_tokens) == (8, 5, 4)


def test_build_batch_pad_and_full_exactly():
    b = build_batch(EX, NOISE, recipe="pad", block_size=4, mask_id=M, pad_id=P)
    assert b.visible.tolist() == [8, 4]  # mask tokens up to the block boundary, no loss there
    assert b.ids.tolist() == [[11, 12, M, 14, M, M, M, M, 11, 12, 13, 14, 15, M, M, M],
                              [21, M, M, M, P, P, P, P, 21, 22, 23, M, P, P, P, P]]
    f = build_batch(EX, NOISE, recipe="full", block_size=4, mask_id=M, pad_id=P)
    assert (f.views, f.length) == (2, 8) and f.visible.tolist() == [8, 4]
    assert f.ids.tolist() == [[11, 12, M, 14, M, M, M, M, 11, 12, 13, M, 15, M, M, M, 11, 12, 13, 14, 15, M, M, M],
                              [21, M, M, M, P, P, P, P, 21, 22, 23, M, P, P, P, P, 21, 22, 23, M, P, P, P, P]]
    assert f.pos.tolist() == [list(range(8)) * 3] * 2
    # view 0's masked positions, then view 1's (offset L = 8); the second row pads its index and targets
    assert f.logits_idx.tolist() == [[1, 3, 10], [0, 1, 0]]
    assert f.targets.tolist() == [[13, 15, 14], [22, 23, IGNORE]]
    assert (f.seq_tokens, f.answer_tokens, f.loss_tokens) == (8, 5, 5)
    with pytest.raises(ValueError, match=r"recipe must be one of \('naive', 'pad', 'full'\) \(got 'half'\)"):
        build_batch(EX, NOISE, recipe="half", block_size=4, mask_id=M, pad_id=P)


def test_a_batch_without_masked_tokens_still_has_one_logit_slot():
    none = [torch.zeros(5, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)]
    b = build_batch(EX, none, recipe="naive", block_size=4, mask_id=M, pad_id=P)
    assert b.logits_idx.tolist() == [[0], [0]] and b.targets.tolist() == [[IGNORE], [IGNORE]] and b.loss_tokens == 0


def test_batch_attention_and_device_move_keep_every_field():
    f = build_batch(EX, NOISE, recipe="full", block_size=4, mask_id=M, pad_id=P)
    dense = f.attention("dense")
    assert torch.equal(dense, dense_mask(8, f.visible, 2, 4)) and torch.equal(dense, f.mask)
    bw = f.attention("blockwise")
    assert isinstance(bw, Blockwise) and (bw.length, bw.views, bw.block_size) == (8, 2, 4)
    assert f.block_aligned and not build_batch(EX, NOISE, recipe="naive", block_size=4, mask_id=M,
                                               pad_id=P).block_aligned
    moved = f.to(torch.device("cpu"))
    assert isinstance(moved, Batch)
    for name in Batch.__slots__:
        a, b = getattr(f, name), getattr(moved, name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name


def test_loss_parts_is_the_mean_masked_ce_plus_the_certainty_term_exactly():
    """ce = sum of cross-entropies over the loss slots / loss_tokens; with certainty forcing, + w x the mean entropy
    of softmax(logits / T) over the slots whose argmax is already the target; `correct` = their share."""
    import torch.nn.functional as F

    from test_training import tiny_model
    from training.recipe import LossConfig, batch_loss, loss_parts

    tiny = tiny_model(3)

    def model(*a, **k):  # the tiny model, with the first slot of each row right
        out = tiny(*a, **k)
        top = out.max(-1).values  # first slot of each row made right by a logit or so: confident, not one-hot
        out[0, 0, 13], out[1, 0, 22] = top[0, 0] + 1.0, top[1, 0] + 1.5
        return out

    b = build_batch(EX, NOISE, recipe="full", block_size=4, mask_id=1, pad_id=P)
    logits = model(b.ids, b.pos, mask=b.mask, logits_idx=b.logits_idx).float().flatten(0, 1)
    tgt = b.targets.flatten()
    keep = tgt != IGNORE
    ce = F.cross_entropy(logits[keep], tgt[keep], reduction="sum") / b.loss_tokens
    plain = loss_parts(model, b, "dense")
    assert set(plain) == {"loss", "ce"} and torch.allclose(plain["ce"], ce) and torch.allclose(plain["loss"], ce)
    assert torch.allclose(batch_loss(model, b, "dense"), ce)
    correct = logits[keep].argmax(-1) == tgt[keep]
    assert 1 < int(correct.sum()) < int(keep.sum())  # some slots right (two: a mean, not a sum), some wrong
    for w, temp in ((0.5, 0.5), (2.0, 1.0)):
        got = loss_parts(model, b, "dense", LossConfig(certainty_weight=w, certainty_temperature=temp))
        logp = F.log_softmax(logits[keep][correct] / temp, -1)
        ent = -(logp.exp() * logp).sum(-1).sum() / max(int(correct.sum()), 1)
        assert float(ent) > 0.1 and torch.allclose(got["entropy"], ent) and torch.allclose(got["loss"], ce + w * ent)
        assert torch.allclose(got["ce"], ce) and float(got["correct"]) == float(correct.float().mean())
        assert torch.allclose(batch_loss(model, b, "dense", LossConfig(w, temp)), got["loss"])
    for kw, msg in (({"certainty_weight": -1.0}, r"certainty_weight must be >= 0 \(got -1.0\)"),
                    ({"certainty_temperature": 0.0}, r"certainty_temperature must be > 0 \(got 0.0\)")):
        with pytest.raises(ValueError, match=msg):
            LossConfig(**kw)
    assert LossConfig() == LossConfig(0.0, 0.5)  # the paper's loss by default


def test_a_batch_with_one_loss_token_is_its_cross_entropy():
    """The mean divides by the loss tokens: one masked token gives its own cross-entropy (not half of it)."""
    import torch.nn.functional as F

    from test_training import tiny_model
    from training.recipe import loss_parts

    model = tiny_model(4)
    one = [Example([11, 12, 13, 14], prompt_len=2)]
    b = build_batch(one, [torch.tensor([False, False, False, True])], recipe="naive", block_size=4, mask_id=1, pad_id=P)
    assert b.loss_tokens == 1
    logits = model(b.ids, b.pos, mask=b.mask, logits_idx=b.logits_idx).float()[0]
    assert torch.allclose(loss_parts(model, b, "dense")["ce"], F.cross_entropy(logits, b.targets[0]))
