"""Fast-dLLM v2 block-diffusion decoding engine."""
from .config import CACHE_MODES, MODES, STRATEGIES, ConfigError, DecodeConfig, ModelConfig
from .engine import Engine, Result
from .events import Event, Summary, Token, Trace

__all__ = ["CACHE_MODES", "MODES", "STRATEGIES", "ConfigError", "DecodeConfig", "ModelConfig", "Engine",
           "Result", "Event", "Summary", "Token", "Trace"]
