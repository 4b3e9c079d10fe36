"""A real model's shape on this CPU at 4-bit: load time and peak memory, forward cost by width, AR speed, and the
diffusion/AR speed a decode schedule of a given tokens-per-forward would reach.

Random N(0, 0.02) weights with the Qwen2.5-1.5B shape (q/k/v biases, 151,936-token tied vocabulary) written once as
a bf16 checkpoint in the Fast_dLLM_v2 layout's tensor names; the cost of a forward does not depend on the values.
Every measurement runs in a child process of its own (peak RSS is the child's), threads interleaved per repeat:

    python -m bench cpu-shape --shape qwen2.5-1.5b --threads 1,2 --out bench/results/cpu_shape_1.5b

The projection replays a dual-cache schedule per 32-token block at `--tpf` tokens per forward overall (the paper's
2.6 by default), F = 32 / tpf forwards a block, against 32 AR steps of t(1), on the forwards decoding runs (timed as
`decode_ms`: the LM head only where decoding reads logits):
- `dual` (the paper's DualCache, the engine's default): a whole-block refresh at each of the 4 sub-blocks (32
  positions, head on the sub-block's 8), the commit (32 positions, head on 1) and F - 5 sub-block steps (9 positions,
  head on 8): block = 4 t(refresh) + t(commit) + (F - 5) t(sub);
- `dual-sparse`: one whole-block refresh a block, the commit, and F - 2 steps, timed as full sub-block windows (its
  steps compute only the rows they need, ~5-6 at 1.3 tokens per forward: an upper bound);
- `one_wide` (the first version of this projection, kept to compare with earlier results): one 33-wide forward with
  the head on all 33 and F - 1 9-wide ones (head on all 9), which undercounts `dual`'s refreshes.

With `--llamacpp-gguf PATH` (llama-cpp-python, requirements-llamacpp.txt) each repeat also times llama.cpp's greedy AR
decode on a GGUF of the same weights (llama.cpp's convert_hf_to_gguf.py on the checkpoint, then Q4_1 projections with
a Q8_0 embedding/head as the bundled SmolLM2 GGUF), same prompt, tokens and threads, in a child of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK, SUB = 32, 8
# the forwards a dual-cache decode runs: (positions, positions whose logits it reads)
DECODE_SHAPES = {"refresh": (BLOCK, SUB), "commit": (BLOCK, 1), "sub": (SUB + 1, SUB)}
PROMPT = [{"role": "user", "content": "Count from one to fifty."}]  # the AR prompt, chat-templated, of both children


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process: load (and, with --widths, time forwards and an AR decode)."""
    import torch

    from engine import Engine

    from .common import parse_list, peak_rss_mb

    torch.set_num_threads(int(args.threads))
    t0 = time.perf_counter()
    eng = Engine.load(args.model, device="cpu")
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "info": eng.lm.info,
                           "rss_after_load_mb": _rss_mb()}
    if args.widths:
        from .roofline import forward_at_width

        model = eng.lm.base
        out["forward_ms"] = {str(k): 1000 * forward_at_width(model, k, args.prefix, torch.device("cpu"), torch.float32,
                                                             args.iters) for k in parse_list(args.widths, int)}
        out["decode_ms"] = {name: 1000 * forward_at_width(model, k, args.prefix, torch.device("cpu"), torch.float32,
                                                          args.iters, heads)
                            for name, (k, heads) in DECODE_SHAPES.items()}
        ids = eng.encode(eng.chat_prompt(PROMPT))
        cfg = eng.decode_config(mode="ar", max_new_tokens=args.ar_tokens, stop_token_ids=(eng.lm.cfg.vocab_size - 1,))
        eng.generate_ids([ids], cfg)  # warm-up
        t = time.perf_counter()
        s = eng.generate_ids([ids], cfg)[0].summary
        out["ar"] = {"tokens": len(s.token_ids), "seconds": time.perf_counter() - t}
        out["ar"]["tok_s"] = out["ar"]["tokens"] / out["ar"]["seconds"]
    # VmHWM: this process's own peak. ru_maxrss is not: Linux carries the parent's RSS at fork into it across exec,
    # so a parent that had just written the random checkpoint made every child report its 7 GB
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def llamacpp_child(args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's greedy AR decode of --ar-tokens tokens on --llamacpp-gguf in this process, timed as `child`'s:
    prefill included, after a warm-up of the same length. It imports no torch, whose ~185 MB would be in its peak."""
    import jinja2
    from llama_cpp import Llama

    threads = int(args.threads)
    t0 = time.perf_counter()
    llm = Llama(model_path=args.llamacpp_gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "rss_after_load_mb": _rss_mb()}
    # The GGUF's own chat template (the checkpoint's), rendered as transformers' apply_chat_template does
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        llm.metadata["tokenizer.chat_template"])
    ids = llm.tokenize(template.render(messages=PROMPT, add_generation_prompt=True).encode(), add_bos=False,
                       special=True)

    def decode() -> int:
        llm.reset()  # n_tokens 0: no prefix reuse from the warm-up, the prompt is prefilled again
        n = 0
        # temp 0 = greedy argmax, repeat_penalty 1 = off; no stop token, as our child's unreachable one
        for _ in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n >= args.ar_tokens:
                break
        return n

    decode()  # warm-up
    t = time.perf_counter()
    out["ar"] = {"prompt_tokens": len(ids), "tokens": decode(), "seconds": time.perf_counter() - t}
    out["ar"]["tok_s"] = out["ar"]["tokens"] / out["ar"]["seconds"]
    out["peak_rss_mb"] = _rss_mb("VmHWM")  # as peak_rss_mb(), without importing bench.common (torch)
    return out


def _rss_mb(key: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def run_child(model: Path, cache: Path, threads: int, widths: str, args: argparse.Namespace,
              act: str = "fp32") -> dict[str, Any]:
    narrow, _, wide = act.partition("/")  # "fp32/int8": FASTDLLM_ACTIVATIONS / FASTDLLM_WIDE_ACTIVATIONS
    env = {**os.environ, "FASTDLLM_CACHE": str(cache), "FASTDLLM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "FASTDLLM_WEIGHTS": "int4+bf16", "FASTDLLM_ACTIVATIONS": narrow, "FASTDLLM_WIDE_ACTIVATIONS": wide or "bf16"}
    cmd = [sys.executable, "-m", "bench.cpu_shape", "--child", "--model", str(model), "--threads", str(threads),
           "--prefix", str(args.prefix), "--iters", str(args.iters), "--ar-tokens", str(args.ar_tokens)]
    if widths:
        cmd += ["--widths", widths]
    return _run(cmd, env)


def run_llamacpp_child(gguf: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.cpu_shape", "--child", "--llamacpp-gguf", gguf, "--threads", str(threads),
           "--ar-tokens", str(args.ar_tokens)]
    return _run(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"})


def _run(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """A child's one JSON line."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def projection(ms: dict[str, float], tpf: float, dec: dict[str, float] | None = None) -> dict[str, Any]:
    """Diffusion/AR speed of the dual-cache schedules at `tpf` tokens per forward (module docstring)."""
    f = BLOCK / tpf  # forwards a block
    ar = BLOCK * ms["1"]
    one_wide = ms[str(BLOCK + 1)] + (f - 1) * ms[str(SUB + 1)]
    out: dict[str, Any] = {"tpf": tpf, "forwards_per_block": f, "ar_block_ms": ar, "block_ms": one_wide,
                           "diffusion_over_ar": ar / one_wide, "x9_over_x1": ms[str(SUB + 1)] / ms["1"],
                           "x33_over_x1": ms[str(BLOCK + 1)] / ms["1"]}
    if dec:
        n = BLOCK // SUB
        blocks = {"dual": n * dec["refresh"] + dec["commit"] + max(f - n - 1, 0) * dec["sub"],
                  "dual-sparse": dec["refresh"] + dec["commit"] + max(f - 2, 0) * dec["sub"]}
        out["schedules"] = {k: {"block_ms": v, "diffusion_over_ar": ar / v} for k, v in blocks.items()}
        out.update({f"{k}_over_x1": v / ms["1"] for k, v in dec.items()})
    return out


def main(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(llamacpp_child(args) if args.llamacpp_gguf else child(args)))
        return 0
    import torch

    from .common import parse_list, write_json
    from .gpu import checkpoint, tokenizer_dir

    work = Path(args.work or Path.home() / ".cache" / "fastdllm" / "bench" / args.shape)
    if not (work / "model.safetensors").exists():
        t = time.perf_counter()
        checkpoint(args.shape, work, tokenizer_dir(), torch.bfloat16, torch.device("cpu"))
        print(f"wrote {work} in {time.perf_counter() - t:.0f} s", flush=True)
    cache = Path(tempfile.mkdtemp(prefix="fastdllm-q4-"))
    report: dict[str, Any] = {"shape": args.shape, "checkpoint_gb": (work / "model.safetensors").stat().st_size / 1e9,
                              "note": args.note}
    report["first_load"] = run_child(work, cache, max(parse_list(args.threads, int)), "", args)
    report["cached_load"] = run_child(work, cache, max(parse_list(args.threads, int)), "", args)
    print(json.dumps({k: report[k] for k in ("first_load", "cached_load")}, indent=1), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    llama_runs: dict[int, list[dict[str, Any]]] = {}
    widths = ",".join(str(w) for w in sorted({1, SUB + 1, BLOCK + 1, *parse_list(args.widths, int)}))
    for _ in range(args.repeats):  # settings interleaved
        for th in parse_list(args.threads, int):
            for act in parse_list(args.acts):
                key = f"{th}/{act}"
                runs.setdefault(key, []).append(run_child(work, cache, th, widths, args, act))
                print(key, json.dumps(runs[key][-1]["forward_ms"]), runs[key][-1]["ar"], flush=True)
            if args.llamacpp_gguf:
                llama_runs.setdefault(th, []).append(run_llamacpp_child(args.llamacpp_gguf, th, args))
                print(f"{th}/llama.cpp", llama_runs[th][-1]["ar"], flush=True)
    report["threads"] = {}  # "threads/activations" -> best of the repeats
    for th, rs in runs.items():
        ms = {k: min(r["forward_ms"][k] for r in rs) for k in rs[0]["forward_ms"]}
        dec = {k: min(r["decode_ms"][k] for r in rs) for k in rs[0]["decode_ms"]}
        report["threads"][th] = {"forward_ms": ms, "decode_ms": dec, "ar_tok_s": max(r["ar"]["tok_s"] for r in rs),
                                 "peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "runs": rs,
                                 "projection": projection(ms, args.tpf, dec)}
    if args.llamacpp_gguf:
        report["llamacpp_gguf"], report["llamacpp"] = args.llamacpp_gguf, {}  # threads -> best of the repeats
        for th, rs in llama_runs.items():
            best = max(r["ar"]["tok_s"] for r in rs)
            report["llamacpp"][str(th)] = {
                "ar_tok_s": best, "peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "runs": rs,
                "ours_over_llamacpp": {k: r["ar_tok_s"] / best for k, r in report["threads"].items()
                                       if k.split("/", 1)[0] == str(th)}}
    write_json(Path(args.out) / "cpu_shape.json", report)
    for th, r in report["threads"].items():
        p = r["projection"]
        print(f"threads/activations {th}: " + ", ".join(f"{k}-wide {v:.1f} ms" for k, v in r["forward_ms"].items())
              + f"; 9/1 {p['x9_over_x1']:.2f}x, 33/1 {p['x33_over_x1']:.2f}x; decoding's forwards: "
              + ", ".join(f"{k} {v:.1f} ms ({p[k + '_over_x1']:.2f}x)" for k, v in r["decode_ms"].items())
              + f"; AR {r['ar_tok_s']:.2f} tok/s; projected diffusion/AR at {args.tpf} tok/fwd: "
              + ", ".join(f"{k} {v['diffusion_over_ar']:.2f}x" for k, v in p["schedules"].items())
              + f" (one 33-wide forward a block: {p['diffusion_over_ar']:.2f}x)")
    if args.llamacpp_gguf:
        print("AR tok/s, ours / llama.cpp (same weights): " + "; ".join(
            f"{th} threads: llama.cpp {r['ar_tok_s']:.2f}, " + ", ".join(
                f"{k.split('/', 1)[1]} {v:.2f}x" for k, v in r["ours_over_llamacpp"].items())
            for th, r in report["llamacpp"].items()))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of bench/roofline.py's SHAPES")
    p.add_argument("--work", default=None, help="where the random checkpoint is written once (default: the cache)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--acts", default="fp32/bf16,fp32/int8",
                   help="activations of the 4-bit kernels, narrow[/wide] (FASTDLLM_ACTIVATIONS / FASTDLLM_WIDE_ACTIVATIONS)")
    p.add_argument("--widths", default="1,9,33", help="forward widths to time (1, 9 and 33 are always timed)")
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before each timed forward")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ar-tokens", type=int, default=32)
    p.add_argument("--tpf", type=float, default=2.6, help="tokens per forward of the projected schedule")
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--llamacpp-gguf", default=None,
                   help="also time llama.cpp's AR decode on this GGUF of the same weights (llama-cpp-python)")
    p.add_argument("--out", default="bench/results/cpu_shape")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)


def add_parser(sub) -> None:
    p = sub.add_parser("cpu-shape", help="a real model's shape at 4-bit on CPU: load, memory, widths, AR, projection")
    add_arguments(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_shape")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
