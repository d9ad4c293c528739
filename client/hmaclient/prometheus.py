"""hmad's metric families (the ``metrics`` reply) as Prometheus metrics, through prometheus_client.

    registry = CollectorRegistry()
    registry.register(FamiliesCollector(await client.metrics()))
    text = generate_latest(registry)

Used by ``hmactl metrics --prometheus`` and the OpenAI gateway's ``/metrics``. prometheus_client is an
optional dependency (hmaclient's ``prometheus`` extra, which hmad's ``openai`` extra brings): import this
module only where it is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

PREFIX = "hmad_"


class FamiliesCollector(Collector):
    """A collector that yields the given families once per scrape (``hmad_`` + name; counters get
    ``_total``)."""

    def __init__(self, families: list[dict[str, Any]], prefix: str = PREFIX):
        self.families, self.prefix = families, prefix

    def collect(self) -> Iterator[Metric]:
        for fam in self.families:
            metric = to_metric(fam, self.prefix)
            if metric is not None:
                yield metric


def to_metric(fam: dict[str, Any], prefix: str = PREFIX) -> Metric | None:
    """One family of the wire format -> a prometheus_client metric family (None for an unknown type)."""
    name, help, samples = prefix + fam["name"], fam.get("help", ""), fam["samples"]
    names = sorted({k for s in samples for k in s.get("labels", {})})
    kind = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
    if fam["type"] not in kind:
        return None
    metric = kind[fam["type"]](name, help, labels=names)
    for s in samples:
        values = [str(s.get("labels", {}).get(k, "")) for k in names]
        if fam["type"] == "histogram":
            buckets = [[_le(b), n] for b, n in zip(s["bounds"], s["buckets"], strict=True)]
            buckets.append(["+Inf", s["count"]])
            metric.add_metric(values, buckets, s["sum"])
        else:
            metric.add_metric(values, s["value"])
    return metric


def exposition(families: list[dict[str, Any]], prefix: str = PREFIX) -> str:
    """The families in Prometheus' text format (version 0.0.4)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamiliesCollector(families, prefix))
    return generate_latest(registry).decode()


def _le(bound: float) -> str:
    return repr(float(bound))
