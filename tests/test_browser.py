"""The studio in headless Chromium: the explanation panel and presets, live denoising, the inspector, replay,
the heatmap after tab switches, Stop's stopped state, clearing, a hostile trace upload, and the phone layout.

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
# the live view's badge once a decode has ended by itself: done (complete), or did not finish (capped, looping)
ENDED = "#fd-live .fd-badge-done, #fd-live .fd-badge-unfinished, #fd-live .fd-badge-looping"


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
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, width: int, height: int):
    pg = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(studio_server().url)
    pg.wait_for_selector(".fd-live-root .fd-legend", timeout=30_000)
    pg.errors = errors
    return pg


@pytest.fixture(scope="module")
def page(browser):
    pg = _open(browser, 1440, 1000)
    yield pg
    assert not pg.errors, pg.errors


# a prompt the bundled model answers at length even at the studio's defaults (234 tokens at threshold 1.0)
LONG_PROMPT = "Write a long, detailed essay about the history of the Roman Empire."


def _settings(pg, **values: float) -> None:
    """Open the settings accordion (once) and type values into its sliders' number boxes."""
    if not pg.locator("#fd-max-new").is_visible():
        pg.click("#fd-settings button, #fd-settings .label-wrap")
    for elem, v in values.items():
        box = pg.locator(f"#fd-{elem} input[type=number]")
        box.fill(str(v))
        box.press("Enter")
        rng = pg.locator(f"#fd-{elem} input[type=range]")
        if rng.count() and float(rng.input_value()) != float(v):  # the box did not take: set the range itself
            rng.evaluate("(e, v) => { e.value = v; e.dispatchEvent(new Event('input', {bubbles: true}));"
                         " e.dispatchEvent(new Event('change', {bubbles: true})); }", str(v))


def open_tab(pg, tab: str, probe: str) -> None:
    """Open a tab and wait until its element `probe` has mounted and stayed the same element for 0.3 s: Gradio mounts
    a tab's contents on its first visit, and a race box filled at once after the click kept its default prompt for
    the run (2026-11-28, reproduced only after a test that ran 8 clients; the same element watched every 10-20 ms never
    showed the text lost, so the exact cause is not known)."""
    pg.get_by_role("tab", name=tab).click()
    pg.wait_for_selector(probe)
    pg.wait_for_function(f"""() => new Promise(done => {{ const el = document.querySelector('{probe}');
        setTimeout(() => done(document.querySelector('{probe}') === el), 300); }})""", timeout=20_000)


def fill_in_tab(pg, tab: str, box: str, text: str) -> None:
    """open_tab, then type into its box `box` (a Gradio Textbox's elem_id selector) and check the text is there."""
    open_tab(pg, tab, f"{box} textarea, {box} input")
    field = pg.locator(f"{box} textarea, {box} input").first
    field.fill(text)
    assert field.input_value() == text


def _send(pg, text: str) -> None:
    pg.fill("#fd-msg textarea", text)
    pg.keyboard.press("Enter")


def _messages(pg) -> int:
    return pg.locator("#fd-chat .message-row").count()


def test_explanation_panel_banner_and_presets(page):
    from app.card import measured_for

    pg = page
    panel = pg.locator("#fd-explain")
    assert panel.is_visible()
    text = panel.inner_text()
    for words in ("Blocks", "Sub-blocks", "threshold", "block cache", "dual cache", "NFE", "Steps",
                  "Tokens per forward"):
        assert words in text, words
    assert panel.locator("a[href='https://arxiv.org/abs/2509.26328']").count() == 1
    # the banner's numbers are the model card's, for the adapter that is loaded
    m = measured_for(studio_server().engine.lm.source.adapter)
    acc, tpf = m.at(0.9)
    honest = pg.locator("#fd-honest").inner_text()
    assert f"{tpf:.2f} tokens per forward" in honest and f"{100 * acc / m.ar_accuracy:.0f}%" in honest, honest
    # a preset sets the threshold and says what to expect, with the measured numbers at that threshold
    _settings(pg)
    threshold = pg.locator("#fd-threshold input[type=number]")
    assert float(threshold.input_value()) == 0.9
    assert "Paper · 0.9" in pg.locator("#fd-presets").inner_text()
    pg.click("#fd-preset-fast")
    pg.wait_for_function("document.querySelector('#fd-presets').innerText.includes('Fast')")
    assert float(threshold.input_value()) == 0.7
    info = pg.locator("#fd-presets").inner_text()
    assert f"{m.at(0.7)[1]:.2f} tokens/forward" in info and "fewer forwards" in info, info
    pg.click("#fd-preset-paper")
    pg.wait_for_function("document.querySelector('#fd-presets').innerText.includes('Paper · 0.9')")
    assert float(threshold.input_value()) == 0.9


def _counts(pg, scope: str) -> tuple[int, int]:
    return (pg.locator(f"{scope} .fd-cell.fd-masked").count(), pg.locator(f"{scope} .fd-cell.fd-done").count())


def test_live_view_denoises_step_by_step(page):
    pg = page
    _settings(pg, **{"max-new": MAX_NEW})
    # record (masked, committed) cell counts at every DOM change of the live view
    pg.evaluate("""() => {
      const root = document.querySelector('#fd-live .fd-live-root'), seen = window.__fdCounts = [];
      new MutationObserver(() => {
        const n = (sel) => root.querySelectorAll(sel).length, c = [n('.fd-cell.fd-masked'), n('.fd-cell.fd-done')];
        const last = seen[seen.length - 1];
        if (!last || last[0] !== c[0] || last[1] !== c[1]) seen.push(c);
      }).observe(root, {subtree: true, childList: true, attributes: true, attributeFilter: ['class']});
    }""")
    _send(pg, "Write a haiku about the sea.")
    pg.wait_for_selector(ENDED, timeout=240_000)
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


def test_pinned_card_closes_with_escape_and_click_outside(page):
    pg = page
    card = pg.locator("#fd-live .fd-card-pop")
    cell = pg.locator("#fd-live .fd-cell.fd-done").first
    assert cell.get_attribute("tabindex") == "0" and "confidence" in cell.get_attribute("aria-label")
    cell.click()
    card.wait_for(state="visible")
    assert cell.get_attribute("aria-expanded") == "true"
    pg.mouse.move(5, 5)  # a pinned card stays when the pointer leaves
    assert card.is_visible()
    pg.keyboard.press("Escape")
    card.wait_for(state="hidden")
    assert cell.get_attribute("aria-expanded") == "false"
    cell.click()
    card.wait_for(state="visible")
    pg.locator("#fd-banner").click()  # anywhere outside the card and its cell
    card.wait_for(state="hidden")
    # keyboard: focus shows the card, Enter pins it, Escape closes it
    cell.focus()
    card.wait_for(state="visible")
    pg.keyboard.press("Enter")
    assert cell.get_attribute("aria-expanded") == "true"
    pg.keyboard.press("Escape")
    assert cell.get_attribute("aria-expanded") == "false"


def test_replay_walks_the_trace(page):
    pg = page
    pg.get_by_role("tab", name="Replay").click()
    pg.wait_for_selector("#fd-player .fd-badge-ready", timeout=20_000)
    assert _counts(pg, "#fd-player")[1] == 0  # a newly loaded trace starts at the beginning
    pg.locator("#fd-player .fd-btn", has_text="⇥").click()
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


def _heatmap_fill(pg) -> float:
    """The plot's drawn width over its panel's width (1.0 = fills it)."""
    pg.wait_for_selector("#fd-heatmap .js-plotly-plot .heatmaplayer, #fd-heatmap .js-plotly-plot .hm",
                         timeout=30_000)
    pg.wait_for_timeout(600)  # the refit after a tab switch is debounced
    return pg.evaluate("""() => {
      const box = document.querySelector('#fd-heatmap'), svg = box.querySelector('.js-plotly-plot .main-svg');
      return svg.getBoundingClientRect().width / box.getBoundingClientRect().width;
    }""")


def test_heatmap_fills_its_panel_after_tab_switches(page):
    """A figure that arrives while its (already shown once) tab is hidden is drawn at plotly's default 700 px;
    showing the tab again must refit it to the panel."""
    pg = page
    pg.get_by_role("tab", name="Heatmap").click()
    assert _heatmap_fill(pg) > 0.9
    pg.get_by_role("tab", name="Replay").click()
    _settings(pg, **{"max-new": 8})
    _send(pg, "Hi")
    pg.wait_for_selector("#fd-live .fd-badge-running", timeout=60_000)
    pg.wait_for_selector(ENDED, timeout=60_000)
    pg.wait_for_timeout(500)
    pg.get_by_role("tab", name="Heatmap").click()
    assert _heatmap_fill(pg) > 0.9
    pg.get_by_role("tab", name="Race").click()
    pg.get_by_role("tab", name="Heatmap").click()
    assert _heatmap_fill(pg) > 0.9
    pg.locator("#fd-heatmap").screenshot(path=str(ARTIFACTS / "screenshot_heatmap.png"))


def test_stop_shows_a_stopped_state(page):
    pg = page
    _settings(pg, **{"max-new": 256, "threshold": 1.0})
    # a long answer (234 tokens at these settings) and no cache (every forward recomputes the whole prefix): Stop
    # lands in it however fast the engine is and however slowly the click arrives on a loaded machine
    pg.locator("#fd-cache input[value='none']").check()
    _send(pg, LONG_PROMPT)
    pg.wait_for_function("document.querySelectorAll('#fd-live .fd-cell.fd-done').length >= 3", timeout=120_000)
    pg.click("#fd-stop")
    pg.wait_for_selector("#fd-live .fd-badge-stopped", timeout=60_000)
    assert pg.locator(ENDED).count() == 0
    assert "Stop pressed" in pg.locator("#fd-live .fd-status").inner_text()
    pg.wait_for_function("document.querySelector('#fd-chat').innerText.includes('stopped')", timeout=20_000)
    assert pg.locator('#fd-meters .fd-card[data-k="stop"] .fd-card-v').inner_text() == "stopped"
    pg.locator("#fd-cache input[value='dual']").check()


def test_stopped_race_and_sweep_say_so(page):
    """A race stopped during its diffusion run says the AR run never started; a stopped sweep keeps its points."""
    pg = page  # still max 256 tokens at threshold 1.0
    _settings(pg)
    # as above: the first diffusion run lasts long enough for Stop to land in it (a short one ended before the click
    # arrived twice under two test workers, and the race went on to its AR run and its second diffusion run)
    pg.locator("#fd-cache input[value='none']").check()
    fill_in_tab(pg, "Race", "#fd-race-msg", LONG_PROMPT)
    pg.click("#fd-race")
    pg.wait_for_function("document.querySelectorAll('#fd-race-d .fd-cell.fd-done').length >= 3", timeout=120_000)
    pg.click("#fd-race-stop")
    pg.wait_for_function("document.querySelector('#fd-race-meters').innerText.includes('Stopped during the "
                         "diffusion run')", timeout=60_000)
    assert pg.locator("#fd-race-d .fd-badge-stopped").count() == 1
    assert "Not run" in pg.locator("#fd-race-ar").inner_text()
    pg.locator("#fd-cache input[value='dual']").check()
    fill_in_tab(pg, "Sweep", "#fd-sweep-msg", "Count from one to fifty, one per line.")
    pg.click("#fd-sweep")
    pg.wait_for_function("document.querySelector('#fd-sweep-stop') && !document.querySelector('#fd-sweep-stop')"
                         ".disabled", timeout=60_000)
    pg.click("#fd-sweep-stop")  # at once: the sweep's stop flag exists before Stop is enabled
    pg.wait_for_selector("#fd-sweep-status .fd-stopped-note", timeout=60_000)
    assert "Stopped after 0 of 4 points" in pg.locator("#fd-sweep-status").inner_text()
    pg.wait_for_function("!document.querySelector('#fd-sweep').disabled", timeout=30_000)
    _settings(pg, **{"max-new": 8, "threshold": 0.9})


def test_clearing_by_every_control_empties_the_state(page):
    """Gradio's trash icon and our Clear button both empty the conversation: the next turn starts afresh."""
    pg = page
    assert _messages(pg) >= 2  # earlier turns are in the chat
    for clear in ("#fd-chat button[aria-label='Clear']", "#fd-clear"):
        pg.locator(clear).first.click()
        pg.wait_for_function("!document.querySelector('#fd-chat .message-row')", timeout=10_000)
        _send(pg, "Hi")
        pg.wait_for_selector(ENDED, timeout=60_000)
        pg.wait_for_function("document.querySelectorAll('#fd-chat .message-row').length >= 2")
        assert _messages(pg) == 2, clear  # the cleared turns did not come back
        prompt_len = pg.evaluate("document.querySelector('#fd-live .fd-live-root').fdLive.r.head.prompt_len")
        assert prompt_len < 40, (clear, prompt_len)  # the model saw only the system prompt and "Hi"


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
        pg.wait_for_function("document.querySelector('#fd-player .fd-pos').textContent.startsWith('0/3 ')",
                             timeout=30_000)
        pg.locator("#fd-player .fd-btn", has_text="⇥").click()
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


def test_phone_layout_shows_the_live_view_while_streaming(browser):
    """390 px wide: the live view starts within the first two screens and the page does not scroll sideways."""
    pg = _open(browser, 390, 844)
    try:
        pg.locator("#fd-chat button[aria-label^='Select example 2']").click()  # an example sends itself
        pg.wait_for_selector("#fd-live .fd-badge-running", timeout=60_000)
        assert "haiku" in pg.locator("#fd-chat").inner_text()
        top = pg.evaluate("document.querySelector('#fd-live').getBoundingClientRect().top + window.scrollY")
        assert top < 2 * 844, top
        assert pg.evaluate("document.documentElement.scrollWidth") <= 391
        grid = pg.evaluate("(() => { const g = document.querySelector('#fd-live .fd-grid'); "
                           "return [g.scrollWidth, g.clientWidth]; })()")
        assert grid[0] <= grid[1] + 1, grid  # block rows wrap instead of overflowing
        pg.click("#fd-stop")
        pg.wait_for_selector(f"#fd-live .fd-badge-stopped, {ENDED}", timeout=60_000)
        pg.screenshot(path=str(ARTIFACTS / "screenshot_phone.png"), full_page=False)
    finally:
        pg.close()
    assert not pg.errors, pg.errors


def test_bench_studio_sessions_report_forwards_and_answers(tmp_path, capsys):
    """`python -m bench studio` at toy size: its own studio process, 2 browser sessions, 8 AR tokens each; the
    JSON has both phases' timings and forward counts, and the concurrent answers equal the one-session ones (fp32
    weights, as the suite pins them: AR batches are exact there)."""
    import bench.__main__ as bench_main

    out = tmp_path / "studio"
    assert bench_main.main(["studio", "--sessions", "2", "--repeats", "1", "--max-tokens", "8", "--settings", "ar",
                            "--out", str(out), "--chromium", CHROMIUM, "--timeout", "240"]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["benchmark"] == "studio" and report["args"]["sessions"] == 2
    (row,) = report["results"]
    assert row["setting"] == "ar" and row["same_answers"] and row["alone_stable"], row["mismatched_prompts"]
    assert not row["page_errors"]
    one, many = row["one_session"], row["concurrent"]
    assert one["sessions"] == 1 and many["sessions"] == 2 and one["requests"] == many["requests"] == 2
    for r in one["requests_detail"] + many["requests_detail"]:
        assert r["text"] and r["tokens"] == 8 and r["nfe"] == 8 and 0 < r["ttft"] <= r["latency"], r
    assert many["answer_tokens"] == one["answer_tokens"] == 16 and many["tokens_per_second"] > 0
    assert row["aggregate_speedup"] == round(many["tokens_per_second"] / one["tokens_per_second"], 3)
    # scheduler forwards against row-forwards (8 + 8 alone). Whether two browser sends overlap at all depends on when
    # each page's request arrives: an 8-token AR answer takes ~0.1 s, and once (2026-11-28, the suite's other worker
    # busy) the second arrived after the first had finished. That rows share forwards is asserted where the requests
    # start together: tests/test_reliability.py::test_eight_users_share_forwards_and_each_get_their_own_answer.
    assert one["engine_forwards"] == 16 and many["engine_forwards"] <= many["row_forwards"] == 16
    assert {"ttft_p50_s", "ttft_p95_s", "latency_p50_s"} <= set(many)
    assert "2 sessions tok/s" in capsys.readouterr().out
