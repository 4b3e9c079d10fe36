"""Self-instruct data at scale: Magpie instructions + training prompts, answered greedily by the AR base.

Magpie (Xu et al., 2024): an instruct model given only its chat template's opening up to the user turn
(`...<|im_start|>user\n`) writes a plausible user request; sampled at temperature ~1 it gives diverse
instructions with no seed data. They join the hand-written `training/data/prompts.jsonl`, are
deduplicated and held out from `bench/data/` by the rule the training prompts already follow
(training/data/README.md, `data_prompts.EvalFilter`), and the AR base answers them (greedy, the engine's
AR mode, large batches; CUDA when present). The answers are stored as token ids, so 2e7 answer tokens
fit the 16 MiB-per-file limit of what comes back from a GPU machine.

Directory layout (every step resumable and idempotent):
  magpie.jsonl     one line per sampling round {"round", "seed", "samples": [{"text", "stopped"}]}
  prompts.jsonl    the deduplicated, filtered prompt list {"prompt", "source"} (rebuilt from the above)
  shard-NNNNN.npz  answered prompts: keys, sources, prompt/answer lengths, stopped flags, token ids
  manifest.json    counts, generation speed, the filter rules, the shards
Work already done is found by content (a hash of each prompt in the shards), not by position, so
shards merged for transport (`gpu_block.stage_data`) or copied back from another machine count as done.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.weights import MASK_TOKEN

from .data_prompts import EvalFilter, load_excluded_prompts, normalise_prompt
from .options import opt
from .shards import SOURCES, answered_keys, make_shard, shard_paths, summarize

FORMAT = "fastdllm-selfinstruct-v1"
MARKUP = ("<|im_start|>", "<|im_end|>", MASK_TOKEN, "<|endoftext|>")
FILTER_RULES = {
    "magpie_kept_if": "the sampled user turn ended with the stop token, has 3 to 150 words, and no chat markup",
    "dedup": "exact match after case-folding and collapsing whitespace (data_prompts.normalise_prompt); "
             "first occurrence kept, training prompts before Magpie samples",
    "held_out": "bench/data/eval_short.jsonl, long_answer.jsonl, long_checkable.jsonl and long_checkable_b.jsonl: exact match or near duplicate by "
                "content-word overlap (>= 75% of an eval prompt's content words, and > 50% of the "
                "candidate's own), data_prompts.EvalFilter, the rule training/data/README.md documents",
}


@dataclass(slots=True)
class SelfInstructConfig:
    out: Path
    # hand-written prompts; None: Magpie only (the CLI's default and its "none" are read in training/__main__.py)
    prompts: Path | None = None
    limit_prompts: int | None = field(default=None, metadata=opt("use only the first N hand-written prompts"))
    magpie: int = field(default=0, metadata=opt("Magpie instructions to have sampled in total (0: none)"))
    magpie_batch: int = field(default=256, metadata=opt("instructions sampled together (one round)"))
    magpie_max_new_tokens: int = field(default=96, metadata=opt("instruction length cap (longer ones are dropped)"))
    magpie_temperature: float = field(default=1.0, metadata=opt("sampling temperature of instructions"))
    magpie_top_p: float = field(default=1.0, metadata=opt("top-p of instructions"))
    answer_batch: int = field(default=256, metadata=opt("prompts answered together (greedy AR)", flag="batch-size"))
    max_new_tokens: int = field(default=256, metadata=opt("answer length cap"))
    shard_examples: int = field(default=8192, metadata=opt("answers per shard file (what a kill can lose)"))
    time_budget_s: float | None = field(default=None, metadata=opt(
        "start no new batch after this many seconds (Magpie sampling: half of it at most)", flag="time-budget"))
    model: str = field(default="bundled-base", metadata=opt("engine model spec of the AR base (without the adapter)"))
    seed: int = field(default=0, metadata=opt("seeds the Magpie rounds"))

    def validate(self) -> "SelfInstructConfig":
        for name in ("magpie_batch", "answer_batch", "magpie_max_new_tokens", "max_new_tokens", "shard_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")
        if self.magpie < 0:
            raise ValueError(f"magpie: must be >= 0 (got {self.magpie})")
        if not 0.0 < self.magpie_temperature <= 2.0:
            raise ValueError(f"magpie_temperature: must be in (0, 2] (got {self.magpie_temperature})")
        if not 0.0 < self.magpie_top_p <= 1.0:
            raise ValueError(f"magpie_top_p: must be in (0, 1] (got {self.magpie_top_p})")
        if self.prompts is None and self.magpie == 0:
            raise ValueError("prompts/magpie: give hand-written prompts, Magpie samples, or both")
        return self


def prompt_key(text: str) -> int:
    """64-bit content key of a prompt (the dedup key, hashed), stored per answered example."""
    return int.from_bytes(hashlib.blake2b(normalise_prompt(text).encode(), digest_size=8).digest(), "little")


# ------------------------------------------------------------------------------------------ Magpie
def magpie_prefix(tok) -> str:
    """The chat template up to where the first user turn's text starts (its default system turn included)."""
    sentinel = "\x00MAGPIE\x00"
    text = tok.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    return text[:text.index(sentinel)]


def read_rounds(path: Path) -> list[dict]:
    """Rounds written so far; a line cut by a kill is ignored (that round is redrawn)."""
    if not path.exists():
        return []
    rounds = []
    # split on "\n" only: str.splitlines() also splits at U+2028/U+2029, which Magpie samples contain (written
    # unescaped), and lost those rounds (redrawn on the next run: block 1 drew 2,048 samples twice)
    for line in path.read_text().split("\n"):
        if not line.strip():
            continue
        try:
            rounds.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rounds


def draw_magpie(engine, cfg: SelfInstructConfig, deadline: float) -> dict:
    """Sample rounds until cfg.magpie samples exist; round r's seeds follow from (seed, r), so reruns are no-ops."""
    path = cfg.out / "magpie.jsonl"
    rounds = read_rounds(path)
    done = {r["round"] for r in rounds}
    have = sum(len(r["samples"]) for r in rounds)
    prefix = engine.encode(magpie_prefix(engine.lm.tokenizer))
    stop = set(engine.lm.stop_token_ids)
    t0, tokens, drawn = time.perf_counter(), 0, 0
    r = 0
    with path.open("a") as f:
        while have < cfg.magpie and time.perf_counter() < deadline:
            if r in done:
                r += 1
                continue
            n = min(cfg.magpie_batch, cfg.magpie - have)
            # row i of the round samples with seed + i (engine: one generator per row), so rounds sit magpie_batch
            # seeds apart and no two rows of any rounds share a seed
            seed = (cfg.seed * 1_000_003 + r) * cfg.magpie_batch
            dcfg = engine.decode_config(mode="ar", max_new_tokens=cfg.magpie_max_new_tokens, seed=seed,
                                        temperature=cfg.magpie_temperature, top_p=cfg.magpie_top_p)
            samples = []
            for res in engine.generate_ids([prefix] * n, dcfg, record=False):
                ids = [t for t in res.summary.token_ids if t not in stop]
                samples.append({"text": engine.lm.tokenizer.decode(ids, skip_special_tokens=False).strip(),
                                "stopped": res.summary.stop_reason == "stop_token"})
                tokens += res.summary.answer_tokens
            f.write(json.dumps({"round": r, "seed": seed, "samples": samples}, ensure_ascii=False) + "\n")
            f.flush()
            have += n
            drawn += n
            r += 1
    dt = time.perf_counter() - t0
    return {"drawn": drawn, "tokens": tokens, "seconds": round(dt, 2)}


def magpie_ok(s: dict) -> bool:
    """FILTER_RULES['magpie_kept_if']."""
    words = len(s["text"].split())
    return s["stopped"] and 3 <= words <= 150 and not any(m in s["text"] for m in MARKUP)


# ------------------------------------------------------------------------------------------ prompts
def build_prompts(cfg: SelfInstructConfig) -> tuple[list[tuple[str, str]], dict]:
    """(prompt, source) in a fixed order: hand-written first, then Magpie rounds; deduped and held out."""
    cands: list[tuple[str, str]] = []
    counts = {"train_prompts": 0, "magpie_samples": 0, "magpie_rejected": 0}
    if cfg.prompts is not None:
        from .distill import read_prompts

        hand = read_prompts(cfg.prompts)[:cfg.limit_prompts]
        counts["train_prompts"] = len(hand)
        cands += [(p, "train") for p in hand]
    for rnd in sorted(read_rounds(cfg.out / "magpie.jsonl"), key=lambda r: r["round"]):
        for s in rnd["samples"]:
            counts["magpie_samples"] += 1
            if magpie_ok(s):
                cands.append((s["text"], "magpie"))
            else:
                counts["magpie_rejected"] += 1
    held_out = EvalFilter(load_excluded_prompts())
    seen: set[str] = set()
    kept: list[tuple[str, str]] = []
    counts |= {"duplicates": 0, "held_out_bench": 0}
    for p, src in cands:
        key = normalise_prompt(p)
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        if held_out.rejects(p):
            counts["held_out_bench"] += 1
            continue
        kept.append((p, src))
    counts["prompts"] = len(kept)
    counts["prompts_magpie"] = sum(src == "magpie" for _, src in kept)
    return kept, counts


# ------------------------------------------------------------------------------------------ answers
def answer(engine, cfg: SelfInstructConfig, prompts: list[tuple[str, str]], deadline: float) -> dict:
    """Greedy AR answers for prompts not yet in a shard; a shard every cfg.shard_examples answers."""
    from .distill import bucket_by_length

    done = answered_keys(cfg.out)
    todo = [(p, s) for p, s in prompts if prompt_key(p) not in done]
    src_of = dict(todo)
    order = bucket_by_length([p for p, _ in todo], engine.encode, cfg.answer_batch * 8)
    dcfg = engine.decode_config(mode="ar", max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    vocab = engine.lm.cfg.vocab_size
    n_shard = max((int(p.stem.split("-")[1]) for p in shard_paths(cfg.out) if p.stem.split("-")[1].isdigit()),
                  default=-1) + 1
    rows: list[tuple[int, int, list[int], list[int], bool]] = []
    t0, tokens, written, shards = time.perf_counter(), 0, 0, []

    def flush() -> None:
        nonlocal rows, n_shard
        if rows:
            path = cfg.out / f"shard-{n_shard:05d}.npz"
            make_shard(rows, vocab).save(path)
            shards.append(path.name)
            n_shard += 1
            rows = []

    for i in range(0, len(order), cfg.answer_batch):
        if time.perf_counter() >= deadline:
            break
        batch = order[i:i + cfg.answer_batch]
        ids = [engine.encode(engine.chat_prompt([{"role": "user", "content": p}])) for p in batch]
        for p, pid, res in zip(batch, ids, engine.generate_ids(ids, dcfg, record=False)):
            s = res.summary
            rows.append((prompt_key(p), SOURCES.index(src_of[p]), pid, list(s.token_ids), s.stop_reason == "stop_token"))
            tokens += s.answer_tokens
        written += len(batch)
        if len(rows) >= cfg.shard_examples:
            flush()
    flush()
    dt = time.perf_counter() - t0
    return {"todo": len(todo), "answered": written, "answer_tokens": tokens, "seconds": round(dt, 2),
            "tokens_per_second": round(tokens / dt, 1) if dt > 0 else 0.0, "shards": shards,
            "cuda_graphs": engine.graphs_report()}  # block 1 generated without them (a capture bug, fixed since)


# ------------------------------------------------------------------------------------------ manifest
def run(cfg: SelfInstructConfig) -> dict:
    """Magpie rounds, then the prompt list, then answers; updates and returns manifest.json."""
    from engine import Engine

    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    deadline = t_start + cfg.time_budget_s if cfg.time_budget_s is not None else float("inf")
    engine = Engine.load(cfg.model)
    mpath = cfg.out / "manifest.json"
    manifest = json.loads(mpath.read_text()) if mpath.exists() else {
        "format": FORMAT, "runs": [], "magpie_totals": {"tokens": 0, "seconds": 0.0},
        "answer_totals": {"answer_tokens": 0, "seconds": 0.0}}
    # Magpie gets at most half the budget, so a slower machine than planned still answers prompts
    magpie_deadline = t_start + cfg.time_budget_s / 2 if cfg.time_budget_s is not None else deadline
    mag = draw_magpie(engine, cfg, magpie_deadline) if cfg.magpie else {"drawn": 0, "tokens": 0, "seconds": 0.0}
    prompts, counts = build_prompts(cfg)
    with (cfg.out / "prompts.jsonl").open("w") as f:
        for p, src in prompts:
            f.write(json.dumps({"prompt": p, "source": src}, ensure_ascii=False) + "\n")
    ans = answer(engine, cfg, prompts, deadline)
    mt, at = manifest["magpie_totals"], manifest["answer_totals"]
    mt["tokens"] += mag["tokens"]
    mt["seconds"] = round(mt["seconds"] + mag["seconds"], 2)
    at["answer_tokens"] += ans["answer_tokens"]
    at["seconds"] = round(at["seconds"] + ans["seconds"], 2)
    for tot, key in ((mt, "tokens"), (at, "answer_tokens")):
        tot["tokens_per_second"] = round(tot[key] / tot["seconds"], 1) if tot["seconds"] else 0.0
    lm = engine.lm
    manifest |= {
        "model": cfg.model, "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""),
        "vocab_size": lm.cfg.vocab_size, "magpie_prefix": magpie_prefix(lm.tokenizer),
        "filters": FILTER_RULES, "counts": counts, **summarize(cfg.out),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
    }
    manifest["runs"].append({"magpie": mag, "answers": {k: v for k, v in ans.items() if k != "shards"},
                             "new_shards": ans["shards"], "seconds": round(time.perf_counter() - t_start, 2)})
    tmp = mpath.with_name("manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    os.replace(tmp, mpath)
    return manifest
