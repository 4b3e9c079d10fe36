"""Studio benchmark: N browser sessions chatting at once against one session, through the studio (`app.py`).

The studio runs in its own process (in-process engine on the continuous-batching scheduler, as `python app.py`
starts it) on a free loopback port; headless Chromium (Debian's, driven by Playwright: no browser download) opens
N pages, each its own browser context (its own Gradio session). Each page picks the setting in the Decoding
settings panel (mode, cache, max new tokens; temperature stays 0, greedy) and types one prompt from
bench/data/long_answer.jsonl into the chat box. Per setting, `repeats` times: one session sends the N prompts in
turn (clearing the chat between them), then N sessions send one prompt each at once; the phases alternate so the
load of a shared machine drifts over both alike.

Measured in the page (one clock, `performance.timeOrigin + now()`, shared by all pages of the browser): sent = the
Enter keydown in the message box; first = the first DOM change that shows answer text in the bot's bubble
(time to first visible token); done = the meters' cards appear (the studio writes them when the answer is
final). Answer tokens and NFE are read from those meters, the answer from the bot's bubble. Aggregate tokens/s of
a phase = its answer tokens / its wall time (N sessions: first send to last done; one session: the sum of its
requests' send-to-done times, so clearing between them is not counted). `engine_forwards` comes from the studio's
/info endpoint before and after each phase: the scheduler's forwards, against the row-forwards (NFE) summed.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine.runtime import Runtime

from .common import add_concurrency_options, free_port, prompts_for, running, start_process, table, write_json
from .serve import SETTINGS, compare, summarize

PAGE_SETUP = """() => {
  const B = window.__fdBench = {runs: []};
  const now = () => performance.timeOrigin + performance.now();
  document.querySelector('#fd-msg textarea').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey) B.runs.push({sent: now(), first: null, done: null});
  }, true);
  const chat = document.querySelector('#fd-chat'), meters = document.querySelector('#fd-meters');
  new MutationObserver(() => {
    const run = B.runs[B.runs.length - 1];
    if (!run || run.first !== null) return;
    const bots = chat.querySelectorAll('[data-testid=bot]'), last = bots[bots.length - 1];
    const text = last ? last.innerText.trim() : '';
    if (text && text !== '\u2026') run.first = now();
  }).observe(chat, {subtree: true, childList: true, characterData: true});
  new MutationObserver(() => {
    const run = B.runs[B.runs.length - 1];
    if (run && run.done === null && meters.querySelector('[data-k=tokens]')) run.done = now();
  }).observe(meters, {subtree: true, childList: true, characterData: true});
}"""

LAST_DONE = "() => { const r = window.__fdBench.runs; return r.length > 0 && r[r.length - 1].done !== null; }"

READ_RUN = """() => {
  const r = window.__fdBench.runs[window.__fdBench.runs.length - 1];
  const card = (k) => { const c = document.querySelector(`#fd-meters [data-k="${k}"] .fd-card-v`);
                        return c ? c.innerText.trim() : null; };
  const bots = document.querySelectorAll('#fd-chat [data-testid=bot] .message-content');
  return {...r, text: bots.length ? bots[bots.length - 1].innerText : '', tokens: card('tokens'), nfe: card('NFE'),
          engine_ttft: card('TTFT'), engine_time: card('time'), stop: card('stop')};
}"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("studio", help="N browser sessions vs one through the studio (Playwright + Chromium)")
    add_concurrency_options(p, started=("studio", "python app.py", "URL"), crowd="sessions", settings=SETTINGS,
                            default_settings="ar", max_tokens_help="the max new tokens slider (a multiple of 8, >= 8)")
    p.add_argument("--chromium", default=None, help="Chromium binary (default: $CHROMIUM, /usr/bin/chromium, PATH)")
    p.add_argument("--timeout", type=float, default=300, help="seconds one answer may take")
    p.add_argument("--out", default="bench/results/studio_concurrency", help="directory for results.json")
    p.set_defaults(func=run)


def find_chromium(explicit: str | None = None) -> str | None:
    for name in (explicit, os.environ.get("CHROMIUM"), "/usr/bin/chromium", "chromium", "chromium-browser",
                 "google-chrome"):
        if name and Path(name).exists():
            return name
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def start_studio(model: str | None, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(port)] + (["--model", model] if model else [])
    url = f"http://127.0.0.1:{port}/"
    return start_process(cmd, url, "studio", threads, cwd=Path(__file__).resolve().parent.parent), url


def studio_info(url: str) -> dict[str, Any]:
    from gradio_client import Client

    return Client(url, verbose=False).predict(api_name="/info")


def _int(v: str | None) -> int:
    return int(v) if v and v.strip().isdigit() else 0


class Session:
    """One browser context with the studio open and the bench's timers installed."""

    def __init__(self, page: Any, timeout_ms: float):
        self.page, self.timeout_ms = page, timeout_ms

    @classmethod
    async def open(cls, browser: Any, url: str, knobs: dict[str, Any], max_tokens: int, timeout: float) -> "Session":
        ctx = await browser.new_context(viewport={"width": 1280, "height": 900})
        pg = await ctx.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        await pg.goto(url)
        await pg.wait_for_selector(".fd-live-root .fd-legend", timeout=120_000)
        await pg.click("#fd-settings button, #fd-settings .label-wrap")
        await pg.wait_for_selector("#fd-max-new input[type=number]", state="visible")
        await pg.click(f"#fd-mode label:has(input[value='{knobs['mode']}'])")
        if "cache" in knobs:
            await pg.click(f"#fd-cache label:has(input[value='{knobs['cache']}'])")
        box = pg.locator("#fd-max-new input[type=number]")
        await box.fill(str(max_tokens))
        await box.press("Enter")
        temp = pg.locator("#fd-temperature input[type=number]")
        if float(await temp.input_value()) != 0.0:
            await temp.fill("0")
            await temp.press("Enter")
        await pg.evaluate(PAGE_SETUP)
        s = cls(pg, timeout * 1000)
        s.errors = errors
        return s

    async def type(self, prompt: str) -> None:
        """Type the prompt and make sure it stays (a late update of the previous event can still empty the box)."""
        await self.page.wait_for_selector("#fd-send:not([disabled])", timeout=self.timeout_ms)
        box = self.page.locator("#fd-msg textarea")
        for _ in range(50):
            await box.fill(prompt)
            await asyncio.sleep(0.3)
            if await box.input_value() == prompt:
                return
        raise RuntimeError("the message box does not keep the typed prompt")

    async def send(self) -> None:
        await self.page.press("#fd-msg textarea", "Enter")

    async def result(self, prompt: str, session: int) -> dict[str, Any]:
        try:
            await self.page.wait_for_function(LAST_DONE, timeout=self.timeout_ms, polling=50)
        except Exception as e:  # say which session and what its page showed
            chat = await self.page.locator("#fd-chat").inner_text()
            toasts = await self.page.locator(".toast-body").all_inner_texts()
            raise RuntimeError(f"session {session}: no finished answer within {self.timeout_ms / 1000:.0f} s "
                               f"(prompt {prompt[:40]!r}; chat shows {chat[-200:]!r}; messages {toasts!r})") from e
        r = await self.page.evaluate(READ_RUN)
        first = r["first"] if r["first"] is not None else r["done"]
        return {"session": session, "prompt": prompt, "text": r["text"], "tokens": _int(r["tokens"]),
                "nfe": _int(r["nfe"]), "stop": r["stop"], "engine_ttft": r["engine_ttft"],
                "engine_time": r["engine_time"], "ttft": round((first - r["sent"]) / 1000, 4),
                "latency": round((r["done"] - r["sent"]) / 1000, 4), "sent_ms": r["sent"], "done_ms": r["done"]}

    async def clear(self) -> None:
        await self.page.wait_for_selector("#fd-send:not([disabled])", timeout=self.timeout_ms)
        await self.page.click("#fd-clear")
        await self.page.wait_for_function("() => !document.querySelector('#fd-chat .message-row') && "
                                          "!!document.querySelector('#fd-meters .fd-empty')", timeout=30_000)


def session_summary(reqs: list[dict[str, Any]], wall: float, sessions: int, forwards: int | None) -> dict[str, Any]:
    return {"sessions": sessions, **summarize(reqs, wall), "row_forwards": sum(r["nfe"] for r in reqs),
            "engine_forwards": forwards}


def _forwards(url: str) -> int | None:
    return studio_info(url).get("engine_forwards")


async def one_session_phase(s: Session, prompts: list[str], url: str) -> dict[str, Any]:
    f0 = await asyncio.to_thread(_forwards, url)
    reqs = []
    for p in prompts:
        await s.clear()
        await s.type(p)
        await s.send()
        reqs.append(await s.result(p, 0))
    f1 = await asyncio.to_thread(_forwards, url)
    wall = sum(r["latency"] for r in reqs)
    return session_summary(reqs, wall, 1, None if f0 is None or f1 is None else f1 - f0)


async def many_sessions_phase(sessions: list[Session], prompts: list[str], url: str) -> dict[str, Any]:
    await asyncio.gather(*(s.clear() for s in sessions))
    await asyncio.gather(*(s.type(p) for s, p in zip(sessions, prompts)))
    f0 = await asyncio.to_thread(_forwards, url)
    await asyncio.gather(*(s.send() for s in sessions))
    reqs = list(await asyncio.gather(*(s.result(p, i) for i, (s, p) in enumerate(zip(sessions, prompts)))))
    f1 = await asyncio.to_thread(_forwards, url)
    wall = (max(r["done_ms"] for r in reqs) - min(r["sent_ms"] for r in reqs)) / 1000
    return session_summary(reqs, wall, len(sessions), None if f0 is None or f1 is None else f1 - f0)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [r for run in runs for r in run["requests_detail"]]
    fw = [r["engine_forwards"] for r in runs]
    out = session_summary(reqs, sum(r["wall_s"] for r in runs), runs[0]["sessions"], None if None in fw else sum(fw))
    out["per_repeat_tokens_per_second"] = [r["tokens_per_second"] for r in runs]
    return out


async def bench_setting(browser: Any, url: str, name: str, prompts: list[str], args: argparse.Namespace) -> dict:
    knobs = SETTINGS[name]
    sessions = list(await asyncio.gather(*(Session.open(browser, url, knobs, args.max_tokens, args.timeout)
                                           for _ in prompts)))
    try:
        await one_session_phase(sessions[0], prompts[:1], url)  # warm-up (first decode of this setting)
        alones, togethers = [], []
        for _ in range(args.repeats):
            alones.append(await one_session_phase(sessions[0], prompts, url))
            togethers.append(await many_sessions_phase(sessions, prompts, url))
        errors = [e for s in sessions for e in s.errors]
    finally:
        await asyncio.gather(*(s.page.context.close() for s in sessions))
    alone, together = combine(alones), combine(togethers)
    return {"setting": name, "knobs": knobs, "one_session": alone, "concurrent": together,
            **compare(alones, togethers, alone, together), "page_errors": errors}


async def drive(url: str, names: list[str], prompts: list[str], chromium: str, args: argparse.Namespace) -> list[dict]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            results = []
            for name in names:
                row = await bench_setting(browser, url, name, prompts, args)
                results.append(row)
                a, c = row["one_session"], row["concurrent"]
                print(f"{name}: 1 session {a['tokens_per_second']:.2f} tok/s (TTFT p50 {a['ttft_p50_s']:.2f} s), "
                      f"{args.sessions} sessions {c['tokens_per_second']:.2f} tok/s ({row['aggregate_speedup']:.2f}x), "
                      f"TTFT p50/p95 {c['ttft_p50_s']:.2f}/{c['ttft_p95_s']:.2f} s, forwards {c['engine_forwards']} "
                      f"for {c['row_forwards']} row-forwards, same answers: {row['same_answers']}", file=sys.stderr)
            return results
        finally:
            await browser.close()


def run_async(make: Any) -> Any:
    """asyncio.run(make()), on a thread of its own when this one already runs an event loop (a caller inside sync
    Playwright, as the browser tests are)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = asyncio.run(make())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=work, name="bench-studio")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def run(args: argparse.Namespace) -> int:
    names = [s for s in args.settings.split(",") if s]
    bad = [s for s in names if s not in SETTINGS]
    if bad or args.sessions < 2 or args.repeats < 1 or args.max_tokens < 8 or args.max_tokens % 8:
        print(f"error: settings must be of {', '.join(SETTINGS)}; sessions >= 2; repeats >= 1; max-tokens a multiple "
              "of 8 (the studio's slider step)", file=sys.stderr)
        return 2
    chromium = find_chromium(args.chromium) if importlib.util.find_spec("playwright") else None
    if chromium is None:
        print("error: needs playwright (pip install playwright) and a Chromium binary (apt-get install chromium, or "
              "--chromium PATH)", file=sys.stderr)
        return 2
    prompts = prompts_for(args.prompts, args.sessions)
    if prompts is None:
        return 2
    with running(args.url, lambda: start_studio(args.model, args.threads)) as url:
        info = studio_info(url)
        load_before, t0 = os.getloadavg(), time.time()
        results = run_async(lambda: drive(url, names, prompts, chromium, args))
        out = Path(args.out)
        write_json(out / "results.json", {
            "benchmark": "studio", "args": vars(args) | {"func": None}, "banner": info["banner"],
            "weights": Runtime.from_env().weights, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "seconds": round(time.time() - t0, 1), "cpus": os.cpu_count(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results})
        print(table([{"setting": r["setting"], "one": r["one_session"]["tokens_per_second"],
                      "many": r["concurrent"]["tokens_per_second"], "x": r["aggregate_speedup"],
                      "p50": r["concurrent"]["ttft_p50_s"], "p95": r["concurrent"]["ttft_p95_s"],
                      "fw": f"{r['concurrent']['engine_forwards']} / {r['concurrent']['row_forwards']}",
                      "same": r["same_answers"]} for r in results],
                    [("setting", "setting"), ("one", "1 session tok/s"), ("many", f"{args.sessions} sessions tok/s"),
                     ("x", "ratio"), ("p50", "TTFT p50 s"), ("p95", "TTFT p95 s"),
                     ("fw", "forwards / row-forwards"), ("same", "same answers")]))
        print(f"wrote {out / 'results.json'}")
    return 0
