"""Serving benchmark: N concurrent streaming clients against one client, through `python -m engine serve`.

The server runs in its own process (as deployed); clients use the official `openai` package and stream. For each
setting, `repeats` times: one client sends the N prompts in turn, then N clients send one prompt each at once.
The two phases alternate so that the load of a shared machine drifts over both alike. Reported: aggregate answer
tokens/s of each phase (tokens / wall time, summed over repeats) and their ratio, client-side TTFT p50/p95
(request sent -> first text), and whether every concurrent answer equals the one-client answer of its prompt.
With `--system FILE` every request starts with that system message (many clients sharing one long document: the
prefix cache's case; each request's `usage.prompt_tokens_details.cached_tokens` is summed per phase).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .common import add_concurrency_options, free_port, prompts_for, running, start_process, table, write_json

SETTINGS = {
    "ar": {"mode": "ar"},
    "diffusion-block": {"mode": "diffusion", "cache": "block"},
    "diffusion-dual": {"mode": "diffusion", "cache": "dual"},
    "diffusion-dual-sparse": {"mode": "diffusion", "cache": "dual-sparse"},
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="N concurrent clients vs one through the OpenAI-compatible server")
    add_concurrency_options(p, started=("server", "python -m engine serve", "/v1 URL"), crowd="clients", settings=SETTINGS,
                            default_settings="ar,diffusion-block,diffusion-dual", max_tokens_help="answer tokens")
    p.add_argument("--out", default="runs/bench/serve", help="directory for results.json")
    p.add_argument("--system", default=None, metavar="FILE",
                   help="a text file every client sends as its system message (e.g. bench/data/system_document.txt)")
    p.set_defaults(func=run)


def start_server(model: str | None, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", model] if model else []
    url = f"http://127.0.0.1:{port}/v1"
    return start_process(cmd, url + "/models", "server", threads), url


def one_request(client: Any, model: str, prompt: str, knobs: dict, max_tokens: int,
                system: str | None = None) -> dict[str, Any]:
    """A streamed chat completion: text, answer tokens, NFE, prompt tokens from the prefix cache, client-side TTFT
    and latency."""
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                                            extra_body={**knobs, "temperature": 0})
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text += ch.choices[0].delta.content
        if ch.usage is not None:
            usage = ch.usage
    latency = time.perf_counter() - t0
    details = usage.prompt_tokens_details
    return {"prompt": prompt, "text": text, "tokens": usage.completion_tokens, "nfe": usage.model_extra["nfe"],
            "cached_tokens": details.cached_tokens if details is not None else None,
            "ttft": ttft if ttft is not None else latency, "latency": latency}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(reqs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One phase's requests (each with tokens, ttft, latency): throughput and latency percentiles."""
    ttfts = [r["ttft"] for r in reqs]
    tokens = sum(r["tokens"] for r in reqs)
    return {"requests": len(reqs), "wall_s": round(wall, 3), "answer_tokens": tokens,
            "tokens_per_second": round(tokens / wall, 3) if wall > 0 else 0.0,
            "ttft_p50_s": round(percentile(ttfts, 0.5), 3), "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
            "latency_p50_s": round(percentile([r["latency"] for r in reqs], 0.5), 3),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in reqs), "requests_detail": reqs}


def compare(alones: list[dict[str, Any]], togethers: list[dict[str, Any]], alone: dict[str, Any],
            together: dict[str, Any]) -> dict[str, Any]:
    """N clients against one (repeats interleaved): throughput ratios and whether every answer is the lone one."""
    ref: dict[str, set[str]] = {}
    for r in alone["requests_detail"]:
        ref.setdefault(r["prompt"], set()).add(r["text"])
    mismatched = sorted({r["prompt"] for r in together["requests_detail"] if {r["text"]} != ref[r["prompt"]]})
    return {"aggregate_speedup": round(together["tokens_per_second"] / max(alone["tokens_per_second"], 1e-9), 3),
            "per_repeat_speedup": [round(b["tokens_per_second"] / max(a["tokens_per_second"], 1e-9), 3)
                                   for a, b in zip(alones, togethers)],
            "alone_stable": all(len(v) == 1 for v in ref.values()),
            "same_answers": not mismatched, "mismatched_prompts": mismatched}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one phase as one: tokens / wall summed, percentiles over every request."""
    reqs = [r for run in runs for r in run["requests_detail"]]
    return {"clients": runs[0]["clients"], **summarize(reqs, sum(r["wall_s"] for r in runs)),
            "per_repeat_tokens_per_second": [r["tokens_per_second"] for r in runs], "nfe": sum(r["nfe"] for r in reqs)}


def phase(url: str, model: str, jobs: list[list[str]], knobs: dict, max_tokens: int,
          system: str | None = None) -> dict[str, Any]:
    """Each inner list is one client's prompts (sent in turn); all clients start together."""
    import openai

    out: list[list[dict]] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        start.wait()
        try:
            for p in jobs[i]:
                out[i].append(one_request(c, model, p, knobs, max_tokens, system))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    reqs = [r for rs in out for r in rs]
    return {"clients": len(jobs), **summarize(reqs, wall), "nfe": sum(r["nfe"] for r in reqs)}


def run(args: argparse.Namespace) -> int:
    import httpx

    names = [s for s in args.settings.split(",") if s]
    bad = [s for s in names if s not in SETTINGS]
    if bad or args.clients < 2 or args.repeats < 1:
        print(f"error: settings must be of {', '.join(SETTINGS)}; clients >= 2; repeats >= 1", file=sys.stderr)
        return 2
    prompts = prompts_for(args.prompts, args.clients)
    if prompts is None:
        return 2
    system = Path(args.system).read_text(encoding="utf-8").strip() if args.system else None
    with running(args.url, lambda: start_server(args.model, args.threads)) as url:
        info = httpx.get(url + "/models", timeout=10).json()["data"][0]
        load_before = os.getloadavg()
        results = []
        for name in names:
            knobs = SETTINGS[name]
            phase(url, info["id"], [[prompts[0]]], knobs, args.max_tokens)  # warm-up (no system message: cold cache)
            alones, togethers = [], []
            for _ in range(args.repeats):
                alones.append(phase(url, info["id"], [prompts], knobs, args.max_tokens, system))
                togethers.append(phase(url, info["id"], [[p] for p in prompts], knobs, args.max_tokens, system))
            alone, together = combine(alones), combine(togethers)
            row = {"setting": name, "knobs": knobs, "one_client": alone, "concurrent": together,
                   **compare(alones, togethers, alone, together)}
            results.append(row)
            print(f"{name}: 1 client {alone['tokens_per_second']:.2f} tok/s (TTFT p50 {alone['ttft_p50_s']:.2f} s), "
                  f"{args.clients} clients "
                  f"{together['tokens_per_second']:.2f} tok/s ({row['aggregate_speedup']:.2f}x), TTFT p50/p95 "
                  f"{together['ttft_p50_s']:.2f}/{together['ttft_p95_s']:.2f} s, same answers: {row['same_answers']}, prompt "
                  f"tokens from the prefix cache {alone['cached_tokens']} / {together['cached_tokens']}",
                  file=sys.stderr)
        out = Path(args.out)
        write_json(out / "results.json", {
            "benchmark": "serve", "args": vars(args) | {"func": None}, "server": info,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results})
        print(table([{"setting": r["setting"], "one": r["one_client"]["tokens_per_second"],
                      "many": r["concurrent"]["tokens_per_second"], "x": r["aggregate_speedup"],
                      "p50": r["concurrent"]["ttft_p50_s"], "p95": r["concurrent"]["ttft_p95_s"],
                      "same": r["same_answers"]} for r in results],
                    [("setting", "setting"), ("one", "1 client tok/s"), ("many", f"{args.clients} clients tok/s"),
                     ("x", "ratio"), ("p50", "TTFT p50 s"), ("p95", "TTFT p95 s"), ("same", "same answers")]))
        print(f"wrote {out / 'results.json'}")
    return 0
