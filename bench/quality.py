"""Quality benchmark: accuracy of the AR base and of the dLLM across thresholds on a held-out short-answer set.

An answer is correct when any of the item's answers occurs in the output as a whole word or phrase,
ignoring case (bench/checker.py). Tokens per forward and tokens/s use the same accounting as the
throughput benchmark: answer tokens through the stop token, engine time only.

--agree-with REF compares every answer with a reference run's (its results.json; same item id, mode and threshold):
the share of greedy answers that are identical, e.g. of the default 4-bit path against FASTDLLM_WEIGHTS=fp32. A
fidelity measure of a weight or kernel path, next to accuracy, which can hide answers that moved both ways.

--long-set adds the parallelism half of the threshold curve: each diffusion setting also decodes the
long-answer prompts (lists, steps, code, explanations), where tokens per forward can show; short answers
barely parallelise. AR is one token per forward by construction, so it is not re-run there.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from .common import (DEFAULT_EVAL_SET, environment, load_engine, parse_list, progress, save_figures, setup_torch,
                     table, write_json)


class Score:
    """Running totals of one (mode, threshold) over the eval set."""

    def __init__(self) -> None:
        self.correct = self.toks = self.nfe = 0
        self.secs = 0.0
        self.outputs: list[dict[str, Any]] = []

    def add(self, eng, chunk: list[dict[str, Any]], ids: list[list[int]], cfg) -> None:
        from .checker import is_correct

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


def long_tokens_per_forward(eng, args: argparse.Namespace, runs: list, results: list[dict[str, Any]]) -> None:
    """Tokens per forward of each diffusion setting on the long-answer prompts (results gain long_* keys)."""
    from .common import load_prompts

    prompts = load_prompts(args.long_set, args.long_limit)
    ids = [eng.encode(eng.chat_prompt([{"role": "user", "content": p}])) for p in prompts]
    todo = [(i, th) for i, (mode, th) in enumerate(runs) if mode == "diffusion"]
    bar = progress(len(todo) * len(ids), "long set", disable=args.quiet)
    for i, th in todo:
        cfg = eng.decode_config(mode="diffusion", threshold=th, cache=args.cache, block_size=args.block_size,
                                sub_block_size=args.sub_block_size, max_new_tokens=args.long_max_new_tokens)
        toks = nfe = 0
        for j in range(0, len(ids), args.batch_size):
            for r in eng.generate_ids(ids[j:j + args.batch_size], cfg, record=False):
                toks, nfe = toks + r.summary.answer_tokens, nfe + r.summary.nfe
            bar.update(len(ids[j:j + args.batch_size]))
        results[i].update(long_n=len(ids), long_answer_tokens=toks, long_nfe=nfe,
                          long_tokens_per_forward=toks / nfe if nfe else 0.0)
    for r in results:
        if r["mode"] == "ar":
            r.update(long_n=len(ids), long_tokens_per_forward=1.0)  # one token per forward by construction
    bar.close()


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
        pairs = [(o["id"], o["output"] == outs[o["id"]]) for o in r["outputs"] if o["id"] in outs] if outs else []
        if pairs:
            equal = sum(ok for _, ok in pairs)
            r["agreement"] = equal / len(pairs)
            r["agreement_detail"] = {"reference": path, "equal": equal, "compared": len(pairs),
                                     "differ": [i for i, ok in pairs if not ok]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .checker import load_eval_set

    ref = load_reference(args.agree_with) if args.agree_with else None  # before the long run: fail early
    setup_torch(args.threads)
    eng = load_engine(args.model, args.dtype, args.device)
    items = load_eval_set(args.eval_set or DEFAULT_EVAL_SET)
    if args.limit:
        items = items[:args.limit]
    runs: list[tuple[str, float | None]] = []
    if "ar" in parse_list(args.modes):
        runs.append(("ar", None))
    if "diffusion" in parse_list(args.modes):
        if not eng.can_diffuse:
            raise SystemExit("quality: the model has no mask token (no adapter loaded); use --modes ar")
        runs += [("diffusion", th) for th in parse_list(args.thresholds, float)]
    cfgs = []
    for mode, th in runs:
        kw: dict[str, Any] = dict(mode=mode, max_new_tokens=args.max_new_tokens)
        if mode == "diffusion":
            kw.update(threshold=th, cache=args.cache, block_size=args.block_size, sub_block_size=args.sub_block_size)
        cfgs.append(eng.decode_config(**kw))
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
    results = [{"mode": mode, "threshold": th, **sc.result()} for (mode, th), sc in zip(runs, scores)]
    bar.close()
    if args.long_set:
        long_tokens_per_forward(eng, args, runs, results)
    if ref is not None:
        add_agreement(results, ref, args.agree_with)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"kind": "quality", "environment": environment(eng), "eval_set": str(args.eval_set or DEFAULT_EVAL_SET),
              "args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}
    report["charts"] = save_figures({"quality": chart(results)}, out_dir, png=not args.no_png).to_json()
    write_json(out_dir / "results.json", report)
    return report


COLUMNS = [("mode", "mode"), ("threshold", "threshold"), ("n", "n"), ("accuracy", "accuracy"),
           ("tokens_per_forward", "tok/fwd"), ("tokens_per_second", "tok/s"), ("answer_tokens", "answer tok"),
           ("nfe", "NFE"), ("long_tokens_per_forward", "long tok/fwd"), ("agreement", "= ref")]


def public(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("mode", "threshold", "accuracy", "tokens_per_forward", "tokens_per_second", "n")
    extra = ("long_tokens_per_forward", "agreement")  # only with --long-set, --agree-with
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
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--long-set", default=None,
                   help="JSONL of {\"prompt\": ...}: also measure each threshold's tokens per forward on these "
                        "long-answer prompts (e.g. bench/data/long_answer.jsonl)")
    p.add_argument("--long-limit", type=int, default=None, help="use only the first N long-answer prompts")
    p.add_argument("--long-max-new-tokens", type=int, default=128, help="answer length cap on the long set")
    p.add_argument("--agree-with", default=None, metavar="RESULTS_JSON",
                   help="an earlier run's results.json (e.g. with FASTDLLM_WEIGHTS=fp32): report the share of answers "
                        "identical to it per setting")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout (all else to stderr)")
    p.add_argument("--out", default="runs/bench/quality")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    if args.json:
        real = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            report = run(args)
            print(table(report["results"], COLUMNS, nd=3), file=sys.stderr)
        real.write(json.dumps(public(report)) + "\n")
        real.flush()
        return 0
    report = run(args)
    print(f"{report['environment']['model']} · {report['eval_set']}")
    print(table(report["results"], COLUMNS, nd=3))
    ch = report["charts"]
    print("results: " + str(Path(args.out) / "results.json") + " · charts: " + ", ".join(ch["html"] + ch["png"])
          + (f" (PNG not written: {ch['png_error']})" if ch["png_error"] else ""))
    return 0
