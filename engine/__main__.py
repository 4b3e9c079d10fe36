"""CLI: `python -m engine generate ...` (one prompt, text or JSON) and `python -m engine chat` (terminal chat)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .config import CACHE_MODES, MODES, STRATEGIES, ConfigError, DecodeConfig
from .events import Token
from .finish import judge
from .penalties import Penalties
from .weights import ModelSourceError
from .prefix_cache import PREFIX_CACHE_MIB
from .scheduler import PREFILL_CHUNK
from .runtime import Runtime


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, non-zero exit, no traceback
        self.exit(2, f"error: {message}\n")


def _decode_args(p: argparse.ArgumentParser) -> None:
    d = DecodeConfig()
    p.add_argument("--model", help="hub id or local checkpoint directory (default: FASTDLLM_MODEL, else the bundled model)")
    p.add_argument("--mode", choices=MODES, default=d.mode, help="block diffusion (Fast-dLLM v2) or the AR baseline")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block (block-causal attention)")
    p.add_argument("--sub-block-size", type=int, default=d.sub_block_size, help="tokens decoded in parallel; must divide the block size")
    p.add_argument("--threshold", type=float, default=d.threshold, help="commit masks whose confidence exceeds this, in (0, 1]")
    p.add_argument("--strategy", choices=STRATEGIES, default=d.strategy, help="unmasking rule")
    p.add_argument("--factor", type=float, default=d.factor, help="f of the factor rule: commit the largest n with (n+1)(1-c_n) < f")
    p.add_argument("--cache", choices=CACHE_MODES, default=d.cache,
                   help="KV cache: none, block-level, block + sub-block DualCache, or DualCache with sparse sub-block steps "
                        "(dual-sparse: docs/engine.md)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="cap on answer tokens")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="transformers/vLLM: logits of tokens already in prompt or answer, >0 divided, else multiplied, "
                        "by this; in (0, 10], 1 = off")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="OpenAI: subtract this times the token's count in the answer so far; in [-2, 2], 0 = off")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="OpenAI: subtract this from tokens already in the answer; in [-2, 2], 0 = off")
    p.add_argument("--no-repeat-ngram-size", type=int, default=d.no_repeat_ngram_size,
                   help="transformers: never repeat an n-gram of prompt + answer; 0 = off")
    p.add_argument("--stop-guard", action="store_true",
                   help="diffusion: commit nothing right of a position whose best token is the stop token (off: the "
                        "paper's rule)")
    p.add_argument("--system", default=None, help="system prompt (default: the model's chat template default)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="weights dtype (default: bf16 on CUDA, fp32 on CPU)")


def _settings(a: argparse.Namespace) -> dict:
    """The DecodeConfig fields the decode flags set (stop tokens come from the model)."""
    return dict(mode=a.mode, block_size=a.block_size, sub_block_size=a.sub_block_size, threshold=a.threshold,
                strategy=a.strategy, factor=a.factor, cache=a.cache, max_new_tokens=a.max_new_tokens,
                temperature=a.temperature, top_p=a.top_p, seed=a.seed, repetition_penalty=a.repetition_penalty,
                frequency_penalty=a.frequency_penalty, presence_penalty=a.presence_penalty,
                no_repeat_ngram_size=a.no_repeat_ngram_size, stop_guard=a.stop_guard)


def _config(engine, a: argparse.Namespace) -> DecodeConfig:
    return engine.decode_config(**_settings(a))


def _messages(system: str | None, history: list[dict[str, str]], prompt: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + history + [{"role": "user", "content": prompt}]


def _logprobs(seen: dict[int, Token], n: int) -> list[dict]:
    """The answer's tokens (through the stop token) with ln(probability) and alternatives, as --json prints them
    (a token among its own alternatives carries the same value)."""
    return [{"token": t.text, "id": t.id, "logprob": t.logprob(),
             "top_logprobs": [{"token": s, "id": i, "logprob": v} for i, s, v in t.alternatives()]}
            for t in (seen[p] for p in range(n))]


STUDIO_KNOBS = "--frequency-penalty 0.3 --no-repeat-ngram-size 4 --stop-guard"  # app/presets.json's, as flags


def _finish(s, cfg: DecodeConfig) -> tuple[str, str]:
    """(the footer's verdict, a hint line or ''): whether the answer ended and whether it loops, said before its
    tokens per forward, which count a loop's easy tokens as speed (engine/finish.py, as the studio says it)."""
    f = judge(s.text, s.stop_reason)
    if f.complete:
        return "complete", ""
    verdict = (f"looping ({100 * f.repeat_share:.0f} % of its word 4-grams repeat)" if f.looping
               else {"capped": "unfinished: hit --max-new-tokens"}.get(f.label, f"unfinished: {f.label}"))
    knobs_off = not Penalties.of(cfg).active and not cfg.stop_guard
    hint = (f"(the repetition knobs are off: the paper's rule; the studio decodes with {STUDIO_KNOBS})"
            if knobs_off and cfg.mode == "diffusion" else "")
    return verdict, hint


def _decode(engine, ids: list[int], cfg: DecodeConfig, **kw):
    """One prompt through the engine's scheduler, the front door the studio and the server use too (so the CLI's
    answer is theirs); Ctrl-C drops the row before the next forward."""
    t = engine.scheduler.submit(ids, cfg, **kw)
    try:
        return t.wait()
    except KeyboardInterrupt:
        t.cancel()
        raise


def cmd_generate(a: argparse.Namespace) -> int:
    from .engine import Engine

    top = a.top_logprobs
    DecodeConfig(**_settings(a), top_logprobs=top or 0).validate()  # fail before loading weights
    if not a.prompt.strip():
        raise ConfigError("prompt", "must not be empty")
    if top is not None and not a.json:
        raise ConfigError("top_logprobs", "needs --json (the log-probabilities are printed in it)")
    engine = Engine.load(a.model, a.device, a.dtype)
    cfg = replace(_config(engine, a), top_logprobs=top or 0)
    text = engine.chat_prompt(_messages(a.system, [], a.prompt))
    seen: dict[int, Token] = {}
    if top is not None:  # committed tokens by answer position
        stream = lambda e: seen.update({t.pos: t for t in e.committed})  # noqa: E731
    else:
        stream = None if (a.json or a.quiet) else (lambda e: print(e.text_delta, end="", flush=True) if e.text_delta else None)
    try:
        res = _decode(engine, engine.encode(text), cfg, listener=stream, record=bool(a.trace), prompt_text=a.prompt)
    finally:
        engine.close_scheduler()
    s = res.summary
    if a.trace:
        Path(a.trace).write_text(res.trace.dumps())
    if a.json:
        fin = judge(s.text, s.stop_reason)
        print(json.dumps({"text": s.text, "tokens": s.answer_tokens, "token_ids": s.token_ids, "nfe": s.nfe,
                          "tokens_per_forward": s.tokens_per_forward, "seconds": s.seconds,
                          "tokens_per_second": s.tokens_per_second, "ttft": s.ttft, "stop_reason": s.stop_reason,
                          "finish": fin.label, "repeat_share": fin.repeat_share,
                          "mode": cfg.mode, "cache": cfg.cache, "threshold": cfg.threshold,
                          "block_size": cfg.block_size, "sub_block_size": cfg.sub_block_size,
                          **{k: getattr(cfg, k) for k in ("repetition_penalty", "frequency_penalty",
                                                          "presence_penalty", "no_repeat_ngram_size")},
                          "model": engine.lm.banner(), **({"logprobs": _logprobs(seen, s.answer_tokens)} if top is not None
                                                          else {})}, ensure_ascii=False))
    else:
        if a.quiet:
            print(s.text)
        else:
            print()
        verdict, hint = _finish(s, cfg)
        print(f"[{s.answer_tokens} tokens · {verdict} · {s.nfe} forwards · {s.tokens_per_forward:.2f} tokens/forward · "
              f"{s.tokens_per_second:.1f} tokens/s · {engine.lm.banner()}]", file=sys.stderr)
        if hint:
            print(hint, file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from .engine import Engine

    engine = Engine.load(a.model, a.device, a.dtype)
    cfg = _config(engine, a)
    print(f"{engine.lm.banner()}\nType a message; 'clear' resets the conversation, 'exit' quits.", file=sys.stderr)
    history: list[dict[str, str]] = []
    try:
        return _chat(engine, cfg, a.system, history)
    finally:
        engine.close_scheduler()


def _chat(engine, cfg: DecodeConfig, system: str | None, history: list[dict[str, str]]) -> int:
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        msg = line.strip()
        if not msg:
            continue
        if msg.lower() in ("exit", "quit"):
            return 0
        if msg.lower() == "clear":
            history.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        ids = engine.encode(engine.chat_prompt(_messages(system, history, msg)))
        print("bot> ", end="", flush=True)
        try:
            res = _decode(engine, ids, cfg, record=False,
                          listener=lambda e: print(e.text_delta, end="", flush=True) if e.text_delta else None)
        except ConfigError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        s = res.summary
        cached = f" · {s.cached_tokens} prompt tokens from the prefix cache" if s.cached_tokens else ""
        verdict, hint = _finish(s, cfg)
        print(f"\n[{s.answer_tokens} tokens · {verdict} · {s.tokens_per_forward:.2f} tokens/forward · "
              f"{s.tokens_per_second:.1f} tokens/s · first token {s.ttft:.2f} s{cached}]", file=sys.stderr)
        if hint:
            print(hint, file=sys.stderr)
        history += [{"role": "user", "content": msg}, {"role": "assistant", "content": s.text}]


def serve_access(a: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(API key or None, CORS origins): --api-key, else FASTDLLM_API_KEY; --allowed-origins split at commas."""
    key = a.api_key if a.api_key is not None else Runtime.from_env().api_key
    if key is not None and (not key.strip() or not key.isprintable() or not key.isascii()):
        raise ConfigError("api_key", "must be printable ASCII and not blank")
    return key, [o.strip() for o in (a.allowed_origins or "").split(",") if o.strip()]


def cmd_serve(a: argparse.Namespace) -> int:
    from .engine import Engine
    from .serve import serve
    from .serve.request import generation_defaults

    if not 1 <= a.max_batch <= 256:
        raise ConfigError("max_batch", f"must be an integer in [1, 256] (got {a.max_batch})")
    if not 0 < a.port < 65536:
        raise ConfigError("port", f"must be in [1, 65535] (got {a.port})")
    if a.prefill_chunk is not None and (a.prefill_chunk < 64 or a.prefill_chunk % 64):
        raise ConfigError("prefill_chunk", f"must be a multiple of 64, at least 64 (got {a.prefill_chunk})")
    if a.prefix_cache_mib is not None and not 0 <= a.prefix_cache_mib <= 1 << 20:
        raise ConfigError("prefix_cache_mib", f"must be an integer in [0, {1 << 20}] (got {a.prefix_cache_mib})")
    key, origins = serve_access(a)
    defaults = generation_defaults(a.override_generation_config)  # refused before the model loads
    engine = Engine.load(a.model, a.device, a.dtype)
    print(f"model: {engine.lm.banner()}; OpenAI API on http://{a.host}:{a.port}/v1"
          f"{'; API key required' if key else ''}{'; CORS for ' + ', '.join(origins) if origins else ''}"
          f"{'; request defaults ' + json.dumps(defaults) if defaults else ''}", file=sys.stderr, flush=True)
    serve(engine, a.host, a.port, a.max_batch, api_key=key, allowed_origins=origins, prefill_chunk=a.prefill_chunk,
          prefix_cache_mib=a.prefix_cache_mib, defaults=defaults)
    return 0


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine", description="Fast-dLLM v2 block-diffusion decoding")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="answer one prompt")
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and measurements")
    g.add_argument("--trace", metavar="FILE", help="write the JSON trace (replayable in the studio)")
    g.add_argument("--quiet", action="store_true", help="print the answer at the end instead of streaming")
    g.add_argument("--top-logprobs", type=int, default=None, metavar="K",
                   help="with --json: each answer token's log-probability and the K (0-20) most likely tokens of the "
                        "distribution it was committed from (the API's top_logprobs)")
    _decode_args(g)
    c = sub.add_parser("chat", help="multi-turn terminal chat")
    _decode_args(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching across requests)")
    s.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1; 0.0.0.0 to share on a network)")
    s.add_argument("--port", type=int, default=8000, help="port (8000)")
    s.add_argument("--max-batch", type=int, default=16, help="rows decoded together per setting; more requests wait")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="a longer prompt is prefilled this many tokens per pass, between the other requests' forwards "
                        "(chunked prefill; on a CPU in forwards of 64, the prefix cache's grain); a multiple of 64 (default: "
                        f"FASTDLLM_PREFILL_CHUNK, else {PREFILL_CHUNK})")
    s.add_argument("--prefix-cache-mib", type=int, default=None, metavar="MIB",
                   help="memory for the K/V of prompt chunks already prefilled, reused by prompts that start with the "
                        "same tokens (a conversation's next turn, a shared system prompt); answers unchanged; 0 turns "
                        f"it off (default: FASTDLLM_PREFIX_CACHE_MIB, else {PREFIX_CACHE_MIB})")
    s.add_argument("--model", help="hub id or local checkpoint directory (default: FASTDLLM_MODEL, else the bundled model)")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="weights dtype")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every route but /health "
                                                   "(default: FASTDLLM_API_KEY, else no key)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins browsers may call from (CORS), or '*'; default none")
    s.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="decoding settings a request gets when it leaves them out (vLLM's option), e.g. the studio's "
                        "'{\"frequency_penalty\": 0.3, \"no_repeat_ngram_size\": 4, \"stop_guard\": true}'; a "
                        "request's own values win (default: none, the paper's rule)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    cmds = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}
    try:
        return cmds[a.cmd](a)
    except (ConfigError, ModelSourceError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
