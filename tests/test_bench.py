"""Benchmarks: CLI outputs, accounting invariants, and the lm-eval model (tiny runs on the bundled model)."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def adapter_env(tmp_path_factory):
    """Use the bundled adapter when it exists; otherwise an untrained mask-token row (mechanics only)."""
    from engine.weights import BUNDLED_ADAPTER, bundled_base_dir, save_adapter

    if os.environ.get("FASTDLLM_ADAPTER") or BUNDLED_ADAPTER.exists():
        yield
        return
    hidden = json.loads((bundled_base_dir() / "config.json").read_text())["hidden_size"]
    path = tmp_path_factory.mktemp("adapter") / "mask_only.safetensors"
    gen = torch.Generator().manual_seed(0)
    save_adapter(path, lora={}, sets={}, new_embed_rows=torch.randn(1, hidden, generator=gen) * 0.02, lora_scale=1.0)
    os.environ["FASTDLLM_ADAPTER"] = str(path)
    yield
    os.environ.pop("FASTDLLM_ADAPTER", None)


@pytest.fixture(scope="module")
def eng(adapter_env):
    """One engine for the module; one intra-op thread (on a busy 2-core machine 2 threads run ~4x slower)."""
    from bench.common import load_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_engine(None, None)
    torch.set_num_threads(threads)


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "id": f"p{i}", "category": "x"}) + "\n"
                            for i, p in enumerate(prompts)), encoding="utf-8")
    return path


def run_cli(argv: list[str], capsys) -> str:
    from bench.__main__ import main

    assert main(argv) == 0
    return capsys.readouterr().out


def test_throughput_cli_schema_and_accounting(eng, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["List three fruits.", "Name two colours.", "Count to five."])
    out_dir = tmp_path / "tp"
    max_new = 4
    stdout = run_cli(["throughput", "--prompts", str(prompts), "--limit", "2", "--batch-sizes", "1,2",
                      "--modes", "ar,diffusion", "--hf-baseline", "--cache", "dual", "--sub-block-sizes", "8,5",
                      "--max-new-tokens", str(max_new), "--repeats", "2", "--warmup-tokens", "2", "--no-png",
                      "--quiet", "--out", str(out_dir)], capsys)
    report = json.loads((out_dir / "results.json").read_text())
    assert report["prompts"]["n"] == 2 and report["kind"] == "throughput"
    assert {"model", "device", "dtype", "threads"} <= set(report["environment"])
    # sub-block 5 does not divide block 32: skipped with the engine's reason, the rest runs
    assert [s["name"] for s in report["skipped"]] == [f"diffusion/dual/t0.9/b32/s5/bs{b}" for b in (1, 2)]
    assert all("divide" in s["reason"] for s in report["skipped"])
    names = [r["name"] for r in report["results"]]
    assert names == [f"{m}/bs{b}" for b in (1, 2) for m in ("ar", "diffusion/dual/t0.9/b32/s8", "transformers")]
    by = {r["name"]: r for r in report["results"]}
    for r in report["results"]:
        for key in ("answer_tokens", "nfe", "tokens_per_forward", "seconds", "tokens_per_second", "ttft",
                    "peak_memory_mb", "memory_kind", "repeat_seconds", "per_prompt", "stop_reasons"):
            assert key in r, (r["name"], key)
        assert r["n_prompts"] == 2 and len(r["repeat_seconds"]) == 2
        assert r["tokens_per_forward"] == pytest.approx(r["answer_tokens"] / r["nfe"])
        assert r["tokens_per_second"] == pytest.approx(r["answer_tokens"] / r["seconds"])
        assert r["seconds"] in r["repeat_seconds"]  # the reported repeat is the (lower) median one
        assert r["seconds"] == sorted(r["repeat_seconds"])[0]
        assert r["answer_tokens"] == sum(p["answer_tokens"] for p in r["per_prompt"])
        assert all(1 <= p["answer_tokens"] <= max_new for p in r["per_prompt"])
        assert all(0 < p["ttft"] <= p["seconds"] for p in r["per_prompt"])
        assert r["peak_memory_mb"] > 0
        if r["mode"] != "diffusion":
            assert r["nfe"] == r["answer_tokens"]  # one token per forward
    # ratios come from this run's own numbers, at equal batch size
    ratios = {(x["numerator"], x["denominator"]): x for x in report["ratios"]}
    for b in (1, 2):
        num = f"diffusion/dual/t0.9/b32/s8/bs{b}"
        x = ratios[(num, f"ar/bs{b}")]
        assert x["tokens_per_second_ratio"] == pytest.approx(by[num]["tokens_per_second"] / by[f"ar/bs{b}"]["tokens_per_second"])
        assert by[num]["vs_ar"] == pytest.approx(x["tokens_per_second_ratio"])
        x = ratios[(f"ar/bs{b}", f"transformers/bs{b}")]
        assert x["tokens_per_second_ratio"] == pytest.approx(by[f"ar/bs{b}"]["tokens_per_second"] / by[f"transformers/bs{b}"]["tokens_per_second"])
    # same weights, dtype, prompts and greedy: our AR and transformers agree token for token
    assert [a["identical"] for a in report["ar_transformers_agreement"]] == [2, 2]
    assert Path(report["charts"]["html"][0]).exists() and report["charts"]["png"] == []
    assert "ratio ar/bs1 / transformers/bs1" in stdout and "diffusion/dual/t0.9/b32/s8/bs1" in stdout


def test_throughput_ignore_eos_decodes_exactly_max_new_tokens(eng, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["Say hi."])
    run_cli(["throughput", "--prompts", str(prompts), "--modes", "ar,diffusion", "--cache", "dual",
             "--max-new-tokens", "6", "--repeats", "1", "--warmup-tokens", "0", "--ignore-eos", "--no-png",
             "--quiet", "--out", str(tmp_path / "o")], capsys)
    report = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [r["answer_tokens"] for r in report["results"]] == [6, 6]
    assert all(r["stop_reasons"] == {"max_new_tokens": 1} for r in report["results"])


def test_throughput_weights_modes_interleaved_and_checked(eng, tmp_path, capsys):
    """--weights runs ar once per FASTDLLM_WEIGHTS mode in the same run; a bad mode names the option."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["Say hi."])
    run_cli(["throughput", "--prompts", str(prompts), "--modes", "ar", "--weights", "fp32,int4", "--max-new-tokens", "4",
             "--repeats", "1", "--warmup-tokens", "0", "--ignore-eos", "--no-png", "--quiet", "--out", str(tmp_path / "o")],
            capsys)
    report = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [(r["name"], r["weights"], r["answer_tokens"]) for r in report["results"]] == [
        ("ar@fp32/bs1", "fp32", 4), ("ar@int4/bs1", "int4", 4)]
    with pytest.raises(SystemExit, match="--weights.*int3"):
        run_cli(["throughput", "--weights", "int3"], capsys)


def test_throughput_llamacpp_same_gguf_same_ids(eng, tmp_path, capsys):
    """llama.cpp (optional dependency) on the bundled GGUF decodes our token ids greedily; batch 2 is skipped."""
    pytest.importorskip("llama_cpp")
    prompts = write_prompts(tmp_path / "p.jsonl", ["What is the capital of France?"])
    run_cli(["throughput", "--prompts", str(prompts), "--modes", "ar,llamacpp", "--batch-sizes", "1,2", "--threads", "1",
             "--max-new-tokens", "8", "--repeats", "1", "--warmup-tokens", "0", "--no-png", "--quiet",
             "--out", str(tmp_path / "o")], capsys)
    report = json.loads((tmp_path / "o" / "results.json").read_text())
    by = {r["name"]: r for r in report["results"]}
    assert by["llamacpp/bs1"]["answer_tokens"] >= 1 and "vs_llamacpp" in by["ar/bs1"]
    assert [s["name"] for s in report["skipped"]] == ["llamacpp/bs2"]
    [agree] = report["ar_llamacpp_agreement"]
    # llama.cpp quantises activations to 8 bits: greedy answers may part early (on this prompt the first token
    # is a near tie, 0.09 logits apart), so agreement is measured, not asserted
    assert agree["n"] == 1 and len(agree["common_prefix_tokens"]) == 1


def test_quality_json_prints_exactly_one_object(eng, tmp_path, capsys):
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text("".join(json.dumps(x) + "\n" for x in [
        {"prompt": "What is the capital of France? Answer with one word.", "answers": ["Paris"], "extra": 1},
        {"prompt": "What is 2 + 2? Answer with a number.", "answers": ["4", "four"]},
        {"prompt": "Unused third item.", "answers": ["x"]}]), encoding="utf-8")
    stdout = run_cli(["quality", "--eval-set", str(eval_set), "--limit", "2", "--thresholds", "0.9,1.0",
                      "--max-new-tokens", "8", "--checkable-set", "none", "--json", "--no-png", "--out", str(tmp_path / "q")], capsys)
    lines = stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert list(obj) == ["results"]
    assert [(r["mode"], r["threshold"]) for r in obj["results"]] == [("ar", None), ("diffusion", 0.9), ("diffusion", 1.0)]
    for r in obj["results"]:
        assert set(r) == {"mode", "threshold", "accuracy", "tokens_per_forward", "tokens_per_second", "n"}
        assert r["n"] == 2 and 0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_forward"] > 0
    full = json.loads((tmp_path / "q" / "results.json").read_text())
    answers = [["Paris"], ["4", "four"]]

    def regrade(text: str, accepted: list[str]) -> bool:  # the documented rule, written plainly: a whole word, any case
        return any(re.search(r"(?<![^\W_])" + re.escape(a.lower()) + r"(?![^\W_])", text.lower()) for a in accepted)

    for r, short in zip(full["results"], obj["results"]):
        assert len(r["outputs"]) == 2
        graded = [regrade(o["output"], a) for o, a in zip(r["outputs"], answers)]
        assert [o["correct"] for o in r["outputs"]] == graded, r["outputs"]  # graded on the answer text, per item
        assert short["accuracy"] == r["accuracy"] == pytest.approx(sum(graded) / 2)
        assert r["tokens_per_forward"] == pytest.approx(r["answer_tokens"] / r["nfe"])
        assert all(0 < o["answer_tokens"] <= 8 for o in r["outputs"]), r["outputs"]
    assert full["results"][0]["outputs"][0]["correct"], "the AR base answers Paris: a grader that never passes fails"
    assert (tmp_path / "q" / "quality.html").exists()


def test_quality_agree_with_counts_answers_equal_to_a_reference_run(eng, tmp_path, capsys):
    """--agree-with: per (mode, threshold) the share of answers identical to an earlier run's (matched by item id);
    a changed reference answer counts as a difference; a file that is not a quality result is refused up front."""
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text("".join(json.dumps(x) + "\n" for x in [
        {"id": "a", "prompt": "What is the capital of France?", "answers": ["Paris"]},
        {"id": "b", "prompt": "What is 2 + 2?", "answers": ["4"]}]), encoding="utf-8")
    common = ["quality", "--eval-set", str(eval_set), "--thresholds", "0.9", "--max-new-tokens", "4", "--no-png",
              "--checkable-set", "none", "--quiet"]
    run_cli([*common, "--out", str(tmp_path / "ref")], capsys)
    ref_path = tmp_path / "ref" / "results.json"
    ref = json.loads(ref_path.read_text())
    ref["results"][1]["outputs"][0]["output"] += " (changed)"  # diffusion, item a
    del ref["results"][0]["outputs"][1]  # AR: item b missing from the reference
    ref_path.write_text(json.dumps(ref))
    stdout = run_cli([*common, "--agree-with", str(ref_path), "--json", "--out", str(tmp_path / "q")], capsys)
    ar, diff = json.loads(stdout)["results"]
    assert ar["agreement"] == 1.0 and diff["agreement"] == 0.5
    full = json.loads((tmp_path / "q" / "results.json").read_text())["results"]
    assert full[0]["agreement_detail"] == {"reference": str(ref_path), "equal": 1, "compared": 1, "differ": []}
    assert full[1]["agreement_detail"]["differ"] == ["a"] and full[1]["agreement_detail"]["compared"] == 2
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "throughput"}))
    with pytest.raises(SystemExit, match="--agree-with: .*bad.json is not a readable `bench quality` results.json"):
        run_cli([*common, "--agree-with", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")], capsys)


def test_quality_long_set_adds_tokens_per_forward_per_mode(eng, tmp_path, capsys):
    """--long-set: every mode decodes the long prompts in the same run (bench/longform.py; the measures themselves
    are tested in tests/test_longform.py); AR there is one token per forward."""
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text(json.dumps({"prompt": "What is 2 + 2?", "answers": ["4"]}) + "\n", encoding="utf-8")
    long_set = write_prompts(tmp_path / "long.jsonl", ["List five fruits.", "Explain rain.", "Unused."])
    stdout = run_cli(["quality", "--eval-set", str(eval_set), "--thresholds", "0.5,1.0", "--max-new-tokens", "4",
                      "--long-set", str(long_set), "--long-limit", "2", "--long-max-new-tokens", "6", "--checkable-set", "none", "--json",
                      "--no-png", "--out", str(tmp_path / "q")], capsys)
    obj = json.loads(stdout)
    assert all("long_tokens_per_forward" in r for r in obj["results"])
    full = json.loads((tmp_path / "q" / "results.json").read_text())["results"]
    assert full[0]["mode"] == "ar" and full[0]["long_tokens_per_forward"] == 1.0
    for r in full:
        assert r["long_n"] == 2 and 0 < r["long_answer_tokens"] <= 12
        assert r["long_tokens_per_forward"] == pytest.approx(r["long_answer_tokens"] / r["long_nfe"])


# ---------------------------------------------------------------------------------------------- lm-eval

def lm_eval_model(eng, **kw):
    pytest.importorskip("lm_eval")
    from bench.lm_eval_model import FastDLLMv2

    return FastDLLMv2(engine=eng, **kw)


def test_lm_eval_likelihood_equals_left_to_right_decoding(eng):
    """Decoding with sub-block 1 and threshold 1.0 commits left to right, one token per forward, with the
    same block cache: the confidences it commits must multiply to the likelihood the lm-eval model reports."""
    lm = lm_eval_model(eng, cache="block", sub_block_size=1, threshold=1.0)
    ids = eng.encode(eng.chat_prompt([{"role": "user", "content": "List three fruits."}]))
    for mode in ("diffusion", "ar"):
        cfg = eng.decode_config(mode=mode, cache="block", sub_block_size=1, threshold=1.0, max_new_tokens=6)
        r = eng.generate_ids([ids], cfg, record=True)[0]
        confs = [t.conf for e in r.trace.events for t in e.committed]
        lm.defaults["mode"] = mode
        lp, greedy = lm._score(ids + r.summary.token_ids, len(ids))
        assert greedy
        assert lp == pytest.approx(sum(math.log(c) for c in confs), abs=1e-3)


def test_lm_eval_generate_until_cuts_and_stops_early(eng):
    lm = lm_eval_model(eng, mode="ar", max_new_tokens=24)
    req = lambda ctx, kw: SimpleNamespace(args=(ctx, kw))  # noqa: E731
    full = lm.generate_until([req("List three fruits.", {"max_gen_toks": 24})], disable_tqdm=True)[0]
    tokens_full = lm.stats["answer_tokens"]
    assert len(full) > 6
    stop = full[4:6]
    cut = lm.generate_until([req("List three fruits.", {"until": [stop], "max_gen_toks": 24, "do_sample": False})],
                            disable_tqdm=True)[0]
    assert cut == full[:full.find(stop)]
    assert lm.stats["answer_tokens"] - tokens_full < tokens_full  # decoding stopped once the stop string appeared
    with pytest.raises(ValueError, match="unknown model_args"):
        lm_eval_model(eng, bogus=1)


def test_lm_eval_simple_evaluate_local_tasks(eng):
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import bench.lm_eval_model  # noqa: F401  registers fast_dllm_v2

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    res = lm_eval.simple_evaluate(
        model="fast_dllm_v2", model_args={"engine": eng, "max_new_tokens": 8, "threshold": 0.9, "cache": "dual"},
        tasks=["fastdllm_short_answer", "fastdllm_choice"], limit=2, apply_chat_template=True,
        task_manager=TaskManager(include_path=str(ROOT / "bench" / "lm_eval_tasks"), include_defaults=False))
    assert 0.0 <= res["results"]["fastdllm_short_answer"]["acc,none"] <= 1.0
    assert 0.0 <= res["results"]["fastdllm_choice"]["acc,none"] <= 1.0
    gens = [s["resps"][0][0] for s in res["samples"]["fastdllm_short_answer"]]
    assert len(gens) == 2 and all(isinstance(g, str) and "\n\n" not in g for g in gens)
    lls = [s["resps"] for s in res["samples"]["fastdllm_choice"]]
    assert all(math.isfinite(ll) and ll < 0 for doc in lls for (ll, _greedy), in doc)


def test_roofline_reports_forward_cost_and_generate_overhead(eng, tmp_path, capsys):
    from bench.roofline import SHAPES, random_model, weight_bytes

    out = run_cli(["roofline", "--widths", "1,4", "--iters", "2", "--probe-mb", "16", "--prefix", "40", "--hf",
                   "--new-tokens", "3", "--threads", "1", "--out", str(tmp_path)], capsys)
    rep = json.loads((tmp_path / "roofline.json").read_text())
    assert "generate()" in out and rep["weight_bytes"] == weight_bytes(eng.lm.dllm)
    assert [r["k"] for r in rep["widths"]] == [1, 4]
    for r in rep["widths"]:
        assert r["ms_per_forward"] > 0
        assert math.isclose(r["achieved_gbps"] * r["ms_per_forward"] / 1e3 * 1e9, rep["weight_bytes"], rel_tol=1e-6)
        assert math.isclose(r["tokens_per_s_at_k"], r["k"] * r["forwards_per_s"], rel_tol=1e-9)
    hf = rep["hf"]
    assert hf["hf_step_s"] > 0 and hf["generate_per_token_s"] > 0 and hf["engine_ar_per_token_s"] > 0
    assert math.isclose(hf["engine_vs_generate"], hf["generate_per_token_s"] / hf["engine_ar_per_token_s"])
    # the named shape is the bundled architecture: same parameter bytes as the real base
    shaped = random_model("smollm2-135m", torch.device("cpu"), torch.float32)
    assert weight_bytes(shaped) == weight_bytes(eng.lm.base) and "qwen2.5-1.5b" in SHAPES


def test_kernels_bench_times_each_projection_shape_and_width(tmp_path, capsys):
    """bench kernels: every shape x width for int4 / dense bf16 / fp32 and our kernels (this CPU builds them),
    ratios against the first width, multiply-add rates."""
    from bench.kernels import SHAPES

    out = run_cli(["kernels", "--widths", "1,4", "--iters", "3", "--repeats", "1", "--stream-mb", "8",
                   "--threads", "1", "--out", str(tmp_path)], capsys)
    rep = json.loads((tmp_path / "kernels.json").read_text())
    assert "int4 us" in out and rep["widths"] == [1, 4] and rep["cold_bf16_stream_gbps"] > 0
    assert {(r["shape"], r["k"]) for r in rep["rows"]} == {(s, k) for s in SHAPES for k in (1, 4)}
    from engine.weights import kernels as cpu_kernels

    ours = all(f in cpu_kernels.cpu_flags() for f in cpu_kernels.NEEDS)
    assert rep["kinds"][:3] == ["int4", "bf16", "fp32"] and ("q4_f32" in rep["kinds"]) == ours == ("q4_i8w" in rep["kinds"])
    assert ("q4_bf16" in rep["kinds"]) == (ours and cpu_kernels.bf16_ok()) and (not ours or "ours fp32-act us" in out)
    for r in rep["rows"]:
        base = next(b for b in rep["rows"] if b["shape"] == r["shape"] and b["k"] == 1)
        for kind in rep["kinds"]:
            assert r[f"{kind}_us"] > 0
            assert math.isclose(r[f"{kind}_x_k1"], r[f"{kind}_us"] / base[f"{kind}_us"])
            assert math.isclose(r[f"{kind}_gmacs"], r["k"] * r["out"] * r["in"] / r[f"{kind}_us"] / 1e3)


def test_cpu_shape_projection_counts_each_caches_whole_block_forwards():
    """bench cpu-shape's projected diffusion/AR: `dual` runs a whole-block refresh at each of a block's 4 sub-blocks
    and the commit, `dual-sparse` one refresh and the commit, the rest sub-block steps; at 2.6 tokens per forward a
    block takes 32 / 2.6 forwards. (The first projection counted one whole-block forward for every schedule.)"""
    from bench.cpu_shape import projection

    ms = {"1": 1.0, "9": 2.0, "33": 10.0}
    dec = {"refresh": 8.0, "commit": 7.0, "sub": 2.0}
    p = projection(ms, 2.6, dec)
    f = 32 / 2.6
    assert p["schedules"]["dual"]["block_ms"] == pytest.approx(4 * 8 + 7 + (f - 5) * 2)
    assert p["schedules"]["dual-sparse"]["block_ms"] == pytest.approx(8 + 7 + (f - 2) * 2)
    assert p["schedules"]["dual"]["diffusion_over_ar"] == pytest.approx(32 / (4 * 8 + 7 + (f - 5) * 2))
    assert p["block_ms"] == pytest.approx(10 + (f - 1) * 2) and p["refresh_over_x1"] == 8.0
    assert projection(ms, 32.0, dec)["schedules"]["dual"]["block_ms"] == pytest.approx(39)  # never fewer steps than 0


def test_profile_splits_a_decode_on_the_one_call_layer_steps(adapter_env, monkeypatch):
    """`bench profile` on the engine's 4-bit default, where every layer of a narrow forward runs in one kernel call
    (LayerSteps): the timer must stand in for that one object (it was a list of per-layer wrappers, which the forward
    cannot call: the command crashed with AttributeError), the time lands in 'layer steps', and the model gets its
    own steps back."""
    from bench.profile import breakdown
    from engine import Engine

    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    monkeypatch.setenv("FASTDLLM_FUSED", "1")
    q = Engine.load()
    ids = [q.encode(q.chat_prompt([{"role": "user", "content": "Name three colours."}]))]
    for mode in ("ar", "diffusion"):
        model = q.lm.dllm if mode == "diffusion" else q.lm.base
        steps = model.steps
        assert steps is not None, "the 4-bit default runs its narrow forwards as one call"
        rep = breakdown(q, ids, q.decode_config(mode=mode, max_new_tokens=8), sync=False)
        assert rep["parts_seconds"]["layer_steps"] > 0 and rep["forwards"] > 0, rep
        assert rep["engine_seconds"] >= rep["forward_seconds"] > 0
        assert model.steps is steps
