"""The broker's serving metrics (issue 14): requests and tokens by deployment, time to first token and
inter-token latency, batch sizes and times, queue depth. ``BrokerMetrics.serving`` is one of these, and it
is the ``ServingObserver`` the HTTP API and the batchers report to.

Series per deployment are removed by ``forget_deployment`` when it is undeployed (a broker serves at most
a handful at once, so the ``deployment`` label stays bounded).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/infer", "/v1/models")


class ServingMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "fusionnet_serving_requests_total",
            "HTTP API requests by deployment, endpoint and status code",
            ["deployment", "endpoint", "code"],
            registry=r,
        )
        self.tokens = Counter(
            "fusionnet_serving_tokens_total",
            "Tokens by deployment; kind: prompt|completion",
            ["deployment", "kind"],
            registry=r,
        )
        self.first_token = Histogram(
            "fusionnet_serving_time_to_first_token_seconds",
            "Time from a completion's start to its first generated token",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "fusionnet_serving_inter_token_seconds",
            "Time between two generated tokens of one choice",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "fusionnet_serving_batch_rows",
            "Rows (samples, or sessions' tokens) per batch sent through the pipeline",
            ["deployment"],
            buckets=BATCH_ROW_BUCKETS,
            registry=r,
        )
        self.batch_duration = Histogram(
            "fusionnet_serving_batch_duration_seconds",
            "Wall time of one batch through every sub-DAG of the deployment",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batches_failed = Counter(
            "fusionnet_serving_batches_failed_total",
            "Batches whose requests got an error or were run again one by one (not in the batch histograms)",
            ["deployment"],
            registry=r,
        )
        self.sessions_missed = Counter(
            "fusionnet_serving_sessions_missed_total",
            "Generation sessions a batch waited for in vain (a stalled stream; not waited for again)",
            ["deployment"],
            registry=r,
        )
        self.queue_rows = Gauge(
            "fusionnet_serving_queue_rows",
            "Rows waiting for a batch, by deployment",
            ["deployment"],
            registry=r,
        )
        self.kv_slots = Gauge(
            "fusionnet_serving_kv_cache_slots_in_use",
            "KV-cache slots held by live generation sessions, by deployment (KV-cached deployments)",
            ["deployment"],
            registry=r,
        )
        self.deployments = Gauge(
            "fusionnet_serving_deployments", "Deployments this broker serves", registry=r
        )
        # per deployment, the other labels its request and token series were made with: all removed
        # with it (``forget_deployment``)
        self._labelled: dict[str, set[tuple[Counter, tuple[str, ...]]]] = {}
        # undeployed names: a request still being answered when its deployment went must not bring
        # the series back (until a deployment of that name is served again, ``serve_deployment``)
        self._gone: set[str] = set()

    def _series(self, metric: Counter, deployment: str, *labels: str) -> Counter:
        self._labelled.setdefault(deployment, set()).add((metric, labels))
        return metric.labels(deployment, *labels)

    def observe_deployments(self, count: int) -> None:
        self.deployments.set(count)

    def observe_kv_slots(self, deployment: str, in_use: int) -> None:
        if deployment not in self._gone:
            self.kv_slots.labels(deployment=deployment).set(in_use)

    def serve_deployment(self, deployment: str) -> None:
        self._gone.discard(deployment)

    # ---- ``ServingObserver`` ---------------------------------------------------------------------
    def observe_request(self, deployment: str, endpoint: str, status: int) -> None:
        if deployment in self._gone:
            return
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        self._series(self.requests, deployment, endpoint, str(status)).inc()

    def observe_tokens(self, deployment: str, prompt: int, completion: int) -> None:
        if deployment in self._gone:
            return
        self._series(self.tokens, deployment, "prompt").inc(prompt)
        self._series(self.tokens, deployment, "completion").inc(completion)

    def observe_first_token(self, deployment: str, seconds: float) -> None:
        if deployment in self._gone:
            return
        self.first_token.labels(deployment=deployment).observe(max(0.0, seconds))

    def observe_inter_token(self, deployment: str, seconds: float) -> None:
        if deployment in self._gone:
            return
        self.inter_token.labels(deployment=deployment).observe(max(0.0, seconds))

    def observe_batch(
        self,
        deployment: str,
        rows: int,
        seconds: float,
        queued_rows: int,
        kv_slots: int | None = None,
        missed_sessions: int = 0,
        *,
        failed: bool = False,
    ) -> None:
        """One batch's figures; a failed batch is only counted: its time and rows would skew the
        served batches' histograms (a failover's batch waits out a re-placement)."""
        if deployment in self._gone:
            return
        self.sessions_missed.labels(deployment=deployment).inc(missed_sessions)
        if failed:
            self.batches_failed.labels(deployment=deployment).inc()
        else:
            self.batch_rows.labels(deployment=deployment).observe(rows)
            self.batch_duration.labels(deployment=deployment).observe(max(0.0, seconds))
        self.queue_rows.labels(deployment=deployment).set(queued_rows)
        if kv_slots is not None:
            self.kv_slots.labels(deployment=deployment).set(kv_slots)

    def forget_deployment(self, deployment: str) -> None:
        self._gone.add(deployment)
        for metric in (
            self.first_token,
            self.inter_token,
            self.batch_rows,
            self.batch_duration,
            self.batches_failed,
            self.sessions_missed,
            self.queue_rows,
            self.kv_slots,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(deployment)
        for counter, labels in self._labelled.pop(deployment, set()):
            with contextlib.suppress(KeyError):
                counter.remove(deployment, *labels)
