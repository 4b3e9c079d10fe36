"""Deterministic, template-based builder of diverse chat training prompts, deduplicated against the eval sets."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EVAL_FILES: tuple[Path, ...] = (
    REPO_ROOT / "bench" / "data" / "eval_short.jsonl",
    REPO_ROOT / "bench" / "data" / "long_answer.jsonl",
    REPO_ROOT / "bench" / "data" / "long_checkable.jsonl",
)
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_OUT = DATA_DIR / "prompts.jsonl"
_POOL_SEED = 1234  # fixed: the candidate pool never depends on the sampling seed

# --------------------------------------------------------------------------------------
# Vocabularies and templates (hand-written) are data: training/data/prompt_vocabulary.json
# and training/data/prompt_templates.json (their shapes: training/data/README.md). Entities
# used by the short eval set are deliberately left out of the short-answer vocabularies.
# --------------------------------------------------------------------------------------

V = json.loads((DATA_DIR / "prompt_vocabulary.json").read_text(encoding="utf-8"))
T = json.loads((DATA_DIR / "prompt_templates.json").read_text(encoding="utf-8"))
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve"]


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------

def _article(noun_phrase: str) -> str:
    """Return the noun phrase with a/an in front."""
    return ("an " if noun_phrase[0].lower() in "aeiou" else "a ") + noun_phrase


def _third_person(phrase: str) -> str:
    """Conjugate the leading verb of an infinitive phrase to third person singular."""
    verb, _, rest = phrase.partition(" ")
    if verb.endswith(("s", "x", "z", "ch", "sh")):
        verb += "es"
    elif verb.endswith("y") and verb[-2] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}".strip()


def _fill(templates: Sequence[str], rows: Iterable[dict[str, object]]) -> list[str]:
    """Every template filled with every row, row by row (the order the prompt pool is drawn from)."""
    return [t.format(**row) for row in rows for t in templates]


def _unique(prompts: Iterable[str]) -> list[str]:
    """Drop repeated prompts while keeping first-seen order."""
    seen: set[str] = set()
    out: list[str] = []
    for prompt in prompts:
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


def _sample_unique(make: Callable[[random.Random], str], rng: random.Random, count: int) -> list[str]:
    """Draw up to count distinct prompts from a randomised maker (bounded attempts)."""
    out: dict[str, None] = {}
    attempts = 0
    while len(out) < count and attempts < count * 20:
        out[make(rng)] = None
        attempts += 1
    return list(out)


# --------------------------------------------------------------------------------------
# Category generators: each returns a list of prompts (order is deterministic)
# --------------------------------------------------------------------------------------

def _facts_geography(rng: random.Random) -> list[str]:
    """Country and city questions."""
    t = T["facts_geography"]
    return _fill(t["country"], ({"c": c} for c in V["countries"])) + _fill(t["city"], ({"c": c} for c in V["cities"]))


def _facts_nature(rng: random.Random) -> list[str]:
    """Animal questions."""
    return _fill(T["facts_nature"]["animal"], ({"pl": pl, "a": _article(sg)} for sg, pl in V["animals"]))


def _facts_history(rng: random.Random) -> list[str]:
    """Questions about historical people and events."""
    t = T["facts_history"]
    return _fill(t["person"], ({"p": p} for p in V["people"])) + _fill(t["event"], ({"e": e} for e in V["events"]))


def _explanations(rng: random.Random) -> list[str]:
    """Concept explanations and why-questions."""
    t = T["explanation"]
    return (_fill(t["concept"], ({"c": c} for c in V["science_concepts"]))
            + _fill(t["why"], ({"q": q} for q in V["why_questions"])))


def _lists(rng: random.Random) -> list[str]:
    """Requests for short lists of things."""
    t = T["list"]
    return _fill(t["list"], ({"k": k, "x": x} for x in V["list_things"] for k in t["counts"]))


def _arithmetic(rng: random.Random) -> list[str]:
    """Single-step arithmetic questions and word problems."""

    def make(r: random.Random) -> str:
        kind = r.randrange(17)
        a, b = r.randint(13, 99), r.randint(13, 99)
        name, items = r.choice(V["names"]), r.choice(V["count_items"])
        if kind == 0:
            return f"What is {a} + {b}?"
        if kind == 1:
            return f"What is {max(a, b)} - {min(a, b)}?"
        if kind == 2:
            return f"Calculate {r.randint(11, 40)} × {r.randint(3, 12)}."
        if kind == 3:
            d = r.randint(3, 12)
            return f"What is {d * r.randint(11, 40)} divided by {d}?"
        if kind == 4:
            return f"What is {r.choice([5, 10, 15, 20, 25, 50, 75])}% of {20 * r.randint(2, 30)}?"
        if kind == 5:
            return f"Round {r.randint(101, 9999)} to the nearest {r.choice(['ten', 'hundred'])}."
        if kind == 6:
            return f"What is {r.randint(11, 25)} squared?"
        if kind == 7:
            return f"Is {r.randint(20, 200)} a prime number? Explain why or why not."
        if kind == 8:
            return f"{name} has {a} {items}. Then {name} buys {b} more. How many {items} does {name} have now?"
        if kind == 9:
            return (f"{name} had {max(a, b)} {items} and gave {min(a, b)} of them away. "
                    f"How many {items} does {name} have left?")
        if kind == 10:
            return f"A box holds {r.randint(12, 48)} {items}. How many {items} are in {r.randint(3, 15)} boxes?"
        if kind == 11:
            f = r.randint(3, 9)
            return f"{name} shares {f * r.randint(4, 20)} {items} equally among {f} friends. How many does each friend get?"
        if kind == 12:
            return f"There are {r.randint(25, 40)} students in a class and {r.randint(2, 9)} are absent today. How many students are present?"
        if kind == 13:
            return (f"A bus has {a} passengers. At the next stop {r.randint(2, 12)} people get off and "
                    f"{r.randint(2, 12)} get on. How many passengers are on the bus now?")
        if kind == 14:
            return f"What is the sum of {a}, {b} and {r.randint(13, 99)}?"
        if kind == 15:
            return r.choice([f"How many minutes are in {r.randint(2, 12)} hours?",
                             f"How many seconds are in {r.randint(2, 15)} minutes?",
                             f"How many days are in {r.randint(2, 9)} weeks?"])
        return f"Write {r.randint(1, 19)}/{r.choice([2, 4, 5, 8, 10, 20, 25])} as a decimal."

    return _sample_unique(make, rng, 900)


def _multistep_math(rng: random.Random) -> list[str]:
    """Multi-step word problems that ask for working."""
    steps = T["multistep_math"]["steps"]

    def make(r: random.Random) -> str:
        kind = r.randrange(14)
        name = r.choice(V["names"])
        tail = r.choice(steps)
        if kind == 0:
            (i1, p1), (i2, p2) = r.sample(V["shop_items"], 2)
            return (f"A shop sells {i1} for {p1} dollars each and {i2} for {p2} dollars each. {name} buys "
                    f"{r.randint(2, 9)} {i1} and {r.randint(2, 9)} {i2}. How much does {name} spend in total? {tail}")
        if kind == 1:
            per = r.randint(12, 40)
            return f"{name} reads {per} pages a day. A book has {per * r.randint(5, 20) + r.randint(0, per - 1)} pages. How many days does it take to finish it? {tail}"
        if kind == 2:
            return (f"A car drives at {r.choice([40, 50, 70, 90, 110])} km per hour for {r.randint(2, 6)} hours, then drives "
                    f"{r.randint(15, 95)} km more. What is the total distance? {tail}")
        if kind == 3:
            c = r.randint(2, 4)
            base = r.choice([12, 16, 20, 24])
            return f"A recipe needs {c} cups of flour for {base} cookies. How much flour is needed for {base * r.randint(2, 5)} cookies? {tail}"
        if kind == 4:
            return (f"{name} earns {r.randint(11, 30)} dollars per hour and works {r.randint(3, 8)} hours a day for "
                    f"{r.randint(3, 6)} days. How much does {name} earn in total? {tail}")
        if kind == 5:
            return (f"The temperature was {r.randint(-5, 15)} degrees in the morning, rose by {r.randint(3, 12)} degrees "
                    f"by noon and then fell by {r.randint(2, 14)} degrees by night. What was the temperature at night? {tail}")
        if kind == 6:
            return (f"A garden is {r.randint(6, 30)} meters long and {r.randint(4, 20)} meters wide. What is its area? "
                    f"If fencing costs {r.randint(3, 15)} dollars per meter, how much does it cost to fence the whole garden? {tail}")
        if kind == 7:
            return f"A class of {r.randint(21, 39)} students is split into groups of {r.randint(3, 6)}. How many full groups are there, and how many students are left over? {tail}"
        if kind == 8:
            return f"{name} has {6 * r.randint(5, 40)} dollars and spends a third on books and half of what remains on food. How much money is left? {tail}"
        if kind == 9:
            return f"A water tank holds {100 * r.randint(3, 20)} liters and is {r.choice([10, 20, 25, 40, 60, 75])}% full. How many more liters are needed to fill it? {tail}"
        if kind == 10:
            nums = [r.randint(10, 99) for _ in range(r.randint(4, 6))]
            return f"What is the average of {', '.join(map(str, nums[:-1]))} and {nums[-1]}? {tail}"
        if kind == 11:
            a, x, b = r.randint(2, 9), r.randint(2, 15), r.randint(1, 30)
            return f"Solve for x: {a}x + {b} = {a * x + b}. {tail}"
        if kind == 12:
            return f"A jacket costs {r.randint(4, 30) * 5} dollars and is on sale for {r.choice([10, 20, 25, 30, 40, 50])}% off. What is the sale price? {tail}"
        return (f"A train leaves at {r.randint(6, 11)}:{r.choice(['00', '15', '30', '45'])} in the morning and the trip takes "
                f"{r.randint(70, 250)} minutes. What time does it arrive? {tail}")

    return _sample_unique(make, rng, 700)


def _rewriting(rng: random.Random) -> list[str]:
    """Rewriting, paraphrasing, translation and grammar fixes."""
    t = T["rewriting"]
    return (_fill(t["sentence"], ({"s": s} for s in V["sentences"]))
            + _fill(t["bad_grammar"], ({"s": s} for s in V["bad_grammar"])))


def _summarising(rng: random.Random) -> list[str]:
    """Summaries and comprehension of short given texts."""
    return _fill(T["summarising"]["passage"], ({"p": p} for p in V["passages"]))


def _code(rng: random.Random) -> list[str]:
    """Short programming tasks, code explanation and bug fixing."""
    t = T["code"]
    return (_fill(t["task"], ({"task": task, "does": _third_person(task)} for task in V["code_tasks"]))
            + _fill(t["concept"], ({"c": c} for c in V["code_concepts"]))
            + _fill(t["snippet"], ({"s": s} for s in V["code_snippets"]))
            + _fill(t["buggy"], ({"s": s} for s in V["buggy_snippets"])))


def _definitions(rng: random.Random) -> list[str]:
    """Vocabulary: meanings, synonyms and example sentences."""
    return _fill(T["definition"]["word"], ({"w": w} for w in V["words_to_define"]))


def _comparisons(rng: random.Random) -> list[str]:
    """Compare-and-contrast questions."""
    return _fill(T["comparison"]["pair"], ({"a": a, "b": b} for a, b in V["compare_pairs"]))


def _howto(rng: random.Random) -> list[str]:
    """Practical how-to questions."""
    return _fill(T["howto"]["task"], ({"t": task} for task in V["howto_tasks"]))


def _advice(rng: random.Random) -> list[str]:
    """Advice and pros/cons questions."""
    t = T["advice"]
    return (_fill(t["gerund"], ({"g": g} for g in V["advice_gerunds"]))
            + _fill(t["topic"], ({"t": x} for x in V["advice_topics"])))


def _creative(rng: random.Random) -> list[str]:
    """Poems, stories, scenes and dialogues."""
    t, characters = T["creative"], V["characters"]
    out = _fill(t["topic"], ({"t": x} for x in V["creative_topics"]))
    out += _fill(t["story"], ({"c": c, "g": g} for c in characters for g in V["story_goals"]))
    out += _fill(t["place"], ({"p": p} for p in V["places"]))
    pairs = [(a, b) for a in characters for b in characters if a != b]
    return out + _fill(t["dialogue"], ({"a": a, "b": b} for a, b in rng.sample(pairs, 80)))


def _writing(rng: random.Random) -> list[str]:
    """Practical writing: emails, descriptions, invitations."""
    t = T["writing"]
    out = _fill(t["email"], ({"r": r, "p": p} for r in V["recipients"] for p in V["generic_purposes"]))
    out += _fill(t["email"], ({"r": r, "p": p} for r, p in V["specific_emails"]))
    out += _fill(t["thanks"], ({"r": r, "g": g} for r in V["thank_recipients"] for g in V["gifts"]))
    out += _fill(t["cover_letter"], ({"j": j} for j in V["jobs"]))
    out += _fill(t["speech"], ({"o": o} for o in V["occasions"]))
    out += _fill(t["product"], ({"p": p} for p in V["products"]))
    return out + _fill(t["occasion"], ({"o": o} for o in V["occasions"]))


def _classification(rng: random.Random) -> list[str]:
    """Classification tasks: categories, sentiment, odd-one-out, parts of speech."""
    t, groups, animals = T["classification"], V["odd_one_groups"], V["animal_classes"]
    mass = set(t["mass_nouns"])
    produce = V["fruits_train"] + V["vegetables_train"]
    out = _fill(t["produce"], ({"x": x if x in mass else _article(x)} for x in produce))
    out += _fill(t["animal"], ({"a": _article(x), "x": x} for x, _cls in animals))
    reviews = [(p, r) for p in V["review_products"] for r in V["pos_reviews"] + V["neg_reviews"] + V["neu_reviews"]]
    out += [rng.choice(t["review"]).format(p=p, r=r) for p, r in rng.sample(reviews, 160)]
    names = list(groups)
    for _ in range(140):
        g_in, g_out = rng.sample(names, 2)
        words = rng.sample(groups[g_in], 3) + [rng.choice(groups[g_out])]
        rng.shuffle(words)
        out.append(t["odd_one_out"].format(words=", ".join(words)))
    out += [t["sentence_type"].format(s=s) for s in V["sentence_types"]]
    out += [t["fact_or_opinion"].format(s=s) for s in V["fact_or_opinion"]]
    pos_pool = [w for ws in V["pos_words"].values() for w in ws]
    out += [t["parts_of_speech"].format(words=", ".join(rng.sample(pos_pool, 4))) for _ in range(60)]
    out += _fill(t["headline"], ({"h": h} for h, _topic in V["headlines"]))
    mammals = [a for a, c in animals if c == "mammal"]
    birds = [a for a, c in animals if c == "bird"]
    for _ in range(50):
        mix = rng.sample(mammals, 3) + rng.sample(birds, 3)
        rng.shuffle(mix)
        out.append(t["sort_animals"].format(animals=", ".join(mix)))
    return _unique(out)


def _formatting(rng: random.Random) -> list[str]:
    """Formatting and text-manipulation tasks."""
    t, names = T["formatting"], V["names"]
    out = [t["sort_words"].format(words=", ".join(rng.sample(V["sort_words"], rng.randint(4, 7)))) for _ in range(150)]
    goods = V["fruits_train"] + V["vegetables_train"] + [x for x, _ in V["shop_items"]]
    out += [t["numbered_list"].format(items=", ".join(rng.sample(goods, rng.randint(3, 6)))) for _ in range(80)]
    out += [t["json"].format(name=rng.choice(names), age=rng.randint(18, 80), city=rng.choice(V["cities"]))
            for _ in range(120)]
    out += _fill(t["sentence"], ({"s": s} for s in V["sentences"]))
    for _ in range(100):
        nums = [str(rng.randint(13, 999)) for _ in range(rng.randint(5, 7))]
        out.append(t["number_order"].format(order=rng.choice(["ascending", "descending"]), numbers=", ".join(nums)))
    for _ in range(60):
        people = ", ".join(f"{n} ({rng.randint(18, 70)})" for n in rng.sample(names, rng.randint(3, 5)))
        out.append(t["table"].format(people=people))
    out += _fill(t["date"], ({"m": m, "d": d, "y": y} for m, d, y in V["dates"]))
    for _ in range(40):
        rows = "; ".join(f"{n} scored {rng.randint(40, 100)} points" for n in rng.sample(names, 3))
        out.append(t["csv"].format(rows=rows))
    return _unique(out + _fill(t["checklist"], ({"o": o} for o in V["occasions"])))


def _short_answer(rng: random.Random) -> list[str]:
    """Short-answer questions with an explicit brevity instruction."""
    t = T["short_answer"]
    one, num, brief = t["one_word"], t["number"], t["brief"]
    out = [t["capital"].format(c=c, tail=rng.choice(t["capital_tails"])) for c in V["countries"]]
    out += [t["opposite"].format(w=w, tail=one) for w in V["antonym_words"]]
    out += [t["past_tense"].format(w=w, tail=one) for w in V["past_tense_verbs"]]
    out += [t["plural"].format(w=w, tail=one) for w in V["plural_nouns"]]
    out += [t["sides"].format(a=_article(x), tail=num) for x in V["shapes_sides"]]
    out += [t["color_mix"].format(a=a, b=b, tail=one) for a, b in V["color_mixes"]]
    out += [t["baby_animal"].format(x=x, tail=one) for x in V["baby_animals"]]
    for template in t["fact"]:
        out += [template.format(q=q, brief=brief) for q in V["short_fact_questions"]]
    out += [t["fruit"].format(a=_article(x), tail=one) for x in V["fruits_train"]]
    out += [t["animal"].format(a=_article(x), tail=one) for x, _cls in V["animal_classes"]]

    def arithmetic(r: random.Random) -> str:
        a, b = r.randint(13, 99), r.randint(13, 99)
        kind = r.randrange(4)
        if kind == 0:
            return f"What is {a} + {b}? {num}"
        if kind == 1:
            return f"What is {max(a, b)} - {min(a, b)}? {num}"
        if kind == 2:
            return f"What is {r.randint(13, 25)} times {r.randint(2, 9)}? Reply with only the number."
        d = r.randint(2, 9)
        return f"What is {d * r.randint(13, 30)} divided by {d}? {num}"

    out += _sample_unique(arithmetic, rng, 250)
    return _unique(out)


CATEGORIES: dict[str, Callable[[random.Random], list[str]]] = {
    "facts_geography": _facts_geography,
    "facts_nature": _facts_nature,
    "facts_history": _facts_history,
    "explanation": _explanations,
    "list": _lists,
    "arithmetic": _arithmetic,
    "multistep_math": _multistep_math,
    "rewriting": _rewriting,
    "summarising": _summarising,
    "code": _code,
    "definition": _definitions,
    "comparison": _comparisons,
    "howto": _howto,
    "advice": _advice,
    "creative": _creative,
    "writing": _writing,
    "classification": _classification,
    "formatting": _formatting,
    "short_answer": _short_answer,
}


# --------------------------------------------------------------------------------------
# Exclusion of eval prompts (exact and near-duplicate)
# --------------------------------------------------------------------------------------

_STOPWORDS = frozenset(
    """a an the is are was were be been being am do does did of to in on at for from by with and or but
    not no yes what which who whom whose when where why how this that these those it its i you your me my
    we our they their he she his her them just only please can could would should will shall may might must
    about into than then there here some any each every as so if also very more most much many give tell
    write name list describe explain answer reply word words number sentence short simple following text
    using use make one letter calculate compute solve show step instruction briefly example
    plus minus times multiplied divided""".split()
)
_NUMBER_CANON = {w: str(i) for i, w in enumerate(_NUMBER_WORDS)}
_SYNONYM_CANON = {"antonym": "opposite", "capitol": "capital"}
_NEAR_DUP_FRACTION = 0.75  # share of the eval prompt's content words that must reappear
_NEAR_DUP_OWN_FRACTION = 0.5  # ...and must be more than this share of the training prompt's own


def normalise_prompt(text: str) -> str:
    """Case-fold a prompt and collapse whitespace (the exact-match key)."""
    return " ".join(text.split()).casefold()


def _stem(token: str) -> str:
    """Very light plural stripping so that 'fruits' and 'fruit' compare equal."""
    if token.isdigit() or len(token) <= 3:
        return token
    if token.endswith("ies") and len(token) > 4:
        return token[:-3] + "y"
    if token.endswith(("ches", "shes", "xes", "sses")):
        return token[:-2]
    if token.endswith("s") and not token.endswith(("ss", "us", "is")):
        return token[:-1]
    return token


def content_words(text: str) -> frozenset[str]:
    """Return the normalised content-word set used for near-duplicate detection."""
    words: set[str] = set()
    for tok in re.findall(r"[a-z0-9]+", text.casefold()):
        if tok in _STOPWORDS or (len(tok) == 1 and not tok.isdigit()):
            continue
        tok = _NUMBER_CANON.get(tok, tok)
        tok = _stem(tok)
        words.add(_SYNONYM_CANON.get(tok, tok))
    return frozenset(words)


def load_excluded_prompts(paths: Sequence[Path] = EVAL_FILES) -> list[str]:
    """Read the 'prompt' field of every line of the given JSONL eval files."""
    prompts: list[str] = []
    for path in paths:
        if not Path(path).exists():
            raise FileNotFoundError(f"eval file needed for de-duplication is missing: {path}")
        with Path(path).open(encoding="utf-8") as handle:
            prompts += [json.loads(line)["prompt"] for line in handle if line.strip()]
    return prompts


class EvalFilter:
    """Rejects prompts equal to, or near-duplicates of, held-out eval prompts."""

    def __init__(self, eval_prompts: Sequence[str]) -> None:
        """Index the eval prompts by normalised text and by content word."""
        self.exact = {normalise_prompt(p) for p in eval_prompts}
        self.needed: list[int] = []
        self.ids: list[int] = []
        self.index: dict[str, list[int]] = {}
        for position, prompt in enumerate(eval_prompts):
            words = content_words(prompt)
            if len(words) < 2:
                continue
            idx = len(self.needed)
            self.ids.append(position)
            self.needed.append(max(2, math.ceil(_NEAR_DUP_FRACTION * len(words))))
            for word in sorted(words):
                self.index.setdefault(word, []).append(idx)

    def match(self, prompt: str) -> int | None:
        """Return the index (in eval order, -1 for exact) of the eval prompt this duplicates, else None."""
        if normalise_prompt(prompt) in self.exact:
            return -1
        words = content_words(prompt)
        hits = Counter(i for w in words for i in self.index.get(w, ()))
        for i, shared in sorted(hits.items()):
            if shared >= self.needed[i] and shared > _NEAR_DUP_OWN_FRACTION * len(words):
                return self.ids[i]
        return None

    def rejects(self, prompt: str) -> bool:
        """True if prompt equals an eval prompt or is a near-duplicate of one (rule documented in training/data/README.md)."""
        return self.match(prompt) is not None


# --------------------------------------------------------------------------------------
# Pool construction and sampling
# --------------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def _pool(exclude_files: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Build the filtered, globally de-duplicated candidate pool per category (seed-independent)."""
    filt = EvalFilter(load_excluded_prompts([Path(p) for p in exclude_files]))
    seen: set[str] = set()
    pool: list[tuple[str, tuple[str, ...]]] = []
    for offset, (category, generate) in enumerate(CATEGORIES.items()):
        kept: list[str] = []
        for prompt in generate(random.Random(_POOL_SEED + offset)):
            key = normalise_prompt(prompt)
            if key in seen or filt.rejects(prompt):
                continue
            seen.add(key)
            kept.append(prompt)
        pool.append((category, tuple(kept)))
    return tuple(pool)


def pool_sizes(exclude_files: Sequence[Path] = EVAL_FILES) -> dict[str, int]:
    """Return the number of available (filtered) candidate prompts per category."""
    return {cat: len(items) for cat, items in _pool(tuple(str(p) for p in exclude_files))}


def build_prompts_with_categories(
    n: int = 8000, seed: int = 0, *, exclude_files: Sequence[Path] = EVAL_FILES
) -> list[tuple[str, str]]:
    """Return n unique (category, prompt) pairs, balanced across categories by round-robin."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    pool = _pool(tuple(str(p) for p in exclude_files))
    total = sum(len(items) for _, items in pool)
    if n > total:
        raise ValueError(f"requested {n} prompts but only {total} unique candidates exist")
    rng = random.Random(seed)
    queues: list[tuple[str, list[str]]] = []
    for category, items in pool:
        shuffled = list(items)
        rng.shuffle(shuffled)
        queues.append((category, shuffled))
    chosen: list[tuple[str, str]] = []
    depth = 0
    while len(chosen) < n:
        for category, items in queues:
            if depth < len(items) and len(chosen) < n:
                chosen.append((category, items[depth]))
        depth += 1
    rng.shuffle(chosen)
    return chosen


def build_prompts(n: int = 8000, seed: int = 0) -> list[str]:
    """Return n unique training prompts, deterministic for a given seed and free of eval prompts."""
    return [prompt for _, prompt in build_prompts_with_categories(n, seed)]


def main(argv: Sequence[str] | None = None) -> None:
    """Write the training prompt set to JSONL and print per-category counts."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8000, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSONL path")
    args = parser.parse_args(argv)
    rows = build_prompts_with_categories(args.n, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for category, prompt in rows:
            handle.write(json.dumps({"prompt": prompt, "category": category}, ensure_ascii=False) + "\n")
    counts = Counter(category for category, _ in rows)
    print(f"wrote {len(rows)} prompts to {args.out}")
    for category in CATEGORIES:
        print(f"  {category:16s} {counts[category]:5d}")


if __name__ == "__main__":
    main()
