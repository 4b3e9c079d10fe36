"""Repetition knobs on long answers (issue 21, part 4): which setting makes the dLLM finish without looping, and
what it costs in tokens per forward.

For each setting (diffusion at the engine defaults, then one knob at a time; the AR base at its defaults as the
reference), every prompt is decoded alone, greedy, as the studio does, and judged by engine/finish.py: stop rate
(ended with its stop token before the cap), loop rate (finish.is_looping), mean answer length, and tokens per
forward over all answers and over complete answers only (stopped and not looping), since a loop is easy to
predict several tokens at a time. Results are written after every setting, so a long run can be read part-way.

    FASTDLLM_THREADS=1 python -m bench penalties --limit 16 --max-new-tokens 256 --out bench/results/penalties_sweep
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from .common import environment, load_engine, setup_torch, table, write_json

DATA = Path(__file__).parent / "data" / "long_answer.jsonl"
# one knob at a time, at the values people use (transformers/vLLM docs: repetition 1.1-1.3; OpenAI: 0.1-1)
DEFAULT_SETTINGS = ("ar; default; repetition_penalty=1.1; repetition_penalty=1.2; repetition_penalty=1.3; "
                    "no_repeat_ngram_size=3; no_repeat_ngram_size=4; frequency_penalty=0.3; frequency_penalty=0.5; "
                    "presence_penalty=0.5")
NUMERIC = {"repetition_penalty": float, "frequency_penalty": float, "presence_penalty": float,
           "no_repeat_ngram_size": int, "threshold": float, "max_new_tokens": int, "block_size": int,
           "sub_block_size": int}


def parse_settings(text: str) -> list[tuple[str, dict[str, Any]]]:
    """'ar; default; repetition_penalty=1.2, no_repeat_ngram_size=3' -> [(label, DecodeConfig overrides)]."""
    out = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        if part in ("ar", "default"):
            out.append((part, {"mode": "ar"} if part == "ar" else {}))
            continue
        kw: dict[str, Any] = {}
        for item in part.split(","):
            k, _, v = item.strip().partition("=")
            if k not in NUMERIC or not v:
                raise SystemExit(f"--settings: {item!r} is not name=value with a name among {', '.join(NUMERIC)}")
            kw[k] = NUMERIC[k](v)
        out.append((part.replace(" ", ""), kw))
    return out


def pick_prompts(path: Path, limit: int) -> list[dict[str, str]]:
    """`limit` prompts spread evenly over the set's categories (the first ones of each), in file order."""
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    cats: dict[str, list[dict]] = {}
    for it in items:
        cats.setdefault(it.get("category", ""), []).append(it)
    per = -(-limit // len(cats))
    chosen = {id(it) for group in cats.values() for it in group[:per]}
    return [it for it in items if id(it) in chosen][:limit]


def summarise(answers: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(answers)
    done = [a for a in answers if a["complete"]]
    tpf = lambda xs: round(sum(a["tokens"] for a in xs) / max(sum(a["nfe"] for a in xs), 1), 3) if xs else None  # noqa: E731
    return {"n": n, "stop_rate": round(sum(a["stopped"] for a in answers) / n, 3),
            "loop_rate": round(sum(a["looping"] for a in answers) / n, 3),
            "complete_rate": round(len(done) / n, 3),
            "mean_tokens": round(sum(a["tokens"] for a in answers) / n, 1),
            "mean_repeat_share": round(sum(a["repeat_share"] for a in answers) / n, 3),
            "tpf_all": tpf(answers), "tpf_complete": tpf(done),
            "seconds": round(sum(a["seconds"] for a in answers), 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.finish import judge

    setup_torch(args.threads)
    eng = load_engine(args.model, args.dtype)
    prompts = pick_prompts(Path(args.data), args.limit)
    base = dict(block_size=32, sub_block_size=8, threshold=0.9, cache="dual", max_new_tokens=args.max_new_tokens)
    out = Path(args.out) if args.out else None
    report: dict[str, Any] = {"kind": "penalties_sweep", "doc": __doc__.strip(), "env": environment(eng),
                              "data": str(args.data), "prompt_ids": [p["id"] for p in prompts], "base": base,
                              "results": []}
    for label, kw in parse_settings(args.settings):
        cfg = eng.decode_config(**{**base, **kw})
        answers = []
        for p in prompts:
            t = time.perf_counter()
            [res] = eng.generate(p["prompt"], cfg, record=False)
            s = res.summary
            f = judge(s.text, s.stop_reason)
            answers.append({"id": p["id"], "tokens": s.answer_tokens, "nfe": s.nfe, "stop_reason": s.stop_reason,
                            "stopped": f.stopped, "looping": f.looping, "complete": f.complete,
                            "repeat_share": f.repeat_share, "seconds": round(time.perf_counter() - t, 2),
                            "text": s.text})
        row = {"setting": label, "mode": cfg.mode, "config": cfg.to_dict(), **summarise(answers), "answers": answers}
        report["results"].append(row)
        print(f"{label}: " + json.dumps({k: v for k, v in row.items() if k not in ("answers", "config")}), flush=True)
        if out is not None:
            write_json(out / "penalties.json", report)
    return report


COLUMNS = [("setting", "setting"), ("stop_rate", "stop"), ("loop_rate", "loop"), ("complete_rate", "complete"),
           ("mean_tokens", "mean tokens"), ("mean_repeat_share", "repeat 4-gram"), ("tpf_all", "tok/fwd all"),
           ("tpf_complete", "tok/fwd complete"), ("seconds", "seconds")]


def main(args: argparse.Namespace) -> int:
    report = run(args)
    text = table(report["results"], COLUMNS, nd=3)
    print(text)
    if args.out:
        (Path(args.out) / "penalties.md").write_text(text + "\n", encoding="utf-8")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("penalties", help="repetition knobs on long answers: stop, loop, length, tokens per forward",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=str(DATA), help="JSONL of {id, category, prompt}")
    p.add_argument("--limit", type=int, default=16, help="prompts, spread over the categories")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help="';'-separated: 'ar' (the AR base), 'default' (diffusion), or name=value[,name=value]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None, help="write DIR/penalties.json (after every setting) and DIR/penalties.md")
    p.set_defaults(func=main)
