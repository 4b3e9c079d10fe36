"""Every FASTDLLM_* environment switch, read in one place.

The names, meanings and defaults are documented in docs/engine.md ("Environment switches"); a test keeps that table,
this tuple and the code's reads equal. Values are read at call time (tests and benchmarks set them per run), with
surrounding white space removed; an unknown name is a KeyError, so a typo cannot silently read nothing.
"""
from __future__ import annotations

import os

NAMES = (
    "FASTDLLM_MODEL", "FASTDLLM_ADAPTER", "FASTDLLM_GGUF", "FASTDLLM_CACHE", "FASTDLLM_DTYPE", "FASTDLLM_THREADS",
    "FASTDLLM_WEIGHTS", "FASTDLLM_INT4_WIDE_ROWS", "FASTDLLM_ACTIVATIONS", "FASTDLLM_WIDE_ACTIVATIONS",
    "FASTDLLM_INT8_PREPACK", "FASTDLLM_KERNELS", "FASTDLLM_AMX", "FASTDLLM_FUSED",
    "FASTDLLM_PACK", "FASTDLLM_STATIC", "FASTDLLM_GRAPHS", "FASTDLLM_COMPILE", "FASTDLLM_PREFILL_CHUNK", "FASTDLLM_PREFIX_CACHE_MIB",
    "FASTDLLM_QUEUE_SIZE", "FASTDLLM_ENGINE_URL",
    "FASTDLLM_API_KEY", "FASTDLLM_UPDATE_SCREENSHOT",
)


def get(name: str, default: str = "") -> str:
    """The switch's value, stripped; `default` when it is unset or blank."""
    if name not in NAMES:
        raise KeyError(f"{name}: not a FASTDLLM switch (known: {', '.join(NAMES)})")
    value = os.environ.get(name, "").strip()
    return value or default
