"""Quality benchmark: accuracy of the AR base and of the dLLM across thresholds on a held-out short-answer set.

An answer is correct when any of the item's answers occurs in the output as a whole word or phrase,
ignoring case (grading/checker.py). Tokens per forward and tokens/s use the same accounting as the
throughput benchmark: answer tokens through the stop token, engine time only.

--agree-with REF compares every answer with a reference run's (its results.json; same item id, mode and threshold):
the share of greedy answers that are identical, e.g. of the default 4-bit path against FASTDLLM_WEIGHTS=fp32. A
fidelity measure of a weight or kernel path, next to accuracy, which can hide answers that moved both ways.

Long answers (bench/longform.py, issue 21): every mode, the AR base included, also decodes the checkable long set
(--checkable-set, on by default) and, with --long-set, the open-ended long-answer prompts: stop rate, loop rate,
mean length, tokens per forward over all answers and over complete ones only, and for the checkable set the share
right (complete, in order, stopped). --long-only skips the short set, so a training run can score a checkpoint
(--adapter) in minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from engine.runtime import Runtime

from .common import (DEFAULT_EVAL_SET, DEFAULT_PROMPTS, environment, load_engine, parse_list, progress, save_figures,
                     setup_torch, table, write_json)
from .longform import CHECKABLE_SET, long_chart, run_long_sets

SHORT_MAX_NEW_TOKENS = 64
LONG_MAX_NEW_TOKENS = 256  # the cap: room for a list or an essay to end, and for a loop to show


class Score:
    """Running totals of one (mode, threshold) over the eval set."""

    def __init__(self) -> None:
        self.correct = self.toks = self.nfe = 0
        self.secs = 0.0
        self.outputs: list[dict[str, Any]] = []

    def add(self, eng, chunk: list[dict[str, Any]], ids: list[list[int]], cfg) -> None:
        from grading.checker import is_correct

        res = eng.generate_ids(ids, cfg, record=False)
        self.secs += max(r.summary.seconds for r in res)
        for it, r in zip(chunk, res):
            s = r.summary
            ok = is_correct(s.text, it["answers"])
            self.correct += ok
            self.toks += s.answer_tokens
            self.nfe += s.nfe
            self.outputs.append({"id": it.get("id"), "correct": ok, "output": s.text,
                                 "answer_tokens": s.answer_tokens, "nfe": s.nfe})

    def result(self) -> dict[str, Any]:
        n = len(self.outputs)
        return {"accuracy": self.correct / n if n else 0.0, "correct": self.correct, "n": n,
                "answer_tokens": self.toks, "nfe": self.nfe,
                "tokens_per_forward": self.toks / self.nfe if self.nfe else 0.0, "seconds": self.secs,
                "tokens_per_second": self.toks / self.secs if self.secs > 0 else 0.0, "outputs": self.outputs}


def chart(results: list[dict[str, Any]]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    diff = sorted((r for r in results if r["mode"] == "diffusion"), key=lambda r: r["threshold"])
    xs = [r["threshold"] for r in diff]
    fig.add_trace(go.Scatter(name="dLLM accuracy", x=xs, y=[r["accuracy"] for r in diff], mode="lines+markers"),
                  secondary_y=False)
    fig.add_trace(go.Scatter(name="dLLM tokens per forward, short answers", x=xs, y=[r["tokens_per_forward"] for r in diff],
                             mode="lines+markers", line_dash="dash"), secondary_y=True)
    if diff and "long_tokens_per_forward" in diff[0]:
        fig.add_trace(go.Scatter(name="dLLM tokens per forward, long answers", x=xs,
                                 y=[r["long_tokens_per_forward"] for r in diff], mode="lines+markers",
                                 line_dash="dashdot"), secondary_y=True)
    for r in results:
        if r["mode"] == "ar":
            fig.add_hline(y=r["accuracy"], line_dash="dot", annotation_text=f"AR base accuracy {r['accuracy']:.3f}")
    fig.update_xaxes(title_text="threshold")
    fig.update_yaxes(title_text="accuracy", range=[0, 1], secondary_y=False)
    fig.update_yaxes(title_text="tokens per forward", rangemode="tozero", secondary_y=True)
    fig.update_layout(title="Accuracy (held-out short answers) and tokens per forward vs threshold", template="plotly_white")
    return fig


Reference = dict[tuple[str, float | None], dict[Any, str]]


def load_reference(path: str) -> Reference:
    """(mode, threshold) -> {item id: output} of an earlier `bench quality` results.json (--agree-with)."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        if report.get("kind") != "quality":
            raise ValueError(f"kind is {report.get('kind')!r}, not 'quality'")
        return {(r["mode"], r["threshold"]): {o["id"]: o["output"] for o in r["outputs"] if o["id"] is not None}
                for r in report["results"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"--agree-with: {path} is not a readable `bench quality` results.json ({e})") from None


def add_agreement(results: list[dict[str, Any]], ref: Reference, path: str) -> None:
    """Each result whose (mode, threshold) the reference has: answers equal to the reference's, over the items both
    ran (matched by id; items without one are not compared; the ids that differ are listed)."""
    for r in results:
        outs = ref.get((r["mode"], r["threshold"]))
        pairs = [(o["id"], o["output"] == outs[o["id"]]) for o in r.get("outputs", []) if o["id"] in outs] if outs else []
        if pairs:
            equal = sum(ok for _, ok in pairs)
            r["agreement"] = equal / len(pairs)
            r["agreement_detail"] = {"reference": path, "equal": equal, "compared": len(pairs),
                                     "differ": [i for i, ok in pairs if not ok]}


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad options before the model loads; fill the long-set defaults."""
    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    parse_decode(args.decode)
    for name in ("limit", "long_limit", "checkable_limit", "max_new_tokens", "long_max_new_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, not {v}")
    if args.adapter:
        model = args.model or Runtime.from_env().model
        if model not in (None, "bundled"):
            raise SystemExit(f"--adapter applies to the bundled base; it cannot be combined with model {model!r}")
        if not Path(args.adapter).is_file():
            raise SystemExit(f"--adapter: no adapter file at {args.adapter}")
    if args.checkable_set and args.checkable_set.lower() == "none":
        args.checkable_set = None
    if args.long_only and not args.long_set:
        args.long_set = str(DEFAULT_PROMPTS)
    if args.long_max_new_tokens is None:  # --long-only has no short set: --max-new-tokens then caps the long sets
        args.long_max_new_tokens = args.max_new_tokens if args.long_only and args.max_new_tokens else LONG_MAX_NEW_TOKENS
    if args.max_new_tokens is None:
        args.max_new_tokens = SHORT_MAX_NEW_TOKENS


def parse_decode(text: str | None) -> dict[str, Any]:
    """--decode 'frequency_penalty=0.5,stop_guard=true' -> DecodeConfig fields for every run (AR and diffusion)."""
    from engine.config import DecodeConfig

    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        name, sep, raw = item.partition("=")
        if not sep or name not in DecodeConfig.__dataclass_fields__ or name in ("mode", "threshold", "max_new_tokens"):
            raise SystemExit(f"--decode: {item!r} is not name=value with a DecodeConfig field (mode, threshold and "
                             "max_new_tokens have their own flags)")
        low = raw.strip().lower()
        if isinstance(DecodeConfig.__dataclass_fields__[name].default, str):  # strategy, cache: the word as given
            out[name] = raw.strip()
            continue
        try:
            out[name] = True if low == "true" else False if low == "false" else int(raw) \
                if raw.strip().lstrip("-").isdigit() else float(raw)
        except ValueError:
            raise SystemExit(f"--decode: {item!r}: {name} takes a number or true/false") from None
    try:
        DecodeConfig(**out).validate()
    except ValueError as e:  # ConfigError names the field
        raise SystemExit(f"--decode: {e}") from None
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from grading.checker import load_eval_set

    check_args(args)
    ref = load_reference(args.agree_with) if args.agree_with else None  # before the long run: fail early
    setup_torch(args.threads)
    runtime = Runtime.from_env()
    if args.adapter:  # the bundled base's adapter (FASTDLLM_ADAPTER's field), for this engine only
        runtime = dataclasses.replace(runtime, adapter=Path(args.adapter))
    eng = load_engine(args.model, args.dtype, args.device, runtime)
    items = [] if args.long_only else load_eval_set(args.eval_set or DEFAULT_EVAL_SET)
    if args.limit:
        items = items[:args.limit]
    runs: list[tuple[str, float | None]] = []
    if "ar" in parse_list(args.modes):
        runs.append(("ar", None))
    if "diffusion" in parse_list(args.modes):
        if not eng.can_diffuse:
            raise SystemExit("quality: the model has no mask token (no adapter loaded); use --modes ar")
        runs += [("diffusion", th) for th in parse_list(args.thresholds, float)]

    extra = parse_decode(args.decode)

    def config(mode: str, th: float | None, cap: int):
        kw: dict[str, Any] = dict(mode=mode, max_new_tokens=cap, **extra)
        if mode == "diffusion":
            kw.update(threshold=th, cache=args.cache, block_size=args.block_size, sub_block_size=args.sub_block_size)
        return eng.decode_config(**kw)

    cfgs = [config(mode, th, args.max_new_tokens) for mode, th in runs]
    scores = [Score() for _ in runs]
    bar = progress(len(runs) * len(items), "quality", disable=args.quiet)
    # chunk by chunk, every setting in turn: drift of a shared machine hits all settings' tokens/s alike
    for i in range(0, len(items), args.batch_size):
        chunk = items[i:i + args.batch_size]
        ids = [eng.encode(eng.chat_prompt([{"role": "user", "content": it["prompt"]}])) for it in chunk]
        for (mode, th), cfg, sc in zip(runs, cfgs, scores):
            bar.set_postfix_str(f"{mode} {th if th is not None else ''}")
            sc.add(eng, chunk, ids, cfg)
            bar.update(len(chunk))
    results = [{"mode": mode, "threshold": th, **(sc.result() if items else {})} for (mode, th), sc in zip(runs, scores)]
    bar.close()
    long_cfgs = [config(mode, th, args.long_max_new_tokens) for mode, th in runs]
    prefixes = run_long_sets(eng, args, runs, long_cfgs, results)
    if ref is not None:
        add_agreement(results, ref, args.agree_with)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"kind": "quality", "environment": environment(eng),
              "eval_set": None if args.long_only else str(args.eval_set or DEFAULT_EVAL_SET),
              "long_sets": {"long": args.long_set, "checkable": args.checkable_set,
                            "max_new_tokens": args.long_max_new_tokens},
              "args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}
    figs = {} if args.long_only else {"quality": chart(results)}
    if prefixes:
        figs["long"] = long_chart(results, prefixes)
    report["charts"] = save_figures(figs, out_dir, png=not args.no_png).to_json()
    write_json(out_dir / "results.json", report)
    return report


COLUMNS = [("mode", "mode"), ("threshold", "threshold"), ("n", "n"), ("accuracy", "accuracy"),
           ("tokens_per_forward", "tok/fwd"), ("tokens_per_second", "tok/s"), ("answer_tokens", "answer tok"),
           ("nfe", "NFE"), ("agreement", "= ref")]
LONG_COLUMNS = [("mode", "mode"), ("threshold", "threshold")] + [
    (f"{p}_{k}", f"{p} {h}") for p in ("long", "checkable") for k, h in
    (("n", "n"), ("stop_rate", "stop"), ("loop_rate", "loop"), ("mean_answer_tokens", "mean tok"),
     ("tokens_per_forward", "tok/fwd"), ("complete_n", "complete"), ("complete_tokens_per_forward", "tok/fwd complete"),
     ("right_rate", "right"))
    if not (p == "long" and k == "right_rate")]
LONG_PUBLIC = tuple(f"{p}_{k}" for p in ("long", "checkable") for k in
                    ("n", "stop_rate", "loop_rate", "mean_answer_tokens", "tokens_per_forward", "complete_n",
                     "complete_tokens_per_forward", "right", "right_rate"))


def tables(report: dict[str, Any]) -> str:
    """The short-set table and, when long sets ran, the long-answer one (columns of sets that ran)."""
    rows = report["results"]
    out = [] if report["eval_set"] is None else [table(rows, COLUMNS, nd=3)]
    cols = [c for c in LONG_COLUMNS if c[0] in ("mode", "threshold") or any(c[0] in r for r in rows)]
    if len(cols) > 2:
        out.append(table(rows, cols, nd=3))
    return "\n\n".join(out)


def public(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("mode", "threshold", "accuracy", "tokens_per_forward", "tokens_per_second", "n")
    extra = ("agreement",) + LONG_PUBLIC  # only with the long sets, --agree-with
    return {"results": [{k: r[k] for k in keys + extra if k in r} for r in report["results"]]}


def add_parser(sub) -> None:
    p = sub.add_parser("quality", help="accuracy of AR base vs dLLM across thresholds",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--eval-set", default=None, help="JSONL of {\"prompt\", \"answers\": [...]} (default bench/data/eval_short.jsonl)")
    p.add_argument("--modes", default="ar,diffusion")
    p.add_argument("--thresholds", default="0.5,0.7,0.9,1.0")
    p.add_argument("--cache", default="dual")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--sub-block-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"answer cap on the short set (default {SHORT_MAX_NEW_TOKENS}); with --long-only, on the long sets")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--long-set", default=None,
                   help="JSONL of {\"prompt\": ...}: also decode these open-ended long-answer prompts with every mode "
                        "(stop, loop, length, tokens per forward; e.g. bench/data/long_answer.jsonl, the default "
                        "with --long-only)")
    p.add_argument("--long-limit", type=int, default=None,
                   help="use N long-answer prompts, taken round-robin over categories")
    p.add_argument("--checkable-set", default=str(CHECKABLE_SET),
                   help="JSONL of {\"id\", \"category\", \"prompt\", \"sequence\"} graded right only when complete, "
                        "in order and stopped (bench/data/README.md); 'none' to skip")
    p.add_argument("--checkable-limit", type=int, default=None,
                   help="use N checkable prompts, taken round-robin over categories")
    p.add_argument("--long-max-new-tokens", type=int, default=None,
                   help=f"answer cap on the long sets (default {LONG_MAX_NEW_TOKENS}, or --max-new-tokens with --long-only)")
    p.add_argument("--long-only", action="store_true",
                   help="skip the short-answer set: only the long sets (scores a checkpoint in minutes)")
    p.add_argument("--adapter", default=None, metavar="SAFETENSORS",
                   help="the dLLM adapter file on the bundled base (as FASTDLLM_ADAPTER; default assets/)")
    p.add_argument("--agree-with", default=None, metavar="RESULTS_JSON",
                   help="an earlier run's results.json (e.g. with FASTDLLM_WEIGHTS=fp32): report the share of answers "
                        "identical to it per setting")
    p.add_argument("--decode", default=None, metavar="NAME=VALUE,...",
                   help="more DecodeConfig settings for every run, e.g. 'frequency_penalty=0.5,stop_guard=true'")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout (all else to stderr)")
    p.add_argument("--out", default="runs/bench/quality")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.json:
        real = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            report = run(args)
            print(tables(report), file=sys.stderr)
        real.write(json.dumps(public(report)) + "\n")
        real.flush()
        return 0
    report = run(args)
    print(f"{report['environment']['model']} · {report['eval_set'] or 'long sets only'}")
    print(tables(report))
    ch = report["charts"]
    print("results: " + str(Path(args.out) / "results.json") + " · charts: " + ", ".join(ch["html"] + ch["png"])
          + (f" (PNG not written: {ch['png_error']})" if ch["png_error"] else ""))
    return 0
