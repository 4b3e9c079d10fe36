"""Long-answer measures (bench/longform.py, issue 21): the checkable-set grader on hand-written answers, the set's
validation, and `bench quality --long-only` on the real bundled model with tiny limits, every measure recomputed
from the outputs the JSON records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.longform import CHECKABLE_SET, EXTRA_MENTIONS, grade, load_checkable, mentions, spread
from engine.finish import judge
from training.data_prompts import normalise_prompt

ROOT = Path(__file__).resolve().parent.parent
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
BUTTERFLY = [["egg", "eggs"], ["caterpillar", "larva"], ["chrysalis", "pupa", "cocoon"], ["adult", "butterfly"]]


# ---------------------------------------------------------------------------------------------- grader

@pytest.mark.parametrize("text", [
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday",
    "Here are the days of the week in order:\n1. Monday\n2. Tuesday\n3. Wednesday\n4. Thursday\n5. Friday\n"
    "6. Saturday\n7. Sunday",
    "The week starts on Monday: monday, TUESDAY, wednesday, thursday, friday, saturday, sunday.",  # 1 restated
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Saturday and Sunday are the weekend.",
])
def test_list_right_when_complete_in_order_and_stopped(text):
    g = grade(text, "stop_token", DAYS)
    assert g.in_order and g.found == 7 and g.extra_mentions <= EXTRA_MENTIONS and g.right


@pytest.mark.parametrize("text,why", [
    ("Monday, Tuesday,, Wednesday, Friday,, Thursday,,, Sunday, Saturday", "out of order"),
    ("Monday, Tuesday, Wednesday, Thursday, Friday, Sunday", "an element missing"),
    ("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Sunday, Sunday, Sunday", "repeated after"),
    ("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday, Wednesday", "second pass"),
    ("Mondays, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday", "not a whole word"),
])
def test_list_wrong_answers(text, why):
    assert not grade(text, "stop_token", DAYS).right, why


def test_list_right_needs_the_stop_token_and_no_loop():
    days = ", ".join(DAYS)
    assert grade(days, "stop_token", DAYS).right
    capped = grade(days, "max_new_tokens", DAYS)
    assert capped.in_order and not capped.right  # all there, but it never ended
    loop = days + ". " + "I hope this helps, I hope this helps, " * 10  # in order, no day repeated, but a loop
    g = grade(loop, "stop_token", DAYS)
    assert g.in_order and g.extra_mentions == 0 and g.finish.looping and not g.right


def test_extra_mentions_boundary():
    days = ", ".join(DAYS)
    assert grade(f"From Monday to Sunday: {days}", "stop_token", DAYS).right  # EXTRA_MENTIONS (2) outside: right
    assert not grade(f"From Monday to Sunday: {days}, Sunday", "stop_token", DAYS).right  # 3: wrong


def test_numbers_match_whole_numbers_in_any_list_layout():
    seq = [str(i) for i in range(1, 11)]
    for text in ("1,2,3,4,5,6,7,8,9,10", "1 2 3 4 5 6 7 8 9 10", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10."):
        assert grade(text, "stop_token", seq).right, text
    assert mentions("10, 1.5, 21, 1", [("1",), ("10",)]) == [1, 0]  # not inside 1.5, 21 or 10
    # the AR base's own layout of "Count from 1 to 20": line-opening list markers are not mentions
    assert grade("\n".join(f"{i}. {i}" for i in range(1, 11)), "stop_token", seq).right
    assert grade("\n".join(f"{i}) {2 * i}" for i in range(1, 11)), "stop_token", [str(2 * i) for i in range(1, 11)]).right
    assert grade("\n".join(f"{i}." for i in range(1, 11)), "stop_token", seq).right  # a line "10." is the number
    assert not grade("1, 2, 3, 4, 5, 6, 7, 8, 9, 100", "stop_token", seq).right


@pytest.mark.parametrize("text,seq,why", [
    (", ".join(str(i) for i in range(1, 21)), [str(i) for i in range(1, 16)], "counts on past 15"),
    ("September, October, November, February, December", ["September", "October", "November", "December"],
     "a month that is no element, inside the run"),
    (", ".join(DAYS), DAYS[:4], "the whole week for Monday to Thursday"),
    ("2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26", [str(i) for i in range(2, 21, 2)],
     "even numbers on past 20 (3 more than EXTRA_MENTIONS allows)"),
    ("Jupiter, Saturn, Pluto, Uranus, Neptune", ["Jupiter", "Saturn", "Uranus", "Neptune"], "Pluto inside the run"),
    ("one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen", "one two three four five "
     "six seven eight nine ten".split(), "number words on past ten"),
])
def test_list_wrong_when_it_says_more_of_the_same_kind(text, seq, why):
    """bench/data/checkable_kinds.json: a closed kind's other words are mentions of no element."""
    g = grade(text, "stop_token", seq)
    assert not g.right, why
    assert not grade(text.replace(", ", " ").replace(",", " "), "stop_token", seq).right, why


def test_kind_words_leave_restatements_and_other_kinds_alone():
    mon_thu = DAYS[:4]
    assert grade("From Monday to Thursday: Monday, Tuesday, Wednesday, Thursday.", "stop_token", mon_thu).right
    assert grade("Monday, Tuesday, Wednesday, Thursday. Then Friday.", "stop_token", mon_thu).right  # 1 extra
    assert not grade("Monday, Tuesday, Wednesday, Thursday. Then Friday and Saturday and Sunday.", "stop_token",
                     mon_thu).right
    seq = [str(i) for i in range(10, 101, 10)]
    assert grade("Counting by tens: 10, 20, 30, 40, 50, 60, 70, 80, 90, 100. That is ten numbers.", "stop_token",
                 seq).right  # "ten" is a number word, not a number: another kind
    assert mentions("100, 10", [("10",)], [__import__("grading.checker").checker.WHOLE_NUMBER]) == [-1, 0]
    assert grade("1. Monday\n2. Tuesday\n3. Wednesday\n4. Thursday", "stop_token", mon_thu).right  # markers


def test_arithmetic_steps_must_end_at_the_result():
    seq = ["6", "10", "20"]
    ok = "Start with 3. Double it: 3 x 2 = 6. Add 4: 6 + 4 = 10. Multiply by 2: 10 x 2 = 20. The result is 20."
    assert grade(ok, "stop_token", seq, "steps").right
    wandering = "1. 3 x 2 = 6\n2. 6 + 4 = 10\n3. 10 x 2 = 20\n4. 20 x 2 = 40\n5. 40 + 4 = 44"
    g = grade(wandering, "stop_token", seq, "steps")
    assert g.found == 3 and not g.right  # the right results pass by on the way, but it ends at 44
    # stages of a life cycle are no closed kind: the last word said is free
    assert grade("Egg, caterpillar, chrysalis, adult butterfly. Then the adult lays an egg.", "stop_token",
                 BUTTERFLY, "steps").right


def test_every_list_item_of_the_sets_has_a_closed_kind():
    from bench.longform import _element, kinds_of
    for path in (CHECKABLE_SET, CHECKABLE_SET.with_name("long_checkable_b.jsonl")):
        for it in load_checkable(path):
            if it.get("match", "list") == "list":
                assert len(kinds_of([_element(v) for v in it["sequence"]])) == 1, it["id"]


def test_steps_allow_repeats_but_need_the_order():
    ok = ("A butterfly starts as an egg on a leaf. The egg hatches into a caterpillar (a larva) that eats leaves, "
          "then it forms a chrysalis. Inside the pupa it changes, and an adult butterfly comes out.")
    assert grade(ok, "stop_token", BUTTERFLY, "steps").right
    assert not grade(ok, "stop_token", BUTTERFLY).right  # the list rule would refuse the repeats
    wrong = "A caterpillar hatches, makes a chrysalis, and the adult lays an egg."
    assert grade(wrong, "stop_token", BUTTERFLY, "steps").found == 1
    assert not grade(wrong, "stop_token", BUTTERFLY, "steps").right
    with pytest.raises(ValueError, match="match must be one of"):
        grade(ok, "stop_token", BUTTERFLY, "bag")


# ---------------------------------------------------------------------------------------------- the set

@pytest.mark.parametrize("path", [CHECKABLE_SET, CHECKABLE_SET.with_name("long_checkable_b.jsonl")],
                         ids=["checkable", "checkable_b"])
def test_shipped_set_loads_and_its_model_answers_are_right(path):
    items = load_checkable(path)
    assert 32 <= len(items) <= 40 and len({it["category"] for it in items}) >= 8
    for it in items:  # a perfect answer, written from the sequence itself, must grade right; a capped one not
        first = [e if isinstance(e, str) else e[0] for e in it["sequence"]]
        perfect = "Here you go:\n" + ", ".join(first) + "."
        assert grade(perfect, "stop_token", it["sequence"], it.get("match", "list")).right, it["id"]
        assert not grade(perfect, "max_new_tokens", it["sequence"], it.get("match", "list")).right, it["id"]
        assert not judge(perfect, "stop_token").looping
    others = {"eval_short.jsonl", "long_answer.jsonl", "long_checkable.jsonl", "long_checkable_b.jsonl"} - {path.name}
    prompts = {normalise_prompt(json.loads(line)["prompt"]) for f in sorted(others)
               for line in (ROOT / "bench" / "data" / f).read_text().splitlines() if line.strip()}
    assert not prompts & {normalise_prompt(it["prompt"]) for it in items}  # not a copy of the other sets' prompts


@pytest.mark.parametrize("record,error", [
    ({"id": "a", "category": "c", "prompt": "p"}, "'sequence' must be a list of at least 2"),
    ({"id": "a", "category": "c", "prompt": "p", "sequence": ["x"]}, "at least 2"),
    ({"id": "a", "category": "c", "prompt": "p", "sequence": ["x", "X"]}, "names 'x' twice"),
    ({"id": "a", "category": "c", "prompt": "p", "sequence": ["x", ["y", ""]]}, "element \\['y', ''\\]"),
    ({"id": "a", "category": "c", "prompt": "p", "sequence": ["x", "..."]}, "has no letter or digit"),
    ({"id": "a", "category": "c", "prompt": "p", "sequence": ["x", "y"], "match": "set"}, "'match' must be one of"),
    ({"id": "a", "category": "c", "prompt": "p", "sequnce": ["x", "y"]}, "unknown field\\(s\\) \\['sequnce'\\]"),
    ({"id": "a", "category": "c", "prompt": " ", "sequence": ["x", "y"]}, "'prompt' must be a non-empty string"),
    ({"category": "c", "prompt": "p", "sequence": ["x", "y"]}, "'id' must be a non-empty string"),
])
def test_bad_records_are_refused_naming_line_and_field(tmp_path, record, error):
    good = {"id": "ok", "category": "c", "prompt": "Count.", "sequence": ["1", "2"]}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"set.jsonl: line 2: .*{error}"):
        load_checkable(path)


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    rec = json.dumps({"id": "a", "category": "c", "prompt": "p", "sequence": ["1", "2"]}) + "\n"
    (tmp_path / "dup.jsonl").write_text(rec + "\n" + rec)
    with pytest.raises(ValueError, match="line 3: duplicate id 'a' \\(first on line 1\\)"):
        load_checkable(tmp_path / "dup.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no items"):
        load_checkable(tmp_path / "empty.jsonl")


def test_spread_takes_categories_in_turn():
    items = [{"id": f"{c}{i}", "category": c} for c in "abc" for i in range(3)]
    assert [it["id"] for it in spread(items, 5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert spread(items, None) == items and spread(items, 99) == items


# ---------------------------------------------------------------------------------------------- the CLI, real model

def _tpf(outs):
    nfe = sum(o["nfe"] for o in outs)
    return sum(o["answer_tokens"] for o in outs) / nfe if nfe else None


def test_quality_long_only_measures_every_mode_from_its_outputs(tmp_path, capsys):
    """--long-only on the bundled model with --adapter (the shipped file, given explicitly): AR and diffusion in
    the same JSON; each rate equals the count of its outputs; complete-only tokens per forward only over complete
    outputs; the checkable grade equals the grader's on the recorded text."""
    from bench.__main__ import main
    from engine.weights import BUNDLED_ADAPTER

    if not BUNDLED_ADAPTER.exists():
        pytest.skip("needs the bundled adapter in assets/")
    long_set = tmp_path / "long.jsonl"  # one answer that stops in a few tokens, one that cannot within the cap
    long_set.write_text("".join(json.dumps(x) + "\n" for x in [
        {"id": "hi", "category": "a", "prompt": "What is the capital of France?"},
        {"id": "essay", "category": "b", "prompt": "Write a long essay about the history of Rome."},
        {"id": "unused", "category": "a", "prompt": "Unused: the limit keeps two, one per category."}]))
    checkable = tmp_path / "chk.jsonl"
    checkable.write_text("".join(json.dumps(x) + "\n" for x in load_checkable(CHECKABLE_SET)[:2]))
    out = tmp_path / "q"
    assert main(["quality", "--long-only", "--long-set", str(long_set), "--long-limit", "2",
                 "--checkable-set", str(checkable), "--max-new-tokens", "16", "--thresholds", "0.9",
                 "--threads", "1", "--adapter", str(BUNDLED_ADAPTER), "--json", "--quiet", "--no-png",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    public = json.loads(lines[0])["results"]
    report = json.loads((out / "results.json").read_text())
    assert report["eval_set"] is None and report["long_sets"]["max_new_tokens"] == 16
    assert report["environment"]["adapter"] == str(BUNDLED_ADAPTER)
    assert [(r["mode"], r["threshold"]) for r in report["results"]] == [("ar", None), ("diffusion", 0.9)]
    stopped_any = discriminating = False
    for r, pub in zip(report["results"], public):
        assert "accuracy" not in r  # no short set
        for prefix, n in (("long", 2), ("checkable", 2)):
            outs = r[f"{prefix}_outputs"]
            assert r[f"{prefix}_n"] == len(outs) == n
            assert [o["id"] for o in outs][:1] == (["hi"] if prefix == "long" else ["days-01"])
            stop = [o for o in outs if o["stop_reason"] == "stop_token"]
            stopped_any |= bool(stop)
            assert r[f"{prefix}_stop_rate"] == len(stop) / n
            assert r[f"{prefix}_loop_rate"] == sum(judge(o["output"], o["stop_reason"]).looping for o in outs) / n
            assert r[f"{prefix}_mean_answer_tokens"] == sum(o["answer_tokens"] for o in outs) / n
            assert all(o["answer_tokens"] <= 16 for o in outs)
            assert r[f"{prefix}_tokens_per_forward"] == pytest.approx(_tpf(outs))
            complete = [o for o in outs if judge(o["output"], o["stop_reason"]).complete]
            assert r[f"{prefix}_complete_n"] == len(complete)
            assert r[f"{prefix}_complete_tokens_per_forward"] == (pytest.approx(_tpf(complete)) if complete else None)
            discriminating |= bool(complete) and _tpf(complete) != pytest.approx(_tpf(outs))
            assert pub[f"{prefix}_stop_rate"] == r[f"{prefix}_stop_rate"]
            if r["mode"] == "ar":
                assert all(o["nfe"] == o["answer_tokens"] for o in outs)  # one token per forward
        for o, item in zip(r["checkable_outputs"], load_checkable(checkable)):
            assert o["right"] == grade(o["output"], o["stop_reason"], item["sequence"]).right
        assert r["checkable_right"] == sum(o["right"] for o in r["checkable_outputs"])
    assert stopped_any  # the capital of France ends within 16 tokens for the AR base: the complete-only path is exercised
    # the shipped dLLM answers it in 8 tokens and 6 forwards, the essay 16 in 16: complete-only and all differ, so
    # the check above would see complete-only computed over every answer
    assert discriminating, "no setting had complete answers with tokens per forward unlike the rest: pick other prompts"
    assert (out / "long.html").exists() and not (out / "quality.html").exists()
    # bench regrade on this run: under the same rule nothing changes
    assert main(["regrade", str(out / "results.json"), "--out", str(tmp_path / "rg.json")]) == 0
    rows = json.loads((tmp_path / "rg.json").read_text())["rows"]
    assert [(row["mode"], row["right"], row["changed"]) for row in rows] == \
        [(r["mode"], r["checkable_right"], []) for r in report["results"]]
    # bench compare on this run: the dLLM's row against the AR base's, each total the one the run recorded
    capsys.readouterr()
    assert main(["compare", str(out / "results.json"), str(out / "results.json"), "--a-row", "diffusion@0.9",
                 "--b-row", "ar", "--out", str(tmp_path / "cmp.json")]) == 0
    sets = {s["set"]: s for s in json.loads((tmp_path / "cmp.json").read_text())["sets"]}
    ar, diff = report["results"]
    assert sets["long"]["a"] == diff["long_complete_n"] and sets["long"]["b"] == ar["long_complete_n"]
    assert sets["checkable"]["a"] == diff["checkable_right"] and sets["checkable"]["b"] == ar["checkable_right"]
    assert sets["long"]["a_tokens_per_forward"] == diff["long_complete_tokens_per_forward"]
    assert "| long | complete | 2 |" in capsys.readouterr().out


def test_regrade_finds_answers_the_old_rule_called_right(tmp_path, capsys):
    """A stored answer graded right by the rule before closed kinds (the whole week for Monday to Thursday, a
    month inserted, counting on) is wrong when regraded; a right one stays right; the file is not rewritten."""
    from bench.__main__ import main

    items = {it["id"]: it for it in load_checkable(CHECKABLE_SET)}
    answers = {"days-03": ("Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday", False),  # whole week
               "months-02": ("March, April, May, October, June, July, August", False),  # a month inside the run
               "count-03": (", ".join(str(i) for i in range(1, 21)), False),  # 1-10, counted on to 20
               "days-01": (", ".join(DAYS), True)}
    outs = [{"id": i, "output": text, "stop_reason": "stop_token", "right": True, "in_order": True}
            for i, (text, _) in answers.items()]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"kind": "quality", "args": {"checkable_set": str(CHECKABLE_SET)}, "results": [
        {"mode": "diffusion", "threshold": 0.9, "checkable_outputs": outs, "checkable_right": 4,
         "checkable_in_order_rate": 1.0}]}))
    before = results.read_text()
    assert main(["regrade", str(results), "--out", str(tmp_path / "rg.json")]) == 0
    row, = json.loads((tmp_path / "rg.json").read_text())["rows"]
    assert (row["right_before"], row["right"]) == (4, 1)
    assert {c["id"] for c in row["changed"]} == {i for i, (_, ok) in answers.items() if not ok}
    assert all(grade(answers[c["id"]][0], "stop_token", items[c["id"]]["sequence"]).right is False
               for c in row["changed"])
    assert "| 4/4 | 1/4 |" in capsys.readouterr().out and results.read_text() == before
    with pytest.raises(SystemExit, match="regrade: .*not a `bench quality` results file"):
        main(["regrade", str(tmp_path / "rg.json")])


def test_quality_options_are_checked_before_loading(tmp_path, capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit, match="--adapter: no adapter file at .*missing.safetensors"):
        main(["quality", "--long-only", "--adapter", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--checkable-limit must be >= 1"):
        main(["quality", "--checkable-limit", "0", "--out", str(tmp_path)])
