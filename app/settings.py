"""Studio settings: the controls' choices and one-line explanations, and their mapping to DecodeConfig."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from engine import ConfigError, DecodeConfig

# The rule set the UI's controls offer and every entry point (UI, API) enforces: to_config checks both.
BLOCK_SIZES = (8, 16, 32, 64)
MAX_NEW_TOKENS = 1024
MAX_REPEATS = 5  # race and sweep: runs per point, for a median and a spread
_PRESETS_FILE: dict[str, Any] = json.loads((Path(__file__).with_name("presets.json")).read_text("utf-8"))
PRESETS: list[dict[str, Any]] = _PRESETS_FILE["presets"]
EXAMPLES: list[str] = _PRESETS_FILE["examples"]
# The repetition knobs (issue 21 part 4), engine semantics in engine/config.py: each with its "off" value. The
# studio's starting values are data (presets.json "defaults"), so the lead can turn one on without touching code.
# stop_guard (engine/config.py) is the same kind of knob: a choice against endless answers, off = the paper's rule.
KNOBS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size", "stop_guard")
KNOB_OFF: dict[str, float | int | bool] = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                           "no_repeat_ngram_size": 0, "stop_guard": False}
KNOB_DEFAULTS: dict[str, float | int] = {**KNOB_OFF, **{k: v for k, v in _PRESETS_FILE.get("defaults", {}).items()
                                                        if k in KNOB_OFF}}
KNOB_NAMES = {"repetition_penalty": "repetition penalty", "frequency_penalty": "frequency penalty",
              "presence_penalty": "presence penalty", "no_repeat_ngram_size": "no-repeat n-gram size",
              "stop_guard": "stop guard"}
# Empty = no system turn from the studio: the model's chat template adds its own default (SmolLM2's "You are a
# helpful AI assistant named SmolLM, ...", Fast_dLLM_v2's "You are a helpful assistant."), which is what the
# adapter was trained and benchmarked with. A different one is off-distribution for the bundled model: with
# "You are a helpful assistant." it answered "The capital of France is" + newlines to the first example.
DEFAULT_SYSTEM = ""
SWEEP_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# One place for every control's explanation: the UI's info= lines and the /info API endpoint.
INFO = {
    "mode": "diffusion = Fast-dLLM v2 block diffusion (base + adapter); "
            "ar = the same base weights, one token per forward.",
    "block_size": f"Tokens per block ({', '.join(map(str, BLOCK_SIZES))}). Attention is causal across blocks "
                  "and bidirectional inside one; the model was trained with 32.",
    "sub_block_size": "Tokens decoded in parallel inside a block, left to right; "
                      "only divisors of the block size are offered.",
    "threshold": "Commit every masked token whose confidence exceeds this (always at least the best one). "
                 "1.0 = one token per forward.",
    "strategy": "threshold: fixed confidence cut-off; factor: commit the largest n with (n+1)(1-c_n) < factor.",
    "factor": "Factor strategy only: larger commits more tokens per forward (faster, riskier).",
    "cache": "none: recompute the prefix every step; block: cache finished blocks; "
             "dual: also reuse the active block's K/V; dual-sparse: dual whose steps after a block's first compute "
             "only the positions they read, the tokens just committed and their left neighbours (faster, approximate; "
             "CPU).",
    "max_new_tokens": f"Upper bound on answer tokens, 1 to {MAX_NEW_TOKENS} (the stop token usually ends the answer "
                      "earlier).",
    "temperature": "0 = greedy (deterministic). Higher values sample more freely.",
    "top_p": "Nucleus sampling: keep the smallest set of tokens whose probability sums to top-p "
             "(used when temperature > 0).",
    "seed": "-1 = a fresh random seed each run; a number ≥ 0 makes sampling reproducible.",
    "system_prompt": "Sent as the system message before the conversation. Empty = the model's own default (its chat "
                     "template's), which is what the bundled model was trained with.",
    "repetition_penalty": "1 = off. Above 1 divides (or multiplies, if negative) the logit of every token already "
                          "in the prompt or answer, so repeats get less likely (transformers' rule; up to 10).",
    "frequency_penalty": "0 = off. Subtracts this × (times the token is already in the answer) from its logit "
                         "(OpenAI's rule, -2 to 2).",
    "presence_penalty": "0 = off. Subtracts this from the logit of every token already in the answer, once "
                        "(OpenAI's rule, -2 to 2).",
    "stop_guard": "Diffusion: a step commits nothing right of a position whose best token is the stop token, so a "
                  "confident continuation past the end cannot push the end away (off = the paper's rule).",
    "no_repeat_ngram_size": "0 = off. n > 0 never lets the answer repeat an n-token sequence of the prompt or "
                            "answer (transformers' rule, up to 64).",
}

CONFIG_KEYS = ("mode", "block_size", "sub_block_size", "threshold", "strategy", "factor", "cache",
               "max_new_tokens", "temperature", "top_p", "seed")
SETTING_KEYS = CONFIG_KEYS + ("system_prompt",)
# The settings widgets' order: the knobs come last, so a caller that passes only SETTING_KEYS' values (older code,
# tests) gets the studio's knob defaults (to_config fills them).
WIDGET_KEYS = SETTING_KEYS + KNOBS


def divisors(n: int) -> list[int]:
    """Valid sub-block sizes for a block size."""
    return [d for d in range(1, n + 1) if n % d == 0]


def fit_sub_block(block_size: int, wanted: int | None) -> int:
    """wanted when it divides block_size, else the largest divisor not above it (8 when unset)."""
    wanted = 8 if wanted is None else int(wanted)
    return max(d for d in divisors(block_size) if d <= max(wanted, 1))


def defaults(can_diffuse: bool, block_size: int = 32) -> dict[str, Any]:
    d = DecodeConfig()
    return {"mode": "diffusion" if can_diffuse else "ar", "block_size": block_size,
            "sub_block_size": fit_sub_block(block_size, d.sub_block_size), "threshold": d.threshold,
            "strategy": d.strategy, "factor": d.factor, "cache": d.cache, "max_new_tokens": d.max_new_tokens,
            "temperature": d.temperature, "top_p": d.top_p, "seed": -1, **KNOB_DEFAULTS,
            "system_prompt": DEFAULT_SYSTEM}


def knobs_on(settings: Any) -> dict[str, float | int | bool]:
    """The repetition knobs that are on (not at their off value) in a settings dict or a DecodeConfig."""
    get = settings.get if isinstance(settings, dict) else lambda k, d=None: getattr(settings, k, d)
    out = {}
    for k, off in KNOB_OFF.items():
        v = get(k, off)
        if isinstance(off, bool):
            if v is True:
                out[k] = v
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v != off:
            out[k] = v
    return out


def knobs_summary(settings: Any) -> str:
    """One line saying which repetition knobs are on ("" when none is)."""
    on = knobs_on(settings)
    if not on:
        return ""
    return "Repetition knobs on: " + " · ".join(KNOB_NAMES[k] if isinstance(v, bool) else f"{KNOB_NAMES[k]} {v:g}"
                                                for k, v in on.items())


def _int_like(v: Any) -> Any:
    """Numbers from UI widgets arrive as floats (gr.Number, sliders): 32.0 -> 32; anything else unchanged."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def to_config(engine: Any, settings: dict[str, Any] | None, **overrides: Any) -> tuple[Any, str]:
    """(validated DecodeConfig, system prompt) from a settings dict; raises ConfigError naming the field."""
    if not isinstance(settings, (dict, type(None))):
        raise ConfigError("settings", "must be an object of decoding settings")
    s = dict(settings or {})
    system = s.pop("system_prompt", DEFAULT_SYSTEM)
    if system is not None and not isinstance(system, str):
        raise ConfigError("system_prompt", "must be a string")
    known = {f.name for f in fields(DecodeConfig)} - {"stop_token_ids"}
    unknown = sorted(set(s) - known)
    if unknown:
        raise ConfigError(unknown[0], f"unknown setting; known: {', '.join(sorted(known | {'system_prompt'}))}")
    s.setdefault("mode", "diffusion" if engine.can_diffuse else "ar")  # the app's default, as /info says
    for k, v in KNOB_DEFAULTS.items():  # the studio's repetition knobs (presets.json), as /info says
        s.setdefault(k, v)
    s.update(overrides)
    for k in ("block_size", "sub_block_size", "max_new_tokens", "seed", "no_repeat_ngram_size"):
        if k in s:
            s[k] = _int_like(s[k])
    check_limits(s)
    if "seed" in s:
        s["seed"] = check_seed(s["seed"])  # -1 or empty: None, a fresh random seed
    cfg = engine.decode_config(**s)
    if cfg.mode == "diffusion" and not engine.can_diffuse:
        raise ConfigError("mode", "this model has no |<MASK>| token (no Fast-dLLM v2 adapter loaded), so it can "
                                  "only decode with mode 'ar'")
    return cfg, (system or "")


def check_limits(s: dict[str, Any]) -> None:
    """The studio's own limits on top of DecodeConfig's rules: the block sizes and token budget the UI offers."""
    if "block_size" in s and s["block_size"] not in BLOCK_SIZES:
        raise ConfigError("block_size", f"must be one of {', '.join(map(str, BLOCK_SIZES))} (got {s['block_size']!r})")
    n = s.get("max_new_tokens", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
        raise ConfigError("max_new_tokens", f"must be an integer in [1, {MAX_NEW_TOKENS}] (got {n!r})")


SEED_RANGE = "-1 (a fresh random seed each run) or an integer in [0, 2^63)"


def check_seed(seed: Any) -> int | None:
    """The seed a widget or client sent: None for a fresh random seed (-1, empty), else an integer in [0, 2^63)."""
    seed = _int_like(seed)
    if seed is None or seed == "" or seed == -1:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        shown = f"{seed:g}" if isinstance(seed, (int, float)) and not isinstance(seed, bool) and abs(seed) >= 1e15 \
            else repr(seed)
        raise ConfigError("seed", f"must be {SEED_RANGE} (got {shown})")
    return seed


def check_repeats(repeats: Any) -> int:
    repeats = _int_like(repeats)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or not 1 <= repeats <= MAX_REPEATS:
        raise ConfigError("repeats", f"must be an integer in [1, {MAX_REPEATS}] (got {repeats!r})")
    return repeats


def settings_from_widgets(*values: Any) -> dict[str, Any]:
    """The settings dict from the widgets' values, in WIDGET_KEYS order (trailing knobs may be left out)."""
    if len(values) > len(WIDGET_KEYS):
        raise ConfigError("settings", f"expected at most {len(WIDGET_KEYS)} widget values (got {len(values)})")
    return dict(zip(WIDGET_KEYS, values))
