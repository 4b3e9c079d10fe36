"""`echo` with prompt log-probabilities, and the tokenizer routes lm-eval asks for (issue 24): lm-evaluation-harness's
`local-completions` model scores a log-likelihood task against the server exactly as `bench/lm_eval_model.py` does in
process (both read engine/likelihood.py). Real bundled model, a real uvicorn server for lm-eval."""
from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest_app import free_port
from engine.likelihood import token_logprobs
from engine.driver import Driver
from engine.serve import MAX_ECHO_DIFFUSION_TOKENS, create_app
from test_reliability import wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def sched(engine):
    s = Driver(engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tc(engine, sched):
    with TestClient(create_app(engine, sched), raise_server_exceptions=True) as c:
        yield c


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_echo_returns_the_prompt_scored_as_in_process(tc, engine, mode):
    ids = engine.encode("The capital of France is Paris")
    r = tc.post("/v1/completions", json={"model": engine.lm.name, "prompt": ids, "max_tokens": 1, "echo": True,
                                         "logprobs": 2, "temperature": 0, "mode": mode})
    assert r.status_code == 200, r.text
    [c] = r.json()["choices"]
    lp = c["logprobs"]
    want = token_logprobs(engine.lm, ids, 1, mode, 32, top=2)
    n = len(ids)
    assert c["text"].startswith(engine.lm.tokenizer.decode(ids)) and len(lp["tokens"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx([t.logprob for t in want], abs=1e-5)
    for tok, top, t in zip(lp["tokens"][1:n], lp["top_logprobs"][1:n], want):  # the token itself, then its 2 best
        assert len(top) <= 3 and max(top.values()) == pytest.approx(t.top[0][1], abs=1e-6) and tok in top
        assert (max(top.values()) == pytest.approx(t.logprob, abs=1e-6)) == t.greedy
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])] and lp["token_logprobs"][n] <= 0
    assert "".join(lp["tokens"]) == c["text"]


def test_echo_rules(tc, engine):
    name = engine.lm.name
    body = {"model": name, "prompt": "Hello", "max_tokens": 1, "echo": True}
    r = tc.post("/v1/completions", json=body).json()["choices"][0]  # echo without logprobs: the text only
    assert r["text"].startswith("Hello") and r["logprobs"] is None
    for extra, param in (({"stream": True}, "echo"), ({"n": 2}, "echo"), ({"logprobs": 21}, "logprobs"),
                         ({"echo": "yes"}, "echo")):
        e = tc.post("/v1/completions", json={**body, **extra})
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (extra, e.text)
    long = [100] * (MAX_ECHO_DIFFUSION_TOKENS + 1)
    e = tc.post("/v1/completions", json={**body, "prompt": long, "logprobs": 0, "mode": "diffusion"})
    assert e.status_code == 400 and "one forward per token" in e.json()["error"]["message"]
    info = tc.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    ids = tc.post("/tokenize", json={"prompt": "Hi there", "add_special_tokens": False}).json()["tokens"]
    assert tc.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Hi there"
    assert tc.post("/detokenize", json={"tokens": [-1]}).status_code == 400


@pytest.mark.timeout(600)
def test_lm_eval_local_completions_scores_as_in_process(engine, sched):
    """lm-eval's OpenAI-completions client, remote tokenizer, against this server: the same log-likelihoods and
    greediness as the in-process model on the local two-way choice task."""
    pytest.importorskip("lm_eval")
    import lm_eval
    import uvicorn
    import lm_eval.models.openai_completions  # noqa: F401  registers local-completions (lazy otherwise)
    from lm_eval.tasks import TaskManager

    import bench.lm_eval_model  # noqa: F401  registers fast_dllm_v2

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, sched), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        wait_until(lambda: server.started, 30)
        tasks = TaskManager(include_path=str(ROOT / "bench" / "lm_eval_tasks"), include_defaults=False)
        remote = lm_eval.simple_evaluate(
            model="local-completions", tasks=["fastdllm_choice"], limit=3, task_manager=tasks,
            model_args={"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": engine.lm.name,
                        "tokenizer_backend": "remote", "tokenized_requests": True, "num_concurrent": 1,
                        "max_retries": 1})
    finally:
        server.should_exit = True
        th.join(10)
    local = lm_eval.simple_evaluate(model="fast_dllm_v2", model_args={"engine": engine}, tasks=["fastdllm_choice"],
                                    limit=3, task_manager=tasks)
    got = [s["resps"] for s in remote["samples"]["fastdllm_choice"]]
    want = [s["resps"] for s in local["samples"]["fastdllm_choice"]]
    assert len(got) == len(want) == 3
    for g_doc, w_doc in zip(got, want):
        for [(g_ll, g_greedy)], [(w_ll, w_greedy)] in zip(g_doc, w_doc):
            assert math.isfinite(g_ll) and g_ll == pytest.approx(w_ll, abs=1e-4) and g_greedy == w_greedy
    assert remote["results"]["fastdllm_choice"]["acc,none"] == local["results"]["fastdllm_choice"]["acc,none"]
