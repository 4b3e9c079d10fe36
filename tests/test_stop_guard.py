"""stop_guard: a diffusion step commits nothing right of the leftmost candidate whose best token is the stop token."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, DecodeConfig

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

PROMPTS = ["What is the capital of France? Answer with one word.", "Name a primary colour. One word.",
           "What is 2 + 3? Answer with just the number."]


def past_stop_commits(result, stop_ids: set[int]) -> int:
    """Steps that committed a position right of a candidate (committed or still masked) whose token was a stop."""
    bad = 0
    for e in result.trace.events:
        if e.kind not in ("step", "prefill"):
            continue
        first = min((t.pos for t in e.committed + e.masked if t.id in stop_ids), default=None)
        bad += first is not None and any(t.pos > first for t in e.committed)
    return bad


@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_guard_never_commits_past_a_predicted_stop_and_the_paper_rule_does(engine, threshold):
    stop = set(engine.lm.stop_token_ids)
    on = engine.generate(PROMPTS, engine.decode_config(threshold=threshold, max_new_tokens=32, stop_guard=True))
    off = engine.generate(PROMPTS, engine.decode_config(threshold=threshold, max_new_tokens=32))
    assert all(r.summary.stop_reason == "stop_token" for r in on)
    assert sum(past_stop_commits(r, stop) for r in on) == 0
    assert sum(past_stop_commits(r, stop) for r in off) >= 1  # the rule the guard changes is really exercised


def test_guard_is_off_by_default_and_validated():
    assert DecodeConfig().stop_guard is False
    with pytest.raises(ConfigError, match="stop_guard"):
        DecodeConfig(stop_guard=1).validate()
    assert DecodeConfig.from_dict(DecodeConfig(stop_guard=True).to_dict()).stop_guard is True


def test_cli_flag_sets_the_guard():
    from engine.__main__ import _settings, parser

    assert _settings(parser().parse_args(["generate", "--prompt", "hi", "--stop-guard"]))["stop_guard"] is True
    assert _settings(parser().parse_args(["generate", "--prompt", "hi"]))["stop_guard"] is False


def test_studio_setting_reaches_the_config_and_says_it_is_on(engine):
    from app.settings import KNOB_DEFAULTS, defaults, knobs_summary, to_config

    assert "stop_guard" in defaults(True) and KNOB_DEFAULTS["stop_guard"] in (True, False)
    cfg, _ = to_config(engine, {**defaults(True), "stop_guard": True})
    assert cfg.stop_guard is True and "stop guard" in knobs_summary(cfg)
    cfg, _ = to_config(engine, {**defaults(True), "stop_guard": False})
    assert cfg.stop_guard is False and "stop guard" not in knobs_summary(cfg)


def _assert_examples_finish(engine) -> None:
    """Each studio example, sent with the studio's defaults through its own request path, ends cleanly."""
    from app.settings import EXAMPLES, defaults
    from app.studio import Studio
    from engine.finish import judge

    studio = Studio(engine)
    for example in EXAMPLES:
        prep = studio.prepare(example, [], defaults(True))
        s = engine.generate_ids([prep.ids], prep.cfg, record=False)[0].summary
        verdict = judge(s.text, s.stop_reason)
        assert verdict.complete, (example, verdict.label, s.text[:200])


def test_every_studio_example_finishes_at_the_studio_defaults(engine):
    """Issue 21: each example prompt the studio offers ends with its stop token, without looping, when sent with
    the studio's default settings (app/presets.json) through the studio's own request path."""
    _assert_examples_finish(engine)


@pytest.mark.timeout(600)  # a second engine load (the 4-bit weights) and four long decodes
def test_every_studio_example_finishes_on_the_studios_own_engine(monkeypatch):
    """The same on the engine `python app.py` loads (app.py studio_runtime): the bundled model's 4-bit weights with
    the studio's int8 wide activations, not the suite's fp32 engine."""
    import importlib.util

    from engine import Engine
    from engine.weights.quant import WeightPolicy

    spec = importlib.util.spec_from_file_location("app_main", ROOT / "app.py")
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    for name in ("FASTDLLM_WEIGHTS", "FASTDLLM_WIDE_ACTIVATIONS", "FASTDLLM_ACTIVATIONS", "FASTDLLM_INT8_PREPACK"):
        monkeypatch.delenv(name, raising=False)
    runtime = main.studio_runtime()
    assert runtime.wide_activations == main.STUDIO_WIDE_ACTIVATIONS == "int8"
    engine = Engine.load(runtime=runtime)
    assert engine.lm.info["weights"] == "int4+bf16" and WeightPolicy.of(runtime).only_int8()
    _assert_examples_finish(engine)


def test_bench_quality_decode_option_parses_settings_and_refuses_bad_ones():
    from bench.quality import parse_decode

    assert parse_decode("frequency_penalty=0.5,no_repeat_ngram_size=4,stop_guard=true") == \
        {"frequency_penalty": 0.5, "no_repeat_ngram_size": 4, "stop_guard": True}
    assert parse_decode(None) == {} and parse_decode("stop_guard=false") == {"stop_guard": False}
    assert parse_decode("strategy=factor,factor=1.0,cache=dual-sparse") == \
        {"strategy": "factor", "factor": 1.0, "cache": "dual-sparse"}  # word-valued fields stay words
    for bad in ("nonsense=1", "threshold=0.5", "stop_guard"):
        with pytest.raises(SystemExit, match="--decode"):
            parse_decode(bad)
    for bad, words in (("strategy=fast", "strategy: must be one of threshold, factor"),
                       ("frequency_penalty=abc", "frequency_penalty takes a number"),
                       ("frequency_penalty=3", "frequency_penalty: must be a number in \\[-2, 2\\]")):
        with pytest.raises(SystemExit, match=f"--decode: .*{words}"):  # refused before any model loads
            parse_decode(bad)
