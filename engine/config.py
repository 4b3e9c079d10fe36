"""Configuration dataclasses at the engine's borders, with validation that names the field."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

Mode = Literal["diffusion", "ar"]
CacheMode = Literal["none", "block", "dual", "dual-sparse"]
Strategy = Literal["threshold", "factor"]

MODES = ("diffusion", "ar")
CACHE_MODES = ("none", "block", "dual", "dual-sparse")
STRATEGIES = ("threshold", "factor")
MAX_BLOCK_SIZE = 256
MAX_NEW_TOKENS_LIMIT = 4096
# Repetition knobs (engine/penalties.py applies them). Ranges: OpenAI's and vLLM's [-2, 2] for frequency and
# presence; transformers and vLLM only require repetition_penalty > 0, and past 10 a seen token's logit is
# scaled by more than 10x, which no one means, so we stop there; an n-gram longer than 64 tokens never repeats
# by accident (a block is 32).
MAX_REPETITION_PENALTY = 10.0
MAX_FREQ_PRES_PENALTY = 2.0
MAX_NO_REPEAT_NGRAM = 64
MAX_TOP_LOGPROBS = 20  # alternatives per answer token (vLLM's default --max-logprobs; OpenAI chat allows 20)


class ConfigError(ValueError):
    """A decoding or model setting is out of its allowed range."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(slots=True)
class ModelConfig:
    """Architecture of a Qwen2/Llama-family decoder (the subset our forward implements)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has QKV bias; Llama does not
    bd_size: int = 32  # block size the diffusion model was trained with
    model_type: str = "qwen2"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a transformers-style config.json (qwen2, llama, Fast_dLLM_Qwen)."""
        model_type = cfg.get("model_type", "qwen2")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConfigError("rope_scaling", f"rope type {rope.get('rope_type')!r} is not supported (only default RoPE)")
        qwen_like = model_type.lower() in ("qwen2", "fast_dllm_qwen")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", qwen_like)),
            bd_size=int(cfg.get("bd_size", 32)),
            model_type=model_type,
        )


@dataclass(slots=True)
class DecodeConfig:
    """How to decode: Fast-dLLM v2 block diffusion, or the AR baseline."""

    mode: str = "diffusion"
    block_size: int = 32
    sub_block_size: int = 8
    threshold: float = 0.9
    strategy: str = "threshold"
    factor: float = 1.0
    cache: str = "dual"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Against repetition, with transformers'/vLLM's meanings (engine/penalties.py); all off by default.
    repetition_penalty: float = 1.0  # seen tokens (prompt + answer so far): logit > 0 -> logit / p, else logit * p
    frequency_penalty: float = 0.0  # OpenAI: logit -= f * (times the token is in the answer so far)
    presence_penalty: float = 0.0  # OpenAI: logit -= p * (the token is in the answer so far)
    no_repeat_ngram_size: int = 0  # transformers: never repeat an n-gram of prompt + answer (0 = off)
    # Diffusion: commit nothing right of the leftmost candidate whose best token is the stop token (those
    # positions are discarded if the stop is committed). Off: the paper's rule, token for token.
    stop_guard: bool = False
    # Keep, for every committed token, the k most likely tokens of the distribution it was committed from (the
    # server's top_logprobs; Token.top). 0: none, nothing computed.
    top_logprobs: int = 0

    def validate(self) -> "DecodeConfig":
        """Raise ConfigError naming the first field outside its allowed values."""
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {', '.join(MODES)} (got {self.mode!r})")
        if not is_int(self.block_size) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError("block_size", f"must be an integer in [1, {MAX_BLOCK_SIZE}] (got {self.block_size!r})")
        if not is_int(self.sub_block_size) or not 1 <= self.sub_block_size <= self.block_size:
            raise ConfigError("sub_block_size", f"must be an integer in [1, block_size={self.block_size}] (got {self.sub_block_size!r})")
        if self.block_size % self.sub_block_size:
            divisors = [d for d in range(1, self.block_size + 1) if self.block_size % d == 0]
            raise ConfigError("sub_block_size", f"must divide block_size={self.block_size}; allowed: {divisors} (got {self.sub_block_size})")
        if not is_num(self.threshold) or not 0.0 < self.threshold <= 1.0:
            raise ConfigError("threshold", f"must be a number in (0, 1] (got {self.threshold!r})")
        if self.strategy not in STRATEGIES:
            raise ConfigError("strategy", f"must be one of {', '.join(STRATEGIES)} (got {self.strategy!r})")
        if not is_num(self.factor) or not 0.0 < self.factor <= 100.0:
            raise ConfigError("factor", f"must be a number in (0, 100] (got {self.factor!r})")
        if self.cache not in CACHE_MODES:
            raise ConfigError("cache", f"must be one of {', '.join(CACHE_MODES)} (got {self.cache!r})")
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ConfigError("max_new_tokens", f"must be an integer in [1, {MAX_NEW_TOKENS_LIMIT}] (got {self.max_new_tokens!r})")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 10.0:
            raise ConfigError("temperature", f"must be a number in [0, 10] (0 = greedy) (got {self.temperature!r})")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be a number in (0, 1] (got {self.top_p!r})")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ConfigError("seed", f"must be empty or an integer in [0, 2^63) (got {self.seed!r})")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ConfigError("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off, "
                                                    f">1 discourages repeats) (got {self.repetition_penalty!r})")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -MAX_FREQ_PRES_PENALTY <= v <= MAX_FREQ_PRES_PENALTY:
                raise ConfigError(name, f"must be a number in [-{MAX_FREQ_PRES_PENALTY:g}, {MAX_FREQ_PRES_PENALTY:g}] "
                                        f"(0 = off, >0 discourages repeats) (got {v!r})")
        if not is_int(self.no_repeat_ngram_size) or not 0 <= self.no_repeat_ngram_size <= MAX_NO_REPEAT_NGRAM:
            raise ConfigError("no_repeat_ngram_size", f"must be an integer in [0, {MAX_NO_REPEAT_NGRAM}] (0 = off) "
                                                      f"(got {self.no_repeat_ngram_size!r})")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}] (0 = none) "
                                              f"(got {self.top_logprobs!r})")
        if not isinstance(self.stop_guard, bool):
            raise ConfigError("stop_guard", f"must be true or false (got {self.stop_guard!r})")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids", f"must be non-negative integers (got {self.stop_token_ids!r})")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DecodeConfig":
        """Build from a dict (trace header, API call); unknown keys are an error."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(unknown[0], f"unknown setting; known: {', '.join(sorted(names))}")
        d = dict(d)
        if "stop_token_ids" in d:
            d["stop_token_ids"] = tuple(d["stop_token_ids"] or ())
        return cls(**d)


def fit_to_context(ids: list[list[int]], cfg: DecodeConfig, max_context: int) -> DecodeConfig:
    """Refuse empty or too-long prompts; clip max_new_tokens to the room the longest prompt leaves."""
    for i, p in enumerate(ids):
        if not p:
            raise ConfigError("prompt", f"prompt {i} is empty")
        room = max_context - len(p)
        if room < 1:
            raise ConfigError("prompt", f"prompt {i} has {len(p)} tokens; the model's context is {max_context}")
        if cfg.max_new_tokens > room:
            cfg = replace(cfg, max_new_tokens=room)
    return cfg
