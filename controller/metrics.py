"""The controller's Prometheus metrics: per-engine state and load (read from the registry at scrape
time), routing decisions by policy and reason, predicted vs engine-reported cached tokens, index
size, whether each engine's KV events reach the index now, KV-event lag (per engine: the
controller's wall clock when a batch is in the index minus the engine's timestamp on it; engine
and controller clocks must agree; batches whose stamp is implausible are counted instead,
`controller.event_lag`), what each engine's KV-event source went through (resyncs, gaps,
reconnects), gateway latency, and with `router.replica_sync` whether this replica hears its
peers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller.event_following import EventFollowing
from controller.registry import EngineRecord, EngineState, Registry
from controller.replica_sync import ReplicaSync
from indexer.size_gauges import IndexSizeGauges
from indexer.sources.zmq import SOURCE_COUNTER_HELP, SourceCounters

# An engine's KV-event source counters, by engine address (None: it has no source now).
EventCounters = Callable[[str], SourceCounters | None]
# Whether the controller follows an engine's KV events now, by its record.
EventsFollowing = Callable[[EngineRecord], EventFollowing]
# Whether the index answers now (the embedded one always does), read at scrape time.
IndexAnswers = Callable[[], bool]
# The engine's source counters exported per engine (HELP: `SOURCE_COUNTER_HELP`): a rebuild
# of the engine's index entries (the index lost them, or the stream went out of sequence), a
# stream or message sequence that skipped, a reconnect after the stream failed, and a new ZMQ
# connection whose check recovered batches published before it.
_SOURCE_COUNTERS = {
    "resyncs": "num_resyncs",
    "gaps": "num_gaps",
    "restarts": "num_restarts",
    "connection_heals": "num_connection_heals",
}

# "invalid": refused for the request itself (a client error such as INVALID_ARGUMENT,
# NOT_FOUND, ALREADY_EXISTS: retrying cannot help), apart from engines' failures; "aborted":
# ended by the gateway on an Abort, before any engine was called or at a disaggregated
# request's handoff (before its decode engine was), or there by its prefill engine's drain
# ending its KV session (any other loss of its KV session in the request's run again fails
# it, "engine_error": no one aborted it); "internal": the controller failed to route;
# "overloaded": refused because every engine was busy (`router.reject_when_all_busy`), or the
# engine it was last tried on refused it for capacity (RESOURCE_EXHAUSTED, or an in-band
# EngineError OVERLOADED); "cancelled": the client left before the request's end (it cancelled
# or passed its deadline), or the controller stopped, so that every generation counts once.
RequestOutcome = Literal[
    "ok", "no_engine", "engine_error", "invalid", "aborted", "internal", "overloaded", "cancelled"
]
# Why a request was re-routed past an engine's refusal of what it cannot serve, before
# anything was relayed (controller/relay.py `Reroute`): "lora_adapter", the engine no longer
# holds the adapter the request names; "context", its prompt's or a pooling input's tokens
# not known here, its length maybe past the engine's context. Not an engine failure:
# counted apart from the retries.
Reroute = Literal["lora_adapter", "context"]
# Routing takes well under a millisecond to a few: the sub-millisecond buckets resolve it.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# A generation's first response waits for its engine's queue and prefill, and its stream runs
# for as long as it decodes: tens of seconds to minutes for long outputs, which buckets ending
# at 10 s would all put in +Inf (no quantile above 10 s could be read).
_STREAM_BUCKETS = (*_LATENCY_BUCKETS, 30, 60, 120, 300, 600)
# Event lag reaches seconds when a source replays a backlog after a reconnect.
_EVENT_LAG_BUCKETS = (*_LATENCY_BUCKETS[1:], 30, 60)


class _EngineCollector:
    def __init__(
        self,
        registry: Registry,
        event_counters: EventCounters | None,
        events_following: EventsFollowing | None,
    ) -> None:
        self._registry = registry
        self._event_counters = event_counters
        self._events_following = events_following

    def collect(self) -> Iterator[Any]:
        labels = ["engine", "instance_id"]
        families = {
            "running": GaugeMetricFamily(
                "kvplane_controller_engine_running_requests",
                "Running requests (GetLoad)",
                labels=labels,
            ),
            "queued": GaugeMetricFamily(
                "kvplane_controller_engine_queued_requests",
                "Queued requests (GetLoad)",
                labels=labels,
            ),
            "kv": GaugeMetricFamily(
                "kvplane_controller_engine_kv_usage_ratio",
                "Used / total KV blocks (GetLoad)",
                labels=labels,
            ),
            "routable": GaugeMetricFamily(
                "kvplane_controller_engine_routable",
                "1 when the engine gets traffic",
                labels=labels,
            ),
            "event_lag": GaugeMetricFamily(
                "kvplane_controller_engine_event_lag_seconds",
                "Event lag of the engine's last KV-event batch (in the index minus stamped); "
                "no series while its events do not reach the index",
                labels=labels,
            ),
            # No series for an engine whose events are not this replica's to follow
            # (kv_events none, a remote indexer's, another replica's lease).
            "kv_events_up": GaugeMetricFamily(
                "kvplane_controller_engine_kv_events_up",
                "1 while the engine's KV events reach this controller's index, 0 while they "
                "do not (its stream or ZMQ publisher down or not connected yet)",
                labels=labels,
            ),
        }
        # Counted by the registry (its hold-down, controller/registry.py), kept with the
        # engine's record: it restarts when the engine is removed and registered again, unless
        # within health.flap_window_s of its removal (`Registry.add`).
        flaps = CounterMetricFamily(
            "kvplane_controller_engine_flaps",
            "Times the engine's health left ready (NOT_READY, STARTING, a failed poll, a new "
            "process), not counting drains and cordons; too many within health.flap_window_s "
            "hold it down",
            labels=labels,
        )
        # One series per state, 1 for the engine's own (Prometheus' state set): an alert on
        # `{state="failing"} == 1` has a series to watch before the engine ever fails.
        states = GaugeMetricFamily(
            "kvplane_controller_engine_state",
            "1 for the engine's state in the controller (ready, unreachable, failing, ...)",
            labels=[*labels, "state"],
        )
        for record in self._registry.records():
            key = [record.address, record.engine_id]
            load = record.load
            families["routable"].add_metric(key, 1.0 if record.routable else 0.0)
            flaps.add_metric(key, float(record.num_flaps))
            for state in EngineState:
                states.add_metric([*key, state.value], 1.0 if record.state is state else 0.0)
            if load.running_requests is not None:
                families["running"].add_metric(key, float(load.running_requests))
            if load.queued_requests is not None:
                families["queued"].add_metric(key, float(load.queued_requests))
            if load.used_kv_blocks is not None and load.total_kv_blocks:
                families["kv"].add_metric(key, load.used_kv_blocks / load.total_kv_blocks)
            up = None if self._events_following is None else self._events_following(record).up
            # While its events do not arrive the last batch's lag says nothing: no series
            # rather than a value frozen at it (`kv_events_up` 0 says why).
            if record.event_lag_s is not None and up is not False:
                families["event_lag"].add_metric(key, record.event_lag_s)
            if up is not None:
                families["kv_events_up"].add_metric(key, 1.0 if up else 0.0)
        yield from families.values()
        yield flaps
        yield states
        yield self._routed_by_cap()
        yield from self._source_counters()

    def _routed_by_cap(self) -> CounterMetricFamily:
        """The registry's count of engines its cap on those held out routed all the same."""
        family = CounterMetricFamily(
            "kvplane_controller_routed_by_cap",
            "Times an engine stayed in routing because at most half of the engines taking "
            "traffic may be held out: a held-down engine routed (reason hold_down), an ejected "
            "engine routed or a request failure that would have ejected its engine (reason "
            "ejection)",
            labels=["reason"],
        )
        for reason, count in self._registry.routed_by_cap.items():
            family.add_metric([reason], float(count))
        return family

    def _source_counters(self) -> Iterator[CounterMetricFamily]:
        families = {
            name: CounterMetricFamily(
                f"kvplane_controller_engine_kv_event_{name}",
                SOURCE_COUNTER_HELP[field],
                labels=["engine"],
            )
            for name, field in _SOURCE_COUNTERS.items()
        }
        if self._event_counters is not None:
            for record in self._registry.records():
                counters = self._event_counters(record.address)
                if counters is None:
                    continue
                for name, field in _SOURCE_COUNTERS.items():
                    families[name].add_metric([record.address], getattr(counters, field))
        yield from families.values()


class _ReplicaSyncCollector:
    """With `router.replica_sync`: whether this replica is on its peers' channel, how many
    peers it hears and how many of their requests it accounts, and the peers' messages found
    missing (each answered by a snapshot), read at scrape time. Replicas that do not hear
    each other route as if alone (each sees only its own requests in flight)."""

    def __init__(self, sync: ReplicaSync) -> None:
        self._sync = sync

    def collect(self) -> Iterator[Any]:
        sync = self._sync
        gauges = (
            ("kvplane_controller_replica_sync_subscribed",
             "1 while this replica is subscribed to its peers' channel on Redis",
             float(sync.subscribed)),
            ("kvplane_controller_replica_peers",
             "Peer replicas heard from within router.replica_timeout_s",
             float(len(sync.protocol.heard))),
            ("kvplane_controller_replica_peer_requests",
             "Peer replicas' requests in flight, accounted in this replica's router",
             float(sum(sync.peers.num_requests(o) for o in sync.peers.origins))),
        )  # fmt: skip
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        yield CounterMetricFamily(
            "kvplane_controller_replica_sync_gaps",
            "Peers' messages found missing (each answered by a snapshot)",
            value=sync.num_gaps,
        )


class ControllerMetrics:
    def __init__(
        self,
        registry: Registry,
        event_counters: EventCounters | None = None,
        index_answers: IndexAnswers = lambda: True,
        events_following: EventsFollowing | None = None,
        index_keying_mismatch: Callable[[], bool] = lambda: False,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(registry, event_counters, events_following))
        r = self.registry
        self.decisions = Counter(
            "kvplane_controller_route_decisions",
            "Engines chosen for generations (each hop, retry and re-route too), by policy, "
            "reason and hop; pooling tasks (Embed, Classify, Score) are not routed by a policy",
            ["policy", "reason", "hop"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "kvplane_controller_predicted_cached_tokens",
            "Prompt tokens the router predicted the chosen engine would serve from cache, "
            "over the requests whose engine reported usage.cached_prompt_tokens",
            registry=r,
        )
        self.actual_cached_tokens = Counter(
            "kvplane_controller_actual_cached_tokens",
            "Prompt tokens engines reported served from cache (usage.cached_prompt_tokens)",
            registry=r,
        )
        self.cached_tokens_abs_error = Counter(
            "kvplane_controller_cached_tokens_abs_error",
            "Sum of |predicted - reported| cached prompt tokens",
            registry=r,
        )
        # Accuracy = 1 - sum |predicted - reported| / sum max(predicted, reported), over the
        # same requests: 1 when every prediction was exact (and before any), 0 when none
        # overlapped what the engine reported.
        self._cached_tokens_error_sum = 0
        self._cached_tokens_max_sum = 0
        self.cached_tokens_accuracy = Gauge(
            "kvplane_controller_cached_tokens_prediction_accuracy_ratio",
            "1 - sum |predicted - reported| / sum max(predicted, reported) cached prompt tokens",
            registry=r,
        )
        self.cached_tokens_accuracy.set_function(self._cached_tokens_accuracy)
        self.prompt_tokens = Counter(
            "kvplane_controller_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.requests = Counter(
            "kvplane_controller_requests",
            "Generations (Generate, vllm.Generate) ended, by outcome, each once; pooling tasks "
            "(Embed, Classify, Score) are not counted",
            ["outcome"],
            registry=r,
        )
        # Labelled children looked up once: `labels()` takes a lock and builds its key on every
        # call, a few times the cost of the increment itself, on every routed request.
        self._outcomes = {o: self.requests.labels(o) for o in get_args(RequestOutcome)}
        self._decisions: dict[tuple[str, str, str], Counter] = {}
        self._event_lags: dict[str, Histogram] = {}  # by engine, until `forget_engine`
        self.retries = Counter(
            "kvplane_controller_retries",
            "Requests retried on another engine after an engine failure",
            registry=r,
        )
        self.prefill_waits = Counter(
            "kvplane_controller_prefill_waits",
            "Disaggregated requests that found no prefill engine taking traffic and waited for "
            "one out of routing for a moment (router.prefill_wait_s)",
            registry=r,
        )
        reroutes = Counter(
            "kvplane_controller_reroutes",
            "Requests re-routed past an engine's refusal of what it cannot serve, by reason",
            ["reason"],
            registry=r,
        )
        self.reroutes = {reason: reroutes.labels(reason) for reason in get_args(Reroute)}
        self.ejections = Counter(
            "kvplane_controller_ejections",
            "Engines taken out of routing for failing requests (outlier ejection)",
            registry=r,
        )
        # The service's index-stats refresh records the figures; none while unreachable.
        self.index_size = IndexSizeGauges("controller", index_answers)
        r.register(self.index_size)
        # 0 while a shared Redis or remote indexer does not answer: requests are routed by
        # load, without cache knowledge (the gateway's Health is DEGRADED, check `kv_index`).
        self.index_reachable = Gauge(
            "kvplane_controller_index_reachable",
            "1 when the index answers; 0 while routing goes on without cache knowledge",
            registry=r,
        )
        self.index_reachable.set_function(lambda: float(index_answers()))
        # 1 while the remote indexer reports keying a worker in another key space (or with
        # another hash seed, or in blocks of another size) than the controller hashes prompts
        # in: it answers, but matches nothing there.
        self.index_key_space_mismatch = Gauge(
            "kvplane_controller_index_key_space_mismatch",
            "1 while the remote indexer keys some worker otherwise than the controller hashes "
            "prompts (index.remote_key_space, remote_hash_seed, or the block size): no prompt "
            "can match it",
            registry=r,
        )
        self.index_key_space_mismatch.set_function(lambda: float(index_keying_mismatch()))
        self.event_lag_seconds = Histogram(
            "kvplane_controller_event_lag_seconds",
            "KV-event batches by lag: in the index minus the engine's timestamp on the batch",
            ["engine"],
            buckets=_EVENT_LAG_BUCKETS,
            registry=r,
        )
        # Batches whose stamp cannot be when they were produced (`controller.event_lag`): not
        # in the lag histogram, whose sum a single ~1.8e9 s lag would spoil.
        self.event_timestamps_implausible = Counter(
            "kvplane_controller_event_timestamps_implausible",
            "KV-event batches whose engine timestamp is implausible (more than an hour old, "
            "or more than a second ahead of the controller's clock): not taken as event lag",
            ["engine"],
            registry=r,
        )
        self.route_seconds = Histogram(
            "kvplane_controller_route_seconds",
            "Time to tokenise, match and choose an engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_response_seconds = Histogram(
            "kvplane_controller_first_response_seconds",
            "Gateway time from request to the first relayed response",
            buckets=_STREAM_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvplane_controller_request_seconds",
            "Gateway time from request to its end (its stream's end, its error, its refusal or "
            "its client leaving): every generation, whatever its outcome",
            buckets=_STREAM_BUCKETS,
            registry=r,
        )

    def watch_replica_sync(self, sync: ReplicaSync) -> None:
        """Export the replica sync's state (`_ReplicaSyncCollector`) from now on."""
        self.registry.register(_ReplicaSyncCollector(sync))

    def record_cache_prediction(self, predicted: int, reported: int) -> None:
        """The router predicted `predicted` cached prompt tokens; the engine reported
        `reported` (usage.cached_prompt_tokens)."""
        self.predicted_cached_tokens.inc(predicted)
        self.actual_cached_tokens.inc(reported)
        error = abs(predicted - reported)
        self.cached_tokens_abs_error.inc(error)
        self._cached_tokens_error_sum += error
        self._cached_tokens_max_sum += max(predicted, reported)

    def _cached_tokens_accuracy(self) -> float:
        if not self._cached_tokens_max_sum:
            return 1.0
        return 1.0 - self._cached_tokens_error_sum / self._cached_tokens_max_sum

    def count_move(self, reroute: Reroute | None) -> None:
        """A request sent on to another engine before anything was relayed: the one retry
        after an engine failure (None), or a re-route past a refusal, by its reason."""
        (self.retries if reroute is None else self.reroutes[reroute]).inc()

    def count_request(self, outcome: RequestOutcome, seconds: float) -> None:
        """A generation ended with `outcome`, `seconds` after the gateway took it: counted
        once and timed once (`request_seconds`), whatever its outcome, so that the
        histogram's count is the requests' (errors, refusals and cancellations included)."""
        self._outcomes[outcome].inc()
        self.request_seconds.observe(seconds)

    def observe_event_lag(self, engine: str, lag_s: float) -> None:
        """Every KV-event batch of every engine: its child is looked up once (see `_outcomes`)."""
        child = self._event_lags.get(engine)
        if child is None:
            child = self._event_lags[engine] = self.event_lag_seconds.labels(engine)
        child.observe(lag_s)

    def count_implausible_event_stamp(self, engine: str) -> None:
        """A KV-event batch of the engine whose stamp is implausible (seldom: no cached child)."""
        self.event_timestamps_implausible.labels(engine).inc()

    def forget_engine(self, engine: str) -> None:
        """Drop an engine's event-lag series: it left the fleet (a new process of it is counted
        on in them)."""
        self._event_lags.pop(engine, None)
        for family in (self.event_lag_seconds, self.event_timestamps_implausible):
            with contextlib.suppress(KeyError):
                family.remove(engine)

    def count_decision(self, policy: str, reason: str, hop: str) -> None:
        child = self._decisions.get((policy, reason, hop))
        if child is None:
            child = self._decisions[policy, reason, hop] = self.decisions.labels(
                policy, reason, hop
            )
        child.inc()
