"""python -m bench regrade RESULTS.json ...: grade again, under today's rule, the checkable answers that `bench quality`
runs stored, without decoding anything.

The grading rule changed once (2026-11-28: a closed kind's other words are mentions of no element, and an arithmetic
chain must end at its result; bench/longform.py): numbers graded before then are regraded here, so a choice made on
them can be checked on the same answers. Prints a table per file (right before -> after, and which answers changed);
--out writes it all as JSON. The results files themselves are left as they were measured."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import BENCH_DIR
from .longform import grade, load_checkable


def _set_path(recorded: str) -> Path:
    """The checkable set a run used: its recorded path, or the file of that name in bench/data (another checkout)."""
    path = Path(recorded)
    return path if path.is_file() else BENCH_DIR / "data" / path.name


def checkable_items(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The checkable set a `bench quality` run used, by id (ValueError when it recorded none)."""
    recorded = data.get("args", {}).get("checkable_set")
    if not recorded:
        raise ValueError("the run recorded no checkable set")
    return {it["id"]: it for it in load_checkable(_set_path(recorded))}


def regrade_file(path: str | Path) -> list[dict[str, Any]]:
    """One row per (mode, threshold) of a `bench quality` results file with checkable answers (none for a run
    without a checkable set)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("kind") != "quality":
        raise ValueError(f"{path}: not a `bench quality` results file")
    if not data.get("args", {}).get("checkable_set"):
        return []
    items = checkable_items(data)
    rows = []
    for r in data.get("results", []):
        outs = r.get("checkable_outputs")
        if not outs:
            continue
        changed, right, in_order = [], 0, 0
        for o in outs:
            it = items.get(o["id"])
            if it is None:
                raise ValueError(f"{path}: answer {o['id']!r} is not in the checkable set any more")
            g = grade(o["output"], o["stop_reason"], it["sequence"], it.get("match", "list"))
            right += g.right
            in_order += g.in_order
            if g.right != o["right"]:
                changed.append({"id": o["id"], "right_before": o["right"], "right": g.right, "output": o["output"]})
        rows.append({"file": str(path), "mode": r["mode"], "threshold": r.get("threshold"), "n": len(outs),
                     "right_before": r["checkable_right"], "right": right,
                     "in_order_rate_before": r["checkable_in_order_rate"], "in_order_rate": in_order / len(outs),
                     "changed": changed})
    return rows


def main(args: argparse.Namespace) -> int:
    try:
        rows = [row for f in args.results for row in regrade_file(f)]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"regrade: {e}") from None
    print("| file | mode | threshold | right before | right now | changed |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ids = ", ".join(f"{c['id']} ({'now right' if c['right'] else 'now wrong'})" for c in row["changed"])
        print(f"| {row['file']} | {row['mode']} | {row['threshold']} | {row['right_before']}/{row['n']} | "
              f"{row['right']}/{row['n']} | {ids or '-'} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"kind": "regrade", "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("regrade", help="grade stored checkable answers again under today's rule (no decoding)",
                       description=__doc__)
    p.add_argument("results", nargs="+", help="results.json files written by `python -m bench quality`")
    p.add_argument("--out", default=None, help="write the rows (with the changed answers) as JSON here")
    p.set_defaults(func=main)
