"""Model sources: the Fast_dLLM_v2 checkpoint layout through the hub path, local dirs, errors, the GGUF cache."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from engine import Engine
from engine.weights import ModelSourceError, bundled_base_dir, resolve_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, tiny_fast_dllm):
    """A hub cache holding the tiny Fast_dLLM_v2 checkpoint under a hub id; network disabled."""
    from checkpoints import put_in_hub_cache

    cache = tmp_path / "hub"
    put_in_hub_cache(tiny_fast_dllm, cache, "Efficient-Large-Model/Fast_dLLM_v2_tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_fast_dllm_checkpoint_loads_through_the_hub_path(offline_hub):
    eng = Engine.load("Efficient-Large-Model/Fast_dLLM_v2_tiny", device="cpu")
    lm = eng.lm
    assert lm.source.kind == "hub" and "explicit" in lm.source.reason
    assert lm.info["model_type"] == "Fast_dLLM_Qwen" and lm.info["bd_size"] == 32
    assert lm.cfg.attention_bias and lm.cfg.tie_word_embeddings and lm.cfg.rope_theta == 1e6
    assert lm.mask_token_id == lm.tokenizer.convert_tokens_to_ids("|<MASK>|") < lm.cfg.vocab_size
    head = lm.dllm.lm_head  # tied: on CPU the decode layout keeps a transposed copy of the embedding
    assert lm.dllm.packed and torch.equal(head.weight_t.t(), lm.dllm.model.embed_tokens.weight)
    prompt = eng.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    never = lm.mask_token_id
    for cache in ("none", "block", "dual"):
        [res] = eng.generate("hi", eng.decode_config(cache=cache, max_new_tokens=40, stop_token_ids=(never,)))
        assert res.summary.answer_tokens == 40
        assert sorted(t.pos for e in res.trace.events for t in e.committed) == list(range(40))


def test_local_directory_and_env(tiny_fast_dllm, monkeypatch):
    monkeypatch.setenv("FASTDLLM_MODEL", str(tiny_fast_dllm))
    src = resolve_source(None)
    assert src.kind == "local" and src.reason == "env FASTDLLM_MODEL"
    assert resolve_source(str(tiny_fast_dllm)).reason == "explicit (--model)"


def test_offline_without_cache_names_the_bundled_default(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="bundled default"):
        resolve_source("Efficient-Large-Model/Fast_dLLM_v2_1.5B")
    with pytest.raises(ModelSourceError, match="neither a local directory nor a hub id"):
        resolve_source("no/such/thing")


def test_bundled_default_without_env(monkeypatch):
    monkeypatch.delenv("FASTDLLM_MODEL", raising=False)
    src = resolve_source(None)
    assert src.kind == "bundled" and src.reason == "bundled (offline default)"


def test_gguf_conversion_is_cached():
    """The dequantised base is written once; later loads read safetensors (timed in bench, not here). The cached
    checkpoint is checked against its source: tensors dequantised from the GGUF by the gguf library itself (Q4_1
    projections of the first, a middle and the last layer, and the Q8_0 embedding) are the cached ones, exactly."""
    import gguf

    from engine.weights import bundled_gguf_path, read_state_dict

    path = bundled_base_dir()
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert bundled_base_dir() == path and (path / "model.safetensors").stat().st_mtime_ns == before
    state = read_state_dict(path)
    src = {t.name: t for t in gguf.GGUFReader(str(bundled_gguf_path())).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in (0, 15, 29):  # not attn_q / attn_k: llama.cpp permutes their rows (test_quant.py checks those)
        pairs |= {f"blk.{i}.ffn_down.weight": f"model.layers.{i}.mlp.down_proj.weight",
                  f"blk.{i}.ffn_gate.weight": f"model.layers.{i}.mlp.gate_proj.weight",
                  f"blk.{i}.attn_v.weight": f"model.layers.{i}.self_attn.v_proj.weight",
                  f"blk.{i}.attn_output.weight": f"model.layers.{i}.self_attn.o_proj.weight"}
    for name, ours in pairs.items():
        t = src[name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        assert torch.equal(want.view(state[ours].shape), state[ours].float()), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "engine", *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_cli_generate_json(tmp_path):
    trace = tmp_path / "t.json"
    r = _cli("generate", "--prompt", "What is 2 + 2?", "--json", "--max-new-tokens", "16", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("text", "tokens", "nfe", "tokens_per_forward", "seconds", "tokens_per_second", "mode", "cache", "model"):
        assert key in out
    assert out["tokens"] <= 16 and out["tokens_per_forward"] == pytest.approx(out["tokens"] / out["nfe"])
    assert json.loads(trace.read_text())["summary"]["answer_tokens"] == out["tokens"]
    from engine.finish import judge

    assert out["finish"] == judge(out["text"], out["stop_reason"]).label  # complete | looping | capped ...


def test_cli_footer_says_whether_the_answer_ended_before_its_speed():
    """The CLI, like the studio, says an answer loops or hit the cap before its tokens per forward (issue 21); with
    the knobs off under diffusion it names the studio's."""
    from types import SimpleNamespace

    from engine.__main__ import STUDIO_KNOBS, _finish
    from engine.config import DecodeConfig

    loop = "I like apples and I like pears and " * 12
    off, studio = DecodeConfig(), DecodeConfig(frequency_penalty=0.3, no_repeat_ngram_size=4, stop_guard=True)
    assert _finish(SimpleNamespace(text="Paris.", stop_reason="stop_token"), off) == ("complete", "")
    verdict, hint = _finish(SimpleNamespace(text=loop, stop_reason="stop_token"), off)
    assert verdict.startswith("looping (") and "% of its word 4-grams repeat)" in verdict and STUDIO_KNOBS in hint
    assert _finish(SimpleNamespace(text=loop, stop_reason="stop_token"), studio)[1] == ""  # knobs on: no hint
    assert _finish(SimpleNamespace(text=loop, stop_reason="stop_token"), DecodeConfig(mode="ar"))[1] == ""
    assert _finish(SimpleNamespace(text="Once upon a", stop_reason="max_new_tokens"), studio) == \
        ("unfinished: hit --max-new-tokens", "")
    flags = STUDIO_KNOBS.split()  # the hint's flags are the CLI's and give the studio's defaults
    from app.settings import KNOB_DEFAULTS
    from engine.__main__ import _settings, parser

    got = _settings(parser().parse_args(["generate", "--prompt", "x", *flags]))
    assert {k: got[k] for k in KNOB_DEFAULTS} == KNOB_DEFAULTS


@pytest.mark.parametrize("args,needle", [
    (["generate", "--prompt", "hi", "--sub-block-size", "5"], "sub_block_size: must divide block_size=32"),
    (["generate", "--prompt", "hi", "--threshold", "0"], "threshold"),
    (["generate", "--prompt", "hi", "--cache", "disk"], "--cache"),
    (["generate", "--prompt", "   "], "prompt"),
    (["generate", "--prompt", "hi", "--model", "/no/such/dir/x"], "model"),
])
def test_cli_bad_arguments_one_line_no_traceback(args, needle):
    r = _cli(*args)
    assert r.returncode != 0
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1


def test_cli_chat_multi_turn():
    r = _cli("chat", "--max-new-tokens", "8", stdin="hello\n\n   \nclear\nwhat is 1+1?\nexit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("bot> ") == 2, "empty input is ignored, each message answered once"
    assert "(conversation cleared)" in r.stderr and "Traceback" not in r.stderr


def test_cli_chat_reuses_the_history_and_says_so():
    """The terminal chat decodes through the scheduler: a long first message's chunks are copied into the next
    turn's prefill (the prefix cache), and that turn's stats line says how many prompt tokens they were."""
    notes = "Notes: " + "The meeting moved to Tuesday at ten. " * 40
    r = _cli("chat", "--mode", "ar", "--max-new-tokens", "4", stdin=f"{notes}\nWhen is it?\nexit\n")
    assert r.returncode == 0, r.stderr
    stats = [ln for ln in r.stderr.splitlines() if "tokens/forward" in ln]
    assert len(stats) == 2 and "prefix cache" not in stats[0] and "first token" in stats[0]
    got = re.search(r"· (\d+) prompt tokens from the prefix cache\]$", stats[1])
    assert got and int(got[1]) % 64 == 0 and int(got[1]) >= 320, stats[1]  # whole 64-token grains (the CPU's)


def test_bf16_model_keeps_fp32_rotary_angles(tiny_fast_dllm):
    """Module.to(bf16) must not round inv_freq: bf16 angles drift by radians at long positions."""
    from engine.weights import build_model

    model = build_model(tiny_fast_dllm, torch.device("cpu"), torch.bfloat16)
    assert model.rope.inv_freq.dtype == torch.float32
    pos = torch.tensor([[4000]])
    cos, _ = model.rope(pos, torch.bfloat16)
    inv = model.rope.inv_freq
    want = torch.cat((4000.0 * inv, 4000.0 * inv)).cos()
    assert (cos.float().flatten() - want).abs().max() < 1e-2  # only the final bf16 cast's rounding


def test_runtime_reads_every_switch_and_names_a_bad_value(monkeypatch, tmp_path):
    """Runtime.from_env (engine/runtime.py) is the one reader of FASTDLLM_*: each switch lands in its field, blank
    means the default, and a value a switch cannot take is an error naming the switch and what it takes."""
    from engine.runtime import FIELDS, Runtime, RuntimeConfigError

    for f in FIELDS:
        monkeypatch.delenv(Runtime.switch_of(f), raising=False)
    assert Runtime.from_env() == Runtime()
    values = {"FASTDLLM_MODEL": "bundled-base", "FASTDLLM_ADAPTER": str(tmp_path / "a.safetensors"),
              "FASTDLLM_GGUF": str(tmp_path / "b.gguf"), "FASTDLLM_CACHE": str(tmp_path), "FASTDLLM_DTYPE": "bfloat16",
              "FASTDLLM_THREADS": "3", "FASTDLLM_WEIGHTS": "int4", "FASTDLLM_INT4_WIDE_ROWS": "9",
              "FASTDLLM_ACTIVATIONS": "int8", "FASTDLLM_KERNELS": "torch", "FASTDLLM_AMX": "0", "FASTDLLM_FUSED": "0", "FASTDLLM_PACK": "0",
              "FASTDLLM_STATIC": "1", "FASTDLLM_GRAPHS": "0", "FASTDLLM_COMPILE": "1", "FASTDLLM_QUEUE_SIZE": "5",
              "FASTDLLM_PREFILL_CHUNK": "128", "FASTDLLM_PREFIX_CACHE_MIB": "0",
              "FASTDLLM_ENGINE_URL": "http://h:8000", "FASTDLLM_API_KEY": "k", "FASTDLLM_UPDATE_SCREENSHOT": "1"}
    for k, v in values.items():
        monkeypatch.setenv(k, f" {v} ")  # surrounding blanks are ignored
    rt = Runtime.from_env()
    assert rt == Runtime(model="bundled-base", adapter=tmp_path / "a.safetensors", gguf=tmp_path / "b.gguf",
                         cache=tmp_path, dtype="bfloat16", threads=3, weights="int4", int4_wide_rows=9,
                         activations="int8", kernels="torch", amx=False, fused=False, pack=False, static=True, graphs=False,
                         compile=True, queue_size=5, engine_url="http://h:8000", api_key="k", update_screenshot=True,
                         prefill_chunk=128, prefix_cache_mib=0)
    for name, bad, needle in (("FASTDLLM_THREADS", "two", "'two' is not an integer >= 1"),
                              ("FASTDLLM_THREADS", "0", "0 must be >= 1"),
                              ("FASTDLLM_STATIC", "yes", "'yes' is not 0 or 1"),
                              ("FASTDLLM_DTYPE", "fp8", "'fp8' is not one of float32, bfloat16, float16")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(RuntimeConfigError, match=f"{name}: {needle}"):
            Runtime.from_env()
        monkeypatch.setenv(name, values[name])


def test_engine_load_takes_its_switches_from_the_runtime_object(monkeypatch):
    """Engine.load(runtime=...) uses the object's switches, not the environment's (conftest sets
    FASTDLLM_WEIGHTS=fp32): here the bundled model at 4-bit on torch's int4 kernel, eagerly (no fused layer step)."""
    from engine.runtime import Runtime

    monkeypatch.setenv("FASTDLLM_KERNELS", "ours")
    eng = Engine.load(runtime=Runtime(weights="int4", kernels="torch", fused=False, static=False))
    assert eng.runtime.weights == "int4" and not eng.static
    assert eng.lm.info["weights"] == "int4" and eng.lm.info["kernels"] == "torch (FASTDLLM_KERNELS=torch)"
    assert eng.lm.base.steps is None and eng.lm.base.lm_head.core.kernels is None
    r = eng.generate("What is 2 + 3?", eng.decode_config(mode="ar", max_new_tokens=8), record=False)[0]
    assert r.summary.answer_tokens > 0


def test_a_non_fp32_dtype_on_the_4bit_cpu_path_is_refused_by_name(monkeypatch):
    """The CPU's 4-bit kernels take and give fp32 rows: `--dtype bfloat16` there crashed at the first decode
    ("layer_step: x must be fp32"); now the load says which parameter and what to do instead."""
    from engine import ConfigError
    from engine.loading import load

    monkeypatch.setenv("FASTDLLM_WEIGHTS", "int4+bf16")
    with pytest.raises(ConfigError, match="dtype: the CPU's 4-bit weights .* not bfloat16.*FASTDLLM_WEIGHTS=fp32"):
        load(None, "cpu", "bfloat16")
