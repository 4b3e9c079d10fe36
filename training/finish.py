"""Training answers that teach stopping: every kept answer ends with its stop token, none loops.

Why: half of the first GPU data set's answers were cut at the 256-token cap without a stop token, and the
adapter trained on it rarely stops (issue 21, DESIGN.md section 3). Policies (`--answers` of `train`):

  finish (default)  an answer that ended with its stop token and fits max_len is kept as it is; one that was
                    cut at the generation cap, or does not fit max_len, is cut after its last sentence end
                    that fits and closed with the stop token (dropped when it has none, or when what is left
                    is shorter than MIN_KEPT tokens); answers that loop (engine/finish.py's rule) are dropped.
  keep              the old rule: capped answers kept without a stop token, long ones cut at max_len.
  drop              capped and over-long answers dropped, loops dropped; nothing is cut.

A sentence end is a token whose text ends with . ! or ? (a closing quote or bracket may follow) and after
which the answer goes on with white space, outside an open ``` code fence, and not a bare list number
("3."). Cutting there keeps the AR base's own words: the answer is what the base said, closed where a
reader could stop reading. (Regenerating the capped answers at a longer cap is the other way; on this CPU
it would take ~13 hours for the 8,288 capped answers.)
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from engine.finish import LOOP_MIN_NGRAMS, LOOP_N, LOOP_SHARE, is_looping

POLICIES = ("finish", "keep", "drop")
MIN_KEPT = 16  # answer tokens before the stop token that a cut answer must keep
_END = re.compile(r"[.!?][\"'”’)\]]*$")
_LIST_NUMBER = re.compile(r"(^|\n)\s*(\d+|[a-zA-Z])[.)]$")

RULES = {
    "policy": "finish: every kept answer ends with its stop token (training/finish.py)",
    "stopped_answers": "kept as generated when prompt + answer fits max_len",
    "capped_or_too_long": "cut after the last sentence end that fits (. ! ? then white space, outside a ``` "
                          f"fence, not a bare list number) and closed with the stop token; dropped when none, "
                          f"or when fewer than {MIN_KEPT} answer tokens would remain",
    "looping": f"dropped: more than {LOOP_SHARE:.0%} of the answer's word {LOOP_N}-grams repeat an earlier one "
               f"(at least {LOOP_MIN_NGRAMS} of them; engine/finish.py)",
}


class Pieces:
    """Token id -> its text alone (cached): enough to find sentence ends and code fences."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.cache = decode, {}

    def __call__(self, t: int) -> str:
        s = self.cache.get(t)
        if s is None:
            s = self.cache[t] = self.decode([t])
        return s


def sentence_ends(answer: Sequence[int], piece: Pieces) -> list[int]:
    """Every j such that answer[:j] ends a sentence (see the module docstring), in increasing order."""
    ends, text, fences = [], "", 0
    for j, t in enumerate(answer):
        p = piece(t)
        text += p
        fences += p.count("```")
        if fences % 2 or not _END.search(text) or _LIST_NUMBER.search(text[-12:]):
            continue
        nxt = piece(answer[j + 1]) if j + 1 < len(answer) else " "
        if nxt[:1].isspace():
            ends.append(j + 1)
    return ends


@dataclass
class FinishStats:
    """What the policy did, for the manifest and the trainer's log."""

    records: int = 0
    kept_stopped: int = 0
    closed_capped: int = 0  # capped at generation, cut at a sentence end and closed
    closed_too_long: int = 0  # stopped but over max_len, cut and closed
    kept_without_stop: int = 0  # policy keep only
    dropped_capped: int = 0
    dropped_too_long: int = 0
    dropped_looping: int = 0
    dropped_long_prompt: int = 0
    dropped_empty_answer: int = 0
    answer_lengths: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "answer_lengths"}
        lens = sorted(self.answer_lengths)
        if lens:
            q = lambda f: lens[min(len(lens) - 1, int(f * len(lens)))]  # noqa: E731
            d["answer_length"] = {"mean": round(sum(lens) / len(lens), 1), "p10": q(0.1), "p50": q(0.5),
                                  "p90": q(0.9), "max": lens[-1],
                                  "share_over_128": round(sum(n > 128 for n in lens) / len(lens), 3)}
        d["kept"] = len(lens)
        return d


def finish_answer(prompt: Sequence[int], answer: Sequence[int], stopped: bool, *, max_len: int, stop_id: int,
                  piece: Pieces, policy: str, stats: FinishStats, min_answer: int = 1) -> list[int] | None:
    """prompt + the answer the policy keeps (through its stop token under 'finish'), or None if dropped."""
    if policy not in POLICIES:
        raise ValueError(f"answers policy must be one of {POLICIES} (got {policy!r})")
    stats.records += 1
    prompt, answer = list(prompt), list(answer)
    if stopped and answer[-1:] != [stop_id]:
        raise ValueError(f"data: an answer marked stopped does not end with the stop token {stop_id}")
    body = answer[:-1] if stopped else answer
    if len(body) < min_answer:
        stats.dropped_empty_answer += 1
        return None
    if len(prompt) + min_answer + (policy == "finish") > max_len:
        stats.dropped_long_prompt += 1
        return None
    if policy != "keep" and is_looping("".join(piece(t) for t in body)):
        stats.dropped_looping += 1
        return None
    fits = len(prompt) + len(answer) <= max_len
    if policy == "keep":
        if not stopped:
            stats.kept_without_stop += 1
        out = (prompt + answer)[:max_len]
    elif stopped and fits:
        stats.kept_stopped += 1
        out = prompt + answer
    elif policy == "drop":
        if stopped:
            stats.dropped_too_long += 1
        else:
            stats.dropped_capped += 1
        return None
    else:
        room = max_len - len(prompt) - 1  # answer tokens that fit before the stop token
        ends = [j for j in sentence_ends(body[:room + 1], piece) if j <= room]
        if not ends or ends[-1] < MIN_KEPT:
            if stopped:
                stats.dropped_too_long += 1
            else:
                stats.dropped_capped += 1
            return None
        if stopped:
            stats.closed_too_long += 1
        else:
            stats.closed_capped += 1
        out = prompt + body[:ends[-1]] + [stop_id]
    stats.answer_lengths.append(len(out) - len(prompt))
    return out


def finish_shards(path: Path, stop_id: int, max_len: int, policy: str = "finish", min_answer: int = 1,
                  decode: Callable[[list[int]], str] | None = None) -> tuple[list[tuple[list[int], int]], dict]:
    """A self-instruct directory's shards under a policy: (ids, prompt length) of each kept sequence, in shard
    order and each prompt once (a key seen in an earlier shard is skipped), and the policy's counts.
    `decode(ids) -> str` is the tokenizer's; the loop rule and the sentence ends need it."""
    stats, dup = FinishStats(), [0]
    out = list(iter_finished_shards(path, stop_id, max_len, policy, min_answer, decode, stats, dup))
    return out, stats.to_json() | {"duplicate_keys": dup[0], "answers": policy}


def iter_finished_shards(path: Path, stop_id: int, max_len: int, policy: str = "finish", min_answer: int = 1,
                         decode: Callable[[list[int]], str] | None = None, stats: FinishStats | None = None,
                         duplicates: list[int] | None = None) -> Iterator[tuple[list[int], int]]:
    """finish_shards one example at a time (one shard in memory; the seen keys, 8 bytes each, are kept)."""
    from .shards import shard_paths, stored_examples

    if not shard_paths(path):
        raise FileNotFoundError(f"data: no shard-*.npz in {path} (run: python -m training selfinstruct --out {path})")
    if decode is None:
        raise ValueError("finish_shards: pass the tokenizer's decode (the answers policy reads the text)")
    stats, piece = stats if stats is not None else FinishStats(), Pieces(decode)
    seen: set[int] = set()
    for name, key, prompt, answer, stopped in stored_examples(path):
        if key in seen:
            if duplicates is not None:
                duplicates[0] += 1
            continue
        seen.add(key)
        try:
            ids = finish_answer(prompt, answer, stopped, max_len=max_len, stop_id=stop_id, piece=piece,
                                policy=policy, stats=stats, min_answer=min_answer)
        except ValueError as e:
            raise ValueError(f"data: {name}: {e}") from None
        if ids is not None:
            yield ids, len(prompt)


def write_report(data: Path, max_lens: Sequence[int]) -> dict:
    """Counts of every policy at each max_len over a self-instruct directory, written into its manifest.json
    under "answers_policy" (with the rules), so the data set says what training will read of it."""
    from engine.weights import bundled_base_dir, load_tokenizer

    tok = load_tokenizer(bundled_base_dir(), add_mask_token=False)
    stop_id = tok.convert_tokens_to_ids("<|im_end|>")
    counts = {str(n): {pol: finish_shards(data, stop_id, n, pol, decode=tok.decode)[1] for pol in POLICIES}
              for n in max_lens}
    report = {"default": "finish", "rules": RULES, "by_max_len": counts}
    mpath = data / "manifest.json"
    manifest = json.loads(mpath.read_text()) if mpath.exists() else {}
    manifest["answers_policy"] = report
    tmp = mpath.with_name("manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    os.replace(tmp, mpath)
    return report
