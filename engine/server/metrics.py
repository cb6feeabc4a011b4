"""The engine's Prometheus metrics, served on the side port (`metrics_listen`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.core.api import EngineRequest, KvImportOutcome, RequestOutput, StepReport

# How a DECODE engine's pull of a KV session ended: `refused` is a session it cannot use (or a
# malformed ref), `failed` the transfer itself (unreachable, too slow, malformed stream),
# `cancelled` the client gone, or the request aborted (Abort, a drain's deadline), during the pull.
PullOutcome = Literal["ok", "not_found", "refused", "failed", "cancelled"]
# What became of the blocks of a pull that ended "ok", exactly one per such pull: what the core
# did with them (`KvImportOutcome`), or why it never took them: `superseded` (the request's
# adapter loaded again with other weights meanwhile: not imported, as its own blocks are not
# cached), `aborted` (Abort or a drain's deadline between the pull's end and the submission),
# `refused` (the submission refused: the engine stopping, or the id in use), `failed` (the
# import raised: the request computes its prompt).
ImportOutcome = KvImportOutcome | Literal["superseded", "aborted", "refused", "failed"]

# A decode step takes milliseconds on a GPU; a prefill step of a full token budget takes
# seconds, and on a CPU engine (docs/benchmarks/e2e.md: about 800 tokens/s) tens of seconds.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5, 10, 30, 60)


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
        self.pooling_forward_tokens = Counter(
            "kvplane_engine_pooling_forward_tokens",
            "Input tokens that Embed/Classify/Score forwards ran through the model; a batch of a "
            "task aborted or cancelled before it began on the engine thread never runs.",
            [*labels, "task"],
            registry=registry,
        )
        self.overloaded = Counter(
            "kvplane_engine_overloaded_requests",
            "Requests refused before acceptance because max_queued_requests were queued, by "
            "task (generate, embed, classify, score).",
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
        self.kv_pulls = Counter(
            "kvplane_engine_kv_pulls",
            "KV session pulls of a DECODE engine, by outcome.",
            [*labels, "outcome"],
            registry=registry,
        )
        self.kv_pulled_blocks = Counter(
            "kvplane_engine_kv_pulled_blocks",
            "KV blocks a DECODE engine received in pulls that completed.",
            labels,
            registry=registry,
        )
        self.kv_imports = Counter(
            "kvplane_engine_kv_imports",
            "What became of a DECODE engine's completed pull's KV blocks, one outcome per pull: "
            "imported at once, held until the request is admitted (no room then), dropped (no "
            "room, and max_held_kv_bytes held already, or a duplicate request id: the request "
            "computes its prompt), unused (nothing to import), superseded (its adapter loaded "
            "again meanwhile), aborted (before its submission), refused (its submission), or "
            "failed (the import raised).",
            [*labels, "outcome"],
            registry=registry,
        )
        self.held_kv_bytes = Gauge(
            "kvplane_engine_held_kv_bytes",
            "Bytes of pulled KV a DECODE engine holds for requests waiting for room in its full "
            "pool (at most kv_transfer.max_held_kv_bytes).",
            labels,
            registry=registry,
        )
        self.open_kv_sessions = Gauge(
            "kvplane_engine_open_kv_sessions",
            "A PREFILL engine's KV sessions handed over and not yet pulled (their blocks held).",
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
            buckets=_STEP_BUCKETS,
            registry=registry,
        )

    def on_accept(self, _request: EngineRequest) -> None:
        self.requests.labels(self._model).inc()

    def on_task(self, task: str, input_tokens: int) -> None:
        self.pooling_requests.labels(self._model, task).inc()
        self.pooling_input_tokens.labels(self._model, task).inc(input_tokens)

    def on_pooling_forward(self, task: str, input_tokens: int) -> None:
        """A pooling batch of `task` ran (any thread: the engine thread counts it)."""
        self.pooling_forward_tokens.labels(self._model, task).inc(input_tokens)

    def on_overloaded(self, task: str) -> None:
        self.overloaded.labels(self._model, task).inc()

    def on_kv_import(self, outcome: ImportOutcome) -> None:
        """Any thread: the engine thread imports."""
        self.kv_imports.labels(self._model, outcome).inc()

    def on_pull(self, outcome: PullOutcome, num_blocks: int = 0) -> None:
        self.kv_pulls.labels(self._model, outcome).inc()
        if num_blocks:
            self.kv_pulled_blocks.labels(self._model).inc(num_blocks)

    def watch_held_kv_bytes(self, count: Callable[[], int]) -> None:
        """The held-bytes gauge reads `count()` at every scrape."""
        self.held_kv_bytes.labels(self._model).set_function(count)

    def watch_open_kv_sessions(self, count: Callable[[], int]) -> None:
        """The open-sessions gauge reads `count()` at every scrape."""
        self.open_kv_sessions.labels(self._model).set_function(count)

    def on_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """Count requests' outputs: their tokens, how they finished, their Usage."""
        m = self._model
        for output in outputs:
            if output.new_token_ids:
                self.generation_tokens.labels(m).inc(len(output.new_token_ids))
            if output.finish_reason is not None:
                self.finished.labels(m, output.finish_reason.value).inc()
            if output.usage is not None:
                self.prompt_tokens.labels(m).inc(output.usage.prompt_tokens)
                self.cached_prompt_tokens.labels(m).inc(output.usage.cached_prompt_tokens)

    def on_report(
        self, report: StepReport, counted: Callable[[str], bool] = lambda _request_id: True
    ) -> None:
        """Count a step; outputs of requests `counted` says no to (the health probe's) are
        left out of the request figures."""
        m = self._model
        self.on_outputs(output for output in report.result.outputs if counted(output.request_id))
        stats = report.result.stats
        if stats is not None:
            self.step_seconds.labels(m).observe(stats.duration_s)
        if report.result.num_preempted:
            self.preemptions.labels(m).inc(report.result.num_preempted)
        if report.kv_events:
            self.kv_event_batches.labels(m).inc()
        load = report.load
        self.running.labels(m).set(load.num_running)
        self.waiting.labels(m).set(load.num_waiting)
        self.kv_usage.labels(m).set(load.kv_usage)
