"""The fleet registry (`controller.registry.Registry`) against a naive model of the rules
docs/controller.md ("Fleet, health and events") gives for membership, identity, health,
drains, cordons and LoRA adapters, driven by a hypothesis state machine the way
`controller.fleet` drives it: an identity read first (at first contact, after a poll failed,
after GetLoad named another process, after the engine was found incompatible, or when its KV
stream broke sequence), health answers only while no identity read is due, `drained_elsewhere`
asked just before an engine leaves ready. Every query is checked against the model after each
step: who is routable (per model, LoRA adapter, with and without cordoned engines), who is out
of routing, how an engine is found by address or instance id, which models are served and by
default, what a refusal names of each engine, and that `on_change` fired whenever routing
changed.

The same run covers "Outlier ejection" and "Hold-down of flapping engines" (short policies,
the time passing in whole seconds at each call and in jumps, `wait`): the gateway reports
requests an engine served or failed (by address or instance id), each flap counts toward a
hold-down, any spell not ready starts a hold-down's ready time again, and the cap they share
(never more than half of the engines taking traffic held out, ejected or held down; cordoned
engines neither held out nor counted) is decided again at every change of the fleet, for
ejected and held-down engines alike. The model checks every engine's state and error (why
it is ejected or held down, until when, or why it is routed all the same: `error_of`, made
when read, as of the latest time recorded and as of the time now, which no call recorded),
its flaps, and the counts of what the cap let through (`routed_by_cap`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from controller.fleet import health_of
from controller.registry import (
    CAPPED_EJECTION,
    CAPPED_HOLD_DOWN,
    DuplicateEngineError,
    EjectionPolicy,
    EngineIdentity,
    EngineState,
    HoldDownPolicy,
    IncompatibleEngineError,
    ModelRequiredError,
    PollFailure,
    Registry,
    Role,
    UnknownEngineError,
)
from controller.router import LoadSnapshot
from openengine.v1 import openengine_pb2 as pb

ADDRESSES = ("a:1", "b:1", "c:1")
INSTANCES = ("i0", "i1", "i2")
MODELS = ("m1", "m2")
LORAS = ("l1", "l2")
# An engine may list no model (it serves any), one, or both in either order (the first is
# what it serves a request naming none).
MODEL_LISTS = ((), ("m1",), ("m2",), ("m1", "m2"), ("m2", "m1"))
# Health answers as the engine sends them: every state the contract names, and one this
# build does not know (NOT_READY, "unknown health state 99"); READY most often, so that
# engines are routable long enough for the rest to matter.
HEALTH_ANSWERS = (
    pb.HEALTH_STATE_READY,
    pb.HEALTH_STATE_READY,
    pb.HEALTH_STATE_READY,
    pb.HEALTH_STATE_DEGRADED,
    pb.HEALTH_STATE_DRAINING,
    pb.HEALTH_STATE_NOT_READY,
    pb.HEALTH_STATE_STARTING,
    pb.HEALTH_STATE_UNSPECIFIED,
    99,
)

# Short policies, so that a run of a few dozen steps sees engines ejected, held down, put
# back, ejected or held down again for twice as long, and their records forgotten.
EJECTION = EjectionPolicy(after_failures=2, initial_s=15.0, max_s=60.0)
HOLD_DOWN = HoldDownPolicy(after_flaps=2, window_s=40.0, initial_s=15.0, max_s=60.0, ready_polls=2)

SERVING = frozenset({EngineState.READY, EngineState.DEGRADED})
# Its health says it is ready, routed or not (leaving it is a flap).
SAYS_READY = SERVING | {EngineState.EJECTED, EngineState.HELD_DOWN}
LEFT_READY = frozenset(
    {
        EngineState.NOT_READY,
        EngineState.STARTING,
        EngineState.UNKNOWN,
        EngineState.UNREACHABLE,
        EngineState.FAILING,
    }
)
POLL_FAILED = frozenset({EngineState.UNREACHABLE, EngineState.FAILING})
# What a query may name: no model, the empty name (none), each model, one nobody serves.
QUERIED_MODELS = (None, "", *MODELS, "m3")

addresses = st.sampled_from(ADDRESSES)
# The admin API names an engine by its address or its instance id.
keys = st.sampled_from(ADDRESSES + INSTANCES)
lora_sets = st.frozensets(st.sampled_from(LORAS))
held_loras = st.none() | lora_sets


def make_identity(instance: str, models: tuple[str, ...]) -> EngineIdentity:
    return EngineIdentity(instance, "sim", "0", Role.AGGREGATED, models, None, 1, 1, "v1.0.0")


@dataclass
class Engine:
    """One engine as the documented rules have it."""

    address: str
    identity: EngineIdentity | None = None
    state: EngineState = EngineState.UNKNOWN
    # Its own (a failed poll's, a health answer's); what it is shown with is
    # `RegistryMachine.shown`.
    error: str = ""
    cordoned: bool = False
    drain: bool = False  # a drain the controller started, its health not DRAINING yet
    loras: frozenset[str] | None = None
    conflicts: frozenset[str] = frozenset()
    flaps: int = 0
    # Outlier ejection: its requests failed in a row, its ejections in a row, until when the
    # last keeps it out (None: not ejected, or its time was up at a health answer; routed by
    # the cap or not), why (the failures) and for how long.
    request_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    ejected_for: str = ""
    ejection_s: float = 0.0
    # Hold-down: when its flaps within the window were, hold-downs in a row, how long it
    # must say ready (0: not held down), since when it has (None: not since its last flap
    # or spell not ready), the ready polls it owes after that, when it was put back, and
    # what its health said while held down or ejected (what it is routed as, past the cap).
    flap_times: list[float] = field(default_factory=list)
    hold_downs: int = 0
    hold_s: float = 0.0
    ready_since: float | None = None
    polls_left: int = 0
    released: float | None = None
    ready_as: EngineState = EngineState.READY
    # What its last GetLoad said; none while it does not answer, or another process does.
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    # Polls failed in a row (each doubles the retry's wait), until a health answer.
    failures: int = 0
    # A poll could not connect since its polls began to fail: whoever answers next may be a
    # new process.
    connection_lost: bool = False
    # How the fleet drives it: an identity read is due (no health is asked meanwhile),
    # taken as a new process's (GetLoad named one, or it was found incompatible), after a
    # failed poll.
    need_identity: bool = True
    restarted: bool = False
    poll_failed: bool = False

    @property
    def engine_id(self) -> str:
        return self.identity.instance_id if self.identity is not None else self.address

    def routable(self, cordoned: bool = False) -> bool:
        """Identity read, compatible, its health READY or DEGRADED, not drained, not
        cordoned (unless asked)."""
        return (
            self.identity is not None and self.state in SERVING and (cordoned or not self.cordoned)
        )

    def serves(self, model: str | None) -> bool:
        identity = self.identity
        return identity is None or not model or not identity.models or model in identity.models

    def holds(self, lora: str) -> bool:
        return not lora or (
            self.loras is not None and lora in self.loras and lora not in self.conflicts
        )

    def leaves_ready(self, state: EngineState) -> bool:
        """A flap: it said ready (routed, ejected or held down), and says otherwise now,
        neither drained nor cordoned."""
        return (
            self.state in SAYS_READY
            and state in LEFT_READY
            and not self.cordoned
            and not self.drain
        )

    def hold_ends(self, now: float) -> float:
        """When its hold-down's ready time is over, if it says ready from `now` on (or since
        it has)."""
        return (self.ready_since if self.ready_since is not None else now) + self.hold_s

    @property
    def answering(self) -> bool:
        return self.state not in POLL_FAILED and self.state is not EngineState.INCOMPATIBLE

    @property
    def availability(self) -> str:
        return "cordoned" if self.cordoned and self.state in SERVING else self.state.value


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.registry = Registry(
            backoff_initial_s=0.5, backoff_max_s=4.0, ejection=EJECTION, hold_down=HOLD_DOWN
        )
        self.engines: dict[str, Engine] = {}
        self.now = 0.0
        # The latest time a poll or a request failure was recorded at: what the error of a
        # held-down engine says "until when" as of, when the cap decides between its polls.
        self.recorded = 0.0
        # Engines removed with flaps counting, by address, with when they left.
        self.left_flapping: dict[str, tuple[float, Engine]] = {}
        self.routed_by_cap = dict.fromkeys((CAPPED_HOLD_DOWN, CAPPED_EJECTION), 0)
        self.changes = 0
        self.registry.on_change(self._count_change)
        self.changes_seen = 0
        self.routing_seen = self.routing()

    def _count_change(self) -> None:
        self.changes += 1

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def record_time(self, now: float) -> None:
        self.recorded = max(self.recorded, now)

    # ---- hold-down and ejection, as docs/controller.md has them ----

    def take(self, engine: Engine, state: EngineState, now: float) -> None:
        """A state not given by a health answer: a poll failed, another process answers (no
        load of its own yet)."""
        self.not_ready(engine)
        if engine.leaves_ready(state):
            self.flap(engine, now)
        engine.state = state
        engine.load = LoadSnapshot()

    def flap(self, engine: Engine, now: float) -> None:
        """It left ready: from its `after_flaps`-th flap within the window it is held down,
        and so at any flap while held or within a window of being put back, each time twice
        as long (a whole window put back without a flap clears the record)."""
        engine.flaps += 1
        engine.flap_times = [t for t in engine.flap_times if now - t < HOLD_DOWN.window_s]
        engine.flap_times.append(now)
        if engine.released is not None and now - engine.released >= HOLD_DOWN.window_s:
            engine.hold_downs = 0
        if engine.hold_downs or len(engine.flap_times) >= HOLD_DOWN.after_flaps:
            engine.hold_s = min(HOLD_DOWN.initial_s * 2**engine.hold_downs, HOLD_DOWN.max_s)
            engine.hold_downs += 1
            engine.ready_since = None
            engine.polls_left = HOLD_DOWN.ready_polls
            engine.released = None

    def not_ready(self, engine: Engine) -> None:
        """A spell not ready (a flap or not: drained, cordoned, incompatible): a hold-down's
        ready time and polls start again at its next READY."""
        if engine.hold_s:
            engine.ready_since, engine.polls_left = None, HOLD_DOWN.ready_polls

    def still_held(self, engine: Engine, now: float) -> bool:
        """A ready health answer: held until it has said ready for `hold_s`, then for
        `ready_polls` answers more; put back at the last."""
        if not engine.hold_s:
            return False
        since = engine.ready_since = now if engine.ready_since is None else engine.ready_since
        if now - since < engine.hold_s:
            return True  # not ready long enough yet
        engine.polls_left -= 1
        if engine.polls_left > 0:
            return True  # ready polls owed
        engine.hold_s, engine.ready_since, engine.released = 0.0, None, now
        return False

    def held_for(self, engine: Engine, now: float, routed: bool) -> str:
        """What a held-down engine's error says, as the docs' examples word it."""
        flaps, polls = len(engine.flap_times), engine.polls_left
        routed_anyway = (
            "held down but routed: more than half of the engines taking traffic would be out "
            "of routing otherwise; "
        )
        return (
            (routed_anyway if routed else "")
            + f"left ready {flaps} time{'s' if flaps != 1 else ''} in "
            f"{HOLD_DOWN.window_s:g} s (hold-down {engine.hold_s:g} s); "
            f"{'hold-down over' if routed else 'routable'} in "
            f"{max(0.0, engine.hold_ends(now) - now):.0f} s and {polls} more ready "
            f"poll{'s' if polls != 1 else ''}, if it stays ready"
        )

    def ejected_error(self, engine: Engine, now: float, routed: bool) -> str:
        """What an ejected engine's error says: out of routing, or routed past the cap."""
        if not routed:
            return f"{engine.ejected_for}; out of routing for {engine.ejection_s:g} s"
        left = max(0.0, (engine.ejected_until or 0.0) - now)
        return (
            "ejected but routed: more than half of the engines taking traffic would be out of "
            f"routing otherwise; {engine.ejected_for}; ejection over in {left:.0f} s"
        )

    def shown(self, engine: Engine, now: float) -> str:
        """What the engine is shown with at `now`: ejected or held down, why and until when;
        routed by the cap all the same (its health ready, not cordoned, its ejection or
        hold-down running on), why, and when that ends; else its own error."""
        if engine.state is EngineState.EJECTED:
            return self.ejected_error(engine, now, routed=False)
        if engine.state is EngineState.HELD_DOWN:
            return self.held_for(engine, now, routed=False)
        if engine.state in SERVING and not engine.cordoned:
            if engine.ejected_until is not None:
                return self.ejected_error(engine, now, routed=True)
            if engine.hold_s:
                return self.held_for(engine, now, routed=True)
        return engine.error

    def keep_shown(self, engine: Engine) -> None:
        """It leaves the cap's decision by a drain, a cordon or a new process: what it was
        shown with stays its error until an answer or a poll says otherwise (or, cordoned,
        until it is uncordoned)."""
        engine.error = self.shown(engine, self.recorded)

    def in_rotation(self) -> list[Engine]:
        """The engines taking traffic: routable, ejected, held down (not cordoned)."""
        return [
            e
            for e in self.engines.values()
            if e.routable()
            or (e.state in (EngineState.EJECTED, EngineState.HELD_DOWN) and not e.cordoned)
        ]

    def ejected(self) -> int:
        """Ejected engines held out (a cordoned one takes no traffic: it does not count)."""
        return sum(e.state is EngineState.EJECTED and not e.cordoned for e in self.engines.values())

    def decide_cap(self) -> None:
        """At every change of the fleet: of the ejected engines (ejection not over at a
        health answer) and then the held-down ones that say ready (none cordoned), at most
        half of those taking traffic are held out; the others are routed as their health
        says. Ejected first: the one whose ejection ends last, then by address; then
        held-down: the one whose hold-down ends last, then the one with most flaps, then by
        address."""
        now = self.recorded
        for e in self.engines.values():
            if (
                e.ejected_until is not None
                and now >= e.ejected_until
                and not e.cordoned
                and e.state in SERVING
            ):
                # Routed by the cap, its ejection over: routed for good, not held out again.
                e.ejected_until = None
        ejected = sorted(
            (
                e
                for e in self.engines.values()
                if e.ejected_until is not None
                and not e.cordoned
                and e.state in SERVING | {EngineState.EJECTED}
            ),
            key=lambda e: (-(e.ejected_until or 0.0), e.address),
        )
        held = sorted(
            (
                e
                for e in self.engines.values()
                if e.hold_s
                and e.ejected_until is None
                and not e.cordoned
                and e.state in SERVING | {EngineState.HELD_DOWN}
            ),
            key=lambda e: (-e.hold_ends(now), -len(e.flap_times), e.address),
        )
        room = len(self.in_rotation()) // 2
        for n, engine in enumerate(ejected):
            self.hold_out(engine, EngineState.EJECTED, n < room, CAPPED_EJECTION)
        room = max(0, room - len(ejected))
        for n, engine in enumerate(held):
            self.hold_out(engine, EngineState.HELD_DOWN, n < room, CAPPED_HOLD_DOWN)

    def hold_out(self, engine: Engine, out: EngineState, kept_out: bool, reason: str) -> None:
        """Held `out`, or routed as its health says: counted when it was held out until now."""
        if kept_out:
            engine.state = out
            return
        if engine.state is out:
            self.routed_by_cap[reason] += 1
        engine.state = engine.ready_as

    # ---- the model's answers ----

    def resolve(self, key: str) -> Engine | None:
        """The engine an address or instance id names: the address's; else of those with the
        instance id, the routable one, then one answering its polls, then by address."""
        if key in self.engines:
            return self.engines[key]
        named = [
            e
            for e in self.engines.values()
            if e.identity is not None and e.identity.instance_id == key
        ]
        if not named:
            return None
        return min(named, key=lambda e: (not e.routable(), not e.answering, e.address))

    def expected_routable(self, model: str | None, lora: str, cordoned: bool) -> list[str]:
        return sorted(
            e.address
            for e in self.engines.values()
            if e.routable(cordoned) and e.serves(model) and e.holds(lora)
        )

    def expected_out_of_routing(self, model: str | None, lora: str) -> list[str]:
        return sorted(
            e.address
            for e in self.engines.values()
            if e.identity is not None
            and e.state not in SERVING
            and e.state is not EngineState.INCOMPATIBLE
            and e.serves(model)
            and e.holds(lora)
        )

    def expected_may_serve(self, model: str | None) -> list[str]:
        return sorted(
            e.address
            for e in self.engines.values()
            if e.state is not EngineState.INCOMPATIBLE and e.serves(model)
        )

    def expected_base_models(self) -> list[str]:
        return sorted(
            {
                e.identity.models[0]
                for e in self.engines.values()
                if e.identity is not None
                and e.identity.models
                and e.state is not EngineState.INCOMPATIBLE
            }
        )

    def routing(self) -> dict[tuple[str | None, str, bool], list[str]]:
        """Every routable answer, as the registry gives it."""
        return {
            (model, lora, cordoned): [
                r.address for r in self.registry.routable(model, lora_name=lora, cordoned=cordoned)
            ]
            for model in QUERIED_MODELS
            for lora in ("", *LORAS)
            for cordoned in (False, True)
        }

    # ---- membership ----

    @initialize(registered=st.sets(addresses, min_size=2), ready=st.booleans())
    def start(self, registered: set[str], ready: bool) -> None:
        """Engines registered; with `ready`, each polled once, ready (a fleet up and running,
        whose engines the rest can eject or hold down)."""
        for n, address in enumerate(sorted(registered)):
            self.add(address)
            if ready:
                self.poll(address, pb.HEALTH_STATE_READY, INSTANCES[n], ("m1",), None)

    @rule(address=addresses)
    def add(self, address: str) -> None:
        """Registered again within a flap window of its removal, an engine at the address
        takes back its flaps and hold-down (its ready time counted afresh)."""
        now = self.tick()
        if address in self.engines:
            with pytest.raises(DuplicateEngineError):
                self.registry.add(address, now_s=now)
            return
        self.registry.add(address, now_s=now)
        engine = self.engines[address] = Engine(address)
        left = self.left_flapping.pop(address, None)
        if left is not None and now - left[0] < HOLD_DOWN.window_s:
            gone = left[1]
            engine.flaps, engine.flap_times = gone.flaps, list(gone.flap_times)
            engine.hold_downs, engine.hold_s = gone.hold_downs, gone.hold_s
            engine.polls_left, engine.released = gone.polls_left, gone.released

    @rule(key=keys)
    def remove(self, key: str) -> None:
        engine = self.resolve(key)
        now = self.tick()
        if engine is None:
            with pytest.raises(UnknownEngineError):
                self.registry.remove(key, now)
            return
        assert self.registry.remove(key, now).address == engine.address
        del self.engines[engine.address]
        if engine.flap_times or engine.hold_downs:
            self.left_flapping[engine.address] = (now, replace(engine))
        self.decide_cap()

    # ---- what the pollers report, as the fleet reports it ----

    @rule(
        address=addresses,
        instance=st.sampled_from(INSTANCES),
        models=st.sampled_from(MODEL_LISTS),
        compatible=st.sampled_from((True, True, True, False)),
        stream_broke=st.booleans(),
        listed=st.booleans(),
        adapters=held_loras,
        conflicts=lora_sets,
    )
    def read_identity(
        self,
        *,
        address: str,
        instance: str,
        models: tuple[str, ...],
        compatible: bool,
        stream_broke: bool,
        listed: bool,
        adapters: frozenset[str] | None,
        conflicts: frozenset[str],
    ) -> None:
        """`Fleet._fetch_identity`: GetEngineInfo's revision checked first (an incompatible
        one is `mark_incompatible`), a process changed under GetLoad's eyes taken as a new
        one (`on_new_instance`), `on_identity`, then the adapters ListLoras listed."""
        engine = self.engines.get(address)
        if engine is None:
            return
        now = self.tick()
        if not compatible:
            self.registry.mark_incompatible(address, "engine schema_release 'main' ...")
            self.incompatible(engine, "engine schema_release 'main' ...")
            return
        identity = make_identity(instance, models)
        previous = engine.identity
        # The fleet reads an identity at first contact, for a new process, after a failed
        # poll, or when the engine's KV stream broke sequence.
        if previous is not None and not engine.restarted and not engine.poll_failed:
            stream_broke = True
        restarted = engine.restarted
        if previous is not None and identity != previous and (stream_broke or engine.poll_failed):
            same_instance = identity.instance_id == previous.instance_id
            self.registry.on_new_instance(address, now, same_instance)
            self.new_process(engine, same_instance, now)
            restarted = True
        # Another address whose engine, answering its polls, has this instance id.
        twins = [
            e.address
            for e in self.engines.values()
            if e.address != address
            and e.identity is not None
            and e.identity.instance_id == instance
            and e.answering
        ]
        twin = bool(twins)
        came_back = engine.state in POLL_FAILED and engine.connection_lost
        try:
            is_new = self.registry.on_identity(address, identity, restarted)
        except IncompatibleEngineError as exc:
            assert twin, f"{address} rejected: {exc}"
            assert any(str(exc).endswith(f"as {a}") for a in twins), exc
            self.registry.mark_incompatible(address, str(exc))
            self.incompatible(engine, str(exc))
            return
        assert not twin, f"{address} took instance {instance}, answering at another address"
        expected_new = (
            previous is None or previous.instance_id != instance or came_back or restarted
        )
        assert is_new == expected_new
        if engine.state is EngineState.INCOMPATIBLE:
            engine.state = EngineState.UNKNOWN
            engine.error = ""
        engine.connection_lost = False
        if is_new:
            # A new process: no drain of the old one's, no adapter known (until its listing,
            # below), a clean ejection record; its cordon (the operator's, of the address) and
            # its hold-down (a crash loop flaps too) stay.
            engine.drain = False
            engine.loras = None
            engine.conflicts = frozenset()
            engine.request_failures = engine.ejections = 0
            engine.ejected_until = None
            record = self.registry.get(address)
            assert record.lora_adapters is None, f"{address}: a new process holds {record}"
            assert not any(record.holds_lora(lora) for lora in LORAS), address
        engine.identity = identity
        engine.need_identity = engine.restarted = engine.poll_failed = False
        self.decide_cap()
        if is_new or listed:  # `Fleet.learn_loras`: a new process's listing always counts
            conflicts = conflicts & adapters if adapters is not None else frozenset()
            self.registry.on_loras(address, adapters, conflicts)
            engine.loras = adapters
            engine.conflicts = conflicts

    def incompatible(self, engine: Engine, error: str) -> None:
        self.not_ready(engine)
        engine.state = EngineState.INCOMPATIBLE
        engine.error = error
        engine.load = LoadSnapshot()  # perhaps an earlier process's
        # Whatever answers next is read as a new process.
        engine.need_identity = engine.restarted = True
        self.decide_cap()

    def new_process(self, engine: Engine, same_instance: bool, now: float) -> None:
        """Out of routing until its identity is read; a flap unless under the same id."""
        if engine.state is EngineState.INCOMPATIBLE:
            return
        self.record_time(now)
        self.keep_shown(engine)  # as of when it was found
        if same_instance:
            self.not_ready(engine)  # no flap, but a spell not ready all the same
            engine.state = EngineState.UNKNOWN
            engine.load = LoadSnapshot()
        else:
            self.take(engine, EngineState.UNKNOWN, now)
        self.decide_cap()

    @rule(address=addresses)
    def load_names_another_process(self, address: str) -> None:
        """GetLoad named another instance than before (polled only with no identity due)."""
        engine = self.engines.get(address)
        if engine is None or engine.need_identity:
            return
        now = self.tick()
        self.registry.on_new_instance(address, now)
        self.new_process(engine, same_instance=False, now=now)
        engine.need_identity = engine.restarted = True

    @rule(
        address=addresses,
        answer=st.sampled_from(HEALTH_ANSWERS),
        running=st.integers(0, 3),
        instance=st.sampled_from(INSTANCES),
        models=st.sampled_from(MODEL_LISTS),
        adapters=held_loras,
    )
    def health(
        self,
        *,
        address: str,
        answer: int,
        running: int,
        instance: str,
        models: tuple[str, ...],
        adapters: frozenset[str] | None,
    ) -> None:
        """A poll: its identity read first if one is due (as the engine it was, if it was
        one), then a health answer."""
        engine = self.engines.get(address)
        if engine is None:
            return
        if engine.need_identity:
            if engine.identity is not None:
                instance, models = engine.identity.instance_id, engine.identity.models
            self.read_identity(
                address=address,
                instance=instance,
                models=models,
                compatible=True,
                stream_broke=False,
                listed=True,
                adapters=adapters,
                conflicts=frozenset(),
            )
            if engine.need_identity:
                return
        state, message = health_of(pb.HealthResponse(state=answer))  # type: ignore[arg-type]
        if answer not in pb.HealthState.values():
            assert (state, message) == (EngineState.NOT_READY, f"unknown health state {answer}")
        self.take_health(engine, state, message)
        load = LoadSnapshot(running_requests=running)
        self.registry.on_load(address, load)  # GetLoad's answer, asked with the health
        engine.load = load

    def take_health(self, engine: Engine, state: EngineState, message: str) -> None:
        now = self.tick()
        self.registry.on_health(engine.address, state, now, message)
        self.record_time(now)
        ejected = engine.ejected_until is not None and now < engine.ejected_until
        if state not in SERVING:
            self.not_ready(engine)
        if engine.leaves_ready(state):
            self.flap(engine, now)
        # A ready answer counts toward its hold-down whatever else keeps it out.
        held = state in SERVING and self.still_held(engine, now)
        if engine.drain and state in SERVING:
            state = EngineState.DRAINING  # an answer sent before the drain took
        elif state is EngineState.DRAINING:
            engine.drain = False  # its own health decides from now on
        elif ejected and state in SERVING:
            # Back once its time is up; until then held out unless the cap routes it (as it
            # did already: it decides again).
            engine.ready_as = state
            if engine.state not in SERVING:
                state = EngineState.EJECTED
        elif held:
            engine.ready_as = state
            if engine.state not in SERVING:  # routed by the cap already: it decides again
                state = EngineState.HELD_DOWN
        if not ejected:
            engine.ejected_until = None
        engine.state = state
        engine.error = "" if state in SAYS_READY else message
        engine.failures = 0
        self.decide_cap()

    @rule(
        address=addresses,
        answers=st.lists(
            st.sampled_from(
                (pb.HEALTH_STATE_READY,) * 3
                + (pb.HEALTH_STATE_DEGRADED, pb.HEALTH_STATE_NOT_READY, pb.HEALTH_STATE_NOT_READY)
                + tuple(PollFailure)
            ),
            min_size=2,
            max_size=6,
        ),
    )
    def polls(self, address: str, answers: list[int | PollFailure]) -> None:
        """Its polls one after the other, each READY, DEGRADED, NOT_READY or failed: a
        flapping engine's."""
        for answer in answers:
            if isinstance(answer, PollFailure):
                self.poll_fails(address, answer)
            else:
                self.poll(address, answer, INSTANCES[ADDRESSES.index(address)], ("m1",), None)

    @rule(address=addresses)
    def flaps(self, address: str) -> None:
        """One poll NOT_READY, the next READY."""
        for answer in (pb.HEALTH_STATE_NOT_READY, pb.HEALTH_STATE_READY):
            self.poll(address, answer, INSTANCES[ADDRESSES.index(address)], (), None)

    @rule()
    def every_engine_answers_ready(self) -> None:
        """A round of polls every engine answers READY: the fleet's steady state, which the
        rest upsets (and from which engines are ejected and flap)."""
        for address in sorted(self.engines):
            self.poll(address, pb.HEALTH_STATE_READY, INSTANCES[ADDRESSES.index(address)], (), None)

    def poll(
        self,
        address: str,
        answer: int,
        instance: str,
        models: tuple[str, ...],
        adapters: frozenset[str] | None,
    ) -> None:
        self.health(
            address=address,
            answer=answer,
            running=0,
            instance=instance,
            models=models,
            adapters=adapters,
        )

    @rule(address=addresses, failure=st.sampled_from(PollFailure))
    def poll_fails(self, address: str, failure: PollFailure) -> None:
        engine = self.engines.get(address)
        if engine is None:
            return
        self.fail_poll(engine, failure)

    def fail_poll(self, engine: Engine, failure: PollFailure) -> None:
        error = f"{failure.value}: the poll failed"
        now = self.tick()
        delay = self.registry.on_poll_failed(engine.address, now, error, failure)
        self.record_time(now)
        assert delay == min(0.5 * 2**engine.failures, 4.0), engine
        engine.failures += 1
        engine.load = LoadSnapshot()
        if engine.state is not EngineState.INCOMPATIBLE:
            if engine.state not in POLL_FAILED:
                engine.connection_lost = False
            self.take(engine, failure.state, now)
        engine.connection_lost |= failure is PollFailure.CONNECTION_LOST
        engine.error = error
        engine.need_identity = engine.poll_failed = True
        self.decide_cap()

    @rule(
        address=addresses,
        drained=st.none() | st.sampled_from(INSTANCES + ADDRESSES),
        failure=st.none() | st.sampled_from(PollFailure),
    )
    def leaves_ready_after_a_shared_drain(
        self, address: str, drained: str | None, failure: PollFailure | None
    ) -> None:
        """`Fleet._excuse_shared_drain`: before an engine leaves ready (a health answer
        NOT_READY, or a poll that fails), the shared membership says which process was drained
        through another replica (None: this one); that one's leave is no flap."""
        engine = self.engines.get(address)
        if engine is None or (failure is None and engine.need_identity):
            return
        if drained is None:
            drained = engine.engine_id
        state = EngineState.NOT_READY if failure is None else failure.state
        assert self.registry.would_flap(address, state) == engine.leaves_ready(state)
        if engine.leaves_ready(state):
            ours = engine.engine_id == drained
            assert self.registry.drained_elsewhere(address, drained) == ours
            engine.drain = engine.drain or ours
        if failure is None:
            self.take_health(engine, state, "")
        else:
            self.fail_poll(engine, failure)

    # ---- what operators and the gateway do ----

    @rule(key=keys)
    def request_drain(self, key: str) -> None:
        engine = self.resolve(key)
        if engine is None:
            with pytest.raises(UnknownEngineError):
                self.registry.request_drain(key)
            return
        assert self.registry.request_drain(key).address == engine.address
        engine.drain = True
        if engine.state in SAYS_READY:  # a drain outranks an ejection and a hold-down
            self.keep_shown(engine)
            engine.state = EngineState.DRAINING  # out of routing before the engine answers
            self.decide_cap()

    @rule(address=addresses)
    def withdraw_drain(self, address: str) -> None:
        """The engine refused the drain: its next health answer decides."""
        self.registry.withdraw_drain(address)
        if address in self.engines:
            self.engines[address].drain = False

    @rule(key=keys, cordoned=st.booleans())
    def set_cordoned(self, key: str, cordoned: bool) -> None:
        engine = self.resolve(key)
        if engine is None:
            with pytest.raises(UnknownEngineError):
                self.registry.set_cordoned(key, cordoned)
            return
        assert self.registry.set_cordoned(key, cordoned).address == engine.address
        if cordoned:
            self.keep_shown(engine)
        elif engine.state in SAYS_READY:
            engine.error = ""  # back in the cap's decision: no words kept
        engine.cordoned = cordoned
        self.decide_cap()

    @rule(address=addresses, adapters=held_loras, conflicts=lora_sets)
    def list_loras(
        self, address: str, adapters: frozenset[str] | None, conflicts: frozenset[str]
    ) -> None:
        """The gateway's ListLoras (or the fleet's refresh): what the engine holds."""
        conflicts = conflicts & adapters if adapters is not None else frozenset()
        self.registry.on_loras(address, adapters, conflicts)
        if address in self.engines:
            self.engines[address].loras = adapters
            self.engines[address].conflicts = conflicts

    @rule(address=addresses, lora=st.sampled_from(LORAS))
    def lora_loaded(self, address: str, lora: str) -> None:
        self.registry.on_lora_loaded(address, lora)
        engine = self.engines.get(address)
        if engine is not None:
            engine.loras = (engine.loras or frozenset()) | {lora}

    @rule(address=addresses, lora=st.sampled_from(LORAS))
    def lora_unloaded(self, address: str, lora: str) -> None:
        self.registry.on_lora_unloaded(address, lora)
        engine = self.engines.get(address)
        if engine is not None and engine.loras is not None:
            engine.loras -= {lora}
            engine.conflicts -= {lora}

    # ---- what the gateway reports of requests, and time ----

    @rule(key=st.sampled_from(ADDRESSES * 2 + INSTANCES), times=st.integers(1, 3))
    def requests_fail(self, key: str, times: int) -> None:
        for n in range(times):
            self.request_failed(key, n)

    def request_failed(self, key: str, n: int) -> None:
        """A request the engine failed by a fault of its own: counted only while its health
        says ready; after `after_failures` in a row it is ejected (unless that would hold out
        more than half of the engines taking traffic), for twice as long at each ejection in
        a row, and at its next failure once back (its probation)."""
        engine = self.resolve(key)
        now = self.tick()
        error = f"INTERNAL: request {n} failed"
        got = self.registry.on_request_failed(key, now, error)
        if engine is None or engine.state not in SERVING:
            assert got is None, engine
            return
        self.record_time(now)
        engine.request_failures += 1
        if engine.request_failures < EJECTION.after_failures:
            assert got is None, engine
            return
        if self.ejected() + 1 > len(self.in_rotation()) // 2:
            self.routed_by_cap[CAPPED_EJECTION] += 1
            assert got is None, engine
            return
        duration = min(EJECTION.initial_s * 2**engine.ejections, EJECTION.max_s)
        assert got == duration, engine
        engine.ejections += 1
        engine.ejected_until = now + duration
        engine.ejection_s = duration
        engine.ejected_for = f"{engine.request_failures} requests failed in a row (last: {error})"
        engine.ready_as, engine.state = engine.state, EngineState.EJECTED
        self.decide_cap()

    @rule(key=keys)
    def request_served(self, key: str) -> None:
        """A request served clears the count, but not while ejected (a stream begun before
        proves nothing of what failed since)."""
        engine = self.resolve(key)
        self.registry.on_request_served(key)
        if engine is not None and engine.state is not EngineState.EJECTED:
            engine.request_failures = engine.ejections = 0

    @rule(seconds=st.sampled_from((5.0, 15.0, 41.0)))
    def wait(self, seconds: float) -> None:
        """Time passes: an ejection or a hold-down's ready time runs out, flaps leave their
        window, a removed engine's record is forgotten."""
        self.now += seconds

    # ---- every query agrees with the model ----

    @invariant()
    def records_agree(self) -> None:
        records = self.registry.records()
        assert [r.address for r in records] == sorted(self.engines)
        assert len(self.registry) == len(self.engines)
        for record in records:
            engine = self.engines[record.address]
            what = f"{record.address} ({engine})"
            assert record.identity == engine.identity, what
            assert record.state is engine.state, what
            assert record.cordoned == engine.cordoned, what
            assert record.drain_requested == engine.drain, what
            assert record.lora_adapters == engine.loras, what
            assert record.num_flaps == engine.flaps, what
            assert record.request_failures == engine.request_failures, what
            assert record.engine_id == engine.engine_id, what
            assert record.routable == engine.routable(), what
            assert record.availability == engine.availability, what
            assert self.registry.error_of(record) == self.shown(engine, self.recorded), what
            assert self.registry.error_of(record, self.now) == self.shown(engine, self.now), what
            assert record.load == engine.load, what
            for lora in LORAS:
                assert record.holds_lora(lora) == (engine.holds(lora)), what
            for state in EngineState:
                assert self.registry.would_flap(record.address, state) == engine.leaves_ready(
                    state
                ), f"{what} taking {state}"

    @invariant()
    def the_cap_agrees(self) -> None:
        """Ejected and held-down engines held out are never more than half of those taking
        traffic, whatever left traffic since they were held out (docs: "at most half ... are
        ejected at once"): those left routable are never all held out."""
        held_out = sum(
            e.state in (EngineState.EJECTED, EngineState.HELD_DOWN) and not e.cordoned
            for e in self.engines.values()
        )
        assert held_out <= len(self.in_rotation()) // 2
        assert self.registry.routed_by_cap == self.routed_by_cap

    @invariant()
    def lookups_agree(self) -> None:
        for key in ADDRESSES + INSTANCES:
            record = self.registry.by_engine_id(key)
            engine = self.resolve(key)
            found = None if record is None else record.address
            assert found == (None if engine is None else engine.address), key

    @invariant()
    def routing_agrees(self) -> None:
        routing = self.routing()
        for (model, lora, cordoned), got in routing.items():
            assert got == self.expected_routable(model, lora, cordoned), (model, lora, cordoned)
        for model in QUERIED_MODELS:
            assert self.registry.any_routable(model) == bool(routing[(model, "", False)])
            for lora in ("", *LORAS):
                out = self.registry.out_of_routing(model, None, lora, generating=False)
                assert [r.address for r in out] == self.expected_out_of_routing(model, lora)
        # Whenever routing changed, those who asked to be told were.
        if routing != self.routing_seen:
            assert self.changes > self.changes_seen, f"{self.routing_seen} -> {routing}"
        self.routing_seen = routing
        self.changes_seen = self.changes

    @invariant()
    def models_agree(self) -> None:
        for model in QUERIED_MODELS:
            serving = self.expected_may_serve(model)
            if model is not None:
                assert self.registry.may_serve(model) == bool(serving), model
                states = ", ".join(
                    f"{self.engines[a].engine_id} {self.engines[a].availability}" for a in serving
                )
                assert self.registry.engine_states(model) == (states or "none serves it")
            assert [r.address for r in self.registry.may_serve_records(model)] == serving
        defaults = self.expected_base_models()
        assert self.registry.base_models() == defaults
        if len(defaults) > 1:
            with pytest.raises(ModelRequiredError):
                self.registry.default_model()
        else:
            assert self.registry.default_model() == next(iter(defaults), None)


RegistryMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRegistryModel = RegistryMachine.TestCase
