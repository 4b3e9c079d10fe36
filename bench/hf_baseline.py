"""transformers generate() on the same base weights, dtype, token ids and stop ids: the bar our AR must clear."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class RowResult:
    """One prompt's outcome, in the fields the throughput accounting reads from engine summaries."""

    answer_tokens: int
    nfe: int
    seconds: float
    ttft: float
    stop_reason: str
    token_ids: list[int]


class _FirstToken:
    """A streamer that notes when generate() hands over the first new token (the first put() is the prompt)."""

    def __init__(self, t0: float):
        self.t0, self.calls, self.first = t0, 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


class HFBaseline:
    """AutoModelForCausalLM loaded from the engine's base checkpoint directory (no adapter)."""

    def __init__(self, eng):
        from transformers import AutoModelForCausalLM

        lm = eng.lm
        self.device, self.dtype = lm.device, lm.dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(lm.source.path), dtype=lm.dtype).to(lm.device).eval()
        self.stop_ids = list(lm.stop_token_ids)
        pad = lm.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]

    def generate_ids(self, ids: list[list[int]], max_new_tokens: int, ignore_eos: bool = False) -> list[RowResult]:
        """Greedy, batched with left padding; time = generate() only (tokenisation is the caller's)."""
        from transformers import GenerationConfig

        width = max(len(p) for p in ids)
        inp = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(ids), width), dtype=torch.long)
        for i, p in enumerate(ids):
            inp[i, width - len(p):] = torch.tensor(p)
            att[i, width - len(p):] = 1
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                              min_new_tokens=max_new_tokens if ignore_eos else None)
        inp, att = inp.to(self.device), att.to(self.device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            streamer = _FirstToken(t0)
            out = self.model.generate(input_ids=inp, attention_mask=att, generation_config=gc, streamer=streamer)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        stops = set(self.stop_ids)
        rows = []
        for gen in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(gen) if t in stops), None)
            toks = gen[:cut] if cut is not None else gen[:max_new_tokens]
            reason = "stop_token" if cut is not None else "max_new_tokens"
            # one forward per generated token for this row (the batch keeps computing finished rows)
            rows.append(RowResult(len(toks), len(toks), secs, streamer.first or secs, reason, toks))
        return rows
