"""Resident memory of the studio process per weights mode (FASTDLLM_WEIGHTS), each in a fresh process.

A child process loads the default engine with the given weights, builds the studio UI, decodes one AR and one
diffusion answer, and reports VmRSS (now) and VmHWM (peak, load included) from /proc/self/status.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import parse_list, subcommand, table, write_json

_CHILD = """
import json, sys
from bench.common import _proc_status_mb
from engine import Engine
from app.studio import Studio
from app.ui import build
eng = Engine.load()
build(Studio(eng))
for mode in ("ar", "diffusion"):
    eng.generate("Explain how a bicycle works.", eng.decode_config(mode=mode, max_new_tokens=int(sys.argv[1])),
                 record=False)
print(json.dumps({"banner": eng.lm.banner(), "rss_mb": _proc_status_mb("VmRSS"), "peak_rss_mb": _proc_status_mb("VmHWM")}))
"""


def measure(weights: str, max_new_tokens: int, threads: int) -> dict[str, Any]:
    env = {**os.environ, "FASTDLLM_WEIGHTS": weights, "FASTDLLM_THREADS": str(threads)}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(max_new_tokens)], env=env, capture_output=True,
                         text=True, check=True, cwd=root)
    return {"weights": weights, **json.loads(out.stdout.strip().splitlines()[-1])}


def add_parser(sub) -> None:
    p = subcommand(sub, "memory", "studio process RSS (now and peak) per FASTDLLM_WEIGHTS mode", main, threads=1)
    p.add_argument("--weights", default="fp32,int4+bf16", help="comma list of FASTDLLM_WEIGHTS modes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    

def main(args: argparse.Namespace) -> int:
    from engine.weights.quant import WeightPolicy

    modes = parse_list(args.weights)
    for w in modes:
        try:
            WeightPolicy(w)
        except ValueError as exc:
            raise SystemExit(f"--weights: {exc}") from None
    rows = [measure(w, args.max_new_tokens, args.threads) for w in modes]
    print(table(rows, [("weights", "weights"), ("rss_mb", "RSS MB"), ("peak_rss_mb", "peak RSS MB")], nd=0))
    if args.out:
        write_json(Path(args.out) / "memory.json", {"kind": "memory", "doc": __doc__.strip(), "results": rows})
    return 0
