"""The Conductor's Prometheus metrics (names are part of the autoscaler's contract).

The load gauges are set at scrape time from the instances' latest load reports
(`observe_pools`), over the instances in rotation only (a draining or unready one is leaving):

- `mooncake_conductor_queue_tokens{role}`: tokens waiting at the instances of a role: prompt
  tokens queued or being computed (prefill), context tokens of sequences waiting for a batch
  slot (decode). Before decode reported tokens, its decode series was a count of sequences.
- `mooncake_conductor_decode_load_tokens`: what the decode instances hold and have waiting, in
  KV tokens: (capacity - free) + the decode queue above. The autoscaler divides it by
  `targetQueueTokensPerDecode`; a running sequence counts what its KV holds, so a decode pool
  busy with long generations shows as loaded even when nothing waits.

Instances and failures (how a partition shows):

- `mooncake_conductor_instances{role,state}`: instances by state, `ready` (routed to),
  `unreachable` (its load polls time out or find nothing listening: a partitioned host, a dead
  or paused process), `unready` (it answers but is loading, draining, serves another
  tokenizer, or just failed a request), `stage` (a prefill group's later stage: never a target,
  reached through its leader) or `incomplete` (a prefill group's leader while a stage is
  missing: the group is out of rotation until it is whole).
- `mooncake_conductor_reroutes_total{role,cause}`: calls the Conductor gave up on one instance,
  moving the request to another (a retry before the client saw output, a resume after):
  `cause` is `unreachable` (abandoned: the instance stopped answering its polls while the call
  waited) or the gRPC status the call failed with (`unavailable`, `deadline_exceeded`, ...),
  prefixed `group_` when the instance was a prefill group's leader (`group_unavailable`: a
  stage died or was partitioned mid-prompt; the request went to another target), `stalled`
  for a decode stream that sent nothing within `--stream-stall-timeout` mid-stream.
- `mooncake_conductor_stream_stalls_total`: decode streams abandoned at the per-token deadline
  (`--stream-stall-timeout`; a frozen or partitioned decode) and resumed by failover.

Drain with KV handoff:

- `mooncake_conductor_handoffs_total{outcome}`: streams a draining decode handed over: `ok`
  (continued on another decode from the KV it stored, no prefill call), `fallback` (that
  failed before a token; resumed by failover instead), `failed` (no instance to continue on).
- `mooncake_conductor_handoff_stall_seconds`: what the client waited at a handoff, from its
  last token before to its first token from the new decode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from mooncake_k8s.common.rpc import serving_pb2 as pb
    from mooncake_k8s.conductor.serving.instances import Instance

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RESUME_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INSTANCE_STATES = ("ready", "unready", "unreachable", "stage", "incomplete")
"""`Instance.state`'s values, each exported (at 0 too) for every role."""


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
        self.decode_load_tokens = Gauge(
            "mooncake_conductor_decode_load_tokens",
            "KV tokens held by the decode instances plus context tokens waiting there",
            registry=r)
        self.instances = Gauge("mooncake_conductor_instances", "Instances by role and state",
                               ["role", "state"], registry=r)
        self.retries = Counter("mooncake_conductor_retries_total",
                               "Requests that needed another attempt", registry=r)
        self.reroutes = Counter(
            "mooncake_conductor_reroutes_total",
            "Calls given up on an instance (failed, or abandoned as unreachable) whose request "
            "went on to another instance", ["role", "cause"], registry=r)
        for role in ("prefill", "decode"):  # exported (at 0) before the first partition
            self.reroutes.labels(role, "unreachable")
        self.reroutes.labels("prefill", "group_unavailable")
        self.reroutes.labels("decode", "stalled")
        self._stalls_and_handoffs(r)
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

    def _stalls_and_handoffs(self, r: CollectorRegistry) -> None:
        """The per-token deadline's and the drain handoff's series (module doc)."""
        self.stream_stalls = Counter(
            "mooncake_conductor_stream_stalls_total",
            "Decode streams abandoned for sending nothing within the per-token deadline "
            "(--stream-stall-timeout), then resumed by failover", registry=r)
        self.handoffs = Counter(
            "mooncake_conductor_handoffs_total",
            "Streams a draining decode handed over: continued from its KV (ok), by failover "
            "instead (fallback), or not at all (failed)", ["outcome"], registry=r)
        for outcome in ("ok", "fallback", "failed"):
            self.handoffs.labels(outcome)
        self.handoff_stall = Histogram(
            "mooncake_conductor_handoff_stall_seconds",
            "A handed-over stream's gap: the client's last token before the handoff until its "
            "first from the new decode instance", buckets=_STALL_BUCKETS, registry=r)

    def observe_pools(self, prefills: Iterable[Instance], decodes: Iterable[Instance]) -> None:
        """Set the instance and load gauges from the latest load reports (at scrape time)."""
        for role, pool in (("prefill", list(prefills)), ("decode", list(decodes))):
            ok = [i for i in pool if i.usable]
            for state in INSTANCE_STATES:
                self.instances.labels(role, state).set(sum(i.state == state for i in pool))
            reports = [i.report for i in ok if i.report is not None]
            self.queue_tokens.labels(role).set(sum(r.queued_tokens for r in reports))
            if role == "decode":
                self.decode_load_tokens.set(decode_load_tokens(reports))


def decode_load_tokens(reports: Iterable[pb.LoadReport]) -> int:
    """KV tokens the decode instances hold plus the context tokens waiting for their batch."""
    return sum(max(0, r.kv_capacity_tokens - r.kv_free_tokens) + r.queued_tokens
               for r in reports)
