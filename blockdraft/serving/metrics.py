"""Server metrics in the Prometheus text format (no client library needed for a few series)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.n}', f"{self.name}_sum {self.total:.6g}",
                  f"{self.name}_count {self.n}"]
        return lines


class Metrics:
    """Updated from the event loop thread only, so no locks."""

    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tau = Histogram("blockdraft_tau", "Mean acceptance length per completed request.", TAU_BUCKETS)
        self.latency = Histogram("blockdraft_request_latency_seconds",
                                 "Time from arrival to the last token, queueing included.", LATENCY_BUCKETS)

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def completed(self, prompt_tokens: int, completion_tokens: int, tau: float, seconds: float) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.tau.observe(tau)
        self.latency.observe(seconds)

    def render(self, queue_depth: int, running: int, cancelled: int, extra: list[Histogram] = ()) -> str:
        """The text format; `extra`: histograms kept elsewhere (the scheduler's, per step)."""
        lines = ["# HELP blockdraft_requests_total Requests by endpoint and HTTP status.",
                 "# TYPE blockdraft_requests_total counter"]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'blockdraft_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        for name, value, kind, help_ in (
            ("blockdraft_prompt_tokens_total", self.prompt_tokens, "counter", "Prompt tokens of completed requests."),
            ("blockdraft_completion_tokens_total", self.completion_tokens, "counter", "Generated tokens."),
            ("blockdraft_cancelled_total", cancelled, "counter", "Requests whose client left before the end."),
            ("blockdraft_queue_depth", queue_depth, "gauge", "Requests waiting for the engine."),
            ("blockdraft_running", running, "gauge", "Requests being decoded (the batch)."),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += self.tau.render() + self.latency.render()
        for h in extra:
            lines += h.render()
        return "\n".join(lines) + "\n"
