"""The fleet's LoRA intent: which adapters the fleet should hold, on the whole fleet or on one
engine, as the operator loaded them through the controller (`kvplane-engine` metadata, `lora
load --engine`) or as the controller found them on its engines. Pure (no I/O).

The adapters an engine holds are its process's: a restarted engine, an engine the planner
scales up or one registered at run time has none. What was loaded through the controller is
the operator's intent for the fleet (as KServe and llm-d reconcile theirs), so the fleet
service loads it on an engine whose new process it meets (`wanted_on`) before routing
requests naming those adapters there. An unload forgets it: fleet-wide, everywhere; with
`--engine E`, on E only (a fleet-wide adapter then stays off E).

An adapter is trained for one base model: a fleet-wide load is for the engines serving one
model (`lora load --model M`, `kvplane-model` metadata; the gateway takes the one base model
the LoRA-capable engines serve when none is named, and refuses a fleet whose engines serve
several), and the intent remembers it (`models`), so that an engine joining is given only the
adapters of a model it serves. A load on one engine may name a model too (a controller fronted
as an engine serves several, and refuses a load naming none): remembered with it
(`engine_models`), and named again when it is restored there. A load of a name held for
another model is refused (`model_conflict`): a one-engine load (or an adapter found there)
holds it for the model it named, else for that engine's base model. An adapter found on every
engine (below) has no model: the engines' ListLoras does not say which base model an adapter
was loaded for, so an adapter found is taken for the base model (first listed) of the engine
it was found on: it is the fleet's, for that model, once every engine of that model the
controller knew holds it (engines of other models, not given it, do not count; one of them
holding it too makes it its holders' own: one name found for two models is held for each, and
a load of it for either is refused until it is unloaded from one model's engines).

The intent lives in the controller's memory, and the controller keeps no state of its own
(ARCHITECTURE.md): a restarted controller rebuilds it from the engines. Controller replicas
on a Redis index share what their LoRA calls leave in it for each adapter name (`shared`,
`adopt`; controller.membership carries it), so that an adapter unloaded through one is not
restored by another. Each engine process
it meets (first contact, registration, a return, a restart) tells what it holds (`found_on`,
from ListLoras): an adapter held by every engine the controller knew when it first found
it is the fleet's (so an engine registered or scaled up later gets it too), one some of them
were read without is the holders' own. An engine restarted while no controller watched is
read without its adapters, as one never given them: they stay its peers' own. What this
controller unloaded stays unloaded while an engine may still hold it: an engine away during
the unload that comes back holding the adapter does not bring it back into the intent, and
the fleet service unloads it there (`unloads_due`), as it restores loads. The
unload is remembered (`unloaded_from`) until every engine it was for has answered it, been
read without the adapter or left the fleet (`unconfirmed`): a fleet that loads and unloads
ever new names (adapters per tenant, per version) would otherwise remember every name it
ever unloaded.

One name is one adapter across the fleet (the router sends a request naming it to any engine
holding it): a load under a known name with another id or path is refused (`conflict`)
before any engine is asked, where engines would each keep whichever came first; an engine
found holding another adapter under a known name is reported (`found_on`), the one known
first is kept."""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """An adapter as LoadLora names it, its path as a directory: `/a/x/` and `/a/./x` are
    `/a/x`, as engines compare them (the same adapter spelled two ways is neither a conflict
    nor two adapters). Lexically: symlinks are not followed."""

    lora_id: int
    lora_name: str
    source_path: str

    def __post_init__(self) -> None:
        if self.source_path:  # an empty path stays empty: the engine names that refusal
            object.__setattr__(self, "source_path", os.path.normpath(self.source_path))

    def __str__(self) -> str:
        return f"{self.lora_name!r} (id {self.lora_id}, {self.source_path})"


@dataclass(frozen=True, slots=True)
class SharedLora:
    """What an intent holds for one adapter name, as the controller replicas share it
    (`LoraIntent.shared`, `LoraIntent.adopt`): the adapter, where it is loaded (an engine's
    address; None: the fleet) with the model each load is for (None: not named), in the
    order they were loaded, the engines a fleet-wide load is kept off (unloaded there), and
    each load's place in the fleet's loading order (`LoraIntent.seqs`; absent: 0, before
    any, as a replica of an older release shared it)."""

    spec: LoraSpec
    on: dict[str | None, str | None]
    off: frozenset[str] = frozenset()
    seqs: dict[str | None, int] = field(default_factory=dict)


@dataclass(slots=True)
class LoraIntent:
    # (name, engine address; None: every engine) -> adapter, in the order they were loaded:
    # an engine that cannot take them all (out of LoRA slots) gets back those loaded first,
    # as it held them before it restarted.
    loads: dict[tuple[str, str | None], LoraSpec] = field(default_factory=dict)
    # Each of `loads` -> its place in the fleet's loading order, shared with the other
    # controller replicas (`shared`): a replica adopting another's loads (`adopt`) keeps
    # them in the order they were loaded, whatever the order it reads them in. A Lamport
    # clock: a load is numbered above every load the intent knows of (`clock`), so a load
    # through a replica that has read another's comes after it; loads through two replicas
    # that had not read each other's come in the order of their numbers (by name where
    # those are equal), alike on every replica.
    seqs: dict[tuple[str, str | None], int] = field(default_factory=dict)
    clock: int = 0
    # name -> where it was unloaded through this controller since it was last loaded there:
    # an address (`--engine`; a fleet-wide adapter then stays off it), None (the whole
    # fleet). An engine found holding it there gives it back to no intent. Kept while
    # `unconfirmed` names an engine for it, or, for an address, while the name is loaded
    # fleet-wide (it keeps the adapter off that engine).
    unloaded_from: dict[str, set[str | None]] = field(default_factory=dict)
    # name -> the engines an unload of it was for that may still hold it: they have neither
    # answered it (unloaded, or NOT_FOUND) nor been read without it since, nor left.
    unconfirmed: dict[str, set[str]] = field(default_factory=dict)
    # name -> the engines the controller knew but had not read when it first found the
    # adapter on one: the fleet's once each of them was read holding it, the holders' own
    # as soon as one was read without it (or once the operator loads or unloads it).
    undecided: dict[str, set[str]] = field(default_factory=dict)
    # The engines `found_on` was told of -> whether they serve LoRA.
    read: dict[str, bool] = field(default_factory=dict)
    # The engines `found_on` was told of -> their base model, where one was named.
    read_models: dict[str, str] = field(default_factory=dict)
    # name (in `undecided`) -> the base model of the engine it was first found on: the
    # model it becomes the fleet's for; engines of other models do not decide it.
    undecided_models: dict[str, str] = field(default_factory=dict)
    # name -> the model a fleet-wide load of it is for: only engines serving that model
    # want it. Absent: every engine (an adapter found on every engine, whose model is not
    # known).
    models: dict[str, str] = field(default_factory=dict)
    # (name, engine address) -> the model a load of it on that engine alone was for (`lora
    # load --engine E --model M`: E a controller fronted as an engine, which serves several
    # base models and refuses a load naming none), named again when it is restored there.
    engine_models: dict[tuple[str, str], str] = field(default_factory=dict)

    def conflict(self, spec: LoraSpec) -> LoraSpec | None:
        """The remembered adapter that has `spec`'s name but another id or path, if any."""
        for known in self.loads.values():
            if known.lora_name == spec.lora_name and known != spec:
                return known
        return None

    def model_conflict(
        self,
        lora_name: str,
        model: str | None,
        base_model: Callable[[str], str | None] = lambda _: None,
    ) -> str | None:
        """A model the fleet holds `lora_name` for that is another than `model`: one name is
        one adapter, trained for one base model. A fleet-wide load is for its model; a load
        on one engine (or an adapter found there) for the model it named, else for that
        engine's base model (`base_model(address)`; None: not known, or a controller fronted
        as an engine, which serves several)."""
        held_for = [self.models.get(lora_name)] + [
            self.engine_models.get((name, address)) or base_model(address)
            for name, address in self.loads
            if name == lora_name and address is not None
        ]
        return next((m for m in held_for if m is not None and m != model), None)

    def loaded(self, spec: LoraSpec, address: str | None, model: str | None = None) -> None:
        """`spec` was loaded on the fleet (`address` None), for the engines serving `model`
        (None: every engine), or on that engine alone."""
        name = spec.lora_name
        self._put((name, address), spec)
        self._decided(name)
        if address is None:
            self.unloaded_from.pop(name, None)
            self.unconfirmed.pop(name, None)
            if model is None:
                self.models.pop(name, None)
            else:
                self.models[name] = model
        else:
            if model is None:
                self.engine_models.pop((name, address), None)
            else:
                self.engine_models[(name, address)] = model
            self.unloaded_from.get(name, set()).discard(address)
            self.unconfirmed.get(name, set()).discard(address)
            self._retire(name)

    def shared(self, lora_name: str) -> SharedLora | None:
        """What the intent holds for `lora_name`, for the other controller replicas; None when
        it is loaded nowhere."""
        spec = self._known(lora_name)
        if spec is None:
            return None
        on = {
            address: self.models.get(name)
            if address is None
            else self.engine_models.get((name, address))
            for name, address in self.loads
            if name == lora_name
        }
        off = self.unloaded_from.get(lora_name, set()) if None in on else set()
        seqs = {address: self.seqs[(lora_name, address)] for address in on}
        return SharedLora(spec, on, frozenset(a for a in off if a is not None), seqs)

    def adopt(self, lora_name: str, shared: SharedLora | None, *, ordered: bool = True) -> None:
        """Another controller replica loaded or unloaded `lora_name`: the intent holds for it
        what that replica's holds (`shared`; None: loaded nowhere). The unloads made through
        this controller that engines have not answered yet stay due (`unconfirmed`), but for
        the engines a load in `shared` is for. Its loads take their places in the loading
        order as `shared` numbers them (`seqs`), not the order they are adopted in; not
        `ordered`: they stay out of place until `order` (adopting many at once: each put
        in place would move every load held)."""
        self._decided(lora_name)
        on = shared.on if shared is not None else {}
        for key in [k for k in self.loads if k[0] == lora_name and k[1] not in on]:
            self._drop(key)
        self._forget_engine_models(lambda name, address: name == lora_name and address not in on)
        if None not in on:
            self.models.pop(lora_name, None)
        if shared is None:
            return
        clock = self.clock  # (as numbered by `shared`, not as loads here)
        moved: list[tuple[str, str | None]] = []
        for address, model in on.items():
            key = (lora_name, address)
            held = self.seqs.get(key)
            self.loaded(shared.spec, address, model)
            seq = shared.seqs.get(address, 0)
            if seq != held:
                self.seqs[key] = seq
                moved.append(key)
            clock = max(clock, seq)
        self.clock = clock
        if ordered:
            self._reorder(moved)
        if shared.off:
            self.unloaded_from.setdefault(lora_name, set()).update(shared.off)

    def model_of(self, lora_name: str, address: str) -> str | None:
        """The model to name when `lora_name` is loaded again on the engine at `address`:
        its load's there, else the fleet-wide load's (None: none named)."""
        return self.engine_models.get((lora_name, address)) or self.models.get(lora_name)

    def unloaded(self, lora_name: str, address: str | None, fleet: Collection[str]) -> None:
        """`lora_name` is being unloaded from the fleet (`address` None) or from that engine;
        `fleet`: the addresses of every engine the controller knows. Remembered until each
        engine it is for may no longer hold it (`unload_confirmed`, `found_on`,
        `forget_engine`)."""
        self._decided(lora_name)
        if address is None:
            self.unloaded_from[lora_name] = {None}
            self.models.pop(lora_name, None)
            for key in [k for k in self.loads if k[0] == lora_name]:
                self._drop(key)
            self._forget_engine_models(lambda name, _: name == lora_name)
            # Not the engines read serving no LoRA: they hold no adapter.
            self.unconfirmed[lora_name] = {a for a in fleet if self.read.get(a, True)}
        else:
            self._drop((lora_name, address))
            self.engine_models.pop((lora_name, address), None)
            self.unloaded_from.setdefault(lora_name, set()).add(address)
            self.unconfirmed.setdefault(lora_name, set()).add(address)
        self._retire(lora_name)

    def unload_confirmed(self, lora_name: str, address: str) -> None:
        """The engine at `address` answered the unload of `lora_name`: it no longer holds it
        (unloaded, or NOT_FOUND)."""
        self.unconfirmed.get(lora_name, set()).discard(address)
        self._retire(lora_name)

    def unconfirmed_on(self, address: str) -> list[str]:
        """The names unloaded through this controller that the engine at `address` may still
        hold: it has not answered their unload."""
        return [n for n, engines in self.unconfirmed.items() if address in engines]

    def unloads_due(self, address: str, held: Collection[str]) -> list[str]:
        """The engine at `address` holds the adapters named `held`: the unloads of the
        others are confirmed. Returns the names it still holds that an unload through this
        controller was for, which it did not answer (away, failing): to be unloaded there
        again."""
        for name in self.unconfirmed_on(address):
            if name not in held:  # read without it: that engine no longer holds it
                self.unload_confirmed(name, address)
        return self.unconfirmed_on(address)

    def found_on(
        self,
        address: str,
        held: Sequence[LoraSpec] | None,
        fleet: Collection[str],
        model: str | None = None,
    ) -> list[tuple[LoraSpec, LoraSpec]]:
        """A process of the engine at `address`, serving base model `model` (None: not
        known, or a controller fronted as an engine, which serves several), was met holding
        `held` (ListLoras; None: it serves no LoRA); `fleet`: the addresses of every engine
        the controller knows. Takes into the intent what it holds that the intent lacks,
        unless this controller unloaded it there or from the fleet. Returns the adapters it
        holds under a name the intent knows with another id or path, each with the known one
        (kept)."""
        for name in [n for n, waiting in self.undecided.items() if address in waiting]:
            self.undecided[name].discard(address)
            peer = _same_model(self.undecided_models.get(name), model)
            holds = held is not None and self._known(name) in held
            if (peer and held is not None and not holds) or (not peer and holds):
                # Read without it, or holding it for another model: the holders' own.
                self._decided(name)
            elif not self.undecided[name]:
                self._make_fleet_wide(name)
        self.unloads_due(address, {spec.lora_name for spec in held or ()})
        others_read = any(
            lora and _same_model(self.read_models.get(other), model)
            for other, lora in self.read.items()
            if other != address
        )
        self.read[address] = held is not None
        if model is not None:
            self.read_models[address] = model
        if held is None:
            return []
        conflicts: list[tuple[LoraSpec, LoraSpec]] = []
        for spec in held:
            name = spec.lora_name
            if {None, address} & self.unloaded_from.get(name, set()):
                continue
            known = self.conflict(spec)
            if known is not None:
                conflicts.append((spec, known))
                continue
            first_found = self._known(name) is None
            if (name, None) not in self.loads:
                self._put((name, address), spec)
            if first_found and not others_read:  # every engine read so far holds it
                self.undecided[name] = set(fleet) - self.read.keys()
                if model is not None:
                    self.undecided_models[name] = model
                if not self.undecided[name]:
                    self._make_fleet_wide(name)
        return conflicts

    def forget_engine(self, address: str) -> None:
        """The engine left the fleet: what was loaded on it alone goes with it, and so does
        what was unloaded from it alone (a fleet-wide adapter kept off it): registered
        again, it is an engine joining, given the fleet's adapters."""
        for key in [k for k in self.loads if k[1] == address]:
            self._drop(key)
        self._forget_engine_models(lambda _, on: on == address)
        for addresses in self.unloaded_from.values():
            addresses.discard(address)
        for name in [n for n, engines in self.unconfirmed.items() if address in engines]:
            self.unload_confirmed(name, address)
        for name in [n for n, addresses in self.unloaded_from.items() if not addresses]:
            del self.unloaded_from[name]
        self.read.pop(address, None)
        self.read_models.pop(address, None)
        for name in [n for n, waiting in self.undecided.items() if address in waiting]:
            self.undecided[name].discard(address)
            if not self.undecided[name]:
                self._make_fleet_wide(name)

    def wanted_on(self, address: str, models: Collection[str]) -> list[LoraSpec]:
        """The adapters the engine at `address`, serving `models`, should hold, in the order
        they were loaded: a fleet-wide adapter for a model only where that model is served."""
        wanted: dict[str, LoraSpec] = {}
        for (name, on), spec in self.loads.items():
            if on == address or (on is None and self._wanted_fleet_wide(name, address, models)):
                wanted.setdefault(name, spec)
        return list(wanted.values())

    def wants(self, lora_name: str, address: str, models: Collection[str]) -> bool:
        """Whether `wanted_on(address, models)` names `lora_name`: read from its loads alone,
        not from every load of every adapter."""
        if (lora_name, address) in self.loads:
            return True
        return (lora_name, None) in self.loads and self._wanted_fleet_wide(
            lora_name, address, models
        )

    def _wanted_fleet_wide(self, lora_name: str, address: str, models: Collection[str]) -> bool:
        """Whether a fleet-wide load of `lora_name` is for the engine at `address`, serving
        `models`: not unloaded from it, and for a model it serves (or for any)."""
        model = self.models.get(lora_name)
        return address not in self.unloaded_from.get(lora_name, ()) and (
            model is None or model in models
        )

    def _put(self, key: tuple[str, str | None], spec: LoraSpec) -> None:
        """Hold `spec` for `key`: a new load comes last in the loading order (a load held
        already keeps its place)."""
        if key not in self.loads:
            self.clock += 1
            self.seqs[key] = self.clock
        self.loads[key] = spec

    def order(self) -> None:
        """Put every load in its place in the loading order (after `adopt` not `ordered`)."""
        self.loads = dict(sorted(self.loads.items(), key=lambda item: self._place(item[0])))

    def _reorder(self, keys: list[tuple[str, str | None]]) -> None:
        """Move the loads `keys` to their places in the loading order (`_place`), the others
        being in theirs: each found by bisection, not by sorting every load again (a replica
        adopting a hash of thousands of adapters, at its start, adopts each)."""
        mine = sorted(((key, self.loads.pop(key)) for key in keys), key=lambda i: self._place(i[0]))
        last = next(reversed(self.loads), None)
        if last is None or not mine or self._place(last) <= self._place(mine[0][0]):
            self.loads.update(mine)  # (after every other: a load numbered last, the usual)
            return
        items = list(self.loads.items())
        for item in mine:
            at = bisect.bisect_right(
                items, self._place(item[0]), key=lambda other: self._place(other[0])
            )
            items.insert(at, item)
        self.loads = dict(items)

    def _drop(self, key: tuple[str, str | None]) -> None:
        self.loads.pop(key, None)
        self.seqs.pop(key, None)

    def _place(self, key: tuple[str, str | None]) -> tuple[int, str, str]:
        """Where the load `key` comes in the loading order."""
        name, address = key
        return self.seqs[key], name, address or ""

    def _forget_engine_models(self, which: Callable[[str, str], bool]) -> None:
        """Drop the models of the one-engine loads `which(name, address)` picks."""
        for key in [k for k in self.engine_models if which(*k)]:
            del self.engine_models[key]

    def _retire(self, lora_name: str) -> None:
        """Forget the unloads of `lora_name` once no engine they were for may still hold it,
        but for the engines a fleet-wide load of it is kept off (an exclusion, not a
        memory of an unload)."""
        if self.unconfirmed.get(lora_name):
            return
        self.unconfirmed.pop(lora_name, None)
        if (lora_name, None) not in self.loads or not self.unloaded_from.get(lora_name):
            self.unloaded_from.pop(lora_name, None)

    def _decided(self, lora_name: str) -> None:
        """Whether `lora_name`, found, is the fleet's or its holders' own is decided (or
        no longer asked: the operator loaded or unloaded it)."""
        self.undecided.pop(lora_name, None)
        self.undecided_models.pop(lora_name, None)

    def _known(self, lora_name: str) -> LoraSpec | None:
        return next((s for (n, _), s in self.loads.items() if n == lora_name), None)

    def _make_fleet_wide(self, lora_name: str) -> None:
        """Every engine read holds the found adapter: the fleet's, in the place of its
        holders' entries (at the first one's place in the loading order), for the model it
        was first found with. Every holder gone meanwhile (left the fleet): loaded nowhere,
        and held for no model (a load of it for another model is no conflict)."""
        model = self.undecided_models.get(lora_name)
        self._decided(lora_name)
        if self._known(lora_name) is None:
            return
        self._forget_engine_models(lambda name, _: name == lora_name)
        if model is None:
            self.models.pop(lora_name, None)
        else:
            self.models[lora_name] = model
        seqs: dict[tuple[str, str | None], int] = {}
        for (name, on), seq in self.seqs.items():
            key = (name, None if name == lora_name else on)
            seqs[key] = min(seq, seqs.get(key, seq))
        self.seqs = seqs
        self.loads = {
            (name, None if name == lora_name else on): spec
            for (name, on), spec in self.loads.items()
        }


def _same_model(first: str | None, second: str | None) -> bool:
    """Whether two engines' base models may be one (None: not known, or several)."""
    return first is None or second is None or first == second
