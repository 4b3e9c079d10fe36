"""One studio server for the app and browser tests: the real default model on 127.0.0.1, a free port."""
from __future__ import annotations

import functools
import socket
from dataclasses import dataclass
from typing import Any

QUICK = {"max_new_tokens": 32}  # keep every decode in the tests short


@dataclass
class StudioServer:
    url: str
    engine: Any
    demo: Any

    @property
    def mode(self) -> str:
        """The mode a chat turn runs in: diffusion once the adapter is there, else the AR baseline."""
        return "diffusion" if self.engine.can_diffuse else "ar"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def studio_server() -> StudioServer:
    """Launched once per test process (both test files share it); Gradio closes it at exit."""
    from app.studio import Studio
    from app.ui import build, launch_kwargs
    from engine import Engine

    engine = Engine.load()
    demo = build(Studio(engine))
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                        **launch_kwargs())
    return StudioServer(f"http://127.0.0.1:{port}/", engine, demo)
