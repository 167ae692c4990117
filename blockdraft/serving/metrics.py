"""The server's metrics, in a Prometheus registry of the app's own (not the process-global one, so
two apps in one process, as in the tests and bench-serve, count apart).

Every label value comes from a fixed set: the endpoint is one of `ROUTES` or "other" (a path is
whatever an unauthenticated client sends: as a label it would grow the series without bound), the
status an HTTP status code. prometheus_client escapes label values and writes the text format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})
OTHER_ROUTE = "other"
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def route_label(path: str) -> str:
    return path if path in ROUTES else OTHER_ROUTE


class Metrics:
    """Written from the event loop (requests) and the engine worker (steps, cancellations);
    prometheus_client's metrics are thread-safe."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blockdraft_requests", "Requests by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("blockdraft_prompt_tokens", "Prompt tokens of completed requests.", registry=r)
        self.completion_tokens = Counter("blockdraft_completion_tokens", "Generated tokens.", registry=r)
        self.cancelled = Counter("blockdraft_cancelled", "Requests whose client left before the end.", registry=r)
        self.failed = Counter("blockdraft_failed", "Requests that ended with an engine error.", registry=r)
        self.queue_depth = Gauge("blockdraft_queue_depth", "Requests waiting for the engine.", registry=r)
        self.running = Gauge("blockdraft_running", "Requests being decoded (the batch).", registry=r)
        self.tau = Histogram("blockdraft_tau", "Mean acceptance length per completed request.",
                             buckets=TAU_BUCKETS, registry=r)
        self.latency = Histogram("blockdraft_request_latency_seconds",
                                 "Time from arrival to the last token, queueing included.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("blockdraft_batch_size", "Sequences in each decode step.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.step_tokens = Histogram("blockdraft_step_tokens", "Tokens the target verified per decode step, "
                                     "all sequences together.", buckets=STEP_TOKEN_BUCKETS, registry=r)

    def count(self, path: str, status: int) -> None:
        self.requests.labels(route_label(path), str(status)).inc()

    def completed(self, prompt_tokens: int, completion_tokens: int, tau: float, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.tau.observe(tau)
        self.latency.observe(seconds)

    def step(self, sequences: int, tokens: int) -> None:
        self.batch_size.observe(sequences)
        self.step_tokens.observe(tokens)

    def watch(self, queue_depth, running) -> None:
        """Read the two gauges from these callables at each scrape (the scheduler's own counts)."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)

    def render(self) -> bytes:
        return generate_latest(self.registry)
