"""One command for a GPU session: every measurement issue 11 asks for, in ~5 minutes on an H100, <= 4 files.

  python -m bench gpu --out $OUT/gpu            # on the GPU machine
  python -m bench gpu --smoke --out /tmp/gpu    # the same code paths on CPU at toy size (tests/test_cuda.py)

Sections, each recorded in gpu.json (an error in one is written down and the others still run):
  roofline  random bf16 weights of the Qwen2.5-1.5B and 7B shapes: ms per forward of k = 1..32 query tokens
            after a cached prefix, eager CausalLM.forward and the static stepper (CUDA graphs), against the
            HBM roof (a streaming probe and the datasheet peak);
  engine    a random-weight 1.5B-shaped checkpoint on disk (tokenizer of the bundled model plus |<MASK>|):
            our AR (static+graphs, and eager) vs transformers generate() on the same weights, batch 1 and 8,
            fixed length, same tokens counted; diffusion at forced parallelism (threshold 1.0 = 1 token per
            forward, and 1e-9 = the whole sub-block) vs AR; TTFT; peak GPU memory;
  bundled   the bundled SmolLM2-135M + adapter (when its weights can be loaded there): diffusion vs AR on real
            prompts, greedy, dual cache, static vs eager.
  clients   the bundled model again: N clients at once through the engine's scheduler (continuous batching on the
            static path, graphs per row bucket) against the same N one after another; tok/s, TTFT from each
            submit, answers equal to the single-user ones (bench/gpu_clients.py).
Ratios come from one process and interleaved repeats (round r of every setting, then round r + 1).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from .common import NEVER_STOP, PeakMemory, load_prompts, setup_torch, table, write_json
from .roofline import NOMINAL_PEAK_GBPS, SHAPES, forward_at_width, probe_bandwidth, timed, weight_bytes

GPU_TOKENIZER = Path(__file__).resolve().parent.parent / ".gpu" / "tokenizer"
TINY = dict(vocab_size=49216, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=True, rope_theta=1e6)


def shape_cfg(name: str) -> dict[str, Any]:
    return TINY if name == "tiny" else SHAPES[name]


def random_weights(shape: str, device: torch.device, dtype: torch.dtype):
    """Our CausalLM with N(0, 0.02) weights (HF's initializer_range) and unit norms, in the plain layout: unlike
    roofline.random_model (default init, packed on CPU) its logits are sane in bf16 and it saves as a checkpoint."""
    from engine.config import ModelConfig
    from engine.model import CausalLM

    with torch.device(device):
        model = CausalLM(ModelConfig(**shape_cfg(shape)))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype).eval().requires_grad_(False)


def static_at_width(model, k: int, prefix: int, device: torch.device, iters: int, compile: bool = False,
                    logits: list | None = None) -> float:
    """Median seconds of one static-stepper step of width k (a CUDA graph replay on GPUs); with `compile`, its
    layers under torch.compile (the first step's compile is not timed: `timed` warms up). `logits` gets the
    step's output (same ids every call: the seed is fixed), to compare compiled with uncompiled."""
    from engine.static import StaticStepper

    stepper = StaticStepper(model, graphs=device.type == "cuda", compile=compile)
    with torch.inference_mode():
        cache = stepper.new_cache(1, prefix + 64)
        ids = torch.randint(0, 1000, (1, k), device=device, generator=torch.Generator(device).manual_seed(k))
        pos = (prefix + torch.arange(k, device=device))[None]
        idx = torch.arange(k, device=device)[None]
        sec = timed(lambda: stepper.step(ids, pos, cache, [prefix + k], idx, width=k), device, iters)
        if logits is not None:
            logits.append(stepper.step(ids, pos, cache, [prefix + k], idx, width=k).float().clone())
    if stepper.compile_error:
        raise RuntimeError(f"compile: {stepper.compile_error}")
    return sec


def section_roofline(shape: str, args, dev: torch.device, dtype: torch.dtype, gbps: float, peak: float | None):
    model = random_weights(shape, dev, dtype)
    wbytes = weight_bytes(model)
    roof_s = wbytes / (gbps * 1e9)
    rows = []
    for k in [int(w) for w in args.widths.split(",")]:
        eager = forward_at_width(model, k, args.prefix, dev, dtype, args.iters)
        outs: list = []
        static = static_at_width(model, k, args.prefix, dev, args.iters, logits=outs)
        rows.append({"k": k, "eager_ms": 1000 * eager, "static_ms": 1000 * static,
                     "static_of_probe": roof_s / static, "static_of_peak": wbytes / static / 1e9 / peak if peak else None,
                     "eager_of_probe": roof_s / eager})
        if args.compile:  # the same step with its layers compiled (FASTDLLM_COMPILE), first step's compile timed
            t0 = time.perf_counter()
            try:
                comp = static_at_width(model, k, args.prefix, dev, args.iters, compile=True, logits=outs)
                diff = (outs[1] - outs[0]).abs().max().item() / outs[0].abs().max().item()
                same = (outs[1].argmax(-1) == outs[0].argmax(-1)).float().mean().item()
                rows[-1].update(compiled_ms=1000 * comp, compiled_of_probe=roof_s / comp,
                                compiled_x_static=comp / static, compile_and_time_s=time.perf_counter() - t0,
                                compiled_max_diff_of_max_logit=diff, compiled_same_argmax=same)
            except Exception as exc:  # noqa: BLE001 - recorded; the uncompiled numbers stand
                rows[-1]["compile_error"] = f"{type(exc).__name__}: {exc}"[:800]
        print(f"[roofline] {shape} k={k}: " + json.dumps({x: (round(y, 4) if isinstance(y, float) else y)
                                                          for x, y in rows[-1].items()}), flush=True)
    one = rows[0]["static_ms"]
    for r in rows:
        r["static_x_k1"] = r["static_ms"] / one
    del model
    return {"shape": shape, "weight_bytes": wbytes, "roof_ms": 1000 * roof_s, "widths": rows}


def write_checkpoint(shape: str, out: Path, dtype: torch.dtype, device: torch.device, eos_id: int | None = None) -> Path:
    """Random weights of `shape` as a checkpoint that our loader and transformers both read (model_type qwen2)."""
    from safetensors.torch import save_file

    c = shape_cfg(shape)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
           "num_hidden_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
           "num_key_value_heads": c["num_key_value_heads"], "vocab_size": c["vocab_size"],
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": c.get("rope_theta", 1e6),
           "tie_word_embeddings": c["tie_word_embeddings"], "use_sliding_window": False, "attention_dropout": 0.0,
           "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": 0, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    model = random_weights(shape, device, dtype)
    state = {k: v.contiguous().cpu() for k, v in model.state_dict().items()
             if not (c["tie_word_embeddings"] and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tokenizer_dir(arg: str | None = None) -> Path:
    """--tokenizer, else .gpu/tokenizer (carried to a GPU machine: README "GPU"), else the bundled model's."""
    if arg:
        return Path(arg)
    if GPU_TOKENIZER.exists():
        return GPU_TOKENIZER
    from engine.weights import ModelSourceError, bundled_base_dir

    try:
        return bundled_base_dir()
    except ModelSourceError as exc:  # GPU block 2's call 1 ran the CUDA tests without '.gpu': 4 errors, not this hint
        raise ModelSourceError(f"tokenizer: no {GPU_TOKENIZER.relative_to(GPU_TOKENIZER.parent.parent)} and no bundled "
                               "model here; run `python -m bench gpu --prepare` and carry '.gpu' with the device "
                               f"command, or pass --tokenizer DIR ({exc})") from exc


def checkpoint(shape: str, out: Path, tokenizer_dir: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """write_checkpoint plus a tokenizer (the bundled model's, with |<MASK>| added) so the engine can load it."""
    from transformers import AutoTokenizer

    from engine.weights import MASK_TOKEN

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    if len(tok) > shape_cfg(shape)["vocab_size"]:
        raise SystemExit(f"--tokenizer: {len(tok)} tokens do not fit the {shape} vocabulary")
    tok.save_pretrained(str(out))
    return write_checkpoint(shape, out, dtype, device, tok.convert_tokens_to_ids("<|im_end|>"))


def run_ours(eng, ids: list[list[int]], cfg) -> dict[str, Any]:
    peak = PeakMemory(eng.lm.device)
    peak.reset()
    t = time.perf_counter()
    res = eng.generate_ids(ids, cfg, record=False)
    secs = time.perf_counter() - t
    toks = sum(r.summary.answer_tokens for r in res)
    nfe = max(r.summary.nfe for r in res)
    return {"seconds": secs, "tokens": toks, "tok_s": toks / secs, "nfe": nfe, "tokens_per_forward": toks / len(ids) / nfe,
            "ttft_s": statistics.median(r.summary.ttft for r in res), "peak_mb": peak.peak_mb(),
            "token_ids": [r.summary.token_ids for r in res]}


def run_hf(hf, ids: list[list[int]], n: int) -> dict[str, Any]:
    peak = PeakMemory(hf.device)
    peak.reset()
    rows = hf.generate_ids(ids, n, ignore_eos=True)
    secs = rows[0].seconds
    toks = sum(r.answer_tokens for r in rows)
    return {"seconds": secs, "tokens": toks, "tok_s": toks / secs, "nfe": n, "tokens_per_forward": 1.0,
            "ttft_s": rows[0].ttft, "peak_mb": peak.peak_mb(), "token_ids": [r.token_ids for r in rows]}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two decodes share before their first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def interleaved(settings: dict[str, Callable[[], dict[str, Any]]], repeats: int) -> dict[str, dict[str, Any]]:
    """Round r of every setting, then r + 1; the median-time repeat of each setting is reported."""
    for fn in settings.values():  # warm-up: graph capture, cuBLAS handles, allocator
        fn()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in settings}
    for _ in range(repeats):
        for name, fn in settings.items():
            runs[name].append(fn())
    out = {}
    for name, rs in runs.items():
        rs.sort(key=lambda r: r["seconds"])
        out[name] = rs[(len(rs) - 1) // 2]
    return out


def section_engine(args, dev: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path) -> dict[str, Any]:
    from engine import Engine
    from engine.loading import load

    from .hf_baseline import HFBaseline

    path = checkpoint(args.engine_shape, work / args.engine_shape, tokenizer_dir, dtype, dev)
    lm = load(str(path), str(dev), str(dtype).removeprefix("torch."))
    static, eager = Engine(lm, static=True), Engine(lm, static=False)
    hf = HFBaseline(static)
    gen = torch.Generator().manual_seed(0)
    n = args.new_tokens
    out: dict[str, Any] = {"shape": args.engine_shape, "new_tokens": n, "prompt_len": args.prompt_len, "batches": {}}
    for bsz in [int(b) for b in args.batch_sizes.split(",")]:
        ids = torch.randint(100, 5000, (bsz, args.prompt_len), generator=gen).tolist()  # equal lengths: no HF padding
        ar = static.decode_config(mode="ar", max_new_tokens=n, stop_token_ids=(NEVER_STOP,))
        settings = {"ar_static": lambda: run_ours(static, ids, ar), "ar_eager": lambda: run_ours(eager, ids, ar),
                    "transformers": lambda: run_hf(hf, ids, n)}
        if bsz == 1:
            for name, thr in (("diffusion_t1", 1.0), ("diffusion_all", 1e-9)):
                d = static.decode_config(mode="diffusion", cache="dual", threshold=thr, max_new_tokens=n,
                                         stop_token_ids=(NEVER_STOP,))
                settings[name] = lambda d=d: run_ours(static, ids, d)
        res = interleaved(settings, args.repeats)
        ref = res["ar_static"]
        summary = {}
        for name, r in res.items():
            row = {k: v for k, v in r.items() if k != "token_ids"}
            row["x_transformers"] = r["tok_s"] / res["transformers"]["tok_s"]
            row["x_ar_static"] = r["tok_s"] / ref["tok_s"]
            if name.startswith("diffusion"):  # issue 11's target: diffusion / AR >= 0.8 x tokens per forward
                row["overhead_ratio"] = row["x_ar_static"] / r["tokens_per_forward"]
            summary[name] = row
        summary["same_tokens_ar_static_vs_transformers"] = sum(
            a == b for a, b in zip(res["ar_static"]["token_ids"], res["transformers"]["token_ids"]))
        summary["same_tokens_ar_static_vs_eager"] = sum(
            a == b for a, b in zip(res["ar_static"]["token_ids"], res["ar_eager"]["token_ids"]))
        # whole-row identity is all-or-nothing; in bf16 on random weights (near-tied logits) rows part somewhere,
        # so also report how far they agree: tokens before the first difference, per row
        for other in ("transformers", "ar_eager"):
            summary[f"common_prefix_ar_static_vs_{other}"] = [
                common_prefix(a, b) for a, b in zip(res["ar_static"]["token_ids"], res[other]["token_ids"])]
        out["batches"][str(bsz)] = summary
    out["graphs_captured"] = sum(s.captured for s in static._steppers.values())
    out["graph_errors"] = [s.graph_error for s in static._steppers.values() if s.graph_error]
    del hf, static, eager, lm
    return out


def section_bundled(args, dev: torch.device) -> dict[str, Any]:
    from engine import Engine
    from engine.loading import load
    from engine.weights import ModelSourceError, bundled_base_dir

    try:
        bundled_base_dir()
    except ModelSourceError as exc:  # no GGUF on this machine (see training/README.md for carrying it)
        return {"skipped": str(exc)}
    lm = load(None, str(dev), None)
    static, eager = Engine(lm, static=True), Engine(lm, static=False)
    prompts = load_prompts(args.prompts, args.bundled_prompts)
    ids = [static.encode(static.chat_prompt([{"role": "user", "content": p}])) for p in prompts]
    res: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        if i and time.perf_counter() - t0 > args.bundled_seconds:  # block 2: 8 prompts ran past a 110 s timeout
            break
        settings = {}
        for name, eng in (("static", static), ("eager", eager)):
            for mode in ("ar", "diffusion"):
                cfg = eng.decode_config(mode=mode, cache="dual", threshold=0.9, max_new_tokens=args.bundled_tokens)
                settings[f"{mode}_{name}"] = lambda e=eng, c=cfg: run_ours(e, [p], c)
        for name, r in interleaved(settings, 1).items():
            res.setdefault(name, []).append(r)
    done = len(next(iter(res.values())))
    out: dict[str, Any] = {"model": lm.banner(), "prompts": done, "prompts_asked": len(ids),
                           "max_new_tokens": args.bundled_tokens, "budget_s": args.bundled_seconds}
    for name, rs in res.items():
        toks, secs, nfe = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs), sum(r["nfe"] for r in rs)
        out[name] = {"tokens": toks, "seconds": secs, "tok_s": toks / secs, "nfe": nfe, "tokens_per_forward": toks / nfe,
                     "ttft_s": statistics.median(r["ttft_s"] for r in rs), "peak_mb": max(r["peak_mb"] for r in rs)}
    for kind in ("static", "eager"):
        d, a = out[f"diffusion_{kind}"], out[f"ar_{kind}"]
        out[f"diffusion_vs_ar_{kind}"] = d["tok_s"] / a["tok_s"]
        out[f"overhead_ratio_{kind}"] = d["tok_s"] / a["tok_s"] / d["tokens_per_forward"]
    out["same_tokens_static_vs_eager"] = {m: sum(x["token_ids"] == y["token_ids"] for x, y in zip(res[f"{m}_static"], res[f"{m}_eager"]))
                                          for m in ("ar", "diffusion")}
    return out


def plot(report: dict[str, Any], out: Path) -> list[str]:
    """roofline.png: ms per forward against k for each shape, eager and static, with the roof."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for sec in report.get("roofline", []):
        if "widths" not in sec:
            continue
        ks = [r["k"] for r in sec["widths"]]
        line, = ax.plot(ks, [r["static_ms"] for r in sec["widths"]], "o-", label=f"{sec['shape']} static/graphs")
        ax.plot(ks, [r["eager_ms"] for r in sec["widths"]], "x--", color=line.get_color(), label=f"{sec['shape']} eager")
        ax.axhline(sec["roof_ms"], color=line.get_color(), lw=0.8, ls=":", label=f"{sec['shape']} HBM roof (probe)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query tokens per forward (k)")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"{report['device']} · {report['dtype']} · prefix {report['prefix']}")
    ax.legend(fontsize=7)
    path = out / "roofline.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [str(path)]


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="all GPU measurements of issue 11 in one run (--smoke: toy size on CPU)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=None, help="directory for gpu.json (+ roofline.png)")
    p.add_argument("--prepare", action="store_true",
                   help="only copy the bundled tokenizer to .gpu/tokenizer, to carry to a GPU machine (3.5 MB)")
    p.add_argument("--smoke", action="store_true", help="toy shapes, few tokens, any device: a rehearsal")
    p.add_argument("--device", default=None, help="default: cuda when present")
    p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b", help="roofline shapes (random bf16 weights)")
    p.add_argument("--widths", default="1,2,4,8,9,16,32", help="k query tokens per forward (9 = dual sub-step)")
    p.add_argument("--prefix", type=int, default=512, help="cached tokens before the query")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--compile", action="store_true",
                   help="roofline: also time each static step with its layers under torch.compile (FASTDLLM_COMPILE)")
    p.add_argument("--engine-shape", default="qwen2.5-1.5b", help="shape of the random checkpoint for AR vs generate()")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: .gpu/tokenizer, else the bundled model's)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", default=str(Path(__file__).parent / "data" / "long_answer.jsonl"))
    p.add_argument("--bundled-prompts", type=int, default=8)
    p.add_argument("--bundled-tokens", type=int, default=128)
    p.add_argument("--bundled-seconds", type=float, default=60.0,
                   help="bundled section: start no new prompt after this many seconds (the first always runs)")
    p.add_argument("--clients", type=int, default=8, help="clients section: requests at once")
    p.add_argument("--clients-check-dtype", default="float32",
                   help="clients section: run again in this dtype when the engine's differs (bf16 on CUDA), to tell "
                        "rounding from a batching bug where batched answers differ from single-user ones ('' skips)")
    p.add_argument("--sections", default="roofline,engine,bundled,clients")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=main)


def prepare() -> int:
    """Here, before a GPU block: the tokenizer files the engine section needs (no model weights)."""
    import shutil

    from engine.weights import bundled_base_dir

    src = bundled_base_dir()
    GPU_TOKENIZER.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, GPU_TOKENIZER / f.name)
    print(f"wrote {GPU_TOKENIZER} (carry '.gpu' with the device command)")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.prepare:
        return prepare()
    if not args.out:
        raise SystemExit("--out: a directory is needed (e.g. --out $OUT/gpu)")
    setup_torch(args.threads)
    if args.smoke:
        args.shapes, args.engine_shape, args.widths, args.iters, args.prefix = "tiny", "tiny", "1,9,32", 2, 64
        args.new_tokens, args.prompt_len, args.repeats, args.batch_sizes = 8, 16, 1, "1,2"
        args.bundled_prompts, args.bundled_tokens, args.clients = 1, 4, 2
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    peak = next((v for k, v in NOMINAL_PEAK_GBPS.items() if gpu and k in gpu), None)
    t0 = time.perf_counter()
    gbps = probe_bandwidth(dev, dtype, (64 if args.smoke else 1024) * 2**20, args.iters)
    report: dict[str, Any] = {
        "command": " ".join(sys.orig_argv),
        "device": gpu or "cpu", "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
        "cuda": torch.version.cuda, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "prefix": args.prefix,
        "probe_gbps": gbps, "nominal_peak_gbps": peak, "errors": {}}
    sections = args.sections.split(",")

    def guarded(name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # one failing section must not lose the others' numbers on a scarce GPU
            report["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
            print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
        finally:
            report.setdefault("section_seconds", {})[name] = time.perf_counter() - t
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            write_json(out / "gpu.json", report)  # after every section: a run cut off by a limit keeps what it has

    if "roofline" in sections:
        report["roofline"] = [r for s in args.shapes.split(",")
                              if (r := guarded(f"roofline:{s}", lambda s=s: section_roofline(s, args, dev, dtype, gbps, peak)))]
        for sec in report["roofline"]:
            print(f"{sec['shape']} · {report['device']} · weights {sec['weight_bytes'] / 1e9:.2f} GB · "
                  f"probe {gbps:.0f} GB/s · roof {sec['roof_ms']:.3f} ms")
            print(table(sec["widths"], [("k", "k"), ("eager_ms", "eager ms"), ("static_ms", "static ms"),
                                        ("static_of_probe", "static of roof"), ("static_x_k1", "x k=1")]))
    if "engine" in sections:
        with tempfile.TemporaryDirectory() as work:
            report["engine"] = guarded("engine", lambda: section_engine(args, dev, dtype, tokenizer_dir(args.tokenizer),
                                                                        Path(work)))
        if report["engine"]:
            for bsz, rows in report["engine"]["batches"].items():
                print(f"batch {bsz}:")
                print(table([{"setting": k, **v} for k, v in rows.items() if isinstance(v, dict)],
                            [("setting", "setting"), ("tok_s", "tok/s"), ("tokens_per_forward", "tok/fwd"),
                             ("x_transformers", "x generate()"), ("x_ar_static", "x AR"), ("ttft_s", "TTFT s"),
                             ("peak_mb", "peak MB")]))
    if "bundled" in sections:
        report["bundled"] = guarded("bundled", lambda: section_bundled(args, dev))
    if "clients" in sections:
        from .gpu_clients import section_clients

        report["clients"] = guarded("clients", lambda: section_clients(args, dev))
        if measured := (report["clients"] or {}).get("dtype"):  # section_clients_check: None when dtypes agree
            from .gpu_clients import section_clients_check

            if (check := guarded("clients_check", lambda: section_clients_check(args, dev, measured))) is not None:
                report["clients_check"] = check
    try:
        report["plots"] = plot(report, out) if report.get("roofline") else "none: no roofline section"
    except ImportError as exc:
        report["plots"] = f"none: {exc}"
    report["seconds"] = time.perf_counter() - t0
    write_json(out / "gpu.json", report)
    print(f"wrote {out / 'gpu.json'} in {report['seconds']:.0f} s; errors: {sorted(report['errors']) or 'none'}")
    return 1 if report["errors"] else 0
