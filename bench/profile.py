"""Where a decode's time goes: model forward (attention, MLP, LM head, the rest) vs the decoder's own work.

On the bundled model's 4-bit CPU path, narrow forwards run each layer as one C++ call (engine/weights/csrc/layer.cpp):
that time is reported as 'layer steps' (attention and MLP together); FASTDLLM_FUSED=0 splits it again.

Forward hooks time each part with perf_counter (exact on CPU, where kernels run synchronously; on GPU
pass --sync to synchronise at each hook, which slows the run but keeps the split honest). The rest of
the engine time (sampling, commit bookkeeping, Python between forwards) is 'decoder overhead'.
--torch-profiler adds torch.profiler's table of the top operators by self CPU time.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from .common import DEFAULT_PROMPTS, NEVER_STOP, load_engine, load_prompts, setup_torch, table, write_json


class Timers:
    def __init__(self, sync: bool):
        self.sync = sync
        self.total: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.widths: Counter[int] = Counter()
        self._t: dict[int, float] = {}
        self.handles: list[Any] = []

    def _now(self) -> float:
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def attach(self, module: torch.nn.Module, name: str, widths: bool = False) -> None:
        def pre(mod, args):
            if widths:
                self.widths[int(args[0].shape[1])] += 1
            self._t[id(mod)] = self._now()

        def post(mod, args, out):
            self.total[name] += self._now() - self._t.pop(id(mod))
            self.calls[name] += 1

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()


class TimedStep:
    """A model's one-call layer steps (engine/weights/layer_step.py LayerSteps: every layer in one kernel call) with a
    timer: attention and MLP of all layers in one number."""

    def __init__(self, step: Any, tm: Timers):
        self.step, self.tm, self.max_width = step, tm, step.max_width

    def __call__(self, *args: Any) -> Any:
        t = self.tm._now()
        out = self.step(*args)
        self.tm.total["layer_steps"] += self.tm._now() - t
        return out


def breakdown(eng, ids: list[list[int]], cfg, sync: bool) -> dict[str, Any]:
    model = eng.lm.dllm if cfg.mode == "diffusion" else eng.lm.base
    tm = Timers(sync)
    tm.attach(model, "forward", widths=True)
    tm.attach(model.lm_head, "lm_head")
    for layer in model.model.layers:
        tm.attach(layer.self_attn, "attention")
        tm.attach(layer.mlp, "mlp")
    steps = model.steps
    if steps is not None:
        model.steps = TimedStep(steps, tm)
    try:
        res = eng.generate_ids(ids, cfg, record=False)
    finally:
        tm.detach()
        model.steps = steps
    s = res[0].summary
    engine = max(r.summary.seconds for r in res)
    fwd = tm.total["forward"]
    parts = {"attention": tm.total["attention"], "mlp": tm.total["mlp"], "layer_steps": tm.total["layer_steps"],
             "lm_head": tm.total["lm_head"]}
    parts["forward_other"] = fwd - sum(parts.values())  # embedding, RoPE, norms, residual adds, Python between layers
    parts["decoder_overhead"] = engine - fwd
    return {"mode": cfg.mode, "cache": cfg.cache if cfg.mode == "diffusion" else None,
            "answer_tokens": sum(r.summary.answer_tokens for r in res), "nfe": s.nfe, "forwards": tm.calls["forward"],
            "engine_seconds": engine, "forward_seconds": fwd,
            "ms_per_forward": 1000 * fwd / max(tm.calls["forward"], 1),
            "parts_seconds": parts, "parts_share": {k: v / engine for k, v in parts.items()},
            "forward_widths": dict(sorted(tm.widths.items()))}


def op_table(eng, ids, cfg, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.lm.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        eng.generate_ids(ids, cfg, record=False)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="split one decode's engine time into forward parts and decoder overhead",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default=None)
    p.add_argument("--prompt-index", type=int, default=0)
    p.add_argument("--modes", default="ar,diffusion")
    p.add_argument("--cache", default="dual", help="comma list for diffusion")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sync", action="store_true", help="cuda.synchronize at every hook (GPU only)")
    p.add_argument("--torch-profiler", type=int, default=0, metavar="ROWS", help="also print the top ROWS operators")
    p.add_argument("--out", default=None, help="write the breakdown as JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    setup_torch(args.threads)
    eng = load_engine(args.model, args.dtype, args.device)
    prompt = load_prompts(args.prompts or DEFAULT_PROMPTS)[args.prompt_index]
    ids = [eng.encode(eng.chat_prompt([{"role": "user", "content": prompt}]))]
    stop = {"stop_token_ids": (NEVER_STOP,)} if args.ignore_eos else {}
    cfgs = []
    for mode in args.modes.split(","):
        if mode == "ar":
            cfgs.append(eng.decode_config(mode="ar", max_new_tokens=args.max_new_tokens, **stop))
        else:
            cfgs += [eng.decode_config(mode="diffusion", cache=c, threshold=args.threshold,
                                       max_new_tokens=args.max_new_tokens, **stop) for c in args.cache.split(",")]
    warm = [eng.decode_config(**{**c.to_dict(), "max_new_tokens": min(16, args.max_new_tokens),
                                 "stop_token_ids": tuple(c.stop_token_ids)}) for c in cfgs]
    for c in warm:
        eng.generate_ids(ids, c, record=False)
    out = [breakdown(eng, ids, c, args.sync) for c in cfgs]
    rows = []
    for b in out:
        r = {"setting": b["mode"] + (f"/{b['cache']}" if b["cache"] else ""), "tokens": b["answer_tokens"],
             "forwards": b["forwards"], "engine_s": b["engine_seconds"], "ms_fwd": b["ms_per_forward"]}
        r.update({k: f"{100 * v:.1f}%" for k, v in b["parts_share"].items()})
        rows.append(r)
    cols = [("setting", "setting"), ("tokens", "tokens"), ("forwards", "forwards"), ("engine_s", "engine s"),
            ("ms_fwd", "ms/forward"), ("attention", "attention"), ("mlp", "MLP"), ("layer_steps", "layer steps"),
            ("lm_head", "LM head"),
            ("forward_other", "fwd other"), ("decoder_overhead", "decoder")]
    print(f"{eng.lm.banner()} · threads {torch.get_num_threads()} · prompt {len(ids[0])} tokens")
    print(table(rows, cols))
    for b in out:
        print(f"{b['mode']}{'/' + b['cache'] if b['cache'] else ''} forward widths (tokens: count): {b['forward_widths']}")
    if args.torch_profiler:
        for c in cfgs:
            print(f"\n== torch.profiler: {c.mode} {c.cache if c.mode == 'diffusion' else ''}")
            print(op_table(eng, ids, c, args.torch_profiler))
    if args.out:
        write_json(Path(args.out), {"banner": eng.lm.banner(), "threads": torch.get_num_threads(), "results": out})
    return 0
