"""The fleet's LoRA intent (`controller.lora_intent.LoraIntent`) against a naive model of the
rules docs/controller.md gives for it ("The fleet's LoRA adapters", "Several controller
replicas"), driven by a hypothesis state machine the way `controller.fleet` and
`controller.gateway` drive it: admin `lora load` / `lora unload` fan-outs (fleet-wide, for a
model, or on one engine; refused on a conflict before any engine is asked; remembered once an
engine took the load, forgotten whatever the engines answer the unload), engines joining,
leaving, restarted and read anew (ListLoras: what their process holds), their adapters restored
(`wanted_on`) and their unanswered unloads re-applied at a health poll (`unloads_due`), adapters
loaded or unloaded on an engine behind the controller's back, and a restarted controller taking
the intent back from its engines (`found_on`).

Small alphabets: 3 engines serving one of 2 base models (or no LoRA), 2 adapter names, each
with 2 ids and 2 paths (one path also spelled another way, which is the same adapter). Every
query is checked against the model after each step: what each engine is to be given back and
in which order, what conflicts with the fleet's adapters (a load refused, an engine holding
the name not routed to for it), which model a name is held for, what is named again at a
restore, which unloads are still due where, and what another controller replica adopting the
shared intent would want on each engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from controller.lora_intent import LoraIntent, LoraSpec

ADDRESSES = ("a:1", "b:1", "c:1")
MODELS = ("m1", "m2")
NAMES = ("x", "y")
SPECS = tuple(
    LoraSpec(lora_id, name, path)
    for name in NAMES
    for lora_id in (1, 2)
    for path in (f"/ad/{name}1", f"/ad/{name}2")
)
# The same adapter as SPECS[0], its path spelled another way.
SPELLED = (LoraSpec(1, "x", "/ad/./x1/"),)

addresses = st.sampled_from(ADDRESSES)
specs = st.sampled_from(SPECS + SPELLED)
names = st.sampled_from(NAMES)
targets = st.none() | addresses  # None: the whole fleet
models = st.sampled_from(MODELS)
answering = st.frozensets(addresses)
holdings = st.dictionaries(names, specs).map(
    lambda held: {name: spec for name, spec in held.items() if spec.lora_name == name}
)


@dataclass
class Engine:
    """An engine at one address as the fleet sees it: whether it is registered, the base
    model it serves, whether it serves LoRA, and what its process holds now."""

    present: bool = False
    model: str = "m1"
    lora: bool = True
    holds: dict[str, LoraSpec] = field(default_factory=dict)

    def held(self) -> list[LoraSpec] | None:
        return list(self.holds.values()) if self.lora else None


@dataclass
class Entry:
    spec: LoraSpec
    model: str | None
    seq: int  # when it was first loaded: restores go in that order


@dataclass
class Unload:
    scopes: set[str | None]  # None: the whole fleet; an address: that engine (`--engine`)
    pending: set[str]  # the engines it was for that may still hold the adapter


@dataclass
class Found:
    waiting: set[str]  # engines known but not read when it was first found
    model: str | None  # the base model of the engine it was first found on


@dataclass
class Model:
    """The documented rules, naively."""

    fleet: dict[str, Entry] = field(default_factory=dict)  # fleet-wide loads
    own: dict[tuple[str, str], Entry] = field(default_factory=dict)  # one engine's loads
    off: dict[str, set[str]] = field(default_factory=dict)  # kept off a fleet-wide load
    unloads: dict[str, Unload] = field(default_factory=dict)
    found: dict[str, Found] = field(default_factory=dict)
    read: dict[str, tuple[bool, str | None]] = field(default_factory=dict)  # lora, model
    seq: int = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def known(self, name: str) -> LoraSpec | None:
        if name in self.fleet:
            return self.fleet[name].spec
        return next((e.spec for (n, _), e in self.own.items() if n == name), None)

    # ---- queries ----

    def conflict(self, spec: LoraSpec) -> LoraSpec | None:
        known = self.known(spec.lora_name)
        return known if known is not None and known != spec else None

    def model_conflict(
        self, name: str, model: str | None, base_model: Callable[[str], str | None]
    ) -> str | None:
        """One name is one adapter, trained for one base model: a fleet-wide load is for its
        model, a load on one engine (or one found there) for the model it named, else that
        engine's."""
        fleet = self.fleet.get(name)
        own = sorted(
            (e.seq, e.model or base_model(a)) for (n, a), e in self.own.items() if n == name
        )
        held_for = [fleet.model if fleet is not None else None] + [m for _, m in own]
        return next((m for m in held_for if m is not None and m != model), None)

    def wanted_on(self, address: str, models: tuple[str, ...]) -> list[LoraSpec]:
        first: dict[str, tuple[int, LoraSpec]] = {}
        for name in NAMES:
            applies = []
            if (name, address) in self.own:
                applies.append(self.own[(name, address)])
            entry = self.fleet.get(name)
            if (
                entry is not None
                and address not in self.off.get(name, set())
                and (entry.model is None or entry.model in models)
            ):
                applies.append(entry)
            if applies:
                best = min(applies, key=lambda e: e.seq)
                first[name] = (best.seq, best.spec)
        return [spec for _, spec in sorted(first.values(), key=lambda p: p[0])]

    def model_of(self, name: str, address: str) -> str | None:
        own = self.own.get((name, address))
        if own is not None and own.model is not None:
            return own.model
        entry = self.fleet.get(name)
        return entry.model if entry is not None else None

    def unconfirmed_on(self, address: str) -> set[str]:
        return {n for n, u in self.unloads.items() if address in u.pending}

    def unloaded_there(self, name: str, address: str) -> bool:
        """An engine found holding it there gives it back to no intent."""
        unload = self.unloads.get(name)
        return address in self.off.get(name, set()) or (
            unload is not None and bool({None, address} & unload.scopes)
        )

    # ---- changes ----

    def _confirm(self, name: str, address: str) -> None:
        unload = self.unloads.get(name)
        if unload is not None:
            unload.pending.discard(address)
            if not unload.pending:
                del self.unloads[name]

    def loaded(self, spec: LoraSpec, address: str | None, model: str | None) -> None:
        name = spec.lora_name
        self.found.pop(name, None)
        if address is None:
            old = self.fleet.get(name)
            self.fleet[name] = Entry(spec, model, old.seq if old else self._next())
            self.unloads.pop(name, None)
            self.off.pop(name, None)
        else:
            old = self.own.get((name, address))
            self.own[(name, address)] = Entry(spec, model, old.seq if old else self._next())
            self.off.get(name, set()).discard(address)
            unload = self.unloads.get(name)
            if unload is not None:
                unload.scopes.discard(address)
                self._confirm(name, address)

    def unloaded(self, name: str, address: str | None, fleet: list[str]) -> None:
        self.found.pop(name, None)
        if address is None:
            self.fleet.pop(name, None)
            self.off.pop(name, None)
            for key in [k for k in self.own if k[0] == name]:
                del self.own[key]
            pending = {a for a in fleet if self.read.get(a, (True, None))[0]}
            self.unloads[name] = Unload({None}, pending)
        else:
            self.own.pop((name, address), None)
            if name in self.fleet:
                self.off.setdefault(name, set()).add(address)
            unload = self.unloads.setdefault(name, Unload(set(), set()))
            unload.scopes.add(address)
            unload.pending.add(address)
        if not self.unloads[name].pending:
            del self.unloads[name]

    def unload_confirmed(self, name: str, address: str) -> None:
        self._confirm(name, address)

    def unloads_due(self, address: str, held: set[str]) -> set[str]:
        for name in self.unconfirmed_on(address) - held:
            self._confirm(name, address)
        return self.unconfirmed_on(address)

    def _make_fleet_wide(self, name: str) -> None:
        found = self.found.pop(name)
        holders = [(k, e) for k, e in self.own.items() if k[0] == name]
        if not holders:  # every holder left meanwhile: loaded nowhere
            return
        for key, _ in holders:
            del self.own[key]
        # An engine it was unloaded from through this controller (not answered yet) stays
        # without it: it was not loaded again through the controller.
        unload = self.unloads.get(name)
        if unload is not None:
            self.off.setdefault(name, set()).update(a for a in unload.scopes if a is not None)
        first = min(e.seq for _, e in holders)
        self.fleet[name] = Entry(holders[0][1].spec, found.model, first)

    def found_on(
        self, address: str, held: list[LoraSpec] | None, fleet: list[str], model: str | None
    ) -> list[tuple[LoraSpec, LoraSpec]]:
        for name in [n for n, f in self.found.items() if address in f.waiting]:
            found = self.found[name]
            found.waiting.discard(address)
            peer = found.model is None or model is None or found.model == model
            holds = held is not None and self.known(name) in held
            if (peer and held is not None and not holds) or (not peer and holds):
                # Read without it, or holding it for another model: its holders' own.
                del self.found[name]
            elif not found.waiting:
                self._make_fleet_wide(name)
        self.unloads_due(address, {s.lora_name for s in held or ()})
        others_read = any(
            lora and (model is None or other_model is None or other_model == model)
            for other, (lora, other_model) in self.read.items()
            if other != address
        )
        self.read[address] = (held is not None, model)
        conflicts: list[tuple[LoraSpec, LoraSpec]] = []
        for spec in held or ():
            name = spec.lora_name
            if self.unloaded_there(name, address):
                continue
            known = self.conflict(spec)
            if known is not None:
                conflicts.append((spec, known))
                continue
            first_found = self.known(name) is None
            if name not in self.fleet and (name, address) not in self.own:
                self.own[(name, address)] = Entry(spec, None, self._next())
            if first_found and not others_read:
                self.found[name] = Found(set(fleet) - self.read.keys(), model)
                if not self.found[name].waiting:
                    self._make_fleet_wide(name)
        return conflicts

    def forget_engine(self, address: str) -> None:
        for key in [k for k in self.own if k[1] == address]:
            del self.own[key]
        for off in self.off.values():
            off.discard(address)
        for name in list(self.unloads):
            self.unloads[name].scopes.discard(address)
            self._confirm(name, address)
        self.read.pop(address, None)
        for name in [n for n, f in self.found.items() if address in f.waiting]:
            self.found[name].waiting.discard(address)
            if not self.found[name].waiting:
                self._make_fleet_wide(name)


class LoraIntentMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.intent = LoraIntent()
        self.model = Model()
        self.engines = {address: Engine() for address in ADDRESSES}
        self.conflicts_seen: list[tuple[LoraSpec, LoraSpec]] = []

    def base_model(self, address: str) -> str | None:
        """The base model the controller read the engine serving (None: not read)."""
        engine = self.engines[address]
        return engine.model if engine.present and address in self.model.read else None

    def fleet(self) -> list[str]:
        return [a for a, e in self.engines.items() if e.present]

    def lora_engines(self, model: str | None) -> list[str]:
        return [
            a
            for a, e in self.engines.items()
            if e.present and e.lora and (model is None or e.model == model)
        ]

    # ---- the fleet's engines ----

    def absent(self) -> list[str]:
        return [a for a, e in self.engines.items() if not e.present]

    @precondition(lambda self: self.absent())
    @rule(data=st.data(), model=models, lora=st.booleans(), held=holdings)
    def join(self, data: st.DataObject, model: str, lora: bool, held: dict[str, LoraSpec]) -> None:
        """An engine registered (or scaled up), holding whatever its process holds; read
        later."""
        address = data.draw(st.sampled_from(self.absent()))
        self.engines[address] = Engine(True, model, lora, held if lora else {})

    @precondition(lambda self: self.fleet())
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        address = data.draw(st.sampled_from(self.fleet()))
        self.engines[address].present = False
        self.intent.forget_engine(address)
        self.model.forget_engine(address)

    @precondition(lambda self: self.fleet())
    @rule(data=st.data(), restarted=st.booleans())
    def read(self, data: st.DataObject, restarted: bool) -> None:
        """A process of the engine met anew (first contact, back after an outage, a
        restart: then it holds nothing) has its adapters listed."""
        address = data.draw(st.sampled_from(self.fleet()))
        engine = self.engines[address]
        if restarted:
            engine.holds = {}
        fleet = self.fleet()
        got = self.intent.found_on(address, engine.held(), fleet, engine.model)
        expected = self.model.found_on(address, engine.held(), fleet, engine.model)
        assert got == expected, (address, engine)

    @rule(address=addresses, upto=st.integers(0, 2))
    def restore(self, address: str, upto: int) -> None:
        """The fleet loads on a read engine what the intent wants there and it lacks, in
        order (a refusal, out of slots, ends it early)."""
        engine = self.engines[address]
        if not engine.present or not engine.lora or address not in self.model.read:
            return
        missing = [
            spec
            for spec in self.intent.wanted_on(address, (engine.model,))
            if spec.lora_name not in engine.holds
        ]
        for spec in missing[:upto]:
            engine.holds[spec.lora_name] = spec

    @rule(address=addresses, name=names, spec=st.none() | specs)
    def behind_the_back(self, address: str, name: str, spec: LoraSpec | None) -> None:
        """An adapter loaded or unloaded on the engine directly."""
        engine = self.engines[address]
        if not engine.lora:
            return
        if spec is None:
            engine.holds.pop(name, None)
        elif name not in engine.holds and spec.lora_name == name:
            engine.holds[name] = spec

    @rule(address=addresses, answers=st.booleans())
    def health_poll(self, address: str, answers: bool) -> None:
        """A health poll the same process answers: the unloads it did not answer are due
        there, and re-applied (if it answers them)."""
        engine = self.engines[address]
        if not engine.present or address not in self.model.read:
            return
        held = set(engine.holds)
        due = self.intent.unloads_due(address, held)
        assert set(due) == self.model.unloads_due(address, held), address
        if answers:
            for name in due:
                engine.holds.pop(name, None)
                self.intent.unload_confirmed(name, address)
                self.model.unload_confirmed(name, address)

    @rule()
    def controller_restarted(self) -> None:
        """A controller killed and started again: its intent is rebuilt from its engines as
        it reads them."""
        self.intent = LoraIntent()
        self.model = Model()

    # ---- the admin API (controller.gateway) ----

    @rule(spec=specs, on=targets, named=st.none() | models, answers=answering)
    def load(
        self, spec: LoraSpec, on: str | None, named: str | None, answers: frozenset[str]
    ) -> None:
        target_model: str | None
        if on is not None:
            engine = self.engines[on]
            if not engine.present or not engine.lora or on not in self.model.read:
                return  # refused: no such engine, or it serves no LoRA (as read)
            if named is not None and named != engine.model:
                return  # INVALID_ARGUMENT: the engine does not serve that model
            model, target_model, asked = named, named or engine.model, [on]
        else:
            model = named
            if named is None:
                served = {
                    self.engines[a].model for a in self.lora_engines(None) if a in self.model.read
                }
                if len(served) > 1:
                    return  # INVALID_ARGUMENT: name a model
                model = next(iter(served), None)
            target_model = model
            asked = [a for a in self.lora_engines(model) if a in self.model.read]
        known = self.intent.conflict(spec)
        assert known == self.model.conflict(spec), spec
        if known is not None:
            return  # ALREADY_EXISTS before any engine is asked
        name = spec.lora_name
        known_model = self.intent.model_conflict(name, target_model, self.base_model)
        assert known_model == self.model.model_conflict(name, target_model, self.base_model)
        if known_model is not None:
            return  # ALREADY_EXISTS: loaded for another model
        for address in asked:
            engine = self.engines[address]
            held = engine.holds.get(spec.lora_name)
            if address in answers and (held is None or held == spec):
                engine.holds[spec.lora_name] = spec
                self.intent.loaded(spec, on, model)
                self.model.loaded(spec, on, model)

    @rule(name=names, on=targets, answers=answering)
    def unload(self, name: str, on: str | None, answers: frozenset[str]) -> None:
        if on is not None and not self.engines[on].present:
            return  # no such engine
        fleet = self.fleet()
        self.intent.unloaded(name, on, fleet)
        self.model.unloaded(name, on, fleet)
        asked = [on] if on is not None else self.lora_engines(None)
        for address in asked:
            if address in answers:  # unloaded, or NOT_FOUND: either way it holds none
                self.engines[address].holds.pop(name, None)
                self.intent.unload_confirmed(name, address)
                self.model.unload_confirmed(name, address)

    # ---- every query agrees ----

    @invariant()
    def restores_agree(self) -> None:
        for address in ADDRESSES:
            for served in ((), ("m1",), ("m2",), ("m1", "m2")):
                got = self.intent.wanted_on(address, served)
                assert got == self.model.wanted_on(address, served), (address, served)
                for name in NAMES:  # (the one adapter the prefill wait asks of)
                    wanted = any(spec.lora_name == name for spec in got)
                    assert self.intent.wants(name, address, served) == wanted, (name, address)
            for name in NAMES:
                got_model = self.intent.model_of(name, address)
                assert got_model == self.model.model_of(name, address), (name, address)

    @invariant()
    def conflicts_agree(self) -> None:
        for spec in SPECS + SPELLED:
            assert self.intent.conflict(spec) == self.model.conflict(spec), spec
        for name in NAMES:
            for model in (None, *MODELS):
                got = self.intent.model_conflict(name, model, self.base_model)
                expected = self.model.model_conflict(name, model, self.base_model)
                assert got == expected, (name, model)

    @invariant()
    def unloads_agree(self) -> None:
        for address in ADDRESSES:
            got = set(self.intent.unconfirmed_on(address))
            assert got == self.model.unconfirmed_on(address), address

    @invariant()
    def another_replica_adopting_it_agrees(self) -> None:
        """A replica adopting what this one shares for each name, name by name in either
        order, wants the same adapters on each engine in the same order (the order they were
        loaded in), for the same models."""
        for names in (NAMES, NAMES[::-1]):
            other = LoraIntent()
            for name in names:
                other.adopt(name, self.intent.shared(name))
            for address in ADDRESSES:
                for served in (("m1",), ("m2",)):
                    got = other.wanted_on(address, served)
                    assert got == self.model.wanted_on(address, served), (names, address)
                for name in NAMES:
                    assert other.model_of(name, address) == self.model.model_of(name, address)


LoraIntentMachine.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLoraIntentModel = LoraIntentMachine.TestCase
