"""The Conductor's Prometheus metrics (names are part of the autoscaler's contract)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_RESUME_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ConductorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mooncake_conductor_requests_total", "Requests by outcome",
                                ["endpoint", "status"], registry=r)
        self.rejections = Counter("mooncake_conductor_rejections_total",
                                  "Requests refused up front (429)", ["reason"], registry=r)
        self.ttft = Histogram("mooncake_conductor_ttft_seconds", "Time to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mooncake_conductor_tpot_seconds", "Time per output token",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("mooncake_conductor_e2e_seconds", "Request latency end to end",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mooncake_conductor_prompt_tokens_total",
                                     "Prompt tokens", registry=r)
        self.cached_tokens = Counter("mooncake_conductor_prompt_tokens_cached_total",
                                     "Prompt tokens served from the KV cache", registry=r)
        self.completion_tokens = Counter("mooncake_conductor_completion_tokens_total",
                                         "Generated tokens", registry=r)
        self.inflight = Gauge("mooncake_conductor_inflight_requests", "Requests running",
                              registry=r)
        self.ttft_headroom = Gauge(
            "mooncake_conductor_predicted_ttft_headroom_ms",
            "TTFT SLO minus the predicted TTFT of the latest routing decision", registry=r)
        self.queue_tokens = Gauge("mooncake_conductor_queue_tokens",
                                  "Tokens queued at the instances of a role", ["role"],
                                  registry=r)
        self.instances = Gauge("mooncake_conductor_instances", "Instances by role and state",
                               ["role", "state"], registry=r)
        self.retries = Counter("mooncake_conductor_retries_total",
                               "Requests that needed another attempt", registry=r)
        self.resumes = Counter(
            "mooncake_conductor_resumes_total",
            "Streams resumed on another decode instance after theirs failed mid-stream",
            ["outcome"], registry=r)
        for outcome in ("ok", "failed"):  # exported (at 0) before the first failure
            self.resumes.labels(outcome)
        self.resume_seconds = Histogram(
            "mooncake_conductor_resume_seconds",
            "Decode failover: failure detected until the first token from the new instance",
            buckets=_RESUME_BUCKETS, registry=r)
        self.header_timeouts = Counter(
            "mooncake_conductor_header_timeouts_total",
            "Connections closed for not sending a complete request head in time (slowloris)",
            registry=r)
