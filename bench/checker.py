"""Short-answer checking and eval-set loading for the benchmark prompts: the rules live in grading/checker.py
(shared with training/, which does not import bench/); this module hands them on under their bench names."""

from grading.checker import is_correct, load_eval_set, mention_pattern, normalise, read_jsonl

__all__ = ["is_correct", "load_eval_set", "mention_pattern", "normalise", "read_jsonl"]
