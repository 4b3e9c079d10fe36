"""Training data that teaches stopping (issue 21 part 2): the `finish` answers policy of training/finish.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.weights import bundled_base_dir, load_tokenizer
from training.examples import Example, load_data
from training.finish import MIN_KEPT, FinishStats, Pieces, finish_answer, sentence_ends
from training.recipe import build_batch, draw_noise
from training.shards import make_shard

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_base_dir(), add_mask_token=False)


@pytest.fixture(scope="module")
def stop(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def run(tok, stop, prompt, answer, stopped, *, max_len=256, policy="finish"):
    stats = FinishStats()
    out = finish_answer(prompt, answer, stopped, max_len=max_len, stop_id=stop, piece=Pieces(tok.decode),
                        policy=policy, stats=stats)
    return out, stats


PROSE = ("The sea is wide and deep. Waves roll in from far away and break on the sand. Gulls cry above the "
         "water while boats rock in the harbour. At night the lighthouse sweeps its beam across the")
LOOP = "that The is a beautiful poem " * 12


def test_capped_answer_is_cut_at_its_last_sentence_end_and_closed(tok, stop):
    prompt = enc(tok, "<|im_start|>user\nDescribe the sea.<|im_end|>\n<|im_start|>assistant\n")
    out, stats = run(tok, stop, prompt, enc(tok, PROSE), stopped=False)
    assert out is not None and out[-1] == stop and out[:len(prompt)] == prompt
    text = tok.decode(out[len(prompt):-1])
    assert text.endswith("rock in the harbour.") and "lighthouse" not in text
    assert stats.closed_capped == 1 and stats.answer_lengths == [len(out) - len(prompt)]


def test_stopped_answer_that_fits_is_kept_unchanged(tok, stop):
    ans = enc(tok, "Paris is the capital of France.") + [stop]
    out, stats = run(tok, stop, [1, 2, 3], ans, stopped=True)
    assert out == [1, 2, 3] + ans and stats.kept_stopped == 1


def test_stopped_answer_over_max_len_is_cut_inside_max_len_and_closed(tok, stop):
    prompt = [1] * 10
    ans = enc(tok, PROSE + " rocks. It keeps ships safe.") + [stop]
    out, stats = run(tok, stop, prompt, ans, stopped=True, max_len=40)
    assert out is not None and len(out) <= 40 and out[-1] == stop and stats.closed_too_long == 1
    assert tok.decode(out[10:-1]).rstrip().endswith(".")


def test_looping_answers_are_dropped_and_keep_policy_keeps_them(tok, stop):
    out, stats = run(tok, stop, [1], enc(tok, LOOP) + [stop], stopped=True)
    assert out is None and stats.dropped_looping == 1
    kept, _ = run(tok, stop, [1], enc(tok, LOOP), stopped=False, policy="keep")
    assert kept is not None and kept[-1] != stop  # the old rule: no stop token to learn


def test_no_cut_inside_a_code_fence_or_after_a_bare_list_number(tok, stop):
    piece = Pieces(tok.decode)
    code = enc(tok, "Here is the code. ```python\nx = 1. \nprint(x) \ny = 2. \n")
    ends = [tok.decode(code[:j]) for j in sentence_ends(code, piece)]
    assert ends == ["Here is the code."]
    listing = enc(tok, "Fruits:\n1. Apples are red.\n2. Pears")
    ends = [tok.decode(listing[:j]) for j in sentence_ends(listing, piece)]
    assert ends == ["Fruits:\n1. Apples are red."]  # "1." and "2." are list numbers, not sentence ends


def test_capped_answer_without_a_usable_sentence_end_is_dropped(tok, stop):
    out, stats = run(tok, stop, [1], enc(tok, "Yes. The tide rolls over rocks while gulls circle slowly above the grey harbour and"), stopped=False)
    assert out is None and stats.dropped_capped == 1  # the only end leaves fewer than MIN_KEPT tokens
    assert len(enc(tok, "Yes.")) < MIN_KEPT


def test_no_answer_without_its_stop_token_gets_into_training(tmp_path, tok, stop):
    """A shard directory with stopped, capped, looping and over-long answers: under the default policy every
    example the trainer reads ends with the stop token; under 'keep' the capped one gets in without it."""
    p = enc(tok, "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n")
    rows = [(1, 0, p, enc(tok, "The sea is salty.") + [stop], True),
            (2, 0, p, enc(tok, PROSE), False),
            (3, 1, p, enc(tok, LOOP), False),
            (4, 1, p, enc(tok, LOOP) + [stop], True),
            (5, 0, p, enc(tok, "Short but never ended"), False)]
    d = tmp_path / "si"
    d.mkdir()
    make_shard(rows, 49152).save(d / "shard-00000.npz")
    examples, stats = load_data(d, tok, stop, 256)
    assert len(examples) == 2 and all(ex.ids[-1] == stop for ex in examples)
    assert stats["dropped_looping"] == 2 and stats["dropped_capped"] == 1 and stats["closed_capped"] == 1
    kept, _ = load_data(d, tok, stop, 256, "keep")
    assert any(ex.ids[-1] != stop for ex in kept) and len(kept) == 5


def test_the_shipped_data_set_manifest_records_the_policy_and_its_counts():
    m = json.loads((ROOT / "training/data/selfinstruct/manifest.json").read_text())
    pol = m["answers_policy"]
    assert pol["default"] == "finish" and "looping" in pol["rules"]
    c = pol["by_max_len"]["256"]["finish"]
    assert c["kept_without_stop"] == 0 and c["records"] == m["examples"]
    assert c["kept"] == c["kept_stopped"] + c["closed_capped"] + c["closed_too_long"]
    assert c["records"] == c["kept"] + sum(v for k, v in c.items() if k.startswith("dropped_"))


@pytest.mark.parametrize("seed", range(6))
def test_the_stop_token_carries_loss_in_exactly_one_view(seed, stop):
    """Token shift, padding to the block boundary and both complementary views included: the stop token at
    position n-1 is a target exactly once, predicted from the logits at n-2 of the view that masks it."""
    ids = list(range(10, 30)) + list(range(100, 120)) + [stop]  # prompt 20, answer 21 (through the stop)
    ex = Example(ids, 20)
    m = draw_noise(ex, 32, torch.Generator().manual_seed(seed))
    b = build_batch([ex], [m], recipe="full", block_size=32, mask_id=7, pad_id=0)
    n, L = len(ids), b.length
    pairs = list(zip(b.logits_idx[0].tolist(), b.targets[0].tolist()))
    hits = [(v, t) for v in range(2) for idx, t in pairs if idx == v * L + n - 2]
    assert len(hits) == 1 and hits[0][1] == stop
    assert int(b.ids[0, hits[0][0] * L + n - 1]) == 7  # masked in the view whose logits predict it
    assert n < L  # padded to the block boundary: positions n..L-1 exist but carry no loss
    assert not any(idx % L >= n - 1 for idx in b.logits_idx[0].tolist() if idx >= 0)
