"""Decoding a batch of prompts: the AR baseline (ar.py) and Fast-dLLM v2 block diffusion (diffusion.py), over the
bookkeeping they share (base.py, rows.py). `decoder_for` picks the decoder of a DecodeConfig's mode."""
from __future__ import annotations

from typing import Any

from ..config import DecodeConfig
from ..model import CausalLM
from ..text import TokenBytes
from .ar import ARDecoder
from .base import Decoder
from .rows import Batch, Cancel, Row
from .diffusion import DiffusionDecoder

__all__ = ["ARDecoder", "Batch", "Cancel", "Decoder", "DiffusionDecoder", "Row", "decoder_for",
           "keeps_cache"]


def _kind(cfg: DecodeConfig) -> type[Decoder]:
    return DiffusionDecoder if cfg.mode == "diffusion" else ARDecoder


def decoder_for(model: CausalLM, cfg: DecodeConfig, mask_id: int | None, tb: TokenBytes, **kw: Any) -> Decoder:
    """The decoder of cfg.mode ('ar' or 'diffusion') for one batch; kw: listener, cancel, stepper."""
    return _kind(cfg)(model, cfg, mask_id, tb, **kw)


def keeps_cache(cfg: DecodeConfig) -> bool:
    """Whether cfg's decoder keeps a KV cache, without a model (the scheduler chunks only such prefills)."""
    return _kind(cfg).caches(cfg)
