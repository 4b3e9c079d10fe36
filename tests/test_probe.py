"""training/probe.py: the adapter's quick measures (teacher-forced agreement with the AR base's answers, P(stop)).

The cached, batched computation must equal the measure's definition (a full forward per position: the block-causal
mask, the position and the rest of its block masked, the token shift); on the bundled model the shipped adapter must
agree with its base on most tokens (a broken shift or mask gives near zero); the reference file must be what its
command makes; the CLI writes its report.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model import CausalLM
from training import probe

REPO = Path(__file__).resolve().parent.parent
V, MASK = 64, 63


def _tiny() -> CausalLM:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, attention_bias=True, rope_theta=10000.0)
    g = torch.Generator().manual_seed(7)
    m = CausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))
    return m.eval()


def _by_definition(model, ids: list[int], plen: int, bs: int) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for q in range(plen, len(ids)):
            end = (q // bs + 1) * bs
            seq = torch.tensor([ids[:q] + [MASK] * (end - q)])
            logits = model(seq, torch.arange(end)[None], mask=probe.block_causal(end, bs))[0, q - 1].clone()
            logits[MASK] = float("-inf")
            rows.append(torch.log_softmax(logits, -1))
    return torch.stack(rows)


@pytest.mark.parametrize("plen", [5, 15, 16, 17])
def test_cached_batched_logprobs_equal_the_definition(plen):
    """Prompts before, at and after a block boundary; 16-position blocks (15 variants: more than ROWS, so a block's
    variants go in several forwards); the last block partial."""
    model = _tiny()
    g = torch.Generator().manual_seed(plen)
    ids = torch.randint(0, MASK, (plen + 37,), generator=g).tolist()
    got = probe.dllm_logprobs(model, ids, plen, MASK, 16)
    want = _by_definition(model, ids, plen, 16)
    assert got.shape == want.shape == (37, V)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_reference_answers_are_the_base_answers_to_the_long_prompts(engine):
    """bench/data/probe_answers.jsonl: the 20 prompts `bench quality --long-limit 20` scores, as the engine
    tokenises them; an answer ends with a stop token exactly when it is marked stopped, and only there."""
    from bench.longform import spread

    items = probe.load_answers()
    prompts = spread([json.loads(x) for x in probe.PROMPTS.read_text().splitlines() if x.strip()], 20)
    assert [it["id"] for it in items] == [p["id"] for p in prompts]
    stops = set(engine.lm.stop_token_ids)
    for it, p in zip(items, prompts):
        assert it["prompt_ids"] == engine.encode(engine.chat_prompt([{"role": "user", "content": p["prompt"]}]))
        assert (it["answer_ids"][-1] in stops) == it["stopped"]
        assert not stops & set(it["answer_ids"][:-1])
        assert it["stopped"] or len(it["answer_ids"]) == 256


def _shortest(n: int) -> list[dict]:
    return sorted(probe.load_answers(), key=lambda a: len(a["answer_ids"]))[:n]


def test_shipped_adapter_agrees_with_its_base_on_most_tokens(engine):
    """On the three shortest reference answers (all stopped): the measures are in range, and the shipped adapter
    predicts most of its base's tokens (0.82 on all 20); a shift or mask off by one gives near zero."""
    answers = _shortest(3)
    rep = probe.probe(engine, answers)
    assert rep.answers == 3 and rep.positions == sum(len(a["answer_ids"]) for a in answers)
    assert 0.6 < rep.agreement <= 1.0
    assert -2.0 < rep.mean_logprob < 0.0
    assert 0 <= rep.first_disagreement_median <= max(a["tokens"] for a in rep.per_answer)
    stopped = [a for a in rep.per_answer if a["stopped"]]
    assert stopped and all(0.0 <= a["p_stop_dllm"] <= 1.0 and 0.0 < a["p_stop_base"] <= 1.0 for a in stopped)
    assert rep.setting["block_size"] == 32


def test_make_answers_writes_what_the_engine_generates(engine, tmp_path):
    path = tmp_path / "answers.jsonl"
    items = probe.make_answers(engine, limit=2, max_new_tokens=8, path=path)
    assert probe.load_answers(path) == items and len(items) == 2
    cfg = engine.decode_config(mode="ar", max_new_tokens=8)
    for it in items:
        s = engine.generate_ids([it["prompt_ids"]], cfg, record=False)[0].summary
        assert it["answer_ids"] == s.token_ids and it["stopped"] == (s.stop_reason == "stop_token")


def test_cli_writes_the_report(tmp_path):
    out, answers = tmp_path / "probe.json", tmp_path / "answers.jsonl"
    answers.write_text(json.dumps(_shortest(1)[0]) + "\n")
    r = subprocess.run([sys.executable, "-m", "training", "probe", "--answers", str(answers), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["answers"] == 1 and len(rep["per_answer"]) == 1 and 0 <= rep["agreement"] <= 1
    assert rep["setting"]["answers_file"] == str(answers) and rep["per_answer"][0]["id"] == _shortest(1)[0]["id"]
    bad = subprocess.run([sys.executable, "-m", "training", "probe", "--adapter", str(tmp_path / "none.safetensors")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--adapter: no adapter file at" in bad.stderr
