"""python -m bench compare A.json B.json: two `bench quality` runs on the same prompts, answer by answer.

Counts of right answers move by one or two with any change of settings (a summation order, a penalty), so a choice
between two adapters or two settings needs more than two totals. For each set both runs have (short: correct;
long: complete, i.e. stopped and not looping; checkable: right, graded again under today's rule), the answers are
paired by id: how many only A got, only B, both, neither, and the exact two-sided sign test (McNemar's, exact) on the
answers where they differ: the chance of a split at least that uneven if A and B were equally good. Tokens per forward
over complete answers are shown beside it (long and checkable; all answers for short).

A file with several (mode, threshold) rows needs --a-row / --b-row, e.g. `diffusion@0.9` or `ar`; A and B may be two
rows of the same file (the dLLM against its AR base)."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from math import comb
from pathlib import Path
from typing import Any, Callable

from engine.finish import judge

from .longform import grade, tokens_per_forward
from .regrade import checkable_items


@dataclass(frozen=True)
class Paired:
    """One set's answers of A and B, paired by id."""

    set: str
    measure: str
    n: int
    a: int  # right (correct, complete) in A
    b: int
    only_a: int
    only_b: int
    p_value: float  # exact two-sided sign test on the only_a + only_b answers that differ
    a_tokens_per_forward: float | None
    b_tokens_per_forward: float | None


def sign_test(x: int, y: int) -> float:
    """Exact two-sided binomial test of x against y successes at p = 1/2 (McNemar's exact test)."""
    n = x + y
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(x, y) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def pick_row(data: dict[str, Any], spec: str | None, what: str) -> dict[str, Any]:
    """The results row `spec` names (mode, or mode@threshold), or the only one."""
    rows = data.get("results", [])
    names = [r["mode"] if r.get("threshold") is None else f"{r['mode']}@{r['threshold']:g}" for r in rows]
    if spec is None:
        if len(rows) == 1:
            return rows[0]
        raise ValueError(f"--{what}-row: the file has {len(rows)} rows, name one of {names}")
    hits = [r for r, name in zip(rows, names) if spec in (name, r["mode"])]
    if len(hits) != 1:
        raise ValueError(f"--{what}-row {spec!r}: {'no' if not hits else 'more than one'} row matches; rows: {names}")
    return hits[0]


def _complete(o: dict[str, Any]) -> bool:
    return judge(o["output"], o["stop_reason"]).complete


def _verdicts(key: str, data: dict[str, Any], row: dict[str, Any]) -> tuple[str, dict[Any, bool], Callable]:
    """(measure, id -> verdict, which outputs tokens per forward is over) for one set of one row."""
    outs = row[f"{key}_outputs"] if key != "short" else row["outputs"]
    if key == "short":
        return "correct", {o["id"]: bool(o["correct"]) for o in outs}, lambda os: os
    if key == "long":
        return "complete", {o["id"]: _complete(o) for o in outs}, lambda os: [o for o in os if _complete(o)]
    items = checkable_items(data)
    right = {o["id"]: grade(o["output"], o["stop_reason"], items[o["id"]]["sequence"],
                            items[o["id"]].get("match", "list")).right for o in outs}
    return "right", right, lambda os: [o for o in os if _complete(o)]


def compare(a: dict[str, Any], ra: dict[str, Any], b: dict[str, Any], rb: dict[str, Any]) -> list[Paired]:
    """Every set both rows have, paired by id (only the ids both answered)."""
    out = []
    for key in ("short", "long", "checkable"):
        field = "outputs" if key == "short" else f"{key}_outputs"
        if not ra.get(field) or not rb.get(field):
            continue
        measure, va, over = _verdicts(key, a, ra)
        _, vb, _ = _verdicts(key, b, rb)
        ids = [i for i in va if i in vb]
        if not ids:
            continue
        only_a = sum(va[i] and not vb[i] for i in ids)
        only_b = sum(vb[i] and not va[i] for i in ids)
        keep = set(ids)
        oa = [o for o in ra[field] if o["id"] in keep]
        ob = [o for o in rb[field] if o["id"] in keep]
        out.append(Paired(key, measure, len(ids), sum(va[i] for i in ids), sum(vb[i] for i in ids), only_a, only_b,
                          sign_test(only_a, only_b), tokens_per_forward(over(oa)),
                          tokens_per_forward(over(ob))))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(args: argparse.Namespace) -> int:
    try:
        a, b = (json.loads(Path(p).read_text(encoding="utf-8")) for p in (args.a, args.b))
        for path, d in ((args.a, a), (args.b, b)):
            if d.get("kind") != "quality":
                raise ValueError(f"{path}: not a `bench quality` results file")
        ra, rb = pick_row(a, args.a_row, "a"), pick_row(b, args.b_row, "b")
        rows = compare(a, ra, b, rb)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"compare: {e}") from None
    if not rows:
        raise SystemExit("compare: the two runs share no set with answers of the same ids")
    print(f"A = {args.a} [{ra['mode']}]  B = {args.b} [{rb['mode']}]")
    print("| set | measure | n | A | B | only A | only B | sign test p | tok/fwd A | tok/fwd B |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in rows:
        print(f"| {p.set} | {p.measure} | {p.n} | {p.a} | {p.b} | {p.only_a} | {p.only_b} | {p.p_value:.3f} | "
              f"{_fmt(p.a_tokens_per_forward)} | {_fmt(p.b_tokens_per_forward)} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"kind": "compare", "a": args.a, "b": args.b, "a_row": ra["mode"],
                                              "b_row": rb["mode"], "sets": [asdict(p) for p in rows]}, indent=1) + "\n",
                                  encoding="utf-8")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="two quality runs answer by answer, with an exact sign test",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="results.json of `python -m bench quality`")
    p.add_argument("b", help="another (or the same file with another --b-row)")
    p.add_argument("--a-row", default=None, help="mode or mode@threshold of A's row (needed when A has several)")
    p.add_argument("--b-row", default=None, help="the same for B")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.set_defaults(func=main)
