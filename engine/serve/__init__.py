"""The OpenAI-compatible HTTP layer over the scheduler (app.py has the routes and what they serve).

request.py: limits, errors and request parsing; response.py: stop strings, rows, choices, logprobs, usage;
surface.py: request ids, the API key, JSON logs and metrics around every route; app.py: create_app and serve.
"""
from __future__ import annotations

from .app import create_app, serve
from .request import MAX_ECHO_DIFFUSION_TOKENS, MAX_JSON_DEPTH, ApiError, ApiRequest, parse

__all__ = ["ApiError", "ApiRequest", "MAX_ECHO_DIFFUSION_TOKENS", "MAX_JSON_DEPTH", "create_app", "parse", "serve"]
