"""How close a decode forward is to the memory-bandwidth roof, and what that bounds.

A decode forward at small width reads every weight once, so its floor is weight_bytes / bandwidth.
This measures, in one process:
  * the machine's streaming bandwidth: a matrix-vector product over a large weight-shaped matrix
    (what an AR step is made of), median of repeats;
  * the engine's forward at forced parallelism k (k query tokens against a cached prefix, LM head on all
    k): ms per forward, achieved bandwidth = weight bytes x forwards/s, as a fraction of the probe and of
    the device's nominal peak (GPUs in NOMINAL_PEAK_GBPS, or --peak-gbps); tokens/s if every forward
    committed k tokens;
  * with --hf (engine-loaded models): transformers' forward step and generate() per token on the same
    weights and dtype, so generate()'s own per-step overhead is measured, and with it the most any
    decoding loop can gain over generate() without a faster forward (generate per token / roof time).
Models: the engine's (--model, default bundled base + adapter) or random weights of a named shape
(--shape qwen2.5-1.5b): the forward's cost does not depend on the values.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .common import environment, load_engine, setup_torch, subcommand, table, write_json

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         attention_bias=False, model_type="llama"),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,
                         attention_bias=True, rope_theta=1e6),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                       attention_bias=True, rope_theta=1e6),
}
# Datasheet HBM bandwidth, GB/s (a measured probe is reported beside it).
NOMINAL_PEAK_GBPS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0, "H200": 4800.0,
                     "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100-PCIE-40GB": 1555.0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() over iters calls after warm-up."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one forward streams: distinct parameters, minus the embedding table when the LM head is a
    separate tensor (a lookup reads only the query's rows). 4-bit models: what their narrow forward streams."""
    from engine.weights.quant import narrow_bytes

    four_bit = narrow_bytes(model)
    if four_bit is not None:
        return four_bit
    embed = model.model.embed_tokens.weight
    head = [p for n, p in model.named_parameters() if n.startswith("lm_head.")]
    skip = {embed.data_ptr()} if all(p.data_ptr() != embed.data_ptr() for p in head) else set()
    seen, total = set(skip), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def probe_bandwidth(device: torch.device, dtype: torch.dtype, nbytes: int, iters: int) -> float:
    """GB/s of one matrix-vector product over about nbytes of weights (the AR step's access pattern),
    the faster of the two layouts ([out, in] as nn.Linear stores it, [in, out] as the CPU decode layout)."""
    cols = 1024
    rows = max(1, nbytes // (cols * torch.finfo(dtype).bits // 8))
    w = torch.randn(rows, cols, device=device, dtype=dtype)
    x = torch.randn(cols, device=device, dtype=dtype)
    with torch.inference_mode():
        sec = timed(lambda: torch.mv(w, x), device, iters)
        w = w.t().contiguous()  # [cols, rows]: x @ w streams rows of w
        sec = min(sec, timed(lambda: torch.matmul(x, w), device, iters))
    return w.numel() * w.element_size() / sec / 1e9


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    from engine.config import ModelConfig
    from engine.model import CausalLM

    cfg = ModelConfig(**SHAPES[shape])
    with torch.device(device):  # default init is fine: the cost of a forward does not depend on the values
        model = CausalLM(cfg)
    model = model.to(dtype).eval()
    from engine.runtime import Runtime
    from engine.weights import packing

    return packing.pack_for_decode(model) if packing.wanted(device, Runtime.from_env().pack) else model  # as Engine.load does


def forward_at_width(model, k: int, prefix: int, device: torch.device, dtype: torch.dtype, iters: int,
                     heads: int | None = None) -> float:
    """Median seconds of one forward of k query tokens after `prefix` cached ones, LM head on the last `heads` of them
    (None: all k; decoding reads the logits of at most a sub-block)."""
    from engine.model import KVCache

    cache = KVCache(model.cfg, 1, prefix + k + 1, device, dtype)
    ids = torch.randint(0, 1000, (1, k), device=device)
    pos = (prefix + torch.arange(k, device=device))[None]
    idx = torch.arange(k - (heads or k), k, device=device)[None]
    with torch.inference_mode():
        return timed(lambda: model(ids, pos, cache, start=prefix, kv_len=prefix + k, logits_idx=idx), device, iters)


def hf_costs(eng, prefix: int, new_tokens: int, iters: int) -> dict[str, float]:
    """transformers on the same weights: one cached forward step, and generate() per new token."""
    from transformers import DynamicCache, GenerationConfig

    from .hf_baseline import HFBaseline

    hf = HFBaseline(eng)
    dev = hf.device
    prompt = torch.randint(0, 1000, (1, prefix), device=dev)
    with torch.inference_mode():
        def step_cost() -> float:
            cache = DynamicCache()
            out = hf.model(input_ids=prompt, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            return timed(lambda: hf.model(input_ids=tok, past_key_values=cache, use_cache=True), dev, iters)

        step = step_cost()

        def gen(n: int) -> Callable[[], Any]:
            gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                                  pad_token_id=hf.pad_id, eos_token_id=hf.stop_ids)
            return lambda: hf.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                             generation_config=gc)

        per_token = per_new_token(gen, new_tokens, dev, iters)
    return {"hf_step_s": step, "generate_per_token_s": per_token}


def per_new_token(run: Callable[[int], Callable[[], Any]], new_tokens: int, device: torch.device,
                  iters: int) -> float:
    """Seconds per generated token with prefill subtracted: (time for 1 + n tokens - time for 1) / n. The two runs
    alternate and each keeps its fastest time: on a machine whose speed swings between minutes (a shared VM), two
    medians taken one after the other could differ by more than the n tokens cost, and the difference go negative
    (seen: a 2-vCPU Xeon, 2026-11-28)."""
    reps = max(3, iters // 4)
    one, more = run(1), run(new_tokens + 1)
    t1, tn = timed(one, device, 1, warmup=1), timed(more, device, 1, warmup=1)
    for _ in range(reps - 1):
        t1, tn = min(t1, timed(one, device, 1, warmup=0)), min(tn, timed(more, device, 1, warmup=0))
    return (tn - t1) / new_tokens


def engine_ar_per_token(eng, prefix: int, new_tokens: int, iters: int) -> float:
    """Our AR decode loop per new token, measured exactly as generate() is (per_new_token)."""
    from .common import NEVER_STOP

    prompt = [list(range(100, 100 + prefix))]

    def run(n: int) -> Callable[[], Any]:
        cfg = eng.decode_config(mode="ar", max_new_tokens=n, temperature=0.0, stop_token_ids=(NEVER_STOP,))
        return lambda: eng.generate_ids(prompt, cfg, record=False)

    return per_new_token(run, new_tokens, eng.lm.device, iters)


def add_parser(sub) -> None:
    p = subcommand(sub, "roofline", "forward cost vs the memory-bandwidth roof; generate() overhead (--hf)", main)
    p.add_argument("--model", default=None, help="engine model spec (default: bundled base + adapter)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="random weights of this architecture instead of --model")
    p.add_argument("--which", choices=("dllm", "base"), default="dllm",
                   help="engine models: time the dLLM's forward or the AR base's (on CPU only the base is packed)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: the engine's)")
    p.add_argument("--widths", default="1,2,4,8,16,32", help="query tokens per forward (forced parallelism k)")
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before the query")
    p.add_argument("--iters", type=int, default=20, help="timed repeats per measurement (median)")
    p.add_argument("--probe-mb", type=int, default=512, help="size of the bandwidth probe's matrix")
    p.add_argument("--peak-gbps", type=float, default=None, help="nominal peak bandwidth (GPUs: from a table)")
    p.add_argument("--hf", action="store_true", help="also time transformers' step and generate() (engine models)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per generate() run for the per-token cost")
    

def main(args: argparse.Namespace) -> int:
    setup_torch(args.threads)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    eng = None
    if args.shape:
        dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
        model, name = random_model(args.shape, dev, dtype), f"{args.shape} (random weights)"
    else:
        eng = load_engine(args.model, args.dtype, str(dev))
        model = eng.lm.base if args.which == "base" else eng.lm.dllm
        name, dtype = f"{eng.lm.banner()} · {args.which}", eng.lm.dtype
    wbytes = weight_bytes(model)
    gbps = probe_bandwidth(dev, dtype, args.probe_mb * 2**20, args.iters)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    peak = args.peak_gbps or next((v for k, v in NOMINAL_PEAK_GBPS.items() if gpu and k in gpu), None)
    roof_s = wbytes / (gbps * 1e9)
    rows = []
    for k in [int(w) for w in args.widths.split(",")]:
        sec = forward_at_width(model, k, args.prefix, dev, dtype, args.iters)
        achieved = wbytes / sec / 1e9
        rows.append({"k": k, "ms_per_forward": 1000 * sec, "forwards_per_s": 1 / sec, "tokens_per_s_at_k": k / sec,
                     "achieved_gbps": achieved, "of_probe": achieved / gbps,
                     "of_peak": achieved / peak if peak else None, "x_roof": sec / roof_s})
    report: dict[str, Any] = {
        "model": name, "device": gpu or "cpu", "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "weight_bytes": wbytes, "prefix": args.prefix,
        "probe_gbps": gbps, "nominal_peak_gbps": peak, "roof_ms": 1000 * roof_s, "widths": rows}
    print(f"{name} · {report['device']} · {report['dtype']} · weights {wbytes / 1e6:.0f} MB · probe {gbps:.1f} GB/s"
          + (f" · nominal peak {peak:.0f} GB/s" if peak else "") + f" · roof {1000 * roof_s:.2f} ms/forward")
    print(table([{**r, "of_peak": r["of_peak"] if r["of_peak"] is not None else "-"} for r in rows],
                [("k", "k tok/fwd"), ("ms_per_forward", "ms/fwd"), ("tokens_per_s_at_k", "tok/s at k"),
                 ("achieved_gbps", "GB/s"), ("of_probe", "of probe"), ("of_peak", "of peak"), ("x_roof", "x roof")]))
    if args.hf:
        if eng is None:
            raise SystemExit("--hf: needs an engine model (--model), not --shape")
        hf = hf_costs(eng, args.prefix, args.new_tokens, args.iters)
        ours = engine_ar_per_token(eng, args.prefix, args.new_tokens, args.iters)
        gen = hf["generate_per_token_s"]
        hf.update({"engine_ar_per_token_s": ours, "generate_overhead_per_token_s": gen - hf["hf_step_s"],
                   "engine_vs_generate": gen / ours, "max_gain_over_generate_at_roof": gen / roof_s})
        report["hf"] = hf
        print(f"transformers forward step {1000 * hf['hf_step_s']:.2f} ms · generate() {1000 * gen:.2f} ms/token "
              f"(overhead {1000 * (gen - hf['hf_step_s']):.2f} ms) · our AR loop {1000 * ours:.2f} ms/token "
              f"({gen / ours:.2f}x generate) · a loop at the roof would be {gen / roof_s:.2f}x generate")
    if eng is not None:
        report["environment"] = environment(eng)
    if args.out:
        write_json(Path(args.out) / "roofline.json", report)
    return 0
