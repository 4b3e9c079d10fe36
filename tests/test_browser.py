"""The studio in headless Chromium: live denoising, replay, heatmap, and a hostile trace upload.

Skips only when Playwright or a Chromium binary is missing (`pip install playwright`,
`apt-get install chromium`). Screenshots go to artifacts/ (git-ignored); with
FASTDLLM_UPDATE_SCREENSHOT=1 the live view's screenshot is also copied to assets/screenshot.png.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest_app import studio_server
from engine import Trace

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
MAX_NEW = 48
XSS = "<img src=x onerror=window.__xss=1>"


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"):
        if name and (Path(name).exists() or shutil.which(name)):
            return str(Path(name)) if Path(name).exists() else shutil.which(name)
    return None


try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None
    print("test_browser: playwright is not installed (pip install playwright)")
CHROMIUM = _chromium()
if CHROMIUM is None:
    print("test_browser: no Chromium binary found (apt-get install chromium, or set CHROMIUM=/path)")
pytestmark = pytest.mark.skipif(sync_playwright is None or CHROMIUM is None,
                                reason="needs playwright and a Chromium binary")


@pytest.fixture(scope="module")
def page():
    server = studio_server()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(server.url)
        pg.wait_for_selector(".fd-live-root .fd-legend", timeout=30_000)
        pg.errors = errors
        yield pg
        browser.close()
        assert not errors, errors


def _counts(pg, scope: str) -> tuple[int, int]:
    return (pg.locator(f"{scope} .fd-cell.fd-masked").count(), pg.locator(f"{scope} .fd-cell.fd-done").count())


def test_live_view_denoises_step_by_step(page):
    pg = page
    pg.click("#fd-settings button, #fd-settings .label-wrap")  # open the settings accordion
    box = pg.locator("#fd-max-new input[type=number]")
    box.fill(str(MAX_NEW))
    box.press("Enter")
    # record (masked, committed) cell counts at every DOM change of the live view
    pg.evaluate("""() => {
      const root = document.querySelector('#fd-live .fd-live-root'), seen = window.__fdCounts = [];
      new MutationObserver(() => {
        const n = (sel) => root.querySelectorAll(sel).length, c = [n('.fd-cell.fd-masked'), n('.fd-cell.fd-done')];
        const last = seen[seen.length - 1];
        if (!last || last[0] !== c[0] || last[1] !== c[1]) seen.push(c);
      }).observe(root, {subtree: true, childList: true, attributes: true, attributeFilter: ['class']});
    }""")
    pg.fill("#fd-msg textarea", "Write a haiku about the sea.")
    pg.keyboard.press("Enter")
    pg.wait_for_selector("#fd-live .fd-badge-done", timeout=240_000)
    samples = pg.evaluate("window.__fdCounts")
    masked_then_done = [s for s in samples if s[0] > 0 and s[1] > 0]
    assert masked_then_done, f"never saw masked and committed cells together: {samples[:10]}"
    assert len({d for _, d in samples}) >= 3, f"tokens did not appear over several steps: {samples}"
    # every committed token arrived (no frame lost): answer cells == the tokens stat == the meters
    done = pg.locator("#fd-live .fd-cell.fd-done:not(.fd-discarded)").count()
    stat = pg.locator("#fd-live .fd-stat", has_text="tokens").first.inner_text()
    assert stat.split()[-1].split("/")[0] == str(done)
    assert pg.locator('#fd-meters .fd-card[data-k="tokens"] .fd-card-v').inner_text() == str(done)
    pg.evaluate("window.scrollTo(0, 0)")
    cell = pg.locator("#fd-live .fd-cell.fd-done").nth(min(3, done - 1))
    cell.hover()
    card = pg.locator("#fd-live .fd-card-pop")
    card.wait_for(state="visible")
    assert "confidence" in card.inner_text() and "committed at forward" in card.inner_text()
    pg.screenshot(path=str(ARTIFACTS / "screenshot_live.png"), full_page=True,
                  clip={"x": 0, "y": 0, "width": 1440, "height": 820})
    if os.environ.get("FASTDLLM_UPDATE_SCREENSHOT") == "1":
        shutil.copy(ARTIFACTS / "screenshot_live.png", ROOT / "assets" / "screenshot.png")
    # a frame that arrives after a gap makes the view fetch the missed events from the server
    gap = pg.evaluate("""async () => {
      const live = document.querySelector('#fd-live .fd-live-root').fdLive, run = live.run, head = live.r.head;
      const n = Math.min(3, live.r.applied);
      live.run = null;  // as if this browser had missed the run's first frames
      await live.feed(JSON.stringify({run, seq: n, frame: -1, head, ev: []}));
      return [n, live.r.applied];
    }""")
    assert gap[0] > 0 and gap[1] == gap[0], gap


def test_replay_walks_the_trace(page):
    pg = page
    pg.get_by_role("tab", name="Replay").click()
    pg.wait_for_selector("#fd-player .fd-cell.fd-done", timeout=20_000)
    total = _counts(pg, "#fd-player")[1]
    assert total > 0
    pg.locator("#fd-player .fd-btn", has_text="⇤").click()
    assert _counts(pg, "#fd-player")[1] == 0
    steps = []
    for _ in range(4):
        pg.locator("#fd-player .fd-btn", has_text="▶|").click()
        steps.append(_counts(pg, "#fd-player")[1])
    assert steps == sorted(steps) and steps[-1] > 0, steps
    pg.locator("#fd-player .fd-speed-sel").select_option("4")
    pg.locator("#fd-player .fd-play").click()
    pg.wait_for_function("document.querySelector('#fd-player .fd-pos').textContent.startsWith("
                         "document.querySelector('#fd-player .fd-scrub').max + '/')", timeout=60_000)
    assert _counts(pg, "#fd-player")[1] == total
    scrub = pg.locator("#fd-player .fd-scrub")
    n = int(scrub.get_attribute("max"))
    scrub.evaluate("(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }", str(n // 2))
    pg.wait_for_function(f"document.querySelector('#fd-player .fd-pos').textContent.startsWith('{n // 2}/')")
    assert 0 < _counts(pg, "#fd-player")[1] <= total
    pg.locator("#fd-player").screenshot(path=str(ARTIFACTS / "screenshot_replay.png"))
    with pg.expect_download() as dl:
        pg.get_by_role("button", name="Download trace").click()
    trace = Trace.loads(Path(dl.value.path()).read_text(encoding="utf-8"))
    assert len(trace.events) == n and trace.summary is not None


def test_heatmap_tab(page):
    pg = page
    pg.get_by_role("tab", name="Heatmap").click()
    pg.wait_for_selector("#fd-heatmap .js-plotly-plot .heatmaplayer, #fd-heatmap .js-plotly-plot .hm",
                         timeout=30_000)
    pg.locator("#fd-heatmap").screenshot(path=str(ARTIFACTS / "screenshot_heatmap.png"))


def test_hostile_trace_upload_is_rendered_as_text(page, tmp_path):
    pg = page
    cfg = {"mode": "diffusion", "block_size": 8, "sub_block_size": 4, "threshold": 0.9, "strategy": "threshold",
           "factor": 1.0, "cache": "dual", "max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None,
           "stop_token_ids": [2]}
    ev = lambda kind, nfe, sub, committed, masked: {  # noqa: E731
        "kind": kind, "row": 0, "nfe": nfe, "block": 0, "sub_block": sub, "committed": committed,
        "masked": masked, "text_delta": XSS, "t": nfe / 100}
    trace = {"version": 1, "header": {"model": XSS, "source": XSS, "adapter": True, "device": "cpu",
                                      "dtype": "float32", "config": cfg, "prompt": XSS, "prompt_len": 5},
             "events": [ev("prefill", 1, 1, [[0, 9, XSS, 0.9]], [[1, 9, XSS, 0.3]]),
                        ev("step", 2, 1, [[1, 9, XSS, 0.95]], []), ev("done", 2, -1, [], [])],
             "summary": None}
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(trace))
    pg.get_by_role("tab", name="Replay").click()
    with pg.expect_file_chooser() as fc:
        pg.get_by_role("button", name="Upload trace").click()
    fc.value.set_files(str(path))
    try:
        pg.wait_for_function("[...document.querySelectorAll('#fd-player .fd-tok')]"
                             ".some(e => e.textContent.includes('onerror'))", timeout=30_000)
    finally:
        pg.screenshot(path=str(ARTIFACTS / "screenshot_upload.png"), full_page=True)
    assert pg.evaluate("window.__xss") is None
    assert pg.locator("#fd-player img, #fd-live img").count() == 0
    # a malformed file is refused with a message, and the previous trace stays
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "header": {}, "events": "nope"}')
    with pg.expect_file_chooser() as fc:
        pg.get_by_role("button", name="Upload trace").click()
    fc.value.set_files(str(bad))
    pg.get_by_text("Trace rejected").first.wait_for(timeout=20_000)
