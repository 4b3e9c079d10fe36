"""The server's surface around the completions (engine/serve.py): errors in OpenAI's shape, the bug fixes of issue 24,
/health, /metrics, the API key, CORS, the per-request log line, and a bounded fuzz of malformed bodies.

In process, through FastAPI's TestClient, on the real bundled model. Requests that decode use AR and 2 to 3 tokens;
the fuzz decodes nothing: its scheduler answers every admitted request at once with a one-token result.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time

import openai
import pytest
from fastapi.testclient import TestClient

from engine.driver import Driver
from engine.events import Result
from engine.events import Event, Summary, Token, Trace
from engine.weights import MASK_TOKEN
from engine.scheduler import Ticket
from engine.serve import MAX_JSON_DEPTH, create_app

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def sched(engine):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = Driver(engine)
    yield s
    s.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tc(engine, sched):
    with TestClient(create_app(engine, sched), raise_server_exceptions=True) as c:
        yield c


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG)
    return caplog


def is_openai_error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def no_traceback(caplog) -> None:
    text = caplog.text + "".join(str(r.exc_info) for r in caplog.records if r.exc_info)
    assert "Traceback" not in text and not any(r.exc_info for r in caplog.records), text[-2000:]


# ---------------------------------------------------------------- the bugs of issue 24
def test_deeply_nested_json_is_a_400_without_a_traceback(tc, engine, logs):
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        e = is_openai_error(tc.post("/v1/chat/completions", content=raw), 400)
        assert "nests too deeply" in e["message"]
    nested = {"model": engine.lm.name, "messages": HI, "stop": json.loads("[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5))}
    assert "nests too deeply" in is_openai_error(tc.post("/v1/chat/completions", json=nested), 400)["message"]
    no_traceback(logs)


def test_max_completion_tokens_null_means_not_given(tc, engine):
    body = {"model": engine.lm.name, "messages": HI, "mode": "ar", "max_tokens": 3, "max_completion_tokens": None}
    r = tc.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
    r = c.completions.create(model=engine.lm.name, prompt="The sky is", max_tokens=2, extra_body={
        "mode": "ar", "max_completion_tokens": None})
    assert r.usage.completion_tokens <= 2


def test_block_size_alone_is_blamed_on_block_size(tc, engine):
    body = {"model": engine.lm.name, "messages": HI}
    for bs in (12, 4):
        e = is_openai_error(tc.post("/v1/chat/completions", json={**body, "block_size": bs}), 400, "block_size")
        assert e["message"].startswith("block_size: must be a multiple of sub_block_size=8") and f"got {bs}" in e["message"]
    e = is_openai_error(tc.post("/v1/chat/completions", json={**body, "block_size": 12, "sub_block_size": 5}), 400,
                        "sub_block_size")  # both sent: the sub-block size is the one that does not divide
    assert "must divide block_size=12" in e["message"]


def test_response_format_text_is_accepted_and_json_modes_refused(tc, engine):
    body = {"model": engine.lm.name, "messages": HI, "mode": "ar", "max_tokens": 2}
    assert tc.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}}).status_code == 200
    for kind in ("json_object", "json_schema"):
        e = is_openai_error(tc.post("/v1/chat/completions", json={**body, "response_format": {"type": kind}}), 400,
                            "response_format")
        assert f"{kind} is not supported" in e["message"]
    is_openai_error(tc.post("/v1/chat/completions", json={**body, "response_format": "text"}), 400, "response_format")


def test_unknown_routes_and_wrong_methods_answer_in_the_openai_shape(tc):
    e = is_openai_error(tc.post("/v1/embeddings", json={}), 404)
    assert e["type"] == "not_found_error" and "/v1/embeddings" in e["message"]
    r = tc.get("/v1/chat/completions")
    e = is_openai_error(r, 405)
    assert "GET is not allowed" in e["message"] and "POST" in r.headers.get("allow", "")
    is_openai_error(tc.delete("/v1/models"), 405)


def test_the_mask_token_is_refused_inside_prompts(tc, engine):
    mask = engine.lm.mask_token_id
    name = engine.lm.name
    e = is_openai_error(tc.post("/v1/completions", json={"model": name, "prompt": [1, 2, mask, 3]}), 400, "prompt")
    assert str(mask) in e["message"] and MASK_TOKEN in e["message"]
    e = is_openai_error(tc.post("/v1/completions", json={"model": name, "prompt": f"a {MASK_TOKEN} b"}), 400, "prompt")
    assert MASK_TOKEN in e["message"]
    is_openai_error(tc.post("/v1/chat/completions", json={"model": name, "messages": [
        {"role": "user", "content": f"fill {MASK_TOKEN} in"}]}), 400, "messages")


def test_prompt_plus_max_tokens_over_the_context_is_refused_with_both_numbers(tc, engine):
    ctx, n = engine.max_context, engine.max_context - 100
    e = is_openai_error(tc.post("/v1/completions", json={"model": engine.lm.name, "prompt": [9] * n,
                                                         "max_tokens": 500}), 400, "max_tokens")
    assert f"prompt has {n} tokens" in e["message"] and "max_tokens is 500" in e["message"] and str(ctx) in e["message"]
    e = is_openai_error(tc.post("/v1/completions", json={"model": engine.lm.name, "prompt": [9] * n,
                                                         "max_completion_tokens": 101}), 400, "max_completion_tokens")
    assert "ask for at most 100" in e["message"]
    is_openai_error(tc.post("/v1/completions", json={"model": engine.lm.name, "prompt": [9] * ctx}), 400, "prompt")


# ---------------------------------------------------------------- health, key, CORS, logs, metrics
def test_health_is_200_while_the_scheduler_runs_and_503_after(engine, tc):
    r = tc.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    s = Driver(engine)
    with TestClient(create_app(engine, s)) as c:
        assert c.get("/health").status_code == 200
        s.close()
        is_openai_error(c.get("/health"), 503)


def test_api_key_guards_every_route_but_health(engine, sched):
    with TestClient(create_app(engine, sched, api_key="s3cret")) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            e = is_openai_error(c.get("/v1/models", headers=headers), 401)
            assert e["type"] == "authentication_error" and e["code"] == "invalid_api_key"
        is_openai_error(c.get("/metrics"), 401)
        is_openai_error(c.post("/v1/nowhere"), 401)  # no route discovery without the key
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=c, max_retries=0)
        assert client.models.list().data[0].id == engine.lm.name
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=c, max_retries=0).models.list()


def test_serve_cli_reads_the_key_from_the_option_or_the_environment(monkeypatch):
    from engine.__main__ import parser, serve_access

    monkeypatch.setenv("FASTDLLM_API_KEY", "from-env")
    assert serve_access(parser().parse_args(["serve"])) == ("from-env", [])
    a = parser().parse_args(["serve", "--api-key", "opt", "--allowed-origins", "https://a.example, https://b.example"])
    assert serve_access(a) == ("opt", ["https://a.example", "https://b.example"])
    monkeypatch.delenv("FASTDLLM_API_KEY")
    assert serve_access(parser().parse_args(["serve"])) == (None, [])


def test_cors_only_for_allowed_origins(engine, sched, tc):
    pre = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    assert "access-control-allow-origin" not in tc.options("/v1/chat/completions", headers=pre).headers  # default: none
    with TestClient(create_app(engine, sched, api_key="k", allowed_origins=["https://a.example"])) as c:
        r = c.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/v1/models", headers={"Origin": "https://a.example"})  # a 401 a browser can read
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://a.example"
        r = c.options("/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_streams_tell_a_reverse_proxy_not_to_buffer(tc, engine):
    """nginx buffers a proxied response unless it carries X-Accel-Buffering: no; a buffered stream would reach the
    client in one piece at the end (docs/serving.md, behind a reverse proxy)."""
    body = {"model": engine.lm.name, "messages": HI, "mode": "ar", "max_tokens": 2}
    r = tc.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
    assert "x-accel-buffering" not in tc.post("/v1/chat/completions", json=body).headers


def test_one_json_log_line_per_request(tc, engine, logs):
    logs.clear()
    r = tc.post("/v1/chat/completions", json={"model": engine.lm.name, "messages": HI, "mode": "ar", "max_tokens": 2})
    tc.get("/v1/models")
    tc.post("/v1/chat/completions", json={"model": engine.lm.name, "messages": HI, "mode": "ar", "max_tokens": 2,
                                          "stream": True})
    tc.post("/v1/chat/completions", json={"model": "nope", "messages": HI})
    lines = [json.loads(rec.getMessage()) for rec in logs.records if rec.name == "engine.serve"]
    assert len(lines) == 4, lines
    first = lines[0]
    assert set(first) >= {"time", "request_id", "route", "status", "prompt_tokens", "cached_tokens",
                          "completion_tokens", "seconds", "finish_reason"}
    body = r.json()
    assert first["cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a short prompt
    assert first["request_id"] == r.headers["x-request-id"] and body["id"].endswith(first["request_id"])
    assert (first["route"], first["status"]) == ("/v1/chat/completions", 200)
    assert first["prompt_tokens"] == body["usage"]["prompt_tokens"] and first["completion_tokens"] == body["usage"][
        "completion_tokens"] and first["finish_reason"] == body["choices"][0]["finish_reason"] and first["seconds"] > 0
    assert (lines[1]["route"], lines[1]["completion_tokens"]) == ("/v1/models", None)
    assert lines[2]["status"] == 200 and lines[2]["completion_tokens"] >= 1 and lines[2]["finish_reason"]
    assert (lines[3]["status"], lines[3]["completion_tokens"]) == (404, None)


def prom(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_in_prometheus_text(engine, sched):
    with TestClient(create_app(engine, sched)) as c:
        for _ in range(2):
            r = c.post("/v1/completions", json={"model": engine.lm.name, "prompt": "One, two,", "mode": "ar",
                                                 "max_tokens": 3})
        c.post("/v1/completions", json={"model": engine.lm.name, "prompt": "x", "max_tokens": 0})
        c.get("/no/such/route")
        m = c.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    p = prom(m.text)
    assert p['fastdllm_requests_total{route="/v1/completions",status="200"}'] == 2
    assert p['fastdllm_requests_total{route="/v1/completions",status="400"}'] == 1
    assert p['fastdllm_requests_total{route="other",status="404"}'] == 1  # unknown paths share one label
    assert p["fastdllm_generated_tokens_total"] == 2 * r.json()["usage"]["completion_tokens"]
    assert p["fastdllm_queue_length"] == 0 and p["fastdllm_running_rows"] >= 0
    assert p["fastdllm_request_latency_seconds_count"] == 2 and p["fastdllm_time_to_first_token_seconds_count"] == 2
    assert p['fastdllm_request_latency_seconds_bucket{le="+Inf"}'] == 2 and p["fastdllm_request_latency_seconds_sum"] > 0
    assert p['fastdllm_time_to_first_token_seconds_bucket{le="60"}'] == 2
    for name in ("requests_total counter", "queue_length gauge", "running_rows gauge", "generated_tokens_total counter",
                 "time_to_first_token_seconds histogram", "request_latency_seconds histogram"):
        assert f"# TYPE fastdllm_{name}" in m.text


# ---------------------------------------------------------------- fuzz
class InstantScheduler:
    """Stands in for the Driver in the fuzz: checks the request as the real one does, then answers at once with
    one token (so thousands of accepted bodies cost no forwards)."""

    running, waiting = 0, ()

    def __init__(self, engine):
        self.engine = engine
        self._worker, self._closed = threading.main_thread(), False

    def submit(self, ids, cfg, *, listener=None, prompt_text=None, record=True, on_finish=None, stop=None) -> Ticket:
        cfg = self.engine.check_ids([ids], cfg)
        trace = Trace(self.engine.trace_header(ids, cfg, prompt_text)) if record else None
        t = Ticket(list(ids), cfg, listener, trace, on_finish=on_finish)
        e = Event("step", 0, 1, 0, 0, [Token(0, 42, "ok", 0.9)], [], "ok", 0.001)
        t.on_event(e)
        t.result = Result(Summary(1, 1, 1.0, 0.001, 1000.0, 0.001, "max_new_tokens", "ok", [42]), trace)
        t.finished.set()
        if on_finish:
            on_finish(t)
        return t


def fuzz_bodies(model: str, rng: random.Random, n: int):
    """(method, path, raw body bytes) for n malformed, nested, huge or wrong-typed requests."""
    weird = [None, True, False, 0, -1, 1, 2, 3.5, -1e308, 1e308, "", "x", "x" * 300_000, [], {}, [1, 2], ["a"],
             {"type": "text"}, {"a": {"b": []}}, "\u0000", "\ud800", "é" * 10, 2**63, 2**64 + 1, [[[[[]]]]],
             list(range(5000)), {"include_usage": True}, [None], [{"type": "text", "text": 5}], "ar", "diffusion",
             "block", "dual", 4096, 8192, 0.0001, "NaN"]
    keys = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
            "stream", "stream_options", "n", "logprobs", "mode", "block_size", "sub_block_size", "threshold",
            "strategy", "factor", "cache", "stop_guard", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "no_repeat_ngram_size", "denoise_events", "response_format", "user", "tools", "x" * 500,
            "top_logprobs", "echo"]
    routes = ["/v1/chat/completions", "/v1/completions", "/tokenize"]
    raw_cases = [b"", b"{", b"null", b"[]", b"1", b'"s"', b"\xff\xfe\x00", b"{" * 50_000, b"[" * 100_000,
                 b'{"model": ' + b"9" * 5000 + b"}", b'{"a": NaN}', b'{"a": Infinity}', b"{}" * 10, b'{"model": "\\ud800"}',
                 b'{"messages": [' + b'{"role": "user", "content": "a"},' * 20_000 + b"{}]}"]
    for i in range(n):
        path = routes[i % 3]
        kind = rng.random()
        if kind < 0.08:
            yield "POST", path, rng.choice(raw_cases)
            continue
        if kind < 0.12:
            yield rng.choice(["GET", "PUT", "DELETE", "PATCH"]), rng.choice(routes + ["/v1/x", "/health/x", "/"]), b"{}"
            continue
        body: dict = {"model": model, "max_tokens": 4}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
        for _ in range(rng.randint(1, 3)):
            k = rng.choice(keys)
            if rng.random() < 0.15:
                body.pop(k, None)
            elif rng.random() < 0.1:  # nested to a random depth
                d = rng.choice([2, 10, MAX_JSON_DEPTH, 200, 900])
                body[k] = json.loads("[" * d + "]" * d)
            elif k == "messages" and rng.random() < 0.5:
                body[k] = [{"role": rng.choice(["user", "system", "assistant", "tool", 5]),
                            "content": rng.choice(weird)} for _ in range(rng.randint(0, 3))]
            elif k == "prompt" and rng.random() < 0.5:
                body[k] = [rng.randrange(-5, 70_000) for _ in range(rng.randint(0, 50))]
            else:
                body[k] = rng.choice(weird)
        raw = json.dumps(body).encode() if rng.random() < 0.9 else json.dumps(body).encode()[:rng.randint(0, 60)]
        yield "POST", path, raw


def test_fuzz_no_500s_and_no_tracebacks(engine, logs):
    """>= 1,000 malformed bodies in at most 120 s: every answer is 2xx or 4xx, errors in OpenAI's shape, and the
    log holds no traceback."""
    rng, statuses, t0 = random.Random(24), {}, time.monotonic()
    n = 0
    with TestClient(create_app(engine, InstantScheduler(engine)), raise_server_exceptions=True) as c:
        for method, path, raw in fuzz_bodies(engine.lm.name, rng, 1200):
            if time.monotonic() - t0 > 120:
                break
            r = c.request(method, path, content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (method, path, raw[:300], r.text[:500])
            if r.status_code >= 400:
                is_openai_error(r, r.status_code)
            n += 1
    print(f"fuzz: {n} requests in {time.monotonic() - t0:.1f} s, statuses {sorted(statuses.items())}")
    assert n >= 1000, (n, statuses)
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 500  # the mutations reach both sides
    no_traceback(logs)


# ---------------------------------------------------------------- n and logprobs
def test_n_choices_greedy_equal_and_seeded_rows_reproduce(tc, engine):
    name = engine.lm.name
    body = {"model": name, "messages": HI, "mode": "ar", "max_tokens": 3, "n": 3}
    r = tc.post("/v1/chat/completions", json=body).json()
    texts = [c["message"]["content"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and len(set(texts)) == 1  # greedy: equal
    one = tc.post("/v1/chat/completions", json={**body, "n": 1}).json()
    assert one["choices"][0]["message"]["content"] == texts[0]
    assert r["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    # sampling: choice i is seeded seed + i, so it equals the n = 1 request with that seed
    hot = {"model": name, "prompt": "My favourite word is", "mode": "ar", "max_tokens": 3, "temperature": 1.5}
    many = tc.post("/v1/completions", json={**hot, "n": 2, "seed": 7}).json()["choices"]
    alone = [tc.post("/v1/completions", json={**hot, "seed": s}).json()["choices"][0]["text"] for s in (7, 8)]
    assert [c["text"] for c in many] == alone
    c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
    stream = c.chat.completions.create(model=name, messages=HI, max_tokens=3, n=2, stream=True,
                                       extra_body={"mode": "ar"})
    got: dict[int, str] = {}
    for ch in stream:
        for choice in ch.choices:
            got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
    assert got == {0: texts[0], 1: texts[0]}
    is_openai_error(tc.post("/v1/chat/completions", json={**body, "n": 17}), 400, "n")
    is_openai_error(tc.post("/v1/chat/completions", json={**body, "denoise_events": True}), 400, "denoise_events")


def test_logprobs_are_the_committed_confidences(tc, engine):
    import math

    name = engine.lm.name
    texts = {}
    for knobs in ({"mode": "ar"}, {"mode": "diffusion", "cache": "block"}):
        r = tc.post("/v1/chat/completions", json={"model": name, "messages": HI, "max_tokens": 4, "logprobs": True,
                                                  "denoise_events": True, **knobs}).json()
        [choice] = r["choices"]
        content = choice["logprobs"]["content"]
        trace = Trace.from_json(r["trace"])
        conf = {t.pos: t.conf for e in trace.events for t in e.committed}
        assert "".join(x["token"] for x in content) == choice["message"]["content"]
        assert len(content) >= 1
        texts[knobs["mode"]] = choice["message"]["content"]
        for pos, x in enumerate(content):
            assert x["logprob"] <= 0 and x["logprob"] == pytest.approx(math.log(conf[pos]), abs=1e-3)
            assert x["top_logprobs"] == [] and bytes(x["bytes"]).decode() == x["token"]
    r = tc.post("/v1/completions", json={"model": name, "prompt": "One, two,", "mode": "ar", "max_tokens": 3,
                                         "logprobs": 0}).json()["choices"][0]
    lp = r["logprobs"]
    assert "".join(lp["tokens"]) == r["text"] and len(lp["token_logprobs"]) == len(lp["tokens"])
    assert lp["text_offset"][0] == 0 and all(v <= 0 for v in lp["token_logprobs"])
    streamed = "".join(t["token"] for ch in tc.post(
        "/v1/chat/completions", json={"model": name, "messages": HI, "max_tokens": 4, "logprobs": True,
                                      "stream": True, "mode": "ar"}).text.split("\n\n")
        if ch.startswith("data: {") for c in json.loads(ch[6:])["choices"] for t in (c.get("logprobs") or {}).get(
            "content", []))
    assert streamed == texts["ar"]  # streamed logprobs follow the text, chunk by chunk
    is_openai_error(tc.post("/v1/completions", json={"model": name, "prompt": "x", "logprobs": 21}), 400, "logprobs")
    is_openai_error(tc.post("/v1/chat/completions", json={"model": name, "messages": HI, "logprobs": True,
                                                          "top_logprobs": 21}), 400, "top_logprobs")


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_top_logprobs_list_the_distribution_each_token_was_committed_from(tc, engine, mode):
    """Chat's top_logprobs and completions' logprobs count (vLLM's shapes): greedy, the committed token is the
    first alternative with its own logprob; the rest follow in order, the mask token never among them; streamed
    chunks carry the same alternatives as the whole answer."""
    name = engine.lm.name
    body = {"model": name, "messages": HI, "max_tokens": 6, "logprobs": True, "top_logprobs": 3, "mode": mode}
    r = tc.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert "".join(x["token"] for x in content) == r["choices"][0]["message"]["content"] and content
    for x in content:
        top = x["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == x["token"] and top[0]["logprob"] == x["logprob"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert all(bytes(t["bytes"]).decode() == t["token"] and t["token"] != "|<MASK>|" for t in top)
    streamed = [x for ch in tc.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
                if ch.startswith("data: {") for c in json.loads(ch[6:])["choices"]
                for x in (c.get("logprobs") or {}).get("content", [])]
    assert streamed == content
    c = tc.post("/v1/completions", json={"model": name, "prompt": "One, two,", "max_tokens": 4, "logprobs": 2,
                                         "mode": mode}).json()["choices"][0]["logprobs"]
    for tok, v, top in zip(c["tokens"], c["token_logprobs"], c["top_logprobs"]):
        assert len(top) == 2 and top[tok] == v == max(top.values())  # greedy: the token itself is the best
