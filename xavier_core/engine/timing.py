"""Where a request's time to first token goes inside the reference engine, as Prometheus counters.

`xavier_engine_first_token_seconds{phase}` adds up, over every request that streams its first token
from the engine (generate and unified requests; a decode's first token comes with the request), the
seconds of each phase, and `xavier_engine_first_tokens` counts those requests:

* `prefix`: the stream's start (the RPC's request validated) to the request queued for the engine
  thread: a grammar's compile, the local prefix-cache match and the page store fetch.
* `queue`: queued to the start of the first engine step that computes any of it.
* `compute`: that step's start to the end of the step that sampled its first token (every chunk of
  its prompt, and the steps of other requests between them).
* `handback`: the end of that step to the event loop holding the token.
* `total`: the stream's start to the event loop holding the token (the phases above together).

A caller that runs one request at a time reads one request's phases as the difference of two readings
(`benchmarks/pagestore.py` does, per case).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from xavier_core.metrics_once import made_once

PHASES = ("prefix", "queue", "compute", "handback", "total")


@dataclass(frozen=True)
class _Metrics:
    seconds: Counter
    requests: Counter


def _make(reg: CollectorRegistry) -> _Metrics:
    return _Metrics(
        Counter(
            "xavier_engine_first_token_seconds",
            "Seconds of the reference engine's requests before their first token, per phase.",
            ("phase",),
            registry=reg,
        ),
        Counter(
            "xavier_engine_first_tokens",
            "Requests whose first token the reference engine streamed (the phases' count).",
            registry=reg,
        ),
    )


_metrics = made_once(_make)


def record_first_token(started: float, queued: float, scheduled: float, sampled: float, held: float) -> None:
    """Adds one request's phases (`time.perf_counter` readings, in order) to the counters."""
    m = _metrics()
    for phase, seconds in (
        ("prefix", queued - started),
        ("queue", scheduled - queued),
        ("compute", sampled - scheduled),
        ("handback", held - sampled),
        ("total", held - started),
    ):
        m.seconds.labels(phase).inc(max(0.0, seconds))
    m.requests.inc()
