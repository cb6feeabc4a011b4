"""The fleet service: keeps the registry current and the index fed, and builds the router's
candidates for a prompt.

Per engine it owns one poll task (GetEngineInfo, each served model's GetModelInfo at once, and
ListLoras on first contact, after a failed poll, whenever GetLoad reports a new instance id
(one it named before at the address, with no failed poll since, rejects the address: several
processes answer there), and at once when the engine's KV-event stream (SubscribeKvEvents or
ZMQ) breaks sequence, which may be a restart that kept the instance id: a changed identity then
makes it a new process; an engine whose models disagree on the KV block size is rejected;
Health every `poll_interval_s`; GetLoad every `load_poll_interval_s`; backoff while its polls
fail, as UNREACHABLE when they do not reach it, FAILING when it answers them with errors; one
nothing listened for is polled at once when its channel connects again, `_wait_unreachable`) and
one KV-event task (SubscribeKvEvents, or the ZMQ source GetKvEventSources advertises) feeding the
index under the engine's address as worker id, and measures each batch's event lag (the
controller's wall clock when the batch is in the index minus the engine's timestamp on it). A
new engine process (`Registry.on_identity`: a new instance id, or an engine answering again
after its connection was lost) has its old index entries dropped before anything else, so a
restarted engine's old blocks never attract traffic; removal drops them too. Every task
is owned here and cancelled by `close()`. A prompt naming a LoRA adapter gets as candidates
only the engines holding it (registry.check_lora says why there is none). What a new engine
process holds is taken into the fleet's LoRA intent (controller.lora_intent: a restarted
controller learns the fleet's adapters back so, `_take_in_loras`), and it is given the
adapters the intent wants there once its events are followed (`_restore_loras`), and the
unloads it did not answer at its health polls (`_reapply_unloads`): both in the engine's LoRA
task, off its poll task, so an engine whose LoRA calls hang neither stalls its own polls nor
holds up the fleet's other LoRA calls (`_Engine.lora_calls`).

Calls to an engine end with its channel: a removed engine's channel is closed, and so is
the channel of one unreachable (its polls unanswered; an error answer is an answer) for
`health.abandon_streams_after_s` (then dialled afresh), whose calls would otherwise wait
for it or for their clients' deadlines; `why_calls_ended` tells the gateway which
(`controller.relay.engine_failure`). A poll that times out has the engine dialled afresh, a
new connection for the calls to come (the one gone silent may be dead without a reset, as
behind a blackholed path); the calls under way stay on the old one, which is polled too once
the engine answers on the new one (`_end_silent_calls`): silent there, its calls bringing
no response meanwhile either (a congested connection brings them, late), it is dead, and its
calls end as an abandoned engine's do, instead of waiting for keepalive pings
(`health.keepalive_s` and `keepalive_timeout_s`).

On a shared Redis index, several controller replicas may follow one fleet: each polls every
engine, but an engine's KV events are followed into the index (and its entries dropped on a
restart or a removal) only by the replica holding its writer lease (`indexer.writer_lease`,
`index.writer_lease_s`); the others read what it writes. An engine leaving ready after a drain
through another replica, which this one's polls did not see, is no flap: the shared
membership is asked at that moment (`shared_drains`, `_excuse_shared_drain`).

An index that cannot answer (a shared Redis that is down) costs cache knowledge, never a
request or an engine: prompts are routed by load (a warning at most every
`BLIND_WARNING_INTERVAL_S`), and a restarted engine's events are followed all the same (its
old entries go when Redis is back, see `_drop_indexed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NamedTuple

import grpc

from controller.config import ControllerConfig, KvEventsMode
from controller.event_following import EventFollowing, FollowingState
from controller.event_lag import MAX_CLOCK_LEAD_S, MAX_PLAUSIBLE_LAG_S, event_lag_s
from controller.fleet_view import FLEET_VIEW_KEY
from controller.hops import FRONTS_METADATA_KEY, metadata_values, via_interceptors
from controller.lora_intent import LoraIntent, LoraSpec
from controller.model_info import model_facts, reported
from controller.outcomes import lora_model_metadata
from controller.registry import (
    DuplicateEngineError,
    EjectionPolicy,
    EngineIdentity,
    EngineRecord,
    EngineState,
    HoldDownPolicy,
    IncompatibleEngineError,
    ModelFacts,
    PollFailure,
    Registry,
    Role,
    agreed_block_size,
    check_revision,
    poll_failure,
)
from controller.remote_index import RemoteIndex, keep_best_hit
from controller.router import Candidate, LoadSnapshot, PrefixHit, cacheable_blocks
from indexer.backend import IndexBackend, TierPrefix
from indexer.batch import Tier
from indexer.keys import block_keys
from indexer.redis_client import stop_if_cancelled
from indexer.sources.openengine import (
    OpenEngineSource,
    OpenEngineSourceSettings,
    advert_endpoint_problem,
    engine_worker_id,
    zmq_source_settings,
)
from indexer.sources.resync import drop_engine
from indexer.sources.zmq import SourceCounters, ZmqSource
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from indexer.writer_lease import LeasedSink, LeasingIndex, WriterLease, lease_holder
from indexer.zmq_decode import ArrayTail, engine_array_tail
from kvplane.channels import (
    INSECURE,
    CallsHeard,
    ClientChannels,
    ClientSettings,
    Redialling,
    failure_details,
    reconnected,
)
from kvplane.errors import KvplaneError
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The drain of an engine recorded through another controller replica
# (`controller.membership`): the address -> (the drain's token, the drained process's
# instance id), None when none is (or it cannot be read).
SharedDrains = Callable[[str], Awaitable[tuple[str, str] | None]]

# The OpenEngine health states of a server that serves requests (one DEGRADED still does):
# an engine routed, a fleet taking vllm.Generate, `kvplane admin health` exiting 0.
SERVING_STATES = frozenset({pb.HEALTH_STATE_READY, pb.HEALTH_STATE_DEGRADED})
_HEALTH = {
    pb.HEALTH_STATE_UNSPECIFIED: EngineState.NOT_READY,
    pb.HEALTH_STATE_STARTING: EngineState.STARTING,
    pb.HEALTH_STATE_READY: EngineState.READY,
    pb.HEALTH_STATE_DEGRADED: EngineState.DEGRADED,
    pb.HEALTH_STATE_DRAINING: EngineState.DRAINING,
    pb.HEALTH_STATE_NOT_READY: EngineState.NOT_READY,
}
_ROLE = {
    pb.ENGINE_ROLE_AGGREGATED: Role.AGGREGATED,
    pb.ENGINE_ROLE_PREFILL: Role.PREFILL,
    pb.ENGINE_ROLE_DECODE: Role.DECODE,
}


# The LoadInfo attributes a controller's GetLoad tells its KV in tokens under (the seed's
# LoadInfo counts KV in blocks only, and blocks of several sizes add up to nothing), by the
# block count each stands for, and the one listing its block sizes ("16,32").
KV_TOKEN_ATTRIBUTES = {"used_kv_blocks": "used_kv_tokens", "total_kv_blocks": "total_kv_tokens"}
KV_BLOCK_SIZE_ATTRIBUTE = "kv_block_size"


def load_from_proto(load: pb.LoadInfo) -> LoadSnapshot:
    """GetLoad's scalars with their presence kept (absent = not reported), and the KV in
    tokens a controller fronted as an engine reports in its attributes (KV_TOKEN_ATTRIBUTES;
    one not a count is not reported)."""
    sizes = load.attributes.get(KV_BLOCK_SIZE_ATTRIBUTE, "").split(",")
    return LoadSnapshot(
        running_requests=reported(load, "running_requests"),
        queued_requests=reported(load, "queued_requests"),
        active_kv_sessions=reported(load, "active_kv_sessions"),
        used_kv_blocks=reported(load, "used_kv_blocks"),
        total_kv_blocks=reported(load, "total_kv_blocks"),
        running_tokens=reported(load, "running_tokens"),
        waiting_tokens=reported(load, "waiting_tokens"),
        used_kv_tokens=_count(load.attributes.get(KV_TOKEN_ATTRIBUTES["used_kv_blocks"])),
        total_kv_tokens=_count(load.attributes.get(KV_TOKEN_ATTRIBUTES["total_kv_blocks"])),
        kv_block_sizes=tuple(size for s in sizes if (size := _count(s))),
    )


def _count(text: str | None) -> int | None:
    """A non-negative count written in an attribute; None for anything else."""
    return int(text) if text is not None and text.isascii() and text.isdigit() else None


_NO_HIT = PrefixHit()
# An engine's LoRA call failing so was not answered (gone, wedged): the fleet service's next
# LoRA call to it would wait as long, so its restore or re-applied unloads end there, and go
# on when next due, not one call after another (each up to `lora_timeout_s`, the gateway's
# LoRA changes to that engine waiting meanwhile, `_Engine.lora_calls`).
_LORA_CALLS_UNANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# While an index cannot answer, every routed request meets the failure: warn this often.
BLIND_WARNING_INTERVAL_S = 10.0


def _names(adapters: Sequence[LoraSpec] | None) -> frozenset[str] | None:
    """The names of the adapters ListLoras listed (None: the engine serves no LoRA), as the
    registry keeps them."""
    return None if adapters is None else frozenset(a.lora_name for a in adapters)


def health_of(reply: pb.HealthResponse) -> tuple[EngineState, str]:
    """The engine's state as its Health answer says, and what its failing checks say. A state
    this build does not know (a newer engine's, or nonsense) is not ready, saying so: an
    engine is routed only when it says READY or DEGRADED in words this controller reads."""
    state = _HEALTH.get(reply.state)
    if state is None:
        said = f"unknown health state {reply.state}"
        return EngineState.NOT_READY, "; ".join(filter(None, (said, _failing_checks(reply))))
    return state, _failing_checks(reply)


def _failing_checks(reply: pb.HealthResponse) -> str:
    """What the checks that are not READY say (a READY check's message is information, such
    as the model's name, not a problem)."""
    return "; ".join(
        f"{c.name}: {c.message}" if c.name else c.message
        for c in reply.checks
        if c.message and c.state != pb.HEALTH_STATE_READY
    )


def _events_ended(address: str, task: asyncio.Task[None]) -> None:
    """A KV-event source ended by itself (a ZMQ endpoint the engine advertised that ZMQ
    cannot parse): the engine is routed cache-blind until it restarts. Say so."""
    if not task.cancelled() and task.exception() is not None:
        log.error("engine %s: KV events not followed: %s", address, task.exception())


def _device_blocks(tiers: Sequence[TierPrefix]) -> int:
    """Leading blocks of a match held on the device (HBM) tier."""
    for tier in tiers:
        if tier.tier is Tier.HBM:
            return tier.matched_blocks
    return 0


class ThrottledWarning:
    """A warning logged (to `logger`, at `level`) at most once per `interval_s`, saying how
    many were held back. An `error` given (a bug that may repeat at every poll) has its
    traceback logged with the first warning only: the later ones are its one line, counted."""

    def __init__(
        self,
        interval_s: float,
        clock: Callable[[], float],
        logger: logging.Logger = log,
        level: int = logging.WARNING,
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._level = level
        self._next_s = float("-inf")
        self._held = 0
        self._traced = False

    def warn(self, message: str, error: BaseException | None = None) -> None:
        now = self._clock()
        if now < self._next_s:
            self._held += 1
            return
        held = f" ({self._held} more since the last warning)" if self._held else ""
        traced = error is not None and not self._traced
        self._traced |= traced
        self._log.log(self._level, "%s%s", message, held, exc_info=error if traced else None)
        self._next_s = now + self._interval_s
        self._held = 0


class PromptView(NamedTuple):
    """A prompt as the router sees it: its canonical keys and every routable engine that may
    take it (holding its LoRA adapter, when it names one); a named tuple, as the router's
    vocabulary is: one is built on every routed request."""

    block_size: int
    block_keys: tuple[int, ...]
    candidates: tuple[Candidate, ...]
    index_error: str | None = None  # the index could not answer: no indexed hits
    # `Registry.version` when the candidates were listed (None: cordoned engines among them,
    # admin `match`): while it stands, every candidate is still routable.
    registry_version: int | None = None
    # Admin `match` only: the engines that would be candidates but for their state
    # (draining, unreachable, ...) or, once `Controller.plan` judged the prompt, for not
    # taking it (its context too short, ...), with what the index holds of them; never
    # routed to.
    out_of_routing: tuple[Candidate, ...] = ()


class _Engine:
    """The live parts of one engine: its channel and tasks."""

    def __init__(
        self,
        address: str,
        channels: ClientChannels = INSECURE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.dialled: Redialling[pb_grpc.OpenEngineAsyncStub] = Redialling(
            channels, address, pb_grpc.OpenEngineStub
        )
        # Why the calls on an earlier channel of this engine were ended (`abandon_calls`),
        # and the start of the outage that did it (one abandonment per outage).
        self.calls_ended_because: str | None = None
        self.abandoned_outage_s: float | None = None
        self.poll_task: asyncio.Task[None] | None = None
        # The token of the last drain through another replica whose leave was excused here
        # (`Fleet._excuse_shared_drain`): one leave per drain, whatever the instance id.
        self.excused_drain: str | None = None
        # Its LoRA task (`Fleet._lora_work`): at most one, started when a restore or a
        # re-applied unload is due and none runs; one due meanwhile is done when it ends.
        self.lora_task: asyncio.Task[None] | None = None
        self.restore_due = False
        self.unloads_due = False
        # Held around each LoRA change sent to the engine (LoadLora, UnloadLora: the LoRA
        # task's, the gateway's), so the engine gets them in the order they were decided (a
        # load then an unload of one adapter never swapped); the fleet's `lora_changes` is
        # not held while it waits for the engine, so a wedged one holds up only its own.
        self.lora_calls = asyncio.Lock()
        # How many changes its LoRA task has taught the registry: a listing of its adapters
        # taken across one may be from before it, not to be learnt (`lora_task_changes`).
        self.lora_task_changes = 0
        self.events_task: asyncio.Task[None] | None = None
        self.source: OpenEngineSource | ZmqSource | None = None
        # Why the engine's events have no source though they are wanted (its advertised ZMQ
        # source cannot be dialled, it advertises none); None while it has one.
        self.no_source_reason: str | None = None
        # When the followed process's last KV-event batch was indexed here (unix time; None:
        # none yet, a new process having sent none).
        self.last_event_unix_s: float | None = None
        # The counters of the engine's KV-event sources, kept from one source to the next
        # while the engine is in the fleet, its new processes at the address too (a writer
        # lease taken again starts a fresh source: after Redis lost the index, say, whose
        # resync would otherwise never show): exported under its address, they never go back.
        self.source_counters: SourceCounters | None = None
        # Its current source delivered a batch whose stamp is implausible (warned once).
        self.implausible_stamp_warned = False
        # The process whose KV events this replica follows into the index (None: none yet,
        # or KV events off); on a shared index, only while it holds `lease`.
        self.followed: EngineIdentity | None = None
        self.lease: WriterLease | None = None
        self.lease_task: asyncio.Task[None] | None = None
        # Held while the events task is started or stopped: by the poll task (a new process)
        # and by the lease (taken, lost), which would otherwise start two subscriptions.
        self.events_lock = asyncio.Lock()
        # A new engine process whose KV events are not followed yet: set until they are, so
        # that a failure on the way (the engine gone again, GetKvEventSources failing) is
        # retried at the next identity fetch, which sees the same instance id again.
        self.events_pending = False
        # The remote index could not be told of this engine's new process: throttled per
        # engine, so that one engine's repeated failures do not hide another's.
        self.remote_resync_failed = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock)
        # An unload it did not answer, re-applied at its load polls, refused again: the same.
        self.unload_refused = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock)
        # A controller fronted as an engine whose fleet view moved, its identity not read
        # again (asked again at each load poll until it is): the same.
        self.view_unread = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock)
        # Its LoRA task failed on a bug (tried again at each answered poll): the same, the
        # first with its traceback.
        self.lora_work_failed = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock)
        # Set by its KV-event source when a batch out of sequence cleared its worker: the
        # engine may have restarted under the same instance id between two polls, which
        # GetLoad cannot tell. The poll task wakes and reads its identity again.
        self.events_out_of_sequence = asyncio.Event()

    async def wait_poll_interval(self, delay_s: float) -> None:
        """Sleep until the next poll: `delay_s`, or less if the KV events break sequence."""
        # (Not `asyncio.wait_for`: on Python 3.11 it loses a cancellation that arrives as
        # the event is set.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await self.events_out_of_sequence.wait()

    async def abandon_calls(self, because: str) -> None:
        """End every call on the engine's channel (each fails as cancelled, see
        `controller.relay.engine_failure`) and dial it afresh for the calls to come. Closing
        the channel is what ends a removed engine's calls too: one mechanism for both."""
        self.calls_ended_because = because
        await self.dialled.redial()

    @property
    def channel(self) -> grpc.aio.Channel:
        return self.dialled.channel

    @property
    def stub(self) -> pb_grpc.OpenEngineAsyncStub:
        return self.dialled.stub

    @property
    def writes_index(self) -> bool:
        """Whether this replica writes the engine's entries: always on its own index, on a
        shared one while it holds the engine's writer lease."""
        return self.lease is None or self.lease.held

    def stop_events(self) -> None:
        """Stop following the engine's KV events (the task ends at its next step)."""
        if self.events_task is not None:
            self.events_task.cancel()
        self.events_task = None
        self.source = None

    async def close(self) -> None:
        tasks = (self.lease_task, self.poll_task, self.lora_task, self.events_task)
        for task in tasks:
            if task is not None:
                task.cancel()
        for task in tasks:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.dialled.close()


# The settings a failed call to an engine names when its TLS or token and the controller's do
# not match.
ENGINE_SETTINGS = ClientSettings(
    "engine_tls",
    "engine_tls.cert_file and key_file",
    "engine_token_file",
    "engine_tls.server_name",
)


def _capacity(record: EngineRecord) -> int | None:
    """The engine's KV capacity in blocks as the router counts it (`Candidate.capacity_blocks`):
    an engine's GetModelInfo `total_kv_blocks` (its cache, fixed while its process lives); a
    fronted controller's last GetLoad sum first (its fleet's: it moves at every poll as
    engines join and leave that fleet, and counts every model's engines, as its used blocks
    and the index's count of its cached blocks do; its GetModelInfo's is its default
    model's), else that."""
    identity = record.identity
    if identity is None:
        return None
    if identity.is_controller and record.load.total_kv_blocks is not None:
        return record.load.total_kv_blocks
    return identity.total_kv_blocks


def _sign_of_new_process(
    previous: EngineIdentity | None,
    identity: EngineIdentity,
    stream_broke: bool,
    poll_failed: bool,
    view_moved: bool,
) -> str | None:
    """What says that the engine process whose `identity` was just read is not the one read
    before (`previous`) though GetLoad named no other (`Fleet._fetch_identity`), for the log;
    None: nothing does. Another identity after its KV events broke sequence or a poll
    failed; for a controller fronted as an engine, whose identity legitimately moves with
    its fleet view, only another block size after a poll failed or its view moved."""
    if previous is None:
        return None
    changed = identity != previous
    if stream_broke and changed:
        return "its KV events broke sequence"
    # (A controller is told by its engine name: `fronted_controller_ids` names only the
    # controllers it fronts in turn, none for one fronting engines only.)
    fronted = identity.is_controller or previous.is_controller
    if poll_failed and changed and not fronted:
        return "a poll failed"
    if (poll_failed or view_moved) and identity.block_size != previous.block_size:
        return "a poll failed" if poll_failed else "its fleet view moved"
    return None


class Fleet:
    def __init__(
        self,
        config: ControllerConfig,
        index: IndexBackend | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_engine_gone: Callable[[str], None] | None = None,
        on_cache_predicted: Callable[[str, int | None], None] | None = None,
        hit_worth: Callable[[PrefixHit, int], float] = PrefixHit.blocks_within,
        on_event_lag: Callable[[str, float], None] | None = None,
        on_implausible_event_stamp: Callable[[str], None] | None = None,
        instance_id: str | None = None,
    ) -> None:
        """`instance_id`: the controller's own, which no engine of the fleet may have.
        `on_engine_gone(address)`: the engine left, or a new process of it came after one
        already met (what the router knew of it goes; not on a first contact,
        `_forget_old_process`). `on_cache_predicted(address, capacity_blocks)`: a process of
        an engine whose cache the router predicts (`kv_events: approximate`) was met, the
        first one included (`_tell_predicted`). `hit_worth`: what an index hit is worth to
        the router's policy (`Policy.hit_worth`; every block served alike unless given): an engine
        indexed rank by rank is seen holding its worthiest rank's hit (`keep_best_hit`).
        `on_event_lag(address, lag_s)`: a KV-event batch of the engine is in the index,
        `lag_s` after the engine stamped it; `on_implausible_event_stamp(address)` instead
        when its stamp cannot be when it was produced (`controller.event_lag`)."""
        self.config = config
        self.index = index
        self._hit_worth = hit_worth
        health = config.health
        self.registry = Registry(
            health.backoff_initial_s,
            health.backoff_max_s,
            EjectionPolicy(health.eject_after_failures, health.eject_for_s, health.eject_max_s),
            own_instance_id=instance_id,
            hold_down=HoldDownPolicy(
                health.hold_down_after_flaps,
                health.flap_window_s,
                health.hold_down_s,
                health.hold_down_max_s,
                health.hold_down_ready_polls,
            ),
        )
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        # The responses of the engine calls under way, counted by the gateway's relay as it
        # reads them: a connection whose calls bring some is alive (`_end_silent_calls`).
        self.calls_heard = CallsHeard()
        # The removals still dropping what the engine left (its tasks, index entries,
        # in-flight accounting), by address: registered again meanwhile, the new engine's
        # entries and accounting would be dropped with the old ones (`removal`).
        self._removals: dict[str, asyncio.Task[None]] = {}
        # The removed engines whose removal task has not closed them yet: `close` closes
        # those of a removal task it ended first (one not started yet closes nothing).
        self._leaving: set[_Engine] = set()
        self._on_engine_gone = on_engine_gone
        self._on_cache_predicted = on_cache_predicted
        self._on_event_lag = on_event_lag
        self._on_implausible_event_stamp = on_implausible_event_stamp
        self._changed = asyncio.Condition()
        self._routing_blind = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock)
        # The adapters loaded through the controller, restored on every new engine process;
        # `lora_changes` is held by the gateway's LoRA calls (two loads racing for one name
        # would split the fleet between two adapters), and by an engine's LoRA task only
        # while it decides its next call there (never while waiting for the engine), so that
        # an engine never ends up holding an adapter the fleet just unloaded.
        self.lora_intent = LoraIntent()
        self.lora_changes = asyncio.Lock()
        # Cleared by `controller.membership` until its first read of the shared hash: an
        # engine's adapters are listed for the intent only after it, so that an unload the
        # hash held then is older than what a listing finds (`hold_lora_listings`).
        self._lora_listings_open = asyncio.Event()
        self._lora_listings_open.set()
        # The drains made through other controller replicas, read when an engine leaves
        # ready (set by `controller.membership` on a shared Redis; None: this replica's only).
        self.shared_drains: SharedDrains | None = None
        # The last listing of every engine's adapters for a request naming one none was known
        # to hold (`relist_loras`), shared by the requests that come while it runs.
        self._relisting: asyncio.Task[None] | None = None
        self._relisted_s = float("-inf")
        self._mixed_block_sizes = ThrottledWarning(BLIND_WARNING_INTERVAL_S, clock)
        # Blocks the index places on each engine (refreshed by the controller's stats task);
        # the router's cache-pressure term reads them.
        self.indexed_blocks: dict[str, int] = {}
        # How engines are dialled (their polls, the gateway's calls, KV-event subscriptions):
        # reconnecting about every second whatever the polls' backoff (no call is made), so
        # that an engine back is polled as soon as its channel connects (`_wait_unreachable`),
        # not at gRPC's own pace (up to 120 s); pinging while calls are under way, so that a
        # subscription on a connection gone silent ends (`health.keepalive_s`). Engines'
        # replies of any size are taken: the gateway relays them unchanged (a stream with
        # every candidate's logprob can pass 4 MiB a message), and its client sets its own
        # limit.
        self._engine_channels = (
            ClientChannels.load(config.engine_tls, "engine_tls")
            .reconnecting_promptly(health.backoff_initial_s)
            .keeping_alive(health.keepalive_s, health.keepalive_timeout_s)
            .receiving_any_size()
            .with_token_file(config.engine_token_file, "engine_token_file")
        )
        # This replica's id in the writer leases of a shared index (`indexer.writer_lease`).
        self.lease_holder = lease_holder(
            config.index.replica_name,
            config.listen,
            instance_id or f"controller-{uuid.uuid4().hex[:8]}",
        )
        self._leasing: LeasingIndex | None = None
        if instance_id is not None:  # every call says which controllers it passed
            self._engine_channels = self._engine_channels.with_interceptors(
                via_interceptors(instance_id)
            )
        self.remote = (
            RemoteIndex(
                config.index.remote,
                health.rpc_timeout_s,
                config.index.remote_key_space,
                config.index.remote_hash_seed,
                ClientChannels.load(config.index.remote_tls, "index.remote_tls").with_token_file(
                    config.index.remote_token_file, "index.remote_token_file"
                ),
                backoff_s=(health.backoff_initial_s, health.backoff_max_s),
                routes=lambda engine: self.registry.by_engine_id(engine) is not None,
                block_size_of=self._hashing_block_size,
                hit_worth=self._hit_worth,
            )
            if config.index.remote is not None
            else None
        )

    # ---- membership ----

    async def start(self) -> None:
        if isinstance(self.index, LeasingIndex):
            # Other replicas may follow the same engines into this index: write an engine's
            # workers (`<address>` and its ranks' `<address>/dp<r>`) only under its lease.
            self._leasing = self.index
            self.index.fence_writes(self.lease_holder, engine_worker_id)
        for entry in self.config.engines:
            await self.add_engine(
                entry.address, entry.kv_events.value, source="config", array_tail=entry.array_tail
            )

    async def add_engine(
        self,
        address: str,
        kv_events: str = KvEventsMode.grpc.value,
        source: str = "admin",
        array_tail: ArrayTail | None = None,
        owner: str = "",
    ) -> EngineRecord:
        if address in self._removals:
            raise DuplicateEngineError(
                f"engine {address} is being removed; register it again once that is done"
            )
        record = self.registry.add(
            address,
            kv_events=kv_events,
            source=source,
            array_tail=array_tail,
            now_s=self._clock(),
            owner=owner,
        )
        engine = _Engine(address, self._engine_channels, self._clock)
        self._engines[address] = engine
        if self._leasing is not None:
            engine.lease = WriterLease(
                self._leasing,
                address,
                self.lease_holder,
                self.config.index.writer_lease_s,
                wanted=lambda: engine.followed is not None,
                on_taken=functools.partial(self._lease_taken, engine),
                on_lost=engine.stop_events,
                # As `admin workers` shows it: a whole term not following gives the lease up.
                reachable=lambda: self.event_following(record).up is True,
            )
            engine.lease_task = asyncio.create_task(engine.lease.run(), name=f"lease {address}")
        engine.poll_task = asyncio.create_task(self._poll(engine), name=f"poll {address}")
        return record

    async def remove_engine(self, key: str) -> EngineRecord:
        record, removal = self.begin_removal(key)
        await asyncio.shield(removal)
        return record

    def begin_removal(self, key: str) -> tuple[EngineRecord, asyncio.Task[None]]:
        """The engine leaves the registry now; the task drops what it left (awaited by
        `remove_engine`; a caller that need not wait, or must not while holding a lock, such
        as `controller.membership`, leaves it running: `close` ends it)."""
        record = self.registry.remove(key, self._clock())
        self.lora_intent.forget_engine(record.address)
        engine = self._engines.pop(record.address, None)
        if engine is not None:
            self._leaving.add(engine)
        # In a task of its own, shielded: a caller that stops waiting (RemoveEngine's client
        # gives up) must not leave the engine's entries and accounting behind, which nothing
        # would drop later (the engine has left the registry).
        task = asyncio.create_task(
            self._drop_removed(record.address, engine), name=f"remove {record.address}"
        )
        self._removals[record.address] = task
        return record, task

    def removal(self, address: str) -> asyncio.Task[None] | None:
        """The removal of the engine at `address` still running (`begin_removal`), if any:
        whichever removed it (RemoveEngine, another replica's removal read by this one)."""
        return self._removals.get(address)

    async def _drop_removed(self, address: str, engine: _Engine | None) -> None:
        """Everything a removed engine left: its tasks and channel (which ends its calls),
        its index entries, the router's accounting of it."""
        try:
            if engine is not None:
                await engine.close()
                self._leaving.discard(engine)
            if engine is None or engine.writes_index:
                await self._drop_indexed(address)
            if engine is not None and engine.lease is not None:
                await engine.lease.release()  # another replica that has it takes it over
            if self.remote is not None:  # added again later, it is a first contact
                self.remote.restarted.discard(address)
            if self._on_engine_gone is not None:
                self._on_engine_gone(address)
        finally:
            del self._removals[address]
        await self._notify()

    async def _drop_indexed(self, address: str) -> None:
        """Remove the engine's entries from the index: its worker and, when its events come
        from several data-parallel ZMQ ranks, each rank's (`<address>/dp<r>`).

        An index that cannot answer (a shared Redis that is down) does not stop a removal or
        a restart: the Redis backend queues the worker's removal and applies it before any
        later batch of that worker (`RedisBackend.remove_worker`), and the engine's next
        subscription starts from a snapshot, which clears each worker it feeds. Only the
        ranks of a removed engine, which cannot be listed then, stay in the shared index
        (unrouted: no engine of the fleet has their address)."""
        if self.index is None:
            return
        try:
            await drop_engine(self.index, address)
        except KvplaneError as exc:
            log.warning("engine %s: index entries not removed yet: %s", address, exc)

    async def _resync_remote(self, engine: _Engine, first_contact: bool = False) -> None:
        """Tell the remote indexer that the engine restarted; until it confirms, the engine's
        hits from it are ignored (`RemoteIndex.restarted`) and each poll asks again. On a
        first contact, ask it to resync only a source that lost its stream, once."""
        assert self.remote is not None
        try:
            await self.remote.resync_engine(engine.address, first_contact=first_contact)
        except KvplaneError as exc:
            if first_contact:
                engine.remote_resync_failed.warn(
                    f"engine {engine.address}: the remote index could not be asked to drop "
                    f"blocks of an earlier process of it: {exc}"
                )
            else:
                engine.remote_resync_failed.warn(
                    f"engine {engine.address} restarted; the remote index is not told yet, "
                    f"its cache is ignored meanwhile: {exc}"
                )

    def stub(self, address: str) -> pb_grpc.OpenEngineAsyncStub:
        return self._engines[address].stub

    def engine_failure_details(self, code: grpc.StatusCode, details: str) -> str:
        """The details of a failed call to an engine as an operator reads them ("TLS
        handshake failed: CERTIFICATE_VERIFY_FAILED: ... (a server certificate not signed by
        the CA of engine_tls?)"), naming the controller's setting it most likely lacks."""
        return failure_details(self._engine_channels, code, details, ENGINE_SETTINGS)

    def why_calls_ended(self, address: str) -> str:
        """Why the fleet ended the calls to the engine at `address` by closing its channel:
        it left the fleet, or it was unreachable too long (`health.abandon_streams_after_s`)."""
        engine = self._engines.get(address)
        if engine is None or engine.calls_ended_because is None:
            return "left"
        return engine.calls_ended_because

    def channel(self, address: str) -> grpc.aio.Channel:
        """The engine's channel, for its other services (`vllm.Generate`); closed when the
        engine leaves the fleet or is abandoned as unreachable, which ends the calls on it.
        KeyError once it left."""
        return self._engines[address].channel

    def source_of(self, address: str) -> OpenEngineSource | ZmqSource | None:
        engine = self._engines.get(address)
        return engine.source if engine is not None else None

    def error_of(self, record: EngineRecord) -> str:
        """What the engine is shown with now (`Registry.error_of` at this fleet's clock: an
        ejected or held-down engine's time left counts down between its polls)."""
        return self.registry.error_of(record, self._clock())

    def event_following(self, record: EngineRecord) -> EventFollowing:
        """Whether this replica follows the engine's KV events into its index now, and if not
        why (`controller.event_following`); a removed engine's record says it is not."""
        engine = self._engines.get(record.address)
        last_s = engine.last_event_unix_s if engine is not None else None
        if not KvEventsMode(record.kv_events).followed:
            return EventFollowing(FollowingState.NOT_FOLLOWED, f"kv_events: {record.kv_events}")
        if self.index is None:
            reason = "the remote indexer follows them" if self.remote else "no index"
            return EventFollowing(FollowingState.NOT_FOLLOWED, reason)
        if engine is None:
            return EventFollowing(FollowingState.NOT_FOLLOWED, "removed")
        lease = engine.lease
        if engine.followed is not None and lease is not None and not lease.held:
            if lease.held_elsewhere:
                # The lease says nothing of its holder's kind: a `kvplane indexer` following
                # the engine into the same partition takes the same lease as a controller.
                reason = "another replica (controller or kvplane indexer) holds its writer lease"
                return EventFollowing(FollowingState.OTHER_REPLICA, reason, None, last_s)
            reason = "taking its writer lease on the shared index"
            return EventFollowing(FollowingState.CONNECTING, reason, None, last_s)
        if engine.followed is None:
            reason = "its identity is not read yet"
            return EventFollowing(FollowingState.CONNECTING, reason, None, last_s)
        task = engine.events_task
        if task is not None and task.done() and not task.cancelled() and task.exception():
            return EventFollowing(FollowingState.DOWN, str(task.exception()), None, last_s)
        if engine.source is None:
            if engine.no_source_reason is not None:
                reason = engine.no_source_reason
                return EventFollowing(FollowingState.DOWN, reason, None, last_s)
            reason = "not subscribed yet"
            return EventFollowing(FollowingState.CONNECTING, reason, None, last_s)
        link = engine.source.link
        if link.up:
            state = FollowingState.FOLLOWING
        else:
            state = FollowingState.DOWN if link.ever_up else FollowingState.CONNECTING
        return EventFollowing(state, link.reason, link.since_unix_s, last_s)

    def event_counters(self, address: str) -> SourceCounters | None:
        """The counters of the engine's KV-event source (None while it has none)."""
        source = self.source_of(address)
        return source.counters if source is not None else None

    async def close(self) -> None:
        if self._relisting is not None:
            self._relisting.cancel()
        removals = list(self._removals.values())
        for task in removals:
            task.cancel()
        if removals:
            await asyncio.wait(removals)
        engines = [*self._engines.values(), *self._leaving]
        self._engines.clear()
        self._leaving.clear()
        for engine in engines:
            await engine.close()
        # The other replicas take over the engines this one followed at their next renewal.
        await asyncio.gather(*(e.lease.release() for e in engines if e.lease is not None))
        if self.remote is not None:
            await self.remote.close()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait until `predicate()` holds after some registry change (tests, `kvplane up`)."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(predicate)

    async def request_drain(self, key: str) -> EngineRecord:
        """The controller is draining this engine: out of routing now, not at the next poll."""
        record = self.registry.request_drain(key)
        await self._notify()
        return record

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def on_request_result(self, engine: str, fault: str | None) -> float | None:
        """How a request the gateway sent to `engine` (address or instance id) ended: served
        (`fault` None) or failed by a fault of the engine's own (`fault` says what). Returns
        how long the engine is now ejected from routing, None when it is not."""
        if fault is None:
            self.registry.on_request_served(engine)
            return None
        ejected_s = self.registry.on_request_failed(engine, self._clock(), fault)
        if ejected_s is not None:
            log.warning(
                "engine %s ejected from routing for %g s: %s",
                engine,
                ejected_s,
                self.error_of(self.registry.get(engine)),
            )
            await self._notify()
        return ejected_s

    # ---- routing view ----

    def _hashing_block_size(self, engine: str) -> int | None:
        """The block size a prompt for `engine` alone is hashed in (`block_size`); None until
        the controller has read the engine's identity (it may report another size)."""
        record = self.registry.by_engine_id(engine)
        if record is None or record.identity is None:
            return None
        return self.block_size([record])

    def block_size(self, records: Sequence[EngineRecord]) -> int:
        """The block size a prompt for `records` is hashed in: theirs (a fleet may serve
        models of different block sizes), the most common one if they disagree (an engine
        of another size then has no cache the router can see), else the config's default.
        Between sizes equally common, the config's default when it is one of them (two
        engines, one reporting a size nothing else uses: the order of their addresses
        decided), else the first engine's."""
        default = self.config.default_block_size
        sizes = Counter(
            r.identity.block_size for r in records if r.identity and r.identity.block_size
        )
        if not sizes:
            return default
        if len(sizes) > 1:
            self._mixed_block_sizes.warn(
                f"the engines a prompt may go to have block sizes {sorted(sizes)}: it is "
                "matched in the most common one; the others are routed without cache knowledge"
            )
        most = max(sizes.values())
        if sizes.get(default) == most:
            return default
        return sizes.most_common(1)[0][0]

    async def prompt_view(
        self,
        token_ids: Sequence[int] | None,
        *,
        model: str = "",
        lora_name: str = "",
        cache_salt: str = "",
        role: Role | None = Role.AGGREGATED,
        cordoned: bool = False,
    ) -> PromptView:
        """The prompt's keys and its candidates (with `cordoned`, admin `match`: cordoned
        engines too, and the engines out of routing for their state aside, `out_of_routing`)."""
        version = None if cordoned else self.registry.version
        records = self.registry.routable(
            model or None, role, lora_name, cordoned=cordoned, generating=True
        )
        if lora_name and not records:
            await self.relist_loras()
            records = self.registry.routable(
                model or None, role, lora_name, cordoned=cordoned, generating=True
            )
        held_out = (
            self.registry.out_of_routing(model or None, role, lora_name, generating=True)
            if cordoned
            else []
        )
        if lora_name and not records and not held_out:
            # Only engines holding the adapter may take the request: say why there is none
            # (admin `match` lists the holders out of routing instead).
            self.registry.check_lora(lora_name, model or None)
        # With no engine to route to (the model's engines drained, down, cordoned), the size
        # they were last known to use: admin `match` shows the prompt's blocks as they
        # cache them, not in the config's default size.
        size = self.block_size(records or self.registry.may_serve_records(model or None))
        keys: tuple[int, ...] = ()
        hits: dict[str, PrefixHit] = {}
        lora, salt = lora_name or None, cache_salt or None
        index_error: str | None = None
        # An index that cannot answer: route without its knowledge rather than fail (the
        # prompt's own keys still meet the router's record of the prompts it just routed).
        listed = records or held_out
        if token_ids and listed and self.remote is not None:
            try:
                keys, hits = await self.remote.match(token_ids, size, lora_name, cache_salt)
            except KvplaneError as exc:
                index_error = str(exc)
                keys = self.remote.prompt_keys(token_ids, size, lora_name, cache_salt)
        elif token_ids:
            keys = tuple(block_keys(token_ids, size, lora_name=lora, cache_salt=salt))
            if keys and self.index is not None and listed:
                try:
                    cacheable = cacheable_blocks(len(token_ids), size, len(keys))
                    hits = await self._indexed_hits(self.index, keys, self._hit_worth, cacheable)
                except KvplaneError as exc:  # the shared Redis is down, loading or refusing
                    index_error = str(exc)
        if index_error is not None:
            self._routing_blind.warn(f"{index_error}; routing by load")
        candidates = tuple(self.candidate(r, hits.get(r.address, _NO_HIT)) for r in records)
        aside = tuple(self.candidate(r, hits.get(r.address, _NO_HIT)) for r in held_out)
        return PromptView(size, keys, candidates, index_error, version, aside)

    def candidate(self, record: EngineRecord, hit: PrefixHit = _NO_HIT) -> Candidate:
        """The engine as the router sees it: its last load, capacity and indexed blocks, and
        `hit`, the request's prefix it holds."""
        identity = record.identity
        return Candidate(
            record.address,
            hit=hit,
            load=record.load,
            total_kv_blocks=_capacity(record),
            block_size=identity.block_size if identity else None,
            cached_blocks=self.indexed_blocks.get(record.address),
            predicts_cache=record.kv_events == KvEventsMode.approximate.value,
        )

    def _tell_predicted(self, address: str) -> None:
        """A process of the engine was met (the first one included: `_forget_old_process`,
        which forgets what the router predicted of an earlier one): tell the router that it
        predicts this one's cache, if it does (`kv_events: approximate`), so that a peer
        replica's routes there are predictions from then on, not only once this replica has
        had the engine among its own candidates."""
        record = self.registry.by_engine_id(address)
        if record is None or self._on_cache_predicted is None:
            return
        candidate = self.candidate(record)
        if candidate.predicts_cache:
            self._on_cache_predicted(address, candidate.capacity_blocks)

    @staticmethod
    async def _indexed_hits(
        index: IndexBackend,
        keys: Sequence[int],
        worth: Callable[[PrefixHit, int], float],
        cacheable: int,
    ) -> dict[str, PrefixHit]:
        """Each engine's cached prefix of `keys` in the controller's own index (an engine's
        worthiest rank's by `worth` for a prompt served at most `cacheable` blocks from
        cache, `keep_best_hit`)."""
        hits: dict[str, PrefixHit] = {}
        for match in await index.match_prefix_by_tier(keys, 0):
            device = _device_blocks(match.tiers)
            hit = PrefixHit.along(device, match.matched_blocks, match.any_tier_blocks)
            keep_best_hit(hits, engine_worker_id(match.worker_id), hit, worth, cacheable)
        return hits

    # ---- polling ----

    async def _poll(self, engine: _Engine) -> None:
        health = self.config.health
        address = engine.address
        next_health = 0.0
        need_identity = True
        # GetLoad's instance id since the identity was fetched; "" until it names one.
        load_instance = ""
        # Every instance id GetLoad named since the engine's polls last failed: one named
        # again after another is no restart (a process does not come back from before its
        # successor without an outage) but several processes answering at one address.
        named: set[str] = set()
        # The next identity fetched is a new process: GetLoad named a new instance, or the
        # process answering was rejected as incompatible (whatever answers next is another).
        restarted = False
        # The KV-event stream broke sequence: the next identity is compared with the last.
        stream_broke = False
        # A poll failed (any failure, not only a lost connection): the next identity is
        # compared with the last too. A poll that reached a process shutting down fails
        # (CANCELLED, say) before the stream of its successor under the same instance id
        # breaks sequence: read first, that successor's identity would be taken for the old
        # process's, and the break, compared with it, would show nothing.
        poll_failed = False
        # The fleet view (`controller.fleet_view`) the identity read last is of: a controller
        # fronted as an engine tells it; None until it does.
        identity_view: str | None = None
        followed = False  # a process was accepted here: what it left must go if it is replaced
        while True:
            # A cancellation that landed in a Redis call (the shared drains, the index) may
            # have come out of it as redis-py's error, which the turn took for Redis's.
            stop_if_cancelled()
            now = self._clock()
            if engine.events_out_of_sequence.is_set():
                engine.events_out_of_sequence.clear()
                need_identity = stream_broke = True
                next_health = 0.0  # a new process's health, once its identity is in
            try:
                if need_identity:
                    identity_view = await self._fetch_identity(
                        engine, restarted, stream_broke, poll_failed=poll_failed
                    )
                    need_identity = restarted = stream_broke = poll_failed = False
                    followed = True
                    load_instance = ""
                elif self.remote is not None and engine.address in self.remote.restarted:
                    await self._resync_remote(engine)
                reply: pb.HealthResponse | None = None
                if now >= next_health:
                    reply = await engine.stub.Health(
                        pb.HealthRequest(), timeout=health.rpc_timeout_s
                    )
                    next_health = now + health.poll_interval_s
                load = await engine.stub.GetLoad(pb.GetLoadRequest(), timeout=health.rpc_timeout_s)
                # Compared with GetLoad's own earlier answers, not with GetEngineInfo's
                # instance id: an engine may leave that one empty or name itself otherwise
                # there, which would read as a restart at every poll.
                changed = bool(load_instance) and load.instance_id not in ("", load_instance)
                if changed and load.instance_id in named:
                    raise IncompatibleEngineError(
                        f"GetLoad named instance {load.instance_id} again after "
                        f"{load_instance}: several engine processes answer at this address "
                        "(a load balancer in front of them?); register each engine process "
                        "at an address of its own"
                    )
                if load.instance_id:
                    named.add(load.instance_id)
                if changed:
                    log.info("engine %s restarted (instance %s)", address, load.instance_id)
                    # Out of routing until the new process's identity is read and the old
                    # one's blocks are dropped: they would attract traffic meanwhile.
                    await self._excuse_shared_drain(engine, EngineState.UNKNOWN)
                    self.registry.on_new_instance(address, now)
                    await self._notify()
                    need_identity = restarted = True
                    next_health = 0.0  # the new process's health, once its identity is in
                    continue
                load_instance = load.instance_id or load_instance
                # The health answer counts once GetLoad answered too: an engine whose GetLoad
                # fails would otherwise turn routable (READY) for the instant between the two
                # at every retry, and take requests there.
                if reply is not None:
                    state, message = health_of(reply)
                    await self._excuse_shared_drain(engine, state)
                    self.registry.on_health(address, state, now, message)
                self.registry.on_load(address, load_from_proto(load))
                view = load.attributes.get(FLEET_VIEW_KEY)
                if view is not None and identity_view is not None and view != identity_view:
                    identity_view = await self._read_moved_view(engine, view) or identity_view
                    next_health = 0.0  # back in routing at once if another block size took it out
                else:
                    identity_view = view or identity_view
                if reply is not None:
                    await self._notify()
                    unloads = bool(self.lora_intent.unconfirmed_on(address))
                    if unloads or engine.restore_due:  # (the usual case: neither)
                        self._lora_work_due(engine, unloads=unloads)
                if engine.dialled.doubted:
                    await self._end_silent_calls(engine)
                delay = health.load_poll_interval_s
            except asyncio.CancelledError:
                raise
            except IncompatibleEngineError as exc:
                self.registry.mark_incompatible(address, str(exc))
                log.error("engine %s rejected: %s", address, exc)
                if followed:
                    # The process followed until now is not the one answering (replaced by
                    # an incompatible build, or by the same engine under another address):
                    # its events, index entries and in-flight accounting go now, not when a
                    # compatible process comes back, which is then a new one.
                    followed = False
                    try:
                        await self._forget_old_process(engine)
                    except Exception:  # a bug: out of this handler it would end the polls
                        log.exception("engine %s: forgetting its old process failed", address)
                await self._notify()
                delay = health.backoff_max_s
                need_identity = restarted = True
            except grpc.aio.AioRpcError as exc:
                named.clear()  # whatever answers next may be a new process, under any id
                details = self.engine_failure_details(exc.code(), exc.details() or "")
                error = f"{exc.code().name}: {details}"
                failure = poll_failure(exc.code().name)
                if failure is PollFailure.TIMED_OUT:
                    # Its connection may be dead without a reset (a blackholed path): polled
                    # on it, the engine would stay unreachable until the kernel gave up on it
                    # (some 15 minutes); a new one reaches it at once if it answers.
                    engine.dialled.dial_afresh(doubted=True)
                await self._excuse_shared_drain(engine, failure.state)
                delay = self.registry.on_poll_failed(address, now, error, failure)
                said = failure.state.value
                log.warning("engine %s %s (%s); retry in %.1fs", address, said, error, delay)
                need_identity = poll_failed = True
                next_health = 0.0
                await self._notify()
                if engine.dialled.renewed():  # an expired client certificate, say
                    log.info("engine %s: dialling it again with its renewed engine_tls files",
                             address)  # fmt: skip
                    await engine.abandon_calls("dialled again with renewed engine_tls files")
                await self._wait_unreachable(engine, delay, failure)
                continue
            except Exception as exc:  # a bug or a malformed answer: keep polling, loudly
                log.exception("engine %s: poll failed", address)
                delay = self.registry.on_poll_failed(
                    address, now, f"poll failed: {exc}", PollFailure.ERROR_ANSWER
                )
                need_identity = poll_failed = True
            await engine.wait_poll_interval(delay)

    async def _end_silent_calls(self, engine: _Engine) -> None:
        """The engine answered a poll on a new connection, dialled after one timed out on the
        old one, which still holds calls (relayed streams): each old connection so doubted is
        polled too (Health, `rpc_timeout_s`; any answer, an error included, is one). One that
        does not answer while the engine answers on the new one, and over which none of its
        calls brought a response meanwhile (`calls_heard`), is dead without a reset (a
        blackholed path, a NAT entry expired): its calls end at once, as an abandoned
        engine's do (`abandon_calls`), instead of waiting for keepalive; one that answers
        (the engine was only slow), or whose calls' responses come in however late (a
        congested connection), keeps them."""
        timeout_s = self.config.health.rpc_timeout_s

        async def answers(channel: grpc.aio.Channel) -> bool:
            before = self.calls_heard.of(channel)
            try:
                await pb_grpc.OpenEngineStub(channel).Health(pb.HealthRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                answered = poll_failure(exc.code().name) is PollFailure.ERROR_ANSWER
                return answered or self.calls_heard.since(before)
            return True

        silent = await engine.dialled.check_doubted(answers)
        if not silent:
            return
        log.warning("engine %s went silent on the connection holding its calls, answering on "
                    "a new one: ending them", engine.address)  # fmt: skip
        engine.calls_ended_because = "went silent on the call's connection (a new one reaches it)"
        await engine.dialled.end_calls_on(silent)

    async def _excuse_shared_drain(self, engine: _Engine, state: EngineState) -> None:
        """Before the engine takes `state`: a leave from ready that would count as a flap may
        be a drain made through another controller replica, which this one's polls did not
        see (the engine drained and stopped within a poll interval). The shared membership
        is asked then, at that moment (one read): a drain of this very process, not excused
        here before, is no flap (`Registry.drained_elsewhere`)."""
        if self.shared_drains is None or not self.registry.would_flap(engine.address, state):
            return
        drain = await self.shared_drains(engine.address)
        if drain is None or drain[0] == engine.excused_drain:
            return
        token, instance_id = drain
        if self.registry.drained_elsewhere(engine.address, instance_id):
            log.info("engine %s leaves ready after a drain through another controller replica "
                     "(instance %s): no flap", engine.address, instance_id)  # fmt: skip
            engine.excused_drain = token

    async def _wait_unreachable(
        self, engine: _Engine, delay_s: float, failure: PollFailure
    ) -> None:
        """Wait `delay_s` for the next poll of an engine whose poll failed (`failure`),
        abandoning the calls it holds on the way once it has been unreachable for
        `health.abandon_streams_after_s` (once per outage). One that could not be reached
        (CONNECTION_LOST: nothing listens at its address) is polled at once when its channel
        connects again (`_until_back`): an engine restarted is back in routing within about
        a second of answering, not at the backoff's next step (up to `backoff_max_s`)."""
        back = failure is PollFailure.CONNECTION_LOST
        limit_s = self.config.health.abandon_streams_after_s
        since_s = self.registry.unreachable_since(engine.address)
        if not limit_s or since_s is None or engine.abandoned_outage_s == since_s:
            await self._until_back(engine, delay_s, back)
            return
        due_in_s = max(0.0, since_s + limit_s - self._clock())
        if due_in_s > delay_s:  # the next poll comes first and may find it back
            await self._until_back(engine, delay_s, back)
            return
        if await self._until_back(engine, due_in_s, back):
            return
        unreachable_s = self._clock() - since_s
        log.warning("engine %s unreachable for %.1f s: ending the calls it holds",
                    engine.address, unreachable_s)  # fmt: skip
        engine.abandoned_outage_s = since_s
        await engine.abandon_calls(f"unreachable for {unreachable_s:.1f} s")
        await self._until_back(engine, delay_s - due_in_s, back)

    @staticmethod
    async def _until_back(engine: _Engine, delay_s: float, back: bool) -> bool:
        """Sleep `delay_s`; with `back`, only until the engine's channel connects again
        (`kvplane.channels.reconnected`: no call made, the channel reconnecting about every
        second). True when it did. Only for an engine nothing listened for: the channel of
        one that answers errors, or hangs with its port open, stays connected, and a poll
        that timed out dials afresh, a new channel that would connect at once. Not on a
        channel connected now (UNAVAILABLE answered over it: a proxy whose upstream is gone):
        its state may not change for long, and each wait timed out would stay in gRPC until
        it does, one more at every step of the backoff."""
        if not back or engine.channel.get_state() is grpc.ChannelConnectivity.READY:
            await asyncio.sleep(delay_s)
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await reconnected(engine.channel)
                return True
        return False

    async def _read_moved_view(self, engine: _Engine, view: str) -> str | None:
        """A controller fronted as an engine told (GetLoad) that its fleet view moved to
        `view`: read its identity again, as the same process's. Returns the view the identity
        read is of; None when it could not be read (an engine of a model that joined is not
        ready to answer GetModelInfo yet, say): the old identity stands, asked again at the
        next poll, and the fronted fleet is not taken for unreachable."""
        log.info("engine %s (a controller) changed its fleet view: reading its models again",
                 engine.address)  # fmt: skip
        try:
            told = await self._fetch_identity(engine, view_moved=True)
        except grpc.aio.AioRpcError as exc:
            engine.view_unread.warn(
                f"engine {engine.address} (a controller) changed its fleet view, which could "
                f"not be read ({exc.code().name}: {exc.details()}); its old models stand, "
                "asked again at its next poll"
            )
            return None
        await self._notify()
        return told or view

    async def _fetch_identity(
        self,
        engine: _Engine,
        restarted: bool = False,
        stream_broke: bool = False,
        view_moved: bool = False,
        poll_failed: bool = False,
    ) -> str | None:
        """Read the engine's identity. `restarted`: it is a new process (GetLoad named one,
        or the one followed was rejected). `stream_broke`: its KV events broke sequence,
        which a new process under the same instance id does, and so does one that lost its
        place in the stream; an identity other than the last one read says which.
        `poll_failed`: a poll failed since the last one read (however: a lost connection, no
        answer in time, an error answer such as the CANCELLED of a process shutting down),
        which a restart under the same instance id does too, its stream's break perhaps not
        seen yet: an identity other than the last one read is a new process as well, but for
        a controller fronted as an engine (its identity moves with its fleet view), which
        only another block size makes a new one, as `view_moved` does.
        `view_moved`: a controller fronted as an engine told that its fleet view moved (the
        same process): only another block size makes it a new one, whose blocks go. Returns
        the fleet view a controller told with it (`controller.fleet_view`), else None."""
        timeout = self.config.health.rpc_timeout_s
        call = engine.stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=timeout)
        info = await call
        trailing = await call.trailing_metadata()
        fronts = metadata_values(trailing, FRONTS_METADATA_KEY)
        told_view = next(iter(metadata_values(trailing, FLEET_VIEW_KEY)), None)
        # Fail closed before asking anything else of an engine we cannot speak to.
        check_revision(info.schema_revision, info.minimum_client_revision, info.schema_release)
        models = tuple(info.supported_models)
        facts = await self._model_facts(engine, models)
        identity = EngineIdentity(
            instance_id=info.instance_id or engine.address,
            engine_name=info.engine_name,
            engine_version=info.engine_version,
            role=_ROLE.get(info.role, Role.UNKNOWN),
            models=models,
            block_size=agreed_block_size(models, facts),
            schema_revision=info.schema_revision,
            minimum_client_revision=info.minimum_client_revision,
            schema_release=info.schema_release,
            model_facts=facts,
            fronted_controller_ids=frozenset(fronts),
        )
        await self._lora_listings_open.wait()
        listed_at = engine.lora_task_changes
        adapters = await self._list_loras(engine, identity)
        previous = self.registry.get(engine.address).identity
        first_contact = previous is None
        sign = _sign_of_new_process(previous, identity, stream_broke, poll_failed, view_moved)
        if previous is not None and sign is not None:
            same_instance = identity.instance_id == previous.instance_id
            if same_instance:
                log.info("engine %s changed its identity under its instance id (%s): taken as a "
                         "new process", engine.address, sign)  # fmt: skip
            else:
                log.info("engine %s restarted (%s, its identity changed)",
                         engine.address, sign)  # fmt: skip
            # As a new process GetLoad names: out of routing until the old one is forgotten;
            # a flap only if another instance id says that the process changed.
            if not same_instance:
                await self._excuse_shared_drain(engine, EngineState.UNKNOWN)
            self.registry.on_new_instance(engine.address, self._clock(), same_instance)
            restarted = True
        is_new = self.registry.on_identity(engine.address, identity, restarted)
        # A new process's adapters are learnt whatever its LoRA task did meanwhile (the
        # registry knows none of them); the same process's (a fleet view re-read) as the
        # listing guard allows.
        self.learn_loras(
            engine.address,
            _names(adapters),
            listed_at if not is_new else engine.lora_task_changes,
            self._lora_conflicts(adapters),
        )
        if is_new:
            await self._take_in_loras(engine.address, adapters)
            engine.events_pending = True
            await self._forget_old_process(engine, first_contact)
        if engine.events_pending:
            await self._follow_events(engine, identity)
            engine.events_pending = False
        # Whenever its adapters were read again: a new process (restarted, back after an
        # outage, scaled up, registered), also one restarted under the same identity
        # faster than a poll, which only its broken event stream shows.
        if self._missing_loras(engine.address):  # (the usual case: none)
            self._lora_work_due(engine, restore=True)
        return told_view

    async def _take_in_loras(self, address: str, adapters: tuple[LoraSpec, ...] | None) -> None:
        """Tell the fleet's LoRA intent what a process of the engine met anew holds: so
        that a restarted controller learns the fleet's adapters back from its engines (it
        keeps nothing of its own). An adapter held under a name the intent knows with
        another id or path is not taken in: the known one stays the fleet's, and requests
        naming it are not routed to this engine (`EngineRecord.lora_conflicts`) until it is
        unloaded there, hence a warning."""
        fleet = [r.address for r in self.registry.records()]
        identity = self.registry.get(address).identity
        # What an adapter found there was loaded for.
        model = identity.base_model if identity is not None else None
        if not adapters:  # nothing to take in: no need to wait for a LoRA call in progress
            self.lora_intent.found_on(address, adapters, fleet, model)
            return
        async with self.lora_changes:
            conflicts = self.lora_intent.found_on(address, adapters, fleet, model)
        for found, known in conflicts:
            log.warning("engine %s holds LoRA adapter %s, which conflicts with %s the fleet "
                        "holds: one name is one adapter across the fleet; requests naming it "
                        "are not routed there until it is unloaded there (lora unload "
                        "--engine)", address, found, known)  # fmt: skip

    def hold_lora_listings(self, held: bool) -> None:
        """Whether the engines met from now on wait to have their adapters listed (and taken
        into the LoRA intent): held by `controller.membership` until its first read of the
        fleet's LoRA intent shared by the controller replicas, which takes an unload written
        there before as older than what this replica's listings find."""
        if held:
            self._lora_listings_open.clear()
        else:
            self._lora_listings_open.set()

    @property
    def lora_listings_held(self) -> bool:
        return not self._lora_listings_open.is_set()

    def _lora_conflicts(self, adapters: Sequence[LoraSpec] | None) -> frozenset[str]:
        """The names of `adapters` held with another id or path than the adapter the fleet
        knows under that name: requests naming it are not routed to their engine."""
        return frozenset(a.lora_name for a in adapters or () if self.lora_intent.conflict(a))

    def _missing_loras(self, address: str) -> list[LoraSpec]:
        """The adapters the fleet's intent wants on the engine that it does not hold (none
        when it serves no LoRA)."""
        record = self.registry.get(address)
        if record.lora_adapters is None:
            return []
        models = record.identity.models if record.identity is not None else ()
        return [
            spec
            for spec in self.lora_intent.wanted_on(address, models)
            if spec.lora_name not in record.lora_adapters  # (a conflicting copy: not loadable)
        ]

    def _lora_work_due(self, engine: _Engine, restore: bool = False, unloads: bool = False) -> None:
        """A restore of the engine's adapters, or its unconfirmed unloads, are due: done by
        its LoRA task, started unless one runs (which does them before it ends)."""
        engine.restore_due |= restore
        engine.unloads_due |= unloads
        if restore:
            self.registry.on_lora_restore(engine.address)
        if engine.lora_task is None or engine.lora_task.done():
            engine.lora_task = asyncio.create_task(
                self._lora_work(engine), name=f"loras {engine.address}"
            )

    async def _lora_work(self, engine: _Engine) -> None:
        """The engine's LoRA task: its restore (`_restore_loras`) and re-applied unloads
        (`_reapply_unloads`) until none is due. Off its poll task: an engine whose LoRA
        calls hang (up to `lora_timeout_s` each) is polled meanwhile all the same."""
        while engine.restore_due or engine.unloads_due:
            restore, unloads = engine.restore_due, engine.unloads_due
            engine.restore_due = engine.unloads_due = False
            try:
                if restore:
                    await self._restore_loras(engine)
                if unloads:
                    await self._reapply_unloads(engine)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: logged, and still due: its next poll starts it again
                engine.lora_work_failed.warn(
                    f"engine {engine.address}: its LoRA adapters not brought up to date: {exc!r}",
                    exc,
                )
                engine.restore_due |= restore
                engine.unloads_due |= unloads
                return

    @contextlib.asynccontextmanager
    async def lora_change_to(self, address: str, timeout_s: float) -> AsyncIterator[float]:
        """Hold the engine's LoRA changes (`_Engine.lora_calls`) for one sent to it (the
        gateway's LoadLora, UnloadLora), waiting at most `timeout_s` for the one it runs:
        DEADLINE_EXCEEDED after that, as the engine's own timeout would be. Yields what is
        left of `timeout_s` for the call: the wait and the call share it, so a change takes
        `timeout_s` at most."""
        engine = self._engines[address]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                await engine.lora_calls.acquire()
        except TimeoutError:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "its earlier LoRA call (restoring its adapters or unloading one) is not "
                "answered yet",
            ) from None
        try:
            yield max(deadline - loop.time(), 0.0)
        finally:
            engine.lora_calls.release()

    def lora_task_changes(self, address: str) -> int:
        """How many changes the engine's LoRA task has made (its restores, its re-applied
        unloads): a listing of its adapters (the gateway's ListLoras) during which this
        moved may be from before one, and would undo what it taught the router."""
        engine = self._engines.get(address)
        return engine.lora_task_changes if engine is not None else 0

    def learn_loras(
        self,
        address: str,
        adapters: frozenset[str] | None,
        listed_at: int,
        conflicts: frozenset[str] = frozenset(),
    ) -> None:
        """Record the adapters a listing found on the engine (`Registry.on_loras`), unless
        its LoRA task changed them while the listing ran (`listed_at`: its
        `lora_task_changes` as the listing began): the listing may be from before that
        change, and would undo what it taught the router. Every listing that is learnt (the
        gateway's ListLoras, `refresh_loras`, an identity read) goes through here."""
        if self.lora_task_changes(address) == listed_at:
            self.registry.on_loras(address, adapters, conflicts)

    async def _next_lora_change(self, engine: _Engine, due: Callable[[], bool]) -> bool:
        """Take the engine's LoRA changes (`_Engine.lora_calls`) for a change of its LoRA
        task if `due()` still holds once no gateway LoRA call runs (it may have made the
        change, or its opposite, meanwhile); False, and nothing held, if not. The gateway
        takes the engine's only under `lora_changes`, so it is free here. False too for an
        engine removed meanwhile: its LoRA work ends there (`due` would not find it)."""
        async with self.lora_changes:
            if self._engines.get(engine.address) is not engine or not due():
                return False
            await engine.lora_calls.acquire()
            return True

    async def _reapply_unloads(self, engine: _Engine) -> None:
        """Unload from the engine what was unloaded through this controller and it still
        holds, as the controller knows (it did not answer the unload: away, failing, wedged,
        and back since, the same process): due at each health poll it answers. The unload is
        the operator's intent as a load is, re-applied as loads are restored. One it refuses
        again is logged (at most once per BLIND_WARNING_INTERVAL_S for the engine), and tried
        again at its next health poll; until then it keeps the adapter, and requests naming
        it. One it does not answer (UNAVAILABLE, DEADLINE_EXCEEDED) ends the unloads there,
        as a restore of its loads ends."""
        address = engine.address

        def due(name: str) -> bool:
            held = self.registry.get(address).lora_adapters or frozenset()
            return name in self.lora_intent.unloads_due(address, held)

        for name in self.lora_intent.unconfirmed_on(address):
            if not await self._next_lora_change(engine, functools.partial(due, name)):
                continue
            try:
                await engine.stub.UnloadLora(
                    pb.UnloadLoraRequest(lora_name=name), timeout=self.config.lora_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: gone already
                    engine.unload_refused.warn(
                        f"engine {address}: LoRA adapter {name!r}, unloaded through "
                        f"the controller while it did not answer, not unloaded: "
                        f"{exc.code().name}: {exc.details()}"
                    )
                    if exc.code() in _LORA_CALLS_UNANSWERED:
                        return  # the others would wait as long: at its next poll
                    continue
            finally:
                engine.lora_calls.release()
            log.info("engine %s: LoRA adapter %r unloaded, as it was from the fleet while "
                     "it did not answer", address, name)  # fmt: skip
            self.registry.on_lora_unloaded(address, name)
            self.lora_intent.unload_confirmed(name, address)
            engine.lora_task_changes += 1

    async def _restore_loras(self, engine: _Engine) -> None:
        """Load on the engine the adapters the fleet's intent wants there and it lacks, one
        by one, in the order they were loaded; each is routed to there once loaded. A
        refusal (out of LoRA slots, a directory gone since) is logged and leaves the engine
        without that adapter until its adapters are next read again; the intent stays."""
        address = engine.address

        def due(spec: LoraSpec) -> bool:
            return spec in self._missing_loras(address)

        for spec in self._missing_loras(address):
            adapter = pb.LoraAdapter(
                lora_id=spec.lora_id, lora_name=spec.lora_name, source_path=spec.source_path
            )
            model = self.lora_intent.model_of(spec.lora_name, address)
            # (Nothing between taking the engine's LoRA changes and the `try` that lets go.)
            if not await self._next_lora_change(engine, functools.partial(due, spec)):
                continue
            try:
                await engine.stub.LoadLora(
                    pb.LoadLoraRequest(adapter=adapter),
                    timeout=self.config.lora_timeout_s,
                    metadata=lora_model_metadata(model),
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("engine %s: LoRA adapter %s not restored: %s: %s",
                            address, spec, exc.code().name, exc.details())  # fmt: skip
                if exc.code() in _LORA_CALLS_UNANSWERED:
                    return  # gone again: its next process is restored then
                self.registry.on_lora_refused(address, spec.lora_name)
                continue
            finally:
                engine.lora_calls.release()
            log.info("engine %s: LoRA adapter %s restored", address, spec)
            self.registry.on_lora_loaded(address, spec.lora_name)
            engine.lora_task_changes += 1

    async def _model_facts(
        self, engine: _Engine, models: tuple[str, ...]
    ) -> tuple[ModelFacts, ...]:
        """Every served model's GetModelInfo, asked at once (each model has its own tasks,
        generation and block size); empty when the engine does not implement it."""
        timeout = self.config.health.rpc_timeout_s
        replies = await asyncio.gather(
            *(
                engine.stub.GetModelInfo(pb.GetModelInfoRequest(model=m), timeout=timeout)
                for m in models
            ),
            return_exceptions=True,  # every call ends before any failure is raised
        )
        facts: list[ModelFacts] = []
        for reply in replies:
            if isinstance(reply, grpc.aio.AioRpcError):
                if reply.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return ()
                raise reply
            if isinstance(reply, BaseException):
                raise reply
            facts.append(model_facts(reply))
        return tuple(facts)

    async def refresh_loras(self, address: str) -> None:
        """Read the engine's adapters again (ListLoras): one refused a request naming an
        adapter the controller believes it holds (unloaded behind the controller's back, or
        a new process the controller has not noticed yet). Failures leave what was known."""
        engine = self._engines.get(address)
        identity = self.registry.get(address).identity if engine is not None else None
        if engine is None or identity is None:
            return
        listed_at = engine.lora_task_changes
        try:
            adapters = await self._list_loras(engine, identity)
        except grpc.aio.AioRpcError as exc:
            log.info("engine %s: LoRA adapters not read again: %s", address, exc.code().name)
            return
        self.learn_loras(address, _names(adapters), listed_at, self._lora_conflicts(adapters))

    async def relist_loras(self) -> None:
        """Read every routable engine's adapters again (ListLoras, as `refresh_loras`): a
        request names an adapter that no engine taking it is known to hold. It may have been
        loaded since this controller last listed them, through another controller replica
        behind the same load balancer (whose LoadLora reaches the engines, not this replica)
        or on an engine directly; without a listing the request would be refused NOT_FOUND
        here while another replica routes it. At most one listing per
        `health.poll_interval_s`, shared by the requests that come while it runs, so that
        requests naming an adapter no engine holds do not each list the whole fleet."""
        if self._relisting is None:
            if self._clock() - self._relisted_s < self.config.health.poll_interval_s:
                return
            self._relisted_s = self._clock()
            addresses = [r.address for r in self.registry.routable() if r.lora_adapters is not None]
            self._relisting = asyncio.create_task(self._relist(addresses), name="LoRA relisting")
            self._relisting.add_done_callback(self._relisted)
        await asyncio.shield(self._relisting)

    async def _relist(self, addresses: list[str]) -> None:
        await asyncio.gather(*(self.refresh_loras(a) for a in addresses))

    def _relisted(self, task: asyncio.Task[None]) -> None:
        self._relisting = None
        self._relisted_s = self._clock()

    async def _list_loras(
        self, engine: _Engine, identity: EngineIdentity
    ) -> tuple[LoraSpec, ...] | None:
        """The LoRA adapters the engine holds, in its order; None when it serves no LoRA (says
        `supports_lora: false`, or answers ListLoras FAILED_PRECONDITION or UNIMPLEMENTED)."""
        if identity.supports_lora is False:
            return None
        try:
            reply = await engine.stub.ListLoras(
                pb.ListLorasRequest(), timeout=self.config.health.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                return None
            raise
        return tuple(LoraSpec(a.lora_id, a.lora_name, a.source_path) for a in reply.adapters)

    async def _forget_old_process(self, engine: _Engine, first_contact: bool = False) -> None:
        """A new engine process: stop following the old one's events, drop what the router
        and the index knew of the address. A remote index is told of a restart; on a first
        contact it is asked to resync only a source of the engine that lost its stream (it
        follows the engine by itself, and while subscribed what it holds is the process's).

        A first contact leaves the router's accounting alone: the router cannot have routed to
        an engine not met yet, so all it holds of it is what peer replicas told it (their
        snapshot can come first), about this very process; were it an earlier one, the peers
        forget that one when they meet this one and release its requests here too."""
        if self.remote is not None:
            # First of all: the engine's hits are ignored from now until the indexer answers.
            await self._resync_remote(engine, first_contact)
        async with engine.events_lock:
            engine.followed = None
            if engine.events_task is not None:
                task = engine.events_task
                engine.stop_events()
                # Not `await` under a suppress of CancelledError: that would swallow this poll
                # task's own cancellation (RemoveEngine, close) arriving meanwhile, and the
                # poll would go on and follow the events again, out of anyone's reach.
                await asyncio.wait([task])
            # The old process's last batch is not the new one's (`admin workers`' "last");
            # its sources' counters go on (Prometheus counters never go back).
            engine.last_event_unix_s = None
        if self._on_engine_gone is not None and not first_contact:
            self._on_engine_gone(engine.address)
        self._tell_predicted(engine.address)
        # On a shared index, the replica holding the engine's lease drops them (its new
        # subscription's snapshot clears the worker anyway).
        if engine.writes_index:
            await self._drop_indexed(engine.address)

    async def _follow_events(self, engine: _Engine, identity: EngineIdentity) -> None:
        """Subscribe to the engine process's KV events into the index (as configured); on a
        shared index, once this replica holds the engine's writer lease."""
        record = self.registry.get(engine.address)
        if self.index is None or not KvEventsMode(record.kv_events).followed:
            return
        async with engine.events_lock:
            engine.followed = identity
            if engine.lease is not None and not engine.lease.held:
                engine.lease.wake()  # it follows them once it takes the lease
                return
            await self._start_events(engine, identity)

    async def _lease_taken(self, engine: _Engine, resync: bool) -> None:
        """This replica took the engine's writer lease over: follow the engine's events from
        a fresh subscription, whose snapshot clears and rebuilds its worker (what another
        replica wrote, or nobody while the lease was free, is replaced), counted as one
        resync of the engine's entries when the lease says it is one (`WriterLease`'s
        `on_taken`: it replaces this replica's own subscription)."""
        async with engine.events_lock:
            if engine.events_task is not None:
                task = engine.events_task
                engine.stop_events()
                await asyncio.wait([task])
            if engine.followed is not None:
                await self._start_events(engine, engine.followed)
                if resync and engine.source_counters is not None:
                    engine.source_counters.num_resyncs += 1

    async def _start_events(self, engine: _Engine, identity: EngineIdentity) -> None:
        """Start the task following the engine process's KV events (a fresh source: its first
        batch clears the worker)."""
        record = self.registry.get(engine.address)
        translator = WorkerTranslator(
            TranslateOptions(
                worker_id=engine.address,
                worker_address=engine.address,
                hash_mode=HashMode.CANONICAL,
                default_block_size=identity.block_size or self.config.default_block_size,
            )
        )
        on_batch_time = functools.partial(self._event_applied, engine.address)
        # Whichever source follows the engine (SubscribeKvEvents, its ZMQ fallback, or
        # `kv_events: zmq`), a break in its stream wakes the poll to read the identity again.
        on_sequence_break = engine.events_out_of_sequence.set
        array_tail = record.array_tail or engine_array_tail(identity.engine_name)
        source: OpenEngineSource | ZmqSource | None
        if record.kv_events == KvEventsMode.zmq.value:
            source = await self._zmq_source(
                engine, translator, on_batch_time, on_sequence_break, array_tail
            )
        else:
            health = self.config.health
            source = OpenEngineSource(
                # The engine's retries back off as its polls do (one warning per attempt).
                OpenEngineSourceSettings(
                    target=engine.address,
                    array_tail=array_tail,
                    backoff_initial_s=health.backoff_initial_s,
                    backoff_max_s=health.backoff_max_s,
                ),
                translator,
                self._sink(engine),
                channels=self._engine_channels,
                on_batch_time=on_batch_time,
                on_sequence_break=on_sequence_break,
            )
        if source is None:
            return
        if engine.source_counters is None:
            engine.source_counters = source.counters
        else:
            source.counters = engine.source_counters
        engine.no_source_reason = None
        engine.source = source
        engine.implausible_stamp_warned = False
        engine.events_task = asyncio.create_task(source.run(), name=f"kv events {engine.address}")
        engine.events_task.add_done_callback(functools.partial(_events_ended, engine.address))

    def _sink(self, engine: _Engine) -> IndexBackend | LeasedSink:
        """Where the engine's KV events are applied: the index, under the engine's writer
        lease on a shared one."""
        assert self.index is not None
        if self._leasing is not None and engine.lease is not None:
            return LeasedSink(self._leasing, engine.lease)
        return self.index

    def _event_applied(self, address: str, stamped_unix_s: float) -> None:
        """A KV-event batch the engine stamped at `stamped_unix_s` is in the index."""
        engine = self._engines.get(address)
        now_unix_s = time.time()
        if engine is not None:
            engine.last_event_unix_s = now_unix_s
        lag_s = event_lag_s(stamped_unix_s, now_unix_s)
        # A stamp that cannot be the batch's (`controller.event_lag`) clears the engine's
        # last lag rather than leave it frozen, and is counted, not observed.
        self.registry.on_event_lag(address, lag_s)
        if lag_s is None:
            if engine is not None and not engine.implausible_stamp_warned:
                engine.implausible_stamp_warned = True
                log.warning(
                    "engine %s: a KV-event batch stamped at unix %.3f reached the index at "
                    "%.3f by the controller's clock: not taken as event lag (more than %.0f s "
                    "old, or more than %.0f s ahead: the engine's clock or its stamps are "
                    "wrong); such batches are counted in "
                    "kvplane_controller_event_timestamps_implausible_total (warned once per "
                    "source)",
                    address,
                    stamped_unix_s,
                    now_unix_s,
                    MAX_PLAUSIBLE_LAG_S,
                    MAX_CLOCK_LEAD_S,
                )
            if self._on_implausible_event_stamp is not None:
                self._on_implausible_event_stamp(address)
        elif self._on_event_lag is not None:
            self._on_event_lag(address, lag_s)

    async def _zmq_source(
        self,
        engine: _Engine,
        translator: WorkerTranslator,
        on_batch_time: Callable[[float], None],
        on_sequence_break: Callable[[], None],
        array_tail: ArrayTail,
    ) -> ZmqSource | None:
        try:
            reply = await engine.stub.GetKvEventSources(
                pb.GetKvEventSourcesRequest(), timeout=self.config.health.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise  # the engine may be gone: the next poll tries again
            reply = pb.GetKvEventSourcesResponse()  # advertises none, for good
        # One worker per engine address: the first advertised ZMQ source (data-parallel
        # ranks beyond it are not followed; `kvplane indexer` follows every rank).
        for advert in reply.sources:
            if advert.transport != "zmq":
                continue
            problem = advert_endpoint_problem(advert)
            if problem is not None:  # e.g. 0.0.0.0: dialled, it reaches this machine
                log.warning("engine %s: not following its ZMQ source: %s", engine.address, problem)
                engine.no_source_reason = f"its ZMQ source is not followed: {problem}"
                continue
            settings = zmq_source_settings(advert, array_tail=array_tail)
            return ZmqSource(
                settings,
                translator,
                self._sink(engine),
                on_batch_time=on_batch_time,
                on_sequence_break=on_sequence_break,
            )
        log.warning("engine %s advertises no ZMQ KV-event source", engine.address)
        engine.no_source_reason = engine.no_source_reason or "it advertises no ZMQ KV-event source"
        return None
