"""What every front end needs of "an engine": one protocol for the in-process Engine and the studio's RemoteEngine.

The studio (app/), the CLI and the server call only these members, so the studio runs the same on a model loaded in
its own process and on `python -m engine serve` elsewhere (app/backend.py). tests/test_protocol.py checks that both
implementations have every member with the same parameters.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .config import DecodeConfig
from .events import Listener


@runtime_checkable
class DecodeEngine(Protocol):
    """A model that chat-encodes text and decodes token ids by AR or block diffusion, one event per forward."""

    lm: Any  # the loaded model's facts: name, source, device, dtype, mask_token_id, banner()
    max_context: int  # prompt + answer tokens the model takes
    can_diffuse: bool  # it has a mask token (a Fast-dLLM v2 model or adapter)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to messages, ready for the assistant's turn."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of text, no special tokens added."""
        ...

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """A validated DecodeConfig with the model's stop tokens filled in."""
        ...

    def check_ids(self, ids: list[list[int]], cfg: DecodeConfig) -> DecodeConfig:
        """cfg fitted to the context for these prompts (ConfigError naming the parameter when they cannot fit)."""
        ...

    def trace_header(self, ids: list[int], cfg: DecodeConfig, prompt: str | None) -> dict[str, Any]:
        """The header of a trace of this decode (what the live view and replay need before the first event)."""
        ...

    def generate_ids(self, ids: list[list[int]], cfg: DecodeConfig, *, listener: Listener | None = None,
                     cancel: Any = None, record: bool = True, prompt_texts: list[str] | None = None) -> list[Any]:
        """Decode each prompt; listener gets every Event; cancel (an object with is_set()) stops after the current
        forward; one Result (summary, trace when record) per prompt."""
        ...
