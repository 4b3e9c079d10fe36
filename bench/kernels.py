"""The CPU kernels a forward is made of, alone: what they bound before any model code runs.

For each projection shape of the bundled model (fused q|k|v, o, gate|up, down) and each row count k, times:
  * torch's int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`, group 32) with bf16 activations: the 4-bit path;
  * dense bf16 and fp32 products (`F.linear`) on the same shape;
  * our kernels (engine/weights/csrc/q4.cpp) where this CPU has them: the 4-bit weights with fp32 activations (`q4_f32`,
    the engine's narrow calls), bf16 ones (`q4_bf16`, wide calls; AVX-512 BF16) and int8 ones per row and 32-group on
    a 16-output interleave (`q4_i8w`: FASTDLLM_WIDE_ACTIVATIONS=int8's wide calls, FASTDLLM_ACTIVATIONS=int8's
    narrow ones), with each kernel's multiply-add rate (GMAC/s);
  * the whole model's weights streamed cold: one pass over a weight set larger than the caches, so the dense
    bf16 numbers can be read against DRAM bandwidth (a forward's weights do not stay in cache between forwards).
Reported as microseconds (median of --repeats, each the mean of --iters calls) and as multiples of the same
kernel's k = 1 time: a forward at width k cannot cost less than its kernels, so these ratios bound issue
"CPU decoding at llama.cpp speed"'s k-token targets on this machine. JSON to --out.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .common import parse_list, setup_torch, subcommand, table, write_json

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down_proj": (576, 1536)}  # (out, in)
GROUP = 32


def _time(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters)
    return statistics.median(runs) * 1e6


def kernel_table(widths: list[int], iters: int, repeats: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows per (shape, k) and the kernel kinds timed (our kernels only where this CPU builds them)."""
    from engine.weights import kernels as cpu_kernels
    from engine.weights.quant import pack_pairs, tiled

    from engine.runtime import Runtime

    ours = cpu_kernels.load(Runtime.from_env().kernels)
    kinds = ["int4", "bf16", "fp32"] + (["q4_f32", "q4_i8w"] if ours is not None else []) \
        + (["q4_bf16"] if ours is not None and cpu_kernels.bf16_ok() else [])
    rows = []
    for name, (out, inp) in SHAPES.items():
        q = torch.randint(0, 16, (out, inp), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = (torch.rand(inp // GROUP, out, 2) * 0.01).bfloat16()
        w32 = torch.randn(out, inp) * 0.02
        w16 = w32.bfloat16()
        if ours is not None:  # the engine's layout of the same 4-bit weights
            qs = pack_pairs(q.to(torch.uint8))
            d, m = torch.rand(out, inp // GROUP) * 0.01, -torch.rand(out, inp // GROUP) * 0.08
            dm = tiled(torch.stack([d, m], -1).half(), inp // GROUP)
        for k in widths:
            x32 = torch.randn(k, inp)
            x16 = x32.bfloat16()
            fns = {"int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, packed, GROUP, sz),
                   "bf16": lambda: F.linear(x16, w16), "fp32": lambda: F.linear(x32, w32)}
            if ours is not None:
                fns.update({"q4_f32": lambda: ours.q4_f32(x32, qs, dm),
                            "q4_bf16": lambda: ours.q4_bf16(x32, qs, dm), "q4_i8w": lambda: ours.q4_i8w(x32, qs, dm)})
            row: dict[str, Any] = {"shape": name, "out": out, "in": inp, "k": k}
            for kind in kinds:
                row[f"{kind}_us"] = _time(fns[kind], iters, repeats)
                row[f"{kind}_gmacs"] = k * out * inp / row[f"{kind}_us"] / 1e3
            rows.append(row)
    for r in rows:
        base = next(b for b in rows if b["shape"] == r["shape"] and b["k"] == widths[0])
        for kind in kinds:
            r[f"{kind}_x_k{widths[0]}"] = r[f"{kind}_us"] / base[f"{kind}_us"]
    return rows, kinds


def cold_stream_gbps(mb: int, repeats: int) -> float:
    """bf16 matrix-vector products over `mb` MB of weights in 64 pieces (cache-cold, like a forward's)."""
    pieces = [torch.randn(2048, mb * 2 ** 20 // 64 // 2048 // 2).bfloat16() for _ in range(64)]
    x = torch.randn(1, pieces[0].shape[1]).bfloat16()
    nbytes = sum(p.numel() * p.element_size() for p in pieces)
    sec = _time(lambda: [F.linear(x, p) for p in pieces], 1, repeats) / 1e6
    return nbytes / sec / 1e9


def add_parser(sub) -> None:
    p = subcommand(sub, "kernels", "the CPU matmul kernels alone (int4 / bf16 / fp32) by rows k", main)
    p.add_argument("--widths", default="1,2,4,8,9,16,32", help="rows k per product")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stream-mb", type=int, default=512, help="weights streamed for the cold bandwidth probe (0: skip)")
    

def main(args: argparse.Namespace) -> int:
    setup_torch(args.threads)
    widths = parse_list(args.widths, int)
    rows, kinds = kernel_table(widths, args.iters, args.repeats)
    gbps = cold_stream_gbps(args.stream_mb, args.repeats) if args.stream_mb else None
    print(f"threads {torch.get_num_threads()} · median of {args.repeats} x {args.iters} calls"
          + (f" · cold bf16 weight streaming {gbps:.1f} GB/s" if gbps else ""))
    cell = lambda r, kind: f"{r[kind + '_us']:.1f} ({r[f'{kind}_x_k{widths[0]}']:.2f}x)"  # noqa: E731
    heads = {"int4": "int4 us (x k1)", "bf16": "dense bf16 us", "fp32": "dense fp32 us", "q4_f32": "ours fp32-act us",
             "q4_bf16": "ours bf16 us", "q4_i8w": "ours int8-act us"}
    print(table([{"shape": r["shape"], "k": r["k"], **{kind: cell(r, kind) for kind in kinds}} for r in rows],
                [("shape", "shape"), ("k", "rows k"), *((kind, heads[kind]) for kind in kinds)]))
    if args.out:
        path = Path(args.out) / "kernels.json"
        write_json(path, {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "widths": widths, "kinds": kinds,
                          "cold_bf16_stream_gbps": gbps, "rows": rows})
        print(f"wrote {path}")
    return 0
