"""A multi-turn conversation through the scheduler, prefix cache on and off: each turn's time to first token.

A chat re-sends its whole history every turn, so without a prefix cache every turn prefills everything again. One
in-process Driver per setting and round (a fresh, empty cache), the same engine and prompts: turn 1 asks about a
document of ~--document-tokens tokens, turns 2..N ask follow-ups; each turn's answer (the model's own, greedy) goes
into the next turn's history. Rounds interleave the settings (off, on, off, on, ...). Recorded per turn: prompt
tokens, positions copied from the cache, TTFT (submit to the first answer token), total time and the answer; the
answers of the two settings are compared token for token (the cache must not change any).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from .common import environment, load_engine, parse_list, save_figures, setup_torch, subcommand, table, write_json

QUESTIONS = ("What day did the meeting move to?", "Who is bringing the slides?", "Summarise the notes in one sentence.",
             "What should I prepare before the meeting?", "Write a short reminder email about it.",
             "Thank you. Anything else I should know?")
NOTES = ("Team notes. The planning meeting moved from Monday to Tuesday at ten in room four. Priya brings the slides "
         "and the budget sheet. Marco will present the hiring plan. Everyone should read the quarterly report first. ")


def converse(engine: Any, cfg: Any, mib: int, chunk: int, document: str, turns: int) -> list[dict[str, Any]]:
    from engine.driver import Driver

    messages: list[dict[str, str]] = []
    out = []
    d = Driver(engine, prefill_chunk=chunk, prefix_cache_mib=mib)
    try:
        for i in range(turns):
            q = QUESTIONS[i % len(QUESTIONS)]
            messages.append({"role": "user", "content": (document + "\n\n" + q) if i == 0 else q})
            ids = engine.encode(engine.chat_prompt(messages))
            hit0 = d.prefixes.hit_tokens if d.prefixes else 0
            t0 = time.perf_counter()
            res = d.generate_ids(ids, cfg, record=False)
            total = time.perf_counter() - t0
            s = res.summary
            out.append({"turn": i + 1, "prompt_tokens": len(ids),
                        "reused_tokens": (d.prefixes.hit_tokens - hit0) if d.prefixes else 0,
                        "ttft_s": s.ttft, "total_s": total, "answer_tokens": s.answer_tokens,
                        "stop_reason": s.stop_reason, "token_ids": s.token_ids})
            messages.append({"role": "assistant", "content": s.text})
    finally:
        d.close()
    return out


def add_parser(sub) -> None:
    p = subcommand(sub, "conversation", "a multi-turn chat's time to first token per turn, prefix cache on and off",
                   main, threads=1)
    p.add_argument("--modes", default="ar,diffusion", help="decoding modes (each at the engine's defaults)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--document-tokens", type=int, default=600, help="about how long turn 1's document is")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prefill-chunk", type=int, default=256, help="the scheduler's chunk (the cache's grain)")
    p.add_argument("--cache-mib", type=int, default=512, help="the 'on' setting's capacity")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--no-png", action="store_true")


def main(args: argparse.Namespace) -> int:
    setup_torch(args.threads)
    engine = load_engine(args.model, None)
    document = NOTES * max(1, args.document_tokens // 45)
    settings = {"off": 0, "on": args.cache_mib}
    report: dict[str, Any] = {
        "command": "python -m bench conversation " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("func", "no_png", "command") and v is not None),
        "order": "settings interleaved within each round (off, on), a fresh Driver (empty cache) per conversation",
        "env": environment(engine), "modes": {}}
    rows = []
    for mode in parse_list(args.modes):
        cfg = engine.decode_config(mode=mode, max_new_tokens=args.max_new_tokens)
        converse(engine, cfg, 0, args.prefill_chunk, NOTES, 2)  # warm-up: allocator, kernels, tokenizer
        runs: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in settings}
        for r in range(args.rounds):
            for name, mib in settings.items():
                runs[name].append(converse(engine, cfg, mib, args.prefill_chunk, document, args.turns))
                print(f"[conversation] {mode} round {r + 1} cache {name}: TTFT " +
                      " ".join(f"{t['ttft_s']:.2f}" for t in runs[name][-1]), flush=True)
        equal = all(a["token_ids"] == b["token_ids"] for x, y in zip(runs["off"], runs["on"]) for a, b in zip(x, y))
        turns = []
        for i in range(args.turns):
            med = {k: statistics.median(run[i]["ttft_s"] for run in runs[k]) for k in settings}
            first = runs["on"][0][i]
            turns.append({"mode": mode, "turn": i + 1, "prompt_tokens": first["prompt_tokens"],
                          "reused_tokens": first["reused_tokens"], "ttft_off_s": med["off"], "ttft_on_s": med["on"],
                          "speedup": med["off"] / med["on"] if med["on"] else None,
                          "answer_tokens": first["answer_tokens"], "stop_reason": first["stop_reason"]})
        rows += turns
        report["modes"][mode] = {"answers_equal": equal, "turns": turns, "runs": {
            k: [[{x: t[x] for x in t if x != "token_ids"} for t in run] for run in v] for k, v in runs.items()}}
    print(table(rows, [("mode", "mode"), ("turn", "turn"), ("prompt_tokens", "prompt"), ("reused_tokens", "reused"),
                       ("ttft_off_s", "TTFT off s"), ("ttft_on_s", "TTFT on s"), ("speedup", "off/on")]))
    for mode, m in report["modes"].items():
        print(f"{mode}: answers equal with and without the cache: {m['answers_equal']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report["charts"] = save_figures({"conversation_ttft": chart(report)}, out, png=not args.no_png).to_json()
        write_json(out / "conversation.json", report)
        print(f"wrote {out / 'conversation.json'}")
    return 0


def chart(report: dict[str, Any]) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for mode, m in report["modes"].items():
        x = [f"{t['turn']} ({t['prompt_tokens']})" for t in m["turns"]]
        for key, dash in (("ttft_off_s", "dot"), ("ttft_on_s", "solid")):
            fig.add_trace(go.Scatter(x=x, y=[t[key] for t in m["turns"]], mode="lines+markers", line={"dash": dash},
                                     name=f"{mode}, prefix cache {key.split('_')[1]}"))
    fig.update_layout(title="Time to first token per turn of one conversation (median of rounds)",
                      xaxis_title="turn (prompt tokens)", yaxis_title="seconds", template="plotly_white")
    return fig
