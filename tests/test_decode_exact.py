"""The decoders (engine/decode/) pinned exactly and fast, on tiny random models: the mutation target `decode`'s tests.

Everything a listener sees is compared with the plain reference decoder (tests/oracle.py): every forward's kind,
block and sub-block, its commits and their confidences, the heatmap of positions it scored and left masked, the
text deltas and the summary. Batches put their rows at different block starts and prompt lengths, rows leave at
different forwards, rows join a running batch (merge), prompts are prefilled in chunks, one row is cancelled alone,
rows carry different repetition knobs, sampled rows reproduce alone and batched and their confidences are their
token's probability under the tempered nucleus; the static stepper (eager here) decodes as CausalLM.forward does.
Each decode is a few dozen forwards of a 2-layer model with a 128-token toy vocabulary and a toy tokenizer (the
bundled tokenizer takes seconds to load, per mutant), and is driven forward by forward with a bound, so a decoder
that stops making progress fails at once instead of hanging: the file runs in a few seconds.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from functools import lru_cache

import pytest
import torch

import oracle
from engine.config import DecodeConfig
from engine.decode import ARDecoder, Decoder, DiffusionDecoder, decoder_for
from engine.decode.rows import Batch, Row
from engine.penalties import Penalties, apply_scales
from engine.static import StaticStepper
from engine.text import TokenBytes
from test_oracle import MASK, V, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPECIAL = 3  # a special token of the toy vocabulary (never shown in the text); MASK is the other


class ToyTokenizer:
    """What TokenBytes reads of a tokenizer, for the random models' V ids: id i is the piece "w{i}", every third one
    with a leading space ("Ġ" in byte-level BPE); SPECIAL and MASK are special ("<s3>")."""

    all_special_ids = [SPECIAL, MASK]

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.decode([i]) if i in self.all_special_ids else ("Ġ" if i % 3 == 0 else "") + f"w{i}"

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<s{i}>" if i in self.all_special_ids else (" " if i % 3 == 0 else "") + f"w{i}" for i in ids)


TB = TokenBytes(ToyTokenizer())


@lru_cache(maxsize=None)
def prompts_of(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(0, MASK, (n,), generator=g).tolist() for n in lengths]


@lru_cache(maxsize=None)
def frequent(seed: int) -> tuple[int, int]:
    """The two tokens model `seed` predicts most often after its prompts (stop tokens that rows actually commit)."""
    with torch.no_grad():
        p = prompts_of(seed, (40,))[0]
        top = tiny(seed)(torch.tensor([p]), torch.arange(40)[None], causal=True)[0, :, :MASK].argmax(-1)
    counts = torch.bincount(top, minlength=V)
    counts[SPECIAL] = 0
    a, b = counts.topk(2).indices.tolist()
    return a, b


class Log:
    """Every event, by row index, and in the order they came."""

    def __init__(self) -> None:
        self.by_row: dict[int, list] = {}
        self.order: list = []

    def __call__(self, e) -> None:
        self.by_row.setdefault(e.row, []).append(e)
        self.order.append(e)


def drive(dec: Decoder, prompts: list[list[int]], rows: list[Row] | None = None, limit: int = 300):
    """Decode to the end forward by forward (prefill, then step while rows are live), at most `limit` steps."""
    rows = rows if rows is not None else dec.new_rows(prompts)
    with torch.inference_mode():
        batch = dec.prefill(prompts, rows)
        for _ in range(limit):
            if not batch.rows:
                break
            batch = dec.step(batch)
        assert not batch.rows, "the decode stopped making progress"
    return [r.summary for r in rows]


def text_of(ids: list[int], stops: set[int]) -> str:
    return "".join(TB.piece(t) for t in ids if t not in stops and t not in TB.special)


def check_summary(s, events: list, stops: set[int]) -> None:
    """A row's summary against its own events: counts, text, clock."""
    n = len(s.token_ids)
    forwards = [e for e in events if e.kind != "done"]
    assert events[-1].kind == "done" and events[-1].committed == [] and events[-1].masked == []
    assert events[-1].sub_block == -1 and events[-1].nfe == s.nfe == len(forwards)
    assert [e.nfe for e in forwards] == list(range(1, len(forwards) + 1))
    assert s.answer_tokens == n and s.tokens_per_forward == n / max(s.nfe, 1)
    assert s.text == text_of(s.token_ids, stops) == "".join(e.text_delta for e in events)
    assert all(t.text == TB.piece(t.id) for e in events for t in e.committed + e.masked)
    times = [e.t for e in events]
    assert times == sorted(times) and 0 < times[0] and times[-1] <= s.seconds
    assert s.tokens_per_second == pytest.approx(n / s.seconds)
    if n:  # the first answer token's time: after the forward before the one that committed it, before its event
        k = next(i for i, e in enumerate(forwards) if any(t.pos == 0 for t in e.committed))
        assert (forwards[k - 1].t if k else 0) <= s.ttft <= forwards[k].t
    else:
        assert s.ttft == s.seconds


def check_oracle(events: list, s, run: oracle.OracleRun, stops: set[int], where: str) -> None:
    """A diffusion row's events and summary == the oracle's: commits, blocks, confidences, heatmap."""
    forwards = [e for e in events if e.kind != "done"]
    got = [(e.kind, [(t.pos, t.id) for t in e.committed]) for e in forwards]
    first = next((j for j, (a, b) in enumerate(zip(got, run.steps)) if a != b), min(len(got), len(run.steps)))
    assert got == run.steps, f"{where}: forward {first}: engine {got[first:first + 1]} oracle {run.steps[first:first + 1]}"
    assert [(e.block, e.sub_block) for e in forwards] == run.where, where
    for e, confs, shown in zip(forwards, run.confs, run.masked):
        assert [t.conf for t in e.committed] == pytest.approx(confs, abs=1e-5), where
        assert [(t.pos, t.id) for t in e.masked] == [(p, t) for p, t, _ in shown], (where, e.nfe)
        assert [t.conf for t in e.masked] == pytest.approx([c for _, _, c in shown], abs=1e-5), where
    assert (s.token_ids, s.stop_reason) == (run.answer, run.stop_reason), where
    check_summary(s, events, stops)


def oracle_runs(model, prompts, cfg: DecodeConfig, caps: list[int] | None = None) -> list[oracle.OracleRun]:
    caps = caps or [cfg.max_new_tokens] * len(prompts)
    return [oracle.decode(model, [p], mask_id=MASK, stop_ids=set(cfg.stop_token_ids), block_size=cfg.block_size,
                          sub_block_size=cfg.sub_block_size, threshold=cfg.threshold, strategy=cfg.strategy,
                          factor=cfg.factor, max_new_tokens=cap, cache="dual" if cfg.cache == "dual" else "none",
                          stop_guard=cfg.stop_guard)[0] for p, cap in zip(prompts, caps)]


def diffusion_cfg(seed: int, cache: str, bs: int, sbs: int, strategy: str = "threshold", threshold: float = 0.7,
                  factor: float = 1.0, max_new: int = 20, **kw) -> DecodeConfig:
    return DecodeConfig(block_size=bs, sub_block_size=sbs, strategy=strategy, threshold=threshold, factor=factor,
                        cache=cache, max_new_tokens=max_new, stop_token_ids=(frequent(seed)[0],), **kw).validate()


# ------------------------------------------------------------------ block diffusion == the oracle, every event
CASES = [  # seed, cache, block, sub-block, rule, threshold, factor, prompt lengths
    (0, "none", 8, 4, "threshold", 0.5, 1.0, (3, 8, 13, 17)),
    (1, "block", 8, 2, "threshold", 0.9, 1.0, (8, 5, 16, 11)),
    (0, "dual", 8, 4, "threshold", 0.7, 1.0, (13, 3, 8, 22)),
    (2, "dual", 16, 4, "factor", 0.9, 2.0, (5, 16, 19, 33)),
    (1, "block", 4, 4, "factor", 0.9, 1.0, (4, 6, 9)),
    (2, "none", 16, 8, "threshold", 0.3, 1.0, (16, 7, 25)),
    (0, "dual", 8, 8, "threshold", 0.6, 1.0, (5, 8, 10)),  # one sub-block a block: each block's first step refreshes
    (1, "dual", 4, 2, "factor", 0.9, 1.5, (2, 4, 7, 12)),
]


@pytest.mark.parametrize("seed,cache,bs,sbs,strategy,threshold,factor,lengths", CASES)
def test_diffusion_batch_equals_the_oracle_event_by_event(seed, cache, bs, sbs, strategy, threshold, factor, lengths):
    model, prompts = tiny(seed), prompts_of(seed, lengths)
    cfg = diffusion_cfg(seed, cache, bs, sbs, strategy, threshold, factor)
    log = Log()
    summaries = drive(decoder_for(model, cfg, MASK, TB, listener=log), prompts)
    runs = oracle_runs(model, prompts, cfg)
    stops = set(cfg.stop_token_ids)
    for i, (s, run) in enumerate(zip(summaries, runs)):
        check_oracle(log.by_row[i], s, run, stops, f"row {i} ({len(prompts[i])} tokens) {cfg.cache} {bs}/{sbs}")
    # what the case reaches: several tokens in one forward, and a row that stops on its stop token
    assert any(len(c) > 1 for r in runs for _, c in r.steps) and any(r.stop_reason == "stop_token" for r in runs)


def test_stop_guard_and_per_row_answer_caps_equal_the_oracle():
    """stop_guard: candidates end at the first predicted stop token; rows with their own max_new_tokens."""
    seed = 0
    model, prompts = tiny(seed), prompts_of(seed, (5, 8, 14))
    caps = [7, 13, 20]  # row 2 predicts its stop token mid-sub-block with confident positions after it
    for cache in ("block", "dual"):
        cfg = diffusion_cfg(seed, cache, 8, 4, threshold=0.3, stop_guard=True)
        log = Log()
        dec = decoder_for(model, cfg, MASK, TB, listener=log)
        summaries = drive(dec, prompts, dec.new_rows(prompts, max_new=caps))
        runs = oracle_runs(model, prompts, cfg, caps)
        for i, (s, run) in enumerate(zip(summaries, runs)):
            check_oracle(log.by_row[i], s, run, set(cfg.stop_token_ids), f"row {i} {cache} cap {caps[i]}")
            assert len(s.token_ids) <= caps[i]
        # the guard bites here (mutation run: with caps that never reached it, committing past the cut survived)
        unguarded = oracle_runs(model, prompts, replace(cfg, stop_guard=False), caps)
        assert any(a.steps != b.steps for a, b in zip(runs, unguarded)), cache


def test_the_mask_token_is_never_an_answer_and_no_mask_token_is_refused():
    """A model that always predicts the mask token still answers with other tokens; a model without one cannot
    decode by diffusion (the message says so)."""
    model = tiny(0)
    cfg = diffusion_cfg(0, "block", 8, 4, max_new=8)
    with torch.no_grad():
        model.lm_head.weight[MASK] += 100.0  # the mask token outscores every other token everywhere
    try:
        [s] = drive(decoder_for(model, cfg, MASK, TB), prompts_of(0, (5,)))
        [want] = oracle_runs(model, prompts_of(0, (5,)), cfg)
    finally:
        with torch.no_grad():
            model.lm_head.weight[MASK] -= 100.0
    assert MASK not in s.token_ids and s.token_ids == want.answer
    with pytest.raises(ValueError, match=r"^mode: this model has no mask token \|<MASK>\|, so it cannot decode by "
                                         r"block diffusion; use mode 'ar'$"):
        decoder_for(model, cfg, None, TB).run(prompts_of(0, (5,)))


def test_run_decodes_to_the_end_and_the_row_helpers():
    """Decoder.run (what Engine.generate_ids calls) gives drive()'s summaries; rows' own bookkeeping."""
    seed = 1
    model, prompts = tiny(seed), prompts_of(seed, (6, 8))
    cfg = diffusion_cfg(seed, "dual", 8, 4)
    log = Log()
    got = decoder_for(model, cfg, MASK, TB, listener=log).run(prompts)
    for i, (s, run) in enumerate(zip(got, oracle_runs(model, prompts, cfg))):
        check_oracle(log.by_row[i], s, run, set(cfg.stop_token_ids), f"run() row {i}")
    dec = decoder_for(model, cfg, MASK, TB)
    assert isinstance(dec, DiffusionDecoder) and dec.block == 8 and dec.uses_cache()
    assert not decoder_for(model, DecodeConfig(cache="none"), MASK, TB).uses_cache()
    row = dec.new_rows([[5, 6, 7]], max_new=[4])[0]
    assert (row.prompt_len, row.limit, row.answer, row.index) == (3, 7, [None] * 4, 0)
    row.answer[1] = 9
    assert [row.known(q) for q in range(7)] == [True, True, True, False, True, False, False]
    assert dec._max_len([row]) == 16 and dec.chunk_limit([row]) == 0  # room: 7 rounded up to 8, plus a block


# ------------------------------------------------------------------ AR == a full causal forward per token
def ar_want(model, prompt: list[int], cap: int, stops: set[int], pen: Penalties | None = None) -> list[int]:
    """Greedy AR, a full causal forward per token; the repetition knobs applied as engine/penalties.py defines them
    (its functions are tested against transformers in test_penalties.py) and no-repeat n-grams written plainly."""
    ids: list[int] = list(prompt)
    with torch.no_grad():
        for _ in range(cap):
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], causal=True)[0, -1].float()
            logits[MASK] = float("-inf")
            if pen is not None and pen.scales:
                logits = apply_scales(logits[None, None], [prompt], [ids[len(prompt):]], [pen])[0, 0]
            if pen is not None and pen.no_repeat_ngram:
                n = pen.no_repeat_ngram
                seen = {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}
                for t in range(V):
                    if len(ids) >= n - 1 and tuple(ids[len(ids) - n + 1:] + [t]) in seen:
                        logits[t] = float("-inf")
            ids.append(int(logits.argmax()))
            if ids[-1] in stops:
                break
    return ids[len(prompt):]


def check_ar(log: Log, summaries, model, prompts, caps, stops, pens=None) -> None:
    for i, (p, s) in enumerate(zip(prompts, summaries)):
        want = ar_want(model, p, caps[i], stops, pens[i] if pens else None)
        events = log.by_row[i]
        assert s.token_ids == want, f"row {i}"
        assert [(e.kind, [(t.pos, t.id) for t in e.committed]) for e in events[:-1]] == \
            [("prefill" if j == 0 else "step", [(j, t)]) for j, t in enumerate(want)], f"row {i}"
        assert all((e.block, e.sub_block, e.masked) == (0, -1, []) for e in events)
        assert s.stop_reason == ("stop_token" if want[-1] in stops else "max_new_tokens")
        assert len(want) == caps[i] or want[-1] in stops
        check_summary(s, events, stops)
    for e in log.order:
        assert all(0.0 < t.conf <= 1.0 for t in e.committed)


@pytest.mark.parametrize("lengths", [(5, 9, 3, 20), (7, 7, 7)])
def test_ar_batch_equals_greedy_full_forwards(lengths):
    """Rows at different positions (a causal key mask per row), or all at the same one (one shared start)."""
    seed = 2
    model, prompts = tiny(seed), prompts_of(seed, lengths)
    stops = {frequent(seed)[0]}
    caps = [12, 6, 16, 9][:len(prompts)]
    cfg = DecodeConfig(mode="ar", max_new_tokens=16, stop_token_ids=tuple(stops)).validate()
    log = Log()
    dec = decoder_for(model, cfg, MASK, TB, listener=log)
    assert isinstance(dec, ARDecoder) and dec.block == 1
    check_ar(log, drive(dec, prompts, dec.new_rows(prompts, max_new=caps)), model, prompts, caps, stops)


def test_ar_rows_of_unequal_length_are_prefilled_one_at_a_time(monkeypatch):
    """An AR batch whose prompts differ in length prefills each row in the forward it gets alone (a padded forward
    runs a row's attention with more query rows, whose last bits the 4-bit default's wide activations turned into
    other answers); rows of one length share a forward; every answer is its row's alone."""
    seed = 0
    model = tiny(seed)
    head = prompts_of(seed, (16,))[0]
    prompts = [head + [5, 6], head + [7], head + [8, 9, 10]]
    stops = {frequent(seed)[0]}
    cfg = DecodeConfig(mode="ar", max_new_tokens=10, stop_token_ids=tuple(stops)).validate()
    widths = []
    real = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, ids, *a, **k: k.get("cache_rows") is None and
                        widths.append(tuple(ids.shape)) or real(self, ids, *a, **k))
    summaries = drive(decoder_for(model, cfg, MASK, TB), prompts)
    assert widths[:4] == [(1, 18), (1, 17), (1, 19), (3, 1)]  # each prompt alone, then the batch's steps
    widths.clear()
    alone = [drive(decoder_for(model, cfg, MASK, TB), [p])[0] for p in prompts]
    assert [s.token_ids for s in summaries] == [s.token_ids for s in alone]
    assert widths[0] == (1, 18)
    widths.clear()
    drive(decoder_for(model, cfg, MASK, TB), [head + [5, 6], head + [7, 8]])
    assert widths[:2] == [(2, 18), (2, 1)]  # one length: one forward


# ------------------------------------------------------------------ sampling: per-row streams, tempered nucleus
class Recorder:
    """The model, with every forward's logits kept (what the decoder sampled from)."""

    def __init__(self, model) -> None:
        self.model, self.cfg, self.logits = model, model.cfg, []

    def parameters(self):
        return self.model.parameters()

    def __call__(self, *a, **k):
        out = self.model(*a, **k)
        self.logits.append(out.detach().clone())
        return out


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) cut to the smallest prefix of tokens whose mass reaches top_p, renormalised (plain)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        keep.append(i)
        mass += float(p[i])
    out = torch.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_sampled_confidences_are_the_tempered_nucleus_and_rows_reproduce(mode):
    """temperature 0.8, top_p 0.9, seed 11: each committed token's confidence is its probability under the row's
    tempered nucleus (the mask token excluded); tokens shown but not drawn (the heatmap past the sub-block) are the
    tempered argmax. Row i samples as a request seeded 11 + i alone, watched or not; an unseeded decode differs."""
    seed = 1
    model, prompts = tiny(seed), prompts_of(seed, (6, 9, 16))
    cfg = DecodeConfig(mode=mode, block_size=8, sub_block_size=4, threshold=0.6, cache="block", max_new_tokens=14,
                       temperature=0.8, top_p=0.9, seed=11, stop_token_ids=()).validate()
    rec, log = Recorder(model), Log()
    dec = decoder_for(rec, cfg, MASK, TB, listener=log)
    summaries = drive(dec, prompts)
    if mode == "ar":  # rows of unequal length are prefilled one at a time (ar.py): their logits as one batch's
        rec.logits[:len(prompts)] = [torch.cat(rec.logits[:len(prompts)])]
    # one forward a step here (AR, or the block cache: every row's window is a whole block), every live row in it: a
    # row's event with nfe k comes from forward k - 1, at the row's place in that forward's batch, which is the order
    # the forward's events were emitted in (a finished row's place is taken by the batch's last row, KVCache.compact)
    forwards = {i: sum(e.kind != "done" for e in log.by_row[i]) for i in range(len(prompts))}
    assert len(rec.logits) == max(forwards.values())
    live = [e for e in log.order if e.kind != "done"]
    place = {id(e): [x.row for x in live if x.nfe == e.nfe].index(e.row) for e in live}
    drawn = shown = 0
    for e in log.order:
        if e.kind == "done":
            continue
        b = place[id(e)]
        logits = rec.logits[e.nfe - 1][b].float().clone()
        logits[..., MASK] = float("-inf")
        if mode == "ar":
            (t,) = e.committed
            assert float(nucleus(logits[-1], 0.8, 0.9)[t.id]) == pytest.approx(t.conf, rel=1e-4)
            drawn += 1
            continue
        lo = e.block * 8 + max(e.sub_block, 0) * 4 - len(prompts[e.row])  # the active sub-block, answer-relative
        for j, t in enumerate(sorted(e.committed + e.masked, key=lambda t: t.pos)):  # the forward's targets, in order
            if e.kind == "commit" or t.pos < lo + 4:  # drawn from the row's generator
                assert float(nucleus(logits[j], 0.8, 0.9)[t.id]) == pytest.approx(t.conf, rel=1e-4), (e, j)
                drawn += 1
            else:  # the heatmap past the sub-block: shown, not drawn
                p = torch.softmax(logits[j].double() / 0.8, -1)
                assert (t.id, t.conf) == (int(p.argmax()), pytest.approx(float(p.max()), rel=1e-4)), (e, j)
                shown += 1
    assert drawn > 20 and (mode == "ar" or shown > 5)
    greedy = drive(decoder_for(model, replace(cfg, temperature=0.0), MASK, TB), prompts)
    assert [s.token_ids for s in summaries] != [s.token_ids for s in greedy], "sampling changes something"
    for i, p in enumerate(prompts):
        alone = decoder_for(model, cfg, MASK, TB)
        [s] = drive(alone, [p], alone.new_rows([p], seeds=[11 + i]))
        assert s.token_ids == summaries[i].token_ids, f"row {i} alone"
    watched = drive(decoder_for(model, cfg, MASK, TB), prompts)  # no listener: no heatmap
    assert [s.token_ids for s in watched] == [s.token_ids for s in summaries]
    unseeded = replace(cfg, seed=None)
    a, c = (drive(decoder_for(model, unseeded, MASK, TB), prompts) for _ in range(2))
    assert [s.token_ids for s in a] != [s.token_ids for s in c], "an unseeded decode draws fresh numbers"


# ------------------------------------------------------------------ repetition knobs, per row
KNOBS = [Penalties(), Penalties(repetition=1.5), Penalties(frequency=0.8, presence=0.6), Penalties(no_repeat_ngram=1),
         Penalties(repetition=1.3, no_repeat_ngram=2)]  # n = 1: no token of prompt or answer twice (bans bite)


def test_ar_rows_with_different_knobs_equal_greedy_with_the_knobs():
    seed = 0
    model, prompts = tiny(seed), prompts_of(seed, (6, 9, 4, 12, 7))
    stops = {frequent(seed)[0]}
    cfg = DecodeConfig(mode="ar", max_new_tokens=14, stop_token_ids=tuple(stops)).validate()
    log = Log()
    dec = decoder_for(model, cfg, MASK, TB, listener=log)
    summaries = drive(dec, prompts, dec.new_rows(prompts, penalties=KNOBS))
    check_ar(log, summaries, model, prompts, [14] * 5, stops, KNOBS)
    plain = [ar_want(model, p, 14, stops) for p in prompts]
    assert sum(s.token_ids != w for s, w in zip(summaries, plain)) >= 3, "the knobs change the answers"


def repeats(ids: list[int], n: int, start: int) -> list[tuple[int, ...]]:
    """n-grams of ids that end at or after `start` (an answer position) and occur earlier too."""
    seen, out = set(), []
    for i in range(len(ids) - n + 1):
        g = tuple(ids[i:i + n])
        if g in seen and i + n > start:
            out.append(g)
        seen.add(g)
    return out


@pytest.mark.parametrize("cache", ["block", "dual"])
def test_diffusion_rows_with_different_knobs_decode_as_alone(cache):
    """Each row's knobs steer only that row (batched == alone, every event), they change answers, and
    no_repeat_ngram_size holds over prompt + answer even for tokens committed in one step."""
    seed = 2
    model, prompts = tiny(seed), prompts_of(seed, (6, 9, 4, 12, 7))
    cfg = diffusion_cfg(seed, cache, 8, 4, threshold=0.3, max_new=16)
    log = Log()
    dec = decoder_for(model, cfg, MASK, TB, listener=log)
    summaries = drive(dec, prompts, dec.new_rows(prompts, penalties=KNOBS))
    plain = drive(decoder_for(model, cfg, MASK, TB), prompts)
    assert sum(s.token_ids != p.token_ids for s, p in zip(summaries, plain)) >= 3, "the knobs change the answers"
    for i, (p, pen) in enumerate(zip(prompts, KNOBS)):
        one = Log()
        alone = decoder_for(model, cfg, MASK, TB, listener=one)
        [s] = drive(alone, [p], alone.new_rows([p], penalties=[pen]))
        assert s.token_ids == summaries[i].token_ids
        assert [seen(e) for e in one.by_row[0]] == [seen(e) for e in log.by_row[i]], f"row {i}"
        if pen.no_repeat_ngram:
            assert repeats(p + s.token_ids, pen.no_repeat_ngram, len(p)) == [], f"row {i}"
        check_summary(s, one.by_row[0], set(cfg.stop_token_ids))
    default = decoder_for(model, cfg, MASK, TB)
    assert all(r.pen == Penalties() and r.ngrams is None for r in default.new_rows(prompts))
    knobbed = decoder_for(model, replace(cfg, repetition_penalty=1.2, no_repeat_ngram_size=2), MASK, TB)
    assert all(r.pen == Penalties(repetition=1.2, no_repeat_ngram=2) and r.ngrams is not None
               for r in knobbed.new_rows(prompts))


# ------------------------------------------------------------------ the scheduler's API: join, cancel, chunks
class seen:
    """What an event shows; equal to another's with confidences within 1e-5 (a batch's matmuls round differently
    from a row's alone)."""

    def __init__(self, e) -> None:
        toks = lambda ts: [(t.pos, t.id, t.text) for t in ts]  # noqa: E731
        self.what = (e.kind, e.block, e.sub_block, toks(e.committed), toks(e.masked), e.text_delta)
        self.confs = [t.conf for t in e.committed + e.masked]

    def __eq__(self, other) -> bool:
        return self.what == other.what and self.confs == pytest.approx(other.confs, abs=1e-5)

    def __repr__(self) -> str:
        return repr((self.what, self.confs))


def alone_events(model, cfg, prompt, cap):
    log = Log()
    dec = decoder_for(model, cfg, MASK, TB, listener=log)
    [s] = drive(dec, [prompt], dec.new_rows([prompt], max_new=[cap]))
    return s, [seen(e) for e in log.by_row[0]]


@pytest.mark.parametrize("mode,cache,stepper", [("diffusion", "dual", False), ("diffusion", "block", False),
                                                ("diffusion", "none", False), ("ar", "block", False),
                                                ("diffusion", "dual", True), ("ar", "block", True)])
def test_rows_joining_a_running_batch_and_a_row_cancelled_alone_decode_as_alone(mode, cache, stepper):
    """Two rows decode; after 2 steps one is cancelled alone, then two more join (their own indices, answer caps and
    listeners); every row's events are its events alone (the cancelled one's up to the cancel), the cancelled row
    ends 'cancelled' with its committed prefix."""
    seed = 1
    model = tiny(seed)
    first, later = prompts_of(seed, (23, 11)), prompts_of(seed, (8, 3))  # row 0's room (56) is longer than 2's, 3's (32)
    cfg = DecodeConfig(mode=mode, block_size=8, sub_block_size=4, threshold=0.6, cache=cache, max_new_tokens=18,
                       stop_token_ids=(frequent(seed)[1],)).validate()
    log, mine = Log(), Log()
    step = StaticStepper(model, graphs=False, quantum=32) if stepper else None
    dec = decoder_for(model, cfg, MASK, TB, listener=log, stepper=step, joins=stepper)
    flag = threading.Event()
    rows_a = dec.new_rows(first, cancels=[None, flag])
    rows_b = dec.new_rows(later, indices=[2, 3], max_new=[12, 18], listeners=[mine, None])
    with torch.inference_mode():
        batch = dec.merge(None, dec.prefill(first, rows_a))
        for _ in range(2):
            batch = dec.step(batch)
        flag.set()
        batch = dec.drop_cancelled(batch)
        assert [r.index for r in batch.rows] == [0]
        if not stepper:
            assert dec.merge(batch, Batch([], batch.seq[:0], None)) is batch
        batch = dec.merge(batch, dec.prefill(later, rows_b))
        assert [r.index for r in batch.rows] == [0, 2, 3]
        for _ in range(200):
            if not batch.rows:
                break
            batch = dec.step(batch)
        assert not batch.rows
    events = {0: log.by_row[0], 1: log.by_row[1], 2: mine.by_row[2], 3: log.by_row[3]}
    assert 2 not in log.by_row, "a row's own listener replaces the decoder's"
    for i, (p, cap, row) in enumerate(zip(first + later, (18, 18, 12, 18), rows_a + rows_b)):
        s, want = alone_events(model, cfg, p, cap)
        got = [seen(e) for e in events[i]]
        assert all(e.row == i for e in events[i])
        if i == 1 and row.summary.stop_reason == "cancelled":
            assert got[-1].what[0] == "done" and got[:-1] == want[:len(got) - 1], f"row {i}"
            assert row.summary.token_ids == s.token_ids[:len(row.summary.token_ids)]
            assert row.summary.nfe == 3 and len(got) == 4
        else:
            assert got == want, f"row {i}"
            assert row.summary.token_ids == s.token_ids and row.summary.stop_reason == s.stop_reason
    assert rows_a[1].summary.stop_reason == "cancelled", "row 1 was still decoding when it was cancelled"


def test_a_cancelled_decode_ends_every_row_and_merging_nothing():
    seed = 0
    model, prompts = tiny(seed), prompts_of(seed, (5, 9, 12))
    cfg = diffusion_cfg(seed, "block", 8, 4, max_new=30, threshold=1.0)
    flag = threading.Event()
    log = Log()

    def listen(e):
        log(e)
        if e.nfe == 3:
            flag.set()

    summaries = decoder_for(model, cfg, MASK, TB, listener=listen, cancel=flag).run(prompts)
    assert [s.stop_reason for s in summaries] == ["cancelled"] * 3 and [s.nfe for s in summaries] == [3] * 3
    for i, s in enumerate(summaries):
        check_summary(s, log.by_row[i], set(cfg.stop_token_ids))
    dec = decoder_for(model, cfg, MASK, TB)
    with torch.inference_mode():
        b = dec.prefill(prompts[:1], dec.new_rows(prompts[:1]))
        empty = Batch([], b.seq[:0], None)
        assert dec.merge(None, b) is b and dec.merge(empty, b) is b and dec.merge(b, empty) is b
        assert dec.drop_cancelled(b) is b  # no row has a flag
        static = decoder_for(model, cfg, MASK, TB, stepper=StaticStepper(model, graphs=False, quantum=32))
        with pytest.raises(ValueError, match=r"^merge: this decoder's prefills write the stepper's storage; build it "
                                             r"with joins=True$"):
            static.merge(None, static.prefill(prompts[:1], static.new_rows(prompts[:1])))


@pytest.mark.parametrize("mode,cache,length", [("ar", "block", 37), ("diffusion", "block", 37),
                                               ("diffusion", "dual", 40), ("diffusion", "block", 33)])
def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefill(mode, cache, length):
    seed = 2
    model, prompt = tiny(seed), prompts_of(seed, (length,))[0]
    cfg = DecodeConfig(mode=mode, block_size=8, sub_block_size=4, threshold=0.6, cache=cache, max_new_tokens=12,
                       stop_token_ids=()).validate()
    s, want = alone_events(model, cfg, prompt, 12)
    log = Log()
    dec = decoder_for(model, cfg, MASK, TB, listener=log)
    rows = dec.new_rows([prompt])
    limit = dec.chunk_limit(rows)
    assert limit == (length - 1 if mode == "ar" else (length - 1) // 8 * 8)
    with torch.inference_mode():
        batch = dec.open_batch([prompt], rows)
        ends = [e for e in (8, 16, 24, 32) if e <= limit]
        done = 0
        for end in ends:
            dec.prefill_chunk(batch, done, end)
            done = end
        batch = dec.prefill([prompt], rows, batch=batch, cached=done)
        while batch.rows:
            batch = dec.step(batch)
    got = [seen(e) for e in log.by_row[0]]
    assert got == want and rows[0].summary.token_ids == s.token_ids and rows[0].summary.nfe == s.nfe
    with torch.inference_mode():
        for start, end in ((0, 4), (4, 8), (0, limit // 8 * 8 + 8)) if mode == "diffusion" else ((0, limit + 1),):
            with pytest.raises(ValueError) as e:
                dec.prefill_chunk(dec.open_batch([prompt], rows), start, end)
            assert str(e.value) == (f"prefill_chunk: [{start}, {end}) is not a whole-block piece of every row's prompt "
                                    f"up to {limit} (block {dec.block}; a cache is needed)")
        if mode == "diffusion":
            none = decoder_for(model, replace(cfg, cache="none"), MASK, TB)
            with pytest.raises(ValueError, match="a cache is needed"):
                none.prefill_chunk(none.open_batch([prompt], none.new_rows([prompt])), 0, 8)


@pytest.mark.parametrize("mode,cache", [("diffusion", "block"), ("diffusion", "dual"), ("ar", "block")])
def test_the_static_stepper_decodes_as_the_model_forward(mode, cache):
    """engine/static.py's fixed-shape steps (CUDA graphs on GPUs, eager here): every event as CausalLM.forward."""
    seed = 0
    model, prompts = tiny(seed), prompts_of(seed, (5, 8, 13, 19))
    cfg = DecodeConfig(mode=mode, block_size=8, sub_block_size=4, threshold=0.6, cache=cache, max_new_tokens=16,
                       stop_token_ids=(frequent(seed)[0],)).validate()
    logs = []
    for stepper in (None, StaticStepper(model, graphs=False, quantum=32)):
        logs.append(Log())
        drive(decoder_for(model, cfg, MASK, TB, listener=logs[-1], stepper=stepper), prompts)
    for i in range(len(prompts)):
        a, b = ([(e.kind, e.block, e.sub_block, [(t.pos, t.id) for t in e.committed],
                  [(t.pos, t.id) for t in e.masked]) for e in lg.by_row[i]] for lg in logs)
        assert a == b, f"row {i}"


# ------------------------------------------------------------------ pieces the decodes above reach too rarely
def test_a_steps_commits_are_accepted_most_confident_first_without_repeating_an_ngram():
    """no_repeat_ngram_size inside one step: commits in order of confidence; one that forms a repeated n-gram with
    those already accepted stays masked; the most confident is always accepted (its bans made it safe)."""
    from engine.penalties import NgramIndex

    def keep(qs, toks, confs, prompt=(1, 2)):
        r = Row(0, len(prompt), 8, None, [None] * 6, ngrams=NgramIndex(2, list(prompt), 8))
        out = DiffusionDecoder._no_new_repeats(r, qs, toks, confs, [True] * len(qs))
        return out, r.ngrams.tok

    # (1, 2) is the prompt's bigram: 1 at 2 beside 2 at 3 repeats it; 7 at 5 forms nothing
    assert keep([2, 3, 5], [1, 2, 7], [0.7, 0.9, 0.5]) == ([False, True, True], [1, 2, None, 2, None, 7, None, None])
    assert keep([2, 3, 5], [1, 2, 7], [0.9, 0.7, 0.5]) == ([True, False, True], [1, 2, 1, None, None, 7, None, None])
    assert keep([2, 3, 5], [1, 2, 7], [0.5, 0.9, 0.7]) == ([False, True, True], [1, 2, None, 2, None, 7, None, None])
    # the most confident is accepted even where it would repeat an n-gram: (1, 2) again at 2..3
    assert keep([3], [2], [0.9], prompt=(1, 2, 1)) == ([True], [1, 2, 1, 2, None, None, None, None])
    r = Row(0, 2, 8, None, [None] * 6, ngrams=NgramIndex(2, [1, 2], 8))
    assert DiffusionDecoder._no_new_repeats(r, [2, 3], [1, 2], [0.9, 0.7], [False, True]) == [False, True]


def test_the_answer_so_far_ends_at_the_earliest_stop_token():
    """What the repetition penalties count: committed answer tokens in any order (gaps skipped) through the
    earliest committed stop token, never past it."""
    r = Row(0, 10, 16, None, [5, None, 7, 99, 9, None])
    assert Decoder._answer_so_far(r) == [5, 7, 99, 9]
    r.stop_at = 13  # the 99 at answer position 3
    assert Decoder._answer_so_far(r) == [5, 7, 99]
    r.stop_at = 10
    assert Decoder._answer_so_far(r) == [5]


def test_run_passes_each_rows_knobs():
    seed = 2
    model, prompts = tiny(seed), prompts_of(seed, (6, 9))
    for mode in ("ar", "diffusion"):
        cfg = replace(diffusion_cfg(seed, "block", 8, 4, threshold=0.3, max_new=12), mode=mode)
        knobs = [Penalties(frequency=2.0, presence=2.0), Penalties(repetition=2.0)]
        got = decoder_for(model, cfg, MASK, TB).run(prompts, penalties=knobs)
        dec = decoder_for(model, cfg, MASK, TB)
        want = drive(dec, prompts, dec.new_rows(prompts, penalties=knobs))
        plain = decoder_for(model, cfg, MASK, TB).run(prompts)
        assert [s.token_ids for s in got] == [s.token_ids for s in want] != [s.token_ids for s in plain], mode


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_a_prefill_chunk_is_one_forward_of_its_positions_with_one_logit_row(mode, monkeypatch):
    """prefill_chunk writes K/V of [start, end) attending to keys < end and reads no logits (one row, unused); the
    final prefill then covers only the rest of the prompt."""
    seed = 2
    model, prompt = tiny(seed), prompts_of(seed, (37,))[0]
    cfg = DecodeConfig(mode=mode, block_size=8, sub_block_size=4, cache="block", max_new_tokens=4,
                       stop_token_ids=()).validate()
    calls = []
    real = type(model).forward

    def spy(self, ids, pos, cache=None, **kw):
        out = real(self, ids, pos, cache, **kw)
        calls.append((tuple(ids.shape), int(pos[0, 0]), kw.get("start"), kw.get("kv_len"), tuple(out.shape[:2])))
        return out

    monkeypatch.setattr(type(model), "forward", spy)
    dec = decoder_for(model, cfg, MASK, TB)
    rows = dec.new_rows([prompt])
    with torch.inference_mode():
        batch = dec.open_batch([prompt], rows)
        dec.prefill_chunk(batch, 0, 16)
        dec.prefill_chunk(batch, 16, 32)
        dec.prefill([prompt], rows, batch=batch, cached=32)
    width = 5 if mode == "ar" else 8  # AR: the prompt's last 5 tokens; diffusion: its partial block 32..40
    assert calls[:3] == [((1, 16), 0, 0, 16, (1, 1)), ((1, 16), 16, 16, 32, (1, 1)),
                         ((1, width), 32, 32, 37 if mode == "ar" else 40, (1, 1 if mode == "ar" else 3))]


def test_ar_forwards_take_the_shared_start_path_only_when_rows_agree(monkeypatch):
    """The AR forwards' arguments: rows at one position share a slice write (start) and no mask (causal prefill);
    rows of unequal prompt lengths are prefilled one at a time, then step with per-row causal key masks."""
    seed = 2
    model = tiny(seed)
    calls = []
    real = type(model).forward

    def spy(self, ids, pos, cache=None, **kw):
        out = real(self, ids, pos, cache, **kw)
        if kw.get("cache_rows") is not None:  # a row prefilled in place: its inner forward is recorded
            return out
        m = kw.get("mask")
        calls.append((tuple(ids.shape), kw.get("start"), kw.get("kv_len"), kw.get("causal"),
                      None if m is None else tuple(m.shape), tuple(out.shape[:2])))
        return out

    monkeypatch.setattr(type(model), "forward", spy)
    cfg = DecodeConfig(mode="ar", max_new_tokens=3, stop_token_ids=()).validate()
    head = prompts_of(seed, (16,))[0]
    for prompts, want in (
            ([[1, 2, 3], [4, 5, 6]], [((2, 3), 0, 3, True, None, (2, 1)), ((2, 1), 3, 4, None, None, (2, 1)),
                                      ((2, 1), 4, 5, None, None, (2, 1))]),
            ([[1, 2, 3], [4, 5]], [((1, 3), 0, 3, True, None, (1, 1)), ((1, 2), 0, 2, True, None, (1, 1)),
                                   ((2, 1), None, 4, None, (2, 1, 1, 4), (2, 1)),
                                   ((2, 1), None, 5, None, (2, 1, 1, 5), (2, 1))]),
            ([head + [1], head + [2, 3]], [((1, 17), 0, 17, True, None, (1, 1)),
                                           ((1, 18), 0, 18, True, None, (1, 1))])):
        calls.clear()
        drive(decoder_for(model, cfg, MASK, TB), prompts)
        assert calls[:len(want)] == want, prompts
