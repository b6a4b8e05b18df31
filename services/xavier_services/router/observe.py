"""The router's request metrics and its one log line per request.

Counters name failures and cancels by reason (the ErrorInfo reason, or the cancel's cause), so an
operator sees at a glance whether peers fail, clients leave or the router sheds load. TTFT, TPOT (mean
time per output token after the first) and queue time are histograms by mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from xavier_core.runtime import get_logger

_log = get_logger("xavier.router.requests")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


@dataclass(frozen=True)
class ModeMetrics:
    """One mode's labelled children of the per-mode metrics. `labels()` checks and joins the labels
    under a lock at every call, and the router's read loop would pay that once per streamed step."""

    ttft: Histogram
    tpot: Histogram
    output_tokens: Counter


class RouterMetrics:
    """Prometheus metrics of the router's requests."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "xavier_router_requests",
            "Requests by mode and finish reason.",
            ("mode", "finish"),
            registry=registry,
        )
        self.active = Gauge("xavier_router_requests_active", "Requests being served.", registry=registry)
        self.queued = Gauge(
            "xavier_router_requests_queued", "Requests waiting for a serving slot.", registry=registry
        )
        self.ttft = Histogram(
            "xavier_router_ttft_seconds",
            "Time to first token (from arrival, queue time included).",
            ("mode",),
            registry=registry,
            buckets=_LATENCY,
        )
        self.tpot = Histogram(
            "xavier_router_tpot_seconds",
            "Mean time per output token after the first, per request.",
            ("mode",),
            registry=registry,
            buckets=_TPOT,
        )
        self.queue_time = Histogram(
            "xavier_router_queue_seconds",
            "Time a request waited for a serving slot.",
            registry=registry,
            buckets=_LATENCY,
        )
        self.output_tokens = Counter(
            "xavier_router_output_tokens",
            "Tokens generated and sent to clients.",
            ("mode",),
            registry=registry,
        )
        self.failures = Counter(
            "xavier_router_failures",
            "Requests that ended with an error, by ErrorInfo reason.",
            ("reason",),
            registry=registry,
        )
        self.cancels = Counter(
            "xavier_router_cancels",
            "Requests stopped before they finished, by cause (client, abort, shutdown).",
            ("reason",),
            registry=registry,
        )
        self.failovers = Counter(
            "xavier_router_failovers",
            "Requests moved to another peer after one failed before the first token.",
            registry=registry,
        )
        self.migrations = Counter(
            "xavier_router_migrations",
            "Requests moved to another pair after their decode failed or stalled mid-stream, by cause "
            "(unavailable, peer_gone, stalled).",
            ("cause",),
            registry=registry,
        )
        self.peer_down = Counter(
            "xavier_router_peer_down",
            "Times a peer was taken out of selection (refused, UNAVAILABLE or failed health).",
            ("role",),
            registry=registry,
        )
        self._modes: dict[str, ModeMetrics] = {}
        self._finished: dict[tuple[str, str], Counter] = {}

    def mode(self, name: str) -> ModeMetrics:
        """The children of mode `name`, looked up once (a handful of modes: the cache stays small)."""
        found = self._modes.get(name)
        if found is None:
            found = self._modes[name] = ModeMetrics(
                self.ttft.labels(name), self.tpot.labels(name), self.output_tokens.labels(name)
            )
        return found

    def finished(self, mode: str, finish: str) -> Counter:
        """The `requests` child of (`mode`, `finish`), looked up once per pair."""
        child = self._finished.get((mode, finish))
        if child is None:
            child = self._finished[(mode, finish)] = self.requests.labels(mode, finish)
        return child


@dataclass
class RequestRecord:
    """One request's facts for its log line (set as the request goes)."""

    request_id: str
    mode: str = ""
    peers: list[str] = field(default_factory=list)
    failed_peers: list[str] = field(default_factory=list)
    migrations: list[str] = field(default_factory=list)  # `Migration.describe()` of each move
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: str = "OK"
    cause: str = ""
    finish: str = ""
    queue_seconds: float = 0.0
    ttft: float | None = None
    duration: float = 0.0

    def log(self) -> None:
        """The request's one structured line (warning level when it failed)."""
        fields = {
            "request_id": self.request_id,
            "mode": self.mode,
            "peers": ",".join(self.peers),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "status": self.status,
            "finish": self.finish,
            "queue_s": round(self.queue_seconds, 4),
            "ttft_s": round(self.ttft, 4) if self.ttft is not None else None,
            "duration_s": round(self.duration, 4),
        }
        if self.failed_peers:
            fields["failed_peers"] = ",".join(self.failed_peers)
        if self.migrations:
            fields["migrations"] = ",".join(self.migrations)
        if self.cause:
            fields["reason"] = self.cause
        if self.status == "OK" or self.status == "CANCELLED":
            _log.info("request", **fields)
        else:
            _log.warning("request failed", **fields)


__all__ = ["ModeMetrics", "RequestRecord", "RouterMetrics"]
