"""The fleet registry: every engine the controller knows, what it is and whether it may get
traffic. Pure (no I/O): the fleet service feeds it what GetEngineInfo, GetModelInfo, Health
and GetLoad answered, with the time, and asks it which engines are routable and which are due
for a poll.

Compatibility (seed 000, "Core identity and roles"): an engine is accepted only when its
`schema_revision` is one this client was tested with, its `minimum_client_revision` does not
exceed ours, and its `schema_release` names an immutable release (not a moving branch); and
only when its `instance_id` is at most `MAX_INSTANCE_ID_BYTES` long. It fails closed: an
engine that does not pass is INCOMPATIBLE and never routed to.

Routable = health READY or DEGRADED, compatible, not cordoned, not ejected. DRAINING and
NOT_READY leave routing the moment a health answer says so. A poll that fails leaves the engine
UNREACHABLE when it did not reach the engine (refused, no answer in time) and FAILING when the
engine answered it with an error (its process is up, and broken); either is retried with
exponential backoff and reports no load until it answers again.

Outlier ejection (`EjectionPolicy`): an engine whose health answers fine but whose requests
fail (INTERNAL, UNKNOWN, DATA_LOSS: a broken device, a wedged worker) looks
idle to a load-balancing router, which would send it ever more traffic. After
`after_failures` such failures in a row it is EJECTED: out of routing for `initial_s`,
doubling with each ejection in a row up to `max_s`. Its health polls bring it back when the
time is up; it then has one request to prove itself (one more failure ejects it again, for
twice as long), and a request it serves clears the count. Failures count only while its
health says ready (an outage or a drain ends streams too). Never more than half of the
engines taking traffic (routable, or ejected; not cordoned) are ejected at once: a fault of
every engine is not an outlier, and those left routable are never all ejected. This is
decided again at every change of the fleet (`_decide_cap`), not only when an engine is
ejected: when the rest of the fleet leaves traffic (down, drained, cordoned), the ejected
engines whose ejection ends soonest are routed all the same (each time counted,
`routed_by_cap`), their ejection running on, and held out again while it runs (as of the
latest time recorded) if enough of the fleet takes traffic again. A new process starts with
a clean record.

Hold-down (`HoldDownPolicy`): an engine whose health flaps (READY, NOT_READY, READY, ... at
every poll: a sick engine that passes every other probe) leaves routing at each NOT_READY, as
it must, but with nothing more would be put back at each READY, and keep taking (and failing or
slowing) traffic half the time. So each time an engine that says it is ready (READY or
DEGRADED, ejected or held down included) stops saying so (NOT_READY, STARTING, a poll that
fails, or a new process at its address: a restart faster than a health poll, which another
instance id shows) is a flap; an identity changed under the same instance id is none (a
controller fronted as an engine whose own fleet changed: taken as a new process, it did not
leave ready). From its `after_flaps`-th flap within `window_s` it is HELD_DOWN: out of routing
while its health says READY, until it has said so for `initial_s` (doubling with each hold-down
in a row, up to `max_s`), and then for `ready_polls` polls more, without a break: any spell not
ready (one that is no flap included: while draining or cordoned, found incompatible, a new
process under its instance id) starts its ready time and polls again. A flap while held
restarts the hold-down, twice as long; one within `window_s` of being put back holds it again
at once, twice as long (its probation, as an ejection's); a window without a flap after it is
put back clears the record. An engine that leaves ready once (a restart) or now and then comes
back at its first READY, as before. Kubernetes' readiness `successThreshold`, Envoy's
`healthy_threshold` and its ejection time growing with each ejection, kept to what a fleet
needs. Hold-down shares ejection's cap: the engines held out (ejected, or held down while they
say READY) are never more than half of those taking traffic (routable, ejected or held down;
cordoned engines are neither). Beyond it, held-down engines that say ready are routed anyway,
their hold-down running on (`_decide_cap`): a blip of the controller's own (its polls time out,
a partition heals three times a minute) flaps every engine at once, and holding them all down
would refuse every request while every engine says READY. Ejections count first (an engine
failing its requests now outranks one that flapped), then the held-down engines whose hold-down
ends soonest (then with fewest flaps, then by address) are the ones routed, each time counted
(`routed_by_cap`, as are the ejected engines it routes and the ejections it refuses). The
record outlives a new process (a crash loop is flapping too), and the engine's removal for
`window_s`: registered again at its address, the engine takes it back (a deregister/register
loop does not wipe it). It follows the address, not the process: another engine registered
there within `window_s` (a new pod on a recycled address) takes it too, as nothing tells it
from the same engine restarted, which comes with a new instance id as well (dropping the record
for a new id would let every crash-looping engine out). Drains and cordons are no flaps: an
engine that drains, or one an operator cordoned (and restarts, say, while working on it), is
not flapping, and its leaves do not count (nor the leave of a process drained through another
controller replica, `drained_elsewhere`).

What an engine the cap decides on is shown with (admin `workers`, the gateway's Health
checks) is made when it is read, by one method, `Registry.error_of`, from its record and the
time asked at: ejected, why and for how long; held down, its flaps and when it is routable
("routable in N s", counting down as the time passes, whether or not anything was recorded
since); routed by the cap all the same, why, and when its ejection or hold-down ends. Its
`last_error` (its own: what a failed poll, a health answer or a rejection said) is empty
while its health says ready. So a health answer writes none of those words, and the cap's
decision (who is held out, who routed) stands, not made again at each answer of each engine,
until the fleet changes (`version`), an answer changes what it is made of (an ejection found
over, a hold-down's ready time begun or its hold-down over: that engine's), or the time
reaches the end of an ejection the cap routes past. An engine that leaves the cap's decision
by a drain, a cordon or a new process keeps the words it was shown with then (a new process:
as of when it was found) as its error, until a health answer or a poll says otherwise (a
cordoned one, until it is uncordoned too: back in the cap's decision, it keeps none).

LoRA: each record keeps the adapters its engine holds, as the controller last learnt them
(ListLoras whenever the fleet service fetches the engine's identity, then the outcomes of the
gateway's own LoadLora/UnloadLora/ListLoras, and the fleet service's restores of the fleet's
adapters, controller.lora_intent); a new engine process starts with none. A request
naming an adapter is routable only to the engines holding it (`routable(lora_name=...)`), and
`check_lora` says why none can take it.

Each model an engine serves has its own GetModelInfo facts (`EngineIdentity.facts_of`): the
pooling tasks it supports, and whether it generates. A model served for pooling only (tasks
advertised, no `generation`) takes Embed/Classify/Score only: `routable(model,
generating=True)`, what every Generate path asks for, leaves out the engines where the model
is pooling-only, while another model of the same engine may generate.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from controller.router import LoadSnapshot
from kvplane.errors import KvplaneError

if TYPE_CHECKING:
    from indexer.zmq_decode import ArrayTail

log = logging.getLogger(__name__)

CLIENT_REVISION = 1
# What a kvplane controller's gateway calls itself in GetEngineInfo.
CONTROLLER_ENGINE_NAME = "kvplane-controller"
SUPPORTED_SERVER_REVISIONS = frozenset({1})
# The longest instance id an engine may have, in UTF-8 bytes: the gateway names the engine
# that served a request in the call's trailing metadata (`controller.route_report`), which
# gRPC clients refuse past 8-16 KiB, failing a request the engine served. Kubernetes pod
# names and UUIDs are far below it.
MAX_INSTANCE_ID_BYTES = 1024
_MOVING_RELEASES = frozenset({"", "main", "master", "head", "latest", "trunk", "develop"})


class EngineState(enum.StrEnum):
    UNKNOWN = "unknown"  # never reached yet, or a new process whose identity is being read
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    DRAINING = "draining"
    NOT_READY = "not_ready"
    UNREACHABLE = "unreachable"  # its polls do not reach it: a dead, stopped or wedged process
    FAILING = "failing"  # it answers its polls with errors (INTERNAL, ...): up, but broken
    INCOMPATIBLE = "incompatible"
    EJECTED = "ejected"  # healthy to its polls, but failing requests (outlier ejection)
    HELD_DOWN = "held_down"  # ready to its polls, held out after flapping (hold-down)


ROUTABLE_STATES = frozenset({EngineState.READY, EngineState.DEGRADED})
# How many `Registry.routable` lists (one per model, role and whether generating) are kept
# between two changes of the fleet: a request may name any model that an engine listing none
# serves, so the memo must not grow with what clients send.
ROUTABLE_MEMO_SIZE = 64
# What a failed poll leaves an engine in, until a poll succeeds.
POLL_FAILED_STATES = frozenset({EngineState.UNREACHABLE, EngineState.FAILING})
# An engine whose health says it is ready, whether or not it is routed (hold-down: leaving
# one of these for one of `_NOT_READY_STATES` is a flap; UNKNOWN there is a new process at
# its address, `Registry.on_new_instance`, a restart faster than a health poll, unless the
# instance id is the same).
_READY_TO_ITS_POLLS = ROUTABLE_STATES | {EngineState.EJECTED, EngineState.HELD_DOWN}
_NOT_READY_STATES = POLL_FAILED_STATES | {
    EngineState.NOT_READY,
    EngineState.STARTING,
    EngineState.UNKNOWN,
}
# Out of routing by the cap's leave (`Registry._decide_cap`).
_HELD_OUT_STATES = frozenset({EngineState.EJECTED, EngineState.HELD_DOWN})
# The states of the engines the cap decides on (`_decide_cap`): taking traffic, or held out.
_CAPPED_STATES = ROUTABLE_STATES | _HELD_OUT_STATES
# How the error of an engine routed by the cap (`Registry._decide_cap`) begins; the rest
# says why it is held down or ejected, and until when (`Registry._held_for`,
# `Registry._ejected_error`).
_OVER_HALF = "more than half of the engines taking traffic would be out of routing otherwise; "
_ROUTED_ANYWAY = "held down but routed: " + _OVER_HALF
_EJECTED_ROUTED = "ejected but routed: " + _OVER_HALF


# Why the cap on engines held out (`Registry.routed_by_cap`) routed an engine all the same.
CAPPED_HOLD_DOWN = "hold_down"
CAPPED_EJECTION = "ejection"
CAPPED_REASONS = (CAPPED_HOLD_DOWN, CAPPED_EJECTION)


class PollFailure(enum.Enum):
    """How a poll of an engine failed; only the first two are an outage (the engine could not
    be reached: UNREACHABLE), which `health.abandon_streams_after_s` is measured against."""

    CONNECTION_LOST = "connection_lost"  # not reached at all: its process may be replaced
    TIMED_OUT = "timed_out"  # no answer in time: the same process, too slow or wedged
    ERROR_ANSWER = "error_answer"  # it answered, with an error: reachable, its calls too

    @property
    def state(self) -> EngineState:
        """What the failure leaves the engine in."""
        return EngineState.FAILING if self is PollFailure.ERROR_ANSWER else EngineState.UNREACHABLE


# The gRPC statuses (by name: the core speaks no grpc) of a poll that did not reach the
# engine; any other is the engine's answer.
_NOT_REACHED = {
    "UNAVAILABLE": PollFailure.CONNECTION_LOST,
    "DEADLINE_EXCEEDED": PollFailure.TIMED_OUT,  # `health.rpc_timeout_s`
}


def poll_failure(status_name: str) -> PollFailure:
    """How a call to an engine that ended with the gRPC status `status_name` failed."""
    return _NOT_REACHED.get(status_name, PollFailure.ERROR_ANSWER)


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """When an engine failing requests leaves routing (the module's "Outlier ejection")."""

    after_failures: int = 5  # failed requests in a row; 0: never eject
    initial_s: float = 10.0
    max_s: float = 120.0


@dataclass(frozen=True, slots=True)
class HoldDownPolicy:
    """When an engine whose health flaps is held out of routing (the module's "Hold-down")."""

    after_flaps: int = 3  # flaps within window_s that hold it down; 0: never
    window_s: float = 60.0
    initial_s: float = 10.0  # ready this long first, doubling with each hold-down in a row
    max_s: float = 300.0
    ready_polls: int = 3  # then this many ready health answers more


class Role(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    UNKNOWN = "unknown"


class IncompatibleEngineError(KvplaneError):
    """The engine speaks a contract revision this controller does not support, or serves
    models whose cache it cannot index together."""


class UnknownEngineError(KvplaneError):
    """No engine with that instance id or address."""


class EmptyEngineRefError(KvplaneError):
    """An engine reference that names nothing (an engine may leave its instance id empty)."""


class DuplicateEngineError(KvplaneError):
    """The engine is already registered."""


class UnknownModelError(KvplaneError):
    """No engine of the fleet serves the model, whatever its health (an engine answers
    NOT_FOUND for a model it does not serve)."""


class NoEngineRegisteredError(KvplaneError):
    """The fleet has no engine at all, so whether it serves a model is not known yet: a
    controller just started (or restarted) before its planner registers its engines again, or
    every engine was removed. UNAVAILABLE, worth retrying, not the NOT_FOUND of a model the
    registered engines do not serve, which clients take as final."""


class ModelRequiredError(KvplaneError):
    """A request names no model while the fleet's engines serve different models by default
    (the first each lists): which one would answer it would be the router's pick, a model
    switching from one request to the next. INVALID_ARGUMENT: the client names the model."""


class GenerationUnsupportedError(KvplaneError):
    """Every engine serving the model is pooling-only: a Generate can never be served there
    (the seed's unsupported task, FAILED_PRECONDITION), not merely not now."""


class LoraRoutingError(KvplaneError):
    """A request names a LoRA adapter that no routable engine holds."""


class LoraUnsupportedError(LoraRoutingError):
    """No engine serving the model supports LoRA at all (seed: FAILED_PRECONDITION)."""


class LoraNotLoadedError(LoraRoutingError):
    """No engine has the adapter loaded (seed: unknown adapter, NOT_FOUND)."""


class LoraUnavailableError(LoraRoutingError):
    """Engines hold the adapter but none takes traffic now (UNAVAILABLE)."""


def check_revision(schema_revision: int, minimum_client_revision: int, schema_release: str) -> None:
    """Raise IncompatibleEngineError unless the engine's advertised contract is one we support."""
    if schema_revision == 0:
        raise IncompatibleEngineError("engine advertises schema_revision 0 (invalid)")
    if schema_revision not in SUPPORTED_SERVER_REVISIONS:
        supported = ", ".join(str(r) for r in sorted(SUPPORTED_SERVER_REVISIONS))
        raise IncompatibleEngineError(
            f"engine schema_revision {schema_revision} is outside the tested range ({supported})"
        )
    if minimum_client_revision > CLIENT_REVISION:
        raise IncompatibleEngineError(
            f"engine requires client revision >= {minimum_client_revision}; "
            f"this controller is revision {CLIENT_REVISION}"
        )
    if schema_release.strip().lower() in _MOVING_RELEASES:
        raise IncompatibleEngineError(
            f"engine schema_release {schema_release!r} is not an immutable release"
        )


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What GetModelInfo told of one model an engine serves. The defaults are what a model
    nobody asked about (GetModelInfo unimplemented) is taken for: one that generates, with no
    pooling task and nothing else known."""

    block_size: int | None = None
    total_kv_blocks: int | None = None
    supports_lora: bool | None = None
    # Tasks besides Generate it supports ("embed", "classify", "score").
    tasks: frozenset[str] = frozenset()
    # False: served for pooling only (tasks advertised, no `generation`): no Generate.
    generates: bool = True
    # The limits past which it refuses a request: (REQUEST_LIMITS path, value) for each it
    # reports.
    limits: tuple[tuple[str, int], ...] = ()
    # Requests it runs at once (the KV capacity is `total_kv_blocks`).
    max_running_requests: int | None = None
    # The request options it says it does not support (CAPABILITY_FLAGS reported false, and
    # the SELECTION_OPTIONS of candidate selection modes a list of them leaves out).
    unsupported: frozenset[str] = frozenset()
    # The model's own name (served_model_name): the name asked for, or the model an alias
    # stands for; "" when not said.
    served_name: str = ""

    def constrains(self, path: str) -> bool:
        """Whether its value at `path` (of REQUEST_LIMITS or CAPABILITY_FLAGS) bounds the
        fleet's: a pooling task's only if it has the task (no other engine is sent it)."""
        parts = path.split(".")
        return parts[0] != "tasks" or parts[1] in self.tasks


_UNKNOWN_MODEL = ModelFacts()


def agreed_block_size(models: tuple[str, ...], facts: tuple[ModelFacts, ...]) -> int | None:
    """The KV block size every model of one engine reports (None: none reports one). Raise
    IncompatibleEngineError when they differ: an engine's KV events name no model, so its
    blocks could not be told apart, and each model's prompts would be matched in a size
    that may not be theirs. `facts` is empty when GetModelInfo was not asked."""
    if not facts:
        return None
    sizes = {m: f.block_size for m, f in zip(models, facts, strict=True) if f.block_size}
    if len(set(sizes.values())) > 1:
        said = ", ".join(f"{m} {size}" for m, size in sizes.items())
        raise IncompatibleEngineError(
            f"its models' KV block sizes differ ({said}): its KV events name no model, so "
            "its cache cannot be indexed; serve models of one block size per engine"
        )
    return next(iter(sizes.values()), None)


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What GetEngineInfo and GetModelInfo told us."""

    instance_id: str
    engine_name: str
    engine_version: str
    role: Role
    models: tuple[str, ...]
    # The one block size its models share (`agreed_block_size`).
    block_size: int | None
    schema_revision: int
    minimum_client_revision: int
    schema_release: str
    # Each model's GetModelInfo, in the order of `models`; empty when it was not asked.
    model_facts: tuple[ModelFacts, ...] = ()
    # A controller's: the controllers it fronts, its engines' and theirs in turn (from its
    # GetEngineInfo, `controller.hops`); empty for an engine.
    fronted_controller_ids: frozenset[str] = frozenset()

    @property
    def is_controller(self) -> bool:
        return self.engine_name == CONTROLLER_ENGINE_NAME

    @property
    def base_model(self) -> str | None:
        """The base model a LoRA adapter on it is attached to: its first listed (what it
        serves a request naming none); None for a controller fronted as an engine, which
        serves several, or one naming none."""
        if self.is_controller or not self.models:
            return None
        return self.models[0]

    def serves(self, model: str | None) -> bool:
        """No model named, or an engine that names none, match."""
        return not model or not self.models or model in self.models

    def plays(self, role: Role | None) -> bool:
        """Whether routing takes the engine for one of `role` (None: any): an engine that
        tells no role (UNKNOWN) is taken for any."""
        return role is None or self.role in (role, Role.UNKNOWN)

    def facts_of(self, model: str | None) -> ModelFacts:
        """What GetModelInfo said of `model`; with none named, of the engine's default model,
        the first it lists (what it serves a request naming none). A model not asked about
        is unknown (`ModelFacts()`)."""
        if not self.model_facts:
            return _UNKNOWN_MODEL
        if not model:
            return self.model_facts[0]
        for name, facts in zip(self.models, self.model_facts, strict=True):
            if name == model:
                return facts
        return _UNKNOWN_MODEL

    @property
    def tasks(self) -> frozenset[str]:
        """The pooling tasks any of its models supports."""
        return frozenset().union(*(f.tasks for f in self.model_facts))

    @property
    def generates(self) -> bool:
        """Whether any of its models generates (False: a pooling-only engine)."""
        return any(f.generates for f in self.model_facts) or not self.model_facts

    @property
    def total_kv_blocks(self) -> int | None:
        """The capacity of its default model's KV cache (None: not known)."""
        return self.facts_of(None).total_kv_blocks

    @property
    def supports_lora(self) -> bool | None:
        """Whether it takes LoRA adapters (and answers ListLoras): True when a model says so,
        False when every model says not, else unknown."""
        said = [f.supports_lora for f in self.model_facts]
        if True in said:
            return True
        if said and all(s is False for s in said):
            return False
        return None


@dataclass(slots=True)
class EngineRecord:
    address: str
    kv_events: str = "grpc"
    source: str = "config"  # config | admin
    # Who registered it through the admin API, as its RegisterEngine said ("": nobody said).
    owner: str = ""
    # The engine entry's `array_tail` (None: chosen from the engine's name).
    array_tail: ArrayTail | None = None
    identity: EngineIdentity | None = None
    state: EngineState = EngineState.UNKNOWN
    cordoned: bool = False
    # Its own error (a failed poll's, a health answer's, a rejection's); empty while its
    # health says ready: what it is shown with then is `Registry.error_of`'s.
    last_error: str = ""
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    num_failures: int = 0
    # A poll could not connect (not one that only timed out) since its polls began to fail
    # (UNREACHABLE or FAILING since): the process that answers next may be a new one.
    connection_lost: bool = False
    # When the polls that could not reach it began (meaningful while UNREACHABLE; None
    # after a poll it answered, even with an error: no outage is running).
    unreachable_since_s: float | None = None
    # Bumped whenever the engine turns out to be a new process (new instance id).
    epoch: int = 0
    # The controller told this engine process to drain: it stays out of routing even if a
    # health answer sent before the drain still says READY. Cleared once the engine itself
    # says DRAINING (from then on its health decides: a process restarted under the same
    # instance id faster than a poll answers READY), by a new process, and by a drain the
    # engine refused (`withdraw_drain`).
    drain_requested: bool = False
    # Seconds from the engine stamping its last KV-event batch to the batch being in the
    # index (None until one arrives from this process).
    event_lag_s: float | None = None
    # The LoRA adapters (names) the engine holds; None: it serves no LoRA (says
    # `supports_lora: false` or refuses ListLoras), or is not known yet.
    lora_adapters: frozenset[str] | None = None
    # Of those, the names it holds with another id or path than the adapter the fleet knows
    # under that name (`LoraIntent.conflict`): a request naming one is never sent there, it
    # would run other weights, until it is unloaded there.
    lora_conflicts: frozenset[str] = frozenset()
    # The adapters (names) the fleet's LoRA intent wants there that this process refused
    # when the fleet restored them (out of LoRA slots, say): not tried again until the
    # fleet restores its adapters again (`on_lora_restore`; a new process), so a request
    # naming one does not wait for it (`Controller.prefill_awaited`).
    lora_refused: frozenset[str] = frozenset()
    # Outlier ejection: requests failed in a row, ejections in a row (each doubles the next),
    # until when the current one keeps it out of routing (routed by the cap or not; None once
    # a health answer finds it over), why (the failures) and for how long
    # (`Registry._ejected_error`).
    request_failures: int = 0
    ejections: int = 0
    ejected_until_s: float | None = None
    ejected_for: str = ""
    ejection_s: float = 0.0
    # Hold-down: its flaps since it was added (the metric), when those within the window
    # were, hold-downs in a row (each doubles the next), how long it must be ready now (0:
    # not held down), since when it has been (None: not yet since its last flap), the ready
    # polls it owes after that, and when it was last put back (its probation's start).
    num_flaps: int = 0
    flap_times: list[float] = field(default_factory=list)
    hold_downs: int = 0
    hold_s: float = 0.0
    held_ready_since_s: float | None = None
    hold_polls_left: int = 0
    released_s: float | None = None
    # While held down (`hold_s`) or ejected: what its health says, READY or DEGRADED, the
    # state it takes when routed all the same (the cap, `Registry._decide_cap`).
    ready_as: EngineState = EngineState.READY

    @property
    def engine_id(self) -> str:
        """The engine's instance id once known, else its address."""
        return self.identity.instance_id if self.identity is not None else self.address

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE_STATES and not self.cordoned and self.identity is not None

    @property
    def role(self) -> Role:
        """Its role as its GetEngineInfo told it; UNKNOWN before it was read."""
        return self.identity.role if self.identity is not None else Role.UNKNOWN

    @property
    def availability(self) -> str:
        """Its state as a refusal for want of an engine names it ("cordoned" for an engine
        that is routable but for its cordon)."""
        if self.cordoned and self.state in ROUTABLE_STATES:
            return "cordoned"
        return self.state.value

    def holds_lora(self, lora_name: str) -> bool:
        """Whether the engine holds the fleet's adapter `lora_name` (not a conflicting one)."""
        return (
            self.lora_adapters is not None
            and lora_name in self.lora_adapters
            and lora_name not in self.lora_conflicts
        )


def _takes(
    identity: EngineIdentity, model: str | None, role: Role | None, generating: bool
) -> bool:
    """Whether an engine of `identity` plays `role` (any: None) and serves `model`, generating
    it when asked to (`generating`: not a pooling-only engine's)."""
    return (
        identity.plays(role)
        and identity.serves(model)
        and (not generating or identity.facts_of(model).generates)
    )


def _holds(record: EngineRecord, lora_name: str) -> bool:
    """Whether the engine holds the LoRA adapter `lora_name` ("" names none: any engine)."""
    return not lora_name or record.holds_lora(lora_name)


def _reject(record: EngineRecord, error: str) -> None:
    """The engine answering at the record's address is one the controller will not use
    (incompatible, or another address's engine): out of routing, and its last load, which may
    be an earlier process's, leaves the fleet's totals."""
    record.state = EngineState.INCOMPATIBLE
    record.last_error = error
    record.load = LoadSnapshot()


def _take_hold_down_record(record: EngineRecord, removed: EngineRecord) -> None:
    """A new registration at the address of the engine `removed` within a flap window: its
    flaps and hold-down go on (the module's "Hold-down"); its ready time while held counts
    again from its next READY."""
    record.num_flaps = removed.num_flaps
    record.flap_times = list(removed.flap_times)
    record.hold_downs = removed.hold_downs
    record.hold_s = removed.hold_s
    record.hold_polls_left = removed.hold_polls_left
    record.released_s = removed.released_s


def _flaps(record: EngineRecord, state: EngineState) -> bool:
    """Whether `record` taking `state` is a flap: it leaves ready. Not while it drains or is
    cordoned: then the controller or an operator took it out, not its own health."""
    return (
        record.state in _READY_TO_ITS_POLLS
        and state in _NOT_READY_STATES
        and not record.cordoned
        and not record.drain_requested
    )


def _in_rotation(record: EngineRecord) -> bool:
    """Whether the engine takes traffic (routable), ejected and held-down ones included: the
    fleet the cap on ejection and hold-down is half of. Engines down, draining or cordoned are
    not in it, so that those left routable are never all held out (clients get their
    failures, not "no engine")."""
    return record.routable or (record.state in _HELD_OUT_STATES and not record.cordoned)


def _cap_inputs(record: EngineRecord) -> tuple[float | None, float, float | None, int]:
    """What the cap's decision (`Registry._decide_cap`) reads of `record` besides its state
    and cordon (each change of which moves `version`): when its ejection ends, how long its
    hold-down is, since when it has been ready, and its flaps."""
    return (
        record.ejected_until_s,
        record.hold_s,
        record.held_ready_since_s,
        len(record.flap_times),
    )


def _hold_down_ends_s(record: EngineRecord, now_s: float) -> float:
    """When the ready time of `record`'s hold-down ends, if it stays ready from `now_s` on
    (or from when it has been)."""
    since_s = record.held_ready_since_s
    return (since_s if since_s is not None else now_s) + record.hold_s


def _standing(record: EngineRecord) -> tuple[bool, bool, str]:
    """Sorts first the record that answers for its engine: routable, then one whose polls
    succeed (not failing, unreachable or rejected), then by address."""
    rejected = record.state in POLL_FAILED_STATES or record.state is EngineState.INCOMPATIBLE
    return (not record.routable, rejected, record.address)


_K = TypeVar("_K")
_V = TypeVar("_V")


class RegistryMemo(Generic[_K, _V]):
    """Values derived from a registry's engines by `derive` (of their key), kept until its
    next change (`version`), `ROUTABLE_MEMO_SIZE` at most (a request may name any model: the
    memo must not grow with what clients send). Asked per request: `get` builds nothing
    (the derivation is given once, not a closure per call)."""

    def __init__(self, registry: Registry, derive: Callable[[_K], _V]) -> None:
        self._registry = registry
        self._derive = derive
        self._values: dict[_K, _V] = {}
        self._version = registry.version

    def get(self, key: _K) -> _V:
        """The value of `key`: `derive(key)`, unless it was derived since the registry's last
        change (a value may be None: it is kept as any other)."""
        if self._version != self._registry.version:
            self._values.clear()
            self._version = self._registry.version
        try:
            return self._values[key]
        except KeyError:
            pass
        if len(self._values) >= ROUTABLE_MEMO_SIZE:
            self._values.clear()
        value = self._values[key] = self._derive(key)
        return value


class Registry:
    def __init__(
        self,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        ejection: EjectionPolicy = EjectionPolicy(),
        own_instance_id: str | None = None,
        hold_down: HoldDownPolicy = HoldDownPolicy(),
    ) -> None:
        """`own_instance_id`: the controller's own (its gateway answers GetEngineInfo with it),
        refused as an engine."""
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.ejection = ejection
        self.hold_down = hold_down
        self.own_instance_id = own_instance_id
        self._by_address: dict[str, EngineRecord] = {}
        # The records by address, sorted again only when an engine joins or leaves: every
        # routed request reads them in this order (`routable`), and at hundreds of engines
        # sorting them for each request cost more than the rest of the scan.
        self._in_order: list[EngineRecord] | None = None
        # Bumped by every change that can take an engine into or out of `routable` (a join,
        # a leave, a state, a cordon, an identity, LoRA adapters; not a load). What was
        # derived from the engines' identities and states stays true while it stands:
        # `routable`'s memo, `base_models`' (identities, and which engines are rejected),
        # and the candidates of a plan (`Controller.route` re-checks them only after a
        # change). So every such change goes through a method of this class, never a
        # record's field set from outside.
        self.version = 0
        # Told of each such change (`on_change`), within it.
        self._on_change: list[Callable[[], None]] = []
        # `routable` without a LoRA adapter or cordons, by (model, role, generating), kept
        # until the next change: every request asks it, and at hundreds of engines testing
        # each engine again for each request cost as much as routing it.
        self._routable_memo = RegistryMemo(self, self._scan_routable)
        # `base_models` by (generating, lora), kept until the next change too: a request
        # naming no model asks it twice (its model check, its session key), each time a scan
        # of every engine and a sort.
        self._base_models_memo = RegistryMemo(self, self._scan_base_models)
        # `served_name` by model, kept until the next change too: asked by every text prompt
        # of a model the controller has no tokenizer of its own for.
        self._served_name_memo = RegistryMemo(self, self._scan_served_name)
        # The latest time a poll or a request's outcome was recorded at: what the cap decides
        # as of, and `error_of` makes an engine's error as of unless told the time.
        self._now_s = 0.0
        # The records of engines removed while their flaps counted (flaps in the window, or
        # hold-downs in a row), by address, with when they left: an engine registered again
        # within `hold_down.window_s` takes its hold-down record back (`add`), so that a
        # deregister/register loop does not wipe its flaps. Older ones are dropped.
        self._left_flapping: dict[str, tuple[float, EngineRecord]] = {}
        # Times the cap shared by ejection and hold-down kept an engine in routing that would
        # be out otherwise, by reason (`CAPPED_REASONS`): a held-down engine that says ready
        # put in routing, an ejected one put back (`_decide_cap`), a request failure that
        # would eject its engine (`on_request_failed`). The metric
        # `kvplane_controller_routed_by_cap_total`.
        self.routed_by_cap = dict.fromkeys(CAPPED_REASONS, 0)
        # The `version` at which the cap's decision was last made, and the time until which
        # it stands unless the fleet changes (`_decide_cap`); None: to be made again.
        self._cap_settled: int | None = None
        self._cap_settled_until_s = math.inf

    def on_change(self, changed: Callable[[], None]) -> None:
        """Call `changed` at each change that can take an engine into or out of `routable`
        (each `version`). It is called within the change, which may not be complete yet: it
        should schedule what reads the registry, not read it there."""
        self._on_change.append(changed)

    def _changed(self) -> None:
        self.version += 1
        for changed in self._on_change:
            changed()

    def __len__(self) -> int:
        return len(self._by_address)

    def records(self) -> list[EngineRecord]:
        return list(self._ordered())

    def _ordered(self) -> list[EngineRecord]:
        if self._in_order is None:
            self._in_order = sorted(self._by_address.values(), key=lambda r: r.address)
        return self._in_order

    def fronted_controller_ids(self) -> frozenset[str]:
        """The controllers this one fronts: its engines that are controllers and, in turn,
        those they front (an incompatible one is never routed to, so fronts nothing)."""
        fronted: set[str] = set()
        for record in self._by_address.values():
            identity = record.identity
            if identity is None or record.state is EngineState.INCOMPATIBLE:
                continue
            if identity.is_controller:
                fronted.add(identity.instance_id)
            fronted |= identity.fronted_controller_ids
        return frozenset(fronted)

    def add(
        self,
        address: str,
        kv_events: str = "grpc",
        source: str = "config",
        array_tail: ArrayTail | None = None,
        now_s: float | None = None,
        *,
        owner: str = "",
    ) -> EngineRecord:
        """`now_s`: when (None: the latest time the registry recorded), which says whether
        the hold-down record of an engine removed from this address is still its own."""
        if address in self._by_address:
            raise DuplicateEngineError(f"engine {address} is already registered")
        record = EngineRecord(
            address, kv_events=kv_events, source=source, array_tail=array_tail, owner=owner
        )
        self._drop_old_flaps(self._now_s if now_s is None else now_s)
        left = self._left_flapping.pop(address, None)
        if left is not None:
            _take_hold_down_record(record, left[1])
        self._by_address[address] = record
        self._in_order = None
        self._changed()
        return record

    def remove(self, key: str, now_s: float) -> EngineRecord:
        """The engine leaves the fleet; its hold-down record is kept for `hold_down.window_s`
        (`add`)."""
        record = self.get(key)
        del self._by_address[record.address]
        self._in_order = None
        self._changed()
        self._drop_old_flaps(now_s)
        if record.flap_times or record.hold_downs:
            self._left_flapping[record.address] = (now_s, record)
        self._decide_cap()
        return record

    def _drop_old_flaps(self, now_s: float) -> None:
        """Forget the hold-down records of engines removed a whole flap window ago."""
        since_s = now_s - self.hold_down.window_s
        self._left_flapping = {
            address: left for address, left in self._left_flapping.items() if left[0] > since_s
        }

    def get(self, key: str) -> EngineRecord:
        """By address or by instance id. Several records may name one instance id (one
        process under two addresses, or replaced at another address): the one that answers
        for it is meant, routable first, then one whose polls succeed (a cordon or a drain
        of the others would miss the engine)."""
        if not key:
            raise EmptyEngineRefError("name the engine by its address or instance id")
        record = self._by_address.get(key)
        if record is not None:
            return record
        named = [
            r
            for r in self._by_address.values()
            if r.identity is not None and r.identity.instance_id == key
        ]
        if not named:
            raise UnknownEngineError(f"no engine {key!r} in the fleet")
        return min(named, key=_standing)

    def by_engine_id(self, engine_id: str) -> EngineRecord | None:
        try:
            return self.get(engine_id)
        except UnknownEngineError:
            return None

    def routable(
        self,
        model: str | None = None,
        role: Role | None = None,
        lora_name: str = "",
        *,
        cordoned: bool = False,
        generating: bool = False,
    ) -> list[EngineRecord]:
        """Engines that may take a request for `model` now, of `role` (or any), holding the
        LoRA adapter `lora_name` when one is named; with `cordoned`, also those that would
        but for a cordon (admin `match`: what an operator checks before uncordoning); with
        `generating`, only those that generate (a Generate: not pooling-only engines)."""
        if lora_name or cordoned:
            return list(self._routable(model, role, lora_name, cordoned, generating))
        return list(self._routable_memo.get((model, role, generating)))

    def _scan_routable(self, key: tuple[str | None, Role | None, bool]) -> tuple[EngineRecord, ...]:
        """`routable` of (model, role, generating), with no LoRA adapter nor cordons."""
        model, role, generating = key
        return tuple(self._routable(model, role, "", False, generating))

    def any_routable(
        self, model: str | None = None, role: Role | None = None, *, generating: bool = False
    ) -> bool:
        """Whether `routable` would name any engine: it stops at the first, where a fleet of
        hundreds would otherwise be scanned whole at every request just to learn that."""
        return next(self._routable(model, role, "", False, generating), None) is not None

    def _routable(
        self,
        model: str | None,
        role: Role | None,
        lora_name: str,
        cordoned: bool,
        generating: bool,
    ) -> Iterator[EngineRecord]:
        """The engines `routable` lists, by address."""
        for record in self._ordered():
            # `record.routable`, with a cordon allowed when asked
            if record.state not in ROUTABLE_STATES or record.identity is None:
                continue
            if record.cordoned and not cordoned:
                continue
            if _takes(record.identity, model, role, generating) and _holds(record, lora_name):
                yield record

    def out_of_routing(
        self, model: str | None, role: Role | None, lora_name: str, *, generating: bool
    ) -> list[EngineRecord]:
        """The engines that `routable` with `cordoned` would list but for their state
        (draining, unreachable, failing, held down, ejected, ...), by address: admin `match`
        shows what the index holds of them. Incompatible engines and those whose identity
        was never read (their models unknown) are not among them."""
        return [
            record
            for record in self._ordered()
            if record.state not in ROUTABLE_STATES
            and record.state is not EngineState.INCOMPATIBLE
            and record.identity is not None
            and _takes(record.identity, model, role, generating)
            and _holds(record, lora_name)
        ]

    def may_serve(self, model: str) -> bool:
        """Whether an engine serves `model` whatever its health, or may: one not reached yet,
        whose models are unknown (a request before the first poll is not for an unknown
        model). An incompatible engine never serves."""
        return any(True for _ in self._may_serve(model))

    def may_serve_records(self, model: str | None) -> list[EngineRecord]:
        """The engines `may_serve` counts, whatever their health, by address."""
        return sorted(self._may_serve(model), key=lambda r: r.address)

    def _may_serve(self, model: str | None) -> Iterator[EngineRecord]:
        """The engines `may_serve` counts, in no particular order."""
        for r in self._by_address.values():
            if r.state is not EngineState.INCOMPATIBLE and (
                r.identity is None or r.identity.serves(model)
            ):
                yield r

    def served_name(self, model: str) -> str | None:
        """The name of the model that `model` names on the engines serving it: itself, or
        for one of its aliases (`served_model_aliases`) the model it stands for, as the first
        engine whose GetModelInfo said so tells; None when none did."""
        return self._served_name_memo.get(model)

    def _scan_served_name(self, model: str) -> str | None:
        """`served_name`, from every engine."""
        for r in self._may_serve(model):
            if r.identity is not None and (served := r.identity.facts_of(model).served_name):
                return served
        return None

    def default_model(self, *, generating: bool = False) -> str | None:
        """The model the compatible engines serve a request naming none: each its first
        listed (with `generating`, only engines whose first model generates: a Generate never
        goes to the others); None while no engine's models are known. Raise
        ModelRequiredError when they differ. A controller fronted as an engine counts every
        model it serves: it answers a request naming none only when its own engines agree,
        which its GetEngineInfo does not say, and a fleet that sent it there would have it
        refused by the controller below one time and served by an engine here the next.
        Engines whose models are not known yet are left out: they may serve any."""
        defaults = self.base_models(generating=generating)
        if len(defaults) > 1:
            raise ModelRequiredError(
                "name a model: the engines of this fleet serve different models to a request "
                f"naming none ({', '.join(defaults)}), which one would answer is not decided"
            )
        return next(iter(defaults), None)

    def base_models(self, *, generating: bool = False, lora: bool = False) -> list[str]:
        """The models the compatible engines serve a request naming none, sorted: each
        engine's first listed, every model of a controller fronted as an engine
        (`default_model`). With `generating`, only engines whose first model generates; with
        `lora`, only engines that may take LoRA adapters (not `supports_lora: false`): the
        base models an adapter loaded on the whole fleet would be attached to. Engines whose
        models are not known yet are left out. Kept until the registry changes."""
        return list(self._base_models_memo.get((generating, lora)))

    def _scan_base_models(self, key: tuple[bool, bool]) -> tuple[str, ...]:
        """`base_models` of (generating, lora), from every engine."""
        generating, lora = key
        defaults: set[str] = set()
        for r in self._may_serve(None):
            identity = r.identity
            if identity is None or not identity.models:
                continue
            if generating and not identity.facts_of(None).generates:
                continue
            if lora and identity.supports_lora is False:
                continue
            defaults.update(identity.models if identity.is_controller else identity.models[:1])
        return tuple(sorted(defaults))

    def check_generates(self, model: str) -> None:
        """Raise GenerationUnsupportedError when every engine that serves `model` ("": the
        default model) is known to be pooling-only; an engine not reached yet may generate.
        Every Generate asks: it stops at the first engine that may generate, where a fleet
        of hundreds would otherwise be scanned whole at every request."""
        served = False
        for r in self._may_serve(model):
            if r.identity is None or r.identity.facts_of(model).generates:
                return
            served = True
        if served:
            what = f"model {model!r}" if model else "the default model"
            raise GenerationUnsupportedError(
                f"{what} is served for Embed, Classify and Score only: every engine serving "
                "it is pooling-only (runner: pooling)"
            )

    def why_unavailable(self, model: str) -> str:
        """Why no engine takes a Generate for `model` ("": the default model) now."""
        what = f"model {model!r}" if model else "the default model"
        return f"no engine available for {what}: " + self.generating_states(model)

    def generating_states(self, model: str) -> str:
        """Each engine that serves `model`, or may (not reached yet), with its state, or
        "pooling only" for one that does not generate it."""

        def state_of(r: EngineRecord) -> str:
            if r.identity is None or r.identity.facts_of(model).generates:
                return r.availability
            return "pooling only"

        return self.engine_states(model, state_of)

    def engine_states(
        self, model: str, state_of: Callable[[EngineRecord], str] = lambda r: r.availability
    ) -> str:
        """Each engine that serves `model`, or may (not reached yet), by address, with
        `state_of` it (by default `EngineRecord.availability`): what a refusal for want of an
        engine says, so that the client sees why (a cordon, a drain, an outage)."""
        serving = self.may_serve_records(model)
        return ", ".join(f"{r.engine_id} {state_of(r)}" for r in serving) or "none serves it"

    def check_lora(
        self,
        lora_name: str,
        model: str | None = None,
        role: Role | None = None,
        *,
        task: str | None = None,
    ) -> None:
        """Raise why no routable engine (of `role`, or any; with the pooling `task`, when
        one is named) holds `lora_name` for `model` (call it when `routable(...,
        lora_name=lora_name)` is empty): LoraUnavailableError when some engine holds it,
        LoraUnsupportedError when no engine serving the model supports LoRA, else
        LoraNotLoadedError, naming the engines of other models that hold it, if any (an
        adapter is trained for one base model: loaded on another model's engine it is no
        help, and "no engine has it" would send the operator looking in vain). Returns when
        no such engine serves the model at all (the request fails as any request for it
        does)."""
        serving = [
            r
            for r in sorted(self._may_serve(model), key=lambda r: r.address)
            if r.identity is not None
            and r.identity.plays(role)
            and (task is None or task in r.identity.facts_of(model).tasks)
        ]
        if not serving:
            return  # nothing to say about LoRA: no engine serves the model
        kind = "engine" if role is None else f"{role.value} engine"
        if task is not None:
            kind = f"{task} {kind}"
        holders = [r.engine_id for r in serving if r.holds_lora(lora_name)]
        if holders:
            raise LoraUnavailableError(
                f"the {kind}s with LoRA adapter {lora_name!r} loaded take no traffic now: "
                + ", ".join(holders)
            )
        if all(r.lora_adapters is None for r in serving):
            raise LoraUnsupportedError(
                f"no {kind} serving {model or 'the default model'} supports LoRA"
            )
        elsewhere = sorted(
            r.engine_id
            for r in self._by_address.values()
            if model
            and r.identity is not None
            and not r.identity.serves(model)
            and r.holds_lora(lora_name)
        )
        held = f" (engines not serving {model!r} hold it: {', '.join(elsewhere)})"
        raise LoraNotLoadedError(
            f"no {kind} has LoRA adapter {lora_name!r} loaded" + (held if elsewhere else "")
        )

    def request_drain(self, key: str) -> EngineRecord:
        """Out of routing at once, until the engine's own health takes over (it says
        DRAINING) or `withdraw_drain`. Not a health answer: an engine that is unreachable or
        not ready keeps its state and error (a drain it cannot be sent fails, and says why)."""
        record = self.get(key)
        record.drain_requested = True
        if record.state in _READY_TO_ITS_POLLS:
            self._keep_shown_error(record)
            record.state = EngineState.DRAINING
            self._changed()
            self._decide_cap()
        return record

    def withdraw_drain(self, address: str) -> None:
        """The engine did not take the drain asked of it (its Drain failed before any
        progress): its next health answer decides again."""
        record = self._by_address.get(address)
        if record is not None:
            record.drain_requested = False

    def set_cordoned(self, key: str, cordoned: bool) -> EngineRecord:
        record = self.get(key)
        if cordoned:
            self._keep_shown_error(record)
        elif record.state in _READY_TO_ITS_POLLS:
            record.last_error = ""  # back in the cap's decision: shown as `error_of` makes it
        record.cordoned = cordoned
        self._changed()
        self._decide_cap()
        return record

    # ---- what the pollers report ----

    def on_identity(self, address: str, identity: EngineIdentity, restarted: bool = False) -> bool:
        """Record GetEngineInfo/GetModelInfo; returns True when this may be a new engine
        process, whose old index entries must go: first contact, a changed instance id, an
        engine answering again after its connection was lost (a process restarted with an
        `instance_id` set in its config keeps it; an engine that was only too busy to answer
        in time is the same process, and keeps its entries and in-flight accounting), or
        `restarted` (the caller saw another sign of a new process: GetLoad naming a new
        instance).
        Raises IncompatibleEngineError (and marks the engine) when the revision check fails."""
        try:
            return self._take_identity(address, identity, restarted)
        finally:
            record = self._by_address.get(address)
            if record is not None and record.state is EngineState.INCOMPATIBLE:
                self._restart_ready_time(record)
            self._decide_cap()  # an engine rejected leaves the fleet taking traffic

    def _take_identity(self, address: str, identity: EngineIdentity, restarted: bool) -> bool:
        """`on_identity`, but for the cap on those held out."""
        record = self._by_address[address]
        self._changed()  # whatever follows: a new identity, or the engine rejected
        # An engine whose connection was lost is a new process when it answers again, even
        # if it answered with errors on the way (restarting, failing, then healthy).
        came_back = record.state in POLL_FAILED_STATES and record.connection_lost
        try:
            check_revision(
                identity.schema_revision,
                identity.minimum_client_revision,
                identity.schema_release,
            )
        except IncompatibleEngineError as exc:
            record.identity = identity
            _reject(record, str(exc))
            raise
        id_bytes = len(identity.instance_id.encode())
        if id_bytes > MAX_INSTANCE_ID_BYTES:
            _reject(
                record,
                f"its instance_id is {id_bytes} bytes long, more than {MAX_INSTANCE_ID_BYTES}: "
                "it would not fit the metadata naming the engine of each request routed there",
            )
            raise IncompatibleEngineError(record.last_error)
        if identity.instance_id == self.own_instance_id:
            # This controller's own gateway, registered under its address: each request routed
            # there would come back in, to be routed again.
            _reject(record, f"this is the controller itself (instance {identity.instance_id})")
            raise IncompatibleEngineError(record.last_error)
        if self.own_instance_id is not None and (
            self.own_instance_id in identity.fronted_controller_ids
        ):
            # Fronting a controller is fine (a hierarchical fleet), unless it fronts this one:
            # each request routed there would be routed back here, and on around the ring.
            _reject(
                record,
                f"a controller (instance {identity.instance_id}) that fronts this controller "
                f"(instance {self.own_instance_id}): requests would loop between them",
            )
            raise IncompatibleEngineError(record.last_error)
        twin = self._reachable_twin(address, identity.instance_id)
        if twin is not None:
            # One engine process under two addresses (localhost and 127.0.0.1, say) would be
            # counted and routed to twice, and cordoned or drained only half.
            _reject(record, f"the same engine (instance {identity.instance_id}) as {twin.address}")
            raise IncompatibleEngineError(record.last_error)
        if record.state is EngineState.INCOMPATIBLE:
            record.state = EngineState.UNKNOWN  # upgraded: the next health answer decides
            record.last_error = ""
        is_new = (
            record.identity is None
            or record.identity.instance_id != identity.instance_id
            or came_back
            or restarted
        )
        # The process that answered after the loss is the one taken now: if its polls go on
        # failing (FAILING: answering with errors), its next identity is the same process's,
        # not a new one at every retry (each of which would drop its index entries again).
        record.connection_lost = False
        if is_new:
            record.epoch += 1
            record.drain_requested = False
            record.request_failures = record.ejections = 0
            record.ejected_until_s = None
            record.event_lag_s = None
            record.lora_adapters = None  # a new process has loaded nothing we know of
            record.lora_refused = frozenset()
        record.identity = identity
        return is_new

    def _reachable_twin(self, address: str, instance_id: str) -> EngineRecord | None:
        """Another record of the same engine process that is answering now (one whose polls
        fail may be the engine's old address, or a broken process replaced at a new one: the
        new one takes over)."""
        for other in self._by_address.values():
            if (
                other.address != address
                and other.identity is not None
                and other.identity.instance_id == instance_id
                and other.state not in POLL_FAILED_STATES
                and other.state is not EngineState.INCOMPATIBLE
            ):
                return other
        return None

    def on_new_instance(self, address: str, now_s: float, same_instance: bool = False) -> None:
        """GetLoad named a process other than the one whose identity was read: out of routing
        (UNKNOWN), reporting no load, until `on_identity` has taken the new process and a
        health answer says READY again. Until then the index still holds the old process's
        blocks. An engine that was ready has left ready (a flap, once per new process: it is
        UNKNOWN from now on), however fast it came back: a crash loop faster than a health
        poll shows only as this. `same_instance`: its identity changed under the instance id
        of the one read (a controller fronted as an engine, whose own fleet changed; an
        engine redeployed under the instance id its config sets): taken as a new process all
        the same, but no flap, as nothing says that its process went away (a crash loop
        under a fixed instance id keeps its identity, and is not taken for a restart here)."""
        record = self._by_address.get(address)
        if record is not None and record.state is not EngineState.INCOMPATIBLE:
            self._now_s = max(self._now_s, now_s)
            self._keep_shown_error(record)  # (as of `now_s`, when the new process was found)
            if not same_instance:
                self._count_flap(record, EngineState.UNKNOWN, now_s)
            self._restart_ready_time(record)  # no flap under the same id, but not ready
            record.state = EngineState.UNKNOWN
            record.load = LoadSnapshot()  # the old process's: the fleet's totals drop it
            self._changed()
            self._decide_cap()

    def on_loras(
        self,
        address: str,
        adapters: frozenset[str] | None,
        conflicts: frozenset[str] = frozenset(),
    ) -> None:
        """Record every adapter the engine holds (ListLoras; None: it serves no LoRA), and
        those of them that conflict with the fleet's (`lora_conflicts`)."""
        record = self._by_address.get(address)
        if record is not None:
            record.lora_adapters = adapters
            record.lora_conflicts = conflicts
            self._changed()

    def on_lora_loaded(self, address: str, lora_name: str) -> None:
        record = self._by_address.get(address)
        if record is not None:
            record.lora_adapters = (record.lora_adapters or frozenset()) | {lora_name}
            self._changed()

    def on_lora_restore(self, address: str) -> None:
        """The fleet restores the engine's adapters again: those refused may be taken."""
        record = self._by_address.get(address)
        if record is not None:
            record.lora_refused = frozenset()

    def on_lora_refused(self, address: str, lora_name: str) -> None:
        """The engine refused the restore of `lora_name` (`lora_refused`)."""
        record = self._by_address.get(address)
        if record is not None:
            record.lora_refused = record.lora_refused | {lora_name}
            self._changed()  # (a request waiting for it to hold the adapter is told)

    def on_lora_unloaded(self, address: str, lora_name: str) -> None:
        record = self._by_address.get(address)
        if record is not None and record.lora_adapters is not None:
            record.lora_adapters = record.lora_adapters - {lora_name}
            record.lora_conflicts = record.lora_conflicts - {lora_name}
            self._changed()

    def mark_incompatible(self, address: str, error: str) -> None:
        record = self._by_address.get(address)
        if record is not None:
            _reject(record, error)
            self._restart_ready_time(record)
            self._changed()
            self._decide_cap()

    def on_health(self, address: str, state: EngineState, now_s: float, message: str = "") -> None:
        """Record a health answer. `message` (what the failing checks said) is kept as the
        engine's error only when the state keeps it out of routing: a healthy engine's checks
        carry informational messages (the model's name), which are no error."""
        record = self._by_address.get(address)
        if record is None or record.state is EngineState.INCOMPATIBLE:
            return
        self._now_s = max(self._now_s, now_s)
        cap_inputs = _cap_inputs(record)
        ejected = record.ejected_until_s is not None and now_s < record.ejected_until_s
        self._count_flap(record, state, now_s)
        held = state in ROUTABLE_STATES and self._still_held(record, now_s)
        if record.drain_requested and state in ROUTABLE_STATES:
            state = EngineState.DRAINING
        elif state is EngineState.DRAINING:
            record.drain_requested = False  # the engine drains: its own health decides now
        elif ejected and state in ROUTABLE_STATES:
            # As a held-down engine, below: the cap decides.
            record.ready_as = state
            if record.state not in ROUTABLE_STATES:
                state = EngineState.EJECTED
        elif held:
            # Where it stands until the cap decides: as its health says if routed by the cap
            # already (READY or DEGRADED, either: no routing by the cap counted again, no bump
            # of `version` for the same answer), else held out.
            record.ready_as = state
            if record.state not in ROUTABLE_STATES:
                state = EngineState.HELD_DOWN
        if not ejected:
            record.ejected_until_s = None
        # Ejected or held down, its words are `error_of`'s, made when read.
        record.last_error = "" if state in _READY_TO_ITS_POLLS else message
        if state is not record.state:
            self._changed()
        if _cap_inputs(record) != cap_inputs:
            self._cap_settled = None  # (what the cap reads of it changed: decided again)
        record.state = state
        record.num_failures = 0
        self._decide_cap()

    def would_flap(self, address: str, state: EngineState) -> bool:
        """Whether the engine at `address` taking `state` now would be a flap (the module's
        "Hold-down"): it leaves ready, and neither drains nor is cordoned."""
        record = self._by_address.get(address)
        return record is not None and _flaps(record, state)

    def drained_elsewhere(self, address: str, instance_id: str) -> bool:
        """The engine process `instance_id` was drained through another controller replica
        (the shared membership says so, `controller.membership`): if it is the one at
        `address`, its leave is the drain's, no flap, as if drained through this one."""
        record = self._by_address.get(address)
        if record is None or record.engine_id != instance_id:
            return False
        record.drain_requested = True
        return True

    def _count_flap(self, record: EngineRecord, state: EngineState, now_s: float) -> None:
        """Before `record` takes `state` (a health answer, a poll's failure, another process):
        count a flap (the module's "Hold-down") if it leaves ready, and hold it down when
        that is one too many. Held down, any state but READY or DEGRADED (a drain's, one while
        cordoned: no flap) starts its ready time again."""
        if state not in ROUTABLE_STATES:
            self._restart_ready_time(record)
        if not _flaps(record, state):
            return
        record.num_flaps += 1
        policy = self.hold_down
        if not policy.after_flaps:
            return
        window_start_s = now_s - policy.window_s
        record.flap_times = [t for t in record.flap_times if t > window_start_s] + [now_s]
        if record.released_s is not None and record.released_s <= window_start_s:
            record.hold_downs = 0  # in routing a whole window since its last hold-down
        if not record.hold_downs and len(record.flap_times) < policy.after_flaps:
            return
        record.hold_s = min(policy.initial_s * 2.0**record.hold_downs, policy.max_s)
        record.hold_downs += 1
        log.warning(
            "engine %s held down: left ready %d times in %g s; out of routing for %g s once it "
            "says READY again, then %d ready polls",
            record.address, len(record.flap_times), policy.window_s, record.hold_s,
            policy.ready_polls,
        )  # fmt: skip
        record.held_ready_since_s = None
        record.hold_polls_left = policy.ready_polls
        record.released_s = None

    def _restart_ready_time(self, record: EngineRecord) -> None:
        """A held-down engine is not ready for a while (its health says so, a poll fails, it
        is found incompatible): the ready time and the ready polls its hold-down asks for
        start again at its next READY."""
        if record.hold_s:
            record.held_ready_since_s = None
            record.hold_polls_left = self.hold_down.ready_polls

    def _still_held(self, record: EngineRecord, now_s: float) -> bool:
        """A ready health answer of `record`: whether its hold-down keeps it out of routing
        (ready for `hold_s`, then for `ready_polls` answers more), putting it back if not."""
        if not record.hold_s:
            return False
        if record.held_ready_since_s is None:
            record.held_ready_since_s = now_s
        if now_s - record.held_ready_since_s >= record.hold_s:
            record.hold_polls_left -= 1
            if record.hold_polls_left <= 0:
                record.hold_s = 0.0
                record.held_ready_since_s = None
                record.released_s = now_s
                return False
        return True

    def error_of(self, record: EngineRecord, now_s: float | None = None) -> str:
        """What `record`'s engine is shown with as of `now_s` (None: the latest time recorded):
        an engine the cap decides on (the module's "Outlier ejection" and "Hold-down"), held
        out or routed all the same, why, and until when; any other, its `last_error`. Made
        here, when read, and nowhere else."""
        if now_s is None:
            now_s = self._now_s
        state = record.state
        if state is EngineState.EJECTED:
            return self._ejected_error(record, now_s, routed=False)
        if state is EngineState.HELD_DOWN:
            return self._held_for(record, now_s)
        if state in ROUTABLE_STATES and not record.cordoned:
            # Routed by the cap: those `_decide_cap` lists, its ejection first.
            if record.ejected_until_s is not None:
                return self._ejected_error(record, now_s, routed=True)
            if record.hold_s:
                return self._held_for(record, now_s, routed=True)
        return record.last_error

    def _keep_shown_error(self, record: EngineRecord) -> None:
        """`record` leaves the cap's decision otherwise than by a health answer or a poll (a
        drain, a cordon, a new process): the words it was shown with (`error_of`) stay its
        error, as of now, until an answer or a poll says otherwise."""
        record.last_error = self.error_of(record)

    def _held_for(self, record: EngineRecord, now_s: float, routed: bool = False) -> str:
        """Why a held-down engine that says it is ready is not routed, and until when; with
        `routed` (the cap routes it all the same), why it is, and when its hold-down ends."""
        left_s = max(0.0, _hold_down_ends_s(record, now_s) - now_s)
        flaps = len(record.flap_times)
        window_s = self.hold_down.window_s
        return (
            (_ROUTED_ANYWAY if routed else "")
            + f"left ready {flaps} time{'s' if flaps != 1 else ''} in {window_s:g} s "
            f"(hold-down {record.hold_s:g} s); {'hold-down over' if routed else 'routable'} "
            f"in {left_s:.0f} s and "
            f"{record.hold_polls_left} more ready poll{'s' if record.hold_polls_left != 1 else ''}"
            ", if it stays ready"
        )

    def _decide_cap(self) -> None:
        """Hold out the ejected engines and the held-down ones that say ready, as many as the
        cap they share leaves room for (half of the engines taking traffic: the module's
        "Outlier ejection" and "Hold-down"), and route the others all the same, their ejection
        or hold-down running on. Ejections first: first out, the one whose ejection ends last
        (the one whose ejection ends soonest is the first routed), then by address; then the
        held-down engines: first out, the one whose hold-down ends last, then the one with
        most flaps in its window, then by address. Cordoned engines take no traffic: neither
        held out nor counted. Called after every change of the fleet that takes an engine
        into or out of traffic."""
        # This runs at every health answer of every engine: at hundreds of engines, going
        # over them all each time cost as much as the rest of the polls, so not again while
        # what it decided stands: no change of the fleet since (`version`; an answer that
        # changes what it reads of its engine, `_cap_inputs`, unsettles it too), and the
        # time short of the end of an ejection it routes past (then that engine is routed
        # for good, which may leave room to hold out another).
        if self.version == self._cap_settled and self._now_s < self._cap_settled_until_s:
            return
        records = self._by_address.values()
        self._cap_settled_until_s = math.inf
        if not any(r.ejected_until_s is not None or r.hold_s for r in records):
            self._cap_settled = self.version
            return
        ejected: list[EngineRecord] = []
        held: list[EngineRecord] = []
        in_rotation = 0
        now_s = self._now_s
        for r in records:  # one pass over the fleet
            state = r.state
            if r.cordoned or state not in _CAPPED_STATES:
                continue
            in_rotation += _in_rotation(r)
            until_s = r.ejected_until_s
            if until_s is not None and state is not EngineState.HELD_DOWN:
                if state is EngineState.EJECTED or now_s < until_s:
                    ejected.append(r)
                    continue
                # Routed by the cap, its ejection over as of the latest time recorded: routed
                # for good (its next health answer would find it over), not held out again.
                r.ejected_until_s = None
            if r.hold_s and r.ejected_until_s is None and state is not EngineState.EJECTED:
                held.append(r)
                if r.held_ready_since_s is None:
                    # (Its hold-down's end, and so the order, runs with the time: decided
                    # again at every call. Not met: an engine saying ready has begun its
                    # ready time, `_still_held`.)
                    self._cap_settled_until_s = now_s
        room = in_rotation // 2
        ejected.sort(key=lambda r: (-(r.ejected_until_s or 0.0), r.address))
        for n, record in enumerate(ejected):
            self._hold_out(record, EngineState.EJECTED, n < room, CAPPED_EJECTION)
            if n >= room:
                until_s = record.ejected_until_s or 0.0
                self._cap_settled_until_s = min(self._cap_settled_until_s, until_s)
        room = max(0, room - len(ejected))
        held.sort(key=lambda r: (-_hold_down_ends_s(r, now_s), -len(r.flap_times), r.address))
        for n, record in enumerate(held):
            self._hold_out(record, EngineState.HELD_DOWN, n < room, CAPPED_HOLD_DOWN)
        self._cap_settled = self.version  # (as `_hold_out` may have moved it)

    def _hold_out(self, record: EngineRecord, out: EngineState, kept_out: bool, why: str) -> None:
        """The cap's decision on `record`: held `out` (EJECTED, HELD_DOWN), or routed as its
        health says, counted as routed by the cap (`why`) when it was held out until now."""
        state = out if kept_out else record.ready_as
        if record.state is out and not kept_out:
            self.routed_by_cap[why] += 1
        if state is not record.state:
            self._changed()
            record.state = state

    def _ejected_error(self, record: EngineRecord, now_s: float, routed: bool) -> str:
        """Why an ejected engine is out of routing, and for how long; with `routed` (the cap
        routes it all the same), why it is routed, and when its ejection ends."""
        if not routed:
            return f"{record.ejected_for}; out of routing for {record.ejection_s:g} s"
        left_s = max(0.0, (record.ejected_until_s or 0.0) - now_s)
        return f"{_EJECTED_ROUTED}{record.ejected_for}; ejection over in {left_s:.0f} s"

    def on_request_served(self, engine: str) -> None:
        """A request the engine (address or instance id) served: its failure count restarts.
        Not while it is ejected: a stream it began before still proves nothing of what
        failed since (its probation and the doubling stand)."""
        record = self.by_engine_id(engine)
        if record is not None and record.state is not EngineState.EJECTED:
            record.request_failures = record.ejections = 0

    def on_request_failed(self, engine: str, now_s: float, error: str) -> float | None:
        """A request the engine failed by a fault of its own (the module's "Outlier
        ejection"). Returns how long it is now out of routing, or None when it stays in."""
        record = self.by_engine_id(engine)
        policy = self.ejection
        # Only while its health says ready: the streams an outage or a drain ends fail as
        # well, and counted they would eject the engine at its first failure once it is back.
        if record is None or record.state not in ROUTABLE_STATES:
            return None
        self._now_s = max(self._now_s, now_s)
        record.request_failures += 1
        if not policy.after_failures or record.request_failures < policy.after_failures:
            return None
        if self._num_ejected() + 1 > self._num_in_rotation() // 2:
            self.routed_by_cap[CAPPED_EJECTION] += 1
            return None
        duration_s = min(policy.initial_s * 2.0**record.ejections, policy.max_s)
        record.ejections += 1
        record.ejected_until_s = now_s + duration_s
        record.ejection_s = duration_s
        record.ejected_for = f"{record.request_failures} requests failed in a row (last: {error})"
        record.ready_as = record.state
        record.state = EngineState.EJECTED
        self._changed()
        self._decide_cap()  # room for the ejection: a held-down engine may be routed
        return duration_s

    def _num_ejected(self) -> int:
        """The ejected engines held out (cordoned ones take no traffic: not counted)."""
        return sum(
            r.state is EngineState.EJECTED and not r.cordoned for r in self._by_address.values()
        )

    def _num_in_rotation(self) -> int:
        """How many engines are `_in_rotation`: the fleet the cap is half of."""
        return sum(_in_rotation(r) for r in self._by_address.values())

    def on_load(self, address: str, load: LoadSnapshot) -> None:
        record = self._by_address.get(address)
        if record is not None:
            record.load = load

    def on_event_lag(self, address: str, lag_s: float | None) -> None:
        """The lag of the engine's last KV-event batch (None: its stamp was implausible)."""
        record = self._by_address.get(address)
        if record is not None:
            record.event_lag_s = lag_s

    def on_poll_failed(
        self,
        address: str,
        now_s: float,
        error: str,
        failure: PollFailure = PollFailure.CONNECTION_LOST,
    ) -> float:
        """A poll failed: out of routing at once, next attempt after backoff, and no load
        reported (its last GetLoad described a process that may be gone; the fleet's totals
        must not keep counting it). `failure` says how, and so the state: UNREACHABLE when
        the poll did not reach the engine, FAILING when it answered with an error. An engine
        that could not be reached at all (CONNECTION_LOST) may have been replaced by the time
        it answers; an outage (`unreachable_since`) runs from the first poll that could not
        reach it until a poll it answers, an error answer included. Returns the delay before
        the next attempt."""
        record = self._by_address.get(address)
        if record is None:
            return self.backoff_max_s
        self._now_s = max(self._now_s, now_s)
        if record.state is not EngineState.INCOMPATIBLE:
            if record.state not in POLL_FAILED_STATES:
                record.connection_lost = False
                record.unreachable_since_s = None
            self._count_flap(record, failure.state, now_s)
            if failure.state is not record.state:
                self._changed()
            record.state = failure.state
        if failure is PollFailure.ERROR_ANSWER:
            record.unreachable_since_s = None
        elif record.unreachable_since_s is None:
            record.unreachable_since_s = now_s
        record.connection_lost = record.connection_lost or failure is PollFailure.CONNECTION_LOST
        record.last_error = error
        record.load = LoadSnapshot()
        delay: float = min(self.backoff_initial_s * 2.0**record.num_failures, self.backoff_max_s)
        record.num_failures += 1
        self._decide_cap()
        return delay

    def unreachable_since(self, address: str) -> float | None:
        """When the engine's current outage began; None while it answers (an error answer
        included) or is unknown."""
        record = self._by_address.get(address)
        if record is None or record.state is not EngineState.UNREACHABLE:
            return None
        return record.unreachable_since_s
