"""The studio's rough edges (issue 25 part 5), each fixed and held here: send errors said inline (the chat kept), the
seed checked in its field, the max-new-tokens slider agreeing with its help, the preset note's stray colon, counts
that never drop at Stop, a prefill state, the sweep's progress, the phone layout (no jump on load, the preset note
and the heatmap fit, plotly's toolbar clear of the title), the chat label above the messages, names for screen
readers, and no server errors in the console.

Browser tests share the session's studio server and one page per viewport; the synthetic ones feed the page's own
renderer (static/studio.js) hand-made events, so they are exact and take no decode.
"""
from __future__ import annotations

import json
import re

import pytest

from app import render
from app.settings import INFO, MAX_NEW_TOKENS, PRESETS
from engine import ConfigError

HAIKU = "Write a haiku about the sea."


def _component(demo, elem_id: str) -> dict:
    return next(c["props"] for c in demo.config["components"] if c.get("props", {}).get("elem_id") == elem_id)


# ---------------------------------------------------------------- app level
def test_max_new_tokens_slider_agrees_with_its_help(server):
    props = _component(server.demo, "fd-max-new")
    assert (props["minimum"], props["maximum"], props["step"]) == (1, MAX_NEW_TOKENS, 1)
    assert f"1 to {MAX_NEW_TOKENS}" in INFO["max_new_tokens"]


def test_custom_threshold_note_has_no_stray_colon():
    for strategy, threshold in (("threshold", 0.05), ("factor", 0.9), ("threshold", 0.9)):
        html = render.presets_html(PRESETS, None, strategy, threshold)
        # the note is a column of lines (b, span): none may start with punctuation
        assert re.search(r"</b>\s*[:;,.]", html) is None and re.search(r"<span>\s*[:;,.]", html) is None, html
    assert "<b>Custom threshold 0.05</b><span>Lower commits" in render.presets_html(PRESETS, None, "threshold", 0.05)


@pytest.mark.parametrize("value, shown", [(-5, "got -5"), (1e30, "got 1e+30"), (2**63, "got 9.22337e+18"),
                                          (0.5, "got 0.5"), ("x", "got 'x'")])
def test_bad_seed_names_the_allowed_range(value, shown):
    from app.settings import check_seed

    with pytest.raises(ConfigError) as err:
        check_seed(value)
    assert str(err.value) == f"seed: must be -1 (a fresh random seed each run) or an integer in [0, 2^63) ({shown})"


def test_good_seeds_pass():
    from app.settings import check_seed

    assert [check_seed(v) for v in (-1, -1.0, None, "", 0, 7.0, 2**63 - 1)] == [None, None, None, None, 0, 7,
                                                                                 2**63 - 1]


@pytest.mark.parametrize("button, field, message_id, said", [
    ("fd-send", "fd-send-error", "fd-msg", "message: type a message first"),
    ("fd-race", "fd-race-meters", "fd-race-msg", "message: type a message first"),
    ("fd-sweep", "fd-sweep-status", "fd-sweep-msg", "message: type a message first")])
def test_bad_input_is_said_without_waiting_for_the_engine_queue(server, button, field, message_id, said):
    """Each run button has a second listener outside the queue (queue=False) that checks the same inputs: a bad one
    is said in its field at once, not after the decodes queued ahead of it (2026-11-28: the race's inline error once
    took over 60 s to show under the full suite's load). A good input changes nothing there."""
    demo = server.demo
    comps = {c["id"]: c for c in demo.config["components"]}
    ids = {c.get("props", {}).get("elem_id"): i for i, c in comps.items()}
    deps = [d for d in demo.config["dependencies"] if (ids[button], "click") in [tuple(t) for t in d["targets"]]
            and ids[field] in d["outputs"] and d.get("queue") is False]
    assert len(deps) == 1, f"{button}: one unqueued check writing {field}"
    dep = deps[0]
    # added before the queued run on the same click: Gradio's page sends a trigger's listeners in that order, each
    # after the previous one has finished (a check added after the run waited for the whole run)
    runs = [d for d in demo.config["dependencies"] if (ids[button], "click") in [tuple(t) for t in d["targets"]]
            and d.get("queue") is not False]
    assert runs and all(dep["id"] < d["id"] for d in runs), (button, dep["id"], [d["id"] for d in runs])
    values = [comps[i]["props"].get("value") for i in dep["inputs"]]
    if button == "fd-sweep":  # the sweep's threshold and block-size choices start empty in the config
        values[1], values[2] = [0.9], [32]
    run = demo.fns[dep["id"]].fn
    values[dep["inputs"].index(ids[message_id])] = "   "
    assert said in run(*values)
    values[dep["inputs"].index(ids[message_id])] = HAIKU
    assert run(*values) == {"__type__": "update"}


def test_api_refuses_a_bad_seed_with_its_range(client):
    with pytest.raises(Exception) as err:
        client.predict("hi", [], {"seed": -5, "max_new_tokens": 4}, api_name="/generate")
    assert str(err.value).startswith("seed: must be -1 (a fresh random seed each run) or an integer in [0, 2^63)")


def test_inline_errors_are_escaped():
    html = render.field_error(ConfigError("seed", "<img src=x onerror=alert(1)>"))
    assert "<img" not in html and 'role="alert"' in html and 'data-field="seed"' in html


# ---------------------------------------------------------------- in the browser
@pytest.fixture(scope="module")
def browser():
    from test_browser import ARTIFACTS, CHROMIUM, sync_playwright

    if sync_playwright is None or CHROMIUM is None:
        pytest.skip("needs playwright and a Chromium binary")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, server, width: int, height: int):
    pg = browser.new_page(viewport={"width": width, "height": height})
    pg.errors, pg.server_errors = [], []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: pg.server_errors.append(m.text) if "status of 5" in m.text else None)
    pg.on("response", lambda r: pg.server_errors.append(f"{r.status} {r.url}") if r.status >= 500 else None)
    pg.goto(server.url)
    pg.wait_for_selector(".fd-live-root .fd-legend", timeout=30_000)
    return pg


@pytest.fixture(scope="module")
def page(browser, server):
    pg = _open(browser, server, 1440, 1000)
    yield pg
    assert not pg.errors, pg.errors
    assert not pg.server_errors, pg.server_errors  # no "Failed to load resource: 500" in the whole session


@pytest.fixture(scope="module")
def phone(browser, server):
    pg = _open(browser, server, 390, 844)
    yield pg
    assert not pg.errors, pg.errors
    assert not pg.server_errors, pg.server_errors


def test_page_does_not_jump_on_load(page, phone):
    from test_browser import ARTIFACTS

    for pg in (page, phone):
        pg.wait_for_timeout(1500)  # autofocus ran long ago by now
        assert pg.evaluate("window.scrollY") == 0
    # on a desktop the message box still has the focus (for typing at once), without scrolling to it
    assert page.evaluate("document.activeElement === document.querySelector('#fd-msg textarea')")
    page.screenshot(path=str(ARTIFACTS / "edges_desktop_load.png"))
    phone.screenshot(path=str(ARTIFACTS / "edges_phone_load.png"))


def test_send_errors_are_inline_and_keep_the_chat(page):
    from test_browser import _messages, _send, _settings

    pg = page
    _settings(pg, **{"max-new": 8})
    _send(pg, "Hi")
    pg.wait_for_function("document.querySelectorAll('#fd-chat .message-row').length >= 2", timeout=120_000)
    pg.wait_for_function("!document.querySelector('#fd-send').disabled", timeout=120_000)
    before = _messages(pg)
    # an empty message: said beside the box, naming the field; the chat stays (no "Error" over it)
    pg.fill("#fd-msg textarea", "")
    pg.click("#fd-send")
    err = pg.locator("#fd-send-error .fd-field-error")
    err.wait_for(timeout=20_000)
    assert err.inner_text() == "⚠ message: type a message first" and err.get_attribute("role") == "alert"
    assert _messages(pg) == before and "Error" not in pg.locator("#fd-chat").inner_text()
    assert pg.locator("#fd-chat .message-row").first.is_visible()
    # a bad seed: said in its field as soon as it is typed, with the allowed range
    seed = pg.locator("#fd-seed input")
    seed.fill("-5")
    seed.press("Enter")
    field = pg.locator("#fd-seed-error .fd-field-error")
    field.wait_for(timeout=10_000)
    assert field.inner_text() == "⚠ seed: must be -1 (a fresh random seed each run) or an integer in [0, 2^63) (got -5)"
    seed.fill("1e30")
    seed.press("Enter")
    pg.wait_for_function("document.querySelector('#fd-seed-error').innerText.includes('got 1e+30')")
    # Send with it: refused inline, naming the seed; the message stays to resend, the chat is kept
    _send(pg, "Hi again")
    pg.wait_for_function("document.querySelector('#fd-send-error').innerText.includes('seed: must be -1')",
                         timeout=20_000)
    assert pg.locator("#fd-msg textarea").input_value() == "Hi again"
    assert _messages(pg) == before and "Error" not in pg.locator("#fd-chat").inner_text()
    from test_browser import ARTIFACTS

    pg.screenshot(path=str(ARTIFACTS / "edges_send_error.png"))
    seed.fill("-1")
    seed.press("Enter")
    pg.wait_for_function("!document.querySelector('#fd-seed-error .fd-field-error')")
    pg.keyboard.press("Escape")
    pg.click("#fd-send")  # a good send clears the error
    pg.wait_for_function(f"document.querySelectorAll('#fd-chat .message-row').length >= {before + 2}",
                         timeout=120_000)
    assert pg.locator("#fd-send-error .fd-field-error").count() == 0
    pg.wait_for_function("!document.querySelector('#fd-send').disabled", timeout=120_000)


def test_race_and_sweep_errors_are_inline(page):
    from test_browser import fill_in_tab, open_tab

    pg = page
    fill_in_tab(pg, "Race", "#fd-race-msg", "   ")
    pg.click("#fd-race")
    pg.wait_for_selector("#fd-race-meters .fd-field-error", timeout=20_000)
    assert "message: type a message first" in pg.locator("#fd-race-meters").inner_text()
    assert "Error" not in pg.locator("#fd-race-meters").inner_text().replace("⚠", "")
    pg.locator("#fd-race-msg textarea").fill(HAIKU)
    open_tab(pg, "Sweep", "#fd-tab-sweep input[type=checkbox]")
    checked = pg.locator("#fd-tab-sweep input[type=checkbox]:checked")
    while checked.count():
        checked.first.uncheck()
    pg.click("#fd-sweep")
    pg.wait_for_selector("#fd-sweep-status .fd-field-error", timeout=20_000)
    assert "thresholds: pick at least one threshold" in pg.locator("#fd-sweep-status").inner_text()
    pg.wait_for_function("!document.querySelector('#fd-sweep').disabled", timeout=20_000)


def test_bad_input_is_said_while_the_engine_queue_is_full(browser, server):
    """The checks outside the queue, in a browser: on a studio with one decoding slot, taken by a request that cannot
    finish (the engine held), a blank chat, race or sweep message is said beside its field within seconds. Fails if
    a check listener is added after its queued run (Gradio's page then sends it only once the run has finished)."""
    from gradio_client import Client
    from gradio_client.utils import Status

    from app.studio import Studio
    from app.ui import build, launch_kwargs
    from conftest_app import StudioServer, free_port
    from test_browser import fill_in_tab
    from test_reliability import wait_until

    demo = build(Studio(server.engine), slots=1)
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                        **launch_kwargs())
    one_slot = StudioServer(f"http://127.0.0.1:{port}/", server.engine, demo)
    pg, lock, job = None, server.engine.lock, None
    try:
        pg = _open(browser, one_slot, 1440, 1000)
        with lock:  # the engine is "busy": the request below holds the only slot until the lock is released
            job = Client(one_slot.url, verbose=False).submit("Say hello.", [], {"max_new_tokens": 4},
                                                             api_name="/generate")
            wait_until(lambda: job.status().code == Status.PROCESSING, 30)
            pg.fill("#fd-msg textarea", "   ")
            pg.click("#fd-send")
            pg.wait_for_selector("#fd-send-error .fd-field-error", timeout=10_000)
            assert "message: type a message first" in pg.locator("#fd-send-error").inner_text()
            for tab, box, button, field in (("Race", "#fd-race-msg", "#fd-race", "#fd-race-meters"),
                                            ("Sweep", "#fd-sweep-msg", "#fd-sweep", "#fd-sweep-status")):
                fill_in_tab(pg, tab, box, "   ")
                pg.click(button)
                pg.wait_for_selector(f"{field} .fd-field-error", timeout=10_000)
                assert "message: type a message first" in pg.locator(field).inner_text()
            assert not job.done()  # all said while the slot was still taken
        job.result(timeout=120)
        assert not pg.errors and not pg.server_errors, (pg.errors, pg.server_errors)
    finally:
        if pg is not None:
            pg.close()
        demo.close()


def test_sweep_shows_progress_from_the_start(page):
    pg = page  # one threshold, the default block size, 8 tokens (max new tokens from the test above)
    pg.get_by_role("tab", name="Sweep").click()
    checked = pg.locator("#fd-tab-sweep input[type=checkbox]:checked")
    while checked.count():
        checked.first.uncheck()
    pg.locator("#fd-tab-sweep label", has_text="0.9").first.click()
    pg.locator("#fd-tab-sweep label", has_text="32").first.click()
    pg.click("#fd-sweep")
    pg.wait_for_selector("#fd-sweep-status .fd-sweep-progress", timeout=10_000)  # before any point has finished
    assert pg.locator("#fd-sweep-status").inner_text().startswith("Point 1 of 1 (threshold 0.9, block 32) · run 1 of")
    pg.wait_for_function("document.querySelector('#fd-sweep-status').innerText.startsWith('Done: 1 point(s)')",
                         timeout=120_000)
    pg.wait_for_function("!document.querySelector('#fd-sweep').disabled", timeout=20_000)


def _stats(pg, root: str) -> dict[str, str]:
    return pg.evaluate(f"""() => Object.fromEntries([...document.querySelectorAll('{root} .fd-stat')]
                           .map(s => [s.children[0].textContent, s.children[1].textContent]))""")


def _renderer(pg, head: dict) -> None:
    """A Renderer of the page's own studio.js in a fresh box, started on `head`."""
    pg.evaluate("""head => {
      let box = document.querySelector('#fd-test-box');
      if (!box) { box = document.createElement('div'); box.id = 'fd-test-box'; document.body.append(box); }
      window.__r = new window.FDStudio.Renderer(box);
      window.__r.reset(head);
    }""", head)


HEAD = {"model": "m", "config": {"mode": "diffusion", "block_size": 8, "sub_block_size": 4, "max_new_tokens": 8,
                                 "stop_token_ids": [2]}, "prompt_len": 3}


def _ev(nfe: int, committed: list, masked: list, kind: str = "step", t: float = 0.1) -> dict:
    return {"kind": kind, "row": 0, "nfe": nfe, "block": 0, "sub_block": 0, "committed": committed,
            "masked": masked, "text_delta": "", "t": t * nfe}


def test_counts_never_drop_at_stop(page):
    """Tokens committed after a still-masked one are not in the answer (the engine's summary counts the contiguous
    prefix): the tokens stat counts that prefix all along, so Stop never makes it or tokens/forward go down."""
    pg = page
    _renderer(pg, HEAD)
    seen = []
    events = [_ev(1, [[0, 11, "a", 0.99]], [[1, 12, "b", 0.5], [2, 13, "c", 0.4]], "prefill"),
              _ev(2, [[1, 12, "b", 0.95], [3, 14, "d", 0.97]], [[2, 13, "c", 0.6]]),  # 3 before 2: a gap
              _ev(3, [[4, 15, "e", 0.96]], [[2, 13, "c", 0.7]])]
    for ev in events:
        pg.evaluate("ev => window.__r.apply(ev)", ev)
        seen.append(_stats(pg, "#fd-test-box"))
    stopped = {"answer_tokens": 2, "nfe": 3, "tokens_per_forward": 2 / 3, "seconds": 0.3, "tokens_per_second": 6.7,
               "ttft": 0.1, "stop_reason": "cancelled", "finish": {"label": "cancelled", "complete": False}}
    pg.evaluate("s => { window.__r.apply({kind: 'done', nfe: 3, t: 0.3, committed: [], masked: []}); "
                "window.__r.finish(s); }", stopped)
    seen.append(_stats(pg, "#fd-test-box"))
    tokens = [int(s["tokens"].split("/")[0]) for s in seen]
    per_forward = [float(s["tok/forward"]) for s in seen]
    assert tokens == [1, 2, 2, 2], tokens  # the answer so far; the final count is the summary's
    assert per_forward[-1] == pytest.approx(round(2 / 3, 2)) and per_forward[-1] >= per_forward[-2], per_forward
    assert all(b >= a for a, b in zip(tokens, tokens[1:])), tokens
    # the cells committed past the gap are shown as cut off by Stop
    assert pg.locator("#fd-test-box .fd-discarded").count() == 2
    # a stop token ends the count even if later positions were committed in the same forward
    _renderer(pg, HEAD)
    pg.evaluate("ev => window.__r.apply(ev)", _ev(1, [[0, 11, "a", 0.99], [1, 2, "<end>", 0.98],
                                                     [2, 13, "c", 0.97]], [], "prefill"))
    assert _stats(pg, "#fd-test-box")["tokens"] == "2/8"


def test_prefill_is_shown_until_the_first_forward_ends(page):
    pg = page
    _renderer(pg, {**HEAD, "prompt_len": 5123})
    status = pg.locator("#fd-test-box .fd-status")
    assert status.inner_text().startswith("PREFILL") or status.inner_text().lower().startswith("prefill")
    assert "prefilling 5,123 prompt tokens" in status.inner_text()
    assert pg.locator("#fd-test-box .fd-badge-running.fd-badge-prefill").count() == 1  # still "running" for tests
    pg.evaluate("ev => window.__r.apply(ev)", _ev(1, [[0, 11, "a", 0.99]], [], "prefill"))
    assert "prefilling" not in status.inner_text() and "block diffusion" in status.inner_text()
    pg.evaluate("document.querySelector('#fd-test-box').remove()")


def test_chat_label_sits_above_the_messages(page):
    pg = page
    geo = pg.evaluate("""() => {
      const c = document.querySelector('#fd-chat'), label = c.querySelector('label'), wrap = c.querySelector('.bubble-wrap');
      wrap.scrollTop = wrap.scrollHeight;  // scrolled: messages pass the top edge
      return [label.getBoundingClientRect().bottom, wrap.getBoundingClientRect().top,
              wrap.getBoundingClientRect().bottom, c.getBoundingClientRect().bottom];
    }""")
    assert geo[0] <= geo[1] + 0.5, geo  # the label ends where the scrolling messages begin
    assert geo[2] <= geo[3] + 0.5, geo  # and the messages still end inside the chat box


def test_inputs_and_controls_have_names(page):
    pg = page
    for tab, name in (("Replay", "Message"), ("Race", "Prompt to race"), ("Sweep", "Prompt to sweep")):
        pg.get_by_role("tab", name=tab).click()  # a hidden tab's inputs are not in the accessibility tree
        assert pg.get_by_role("textbox", name=name, exact=True).count() == 1, name
        assert pg.get_by_role("textbox", name="Textbox", exact=True).count() == 0
    pg.get_by_role("tab", name="Replay").click()
    for name in ("to the start", "step back one forward", "play", "step forward one forward", "to the end"):
        assert pg.locator("#fd-player").get_by_role("button", name=name, exact=True).count() == 1, name
    assert pg.locator("#fd-player").get_by_role("slider", name="replay position (forwards)").count() == 1
    # presets say which one is on
    pressed = lambda: {b.get_attribute("id"): b.get_attribute("aria-pressed")  # noqa: E731
                       for b in pg.locator(".fd-preset-btn").all()}
    pg.wait_for_function("document.querySelector('#fd-preset-paper').getAttribute('aria-pressed') === 'true'")
    ids = ("careful", "paper", "factor", "fast")
    assert pressed() == {f"fd-preset-{i}": str(i == "paper").lower() for i in ids}
    pg.click("#fd-preset-fast")
    pg.wait_for_function("document.querySelector('#fd-preset-fast').getAttribute('aria-pressed') === 'true'")
    assert pressed() == {f"fd-preset-{i}": str(i == "fast").lower() for i in ids}
    pg.click("#fd-preset-factor")  # the factor rule: the strategy and its value change, the note names it
    pg.wait_for_function("document.querySelector('#fd-preset-factor').getAttribute('aria-pressed') === 'true'")
    assert pressed() == {f"fd-preset-{i}": str(i == "factor").lower() for i in ids}
    assert "Factor · 0.5" in pg.locator("#fd-presets").inner_text()
    pg.click("#fd-preset-paper")
    pg.wait_for_function("document.querySelector('#fd-preset-paper').getAttribute('aria-pressed') === 'true'")


def test_chat_messages_are_named_by_their_text(page):
    """A user message with & and < is named as typed (Gradio named it by the escaped source: '&amp;lt;')."""
    from test_browser import _send

    pg = page
    text = "Fish & chips <b>bold</b>"
    _send(pg, text)
    pg.wait_for_function("!document.querySelector('#fd-send').disabled", timeout=120_000)
    want = f"user's message: {text}"
    pg.wait_for_function(f"[...document.querySelectorAll('#fd-chat [aria-label]')].some(e => "
                         f"e.getAttribute('aria-label') === {json.dumps(want)})", timeout=10_000)
    labels = pg.evaluate("[...document.querySelectorAll('#fd-chat [aria-label]')].map(e => e.getAttribute('aria-label'))")
    assert not any("&amp;" in x or "&lt;" in x or "<span" in x for x in labels), labels
    assert pg.locator("#fd-chat b").count() == 0  # still shown as text, not HTML


def test_phone_preset_note_fits(phone):
    pg = phone
    note = pg.evaluate("""() => { const n = document.querySelector('#fd-presets .fd-presets'), r = n.getBoundingClientRect();
      return [n.scrollWidth, n.clientWidth, Math.max(...[...n.children].map(c => c.getBoundingClientRect().right)), r.right]; }""")
    assert note[0] <= note[1] and note[2] <= note[3] + 0.5, note  # nothing clipped


def test_phone_heatmap_labels_and_toolbar_fit(phone, tmp_path):
    from test_browser import ARTIFACTS

    pg = phone
    # a 40-token trace on the heatmap (uploaded: no decode needed)
    cfg = {"mode": "diffusion", "block_size": 32, "sub_block_size": 8, "threshold": 0.9, "strategy": "threshold",
           "factor": 1.0, "cache": "dual", "max_new_tokens": 40, "temperature": 0.0, "top_p": 1.0, "seed": None,
           "stop_token_ids": [2]}
    events = [_ev(n + 1, [[n, 11, "tok", 0.95]], [[p, 12, "x", 0.4] for p in range(n + 1, 40)],
                  "prefill" if n == 0 else "step") for n in range(40)]
    trace = {"version": 1, "header": {"model": "m", "source": "s", "adapter": True, "device": "cpu", "dtype": "float32",
                                      "config": cfg, "prompt": "p", "prompt_len": 5}, "events": events, "summary": None}
    path = tmp_path / "wide.json"
    path.write_text(json.dumps(trace))
    pg.get_by_role("tab", name="Replay").click()
    with pg.expect_file_chooser() as fc:
        pg.get_by_role("button", name="Upload trace").click()
    fc.value.set_files(str(path))
    pg.wait_for_function("document.querySelector('#fd-player .fd-pos').textContent.startsWith('0/40 ')",
                         timeout=30_000)
    pg.get_by_role("tab", name="Heatmap").click()
    pg.wait_for_selector("#fd-heatmap .xtick text", timeout=30_000)
    pg.wait_for_timeout(700)  # the refit after the tab switch
    pg.locator("#fd-heatmap").scroll_into_view_if_needed()
    boxes = pg.evaluate("""() => [...document.querySelectorAll('#fd-heatmap .xtick text')]
                             .map(t => t.getBoundingClientRect()).map(r => [r.left, r.right])""")
    assert len(boxes) >= 2
    boxes.sort()
    assert all(a[1] <= b[0] for a, b in zip(boxes, boxes[1:])), boxes  # x labels do not overlap
    pg.locator("#fd-heatmap .js-plotly-plot").hover()  # plotly's toolbar shows on hover
    pg.wait_for_selector("#fd-heatmap .modebar", state="visible", timeout=5_000)
    geo = pg.evaluate("""() => { const q = (s) => document.querySelector('#fd-heatmap ' + s).getBoundingClientRect();
      const t = q('.gtitle'), m = q('.modebar'); return [t.left, t.right, t.top, t.bottom, m.left, m.right, m.top, m.bottom]; }""")
    t, m = geo[:4], geo[4:]
    apart = t[1] <= m[0] or m[1] <= t[0] or t[3] <= m[2] or m[3] <= t[2]
    assert apart, geo  # the toolbar does not cover the title
    pg.locator("#fd-heatmap").screenshot(path=str(ARTIFACTS / "edges_phone_heatmap.png"))
    pg.screenshot(path=str(ARTIFACTS / "edges_phone_full.png"), full_page=True)
