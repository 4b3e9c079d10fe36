"""The studio never presents a loop as speed (issue 21, part 5): answers that hit the cap or loop are marked in the
chat bubble, the meters, the live view, the race and the sweep; the race compares time to a complete answer and
gives a tokens/s ratio only when both sides finished; the banner shows the long-answer stop and loop rates.

Every decode here is real (the bundled model through the studio's API or in headless Chromium), capped with a
small max_new_tokens so the tests are fast and their outcome deterministic.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from app import plots, render
from app.card import front_matter, long_answers, measured_for
from app.verdict import finish_record, race_verdict
from engine import Summary, Trace

HAIKU = "Write a haiku about the sea."
LOOP = "that\nThe is a beautiful poem that\n" * 12  # the loop
XSS = "<img src=x onerror=alert(1)>"
ROOT = Path(__file__).resolve().parent.parent


def _summary(stop: str, text: str, n: int = 17, seconds: float = 1.0, tps: float = 5.0, nfe: int = 10) -> Summary:
    return Summary(answer_tokens=n, nfe=nfe, tokens_per_forward=n / nfe, seconds=seconds, tokens_per_second=tps,
                   ttft=0.1, stop_reason=stop, text=text, token_ids=[])


@pytest.fixture(scope="module")
def capped(client, server):
    """A real chat turn cut at 8 tokens: (text, summary)."""
    text, trace = client.predict(HAIKU, [], {"max_new_tokens": 8, "mode": server.mode}, api_name="/generate")
    s = Trace.loads(trace).summary
    assert s.stop_reason == "max_new_tokens" and s.answer_tokens == 8
    return text, s


# ---------------------------------------------------------------- chat bubble and meters
def test_capped_answer_is_marked_in_bubble_and_meters(capped):
    text, s = capped
    rec = finish_record(s)
    assert rec["label"] in ("capped", "looping") and not rec["complete"]
    assert rec["badges"][0] == "⚠ cut at 8 tokens — did not finish"
    shown = render.chat_display([{"role": "user", "content": HAIKU},
                                 {"role": "assistant", "content": text, "finish": rec}])[1]["content"]
    assert '<span class="fd-finish fd-finish-' in shown and "cut at 8 tokens — did not finish" in shown
    meters = render.meters_html(s, "diffusion · engine time")
    assert 'data-finish="capped"' in meters or 'data-finish="looping"' in meters
    assert meters.count("fd-card-muted") == 2  # tokens/s and tokens/forward greyed out
    assert "⚠ Did not finish (cut at 8 tokens" in meters and "not a speed-up" in meters


def test_complete_answer_is_not_marked():
    s = _summary("stop_token", "Waves kiss the shore,\nsalt wind hums an old song,\nthe tide keeps its time.")
    rec = finish_record(s)
    assert rec == {"label": "complete", "complete": True, "repeat_share": 0.0, "badges": []}
    assert "fd-finish" not in render.chat_display([{"role": "assistant", "content": s.text, "finish": rec}])[0][
        "content"]
    meters = render.meters_html(s)
    assert "fd-card-muted" not in meters and "fd-unfinished" not in meters and 'data-finish="complete"' in meters


def test_looping_answer_is_marked_even_when_it_stopped():
    s = _summary("stop_token", LOOP, n=120)
    rec = finish_record(s)
    assert rec["label"] == "looping"
    assert len(rec["badges"]) == 1 and rec["badges"][0].startswith("⚠ repeats itself (")
    assert "% repeated word 4-grams)" in rec["badges"][0]
    meters = render.meters_html(s)
    assert 'data-finish="looping"' in meters and meters.count("fd-card-muted") == 2


def test_model_output_is_escaped_beside_the_badges():
    s = _summary("max_new_tokens", (XSS + " ") * 10, n=64)
    shown = render.chat_display([{"role": "assistant", "content": s.text, "finish": finish_record(s)}])[0]["content"]
    assert "<img" not in shown and "&lt;img" in shown and '<span class="fd-finish' in shown
    # a finish record that came back from the browser state with hostile fields is escaped too
    evil = render.chat_display([{"role": "assistant", "content": "x",
                                 "finish": {"label": XSS, "badges": [XSS]}}])[0]["content"]
    assert "<img" not in evil and "fd-finish-unfinished" in evil
    for html in (render.meters_html(s, XSS, _summary("stop_token", XSS)),
                 render.race_html([s], [_summary("stop_token", XSS)], XSS)):
        assert "<img" not in html


def test_live_view_payload_carries_the_verdict(capped):
    _, s = capped
    d = json.loads(render.live_payload("r", 0, [], summary=s))
    assert d["sum"]["finish"]["complete"] is False and d["sum"]["finish"]["why"].startswith("cut at 8 tokens")


# ---------------------------------------------------------------- race
def test_race_with_an_unfinished_side_gives_no_speed_ratio():
    ar = _summary("stop_token", "Waves kiss the shore,\nsalt wind hums an old song,\nthe tide keeps its time.",
                  seconds=1.0, tps=17.0)
    loop = _summary("max_new_tokens", LOOP, n=256, seconds=9.0, tps=28.0, nfe=130)
    v = race_verdict([loop], [ar])
    assert not v.comparable and v.speedup is None and v.finished == {"diffusion": ["looping"], "ar": ["complete"]}
    assert v.headline.startswith("dLLM did not finish (cut at 256 tokens, looping); AR finished in 1.0 s.")
    html = render.race_html([loop], [ar], "Done")
    assert "dLLM did not finish (cut at 256 tokens, looping); AR finished in 1.0 s" in html
    assert "fd-ratio" not in html and "tokens/s</b>" not in html and "1.65×" not in html
    both = render.race_html([_summary("stop_token", "a b c", seconds=0.5, tps=10.0)], [ar], "Done")
    assert "Both finished. Time to a complete answer: dLLM 500 ms, AR 1.0 s (dLLM 2.00× faster)" in both
    assert "diffusion / AR speed: <b>0.59×</b> tokens/s" in both
    # one diffusion run of three looped: still no ratio, and the headline says how many
    mixed = race_verdict([ar, loop, ar], [ar, ar, ar])
    assert mixed.speedup is None and mixed.headline.startswith("dLLM did not finish in 1 of 3 runs (cut at 256")


def test_race_api_reports_finish_and_compares_only_finished_answers(client, server):
    if not server.engine.can_diffuse:
        pytest.skip("race needs the Fast-dLLM v2 adapter")
    race = client.predict(HAIKU, {"max_new_tokens": 4}, 1, api_name="/race")  # both cut at 4 tokens
    assert race["finish"] == {"diffusion": ["capped"], "ar": ["capped"]}
    assert race["comparable"] is False and race["speedup"] is None and race["speedup_range"] is None
    assert race["headline"].startswith("dLLM did not finish (cut at 4 tokens); AR did not finish (cut at 4 tokens).")
    assert race["time_to_complete"] == {"diffusion": None, "ar": None}
    # at the studio's defaults the AR base writes a 30-token haiku and stops: with room for it, AR finishes; the
    # dLLM's side is judged
    race = client.predict(HAIKU, {"max_new_tokens": 40}, 1, api_name="/race")
    assert race["finish"]["ar"] == ["complete"] and race["time_to_complete"]["ar"] > 0
    d = race["runs"]["diffusion"][0]
    if race["finish"]["diffusion"] == ["complete"]:
        assert race["comparable"] and race["speedup"] == pytest.approx(
            d["tokens_per_second"] / race["runs"]["ar"][0]["tokens_per_second"])
    else:
        assert race["speedup"] is None and race["headline"].startswith("dLLM did not finish (")
        assert "AR finished in " in race["headline"]


# ---------------------------------------------------------------- sweep
def test_sweep_marks_points_that_did_not_finish(client, server):
    if not server.engine.can_diffuse:
        pytest.skip("sweep needs the Fast-dLLM v2 adapter")
    rows = client.predict(HAIKU, [0.9], [32], {"max_new_tokens": 4}, 1, api_name="/sweep")
    assert [r["finish"] for r in rows] == ["capped"]
    fig = plots.sweep_figure(rows + [{**rows[0], "threshold": 1.0, "finish": "complete"}])
    marker = fig.data[0].marker
    assert list(marker.symbol) == ["x-thin-open", "circle"]
    assert "did not finish" in fig.layout.title.text and "1 of 2 points" in fig.layout.title.text
    assert fig.data[0].customdata[0][3].startswith("did not finish (capped)")
    evil = plots.sweep_figure([{**rows[0], "finish": XSS}])
    assert "<img" not in json.dumps(evil.to_dict())


# ---------------------------------------------------------------- banner
def test_banner_shows_long_answer_stop_and_loop_rates(engine):
    m = measured_for(engine.lm.source.adapter)
    assert m is not None and m.long is not None
    fm = front_matter()
    assert m.long == long_answers(fm)
    banner = render.banner_html(engine.lm, True, "t", m, 0.9)
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    assert (f"ends <b>{pct(fm['long_stop_rate'])}</b> of them with its stop token (AR base "
            f"<b>{pct(fm['ar_long_stop_rate'])}</b>)") in banner
    assert f"loops on <b>{pct(fm['long_loop_rate'])}</b> (AR base <b>{pct(fm['ar_long_loop_rate'])}</b>)" in banner
    assert f"<b>{fm['tokens_per_forward_complete']:.2f} tokens per forward</b>" in banner
    assert f"over its {fm['long_complete_n']} complete, non-looping answers" in banner.lower()
    assert esc_in(fm["long_source"], banner)
    # the card's numbers are the measurement it cites (when it cites a results file)
    src = ROOT / fm["long_source"]
    if src.suffix == ".json" and src.exists():
        rows = {r["mode"]: r for r in json.loads(src.read_text())["results"]}
        d, ar = rows["diffusion"], rows["ar"]
        assert fm["long_stop_rate"] == pytest.approx(d["long_stop_rate"], abs=5e-3)
        assert fm["long_loop_rate"] == pytest.approx(d["long_loop_rate"], abs=5e-3)
        assert fm["ar_long_stop_rate"] == pytest.approx(ar["long_stop_rate"], abs=5e-3)
        assert fm["ar_long_loop_rate"] == pytest.approx(ar["long_loop_rate"], abs=5e-3)
        assert fm["tokens_per_forward_complete"] == pytest.approx(d["long_complete_tokens_per_forward"], abs=5e-4)
        assert fm["long_tokens_per_forward"] == pytest.approx(d["long_tokens_per_forward"], abs=5e-4)
        assert fm["long_complete_n"] == d["long_complete_n"]
    # the "loops are easy to predict" remark only where all answers decode faster than the complete ones
    looped = render.long_html(replace(m.long, tokens_per_forward_complete=1.15, tokens_per_forward_all=1.83))
    clean = render.long_html(replace(m.long, tokens_per_forward_complete=1.06, tokens_per_forward_all=1.06))
    assert "(1.83 over all: loops are easy" in looped and "(1.06 over all)." in clean and "loops are easy" not in clean
    # without the keys the line is not there (and nothing breaks)
    assert "fd-long" not in render.banner_html(engine.lm, True, "t", replace(m, long=None), 0.9)
    assert long_answers({"long_stop_rate": 0.4}) is None


def esc_in(text: str, html: str) -> bool:
    return render.esc(text) in html


# ---------------------------------------------------------------- repetition knobs (issue 21 part 4, the studio's half)
def test_knob_defaults_are_data_and_the_measured_ones():
    from app.settings import KNOB_DEFAULTS, KNOB_OFF, KNOBS, _PRESETS_FILE, defaults, knobs_summary

    assert set(KNOBS) == set(KNOB_OFF) == set(_PRESETS_FILE["defaults"])  # one place: presets.json "defaults"
    assert KNOB_DEFAULTS == _PRESETS_FILE["defaults"]
    # chosen by measurement (bench/results/studio_defaults, studio_knobs_fp): frequency 0.3, no-repeat 4-grams, guard
    assert {k: v for k, v in KNOB_DEFAULTS.items() if v != KNOB_OFF[k]} == \
        {"frequency_penalty": 0.3, "no_repeat_ngram_size": 4, "stop_guard": True}
    d = defaults(True)
    assert {k: d[k] for k in KNOBS} == KNOB_DEFAULTS
    assert knobs_summary(d) == "Repetition knobs on: frequency penalty 0.3 · no-repeat n-gram size 4 · stop guard"
    off = {**d, **KNOB_OFF}
    assert knobs_summary(off) == ""
    assert knobs_summary({**off, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}) == \
        "Repetition knobs on: repetition penalty 1.3 · no-repeat n-gram size 3"
    assert 'data-knobs="off"' in render.knobs_html(off) and "all off" in render.knobs_html(off)
    assert 'data-knobs="on"' in render.knobs_html(d)
    assert XSS not in render.knobs_html({"repetition_penalty": XSS})


def test_knobs_reach_the_engine_and_the_trace(client, server):
    info = client.predict(api_name="/info")
    for k in ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size"):
        assert k in info["defaults"] and k in info["settings_help"]
    settings = {"max_new_tokens": 24, "mode": server.mode, "no_repeat_ngram_size": 3, "repetition_penalty": 1.3}
    text, trace = client.predict(HAIKU, [], settings, api_name="/generate")
    cfg = Trace.loads(trace).header["config"]
    assert cfg["no_repeat_ngram_size"] == 3 and cfg["repetition_penalty"] == 1.3
    ids = Trace.loads(trace).summary.token_ids  # the engine applied it: no token 3-gram of the answer repeats
    grams = list(zip(ids, ids[1:], ids[2:]))
    assert len(ids) >= 8 and len(set(grams)) == len(grams), text
    from app.traces import settings_label

    assert "repetition penalty 1.3 · frequency penalty 0.3 · no-repeat n-gram 3 · stop guard" in settings_label(cfg)
    meters = render.meters_html(Trace.loads(trace).summary, knobs="Repetition knobs on: x")
    assert 'class="fd-knobs-line" data-knobs="on">Repetition knobs on: x<' in meters


@pytest.mark.parametrize("settings, words", [
    ({"no_repeat_ngram_size": 99}, "no_repeat_ngram_size: must be an integer in [0, 64]"),
    ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size: must be an integer in [0, 64]"),
    ({"repetition_penalty": 0}, "repetition_penalty: must be a number in (0, 10]"),
    ({"frequency_penalty": 3}, "frequency_penalty: must be a number in [-2, 2]"),
    ({"presence_penalty": "lots"}, "presence_penalty: must be a number in [-2, 2]"),
])
def test_bad_knob_values_name_the_parameter_and_range(client, settings, words):
    with pytest.raises(Exception) as err:
        client.predict("hi", [], {**settings, "max_new_tokens": 4}, api_name="/generate")
    assert str(err.value).startswith(words) and "Traceback" not in str(err.value), str(err.value)


# ---------------------------------------------------------------- in the browser (headless Chromium)
@pytest.fixture(scope="module")
def page(server):
    from test_browser import ARTIFACTS, CHROMIUM, sync_playwright

    if sync_playwright is None or CHROMIUM is None:
        pytest.skip("needs playwright and a Chromium binary")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(server.url)
        pg.wait_for_selector(".fd-live-root .fd-legend", timeout=30_000)
        yield pg
        browser.close()
    assert not errors, errors


def test_browser_marks_a_capped_answer_and_race(page):
    """Bubble badge, greyed meters, live badge, the race's "did not finish" headline without a tokens/s ratio, and
    the banner's stop and loop rates, as a visitor sees them."""
    from test_browser import ARTIFACTS, _send, _settings, fill_in_tab

    pg, fm = page, front_matter()
    long = pg.locator("#fd-long").inner_text()
    for k in ("long_stop_rate", "ar_long_stop_rate", "long_loop_rate", "ar_long_loop_rate"):
        assert f"{100 * fm[k]:.0f}%" in long, (k, long)
    assert f"{fm['tokens_per_forward_complete']:.2f} tokens per forward" in long
    # a chat answer cut at 8 tokens
    _settings(pg, **{"max-new": 8})
    _send(pg, HAIKU)
    pg.wait_for_selector("#fd-live .fd-badge-unfinished, #fd-live .fd-badge-looping", timeout=120_000)
    assert "did not finish: cut at 8 tokens" in pg.locator("#fd-live .fd-status").inner_text()
    badge = pg.locator("#fd-chat .fd-finish").first
    badge.wait_for(timeout=120_000)
    assert badge.inner_text() == "⚠ cut at 8 tokens — did not finish"
    assert pg.locator('#fd-meters .fd-card[data-k="stop"] .fd-card-v').inner_text() in ("capped", "looping")
    muted = pg.locator("#fd-meters .fd-card-muted")
    assert muted.count() == 2
    assert float(muted.first.evaluate("e => getComputedStyle(e).opacity")) < 0.6  # greyed out, visibly
    assert "Did not finish (cut at 8 tokens" in pg.locator("#fd-meters").inner_text()
    pg.screenshot(path=str(ARTIFACTS / "screenshot_unfinished.png"))
    # the race, both sides cut at 8 tokens: no tokens/s ratio, a plain headline
    fill_in_tab(pg, "Race", "#fd-race-msg", HAIKU)
    reps = pg.locator("#fd-race-reps input[type=number]")
    reps.fill("1")
    reps.press("Enter")
    pg.click("#fd-race")
    pg.wait_for_selector("#fd-race-meters .fd-verdict", timeout=120_000)
    verdict = pg.locator("#fd-race-meters .fd-verdict").inner_text()
    assert verdict.startswith("dLLM did not finish (cut at 8 tokens") and "AR did not finish (cut at 8" in verdict
    assert "No speed comparison" in verdict
    assert pg.locator("#fd-race-meters .fd-ratio").count() == 0
    assert "tokens/s (" not in pg.locator("#fd-race-meters").inner_text()
    pg.locator("#fd-race-meters").screenshot(path=str(ARTIFACTS / "screenshot_race_unfinished.png"))
    pg.wait_for_function("!document.querySelector('#fd-race').disabled", timeout=30_000)


def test_browser_knob_controls_validate_and_say_what_is_on(page):
    """The knobs are in the settings accordion with their explanations; a bad value is refused with the parameter's
    name and range, and the conversation is kept; the summary line and the meters say which knobs are on."""
    from test_browser import _messages, _send, _settings

    pg = page
    _settings(pg)
    box = pg.locator("#fd-no-repeat-ngram-size input")
    assert "never lets the answer repeat" in pg.locator("#fd-no-repeat-ngram-size").inner_text()
    assert "Repetition knobs on: frequency penalty 0.3 · no-repeat n-gram size 4 · stop guard" in \
        pg.locator("#fd-knobs").inner_text()  # the studio's measured defaults (app/presets.json)
    before = _messages(pg)
    assert before >= 2  # the capped turn of the test above
    box.fill("99")
    box.press("Enter")
    _send(pg, "Hi")
    toast = pg.get_by_text("no_repeat_ngram_size: must be an integer in [0, 64]").first
    toast.wait_for(timeout=120_000)
    assert _messages(pg) == before  # nothing lost, nothing added
    assert pg.locator("#fd-msg textarea").input_value() == "Hi"  # the message is still there to resend
    box.fill("3")
    box.press("Enter")
    pg.wait_for_function("document.querySelector('#fd-knobs').innerText.includes('no-repeat n-gram size 3')")
    pg.keyboard.press("Escape")
    pg.click("#fd-send")
    pg.wait_for_function(f"document.querySelectorAll('#fd-chat .message-row').length >= {before + 2}",
                         timeout=120_000)
    # the turn above ran at the defaults (its meters already name size 4): wait for this run's meters
    pg.wait_for_function("(document.querySelector('#fd-meters .fd-knobs-line') || {innerText: ''})"
                         ".innerText.includes('size 3')", timeout=120_000)
    assert pg.locator("#fd-meters .fd-knobs-line").inner_text() == \
        "Repetition knobs on: frequency penalty 0.3 · no-repeat n-gram size 3 · stop guard"
    box.fill("0")
    box.press("Enter")
    pg.wait_for_function("!document.querySelector('#fd-knobs').innerText.includes('no-repeat')")
