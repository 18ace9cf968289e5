"""Prometheus metrics of the segment store, on SGLang's ``/metrics`` with ``--enable-metrics``.

Created as SGLang 0.5.17 creates its scheduler metrics (``sglang.srt.observability.
metrics_collector``): ``prometheus_client`` metrics built in the scheduler process after
SGLang has set ``PROMETHEUS_MULTIPROC_DIR``, so the values go to the multiprocess directory
that the HTTP server's ``/metrics`` collects. Only the attention-TP rank 0 scheduler exports
(every rank makes the same decisions), unless ``--enable-metrics-for-all-schedulers``.

| metric                                | type    | meaning                                   |
| ------------------------------------- | ------- | ----------------------------------------- |
| ``redknot_segment_hits_total``        | counter | lookups that found a ready segment        |
| ``redknot_segment_misses_total``      | counter | lookups that did not                      |
| ``redknot_segment_hit_tokens_total``  | counter | tokens served by hits                     |
| ``redknot_segment_bytes_saved_total`` | counter | K/V bytes served by hits (store docstring) |
| ``redknot_segment_evictions_total``   | counter | segments evicted to make room             |
| ``redknot_segment_captures_total``    | counter | segments stored by a capture on miss      |
| ``redknot_segment_count``             | gauge   | cached segments                           |
| ``redknot_segment_pinned``            | gauge   | cached pinned segments                    |
| ``redknot_segment_bytes_used``        | gauge   | region bytes held (whole pages)           |
| ``redknot_segment_capacity_bytes``    | gauge   | size of the segment region                |

Labels: SGLang's ``model_name`` and ``tp_rank`` (plus ``--extra-metric-labels``), and
``namespace`` on all but the capacity. Namespaces come from clients, so the label is bounded:
the first ``MAX_NAMESPACE_LABELS`` namespaces that register a segment get their own value, every
other namespace (and lookups in a namespace that never registered) reports as ``_other``.
Per-namespace values of every namespace remain available through ``SegmentStore.stats``.
Segment ids are never labels. Automatic chunks (``--redknot-auto-segments cdc``) are the
``namespace="auto"`` series: their hits, misses and captures.
"""

from __future__ import annotations

from typing import Any

MAX_NAMESPACE_LABELS = 16
OTHER_NAMESPACE = "_other"


class SegmentMetrics:
    """The ``SegmentObserver`` that writes the store's events to Prometheus metrics."""

    def __init__(self, labels: dict[str, str], capacity_bytes: int, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.labels = dict(labels)
        names = [*self.labels, "namespace"]
        self._named: set[str] = set()
        # each metric's labelled child per namespace label, made once (prometheus_client's
        # labels() takes a lock and builds the key on every call; a marked request looks up
        # each of its segments on the scheduler's path to its prefill)
        self._children: dict[tuple[int, str], Any] = {}

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labelnames=names, registry=registry)

        def gauge(name: str, doc: str, labelnames: list[str] = names) -> Any:
            return Gauge(
                name, doc, labelnames=labelnames, registry=registry, multiprocess_mode="livesum"
            )

        self.hits = counter("redknot_segment_hits_total", "Segment lookups that hit.")
        self.misses = counter("redknot_segment_misses_total", "Segment lookups that missed.")
        self.hit_tokens = counter("redknot_segment_hit_tokens_total", "Tokens served by hits.")
        self.bytes_saved = counter(
            "redknot_segment_bytes_saved_total", "K/V bytes served by segment hits."
        )
        self.evictions = counter("redknot_segment_evictions_total", "Segments evicted.")
        self.captures = counter(
            "redknot_segment_captures_total", "Segments stored by a capture on miss."
        )
        self.segments = gauge("redknot_segment_count", "Cached segments.")
        self.pinned = gauge("redknot_segment_pinned", "Cached pinned segments.")
        self.bytes_used = gauge("redknot_segment_bytes_used", "Segment region bytes held.")
        self.capacity = gauge(
            "redknot_segment_capacity_bytes", "Size of the segment region.", list(self.labels)
        )
        self.capacity.labels(**self.labels).set(capacity_bytes)

    def namespace_label(self, namespace: str, *, claim: bool = False) -> str:
        """The label value of ``namespace``; ``claim``: give it its own value if one is left."""
        if namespace in self._named:
            return namespace
        if claim and len(self._named) < MAX_NAMESPACE_LABELS:
            self._named.add(namespace)
            return namespace
        return OTHER_NAMESPACE

    def _child(self, metric: Any, label: str) -> Any:
        """``metric`` labelled with this exporter's labels and namespace label ``label``."""
        key = (id(metric), label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, namespace=label)
        return child

    # ---- SegmentObserver -----------------------------------------------------------------------

    def lookup(self, namespace: str, hits: int, misses: int, tokens: int, bytes_saved: int) -> None:
        label = self.namespace_label(namespace)
        if hits:
            self._child(self.hits, label).inc(hits)
            self._child(self.hit_tokens, label).inc(tokens)
            self._child(self.bytes_saved, label).inc(bytes_saved)
        if misses:
            self._child(self.misses, label).inc(misses)

    def evicted(self, namespace: str) -> None:
        self._child(self.evictions, self.namespace_label(namespace)).inc()

    def captured(self, namespace: str) -> None:
        self._child(self.captures, self.namespace_label(namespace, claim=True)).inc()

    def usage(self, namespace: str, segments: int, pinned: int, bytes_used: int) -> None:
        label = self.namespace_label(namespace, claim=segments > 0)
        if segments:
            self._child(self.segments, label).inc(segments)
        if pinned:
            self._child(self.pinned, label).inc(pinned)
        if bytes_used:
            self._child(self.bytes_used, label).inc(bytes_used)


def scheduler_metrics(capacity_bytes: int) -> SegmentMetrics | None:
    """The exporter of this scheduler process, or None where it does not export (not rank 0)."""
    from sglang.srt.runtime_context import get_parallel, get_server_args

    server_args = get_server_args()
    tp_rank = get_parallel().attn_tp_rank
    if tp_rank != 0 and not server_args.enable_metrics_for_all_schedulers:
        return None
    labels = {"model_name": str(server_args.served_model_name), "tp_rank": str(tp_rank)}
    labels.update({k: str(v) for k, v in (server_args.extra_metric_labels or {}).items()})
    return SegmentMetrics(labels, capacity_bytes)
