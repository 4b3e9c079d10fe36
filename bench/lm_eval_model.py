"""lm-evaluation-harness model `fast_dllm_v2`: generation on our engine, and likelihoods a block-diffusion
model can actually define.

Import this module (or pass `--include_path`-style `import bench.lm_eval_model` before calling
lm_eval.simple_evaluate) to register the model:

    import bench.lm_eval_model  # noqa: F401  registers "fast_dllm_v2"
    lm_eval.simple_evaluate(model="fast_dllm_v2", model_args="threshold=0.9,cache=dual", tasks=[...])

Likelihood. With mode=diffusion a block-diffusion LM has no causal factorisation of its own, but it
defines one exactly through its decoding order: committing one token at a time, left to right, the
probability of token q is read at q - 1 (token shift) with the clean prefix cached block by block and
positions q.. of q's block still masked. The product of those conditionals is a normalised distribution
over sequences (each factor is a distribution over x_q given x_<q), so loglikelihood and
loglikelihood_rolling are exact under that left-to-right decoding policy, and `is_greedy` is whether
every token is the argmax of its conditional. Cost: one forward of one block per scored token (plus one
commit forward per block), like decoding with cache=block and threshold=1.0. With mode=ar the base
model's ordinary causal likelihood is used.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

log = logging.getLogger(__name__)

ENGINE_KEYS = ("mode", "block_size", "sub_block_size", "threshold", "strategy", "factor", "cache", "top_p", "seed")
IGNORED_GEN_KEYS = ("do_sample", "top_k", "num_beams", "repetition_penalty")


def _bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


class _StopWatch:
    """Listener + cancel: stop decoding once every row has finished or produced one of the stop strings."""

    def __init__(self, n: int, until: list[str]):
        self.text = [""] * n
        self.done = [False] * n
        self.until = until

    def __call__(self, e) -> None:
        if e.text_delta:
            self.text[e.row] += e.text_delta
            if any(s in self.text[e.row] for s in self.until):
                self.done[e.row] = True
        if e.kind == "done":
            self.done[e.row] = True

    def is_set(self) -> bool:
        return all(self.done)


@register_model("fast_dllm_v2")
class FastDLLMv2(LM):
    """model_args: model, mode, block_size, sub_block_size, threshold, strategy, factor, cache,
    max_new_tokens, chat (wrap raw contexts in a user turn), dtype, device, threads, batch_size."""

    def __init__(self, model: str | None = None, mode: str = "diffusion", block_size: int = 32,
                 sub_block_size: int = 8, threshold: float = 0.9, strategy: str = "threshold", factor: float = 1.0,
                 cache: str = "dual", max_new_tokens: int = 256, chat: bool | str = False, dtype: str | None = None,
                 device: str | None = None, threads: int | None = None, batch_size: int | str | None = 1,
                 max_batch_size: int | None = None, max_length: int = 2048, engine: Any = None, **unknown: Any):
        super().__init__()
        if unknown:
            raise ValueError(f"fast_dllm_v2: unknown model_args {sorted(unknown)}; known: model, mode, block_size, "
                             "sub_block_size, threshold, strategy, factor, cache, max_new_tokens, chat, dtype, "
                             "device, threads, batch_size, max_length")
        if threads:
            torch.set_num_threads(int(threads))
        if engine is None:
            from engine import Engine

            engine = Engine.load(None if model in (None, "", "bundled") else str(model), device=device, dtype=dtype)
        self.eng = engine
        self.defaults = dict(mode=str(mode), block_size=int(block_size), sub_block_size=int(sub_block_size),
                             threshold=float(threshold), strategy=str(strategy), factor=float(factor), cache=str(cache))
        self.max_new_tokens = int(max_new_tokens)
        self.eng.decode_config(**self.defaults, max_new_tokens=self.max_new_tokens)  # fail early on bad args
        if self.defaults["mode"] == "diffusion" and not self.eng.can_diffuse:
            raise ValueError("fast_dllm_v2: mode=diffusion needs a model with a mask token (bundled adapter or a "
                             "Fast-dLLM v2 checkpoint); use mode=ar for the base model")
        self.chat = _bool(chat)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() and int(batch_size) > 0 else 1
        self.max_length = min(int(max_length), self.eng.max_context)
        self._device = self.eng.lm.device
        self.stats = {"answer_tokens": 0, "nfe": 0, "seconds": 0.0, "requests": 0}
        vocab = self.eng.lm.tokenizer.get_vocab()
        self.prefix_token_id = vocab.get("<|endoftext|>", self.eng.lm.stop_token_ids[0])

    # ------------------------------------------------------------------ chat templating (apply_chat_template=True)
    @property
    def tokenizer_name(self) -> str:
        return self.eng.lm.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.eng.lm.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        self._templated = True
        return self.eng.lm.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ generation
    def _config(self, gen_kwargs: dict[str, Any]):
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = self.max_new_tokens
        for alias in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):
            if kw.get(alias) is not None:
                max_new = int(kw.pop(alias))
                break
        do_sample = kw.pop("do_sample", None)
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        if do_sample is False:
            temperature = 0.0
        cfg = dict(self.defaults, max_new_tokens=max_new, temperature=temperature)
        for k in ENGINE_KEYS:
            if k in kw and kw[k] is not None:
                cfg[k] = kw.pop(k)
        for k in list(kw):
            if k.startswith("max_") or k in IGNORED_GEN_KEYS:
                kw.pop(k)
        if kw:
            log.warning("fast_dllm_v2: ignoring unsupported gen_kwargs %s", sorted(kw))
        return self.eng.decode_config(**cfg), [s for s in until if s]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        templated = getattr(self, "_templated", False)
        bar = tqdm(total=len(requests), desc="fast_dllm_v2 generate_until", disable=disable_tqdm or self.rank != 0)
        for idxs in groups.values():
            cfg, until = self._config(requests[idxs[0]].args[1])
            for j in range(0, len(idxs), self.batch_size):
                chunk = idxs[j:j + self.batch_size]
                contexts = [requests[i].args[0] for i in chunk]
                watch = _StopWatch(len(chunk), until) if until else None
                res = self.eng.generate(contexts, cfg, record=False, chat=self.chat and not templated,
                                        listener=watch, cancel=watch)
                for i, r in zip(chunk, res):
                    text = r.summary.text
                    cut = min((text.find(s) for s in until if s in text), default=-1)
                    text = text[:cut] if cut >= 0 else text
                    out[i] = text
                    self.stats["answer_tokens"] += r.summary.answer_tokens
                    self.stats["nfe"] += r.summary.nfe
                    self.stats["requests"] += 1
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                self.stats["seconds"] += max(r.summary.seconds for r in res)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ likelihoods
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = self.eng.encode(context + continuation)
        ctx = self.eng.encode(context) if context else []
        if whole[:len(ctx)] != ctx:  # a merge across the boundary: score the continuation's own tokens
            whole = ctx + self.eng.encode(continuation)
        if not ctx:
            ctx, whole = [self.prefix_token_id], [self.prefix_token_id] + whole
        return ctx, whole[len(ctx):]

    def _score_tokens(self, x: list[int], first: int) -> tuple[float, bool]:
        """log p(x[first:] | x[:first]) and whether every token is the argmax (engine/likelihood.py: the same
        definition the server's `echo` serves)."""
        from engine.likelihood import token_logprobs

        lps = token_logprobs(self.eng.lm, x, first, self.defaults["mode"], self.defaults["block_size"])
        return sum(t.logprob for t in lps), all(t.greedy for t in lps)

    def _score(self, x: list[int], first: int) -> tuple[float, bool]:
        if len(x) > self.max_length:
            raise ValueError(f"fast_dllm_v2: {len(x)} tokens exceed max_length={self.max_length}")
        return self._score_tokens(x, first)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        out = []
        for req in tqdm(requests, desc="fast_dllm_v2 loglikelihood", disable=disable_tqdm or self.rank != 0):
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            if len(ctx) + len(cont) > self.max_length:
                ctx = ctx[-(self.max_length - len(cont)):]
            res = self._score(ctx + cont, len(ctx)) if cont else (0.0, True)
            out.append(res)
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        from tqdm import tqdm

        out = []
        for req in tqdm(requests, desc="fast_dllm_v2 loglikelihood_rolling", disable=disable_tqdm or self.rank != 0):
            (text,) = req.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.eng.encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(self._score(ctx + cont, len(ctx))[0] for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out
