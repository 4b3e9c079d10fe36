"""Per-forward micro-benchmark: the engine's CausalLM on the shapes decoding uses, under speed-up variants.

Every variant starts from the plain nn.Linear layout; "+packed" applies the engine's CPU decode layout.
Shapes (query width x keys): the AR step (1 token), the dual-cache sub-block step (sub_block + 1), the
block-cache step (a whole block), and the no-cache step (the whole prefix, block-causal mask), each
with the LM head on the positions decoding reads (--widths: forced widths k instead, LM head on all k).
Variants: dtype (float32 / bfloat16), torch.compile, or weights=MODE (the bundled GGUF's weights as
engine/weights/quant.py runs them), each timed round-robin with the others (iteration i of every variant, then
i + 1), so a busy machine's drift hits all alike; medians reported, ratios against the first variant.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.runtime import Runtime

from .common import load_engine, setup_torch, table, write_json


def make_variant(model: torch.nn.Module, spec: str) -> torch.nn.Module:
    if spec.startswith("weights="):  # the bundled GGUF's weights as Engine.load builds them (engine/weights/quant.py)
        return quantized(model, spec.removeprefix("weights="))
    parts = spec.split("+")
    m = model
    if "bf16" in parts:
        m = copy.deepcopy(model).to(torch.bfloat16)
    elif "fp16" in parts:
        m = copy.deepcopy(model).to(torch.float16)
    if "packed" in parts:  # the engine's CPU decode layout (engine/weights/packing.py), on a copy
        from engine.weights.packing import pack_for_decode

        m = pack_for_decode(copy.deepcopy(m) if m is model else m)
    if "compile" in parts:
        m = torch.compile(m, dynamic=True)
    return m


def quantized(model: torch.nn.Module, spec: str) -> torch.nn.Module:
    """A copy of the bundled dLLM with FASTDLLM_WEIGHTS=mode[@wide_rows][/act[/wide_act[/prepack]]] weights (LoRA as
    its own path; act = FASTDLLM_ACTIVATIONS of our 4-bit kernels, fp32 or int8; wide_act = FASTDLLM_WIDE_ACTIVATIONS,
    bf16 or int8; prepack = FASTDLLM_INT8_PREPACK, 0 or 1, unset: by size)."""
    from engine.weights import quant
    from engine.weights import BUNDLED_ADAPTER, bundled_base_dir, bundled_gguf_path, read_adapter_tensors

    spec, _, acts = spec.partition("/")
    act, _, wide_act = acts.partition("/")
    wide_act, _, prepack = wide_act.partition("/")
    mode, _, wide = spec.partition("@")
    policy = quant.WeightPolicy(mode, int(wide) if wide else None, act or quant.DEFAULT_ACT,
                                wide_act=wide_act or quant.DEFAULT_WIDE_ACT, prepack={"": None, "0": False, "1": True}[prepack])
    tensors, scale = read_adapter_tensors(BUNDLED_ADAPTER)
    gguf = quant.cached_gguf(bundled_gguf_path(), model.cfg.num_attention_heads, model.cfg.num_key_value_heads,
                             bundled_base_dir() / "q4_1_blocks.safetensors")
    pair = quant.QuantizedPair(gguf, policy)
    return pair.apply(copy.deepcopy(model), quant.read_lora(tensors), scale,
                      tensors.get("extend.model.embed_tokens.weight"))


def shapes(prefix: int, bs: int, sbs: int) -> dict[str, dict[str, Any]]:
    """name -> forward arguments: the cached prefix length stays `prefix` (block aligned)."""
    return {
        "ar (1 tok)": dict(width=1, start=prefix, kv_len=prefix + 1, heads=1),
        f"dual sub-step ({sbs + 1} tok)": dict(width=sbs + 1, start=prefix + bs // 2 - 1, kv_len=prefix + bs, heads=sbs),
        f"block step ({bs} tok)": dict(width=bs, start=prefix, kv_len=prefix + bs, heads=sbs),
        f"no cache ({prefix + bs} tok)": dict(width=prefix + bs, start=None, kv_len=None, heads=sbs),
    }


def call(model, cfg, spec: dict[str, Any], cache, bs: int, dtype) -> None:
    from engine.model import block_causal_mask

    w = spec["width"]
    ids = torch.randint(0, 1000, (1, w))
    idx = torch.arange(w - spec["heads"], w)[None]
    if spec["start"] is None:
        pos = torch.arange(w)[None]
        model(ids, pos, None, mask=block_causal_mask(pos, w, bs), logits_idx=idx)
    else:
        pos = spec["start"] + torch.arange(w)[None]
        model(ids, pos, cache[dtype], start=spec["start"], kv_len=spec["kv_len"], logits_idx=idx)


def add_parser(sub) -> None:
    p = sub.add_parser("forward", help="per-forward time of the decode shapes under dtype / torch.compile variants",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--variants", default="fp32,bf16",
                   help="comma list of fp32, bf16, fp16, each optionally +packed (CPU decode layout) and/or +compile; "
                        "or weights=MODE[@ROWS][/ACT] (the bundled GGUF's weights, FASTDLLM_WEIGHTS modes of engine/weights/quant.py; "
                        "ACT: fp32 or int8 activations of our 4-bit kernels; MODE[@ROWS]/ACT/WIDE_ACT/PREPACK adds the "
                        "wide calls' activations, bf16 or int8, and FASTDLLM_INT8_PREPACK, 0 or 1)")
    p.add_argument("--widths", default=None,
                   help="comma list of forced widths k (k tokens against the cached prefix, LM head on all k) "
                        "instead of the decode shapes")
    p.add_argument("--prefix", type=int, default=160, help="cached prefix tokens (prompt + answer so far)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--sub-block-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from engine.model import KVCache

    setup_torch(args.threads)
    # variants start from the plain layout ("+packed" applies the engine's) and from the dequantised fp32 weights
    # (weights=MODE applies quant)
    eng = load_engine(args.model, None, None, replace(Runtime.from_env(), pack=False, weights="fp32"))
    base = eng.lm.dllm
    specs = args.variants.split(",")
    models = {v: make_variant(base, v) for v in specs}
    dtypes = {v: m.model.norm.weight.dtype for v, m in models.items()}
    n = args.prefix + 2 * args.block_size
    cache = {dt: KVCache(base.cfg, 1, n, torch.device("cpu"), dt) for dt in set(dtypes.values())}
    sh = shapes(args.prefix, args.block_size, args.sub_block_size) if not args.widths else {
        f"k={k}": dict(width=k, start=args.prefix, kv_len=args.prefix + k, heads=k)
        for k in (int(w) for w in args.widths.split(","))}
    times: dict[tuple[str, str], list[float]] = {(v, s): [] for v in specs for s in sh}
    with torch.inference_mode():
        for v in specs:  # warm-up (and compilation) excluded
            for s in sh.values():
                for _ in range(2):
                    call(models[v], base.cfg, s, cache, args.block_size, dtypes[v])
        for _ in range(args.iters):
            for name, s in sh.items():
                for v in specs:
                    t = time.perf_counter()
                    call(models[v], base.cfg, s, cache, args.block_size, dtypes[v])
                    times[(v, name)].append(time.perf_counter() - t)
    rows = []
    for name in sh:
        ref = statistics.median(times[(specs[0], name)])
        row = {"shape": name}
        for v in specs:
            med = statistics.median(times[(v, name)])
            row[v] = f"{1000 * med:.1f} ms" + (f" ({ref / med:.2f}x)" if v != specs[0] else "")
            if args.widths and name != next(iter(sh)):  # cost relative to this variant's 1st width (k = 1)
                row[v] += f" [{med / statistics.median(times[(v, next(iter(sh)))]):.2f}x k1]"
        rows.append(row)
    print(f"{eng.lm.banner()} · threads {torch.get_num_threads()} · prefix {args.prefix} · {args.iters} iters, median")
    print(table(rows, [("shape", "forward shape")] + [(v, v) for v in specs]))
    if args.out:
        write_json(Path(args.out), {
            "threads": torch.get_num_threads(), "prefix": args.prefix,
            "median_ms": {f"{v}|{s}": 1000 * statistics.median(t) for (v, s), t in times.items()}})
    return 0
