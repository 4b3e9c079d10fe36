"""The server's request validation (engine/serve/request.py) in process: parse() on real engines, no HTTP.

Every field of the parsed ApiRequest and every refusal's exact message, status and parameter are pinned, so a
changed limit, a flipped comparison or a reworded error fails here. The engines are tiny random checkpoints in the
Fast_dLLM_v2 layout with the bundled tokenizer (tests/checkpoints.py; parse() reads the name, the chat template, the
vocabulary and the mask token, never the weights), one with |<MASK>| and one AR-only: a few seconds for the file,
which is the mutation target `serve`'s test selection (scripts/mutation.sh). The HTTP layer around parse() is tested
on the bundled model in test_serve.py and test_serve_surface.py.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer  # noqa: F401  (imported at collection, before the engines load)

from checkpoints import build_fast_dllm_checkpoint
from engine import Engine
from engine.weights import MASK_TOKEN
from engine.serve.request import MAX_JSON_DEPTH, ApiError, ApiRequest, _depth, _show, parse

HI = [{"role": "user", "content": "hi"}]
KNOBS_LIST = ("mode, block_size, sub_block_size, threshold, strategy, factor, cache, stop_guard, frequency_penalty, "
              "presence_penalty, repetition_penalty, no_repeat_ngram_size")


PRELOADED: dict[str, Engine] = {}
if os.environ.get("PRELOAD_TEST_ENGINES"):
    # scripts/mutation.sh sets this: mutmut forks every mutant's run from a server that has only collected the tests,
    # so engines built here, at collection, are built once for the whole run instead of once per mutant (~3 s each).
    # One torch thread first: a process forked after torch started a thread pool can deadlock.
    import torch

    torch.set_num_threads(1)
    for _name, _mask in (("tiny-dllm", True), ("tiny-ar", False)):
        _dir = Path(tempfile.mkdtemp(prefix="serve_request_")) / _name
        PRELOADED[_name] = Engine.load(str(build_fast_dllm_checkpoint(_dir, mask=_mask)))


def _tiny_engine(tmp_path_factory, name: str, mask: bool) -> Engine:
    if name in PRELOADED:
        return PRELOADED[name]
    return Engine.load(str(build_fast_dllm_checkpoint(tmp_path_factory.mktemp(name) / name, mask=mask)))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny dLLM: block diffusion by default, |<MASK>| one of its ids."""
    eng = _tiny_engine(tmp_path_factory, "tiny-dllm", True)
    assert eng.can_diffuse and eng.lm.name == "tiny-dllm"
    return eng


@pytest.fixture(scope="module")
def ar_engine(tmp_path_factory):
    """A tiny model without a mask token: AR only."""
    eng = _tiny_engine(tmp_path_factory, "tiny-ar", False)
    assert not eng.can_diffuse
    return eng


def ok(engine, chat: bool = True, **body) -> ApiRequest:
    base = {"model": engine.lm.name} | ({"messages": HI} if chat else {"prompt": "The sky is"})
    return parse(base | body, chat, engine, engine.lm.name)


def refused(engine, body, chat: bool = True, status: int = 400, full: bool = True) -> ApiError:
    """The ApiError parse() raises for `body` (the model and messages/prompt added unless given)."""
    if full:
        body = {"model": engine.lm.name} | ({"messages": HI} if chat else {"prompt": "The sky is"}) | body
    with pytest.raises(ApiError) as e:
        parse(body, chat, engine, engine.lm.name)
    assert e.value.status == status and e.value.message == str(e.value), e.value
    return e.value


def says(e: ApiError, message: str, param: str | None) -> None:
    assert (e.message, e.param) == (message, param), (e.message, e.param)


# ---------------------------------------------------------------- what a valid request parses to
def test_a_bare_chat_request_gets_the_engine_defaults(engine):
    r = ok(engine)
    assert r == ApiRequest(True, engine.chat_prompt(HI), "hi", None, engine.decode_config(mode="diffusion"),
                           False, False, False, [], "max_tokens", False, 1, False, False, 0)


def test_every_field_of_a_completions_request(engine):
    body = {"prompt": "The sky is", "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n", "."],
            "max_tokens": 7, "n": 1, "logprobs": 0, "temperature": 0.5, "top_p": 0.9, "seed": 3, "mode": "ar",
            "frequency_penalty": 0.1, "presence_penalty": 0.2, "repetition_penalty": 1.1, "no_repeat_ngram_size": 3,
            "user": "u1", "top_logprobs": 0, "response_format": {"type": "text"}, "echo": False}
    cfg = engine.decode_config(mode="ar", temperature=0.5, top_p=0.9, seed=3, max_new_tokens=7, frequency_penalty=0.1,
                               presence_penalty=0.2, repetition_penalty=1.1, no_repeat_ngram_size=3)
    assert ok(engine, False, **body) == ApiRequest(False, "The sky is", "The sky is", None, cfg, True, True, False,
                                                    ["\n", "."], "max_tokens", True, 1, True, False, 0)


def test_every_decoding_knob_reaches_the_config(engine):
    knobs = {"mode": "diffusion", "block_size": 16, "sub_block_size": 4, "threshold": 0.7, "strategy": "factor",
             "factor": 2.0, "cache": "block", "stop_guard": True}
    r = ok(engine, **knobs, denoise_events=True, max_completion_tokens=9)
    assert r.cfg == engine.decode_config(**knobs, max_new_tokens=9)
    assert (r.denoise_events, r.max_tokens_name, r.max_tokens_given) == (True, "max_completion_tokens", True)


def test_null_means_not_given_and_max_completion_tokens_wins(engine):
    r = ok(engine, temperature=None, top_p=None, seed=None, frequency_penalty=None, max_tokens=None, n=None,
           stream=None, stop=None, stream_options=None, logprobs=None, top_logprobs=None, denoise_events=None,
           response_format=None, max_completion_tokens=None)
    assert r == ok(engine)
    r = ok(engine, max_tokens=5, max_completion_tokens=6)
    assert (r.cfg.max_new_tokens, r.max_tokens_name, r.max_tokens_given) == (6, "max_completion_tokens", True)
    r = ok(engine, max_tokens=5, max_completion_tokens=None)
    assert (r.cfg.max_new_tokens, r.max_tokens_name, r.max_tokens_given) == (5, "max_tokens", True)
    r = ok(engine, stream=False, denoise_events=False, stream_options={"include_usage": False})
    assert (r.stream, r.denoise_events, r.include_usage) == (False, False, False)
    assert ok(engine, stream_options={}).include_usage is False


def test_every_known_parameter_is_accepted(engine):
    valid = {"mode": "ar", "block_size": 32, "sub_block_size": 8, "threshold": 0.9, "strategy": "threshold",
             "factor": 1.0, "cache": "dual", "stop_guard": False, "frequency_penalty": 0.0, "presence_penalty": 0.0,
             "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "n": 1, "logprobs": False, "top_logprobs": 0,
             "model": engine.lm.name, "messages": HI, "prompt": "x", "stream": False, "stream_options": {},
             "user": "u", "max_tokens": 4, "max_completion_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": 1,
             "stop": "\n", "denoise_events": False, "response_format": {"type": "text"}}
    for name, value in valid.items():
        parse({"model": engine.lm.name, "messages": HI, name: value}, True, engine, engine.lm.name)
        completions = {"logprobs": 0} if name == "logprobs" else {name: value}
        parse({"model": engine.lm.name, "prompt": "x"} | completions, False, engine, engine.lm.name)
    parse({"model": engine.lm.name, "prompt": "x", "echo": True}, False, engine, engine.lm.name)


def test_chat_messages_roles_and_content_parts(engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}]
    r = ok(engine, messages=msgs)
    flat = msgs[:3] + [{"role": "user", "content": "two parts"}]
    assert (r.prompt, r.user_text, r.ids) == (engine.chat_prompt(flat), "two parts", None)


def test_completions_prompt_as_text_parts_or_token_ids(engine):
    parts = [{"type": "text", "text": "The "}, {"type": "text", "text": "sky"}]
    r = ok(engine, False, prompt=parts)
    assert (r.prompt, r.user_text, r.ids, r.chat) == ("The sky", "The sky", None, False)
    last = engine.lm.cfg.vocab_size - 1
    assert last != engine.lm.mask_token_id
    for prompt in ([0, 5, last], [[0, 5, last]]):  # lm-eval sends a batch of one token list
        r = ok(engine, False, prompt=prompt)
        assert (r.prompt, r.user_text, r.ids) == ("", None, [0, 5, last])
    long = "x" * 200_000  # the limit itself is allowed
    assert ok(engine, False, prompt=long).prompt == long


def test_the_ar_only_model_defaults_to_ar_and_allows_the_mask_text(ar_engine):
    r = ok(ar_engine)
    assert r.cfg == ar_engine.decode_config(mode="ar")
    assert ok(ar_engine, False, prompt=f"a {MASK_TOKEN} b").prompt == f"a {MASK_TOKEN} b"
    assert ok(ar_engine, False, prompt=[0, ar_engine.lm.cfg.vocab_size - 1]).ids == [0, ar_engine.lm.cfg.vocab_size - 1]
    says(refused(ar_engine, {"mode": "diffusion"}), "mode: this model has no |<MASK>| token and cannot decode by block "
         "diffusion; use 'ar'", "mode")


# ---------------------------------------------------------------- refusals: exact message and parameter
def test_the_body_and_the_model(engine):
    name = engine.lm.name
    for body in ([], "x", None):
        says(refused(engine, body, full=False), "the request body must be a JSON object", None)
    e = refused(engine, {"model": "gpt-4o", "messages": HI}, status=404, full=False)
    says(e, f"model: 'gpt-4o' is not served here; this server serves {name!r}", "model")
    assert e.code == "model_not_found"
    e = refused(engine, {"messages": HI}, status=404, full=False)
    says(e, f"model: None is not served here; this server serves {name!r}", "model")


@pytest.mark.parametrize("n", [0, 17, True, 2.0, "2", -1])
def test_n_must_be_an_integer_in_range(engine, n):
    says(refused(engine, {"n": n}), f"n: must be an integer in [1, 16] (got {n!r})", "n")


def test_n_at_its_limits_and_rules_for_several_choices(engine):
    assert ok(engine, n=16).n == 16 and ok(engine, n=1).n == 1
    says(refused(engine, {"n": 2, "denoise_events": True}), "denoise_events: only with n = 1", "denoise_events")
    assert ok(engine, n=2, stream=True).n == 2


def test_unknown_parameters_are_named_with_the_knobs(engine):
    says(refused(engine, {"zeta": 1, "num_beams": 4}), f"num_beams: unknown parameter; decoding knobs: {KNOBS_LIST}",
         "num_beams")
    says(refused(engine, {"echo": True}), f"echo: unknown parameter; decoding knobs: {KNOBS_LIST}", "echo")  # chat
    # chat never reads echo: not as a flag (1 is no bool), not for the echo rules (n = 2)
    for extra in ({"echo": 1}, {"echo": True, "n": 2}, {"echo": True, "stream": True}):
        says(refused(engine, extra), f"echo: unknown parameter; decoding knobs: {KNOBS_LIST}", "echo")


def test_response_format(engine):
    for kind in ("json_object", "json_schema"):
        says(refused(engine, {"response_format": {"type": kind}}), f"response_format: {kind} is not supported (no "
             'constrained decoding); only {"type": "text"}', "response_format")
    for v, shown in (("text", "'text'"), ({"type": "xml"}, "{'type': 'xml'}"), ({}, "{}")):
        says(refused(engine, {"response_format": v}), f'response_format: must be {{"type": "text"}} (got {shown})',
             "response_format")


def test_messages_must_be_a_list_of_role_and_content(engine):
    shape = "messages: must be a non-empty list of {role, content} objects"
    for v in ([], None, "hi", {"role": "user", "content": "hi"}):
        says(refused(engine, {"messages": v}), shape, "messages")
    role = "messages: each message needs role system, user or assistant, and content"
    for m in ({"role": "tool", "content": "x"}, {"content": "x"}, "hi", ["user", "hi"]):
        says(refused(engine, {"messages": [m]}), role, "messages")
    content = "messages: must be a string or a list of text parts"
    for c in (None, 5, [{"type": "image_url", "text": "x"}], [{"type": "text", "text": 5}], [{"type": "text"}], ["x"]):
        says(refused(engine, {"messages": [{"role": "user", "content": c}]}), content, "messages")
    says(refused(engine, {"messages": [{"role": "user", "content": "ab\ud800c"}]}),
         "messages: not valid Unicode (a lone surrogate at character 2)", "messages")


def test_the_prompt_must_be_text_or_token_ids_and_not_empty(engine):
    shape = "prompt: must be a string or a list of text parts"
    for p in (None, 5, [[1, 2], [3]], [[]], [True, 2], [[True]], [1, "a"], [[1, "a"]]):
        says(refused(engine, {"prompt": p}, chat=False), shape, "prompt")
    for p in ("", "  \n\t", []):
        says(refused(engine, {"prompt": p}, chat=False), "prompt: the prompt must not be empty", "prompt")
    says(refused(engine, {"prompt": "x" * 200_001}, chat=False), "prompt: longer than 200000 characters", "prompt")
    says(refused(engine, {"prompt": "a\ud800"}, chat=False), "prompt: not valid Unicode (a lone surrogate at "
         "character 1)", "prompt")


def test_the_mask_token_is_the_decoders_alone(engine):
    mask, vocab = engine.lm.mask_token_id, engine.lm.cfg.vocab_size
    says(refused(engine, {"prompt": f"a {MASK_TOKEN} b"}, chat=False), f"prompt: contains the mask token {MASK_TOKEN}, "
         "which only the decoder may place", "prompt")
    says(refused(engine, {"messages": [{"role": "user", "content": MASK_TOKEN}]}), "messages: contains the mask token "
         f"{MASK_TOKEN}, which only the decoder may place", "messages")
    says(refused(engine, {"prompt": [1, 2, mask, 3]}, chat=False), f"prompt: contains the mask token id {mask} "
         f"({MASK_TOKEN}), which only the decoder may place (at position 2)", "prompt")
    for ids in ([-1], [0, vocab], [[vocab + 5]]):
        says(refused(engine, {"prompt": ids}, chat=False), f"prompt: token ids must be in [0, {vocab})", "prompt")


def test_config_errors_name_the_parameter_the_client_sent(engine):
    says(refused(engine, {"block_size": 12}), "block_size: must be a multiple of sub_block_size=8 (its default; send "
         "sub_block_size too to change it) (got 12)", "block_size")
    says(refused(engine, {"block_size": 12, "sub_block_size": 8}), "sub_block_size: must divide block_size=12; "
         "allowed: [1, 2, 3, 4, 6, 12] (got 8)", "sub_block_size")
    says(refused(engine, {"max_tokens": 0}), "max_tokens: must be an integer in [1, 4096] (got 0)", "max_tokens")
    says(refused(engine, {"max_tokens": 3, "max_completion_tokens": 5000}),
         "max_completion_tokens: must be an integer in [1, 4096] (got 5000)", "max_completion_tokens")
    says(refused(engine, {"threshold": 0}), "threshold: must be a number in (0, 1] (got 0)", "threshold")
    # only the field name is renamed, not the value the message quotes
    says(refused(engine, {"max_tokens": "max_new_tokens"}), "max_tokens: must be an integer in [1, 4096] (got "
         "'max_new_tokens')", "max_tokens")


@pytest.mark.parametrize("name", ["stream", "denoise_events"])
def test_flags_must_be_booleans(engine, name):
    for v in (1, "yes", 0):
        says(refused(engine, {name: v}), f"{name}: must be true or false (got {v!r})", name)
    assert getattr(ok(engine, **{name: True}), name) is True


def test_echo_rules(engine):
    r = ok(engine, False, echo=True, logprobs=5)
    assert (r.echo, r.logprobs, r.top) == (True, True, 5)
    r = ok(engine, False, echo=True, logprobs=0)
    assert (r.echo, r.logprobs, r.top) == (True, True, 0)
    r = ok(engine, False, echo=True)
    assert (r.echo, r.logprobs, r.top) == (True, False, 0)
    for extra in ({"n": 2}, {"stream": True}):
        says(refused(engine, {"echo": True, **extra}, chat=False), "echo: only with n = 1 and without stream", "echo")
    assert ok(engine, False, echo=False, n=2, stream=True).echo is False
    says(refused(engine, {"echo": 1}, chat=False), "echo: must be true or false (got 1)", "echo")
    for v in (21, -1, True, 1.0):
        says(refused(engine, {"echo": True, "logprobs": v}, chat=False), "logprobs: an integer in [0, 20], the "
             f"alternatives kept per token (0: each token's own log-probability only) (got {v!r})", "logprobs")


def test_logprobs_rules(engine):
    assert (ok(engine, logprobs=True).logprobs, ok(engine, logprobs=False).logprobs) == (True, False)
    assert ok(engine, logprobs=True).top == 0
    for v in (1, "true", 0):
        says(refused(engine, {"logprobs": v}), f"logprobs: must be true or false (got {v!r})", "logprobs")
    r = ok(engine, False, logprobs=0)
    assert (r.logprobs, r.top, r.cfg.top_logprobs) == (True, 0, 0)
    r = ok(engine, False, logprobs=20)  # completions: the count of alternatives, vLLM's limit
    assert (r.logprobs, r.top, r.cfg.top_logprobs) == (True, 20, 20)
    for v in (21, True, -1, 0.0):
        says(refused(engine, {"logprobs": v}, chat=False), "logprobs: an integer in [0, 20], the alternatives kept "
             f"per token (0: each token's own log-probability only) (got {v!r})", "logprobs")
    r = ok(engine, logprobs=True, top_logprobs=3)  # chat: logprobs on, top_logprobs the count
    assert (r.logprobs, r.top, r.cfg.top_logprobs) == (True, 3, 3)
    assert ok(engine, logprobs=False, top_logprobs=0).cfg.top_logprobs == 0
    for v in (21, True, 0.0, -1):
        says(refused(engine, {"logprobs": True, "top_logprobs": v}), f"top_logprobs: must be an integer in [0, 20] "
             f"(got {v!r})", "top_logprobs")
    for off in ({}, {"logprobs": False}):
        says(refused(engine, {"top_logprobs": 2, **off}), "top_logprobs: needs logprobs: true", "top_logprobs")
    assert ok(engine, False, top_logprobs=0).top == 0
    says(refused(engine, {"top_logprobs": 2, "logprobs": 1}, chat=False), "top_logprobs: a chat parameter; "
         "completions take the number of alternatives as logprobs, an integer in [0, 20] (got 2)", "top_logprobs")


def test_stop_strings(engine):
    assert ok(engine, stop="\n").stops == ["\n"]
    assert ok(engine, stop=["a", "b", "c", "d"]).stops == ["a", "b", "c", "d"]
    assert ok(engine, stop=[]).stops == []
    message = "stop: must be a non-empty string or a list of at most 4 of them"
    for v in ("", [""], ["a", "b", "c", "d", "e"], 5, [1], {"a": 1}, ["a", None]):
        says(refused(engine, {"stop": v}), message, "stop")


def test_stream_options_must_be_an_object(engine):
    for v in ("x", [1], 5):
        says(refused(engine, {"stream_options": v}), "stream_options: must be an object", "stream_options")
    assert ok(engine, stream_options={"include_usage": True}).include_usage is True


# ---------------------------------------------------------------- errors, values shown, nesting depth
def test_values_in_messages_are_shown_short():
    assert _show("x" * 58) == repr("x" * 58)  # 60 characters with the quotes: kept whole
    assert _show("x" * 59) == repr("x" * 59)[:60] + "..."
    assert _show([1, 2], limit=3) == "[1,..."
    assert _show(10 ** 5000) == "<int>"  # more digits than str() allows
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert _show(deep) == "<list>"


def test_api_errors_are_cut_and_answer_in_the_openai_shape():
    assert ApiError(400, "m" * 1000).message == "m" * 1000
    e = ApiError(400, "m" * 1001, "p", "c")
    assert (e.message, str(e), e.param, e.code) == ("m" * 1000 + "...", "m" * 1000 + "...", "p", "c")
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "server_busy", 500: "server_error"}
    for status, kind in kinds.items():
        r = ApiError(status, "bad", "n", "x").response({"retry-after": "1"})
        assert r.status_code == status and r.headers["retry-after"] == "1"
        assert json.loads(r.body) == {"error": {"message": "bad", "type": kind, "param": "n", "code": "x"}}
    r = ApiError(400, "bad").response()
    assert json.loads(r.body) == {"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                                            "code": None}} and "retry-after" not in r.headers


def test_nesting_depth():
    # a bare scalar body (JSON 5, null, true, 1.5, "xy") nests 0 levels: no TypeError from iterating it, so the
    # server's "must be a JSON object" 400 stays the answer whichever check runs first
    assert [_depth(v) for v in (5, None, True, 1.5, "xy", "")] == [0, 0, 0, 0, 0, 0]
    assert [_depth(v) for v in ([], {}, [1, "a"], {"a": 1})] == [1, 1, 1, 1]
    assert [_depth(v) for v in ([[]], {"a": [1]}, [{"a": {"b": []}}], [[], [[[]]], []])] == [2, 2, 4, 4]
    assert _depth({"a": [{"b": 1}], "c": [[[[1]]]]}) == 5
    deep = json.loads("[" * 500 + "]" * 500)
    assert _depth(deep) == MAX_JSON_DEPTH + 1  # stops one level past the limit
    assert _depth(json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
