"""/metrics of a replica set: each replica's Prometheus text, merged with a `replica` label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """One exposition of every replica's families; each sample gains replica="NAME".

    texts: replica name -> its Prometheus text ("" for one never read). A family appears
    once, with the samples of every replica that has it.
    """
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica},
                                  sample.value, sample.timestamp, sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector that yields the given families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


class ReplicaSetMetrics:
    """What build_app's `metrics` needs (`render()`), over a ReplicaFront's snapshots."""

    def __init__(self, front) -> None:
        self.front = front

    def render(self) -> bytes:
        return self.front.metrics_text()
