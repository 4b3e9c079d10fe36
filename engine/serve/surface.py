"""Around every route: request ids, the API key, one JSON log line per request, Prometheus metrics."""
from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any

from ..driver import Driver
from .request import ApiError

log = logging.getLogger("engine.serve")


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count), written by hand: no client library needed."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """What GET /metrics reports; updated by the request middleware on the event loop (no locks needed)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generated_tokens = 0
        self.ttft = Histogram((0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.latency = Histogram((0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def record(self, route: str, status: int, info: dict[str, Any], seconds: float) -> None:
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
        if "completion_tokens" not in info:  # not a completion that ran
            return
        self.prompt_tokens += info.get("prompt_tokens") or 0
        self.generated_tokens += info["completion_tokens"] or 0
        self.latency.observe(seconds)
        if info.get("ttft") is not None:
            self.ttft.observe(info["ttft"])

    def text(self, scheduler: Driver) -> str:
        p = "fastdllm_"
        out = [f"# HELP {p}requests_total HTTP requests answered, by route and status.", f"# TYPE {p}requests_total counter"]
        out += [f'{p}requests_total{{route="{r}",status="{c}"}} {n}' for (r, c), n in sorted(self.requests.items())]
        pc = scheduler.prefixes
        gauges = [("queue_length", "Requests waiting for a batch row.", len(scheduler.waiting)),
                  ("running_rows", "Rows in running batches after the scheduler's last pass.", scheduler.running),
                  ("prefix_cache_bytes", "Memory held by the prefix cache's K/V.", pc.bytes if pc else 0)]
        for name, about, v in gauges:
            out += [f"# HELP {p}{name} {about}", f"# TYPE {p}{name} gauge", f"{p}{name} {v}"]
        counters = [("prompt_tokens_total", "Prompt tokens of completed requests.", self.prompt_tokens),
                    ("generated_tokens_total", "Answer tokens generated (through the stop token); rate() = tokens/s.",
                     self.generated_tokens),
                    ("prefix_cache_queried_tokens_total", "Prompt positions of chunked prefills looked up in the prefix "
                     "cache.", pc.queried_tokens if pc else 0),
                    ("prefix_cache_hit_tokens_total", "Of those, positions whose K/V were copied, not prefilled.",
                     pc.hit_tokens if pc else 0)]
        for name, about, v in counters:
            out += [f"# HELP {p}{name} {about}", f"# TYPE {p}{name} counter", f"{p}{name} {v}"]
        for name, about, h in [("time_to_first_token_seconds", "Request arrival to its first committed answer token.",
                                self.ttft),
                               ("request_latency_seconds", "Request arrival to its last byte (completions).",
                                self.latency)]:
            out += [f"# HELP {p}{name} {about}", f"# TYPE {p}{name} histogram", *h.lines(p + name)]
        return "\n".join(out) + "\n"


class Surface:
    """ASGI middleware around every route: request id, API key, one JSON log line and the metrics per request."""

    def __init__(self, app: Any, api_key: str | None, metrics: Metrics, routes: set[str]):
        self.app, self.api_key, self.metrics, self.routes = app, api_key, metrics, routes

    def _authorized(self, scope: dict) -> bool:
        if not self.api_key or scope["path"] == "/health" or scope["method"] == "OPTIONS":
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        want = b"Bearer " + self.api_key.encode()
        return hmac.compare_digest(auth, want)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, t0 = uuid.uuid4().hex[:24], time.perf_counter()
        info: dict[str, Any] = {}
        scope.setdefault("state", {}).update(request_id=rid, t0=t0, log=info)
        status = 500

        async def send_(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg["headers"] = [*msg.get("headers", []), (b"x-request-id", rid.encode())]
            await send(msg)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_)
            else:
                await ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", None,
                               "invalid_api_key").response({"WWW-Authenticate": "Bearer"})(scope, receive, send_)
        finally:
            seconds = time.perf_counter() - t0
            route = scope["path"] if scope["path"] in self.routes else "other"  # bounded label set
            self.metrics.record(route, status, info, seconds)
            log.info(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "request_id": rid,
                                 "method": scope["method"], "route": route, "status": status,
                                 "prompt_tokens": info.get("prompt_tokens"), "cached_tokens": info.get("cached_tokens"),
                                 "completion_tokens": info.get("completion_tokens"), "seconds": round(seconds, 4),
                                 "ttft": None if info.get("ttft") is None else round(info["ttft"], 4),
                                 "finish_reason": info.get("finish_reason")}))


