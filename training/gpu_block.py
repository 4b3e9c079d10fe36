"""The GPU block as commands: prepare here, then weights / data / train on the device, unpack here.

A device command carries the repo plus named ignored paths (64 MiB in all), runs at most 10 minutes,
and returns at most 8 files of <= 16 MiB through $OUT; the machine is bare at each start and keeps its
files only while calls follow each other within ~30 s. So every device stage is idempotent, finds the
work already done on the machine, and ends by copying its results into $OUT within those limits
(`collect`), splitting what is bigger than a file may be. The runbook is training/README.md.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import weights
from .weights import MIB

if TYPE_CHECKING:
    from .train import TrainConfig

REPO = Path(__file__).resolve().parent.parent
PARTS_DIR = REPO / ".gl" / "gguf"  # ignored; carried part by part
WHEELS_DIR = REPO / ".whl"  # ignored; carried by every device command
WHEELS = ("gguf==0.19.0",)  # pure Python; transformers reads the GGUF with it. The device image has the rest.
OUT_FILES, OUT_FILE_BYTES, OUT_BYTES = 8, 16 * MIB, 64 * MIB  # what $OUT may hand back per command
SPLIT_BYTES = 15 * MIB  # part size for files too big for one $OUT file (a little under the limit)
SLIM = "ckpt-slim.pt"
# log.jsonl + train.json travel as one file: a rank-64 slim checkpoint takes 4 files (3 parts + parts.json), the
# generator beside it 3, and $OUT holds 8.
LOGS_TAR = "train-logs.tar"
# The block's device commands (training/README.md's table; a test keeps the two equal). Each starts with the
# device README's wheel install.
PREFIX = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
          ".whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1; ")
# The block fits 15 minutes of device time (the rule since 2026-11-27; block 3 ran this shape in 690 s): the first
# part's call re-runs the CUDA tests (toy and random-weight models: the bundled one is not converted yet, so its
# test skips; `.gpu` carries the tokenizer they need), the last part's call converts the base and trains the next
# phase from the shipped adapter while new data is generated beside it, then measures the bundled model on CUDA
# and 8 clients through the scheduler for what is left (stdout only: $OUT holds the trainer's 5 files and the
# generator's 3, the limit).
GPU_DIR = REPO / ".gpu"  # the tokenizer the CUDA tests need before the base is converted (bench gpu --prepare)
CHECK_SLOT = ("timeout 120 python3 -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider >$OUT/cuda_tests.log 2>&1;"
              " tail -3 $OUT/cuda_tests.log")
BUNDLED_SLOT = ("timeout 100 python3 -m bench gpu --sections bundled,clients --bundled-seconds 30 --out /tmp/gpu_bundled;"
                " cat /tmp/gpu_bundled/gpu.json")  # clients: 8 at once through the scheduler on graphs (issue 24)
# Block 2: the generator at batch 512 beside the trainer at micro-batch 64 ran out of GPU memory (56.5 GiB trainer
# peak); batch 256 beside micro-batch 32 fits (46 GiB at most, blocks 2 and 3). Logs of the side process stay in /tmp.
SEED_DATA = "training/data/selfinstruct"
DATA_SEED = 3  # Magpie rounds: seed 0 block 1, 1 block 2, 2 block 3
DATA_ARGS = (f"--seed-from {SEED_DATA} --seed {DATA_SEED} --magpie 30000 --magpie-batch 1024 --batch-size 256 "
             "--max-new-tokens 256 --time-budget 300 --threads 6")
# Peak lr 5e-5, not block 3's 2e-4 (p5's loss rose from 2.42 to 2.51 once its lr passed 1e-4, fell back only below
# ~6e-5). Block 4 trained at 5e-5 and its loss stayed flat too (p6a: 2.48 -> 2.47 over 402 steps; neither p6a nor
# p6b beat the shipped adapter, bench/results/gpu_h200_2026-11-28): at rank 32 this data no longer moves the adapter.
# Block 5 adds capacity: rank 64 grown from the shipped rank-32 adapter (`--init-from` fills the first 32 directions,
# the new ones start at B = 0, so training starts from the shipped model; alpha 128 keeps alpha/rank at 2). The
# slim checkpoint is then 39 MB (3 parts): 5 train + 3 data files, ~43 MB, still inside $OUT's limits.
TRAIN_ARGS = ("--answers finish --batch-size 64 --micro-batch 32 --max-len 512 --rank 64 --alpha 128 --lr 5e-5 "
              "--warmup-steps 20 --save-every-s 120 --threads 6")
# ~1.36 steps of 64 a second beside the generator (block 3): 6.5 minutes ~ 530 steps; 20,545 answers kept by `finish`
# at max-len 512 are 321 steps an epoch, so 1.6 epochs (514 steps) end the schedule inside the call.
TRAIN_MINUTES, TRAIN_EPOCHS = 6.5, 1.6
TRAIN = (f"python3 -m training gpu train --out $OUT/train --data {SEED_DATA} --run runs/gpu/next --minutes {TRAIN_MINUTES} "
         f"-- {TRAIN_ARGS} --epochs {TRAIN_EPOCHS} --init-from assets/fastdllm_adapter.safetensors")
# What no device command reads: the dated results (15 MiB of JSON after block 3, a third of what travelled). The
# block runs from a branch without them, so the GGUF rides in fewer, bigger parts (7 parts of 13.4 MiB with them
# on 2026-11-28, 4 without): each part is a call, ~15-20 s of device time.
NOT_CARRIED = ("bench/results",)
BLOCK_BRANCH = "gpu-block"
HOOK_MARK = "# written by `python -m training gpu prepare`; `gpu back` removes it"
# Commits made on the block's branch would not reach main (and would delete bench/results there if merged): refused.
PRE_COMMIT = f"""#!/bin/sh
{HOOK_MARK}
if [ "$(git rev-parse --abbrev-ref HEAD)" = "{BLOCK_BRANCH}" ]; then
  echo "on the GPU block's branch (bench/results set aside): run 'python -m training gpu back' before committing" >&2
  exit 1
fi
"""
FINGERPRINT_FILE = Path(__file__).resolve().parent / "data" / "base_fingerprint.json"
FINGERPRINT_PROMPT = "Name three colors."


# ------------------------------------------------------------------------------------------ $OUT
@dataclass(slots=True)
class Collected:
    files: list[str]
    bytes: int


def collect(paths: list[Path], out: Path) -> Collected:
    """Copy paths into out; a file over SPLIT_BYTES goes as `<name>.split/` parts. Fails loudly past the limits."""
    out.mkdir(parents=True, exist_ok=True)
    for p in paths:
        if p.stat().st_size > SPLIT_BYTES:
            weights.split(p, out / f"{p.name}.split", -(-p.stat().st_size // SPLIT_BYTES))
        else:
            shutil.copy2(p, out / p.name)
    files = sorted(f for f in out.rglob("*") if f.is_file())
    total = sum(f.stat().st_size for f in files)
    if len(files) > OUT_FILES or total > OUT_BYTES or any(f.stat().st_size > OUT_FILE_BYTES for f in files):
        raise RuntimeError(f"$OUT: {len(files)} files, {total / MIB:.1f} MiB; a command hands back at most "
                           f"{OUT_FILES} files of {OUT_FILE_BYTES // MIB} MiB, {OUT_BYTES // MIB} MiB in all")
    return Collected([str(f.relative_to(out)) for f in files], total)


def unpack(src: Path, data: Path, run: Path) -> list[str]:
    """Here, after a device command: join split files, put data files under `data`, training files under `run`."""
    placed = []
    for parts in sorted(src.glob("*.split/parts.json")):
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        joined = weights.join(parts.parent, tmp / weights.PartSet.read(parts).file)
        placed.append(_place(joined, data, run, move=True))
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name == LOGS_TAR:  # the trainer's small files, one $OUT file for all of them
            with tarfile.open(f) as tar, tempfile.TemporaryDirectory() as tmp:
                tar.extractall(tmp, filter="data")
                placed += [_place(m, data, run, move=True) for m in sorted(Path(tmp).iterdir())]
        elif f.is_file():
            placed.append(_place(f, data, run, move=False))
    return placed


def read_logs(out: Path) -> dict[str, str]:
    """The trainer's small files in a command's $OUT (`train.json`, `log.jsonl`) by name, as text."""
    with tarfile.open(out / LOGS_TAR) as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def _place(f: Path, data: Path, run: Path, move: bool) -> str:
    name = f.name
    if name.endswith(".npz") or name == "manifest.json":
        dest = data / name
    elif name == "magpie.jsonl.gz":
        data.mkdir(parents=True, exist_ok=True)
        with gzip.open(f, "rb") as g:
            (data / "magpie.jsonl").write_bytes(g.read())
        return str(data / "magpie.jsonl")
    else:
        dest = run / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    (shutil.move if move else shutil.copy2)(str(f), str(dest))
    return str(dest)


# ------------------------------------------------------------------------------------------ prepare (here)
def _git(repo: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _hook(repo: Path) -> Path:
    return repo / _git(repo, "rev-parse", "--git-path", "hooks") / "pre-commit"  # core.hooksPath if set


def set_aside(repo: Path = REPO, paths: tuple[str, ...] = NOT_CARRIED, branch: str = BLOCK_BRANCH) -> dict:
    """Switch the checkout to `branch`: HEAD's commit without `paths` (HEAD its parent), so that what every device
    command sends leaves them out. Built in a scratch index, so nothing is staged on the branch you were on; the
    switch removes the paths from the working tree and `come_back` restores them. Refuses with uncommitted changes
    to tracked files. A pre-commit hook refuses commits on `branch` (they would not reach the branch you were on)
    until `come_back`."""
    gitdir, name = Path(_git(repo, "rev-parse", "--absolute-git-dir")), _git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    if name == branch:
        return {"branch": branch, "from": (gitdir / "gpu-block-from").read_text().split()[1], "left_out": list(paths)}
    if _git(repo, "status", "--porcelain", "--untracked-files=no"):
        raise ValueError("set_aside: the checkout has uncommitted changes to tracked files; commit or stash them first")
    came_from = _git(repo, "rev-parse", "HEAD") if name == "HEAD" else name  # a detached HEAD: its commit
    env = {**os.environ, "GIT_INDEX_FILE": str(gitdir / "gpu-block-index"), "GIT_AUTHOR_NAME": "gpu block",
           "GIT_AUTHOR_EMAIL": "gpu-block@localhost", "GIT_COMMITTER_NAME": "gpu block",
           "GIT_COMMITTER_EMAIL": "gpu-block@localhost"}
    _git(repo, "read-tree", "HEAD", env=env)
    _git(repo, "rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", *paths, env=env)
    tree = _git(repo, "write-tree", env=env)
    (gitdir / "gpu-block-index").unlink()
    commit = _git(repo, "commit-tree", tree, "-p", "HEAD", "-m",
                  f"GPU block: {came_from} without {', '.join(paths)} (what no device command reads)", env=env)
    _git(repo, "branch", "-f", branch, commit)
    hook = _hook(repo)
    if not hook.exists():  # never over someone's own hook
        hook.parent.mkdir(parents=True, exist_ok=True)
        hook.write_text(PRE_COMMIT)
        hook.chmod(0o755)
    (gitdir / "gpu-block-from").write_text(f"{'commit' if name == 'HEAD' else 'branch'} {came_from}\n")
    _git(repo, "switch", "-q", branch)
    return {"branch": branch, "from": came_from, "left_out": list(paths)}


def come_back(repo: Path = REPO, branch: str = BLOCK_BRANCH) -> dict:
    """After the block: back to the branch (or commit) `set_aside` left; the set-aside paths return with it."""
    try:
        gitdir, on = Path(_git(repo, "rev-parse", "--absolute-git-dir")), _git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a copy of the files): nothing to switch
        return {"on": None, "switched": False}
    if on != branch:
        return {"on": on, "switched": False}
    kind, came_from = (gitdir / "gpu-block-from").read_text().split()
    _git(repo, "switch", "-q", *(["--detach"] if kind == "commit" else []), came_from)
    hook = _hook(repo)
    if hook.exists() and HOOK_MARK in hook.read_text():
        hook.unlink()
    return {"on": came_from, "switched": True}


def prepare(reserve_mib: float = 0.0, parts: int | None = None, aside: bool = True) -> dict:
    """Wheels into .whl/, the bundled GGUF into .gl/gguf/ parts sized so that each rides with the repo (from the
    block's branch without NOT_CARRIED unless `aside` is off)."""
    from engine.weights import bundled_gguf_path

    switched = set_aside() if aside else None
    WHEELS_DIR.mkdir(exist_ok=True)
    for spec in WHEELS:
        name = spec.split("==")[0]
        if not any(WHEELS_DIR.glob(f"{name}-{spec.split('==')[1]}-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                            "--platform", "manylinux_2_17_x86_64", "-d", str(WHEELS_DIR), spec], check=True)
    from bench.gpu import prepare as prepare_tokenizer

    prepare_tokenizer()  # .gpu/tokenizer, carried with the first part
    gguf = bundled_gguf_path()
    if gguf.stat().st_size != weights.GGUF_BYTES or weights.sha256_file(gguf) != weights.GGUF_SHA256:
        raise ValueError(f"gguf: {gguf} is not the file DESIGN.md §5 describes (size/sha256 differ)")
    wheel_bytes = sum(f.stat().st_size for f in WHEELS_DIR.glob("*.whl"))
    tree = weights.tree_bytes(REPO)
    gpu_bytes = sum(f.stat().st_size for f in GPU_DIR.rglob("*") if f.is_file())  # rides with the first part
    n = parts or weights.part_count(weights.GGUF_BYTES, tree, wheel_bytes + gpu_bytes + int(reserve_mib * MIB))
    ps = weights.split(gguf, PARTS_DIR, n)
    biggest = tree + wheel_bytes + gpu_bytes + max(p.bytes for p in ps.parts)
    return {"set_aside": switched, "tree_mib": round(tree / MIB, 1), "wheels_mib": round(wheel_bytes / MIB, 2),
            "parts": len(ps.parts),
            "part_mib": round(max(p.bytes for p in ps.parts) / MIB, 1),
            "largest_command_mib": round(biggest / MIB, 1), "calls": plan([p.name for p in ps.parts])}


def plan(part_names: list[str]) -> list[dict]:
    """The block's `run` calls in order: carry, command, timeout_s (the runbook's table)."""
    rel = lambda p: str(p.relative_to(REPO))  # noqa: E731
    calls = []
    for k, name in enumerate(part_names):
        first, last = k == 0, k == len(part_names) - 1
        cmd = PREFIX + "python3 -m training gpu weights --out " + ("/tmp/w && cat /tmp/w/weights.json" if last else "$OUT")
        carry = [rel(WHEELS_DIR), rel(PARTS_DIR / "parts.json"), rel(PARTS_DIR / name)]
        if first and not last:
            cmd += "; " + CHECK_SLOT
            carry.append(rel(GPU_DIR))
        if last:  # weights.json stays out of $OUT (8 files: 3 data + 5 train); the bundled bench prints to stdout
            cmd += (f" && {{ python3 -m training gpu data --out $OUT/data {DATA_ARGS} >/tmp/data.log 2>&1 & {TRAIN}; "
                    f"wait; tail -c 1500 /tmp/data.log; {BUNDLED_SLOT}; }}")
        calls.append({"carry": carry, "command": cmd, "timeout_s": 600 if last else 200 if first else 120})
    return calls


# ------------------------------------------------------------------------------------------ device stages
def base_ready(parts_dir: Path = PARTS_DIR) -> dict:
    """Make the converted base exist on this machine: join the parts and convert, once; a no-op after."""
    from dataclasses import replace

    from engine.runtime import Runtime
    from engine.weights import BUNDLED_CACHE_NAME, bundled_base_dir, cache_dir

    cached = cache_dir() / BUNDLED_CACHE_NAME / "model.safetensors"
    if cached.exists():
        return {"base": "cached", "path": str(cached.parent)}
    manifest = parts_dir / "parts.json"
    have = sorted(p.name for p in parts_dir.glob("*.part*of*")) if parts_dir.exists() else []
    if not manifest.exists() or len(have) < len(weights.PartSet.read(manifest).parts):
        total = len(weights.PartSet.read(manifest).parts) if manifest.exists() else "?"
        return {"base": "waiting for parts", "have": have, "parts": total}
    t0 = time.perf_counter()
    gguf = weights.join(parts_dir, expect_sha256=weights.GGUF_SHA256)
    t1 = time.perf_counter()
    path = bundled_base_dir(replace(Runtime.from_env(), gguf=gguf))  # converted once: later loads read the cache
    return {"base": "converted", "path": str(path), "join_s": round(t1 - t0, 1),
            "convert_s": round(time.perf_counter() - t1, 1)}


def require_base(parts_dir: Path = PARTS_DIR) -> None:
    st = base_ready(parts_dir)
    if st["base"] == "waiting for parts":
        raise RuntimeError(f"weights: this machine has {len(st['have'])} of {st['parts']} GGUF parts and no converted "
                           "base: it was restarted or a part was not carried. Carry every part again "
                           "(training/README.md, 'If the machine vanishes').")


def device_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0),
                 "gpu_mem_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    return info


def fingerprint(base_dir: Path) -> dict:
    """Token ids of a fixed chat prompt and the fp32 CPU argmax after each: catches a GGUF conversion or
    tokenizer that differs on the device's transformers version before any GPU minute goes into it."""
    from engine.weights import build_model, load_tokenizer

    tok = load_tokenizer(base_dir, add_mask_token=False)
    text = tok.apply_chat_template([{"role": "user", "content": FINGERPRINT_PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    ids = list(tok.encode(text, add_special_tokens=False))
    model = build_model(base_dir, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], causal=True)
    return {"prompt_ids": ids, "argmax": logits[0].argmax(-1).tolist()}


def stage_weights(out: Path, parts_dir: Path = PARTS_DIR) -> dict:
    """Report (to $OUT/weights.json) which parts are here; once all are, join, convert and check the base.

    A fingerprint that differs from this repo's fails the command (after the report), so `&&` keeps data
    generation and training off a base that is not the one the repo was built with."""
    rep = {"device": device_info(), **base_ready(parts_dir)}
    if rep["base"] != "waiting for parts":
        want = json.loads(FINGERPRINT_FILE.read_text())
        got = fingerprint(Path(rep["path"]))
        rep["fingerprint_matches"] = got == want
        if got != want:
            rep["fingerprint"] = got
    out.mkdir(parents=True, exist_ok=True)
    (out / "weights.json").write_text(json.dumps(rep, indent=1))
    if rep.get("fingerprint_matches") is False:
        raise RuntimeError(f"weights: the converted base differs from {FINGERPRINT_FILE.name} (see $OUT/weights.json)")
    return rep


def stage_data(out: Path, cfg, parts_dir: Path = PARTS_DIR, seed_from: Path | None = None) -> dict:
    """Self-instruct data (resumable), then to $OUT: the manifest, the Magpie rounds and the shards not sent
    yet, merged into packs (each a valid shard) as far as the file limits allow; the rest go next time.

    `seed_from` (the repo's committed shards): copied in first and counted as sent, so their prompts are not
    answered again and only new answers come back."""
    from .selfinstruct import run
    from .shards import shard_paths

    require_base(parts_dir)
    sent_file = cfg.out / "sent.json"  # shards already handed back by an earlier command on this machine
    sent = set(json.loads(sent_file.read_text())) if sent_file.exists() else set()
    if seed_from is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        for p in shard_paths(seed_from):
            if not (cfg.out / p.name).exists():
                shutil.copy2(p, cfg.out / p.name)
            sent.add(p.name)
        sent_file.write_text(json.dumps(sorted(sent)))
    manifest = run(cfg)
    stage = cfg.out / ".out"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    files = [cfg.out / "manifest.json"]
    if (cfg.out / "magpie.jsonl").exists():
        with gzip.open(stage / "magpie.jsonl.gz", "wb") as g:
            g.write((cfg.out / "magpie.jsonl").read_bytes())
        files.append(stage / "magpie.jsonl.gz")
    present = [f for f in out.rglob("*") if f.is_file()] if out.exists() else []
    room_files = OUT_FILES - len(present) - len(files)
    room_bytes = OUT_BYTES - sum(f.stat().st_size for f in present + files) - MIB
    packs, group, size, held = [], [], 0, []
    for p in (p for p in shard_paths(cfg.out) if p.name not in sent):
        b = p.stat().st_size
        if group and size + b > SPLIT_BYTES:  # close this pack
            packs.append(_pack(group, stage))
            room_files, room_bytes = room_files - 1, room_bytes - size
            group, size = [], 0
        if room_files < 1 or room_bytes < size + b:
            held.append(p.name)
            continue
        group.append(p)
        size += b
    if group:
        packs.append(_pack(group, stage))
    col = collect(files + packs, out)
    sent |= {p.name for p in shard_paths(cfg.out)} - set(held)
    sent_file.write_text(json.dumps(sorted(sent)))
    shutil.rmtree(stage, ignore_errors=True)
    return {"examples": manifest["examples"], "answer_tokens": manifest["answer_tokens"],
            "run": manifest["runs"][-1], "out": col.files, "shards_held_back": held}


def _pack(group: list[Path], stage: Path) -> Path:
    from .shards import Shard

    shard = Shard.concat([Shard.load(p) for p in group])
    # named by content: packs from different commands (or machines) never overwrite each other here
    digest = hashlib.blake2b(shard.keys.tobytes(), digest_size=6).hexdigest()
    path = stage / f"shard-{digest}.npz"
    shard.save(path)
    return path


def slim_checkpoint(ckpt: Path, dest: Path) -> Path:
    """The checkpoint without optimiser/RNG state, trainable tensors in fp16: `export --checkpoint` and
    `train --init-from` both read it, so a lost machine costs only the optimiser's momentum."""
    sd = torch.load(ckpt, map_location="cpu", weights_only=False)
    slim = {k: v for k, v in sd.items() if k not in ("optimizer", "scheduler", "rng")}
    slim["trainable"] = {n: t.detach().to(torch.float16) for n, t in sd["trainable"].items()}
    torch.save(slim, dest)
    return dest


def rates(steps: list[dict]) -> dict:
    """Tokens per training second over a command's log records (the first step's time is its baseline)."""
    secs = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"] if len(steps) > 1 else 0.0
    # a trainer that logs answer tokens apart from loss tokens is read as such; else every loss token is one
    answer = "answer_tokens" if steps and all("answer_tokens" in r for r in steps) else "loss_tokens"
    names = {"answer_tokens_per_s": answer, "sequence_tokens_per_s": "seq_tokens", "model_tokens_per_s": "forward_tokens"}
    return {k: round(sum(r.get(key, 0) for r in steps[1:]) / secs, 1) if secs > 0 else None for k, key in names.items()}


def stage_train(out: Path, cfg: TrainConfig, parts_dir: Path = PARTS_DIR) -> dict:
    """`run.train(cfg)` for cfg.minutes (it resumes from cfg.run), then a slim checkpoint + log to $OUT."""
    from .run import train
    from .train import latest_checkpoint

    require_base(parts_dir)
    run = cfg.run
    log = run / "log.jsonl"
    lines_before = len(log.read_text().splitlines()) if log.exists() else 0
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in log.read_text().splitlines()[lines_before:]]
    steps = [r for r in recs if "loss" in r]
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise RuntimeError(f"train: no checkpoint in {run} after training")
    last = steps[-1] if steps else {}
    # the peak the next block's plans need (two trainers beside the data generator, bigger batches)
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None
    summary = {"device": device_info(), "gpu_peak_memory_gib": peak, "steps_this_command": len(steps),
               "step": last.get("step"),
               "loss_last": last.get("loss"), "tokens_seen": last.get("tokens_seen"), **rates(steps),
               "wall_s": round(wall, 1), "checkpoint": ckpt.name}
    stage = run / ".out"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    (stage / "train.json").write_text(json.dumps(summary, indent=1))
    with tarfile.open(stage / LOGS_TAR, "w") as tar:
        for f in (log, stage / "train.json"):
            tar.add(f, arcname=f.name)
    col = collect([slim_checkpoint(ckpt, stage / SLIM), stage / LOGS_TAR], out)
    shutil.rmtree(stage, ignore_errors=True)
    return {**summary, "out": col.files}
