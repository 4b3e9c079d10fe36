"""`bench gpu`'s clients section: N requests at once through the engine's one front door (the Driver: continuous
batching, static steps, CUDA graphs per row bucket on a GPU) against the same N requests one after another.

What a deployer asks (issues 22 and 24): aggregate tokens/s with N clients, each client's time to its first
token counted from its own submit, whether the answers are the single-user ones, and whether graphs were captured.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from .common import load_prompts


def _one(driver, ids: list[int], cfg, t0: float | None = None) -> tuple[Any, dict[str, Any]]:
    """Submit one request (timed from t0, default now); returns its ticket and a dict the listener fills."""
    t0 = time.perf_counter() if t0 is None else t0
    seen: dict[str, Any] = {"t0": t0, "first": None}

    def listener(e) -> None:
        if seen["first"] is None and e.committed:
            seen["first"] = time.perf_counter()

    return driver.submit(ids, cfg, listener=listener, record=False), seen


def _finish(ticket, seen: dict[str, Any]) -> dict[str, Any]:
    res = ticket.wait()
    end = time.perf_counter()
    first = seen["first"] if seen["first"] is not None else end
    return {"tokens": res.summary.answer_tokens, "ttft_s": first - seen["t0"], "seconds": end - seen["t0"],
            "nfe": res.summary.nfe, "token_ids": res.summary.token_ids}


def alone(driver, ids: list[list[int]], cfg) -> list[dict[str, Any]]:
    """Each request waits for the previous one: what a single user sees."""
    return [_finish(*_one(driver, x, cfg)) for x in ids]


def together(driver, ids: list[list[int]], cfg) -> tuple[float, list[dict[str, Any]]]:
    """Every request submitted at once; wall seconds until the last one ends, and each one's numbers."""
    t0 = time.perf_counter()
    subs = [_one(driver, x, cfg, t0) for x in ids]
    rows = [_finish(*s) for s in subs]
    return time.perf_counter() - t0, rows


def summarize(alone_rows: list[dict[str, Any]], wall: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    one_s = sum(r["seconds"] for r in alone_rows)
    one_tok = sum(r["tokens"] for r in alone_rows)
    tok = sum(r["tokens"] for r in rows)
    return {"one_by_one": {"tokens": one_tok, "seconds": one_s, "tok_s": one_tok / one_s,
                           "ttft_median_s": statistics.median(r["ttft_s"] for r in alone_rows)},
            "together": {"tokens": tok, "seconds": wall, "tok_s": tok / wall,
                         "ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
                         "ttft_max_s": max(r["ttft_s"] for r in rows),
                         "tokens_per_forward": tok / max(sum(r["nfe"] for r in rows), 1)},
            "speedup": (tok / wall) / (one_tok / one_s),
            "same_answers": sum(a["token_ids"] == b["token_ids"] for a, b in zip(alone_rows, rows))}


def section_clients(args, dev) -> dict[str, Any]:
    from engine import Engine
    from engine.loading import load
    from engine.weights import ModelSourceError, bundled_base_dir

    try:
        bundled_base_dir()
    except ModelSourceError as exc:  # no GGUF on this machine (training/README.md says how to carry it)
        return {"skipped": str(exc)}
    return measure(Engine(load(None, str(dev), None), static=True), args)


def section_clients_check(args, dev, measured_dtype: str) -> dict[str, Any] | None:
    """Batched answers that differ from the single-user ones (block 4, an H200: 5 of 8 in diffusion, bf16) are either
    rounding (a batch of 8 runs other kernels than a batch of 1, and a 0.9 threshold turns a near-tie into another
    commit) or a batching bug. The same clients in the exact dtype tell them apart: equal there, it was rounding.
    A section of its own, after `clients`: a run cut off here keeps the measured one (gpu.json is written between)."""
    from engine import Engine
    from engine.loading import load

    check = args.clients_check_dtype
    if not check or check == measured_dtype:
        return None
    exact = measure(Engine(load(None, str(dev), check), static=True), args)
    return {k: exact[k] for k in ("dtype", "graphs")} | {
        m: {"same_answers": exact[m]["same_answers"], "speedup": exact[m]["speedup"]} for m in ("ar", "diffusion")}


def measure(eng, args) -> dict[str, Any]:
    """AR and diffusion (dual cache, threshold 0.9): the clients one after another, then all at once."""
    n = args.clients
    prompts = load_prompts(args.prompts, n)
    ids = [eng.encode(eng.chat_prompt([{"role": "user", "content": p}])) for p in prompts]
    driver = eng.start_scheduler(max_batch=max(n, 8))
    out: dict[str, Any] = {"model": eng.lm.banner(), "dtype": str(eng.lm.dtype).removeprefix("torch."),
                           "clients": len(ids), "max_new_tokens": args.bundled_tokens}
    try:
        for mode in ("ar", "diffusion"):
            cfg = eng.decode_config(mode=mode, cache="dual", threshold=0.9, max_new_tokens=args.bundled_tokens)
            together(driver, ids, cfg)  # warm-up: the row buckets' shapes (graphs captured on CUDA)
            alone(driver, ids[:1], cfg)
            one = alone(driver, ids, cfg)
            wall, rows = together(driver, ids, cfg)
            out[mode] = summarize(one, wall, rows)
        out["graphs"] = eng.graphs_report()
        out["forwards"] = driver.forwards
    finally:
        eng.close_scheduler()
    return out
