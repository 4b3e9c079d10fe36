"""llama.cpp on the same GGUF (llama-cpp-python): the CPU bar for our AR mode.

Same token ids (our chat template and tokenizer; the vocabularies are the GGUF's), greedy, same stop ids,
same threads. Optional dependency: requirements-llamacpp.txt (README "Dependencies" has the build flags).
"""
from __future__ import annotations

import time

from .hf_baseline import RowResult


class LlamaCppBaseline:
    """One llama_cpp.Llama on the bundled GGUF; batch 1 (its high-level API decodes one sequence)."""

    def __init__(self, eng, threads: int, n_ctx: int = 2048):
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise SystemExit("--modes llamacpp: needs llama-cpp-python (pip install -r requirements-llamacpp.txt, "
                             f"built as README 'Dependencies' says): {exc}") from None
        from engine.weights import bundled_gguf_path

        if eng.lm.source.kind != "bundled":
            raise SystemExit("--modes llamacpp: compares against the bundled GGUF; run with the bundled model")
        self.path = bundled_gguf_path()
        self.llm = Llama(model_path=str(self.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        self.stop_ids = set(eng.lm.stop_token_ids)

    def generate_ids(self, ids: list[list[int]], max_new_tokens: int, ignore_eos: bool = False) -> list[RowResult]:
        if len(ids) != 1:
            raise ValueError(f"llamacpp: batch size {len(ids)} (only 1 is supported)")
        t0 = time.perf_counter()
        first, toks = None, []
        # temp 0 = greedy argmax; repeat_penalty 1 = off (as our greedy decoding).
        for tok in self.llm.generate(ids[0], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            first = first if first is not None else time.perf_counter() - t0
            toks.append(int(tok))
            if (not ignore_eos and tok in self.stop_ids) or len(toks) >= max_new_tokens:
                break
        secs = time.perf_counter() - t0
        reason = "stop_token" if toks and toks[-1] in self.stop_ids and not ignore_eos else "max_new_tokens"
        return [RowResult(len(toks), len(toks), secs, first or secs, reason, toks)]
