"""The engine's Prometheus metrics, served on the side port (`metrics_listen`)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.core.api import EngineRequest, StepReport


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model"]
        self._model = model_name
        self.requests = Counter(
            "kvplane_engine_requests", "Accepted generation requests.", labels, registry=registry
        )
        self.pooling_requests = Counter(
            "kvplane_engine_pooling_requests",
            "Accepted Embed/Classify/Score requests.",
            [*labels, "task"],
            registry=registry,
        )
        self.pooling_input_tokens = Counter(
            "kvplane_engine_pooling_input_tokens",
            "Input tokens of accepted Embed/Classify/Score requests.",
            [*labels, "task"],
            registry=registry,
        )
        self.finished = Counter(
            "kvplane_engine_finished_outputs",
            "Finished outputs by reason.",
            [*labels, "reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvplane_engine_prompt_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=registry,
        )
        self.cached_prompt_tokens = Counter(
            "kvplane_engine_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            labels,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "kvplane_engine_generation_tokens", "Generated tokens.", labels, registry=registry
        )
        self.kv_event_batches = Counter(
            "kvplane_engine_kv_event_batches",
            "KV event batches published.",
            labels,
            registry=registry,
        )
        self.preemptions = Counter(
            "kvplane_engine_preemptions",
            "Sequences preempted (recompute).",
            labels,
            registry=registry,
        )
        self.running = Gauge(
            "kvplane_engine_running_sequences", "Running sequences.", labels, registry=registry
        )
        self.waiting = Gauge(
            "kvplane_engine_waiting_sequences", "Waiting sequences.", labels, registry=registry
        )
        self.kv_usage = Gauge(
            "kvplane_engine_kv_usage_ratio",
            "Fraction of KV blocks in use.",
            labels,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "kvplane_engine_step_seconds",
            "Duration of one engine step.",
            labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )

    def on_accept(self, _request: EngineRequest) -> None:
        self.requests.labels(self._model).inc()

    def on_task(self, task: str, input_tokens: int) -> None:
        self.pooling_requests.labels(self._model, task).inc()
        self.pooling_input_tokens.labels(self._model, task).inc(input_tokens)

    def on_report(
        self, report: StepReport, counted: Callable[[str], bool] = lambda _request_id: True
    ) -> None:
        """Count a step; outputs of requests `counted` says no to (the health probe's) are
        left out of the request figures."""
        m = self._model
        for output in report.result.outputs:
            if not counted(output.request_id):
                continue
            if output.new_token_ids:
                self.generation_tokens.labels(m).inc(len(output.new_token_ids))
            if output.finish_reason is not None:
                self.finished.labels(m, output.finish_reason.value).inc()
            if output.usage is not None:
                self.prompt_tokens.labels(m).inc(output.usage.prompt_tokens)
                self.cached_prompt_tokens.labels(m).inc(output.usage.cached_prompt_tokens)
        stats = report.result.stats
        if stats is not None:
            self.step_seconds.labels(m).observe(stats.duration_s)
            if stats.num_preempted:
                self.preemptions.labels(m).inc(stats.num_preempted)
        if report.kv_events:
            self.kv_event_batches.labels(m).inc()
        load = report.load
        self.running.labels(m).set(load.num_running)
        self.waiting.labels(m).set(load.num_waiting)
        self.kv_usage.labels(m).set(load.kv_usage)
