"""`python -m bench compare` (bench/compare.py): two quality runs answer by answer, with the exact sign test."""
from __future__ import annotations

import json
from math import comb

import pytest

from bench.compare import compare, pick_row, sign_test
from bench.longform import CHECKABLE_SET, load_checkable

DAYS = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday"


def test_sign_test_is_the_exact_binomial():
    assert sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0
    assert sign_test(0, 6) == pytest.approx(2 / 64) and sign_test(6, 0) == sign_test(0, 6)
    assert sign_test(5, 3) == pytest.approx(2 * sum(comb(8, i) for i in range(4)) / 256)  # 0.727
    assert sign_test(0, 18) < 1e-5 and sign_test(1, 20) < sign_test(2, 20) < 0.05


def _out(i, output, stop="stop_token", tokens=10, nfe=8, **kw):
    return {"id": i, "output": output, "stop_reason": stop, "answer_tokens": tokens, "nfe": nfe, **kw}


def _run(short, long, checkable, mode="diffusion"):
    return {"mode": mode, "threshold": 0.9 if mode == "diffusion" else None, "outputs": short,
            "long_outputs": long, "checkable_outputs": checkable}


def test_compare_pairs_answers_by_id_and_regrades_checkable_ones():
    data = {"kind": "quality", "args": {"checkable_set": str(CHECKABLE_SET)}}
    items = {it["id"]: it for it in load_checkable(CHECKABLE_SET)}
    assert items["days-01"]["sequence"][0] == "Monday" and items["days-03"]["prompt"].startswith("Name the days")
    a = _run([_out(f"s{i}", "x", correct=i < 3) for i in range(5)],
             [_out("l0", "Done."), _out("l1", "More and more and more. " * 30, stop="max_new_tokens", tokens=90, nfe=30)],
             [_out("days-01", DAYS, right=True), _out("days-03", DAYS, right=True)])  # days-03: "the whole week" ...
    b = _run([_out(f"s{i}", "x", correct=i in (0, 4)) for i in range(6)],  # s5 only in B: not paired
             [_out("l0", "Done.", tokens=4, nfe=4), _out("l1", "Done too.")],
             [_out("days-01", "Monday, Tuesday", right=False), _out("days-03", "Wednesday, Thursday, Friday, Saturday",
                                                                  right=True)], mode="ar")
    short, long, chk = compare(data, a, data, b)
    assert (short.n, short.a, short.b, short.only_a, short.only_b) == (5, 3, 2, 2, 1)
    assert short.p_value == pytest.approx(sign_test(2, 1))
    assert (long.a, long.b, long.only_a, long.only_b) == (1, 2, 0, 1)
    assert long.a_tokens_per_forward == pytest.approx(10 / 8)  # over A's complete answers only (l0)
    assert long.b_tokens_per_forward == pytest.approx(14 / 12)
    # ... is wrong under today's rule for "Wednesday to Saturday" although the file says right
    assert (chk.measure, chk.a, chk.b, chk.only_a, chk.only_b) == ("right", 1, 1, 1, 1)


def test_rows_are_named_or_single(tmp_path, capsys):
    from bench.__main__ import main

    two = {"kind": "quality", "results": [{"mode": "ar", "threshold": None}, {"mode": "diffusion", "threshold": 0.9}]}
    assert pick_row(two, "diffusion@0.9", "a")["mode"] == "diffusion" and pick_row(two, "ar", "b")["mode"] == "ar"
    with pytest.raises(ValueError, match=r"--a-row: the file has 2 rows, name one of \['ar', 'diffusion@0.9'\]"):
        pick_row(two, None, "a")
    with pytest.raises(ValueError, match="--b-row 'diffusion@0.7': no row matches"):
        pick_row(two, "diffusion@0.7", "b")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(two))
    with pytest.raises(SystemExit, match="compare: --a-row: the file has 2 rows"):
        main(["compare", str(path), str(path)])
    with pytest.raises(SystemExit, match="compare: the two runs share no set"):
        main(["compare", str(path), str(path), "--a-row", "ar", "--b-row", "diffusion"])
