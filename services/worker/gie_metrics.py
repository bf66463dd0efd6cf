"""The model-server metrics the Gateway API Inference Extension reads, on every worker.

GIE's endpoint picker (and autoscalers built on the same signals) scrape each model server for
three gauges, defined by its "model server protocol" (proposal 003): queued requests, running
requests and KV-cache utilisation. The protocol recommends vLLM's names, and pickers default
to them, so every worker exports exactly those names whatever its engine (embedded, vLLM,
SGLang):

- `vllm:num_requests_waiting`: requests the worker holds but has not started;
- `vllm:num_requests_running`: requests it is computing;
- `vllm:kv_cache_usage_perc`: the fraction (0..1, despite the name) of its KV cache in use.

All three come from the worker's own `LoadReport` (the one the Conductor polls), read at scrape
time, so the picker and the Conductor see the same numbers. How each role fills them:

- decode: the engine's batch (running) and the sequences waiting for a batch slot; KV use is
  1 - free / capacity of the engine's KV tokens;
- prefill: the report counts prompts queued or being computed together; the engine computes
  one prompt at a time, so one of them is running and the rest wait. A prefill worker keeps
  no KV between requests, so its KV use is 0.

`model_name` carries the served model, as vLLM labels these gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from mooncake_k8s.common.rpc import serving_pb2 as pb

QUEUED = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
NAMES = (QUEUED, RUNNING, KV_USAGE)


def gauges(report: pb.LoadReport) -> tuple[int, int, float]:
    """(queued, running, KV-cache use 0..1) of one worker, from its LoadReport."""
    if report.role == "prefill":
        pending = report.queued_requests
        queued, running = max(0, pending - 1), min(1, pending)
    else:
        # Decode reports `running` as the batch plus the waiting sequences.
        queued = report.waiting
        running = max(0, report.running - report.waiting)
    cap = report.kv_capacity_tokens
    used = 0.0 if cap == 0 else 1.0 - min(report.kv_free_tokens, cap) / cap
    return queued, running, used


class GieMetrics:
    """A prometheus_client collector over the worker's LoadReport (`report` builds one)."""

    def __init__(self, report: Callable[[], pb.LoadReport]) -> None:
        self.report = report

    def describe(self) -> list[Any]:
        return []  # read at scrape time: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rep = self.report()
        queued, running, used = gauges(rep)
        helps = (
            (QUEUED, "Requests waiting to be started (Gateway API Inference Extension: "
                     "TotalQueuedRequests)", queued),
            (RUNNING, "Requests being computed (Gateway API Inference Extension: "
                      "TotalRunningRequests)", running),
            (KV_USAGE, "Fraction of the KV cache in use, 0 to 1 (Gateway API Inference "
                       "Extension: KVCacheUtilization)", used),
        )
        for name, text, value in helps:
            fam = GaugeMetricFamily(name, text, labels=["model_name"])
            fam.add_metric([rep.model], float(value))
            yield fam
