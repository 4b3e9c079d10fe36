"""Deterministic, template-based builder of diverse chat training prompts, deduplicated against the eval sets."""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
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
    REPO_ROOT / "bench" / "data" / "long_checkable_b.jsonl",
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
MATHS = json.loads((DATA_DIR / "prompt_maths.json").read_text(encoding="utf-8"))
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


@lru_cache(maxsize=None)
def _parsed(expr: str) -> ast.expr:
    return ast.parse(expr, mode="eval").body


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _draw(expr: str, names: dict[str, object], r: random.Random) -> object:
    """One draw of prompt_maths.json: literals, + - *, names and the draw functions, evaluated left to right as Python
    would (the random stream, hence every later prompt, depends on that order)."""
    calls: dict[str, Callable[..., object]] = {
        "randint": r.randint, "choice": r.choice, "sample": r.sample, "max": max, "min": min,
        "randints": lambda lo, hi, n: [r.randint(lo, hi) for _ in range(n)],
        "and_list": lambda xs: ", ".join(map(str, xs[:-1])) + f" and {xs[-1]}"}

    def value(node: ast.expr) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)  # type: ignore[operator]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left = value(node.left)
            return _OPS[type(node.op)](left, value(node.right))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in calls:
            return calls[node.func.id](*[value(a) for a in node.args])
        raise ValueError(f"prompt_maths.json: {ast.unparse(node)!r} in {expr!r} is not a literal, + - *, a known name "
                         f"or one of {sorted(calls)}")

    return value(_parsed(expr))


def _maths(category: str) -> Callable[[random.Random], list[str]]:
    """Randomised arithmetic and word problems from training/data/prompt_maths.json: a kind chosen uniformly, the
    category's draws, the kind's draws, then its text filled."""
    spec = MATHS[category]

    def make(r: random.Random) -> str:
        kind = spec["kinds"][r.randrange(len(spec["kinds"]))]
        names: dict[str, object] = {**V, **spec.get("lists", {})}
        for name, expr in spec["draws"] + kind.get("draws", []):
            names[name] = _draw(expr, names, r)
        text = kind["text"]
        return (r.choice(text) if isinstance(text, list) else text).format(**names)

    return lambda rng: _sample_unique(make, rng, spec["count"])


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
    "arithmetic": _maths("arithmetic"),  # single-step arithmetic and word problems
    "multistep_math": _maths("multistep_math"),  # multi-step word problems that ask for working
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
