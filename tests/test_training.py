"""The Fast-dLLM v2 training recipe on a tiny random model: mask rule, loss coverage, padding, steps,
exact resume, and the export -> apply_adapter round trip."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.weights import apply_adapter
from engine.model import CausalLM
from training.examples import Example
from training.export import export
from training.lora import LoRALinear
from training.recipe import IGNORE, attention_mask, batch_loss, build_batch, draw_noise, padded_len, views_for
from training.train import TrainConfig, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

VOCAB, MASK, PAD, BS = 64, 64, 0, 4



def tiny_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return CausalLM(cfg).float().eval().requires_grad_(False)


def examples(n: int, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        a = int(torch.randint(3, 11, (1,), generator=g))
        # a learnable pattern: the answer counts up from the last prompt token
        ids = torch.randint(1, 40, (p,), generator=g).tolist()
        ids += [(ids[-1] + k + 1) % 60 + 1 for k in range(a)]
        out.append(Example(ids, p))
    return out


def rule(q: int, k: int, length: int, visible: int) -> bool:
    """The four-clause rule of DESIGN.md §3 over [noisy || clean], written out directly."""
    if k % length >= visible:
        return q == k  # padding key: hidden (a padding query keeps itself)
    q_clean, k_clean = q >= length, k >= length
    qb, kb = (q % length) // BS, (k % length) // BS
    if q_clean == k_clean and qb == kb:
        return True
    if not q_clean and k_clean and kb < qb:
        return True
    if q_clean and k_clean and kb <= qb:
        return True
    return False


@pytest.mark.parametrize("length,visible", [(8, 8), (12, 12), (12, 9), (16, 5)])
def test_attention_mask_matches_rule(length, visible):
    m = attention_mask(length, visible, views=1, block_size=BS)
    for q, k in itertools.product(range(2 * length), repeat=2):
        assert bool(m[q, k]) == rule(q, k, length, visible), (q, k)


def test_packed_views_equal_two_rows():
    """[noisy || complement || clean] gives the logits of the two [view || clean] rows."""
    model = tiny_model().double()
    ex = examples(1, seed=3)[0]
    m = draw_noise(ex, BS, torch.Generator().manual_seed(0))
    packed = build_batch([ex], [m], recipe="full", block_size=BS, mask_id=MASK, pad_id=PAD)
    full_model = _with_mask_row(model)
    lp = full_model(packed.ids, packed.pos, mask=packed.mask)
    comp = views_for(ex, m, complementary=True)[1]
    length = packed.length
    for v, vm in enumerate((m, comp)):
        row = build_batch([ex], [vm], recipe="pad", block_size=BS, mask_id=MASK, pad_id=PAD)
        lr = full_model(row.ids, row.pos, mask=row.mask)
        torch.testing.assert_close(lp[0, v * length:(v + 1) * length], lr[0, :length])
        torch.testing.assert_close(lp[0, 2 * length:], lr[0, length:])


def _with_mask_row(model: CausalLM) -> CausalLM:
    """A copy of the tiny model whose embedding has the mask row (for plain forwards in tests)."""
    cfg = ModelConfig(**{**{k: getattr(model.cfg, k) for k in model.cfg.__slots__}, "vocab_size": VOCAB + 1})
    big = CausalLM(cfg).to(model.lm_head.weight.dtype)
    sd = model.state_dict()
    sd["model.embed_tokens.weight"] = torch.cat([sd["model.embed_tokens.weight"],
                                                 sd["model.embed_tokens.weight"].mean(0, keepdim=True)])
    sd.pop("lm_head.weight", None)
    big.load_state_dict(sd, strict=False)
    big.lm_head.weight = big.model.embed_tokens.weight
    return big.eval()


def test_loss_only_on_masked_answer_tokens_and_complement_covers_each_once():
    exs = examples(6, seed=1)
    gen = torch.Generator().manual_seed(7)
    noise = [draw_noise(ex, BS, gen) for ex in exs]
    b = build_batch(exs, noise, recipe="full", block_size=BS, mask_id=MASK, pad_id=PAD)
    L = b.length
    for r, (ex, m) in enumerate(zip(exs, noise)):
        assert not m[:ex.prompt_len].any()
        hits = {}
        for idx, tgt in zip(b.logits_idx[r].tolist(), b.targets[r].tolist()):
            if tgt == IGNORE:
                continue
            view, i = divmod(idx, L)
            i += 1  # token shift: logits at i - 1 predict token i
            assert ex.prompt_len <= i < len(ex.ids)
            assert b.ids[r, view * L + i] == MASK  # the target position is masked in that view
            assert tgt == ex.ids[i] and b.ids[r, 2 * L + i] == ex.ids[i]
            hits[i] = hits.get(i, 0) + 1
        assert hits == {i: 1 for i in range(ex.prompt_len, len(ex.ids))}
        # prompt tokens are never masked in either view
        assert (b.ids[r, :ex.prompt_len] == b.ids[r, 2 * L:2 * L + ex.prompt_len]).all()
        assert (b.ids[r, L:L + ex.prompt_len] == b.ids[r, 2 * L:2 * L + ex.prompt_len]).all()


def test_noise_rate_is_per_block():
    ex = Example(list(range(1, 3)) + [5] * 4000, 2)
    m = draw_noise(ex, 32, torch.Generator().manual_seed(0))
    rates = m[32:32 * 120].view(-1, 32).float().mean(1)
    assert rates.std() > 0.15  # one t per block: rates spread over (0, 1), unlike one global rate


@pytest.mark.parametrize("recipe", ["naive", "pad", "full"])
def test_padding_to_block_boundary(recipe):
    ex = Example(list(range(1, 12)), 3)  # 11 tokens: 3 blocks of 4, last one partial
    m = torch.zeros(11, dtype=torch.bool)
    m[5] = True
    b = build_batch([ex, Example(list(range(1, 19)), 2)], [m, torch.zeros(18, dtype=torch.bool)],
                    recipe=recipe, block_size=BS, mask_id=MASK, pad_id=PAD)
    assert b.length % BS == 0 and b.length == 20
    assert padded_len(11, BS, pad=True) == 12
    L, c = b.length, b.views * b.length
    clean = b.ids[0, c:]
    if recipe == "naive":
        assert clean[11] == PAD and not b.mask[0, 0, c + 10, c + 11]  # padding in the last block is hidden
    else:
        assert clean[11] == MASK  # the tail of the last block is mask tokens, visible in that block
        assert b.mask[0, 0, c + 10, c + 11] and b.mask[0, 0, 8, 11]
    assert (clean[12:] == PAD).all()
    seg_pos = torch.arange((b.views + 1) * L) % L
    valid_q = seg_pos < (11 if recipe == "naive" else 12)
    assert not b.mask[0, 0][valid_q][:, seg_pos >= 12].any()  # batch padding is never seen
    assert b.views == (2 if recipe == "full" else 1)


def cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(run=tmp_path / "run", recipe="full", block_size=BS, max_len=16, rank=4, alpha=8.0, lr=3e-2,
                warmup_steps=2, epochs=100.0, batch_size=4, bf16=False, seed=0, save_every_s=1e9,
                progress=False, train_norms=True)
    base.update(kw)
    return TrainConfig(**base)


def test_steps_lower_the_loss(tmp_path):
    exs = examples(8)
    tr = Trainer(cfg(tmp_path, max_steps=20), tiny_model(), exs, MASK, PAD)
    fixed = [draw_noise(ex, BS, torch.Generator().manual_seed(i)) for i, ex in enumerate(exs)]
    batch = build_batch(exs, fixed, recipe="full", block_size=BS, mask_id=MASK, pad_id=PAD)
    with torch.no_grad():
        before = batch_loss(tr.model, batch).item()
    tr.run(tmp_path / "run")
    with torch.no_grad():
        after = batch_loss(tr.model, batch).item()
    assert after < 0.8 * before


def test_resume_is_exact(tmp_path):
    exs = examples(10)
    straight = Trainer(cfg(tmp_path / "a", max_steps=6), tiny_model(), exs, MASK, PAD)
    straight.run(tmp_path / "a" / "run")
    first = Trainer(cfg(tmp_path / "b", max_steps=3), tiny_model(), exs, MASK, PAD)
    first.run(tmp_path / "b" / "run")
    second = Trainer(cfg(tmp_path / "b", max_steps=6), tiny_model(), exs, MASK, PAD)
    ckpt = sorted((tmp_path / "b" / "run").glob("ckpt-*.pt"))[-1]
    second.load_state_dict(torch.load(ckpt, weights_only=False))
    second.run(tmp_path / "b" / "run")
    assert [h["loss"] for h in second.history] == [h["loss"] for h in straight.history]
    a, b = dict(straight.model.named_parameters()), dict(second.model.named_parameters())
    for n in straight.names:
        assert torch.equal(a[n], b[n]), n


def test_export_round_trip_gives_merged_weights(tmp_path):
    exs = examples(8)
    tr = Trainer(cfg(tmp_path, max_steps=5), tiny_model(), exs, MASK, PAD)
    tr.run(tmp_path / "run")
    out = tmp_path / "adapter.safetensors"
    meta = export(tmp_path / "run", out)
    assert meta["step"] == "5"
    merged = apply_adapter(tiny_model(), out)
    assert merged.cfg.vocab_size == VOCAB + 1
    params = dict(merged.named_parameters())
    for name, mod in tr.model.named_modules():
        if isinstance(mod, LoRALinear):
            a, b = mod.lora_A.to(torch.bfloat16).float(), mod.lora_B.to(torch.bfloat16).float()
            want = mod.base.weight + mod.scale * b @ a
            torch.testing.assert_close(params[name + ".weight"], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(params["model.embed_tokens.weight"][VOCAB], tr.model.model.embed_tokens.new[0])
    torch.testing.assert_close(params["model.norm.weight"], tr.model.model.norm.weight)
    # and the merged model computes what the trained (wrapped) model computes
    b = build_batch(exs[:2], [draw_noise(ex, BS, torch.Generator().manual_seed(0)) for ex in exs[:2]],
                    recipe="full", block_size=BS, mask_id=MASK, pad_id=PAD)
    with torch.no_grad():
        want = tr.model(b.ids, b.pos, mask=b.mask, logits_idx=b.logits_idx)
        got = merged(b.ids, b.pos, mask=b.mask, logits_idx=b.logits_idx)[..., :VOCAB]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_new_token_row_appended_or_spare():
    from training.lora import ExtendedEmbedding

    base = torch.nn.Embedding(10, 4)
    row = torch.full((1, 4), 7.0)
    ids = torch.tensor([[0, 9, 10]])
    appended = ExtendedEmbedding(base, row, first=10)(ids)
    assert torch.equal(appended[0, 2], row[0]) and torch.equal(appended[0, 1], base.weight[9])
    spare = ExtendedEmbedding(base, row, first=9)(ids)  # a padded embedding's unused row (Qwen2.5)
    assert torch.equal(spare[0, 1], row[0]) and torch.equal(spare[0, 0], base.weight[0])


@pytest.mark.parametrize("rows", [1, 3])
def test_new_token_rows_get_the_gradient_of_their_positions(rows):
    """The new rows' gradient is the sum of the upstream gradient over the positions holding their ids (the
    one-row path broadcasts instead of indexing: same values and gradient, no index_put accumulate)."""
    from training.lora import ExtendedEmbedding

    torch.manual_seed(0)
    base = torch.nn.Embedding(10, 4).requires_grad_(False)
    new = torch.randn(rows, 4)
    emb = ExtendedEmbedding(base, new, first=10)
    ids = torch.randint(0, 10 + rows, (3, 7))
    ids[0, 0] = 10  # at least one new-token position
    up = torch.randn(3, 7, 4)
    out = emb(ids)
    (out * up).sum().backward()
    for r in range(rows):
        at = ids == 10 + r
        torch.testing.assert_close(out[at], new[r].expand(int(at.sum()), 4))
        torch.testing.assert_close(emb.new.grad[r], up[at].sum(0))
    torch.testing.assert_close(out[ids < 10], base.weight[ids[ids < 10]])


def test_init_from_loads_weights_only(tmp_path):
    exs = examples(8)
    first = Trainer(cfg(tmp_path / "a", max_steps=3), tiny_model(), exs, MASK, PAD)
    first.run(tmp_path / "a" / "run")
    ckpt = torch.load(sorted((tmp_path / "a" / "run").glob("ckpt-*.pt"))[-1], weights_only=False)
    second = Trainer(cfg(tmp_path / "b", seed=5), tiny_model(), exs[:6], MASK, PAD)
    second.load_weights(ckpt)
    a, b = dict(first.model.named_parameters()), dict(second.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in first.names) and second.step == 0


def test_ablation_heldout_scores_every_answer_token_once_and_sees_training(tmp_path):
    from training.ablation import markdown, score_heldout

    exs = examples(8)
    answer_tokens = sum(len(ex.ids) - ex.prompt_len for ex in exs)
    tr = Trainer(cfg(tmp_path, max_steps=20), tiny_model(), exs, MASK, PAD)
    before = score_heldout(tr.model, exs, BS, MASK, PAD)
    tr.run(tmp_path / "run")
    after = score_heldout(tr.model, exs, BS, MASK, PAD)
    assert before["heldout_tokens"] == after["heldout_tokens"] == answer_tokens
    assert after["heldout_loss"] < 0.8 * before["heldout_loss"]
    assert after["heldout_top1"] > before["heldout_top1"]
    row = {"label": "+ pad", "tokens_seen": 1234, "diffusion_accuracy": 0.5, "ar_accuracy": 0.6,
           "long_tokens_per_forward": 1.1, "paper_gsm8k": 60.1, "paper_avg": 42.2, **after}
    assert "| + pad | 1,234 | 0 |" in markdown([row])


def test_phases_add_up_across_init_from_and_reach_the_adapter(tmp_path):
    """A run started --init-from another records it; the exported adapter's totals count both runs (the banner
    reads them), and --after does the same for checkpoints made before runs recorded their lineage."""
    from safetensors import safe_open

    from training.train import latest_checkpoint, phase_summary

    exs = examples(8)
    first = Trainer(cfg(tmp_path / "a", max_steps=3), tiny_model(), exs, MASK, PAD)
    first.run(tmp_path / "a" / "run")
    ckpt1 = latest_checkpoint(tmp_path / "a" / "run")
    sd1 = torch.load(ckpt1, weights_only=False)
    second = Trainer(cfg(tmp_path / "b", max_steps=2), tiny_model(), exs[:6], MASK, PAD)
    second.load_weights(sd1)
    assert second.prior_phases == [phase_summary(sd1)]
    second.run(tmp_path / "b" / "run")
    ckpt2 = latest_checkpoint(tmp_path / "b" / "run")
    sd2 = torch.load(ckpt2, weights_only=False)

    def meta_of(path):
        with safe_open(str(path), "pt") as f:
            return f.metadata()

    meta = meta_of(export(tmp_path / "b" / "run", tmp_path / "ad.safetensors")["file"])
    assert int(meta["tokens_seen_total"]) == sd1["tokens_seen"] + sd2["tokens_seen"] > int(meta["tokens_seen"])
    assert [p["step"] for p in json.loads(meta["phases"])] == [3, 2]
    with pytest.raises(ValueError, match="after"):
        export(tmp_path / "b" / "run", tmp_path / "x.safetensors", after=[ckpt1])
    legacy = tmp_path / "legacy.pt"  # a checkpoint from before runs recorded what they were initialised from
    torch.save({k: v for k, v in sd2.items() if k != "prior_phases"}, legacy)
    again = meta_of(export(tmp_path / "b" / "run", tmp_path / "ad2.safetensors", checkpoint=legacy, after=[ckpt1])["file"])
    assert again["tokens_seen_total"] == meta["tokens_seen_total"] and again["phases"] == meta["phases"]


def test_init_from_an_exported_adapter_file(tmp_path):
    """--init-from the shipped adapter file: the trainable tensors come back (LoRA at its stored bf16), with the
    phases recorded in its metadata; a file of another LoRA scale is refused."""
    from training.train import init_state, latest_checkpoint, phases

    exs = examples(8)
    first = Trainer(cfg(tmp_path / "a", max_steps=3), tiny_model(), exs, MASK, PAD)
    first.run(tmp_path / "a" / "run")
    sd1 = torch.load(latest_checkpoint(tmp_path / "a" / "run"), weights_only=False)
    ad = Path(export(tmp_path / "a" / "run", tmp_path / "ad.safetensors")["file"])
    c = cfg(tmp_path / "b")
    st = init_state(ad, c.alpha / c.rank)
    assert set(st["trainable"]) == set(sd1["trainable"])
    for n, t in sd1["trainable"].items():
        want = t.to(torch.bfloat16).float() if ".lora_" in n else t.float()
        assert torch.equal(st["trainable"][n], want), n
    second = Trainer(c, tiny_model(), exs[:6], MASK, PAD)
    second.load_weights(st)
    assert second.prior_phases == phases(sd1)
    with pytest.raises(ValueError, match="LoRA scale"):
        init_state(ad, 2 * c.alpha / c.rank)



def test_init_from_a_lower_rank_grows_the_adapter_and_keeps_the_model(tmp_path):
    """--init-from a rank-4 run into rank 8 at the same alpha/rank: the old directions fill the first rows of A and
    columns of B, the new ones start as fresh LoRA (B zero), so the model's logits are unchanged, and they train."""
    exs = examples(8)
    small = Trainer(cfg(tmp_path / "a", max_steps=3), tiny_model(), exs, MASK, PAD)
    small.run(tmp_path / "a" / "run")
    sd = torch.load(sorted((tmp_path / "a" / "run").glob("ckpt-*.pt"))[-1], weights_only=False)
    big = Trainer(cfg(tmp_path / "b", rank=8, alpha=16.0, max_steps=2), tiny_model(), exs, MASK, PAD)
    fresh_a = {n: p.detach().clone() for n, p in big.model.named_parameters() if n.endswith(".lora_A")}
    big.load_weights(sd)
    ids = torch.tensor([exs[0].ids])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(big.model(ids, pos, causal=True), small.model(ids, pos, causal=True))
    params = dict(big.model.named_parameters())
    for n, t in sd["trainable"].items():
        if n.endswith(".lora_A"):
            assert torch.equal(params[n][:4], t) and torch.equal(params[n][4:], fresh_a[n][4:]), n
        elif n.endswith(".lora_B"):
            assert torch.equal(params[n][:, :4], t) and not params[n][:, 4:].any(), n
    big.run(tmp_path / "b" / "run")
    assert any(params[n][:, 4:].any() for n in params if n.endswith(".lora_B")), "the new directions never trained"
    with pytest.raises(ValueError, match="rank may only grow"):
        Trainer(cfg(tmp_path / "c", rank=2, alpha=4.0), tiny_model(), exs, MASK, PAD).load_weights(sd)
