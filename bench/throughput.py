"""Throughput benchmark: tokens/s, NFE, tokens per forward, TTFT and peak memory per decoding setting.

Accounting: prompts are tokenised once, before any timing. Each setting first runs one warm-up batch
(excluded). Then each repeat runs batch 1 of every setting, then batch 2 of every setting, and so on:
settings are interleaved batch by batch, so drift of a shared machine hits every setting alike, and
ratios come from the same run.
A setting's repeat time is the sum over its batches of the engine time of the batch (the last row's
Summary.seconds: engine time only, no tokenisation or detokenised output handling outside the engine).
The reported repeat is the median one by time; answer tokens count through the stop token, never pads.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .common import (DEFAULT_PROMPTS, NEVER_STOP, PeakMemory, environment, load_engine, load_prompts, median,
                     median_index, parse_list, progress, save_figures, setup_torch, table, write_json)


MODES = ("ar", "diffusion", "transformers", "llamacpp")


@dataclass(frozen=True)
class Setting:
    mode: str  # one of MODES
    batch_size: int
    cache: str | None = None
    threshold: float | None = None
    block_size: int | None = None
    sub_block_size: int | None = None
    weights: str | None = None  # FASTDLLM_WEIGHTS of the engine (ar / diffusion); None: the engine's default

    @property
    def label(self) -> str:
        w = f"@{self.weights}" if self.weights else ""
        if self.mode != "diffusion":
            return self.mode + w
        return f"diffusion/{self.cache}/t{self.threshold:g}/b{self.block_size}/s{self.sub_block_size}{w}"

    @property
    def name(self) -> str:
        return f"{self.label}/bs{self.batch_size}"


def build_settings(args: argparse.Namespace, eng) -> tuple[list[Setting], list[dict[str, Any]]]:
    """The grid of settings to run, and those skipped (with the engine's reason)."""
    from engine import ConfigError

    modes = parse_list(args.modes)
    if args.hf_baseline and "transformers" not in modes:
        modes.append("transformers")
    check_modes(modes)
    weights = parse_list(args.weights) or [None]
    settings: list[Setting] = []
    skipped: list[dict[str, Any]] = []
    for bs in parse_list(args.batch_sizes, int):
        if bs < 1:
            raise SystemExit(f"--batch-sizes: {bs} is not a positive integer")
        for mode in modes:
            if mode == "llamacpp" and bs != 1:
                skipped.append({"name": f"llamacpp/bs{bs}", "reason": "llama-cpp-python decodes one sequence (batch 1)"})
                continue
            if mode in ("transformers", "llamacpp"):
                settings.append(Setting(mode, bs))
                continue
            if mode == "ar":
                settings.extend(Setting(mode, bs, weights=w) for w in weights)
                continue
            if not eng.can_diffuse:
                skipped.append({"name": f"diffusion/bs{bs}", "reason": "the model has no mask token (no adapter loaded)"})
                continue
            for cache in parse_list(args.cache):
                for th in parse_list(args.thresholds, float):
                    for blk in parse_list(args.block_sizes, int):
                        for sub, w in ((sub, w) for sub in parse_list(args.sub_block_sizes, int) for w in weights):
                            s = Setting("diffusion", bs, cache, th, blk, sub, w)
                            try:
                                engine_config(eng, s, args.max_new_tokens, False)
                            except ConfigError as exc:
                                skipped.append({"name": s.name, "reason": str(exc)})
                                continue
                            settings.append(s)
    return settings, skipped


def check_modes(modes: list[str]) -> None:
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")


def engine_config(eng, s: Setting, max_new_tokens: int, ignore_eos: bool):
    kw: dict[str, Any] = dict(mode=s.mode, max_new_tokens=max_new_tokens, temperature=0.0)
    if s.mode == "diffusion":
        kw.update(cache=s.cache, threshold=s.threshold, block_size=s.block_size, sub_block_size=s.sub_block_size)
    if ignore_eos:
        kw["stop_token_ids"] = (NEVER_STOP,)
    return eng.decode_config(**kw)


class Runner:
    """Runs one batch of one setting and returns per-row numbers plus the batch's engine seconds."""

    def __init__(self, eng, args: argparse.Namespace):
        self.eng, self.args = eng, args
        self._hf = None
        self._llama = None

    def engine(self, s: Setting):
        """The engine of a setting's weights mode (loaded once per mode, memoised by load_engine)."""
        if not s.weights or s.weights == self.eng.lm.info.get("weights"):
            return self.eng
        from dataclasses import replace

        from engine.runtime import Runtime

        return load_engine(self.args.model, self.args.dtype, self.args.device,
                           replace(Runtime.from_env(), weights=s.weights))

    def llama(self):
        if self._llama is None:
            from .llamacpp import LlamaCppBaseline

            self._llama = LlamaCppBaseline(self.eng, self.args.threads or torch.get_num_threads())
        return self._llama

    def hf(self):
        if self._hf is None:
            from .hf_baseline import HFBaseline

            self._hf = HFBaseline(self.eng)
        return self._hf

    def run(self, s: Setting, batch: list[list[int]], max_new_tokens: int) -> tuple[float, list[dict[str, Any]]]:
        if s.mode in ("transformers", "llamacpp"):
            base = self.hf() if s.mode == "transformers" else self.llama()
            rows = base.generate_ids(batch, max_new_tokens, ignore_eos=self.args.ignore_eos)
            out = [dict(answer_tokens=r.answer_tokens, nfe=r.nfe, seconds=r.seconds, ttft=r.ttft,
                        stop_reason=r.stop_reason, token_ids=r.token_ids) for r in rows]
        else:
            eng = self.engine(s)
            cfg = engine_config(eng, s, max_new_tokens, self.args.ignore_eos)
            res = eng.generate_ids(batch, cfg, record=False)
            out = [dict(answer_tokens=r.summary.answer_tokens, nfe=r.summary.nfe, seconds=r.summary.seconds,
                        ttft=r.summary.ttft, stop_reason=r.summary.stop_reason, token_ids=r.summary.token_ids)
                   for r in res]
        return max(r["seconds"] for r in out), out


def aggregate(s: Setting, repeats: list[dict[str, Any]], mem_kind: str) -> dict[str, Any]:
    """Report the median repeat (by engine seconds); keep every repeat's time for spread."""
    i = median_index([r["seconds"] for r in repeats])
    rep = repeats[i]
    toks, nfe, secs = rep["answer_tokens"], rep["nfe"], rep["seconds"]
    return {
        "name": s.name, "label": s.label, **asdict(s),
        "n_prompts": len(rep["rows"]), "answer_tokens": toks, "nfe": nfe,
        "tokens_per_forward": toks / nfe if nfe else 0.0,
        "seconds": secs, "tokens_per_second": toks / secs if secs > 0 else 0.0,
        "ttft": median(r["ttft"] for r in rep["rows"]),
        "peak_memory_mb": max(r["peak_mb"] for r in repeats), "memory_kind": mem_kind,
        "peak_memory_growth_mb": max(r["peak_growth_mb"] for r in repeats),  # above the span's starting level
        "repeat_seconds": [r["seconds"] for r in repeats],
        "repeat_tokens_per_second": [r["answer_tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in repeats],
        "deterministic": len({(r["answer_tokens"], r["nfe"]) for r in repeats}) == 1,
        "stop_reasons": dict(Counter(r["stop_reason"] for r in rep["rows"])),
        "per_prompt": [{k: r[k] for k in ("answer_tokens", "nfe", "seconds", "ttft", "stop_reason")} for r in rep["rows"]],
    }


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """diffusion / AR (same weights), AR / transformers and AR / llama.cpp tokens/s, every term taken from this
    run at the same batch size."""
    by = {(r["mode"], r["batch_size"], r["weights"]): r for r in results if r["mode"] != "diffusion"}
    out = []
    for r in results:
        if r["mode"] == "diffusion":
            dens = [("vs_ar", by.get(("ar", r["batch_size"], r["weights"])))]
        elif r["mode"] == "ar":
            dens = [(f"vs_{m}", by.get((m, r["batch_size"], None))) for m in ("transformers", "llamacpp")]
        else:
            continue
        for key, den in dens:
            if den is None or not den["tokens_per_second"]:
                continue
            value = r["tokens_per_second"] / den["tokens_per_second"]
            r[key] = value
            out.append({"numerator": r["name"], "denominator": den["name"], "tokens_per_second_ratio": value,
                        "numerator_tokens_per_second": r["tokens_per_second"],
                        "denominator_tokens_per_second": den["tokens_per_second"]})
    return out


def agreement(results_rows: dict[str, list[dict[str, Any]]], settings: list[Setting],
              other: str = "transformers") -> list[dict[str, Any]]:
    """How many prompts our AR and `other` (transformers / llamacpp) decode to identical token ids (greedy)."""
    out = []
    for s in settings:
        if s.mode != "ar":
            continue
        ref = Setting(other, s.batch_size)
        if ref.name not in results_rows:
            continue
        a, b = results_rows[s.name], results_rows[ref.name]
        same = sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b))
        prefix = [next((j for j, (u, v) in enumerate(zip(x["token_ids"], y["token_ids"])) if u != v),
                       min(len(x["token_ids"]), len(y["token_ids"]))) for x, y in zip(a, b)]
        out.append({"setting": s.name, "batch_size": s.batch_size, "identical": same, "n": len(a),
                    "common_prefix_tokens": prefix})
    return out


def charts(results: list[dict[str, Any]]) -> dict[str, Any]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figs = {}
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens / second (engine time)", "tokens per forward"))
    palette = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2"]
    for n, bs in enumerate(sorted({r["batch_size"] for r in results})):
        rs = [r for r in results if r["batch_size"] == bs]
        color = palette[n % len(palette)]
        labels = [r["label"] for r in rs]
        fig.add_trace(go.Bar(name=f"batch {bs}", x=labels, y=[r["tokens_per_second"] for r in rs],
                             legendgroup=str(bs), marker_color=color,
                             text=[f"{r['tokens_per_second']:.1f}" for r in rs]), 1, 1)
        fig.add_trace(go.Bar(name=f"batch {bs}", x=labels, y=[r["tokens_per_forward"] for r in rs],
                             legendgroup=str(bs), showlegend=False, marker_color=color,
                             text=[f"{r['tokens_per_forward']:.2f}" for r in rs]), 1, 2)
    fig.update_layout(title="Fast-dLLM v2 throughput", barmode="group", template="plotly_white")
    figs["throughput"] = fig
    diff = [r for r in results if r["mode"] == "diffusion"]
    if len({r["threshold"] for r in diff}) > 1:
        fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens / second vs threshold", "tokens per forward vs threshold"))
        groups = sorted({(r["cache"], r["block_size"], r["sub_block_size"], r["batch_size"]) for r in diff})
        for g in groups:
            rs = sorted((r for r in diff if (r["cache"], r["block_size"], r["sub_block_size"], r["batch_size"]) == g),
                        key=lambda r: r["threshold"])
            name = f"{g[0]} b{g[1]}/s{g[2]} bs{g[3]}"
            xs = [r["threshold"] for r in rs]
            fig.add_trace(go.Scatter(name=name, x=xs, y=[r["tokens_per_second"] for r in rs], mode="lines+markers",
                                     legendgroup=name), 1, 1)
            fig.add_trace(go.Scatter(name=name, x=xs, y=[r["tokens_per_forward"] for r in rs], mode="lines+markers",
                                     legendgroup=name, showlegend=False), 1, 2)
        for r in results:
            if r["mode"] == "ar":
                fig.add_hline(y=r["tokens_per_second"], line_dash="dot", row=1, col=1,
                              annotation_text=f"AR bs{r['batch_size']}")
        fig.update_layout(title="Threshold sweep", template="plotly_white")
        figs["threshold_sweep"] = fig
    return figs


COLUMNS = [("name", "setting"), ("n_prompts", "prompts"), ("answer_tokens", "answer tok"), ("nfe", "NFE"),
           ("tokens_per_forward", "tok/fwd"), ("seconds", "seconds"), ("tokens_per_second", "tok/s"),
           ("ttft", "TTFT s"), ("peak_memory_mb", "peak MB"), ("peak_memory_growth_mb", "+MB"), ("vs_ar", "÷ AR"), ("vs_transformers", "÷ HF"),
           ("vs_llamacpp", "÷ llama.cpp")]


def run(args: argparse.Namespace) -> dict[str, Any]:
    setup_torch(args.threads)
    eng = load_engine(args.model, args.dtype, args.device)
    prompts = load_prompts(args.prompts or DEFAULT_PROMPTS, args.limit)
    ids = [eng.encode(eng.chat_prompt([{"role": "user", "content": p}])) for p in prompts]
    settings, skipped = build_settings(args, eng)
    if not settings:
        raise SystemExit("throughput: nothing to run (every setting was skipped: " +
                         "; ".join(f"{s['name']}: {s['reason']}" for s in skipped) + ")")
    runner = Runner(eng, args)
    mem = PeakMemory(eng.lm.device)
    batches = {bs: [ids[i:i + bs] for i in range(0, len(ids), bs)] for bs in {s.batch_size for s in settings}}
    total = len(settings) * (1 if args.warmup_tokens else 0) + args.repeats * sum(len(batches[s.batch_size]) for s in settings)
    bar = progress(total, "throughput", disable=args.quiet)
    if args.warmup_tokens:
        for s in settings:  # warm-up (excluded): allocator, oneDNN/cuBLAS plans, lazy imports, HF load
            bar.set_postfix_str(f"warm-up {s.name}")
            runner.run(s, batches[s.batch_size][0], min(args.max_new_tokens, args.warmup_tokens))
            bar.update()
    reps: dict[Setting, list[dict[str, Any]]] = {s: [] for s in settings}
    n_batches = max(len(b) for b in batches.values())
    for r in range(args.repeats):
        cur = {s: {"seconds": 0.0, "rows": [], "peak_mb": 0.0, "peak_growth_mb": 0.0} for s in settings}
        for i in range(n_batches):  # interleave settings batch by batch: drift of a shared machine hits all alike
            for s in settings:
                if i >= len(batches[s.batch_size]):
                    continue
                bar.set_postfix_str(f"repeat {r + 1} batch {i + 1} {s.name}")
                mem.reset()
                base_mb = mem.current_mb()
                t, out = runner.run(s, batches[s.batch_size][i], args.max_new_tokens)
                peak = mem.peak_mb()
                c = cur[s]
                c["seconds"] += t
                c["rows"].extend(out)
                c["peak_mb"] = max(c["peak_mb"], peak)
                c["peak_growth_mb"] = max(c["peak_growth_mb"], peak - base_mb)
                bar.update()
        for s in settings:
            c = cur[s]
            c["answer_tokens"] = sum(x["answer_tokens"] for x in c["rows"])
            c["nfe"] = sum(x["nfe"] for x in c["rows"])
            reps[s].append(c)
    bar.close()
    results = [aggregate(s, reps[s], mem.kind) for s in settings]
    last_rows = {s.name: reps[s][median_index([x["seconds"] for x in reps[s]])]["rows"] for s in settings}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "kind": "throughput", "environment": environment(eng),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "prompts": {"file": str(args.prompts or DEFAULT_PROMPTS), "n": len(prompts),
                    "prompt_tokens": [len(x) for x in ids]},
        "accounting": __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
        "results": results, "ratios": ratios(results), "skipped": skipped,
        "ar_transformers_agreement": agreement(last_rows, settings),
        "ar_llamacpp_agreement": agreement(last_rows, settings, "llamacpp"),
    }
    report["charts"] = save_figures(charts(results), out_dir, png=not args.no_png).to_json()
    write_json(out_dir / "results.json", report)
    return report


def print_report(report: dict[str, Any], file=None) -> None:
    file = file or sys.stdout
    env = report["environment"]
    print(f"{env['model']} · threads {env['threads']} · {report['prompts']['n']} prompts · "
          f"max_new_tokens {report['args']['max_new_tokens']} · {report['args']['repeats']} repeat(s), median shown"
          + (" · ignore-eos" if report["args"].get("ignore_eos") else ""), file=file)
    print(table(report["results"], COLUMNS), file=file)
    for r in report["ratios"]:
        print(f"ratio {r['numerator']} / {r['denominator']}: {r['tokens_per_second_ratio']:.3f}x "
              f"({r['numerator_tokens_per_second']:.2f} / {r['denominator_tokens_per_second']:.2f} tok/s, same run)", file=file)
    for other in ("transformers", "llamacpp"):
        for a in report.get(f"ar_{other}_agreement", []):
            print(f"our {a.get('setting', 'AR')} vs {other}, batch {a['batch_size']}: {a['identical']}/{a['n']} prompts "
                  f"decode to identical token ids", file=file)
    for s in report["skipped"]:
        print(f"skipped {s['name']}: {s['reason']}", file=file)
    ch = report["charts"]
    print("charts: " + ", ".join(ch["html"] + ch["png"]) + (f" (PNG not written: {ch['png_error']})" if ch["png_error"] else ""), file=file)


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="tokens/s, NFE, tokens per forward, TTFT, peak memory per setting",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model spec for Engine.load (default: bundled base + adapter)")
    p.add_argument("--prompts", default=None, help=f"JSONL of {{\"prompt\": ...}} (default {DEFAULT_PROMPTS.relative_to(DEFAULT_PROMPTS.parents[2])})")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--modes", default="ar,diffusion",
                   help="comma list of ar, diffusion, transformers, llamacpp (llama-cpp-python on the bundled GGUF)")
    p.add_argument("--weights", default=None,
                   help="comma list of FASTDLLM_WEIGHTS modes (int4+bf16, int4, bf16, fp32) to run ar/diffusion with, "
                        "interleaved in one run (default: the engine's)")
    p.add_argument("--hf-baseline", action="store_true", help="also run transformers generate() (= mode transformers)")
    p.add_argument("--cache", default="dual", help="diffusion cache modes: none, block, dual, dual-sparse")
    p.add_argument("--thresholds", default="0.9")
    p.add_argument("--block-sizes", default="32")
    p.add_argument("--sub-block-sizes", default="8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--repeats", type=int, default=3, help="measured repeats per setting (median reported)")
    p.add_argument("--warmup-tokens", type=int, default=32,
                   help="max_new_tokens of the excluded warm-up batch per setting (0: no warm-up)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never stop on the stop token: every row decodes exactly max_new_tokens (compares per-token cost)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: engine's choice)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default="runs/bench/throughput")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    check_modes(parse_list(args.modes))  # before the model loads
    if args.weights:
        from engine.weights.quant import WeightPolicy

        for w in parse_list(args.weights):
            try:
                WeightPolicy(w)
            except ValueError as exc:
                raise SystemExit(f"--weights: {exc}") from None
    report = run(args)
    print_report(report)
    return 0
