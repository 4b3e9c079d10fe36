"""python -m training {distill,train,throughput,export,eval,probe,ablation}: make the bundled Fast-dLLM v2 adapter.

Typical run (CPU, the bundled SmolLM2-135M base):
  python -m training distill --limit 800 --time-budget 900
  python -m training train --run runs/train --minutes 30
  python -m training export --run runs/train
  python -m training eval --out runs/eval.json

Data at scale and the GPU block (runbook: training/README.md):
  python -m training selfinstruct --out runs/si --magpie 20000
  python -m training gpu {prepare,weights,data,train,unpack,back}    # and `weights split|join` for big files
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def _threads(n: int) -> None:
    # On a CPU shared with other jobs, 1 thread beats 2: OpenMP barriers stall when a core is taken.
    torch.set_num_threads(n)


def cmd_distill(a: argparse.Namespace) -> None:
    from .distill import DistillConfig, distill

    _threads(a.threads)
    distill(DistillConfig(prompts=a.prompts, out=a.out, model=a.model, limit=a.limit, batch_size=a.batch_size,
                          max_new_tokens=a.max_new_tokens, time_budget_s=a.time_budget, mode=a.mode,
                          threshold=a.threshold, dtype=a.dtype))


def train_config(a: argparse.Namespace):
    """The `train` subcommand's options as a TrainConfig."""
    from .options import from_options
    from .train import TrainConfig

    return from_options(TrainConfig, a, data=a.data)


def cmd_train(a: argparse.Namespace) -> None:
    from .run import train

    _threads(a.threads)
    train(train_config(a))


def cmd_throughput(a: argparse.Namespace) -> None:
    import json

    from .options import from_options
    from .train_speed import ThroughputConfig, measure

    _threads(a.threads)
    if a.padding:
        from engine.weights import MASK_TOKEN, load_tokenizer, resolve_source

        from .examples import load_data
        from .train_speed import padding_table

        tok = load_tokenizer(resolve_source("bundled-base").path, add_mask_token=True)
        vocab = tok.get_vocab()
        examples, _ = load_data(a.data, tok, vocab["<|im_end|>"], a.max_len)
        rows = padding_table(examples, vocab[MASK_TOKEN], [(4, 4), (16, 16), (16, 4), (64, 8), (64, 4)])
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"data": str(a.data), "max_len": a.max_len, "recipe": "full", "rows": rows}, indent=1))
        print(json.dumps(rows, indent=1))
        return
    rep = measure(from_options(ThroughputConfig, a, data=a.data, variants=a.variants.split(","), out=a.out))
    print(json.dumps({k: {m: v[m] for m in ("answer_tokens_per_s", "model_tokens_per_s", "answer_tokens_per_cpu_s",
                                            "model_tokens_per_cpu_s", "seconds")}
                      for k, v in rep["variants"].items()}, indent=1))


def cmd_export(a: argparse.Namespace) -> None:
    from .export import export, export_full, is_full, merge

    if is_full(a.run, a.checkpoint):  # full fine-tuning: the whole model, no adapter
        if a.merge_to is None:
            raise SystemExit("export: a full fine-tuning run is written as a checkpoint directory: pass --merge-to DIR")
        print(f"full fine-tuned checkpoint: {export_full(a.run, a.merge_to, a.checkpoint, a.merge_dtype)}")
        return
    print(export(a.run, a.out, checkpoint=a.checkpoint, after=a.after))
    if a.merge_to is not None:
        print(f"merged checkpoint: {merge(a.out, a.base, a.merge_to, a.merge_dtype)}")


def cmd_eval(a: argparse.Namespace) -> None:
    import json

    from .evaluate import EvalConfig, evaluate

    _threads(a.threads)
    print(json.dumps(evaluate(EvalConfig(model=a.model, short=a.short, long=a.long, max_new_tokens=a.max_new_tokens,
                                         short_max_new_tokens=a.short_max_new_tokens,
                                         threshold=a.threshold, batch_size=a.batch_size, out=a.out)), indent=1))


def cmd_probe(a: argparse.Namespace) -> None:
    import dataclasses
    import json

    from engine import Engine
    from engine.runtime import Runtime

    from .probe import load_answers, make_answers, probe

    _threads(a.threads)
    runtime = Runtime.from_env()
    if a.make_answers:  # the reference: the AR base's own answers on the exact path (fp32 weights and steps)
        runtime = dataclasses.replace(runtime, weights="fp32", activations="fp32")
    if a.adapter is not None:
        if not a.adapter.is_file():
            raise SystemExit(f"--adapter: no adapter file at {a.adapter}")
        runtime = dataclasses.replace(runtime, adapter=a.adapter)
    eng = Engine.load(runtime=runtime)
    if a.make_answers:
        items = make_answers(eng, a.limit, a.max_new_tokens, a.answers)
        print(f"{len(items)} answers ({sum(x['stopped'] for x in items)} stopped) -> {a.answers}")
        return
    answers = load_answers(a.answers)[: a.limit]
    report = dataclasses.asdict(probe(eng, answers, a.block_size))
    report["setting"]["answers_file"] = str(a.answers)
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "per_answer"}, indent=1))


def cmd_ablation(a: argparse.Namespace) -> None:
    from .ablation import AblationConfig, run_ablation

    _threads(a.threads)
    rep = run_ablation(AblationConfig(runs=a.runs, data=a.data, val_size=a.val_size, short=a.short, long=a.long,
                                      max_new_tokens=a.max_new_tokens, threshold=a.threshold, out=a.out))
    from .ablation import markdown

    print(markdown(rep["rows"]))


def _selfinstruct_config(a: argparse.Namespace, out: Path):
    from .options import from_options
    from .selfinstruct import SelfInstructConfig

    prompts = None if str(a.prompts) == "none" else a.prompts
    return from_options(SelfInstructConfig, a, out=out, prompts=prompts).validate()


def cmd_selfinstruct(a: argparse.Namespace) -> None:
    import json

    from .selfinstruct import run

    _threads(a.threads)
    m = run(_selfinstruct_config(a, a.out))
    print(json.dumps({k: m[k] for k in ("counts", "examples", "answer_tokens", "truncated")} | {"run": m["runs"][-1]}))


def cmd_answers(a: argparse.Namespace) -> None:
    import json

    from .finish import write_report

    print(json.dumps(write_report(a.data, a.max_len), indent=1))


def cmd_weights(a: argparse.Namespace) -> None:
    from . import weights

    if a.action == "split":
        print(weights.split(a.path, a.out_dir, a.parts).to_json())
    else:
        print(weights.join(a.path, a.dest, a.sha256))


def cmd_gpu(a: argparse.Namespace) -> None:
    import json

    from . import gpu_block

    if a.stage == "prepare":
        rep = gpu_block.prepare(a.reserve_mib, a.parts, aside=not a.keep_results)
    elif a.stage == "back":
        rep = gpu_block.come_back()
    elif a.stage == "weights":
        rep = gpu_block.stage_weights(a.out, a.parts_dir)
    elif a.stage == "data":
        _threads(a.threads)
        rep = gpu_block.stage_data(a.out, _selfinstruct_config(a, a.dir), seed_from=a.seed_from)
    elif a.stage == "train":  # the options after -- are `train`'s, read by its own parser
        extra = a.trainer_args[1:] if a.trainer_args[:1] == ["--"] else a.trainer_args
        t = parser().parse_args(["train", "--data", str(a.data), "--run", str(a.run), "--minutes", str(a.minutes),
                                 *extra])
        _threads(t.threads)
        rep = gpu_block.stage_train(a.out, train_config(t))
    else:
        rep = {"placed": gpu_block.unpack(a.src, a.data, a.run)}
    print(json.dumps(rep, indent=1))


def _add_selfinstruct_options(s: argparse.ArgumentParser) -> None:
    from .options import add_options
    from .selfinstruct import SelfInstructConfig

    s.add_argument("--prompts", type=Path, default=DATA / "prompts.jsonl",
                   help='hand-written prompts, JSONL of {"prompt": ...} ("none": Magpie only)')
    add_options(s, SelfInstructConfig)  # the documented fields of SelfInstructConfig (training/selfinstruct.py)
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def parser() -> argparse.ArgumentParser:
    from .options import add_options
    from .train import TrainConfig
    from .train_speed import ThroughputConfig

    p = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    d = sub.add_parser("distill", formatter_class=fmt,
                       help="answer the training prompts with the AR base (greedy) -> chat JSONL")
    d.add_argument("--prompts", type=Path, default=DATA / "prompts.jsonl", help='JSONL of {"prompt": ...}')
    d.add_argument("--out", type=Path, default=DATA / "distill.jsonl",
                   help="chat JSONL to append to; prompts already in it are skipped (resumable)")
    d.add_argument("--model", default="bundled-base",
                   help="engine model spec of the teacher (mode diffusion: 'bundled' = base + FASTDLLM_ADAPTER or assets/)")
    d.add_argument("--mode", choices=("ar", "diffusion"), default="ar",
                   help="ar: the AR base's answers; diffusion: the dLLM's own decoding trajectories (certainty-forcing data)")
    d.add_argument("--threshold", type=float, default=0.9, help="diffusion confidence threshold (--mode diffusion)")
    d.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="engine dtype (default: the engine's, float32 on CPU and bfloat16 on CUDA)")
    d.add_argument("--limit", type=int, default=None, help="use only the first N prompts of the file")
    d.add_argument("--batch-size", type=int, default=32, help="prompts decoded together")
    d.add_argument("--max-new-tokens", type=int, default=160, help="answer length cap")
    d.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds (resume later)")
    d.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    d.set_defaults(func=cmd_distill)

    t = sub.add_parser("train", formatter_class=fmt, help="LoRA fine-tuning with the Fast-dLLM v2 recipe")
    t.add_argument("--data", type=Path, default=DATA / "distill.jsonl", help="chat JSONL (user/assistant turns)")
    add_options(t, TrainConfig)  # every other option is a documented field of TrainConfig (training/train.py)
    t.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    t.set_defaults(func=cmd_train)

    h = sub.add_parser("throughput", formatter_class=fmt,
                       help="training throughput of trainer variants, measured interleaved -> JSON")
    h.add_argument("--data", type=Path, default=DATA / "distill.jsonl", help="training data")
    h.add_argument("--variants", default="before,after",
                   help="comma list of: before (fp32 weights + autocast, dense mask), bf16_weights, after, "
                        "b16_micro4 (after, 16 sequences a step in length-sorted micro-batches of 4), fp32")
    add_options(h, ThroughputConfig)  # rounds, warmup, batch and micro-batch, length, rank, profile
    h.add_argument("--padding", action="store_true",
                   help="instead: count model tokens per answer token for batch/micro-batch shapes (no model, no timing)")
    h.add_argument("--out", type=Path, default=Path("bench/results/train_throughput.json"), help="JSON report")
    h.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    h.set_defaults(func=cmd_throughput)

    e = sub.add_parser("export", formatter_class=fmt, help="write the adapter the engine loads from a checkpoint")
    e.add_argument("--run", type=Path, default=Path("runs/train"), help="run directory")
    e.add_argument("--checkpoint", type=Path, default=None, help="a specific checkpoint file (default: latest)")
    e.add_argument("--out", type=Path, default=ASSETS / "fastdllm_adapter.safetensors", help="adapter file")
    e.add_argument("--after", type=Path, nargs="*", default=[],
                   help="checkpoints of the earlier runs this one was --init-from'd from, earliest first, for "
                        "checkpoints that do not record them: the adapter's tokens/seconds totals count them")
    e.add_argument("--merge-to", type=Path, default=None,
                   help="also write base + adapter merged as a Fast_dLLM_v2 checkpoint directory (model_type "
                        "Fast_dLLM_Qwen, Qwen2 names, bd_size, |<MASK>| in the tokenizer; --model DIR loads it)")
    e.add_argument("--merge-dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="dtype of the merged weights (the hub's Fast_dLLM_v2 checkpoints are bfloat16)")
    e.add_argument("--base", default="bundled-base", help="engine model spec of the base, for --merge-to")
    e.set_defaults(func=cmd_export)

    v = sub.add_parser("eval", formatter_class=fmt,
                       help="quick check: short-answer accuracy AR vs diffusion, tokens per forward")
    v.add_argument("--model", default=None, help="engine model spec (default: bundled base + assets adapter)")
    v.add_argument("--short", type=int, default=40, help="items of bench/data/eval_short.jsonl (spread over the file)")
    v.add_argument("--long", type=int, default=10, help="prompts of bench/data/long_answer.jsonl")
    v.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap, long-answer prompts")
    v.add_argument("--short-max-new-tokens", type=int, default=64, help="answer length cap, short-answer items")
    v.add_argument("--threshold", type=float, default=0.9, help="diffusion confidence threshold")
    v.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    v.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    v.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    v.set_defaults(func=cmd_eval)

    pr = sub.add_parser("probe", formatter_class=fmt,
                        help="the adapter's quick measures: teacher-forced agreement with the AR base's own answers, "
                             "P(stop) at their ends (training/probe.py)")
    pr.add_argument("--adapter", type=Path, default=None,
                    help="the dLLM adapter file on the bundled base (default: FASTDLLM_ADAPTER, else assets/)")
    pr.add_argument("--answers", type=Path, default=DATA.parent.parent / "bench" / "data" / "probe_answers.jsonl",
                    help="reference answers (JSONL: id, prompt_ids, answer_ids, stopped)")
    pr.add_argument("--limit", type=int, default=20, help="answers used (--make-answers: prompts answered)")
    pr.add_argument("--block-size", type=int, default=32, help="the block grid (the adapter's training block size)")
    pr.add_argument("--make-answers", action="store_true",
                    help="instead: write the reference (the AR base's greedy answers, fp32 weights and steps, to the "
                         "prompts `bench quality --long-limit LIMIT` scores) to --answers")
    pr.add_argument("--max-new-tokens", type=int, default=256, help="--make-answers: answer length cap")
    pr.add_argument("--out", type=Path, default=None, help="write the report (with per-answer rows) as JSON here")
    pr.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    pr.set_defaults(func=cmd_probe)

    b = sub.add_parser("ablation", formatter_class=fmt,
                       help="the paper's recipe ablation: score runs trained with --recipe naive|pad|full alike")
    b.add_argument("runs", type=Path, nargs="+", help="run directories (same data, seed, budget and --val-size)")
    b.add_argument("--data", type=Path, default=DATA / "distill.jsonl", help="the runs' training data")
    b.add_argument("--val-size", type=int, default=16, help="the --val-size the runs held out (scored here)")
    b.add_argument("--short", type=int, default=40, help="short-answer items for decoding accuracy")
    b.add_argument("--long", type=int, default=8, help="long-answer prompts for tokens per forward")
    b.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap, long-answer prompts")
    b.add_argument("--threshold", type=float, default=0.9, help="diffusion confidence threshold")
    b.add_argument("--out", type=Path, default=Path("bench/results/ablation"), help="results.json + table.md here")
    b.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    b.set_defaults(func=cmd_ablation)

    si = sub.add_parser("selfinstruct", formatter_class=fmt,
                        help="Magpie instructions + training prompts, deduped, held out from bench/, answered by the AR base")
    si.add_argument("--out", type=Path, default=Path("runs/selfinstruct"),
                    help="data directory (token-id shards + manifest.json); reruns resume and skip done work")
    _add_selfinstruct_options(si)
    si.set_defaults(func=cmd_selfinstruct)

    an = sub.add_parser("answers", formatter_class=fmt,
                        help="what the answers policies keep of a self-instruct directory; written to its manifest.json")
    an.add_argument("--data", type=Path, default=DATA / "selfinstruct", help="self-instruct directory (shard-*.npz)")
    an.add_argument("--max-len", type=int, nargs="+", default=[256, 512], help="training max lengths to count for")
    an.set_defaults(func=cmd_answers)

    w = sub.add_parser("weights", formatter_class=fmt, help="split a big file into parts (+ parts.json) / join and check them")
    w.add_argument("action", choices=("split", "join"))
    w.add_argument("path", type=Path, help="split: the file; join: the directory holding parts.json and the parts")
    w.add_argument("--out-dir", type=Path, default=Path(".gl/gguf"), help="split: where the parts go")
    w.add_argument("--parts", type=int, default=2, help="split: number of parts")
    w.add_argument("--dest", type=Path, default=None, help="join: output file (default: next to the parts)")
    w.add_argument("--sha256", default=None, help="join: the sha256 the whole file must have")
    w.set_defaults(func=cmd_weights)

    g = sub.add_parser("gpu", formatter_class=fmt, help="the GPU block's stages (runbook: training/README.md)")
    gs = g.add_subparsers(dest="stage", required=True)
    gp = gs.add_parser("prepare", formatter_class=fmt, help="here: wheels to .whl/, GGUF parts to .gl/gguf/, carry lists")
    gp.add_argument("--reserve-mib", type=float, default=0.0, help="room kept in each command for other carried paths")
    gp.add_argument("--parts", type=int, default=None, help="number of parts (default: the fewest that fit)")
    gp.add_argument("--keep-results", action="store_true",
                    help="stay on this branch (default: switch to the block's branch without bench/results, which no "
                         "device command reads, so the GGUF needs fewer parts; `gpu back` returns)")
    gs.add_parser("back", formatter_class=fmt, help="here, after the block: back to the branch `gpu prepare` left")
    gw = gs.add_parser("weights", formatter_class=fmt, help="device: join the GGUF once all parts are here, convert it")
    gw.add_argument("--out", type=Path, required=True, help="$OUT")
    gw.add_argument("--parts-dir", type=Path, default=Path(".gl/gguf"), help="where the carried parts and parts.json are")
    gd = gs.add_parser("data", formatter_class=fmt, help="device: selfinstruct, then this command's shards to $OUT")
    gd.add_argument("--out", type=Path, required=True, help="$OUT")
    gd.add_argument("--dir", type=Path, default=Path("runs/gpu/data"), help="data directory on the device")
    gd.add_argument("--seed-from", type=Path, default=None,
                    help="shards already made (training/data/selfinstruct): copied in first, their prompts count as "
                         "answered and they are not sent back; use a new --seed for new Magpie rounds")
    _add_selfinstruct_options(gd)
    gt = gs.add_parser("train", formatter_class=fmt,
                       help="device: `training train` for --minutes (resumes), then a slim checkpoint + log to $OUT")
    gt.add_argument("--out", type=Path, required=True, help="$OUT")
    gt.add_argument("--data", type=Path, default=Path("runs/gpu/data"), help="training data (self-instruct directory)")
    gt.add_argument("--run", type=Path, default=Path("runs/gpu/train"), help="run directory on the device")
    gt.add_argument("--minutes", type=float, required=True, help="training wall time of this command")
    gt.add_argument("trainer_args", nargs=argparse.REMAINDER, help="after --: more `training train` options")
    gu = gs.add_parser("unpack", formatter_class=fmt, help="here: join split files that came back, place them")
    gu.add_argument("src", type=Path, help="the folder the device's files came back to")
    gu.add_argument("--data", type=Path, default=Path("runs/gpu/data"), help="where data files go")
    gu.add_argument("--run", type=Path, default=Path("runs/gpu/train"), help="where training files go")
    g.set_defaults(func=cmd_gpu)
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    a.func(a)


if __name__ == "__main__":
    main(sys.argv[1:])
