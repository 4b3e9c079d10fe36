"""The adapter's quick measures (DESIGN.md section 5; docs/quality.md "Why the adapter loops"): how well the dLLM
predicts its AR base's own greedy answers, left to right, teacher-forced. A minute on a CPU instead of the
long-answer decoding runs, so a training run can be steered by it between those.

Reference answers (`bench/data/probe_answers.jsonl`, `make_answers`): the AR base's greedy answers, fp32 steps,
through its stop token (at most 256 new tokens), to the 20 long-answer prompts `bench quality --long-limit 20`
scores. For every answer position q, on the block grid from absolute position 0 with the token shift: the sequence
clean up to q, q and the rest of its block masked, earlier blocks clean (block-causal attention), the dLLM's
logits at q - 1 (a block's first position: the clean previous block's last logits). Measures:
- `agreement`: the dLLM's top token (the mask token excluded) equals the base's token;
- `mean_logprob`: of the base's token;
- `first_disagreement_median`: per answer, the first answer index where they differ (the answer's length when none);
- `p_stop_dllm` / `p_stop_base`: at the base's end (answers that stopped), the probability of its stop token under
  the dLLM as above and under the base itself (causal, teacher-forced).
Judged against the design's aims: agreement >= 0.95; P(stop) at the end as high as the base's.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
ANSWERS = REPO / "bench" / "data" / "probe_answers.jsonl"
PROMPTS = REPO / "bench" / "data" / "long_answer.jsonl"
ROWS = 8  # variants of a block per forward (each row holds its own copy of the prefix's K/V)


@dataclass(slots=True)
class AnswerProbe:
    id: str
    tokens: int
    stopped: bool
    agree: int
    logprob_sum: float
    first_disagreement: int
    p_stop_dllm: float | None
    p_stop_base: float | None


@dataclass(slots=True)
class ProbeReport:
    agreement: float
    mean_logprob: float
    first_disagreement_median: float
    p_stop_dllm: float | None
    p_stop_base: float | None
    positions: int
    answers: int
    seconds: float
    setting: dict[str, Any] = field(default_factory=dict)
    per_answer: list[dict[str, Any]] = field(default_factory=list)


def block_causal(n: int, bs: int) -> torch.Tensor:
    """[1, 1, n, n] boolean: query i may see key j when block(j) <= block(i)."""
    i = torch.arange(n)
    return ((i[None, :] // bs) <= (i[:, None] // bs))[None, None]


def _logp(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    logits = logits.float().clone()
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits[..., mask_id] = float("-inf")
    return torch.log_softmax(logits, -1)


@torch.inference_mode()
def dllm_logprobs(model, ids: list[int], plen: int, mask_id: int, bs: int) -> torch.Tensor:
    """[len(ids) - plen, V] log-probabilities the dLLM gives answer position q (see the module's comment)."""
    from engine.model import KVCache

    n = len(ids)
    seq = torch.tensor([ids])
    dtype = next(model.parameters()).dtype
    room = -(-n // bs) * bs
    clean = KVCache(model.cfg, 1, room, seq.device, dtype)  # every clean block's K/V, as a committed block's
    firsts = [q for q in range(plen, n) if q % bs == 0]  # a block's first position: the clean previous block's last logits
    logits = model(seq, torch.arange(n)[None], clean, start=0, kv_len=n, mask=block_causal(n, bs),
                   logits_idx=torch.tensor([[q - 1 for q in firsts] or [0]]))[0]
    out = torch.empty(n - plen, logits.shape[-1])
    for i, q in enumerate(firsts):
        out[q - plen] = _logp(logits[i], mask_id)
    for s in range(plen // bs * bs, n, bs):
        qs = list(range(max(s + 1, plen), min(s + bs, n)))
        for c in range(0, len(qs), ROWS):
            part = qs[c:c + ROWS]
            rows = torch.full((len(part), bs), mask_id, dtype=torch.long)
            for r, q in enumerate(part):
                rows[r, :q - s] = seq[0, s:q]
            cache = KVCache(model.cfg, len(part), s + bs, seq.device, dtype)
            cache.k[:, :, :, :s] = clean.k[:, :1, :, :s]
            cache.v[:, :, :, :s] = clean.v[:, :1, :, :s]
            pos = torch.arange(s, s + bs)[None].expand(len(part), bs)
            idx = torch.tensor([[q - 1 - s] for q in part])
            got = model(rows, pos, cache, start=s, kv_len=s + bs, logits_idx=idx)[:, 0]
            for r, q in enumerate(part):
                out[q - plen] = _logp(got[r], mask_id)
    return out


@torch.inference_mode()
def base_stop_prob(model, ids: list[int]) -> float:
    """The base's probability of the answer's last token (its stop token) after the rest, causal."""
    n = len(ids)
    logits = model(torch.tensor([ids[:-1]]), torch.arange(n - 1)[None], causal=True)[0, -1]
    return float(torch.softmax(logits.float(), -1)[ids[-1]])


def load_answers(path: Path = ANSWERS) -> list[dict[str, Any]]:
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for it in items:
        if not all(k in it for k in ("id", "prompt_ids", "answer_ids", "stopped")):
            raise ValueError(f"{path}: item {it.get('id')!r} lacks prompt_ids / answer_ids / stopped")
    return items


def probe(eng, answers: list[dict[str, Any]], block_size: int | None = None) -> ProbeReport:
    """The measures for the engine's dLLM (eng.lm.dllm) on these reference answers."""
    lm = eng.lm
    if lm.mask_token_id is None:
        raise ValueError("probe: the model has no mask token (no adapter loaded)")
    bs = block_size or 32
    t0 = time.perf_counter()
    per: list[AnswerProbe] = []
    for it in answers:
        ids = it["prompt_ids"] + it["answer_ids"]
        plen = len(it["prompt_ids"])
        lp = dllm_logprobs(lm.dllm, ids, plen, lm.mask_token_id, bs)
        target = torch.tensor(it["answer_ids"])
        mine = lp.argmax(-1)
        same = mine == target
        wrong = (~same).nonzero()
        p_dllm = p_base = None
        if it["stopped"]:
            p_dllm = float(lp[-1, target[-1]].exp())
            p_base = base_stop_prob(lm.base, ids)
        per.append(AnswerProbe(it["id"], len(target), it["stopped"], int(same.sum()),
                               float(lp.gather(1, target[:, None]).sum()),
                               int(wrong[0, 0]) if len(wrong) else len(target), p_dllm, p_base))
    total = sum(a.tokens for a in per)
    stops = [a for a in per if a.p_stop_dllm is not None]
    mean = (lambda xs: round(statistics.fmean(xs), 4) if xs else None)  # noqa: E731
    return ProbeReport(
        agreement=round(sum(a.agree for a in per) / total, 4),
        mean_logprob=round(sum(a.logprob_sum for a in per) / total, 4),
        first_disagreement_median=float(statistics.median(a.first_disagreement for a in per)),
        p_stop_dllm=mean([a.p_stop_dllm for a in stops]), p_stop_base=mean([a.p_stop_base for a in stops]),
        positions=total, answers=len(per), seconds=round(time.perf_counter() - t0, 1),
        setting={"block_size": bs, "model": lm.banner(), "adapter": str(lm.source.adapter or "")},
        per_answer=[asdict(a) for a in per])


def make_answers(eng, limit: int = 20, max_new_tokens: int = 256, path: Path = ANSWERS) -> list[dict[str, Any]]:
    """The AR base's greedy answers to the prompts `bench quality --long-limit {limit}` scores, written to `path`."""
    from bench.longform import spread

    prompts = spread([json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()], limit)
    cfg = eng.decode_config(mode="ar", max_new_tokens=max_new_tokens)
    items = []
    for it in prompts:
        ids = eng.encode(eng.chat_prompt([{"role": "user", "content": it["prompt"]}]))
        s = eng.generate_ids([ids], cfg, record=False)[0].summary
        items.append({"id": it["id"], "prompt": it["prompt"], "prompt_ids": ids, "answer_ids": list(s.token_ids),
                      "stopped": s.stop_reason == "stop_token", "text": s.text})
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return items
