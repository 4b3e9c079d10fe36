"""The studio's named API (gradio_client, the "Use via API" page): typed endpoints over Studio."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypedDict

import gradio as gr

from engine import ConfigError, Result
from engine.scheduler import MAX_BATCH

from .settings import BLOCK_SIZES, INFO, MAX_NEW_TOKENS, MAX_REPEATS
from .studio import Studio, summary_dict
from .traces import TraceError, parse_trace

SLOTS = MAX_BATCH  # visitors decoding at once (their rows share the scheduler's forwards); more wait in the queue


def engine_slots(slots: int) -> dict[str, Any]:
    """Every decoding event shares one Gradio concurrency group of `slots`."""
    return dict(concurrency_id="engine", concurrency_limit=slots)


class RunSummary(TypedDict):
    answer_tokens: int
    nfe: int
    tokens_per_forward: float
    seconds: float
    tokens_per_second: float
    ttft: float
    stop_reason: str
    text: str
    cached_tokens: int  # prompt positions the prefix cache gave (a conversation's earlier turns), not prefilled


class SweepRow(TypedDict):
    threshold: float
    block_size: int
    sub_block_size: int
    runs: int
    tokens_per_second: float  # median of the runs
    tokens_per_second_min: float
    tokens_per_second_max: float
    tokens_per_forward: float
    nfe: float
    answer_tokens: float
    seconds: float
    stop_reason: str
    finish: str  # complete | capped | looping | cancelled | context (engine/finish.py), or e.g. "capped 1/2"


class TraceCheck(TypedDict):
    header: dict[str, Any]
    events: int
    summary: RunSummary | None


class Limits(TypedDict):
    block_sizes: list[int]
    max_new_tokens: int
    repeats: int


class Info(TypedDict):
    banner: str
    can_diffuse: bool
    defaults: dict[str, Any]
    block_sizes: list[int]
    limits: Limits
    settings_help: dict[str, str]
    engine_forwards: int | None  # forwards the in-process engine's scheduler has run (prefills included); None remote


def error(e: Exception) -> gr.Error:
    return gr.Error(str(e), title="Invalid setting" if isinstance(e, ConfigError) else "Error", print_exception=False)


def _typed(call: Callable, fn: Callable) -> Callable:
    """Gradio reads an endpoint's types from its signature; this module's annotations are strings (PEP 563),
    so hand it the evaluated ones (else every output shows as "Any")."""
    call.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return call


def plain(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except (ConfigError, TraceError) as e:
            raise error(e) from None
        except Exception as e:  # a bug or an engine failure: a message, not Gradio's opaque "Error"
            raise gr.Error(f"{fn.__name__} failed: {e}") from e
    return _typed(call, fn)


def streamed(fn: Callable) -> Callable:
    """A decoding endpoint as a generator: Gradio closes it when the client cancels (job.cancel()) or
    disconnects, and closing stops the engine after its current forward (no orphan work)."""
    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            yield from fn(*args)
        except (ConfigError, TraceError) as e:
            raise error(e) from None
        except Exception as e:  # an engine failure mid-generation: say so; the next request works
            raise gr.Error(f"decoding failed: {e}") from e
    return _typed(call, fn)


def _forwards(engine: Any) -> int | None:
    """The shared scheduler's forward count (what batching visitors saves: compare with their NFE summed), or None
    where decodes do not go through it (a remote engine, ZeroGPU)."""
    from .stream import scheduler_for

    sched = scheduler_for(engine)
    return None if sched is None else sched.forwards


def register(studio: Studio, defaults: dict[str, Any], slots: int = SLOTS) -> None:
    """Add the named endpoints to the Blocks being built. Every decoding setting is checked by the same rules as
    the UI's (app/settings.py: block sizes, max_new_tokens, repeats)."""
    eng = studio.engine

    # The return annotations give Gradio the outputs (and the API docs); each endpoint yields such a value
    # once per frame (the answer so far) and the final result last, which is what Client.predict returns.
    def generate(message: str, history: list[dict[str, str]], settings: dict[str, Any]) -> tuple[str, str]:
        """Answer one chat turn. history: [{role, content}]; settings: decoding settings (see /info).
        Returns (answer text, trace JSON); streams (answer so far, "") while decoding."""
        yield from studio.generate(message, history, settings)

    def race(message: str, settings: dict[str, Any], repeats: int = 1) -> dict[str, Any]:
        """Decode one prompt by block diffusion and by the AR baseline, `repeats` times interleaved (1-5).
        Returns the median runs' summaries, every run, each run's finish (complete | looping | capped | ...), a
        headline, the time to a complete answer, and the tokens/s speed-up (median and range of the pairs' ratios)
        only when every answer of both sides finished (else null). Streams {running, run, text} while decoding."""
        yield from studio.race(message, settings, repeats)

    def sweep(message: str, thresholds: list[float], block_sizes: list[int], settings: dict[str, Any],
              repeats: int = 1) -> list[SweepRow]:
        """One prompt across thresholds × block sizes, each point `repeats` times (1-5): median tokens/s with its
        range, and tokens per forward (streams the rows so far)."""
        yield from studio.sweep(message, thresholds, block_sizes, settings, repeats)

    def check_trace(trace_json: str) -> TraceCheck:
        """Validate a trace JSON as the replay upload does; returns its header and summary."""
        tr = parse_trace(trace_json)
        return {"header": tr.header, "events": len(tr.events),
                "summary": summary_dict(Result(tr.summary, None)) if tr.summary else None}

    def info() -> Info:
        """The loaded model, the default settings and the limits every endpoint enforces."""
        return {"banner": eng.lm.banner(), "can_diffuse": eng.can_diffuse, "defaults": defaults,
                "block_sizes": list(BLOCK_SIZES),
                "limits": {"block_sizes": list(BLOCK_SIZES), "max_new_tokens": MAX_NEW_TOKENS, "repeats": MAX_REPEATS},
                "settings_help": INFO, "engine_forwards": _forwards(eng)}

    engine = engine_slots(slots)
    gr.api(streamed(generate), api_name="generate", **engine)
    gr.api(streamed(race), api_name="race", **engine)
    gr.api(streamed(sweep), api_name="sweep", **engine)
    gr.api(plain(check_trace), api_name="check_trace")
    gr.api(plain(info), api_name="info")
