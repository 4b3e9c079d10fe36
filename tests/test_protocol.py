"""One protocol for "an engine" (engine/protocol.py): the in-process Engine and the studio's RemoteEngine both carry
every member with the same parameters, and the engine owns the one scheduler its front ends share."""
from __future__ import annotations

import inspect

from app.backend import RemoteEngine
from engine import Engine
from engine.protocol import DecodeEngine

METHODS = [n for n, v in vars(DecodeEngine).items() if callable(v) and not n.startswith("_")]
FIELDS = list(DecodeEngine.__annotations__)


def params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_both_engines_implement_the_protocol_with_its_parameters():
    assert set(METHODS) == {"chat_prompt", "encode", "decode_config", "check_ids", "trace_header", "generate_ids"}
    assert set(FIELDS) == {"lm", "max_context", "can_diffuse"}
    for impl in (Engine, RemoteEngine):
        for name in METHODS:
            assert params(getattr(impl, name)) == params(getattr(DecodeEngine, name)), (impl.__name__, name)


def test_the_loaded_engine_is_a_decode_engine_and_owns_one_scheduler(engine):
    assert isinstance(engine, DecodeEngine)
    e = Engine(engine.lm)  # same weights, its own scheduler
    try:
        first = e.start_scheduler(max_batch=4, prefill_chunk=128)
        assert e.scheduler is first and (first.max_batch, first.prefill_chunk) == (4, 128)  # settings of the first call
        cfg = e.decode_config(mode="ar", max_new_tokens=4)
        ids = e.encode(e.chat_prompt([{"role": "user", "content": "Hi"}]))
        assert first.generate_ids(ids, cfg).summary.token_ids == e.generate_ids([ids], cfg)[0].summary.token_ids
    finally:
        e.close_scheduler()
    assert e._scheduler is None and e.scheduler is not first  # closed, and a later use starts a fresh one
    e.close_scheduler()
