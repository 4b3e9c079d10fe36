"""Shared fixtures: the real bundled engine (loaded once) and small on-disk checkpoints."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's exactness tests (our forward == transformers, token for token) need the dequantised fp32
# weights; the 4-bit default path (engine/weights/quant.py) is tested in test_quant.py, which sets its own mode.
os.environ.setdefault("FASTDLLM_WEIGHTS", "fp32")


@pytest.fixture
def one_thread():
    """Tiny matmuls: thread hand-offs cost more than they save (and the CI CPU is shared)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def engine():
    """The default engine: bundled SmolLM2-135M + the trained adapter from assets/ (the studio's default)."""
    from engine import Engine

    eng = Engine.load()
    assert eng.can_diffuse, "the bundled model must ship its adapter (assets/fastdllm_adapter.safetensors)"
    return eng


@pytest.fixture(scope="session")
def tiny_fast_dllm(tmp_path_factory) -> Path:
    from checkpoints import build_fast_dllm_checkpoint

    return build_fast_dllm_checkpoint(tmp_path_factory.mktemp("fast_dllm_tiny"))


@pytest.fixture(scope="module")
def server():
    """A studio server on a free port (one per test module that asks for it; the process is cached)."""
    from conftest_app import studio_server

    return studio_server()


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server.url, verbose=False)
