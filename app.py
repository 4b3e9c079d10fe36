"""Fast-dLLM v2 studio: `python app.py [--model M | --engine-url URL] [--host H] [--port P]` (also the Spaces entry point).

Model: --model, else FASTDLLM_MODEL, else on Hugging Face Spaces (SPACE_ID set) the real Fast-dLLM v2 1.5B
checkpoint, else the bundled SmolLM2-135M + Fast-dLLM v2 adapter that runs offline on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from engine.runtime import Runtime

try:  # Hugging Face ZeroGPU: `spaces` must be imported before torch touches CUDA
    import spaces  # type: ignore[import-not-found]  # noqa: F401
except ImportError:
    pass

SPACES_MODEL = "Efficient-Large-Model/Fast_dLLM_v2_1.5B"
# The studio's wide activations where FASTDLLM_WIDE_ACTIVATIONS is unset: int8 (1.23x faster diffusion on the bundled
# model). Measured with the studio's repetition knobs on, every answer measure was equal or better than bf16's; under
# the paper's plain rule (the engine's default for API callers, which keeps bf16) long answers looped more
# (bench/results/wide_int8/README.md).
STUDIO_WIDE_ACTIVATIONS = "int8"
# Its one-token (AR) steps take the engine's default int8 activations (engine/weights/int4.py DEFAULT_ACT), so with
# int8 wide ones every product reads the weights prepacked at load, with no second copy (bench/results/prepack/).


def default_model() -> str | None:
    """On Spaces the 1.5B checkpoint (unless FASTDLLM_MODEL says otherwise); elsewhere the engine's default."""
    if os.environ.get("SPACE_ID") and not Runtime.from_env().model:
        return SPACES_MODEL
    return None


def studio_runtime() -> Runtime:
    """The environment's switches, with the studio's own default for the wide activations."""
    runtime = Runtime.from_env()
    return dataclasses.replace(runtime, wide_activations=runtime.wide_activations or STUDIO_WIDE_ACTIVATIONS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fast-dLLM v2 studio: chat, live denoising view, replay, race, sweep.")
    p.add_argument("--model", default=None, help="hub id or local directory (default: bundled SmolLM2-135M + adapter; "
                                                  f"{SPACES_MODEL} on Hugging Face Spaces)")
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                   help="interface to listen on (default 127.0.0.1; 0.0.0.0 to share on a network)")
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), help="port (7860)")
    p.add_argument("--engine-url", default=Runtime.from_env().engine_url,
                   help="drive a remote `python -m engine serve` (e.g. http://gpu-host:8000) instead of loading a model "
                        "here (default: FASTDLLM_ENGINE_URL)")
    p.add_argument("--queue-size", type=int, default=None,
                   help="requests that may wait for the engine before new ones are refused as busy "
                        "(default: FASTDLLM_QUEUE_SIZE, else 16)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from app.studio import Studio
    from app.ui import build, launch_kwargs, queue_kwargs
    from engine import Engine

    queue = queue_kwargs(args.queue_size)  # a bad size fails before the model loads
    if args.engine_url:
        from app.backend import RemoteEngine

        engine = RemoteEngine(args.engine_url)
    else:
        engine = Engine.load(args.model or default_model(), runtime=studio_runtime())
    print(f"model: {engine.lm.banner()}", flush=True)
    build(Studio(engine)).queue(**queue).launch(server_name=args.host, server_port=args.port, **launch_kwargs())


if __name__ == "__main__":
    main()
