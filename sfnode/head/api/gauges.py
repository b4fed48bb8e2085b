"""The gauges an inference gateway's endpoint picker reads, per model, from a head's
``/metrics`` (docs/architecture.md section 7).

The Gateway API Inference Extension's model-server protocol asks a model server for
Prometheus gauges of its queued requests, its running requests and its KV cache utilisation,
and names vLLM's metrics as the reference; an endpoint picker configured for vLLM reads them
under these names (one series per served model, labelled ``model_name`` as vLLM labels them):

- ``vllm:num_requests_waiting``: generations waiting: in the head's queue, and beyond the
  lanes of the nodes serving the model (their reported queue depth);
- ``vllm:num_requests_running``: generations decoding on the nodes serving the model;
- ``vllm:kv_cache_usage_perc`` and its older name ``vllm:gpu_cache_usage_perc``: KV blocks in
  use over KV blocks in total on those nodes, a fraction from 0 to 1 (1 means full), as vLLM
  reports it whatever the device.

A head is one model server to the gateway: a gateway in front of several heads picks the head
whose gauges are lowest for the request's model.  LoRA adapters, whose gauge
(``vllm:lora_requests_info``) the protocol lists as optional, do not exist here and are not
exported.

This module is pure: it must never read the fleet, a link or a clock; it turns
:class:`~sfnode.head.fleet.backend.BackendStatus` snapshots into metric families.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from sfnode.head.fleet.backend import BackendStatus

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
LABEL = "model_name"


def kv_usage(status: BackendStatus) -> float:
    """KV blocks in use over blocks in total on the nodes serving the model (0 when none
    reported any)."""
    if status.model_kv_blocks_total <= 0:
        return 0.0
    return min(1.0, status.model_kv_blocks_used / status.model_kv_blocks_total)


def gateway_gauges(statuses: Mapping[str, BackendStatus]) -> Iterable[Metric]:
    """The gateway's gauges, one series per model of ``statuses`` (model name to status)."""
    waiting = GaugeMetricFamily(
        WAITING,
        "Requests waiting for a lane, per model: in the head's queue and at its nodes.",
        labels=[LABEL],
    )
    running = GaugeMetricFamily(
        RUNNING, "Requests decoding on the nodes serving the model.", labels=[LABEL]
    )
    usage = GaugeMetricFamily(
        KV_USAGE,
        "KV cache usage of the nodes serving the model (1 means 100 percent).",
        labels=[LABEL],
    )
    usage_old = GaugeMetricFamily(
        KV_USAGE_OLD, f"The same as {KV_USAGE} (its older vLLM name).", labels=[LABEL]
    )
    for name, status in statuses.items():
        waiting.add_metric([name], float(status.model_waiting))
        running.add_metric([name], float(status.model_running))
        usage.add_metric([name], kv_usage(status))
        usage_old.add_metric([name], kv_usage(status))
    return [waiting, running, usage, usage_old]


__all__ = ["KV_USAGE", "KV_USAGE_OLD", "LABEL", "RUNNING", "WAITING", "gateway_gauges", "kv_usage"]
