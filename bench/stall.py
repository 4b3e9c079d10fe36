"""Head-of-line blocking: a short request's time to first token beside a long prompt, chunked prefill on and off.

One in-process Driver per setting (prefill_chunk; "off" = a chunk larger than any prompt, the whole prompt in
one forward), the same engine. Per round: a long prompt (~--long-tokens) is submitted, then after --delay seconds
a short chat request; recorded: the short request's TTFT (submit to its first event), its total time, and the long
prompt's TTFT and total. Rounds interleave the settings (A, B, C, A, B, C, ...); the median round is reported.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from .common import environment, load_engine, parse_list, setup_torch, table, write_json

OFF = 1 << 20  # a chunk no prompt reaches: the whole prompt in one forward


def one_round(engine, sched_chunk: int, long_ids: list[int], short_ids: list[int], cfg, delay: float) -> dict[str, float]:
    from engine.driver import Driver

    first: dict[str, float] = {}
    lock = threading.Lock()

    def mark(name: str, t0: list[float]):
        def on(_e) -> None:
            with lock:
                first.setdefault(name, time.perf_counter() - t0[0])
        return on

    t_long, t_short = [0.0], [0.0]
    sched = Driver(engine, prefill_chunk=sched_chunk)
    try:
        t_long[0] = time.perf_counter()
        long = sched.submit(long_ids, cfg, listener=mark("long", t_long), record=False)
        time.sleep(delay)
        t_short[0] = time.perf_counter()
        short = sched.submit(short_ids, cfg, listener=mark("short", t_short), record=False)
        short.wait(600)
        short_total = time.perf_counter() - t_short[0]
        long.wait(600)
        long_total = time.perf_counter() - t_long[0]
    finally:
        sched.close()
    return {"short_ttft_s": first["short"], "short_total_s": short_total, "long_ttft_s": first["long"],
            "long_total_s": long_total}


def add_parser(sub) -> None:
    p = sub.add_parser("stall", help="a short request's TTFT beside a long prompt, chunked prefill on and off",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--chunks", default="off,512,256", help="prefill_chunk settings (multiples of 64, or 'off')")
    p.add_argument("--long-tokens", type=int, default=4000, help="approximate length of the long prompt")
    p.add_argument("--delay", type=float, default=0.2, help="seconds between the long and the short request")
    p.add_argument("--mode", default="ar", choices=("ar", "diffusion"))
    p.add_argument("--cache", default="block", help="diffusion cache (block or dual; none is never chunked)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None, help="write DIR/stall.json")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    setup_torch(args.threads)
    engine = load_engine(args.model, None)
    filler = "The quick brown fox jumps over the lazy dog. "
    text = "Summarise this text in one sentence. " + filler * max(1, args.long_tokens // 10)
    long_ids = engine.encode(engine.chat_prompt([{"role": "user", "content": text}]))[: args.long_tokens]
    short_ids = engine.encode(engine.chat_prompt([{"role": "user", "content": "Name three colors."}]))
    cfg = engine.decode_config(mode=args.mode, cache=args.cache, max_new_tokens=args.max_new_tokens)
    chunks = {c: (OFF if c == "off" else int(c)) for c in parse_list(args.chunks)}
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in chunks}
    one_round(engine, 512, short_ids * 8, short_ids, cfg, 0.0)  # warm-up: allocator, kernels, tokenizer
    for r in range(args.rounds):
        for name, chunk in chunks.items():
            runs[name].append(one_round(engine, chunk, long_ids, short_ids, cfg, args.delay))
            print(f"[stall] round {r + 1} prefill_chunk={name}: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()), flush=True)
    rows = []
    for name, rs in runs.items():
        med = sorted(rs, key=lambda x: x["short_ttft_s"])[(len(rs) - 1) // 2]
        rows.append({"prefill_chunk": name, **med,
                     "short_ttft_all_s": [x["short_ttft_s"] for x in rs],
                     "long_total_median_s": statistics.median(x["long_total_s"] for x in rs)})
    print(table(rows, [("prefill_chunk", "prefill_chunk"), ("short_ttft_s", "short TTFT s"),
                       ("short_total_s", "short total s"), ("long_ttft_s", "long TTFT s"),
                       ("long_total_median_s", "long total s (median)")]))
    report = {"command": "python -m bench stall " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                            if k not in ("func", "command") and v is not None),
              "long_prompt_tokens": len(long_ids), "short_prompt_tokens": len(short_ids), "mode": args.mode,
              "cache": args.cache, "delay_s": args.delay, "rounds": args.rounds, "order": "interleaved by round",
              "env": environment(engine), "rows": rows}
    if args.out:
        write_json(Path(args.out) / "stall.json", report)
        print(f"wrote {Path(args.out) / 'stall.json'}")
    return 0
