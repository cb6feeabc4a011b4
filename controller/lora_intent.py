"""The fleet's LoRA intent: which adapters the operator loaded through the controller, on the
whole fleet or on one engine (`kvplane-engine` metadata, `lora load --engine`). Pure (no I/O).

The adapters an engine holds are its process's: a restarted engine, an engine the planner
scales up or one registered at run time has none. What was loaded through the controller is
the operator's intent for the fleet (as KServe and llm-d reconcile theirs), so the fleet
service loads it on an engine whose new process it meets (`wanted_on`) before routing
requests naming those adapters there. An unload forgets it: fleet-wide, everywhere; with
`--engine E`, on E only (a fleet-wide adapter then stays off E).

One name is one adapter across the fleet (the router sends a request naming it to any engine
holding it): a load under a remembered name with another id or path is refused
(`conflict`) before any engine is asked, where engines would each keep whichever came first.

Kept in memory: a restarted controller remembers nothing (the engines keep their adapters,
and it routes to them as it lists them), until the next load through it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """An adapter as LoadLora names it."""

    lora_id: int
    lora_name: str
    source_path: str

    def __str__(self) -> str:
        return f"{self.lora_name!r} (id {self.lora_id}, {self.source_path})"


@dataclass(slots=True)
class LoraIntent:
    # (name, engine address; None: every engine) -> adapter, in the order they were loaded:
    # an engine that cannot take them all (out of LoRA slots) gets back those loaded first,
    # as it held them before it restarted.
    loads: dict[tuple[str, str | None], LoraSpec] = field(default_factory=dict)
    # name -> addresses a fleet-wide adapter was unloaded from with `--engine`.
    excluded: dict[str, set[str]] = field(default_factory=dict)

    def conflict(self, spec: LoraSpec) -> LoraSpec | None:
        """The remembered adapter that has `spec`'s name but another id or path, if any."""
        for known in self.loads.values():
            if known.lora_name == spec.lora_name and known != spec:
                return known
        return None

    def loaded(self, spec: LoraSpec, address: str | None) -> None:
        """`spec` was loaded on the fleet (`address` None) or on that engine alone."""
        self.loads[(spec.lora_name, address)] = spec
        if address is None:
            self.excluded.pop(spec.lora_name, None)
        else:
            self.excluded.get(spec.lora_name, set()).discard(address)

    def unloaded(self, lora_name: str, address: str | None) -> None:
        """`lora_name` was unloaded from the fleet (`address` None) or from that engine."""
        if address is None:
            self.excluded.pop(lora_name, None)
            for key in [k for k in self.loads if k[0] == lora_name]:
                del self.loads[key]
            return
        self.loads.pop((lora_name, address), None)
        if (lora_name, None) in self.loads:
            self.excluded.setdefault(lora_name, set()).add(address)

    def forget_engine(self, address: str) -> None:
        """The engine left the fleet: what was loaded on it alone goes with it."""
        for key in [k for k in self.loads if k[1] == address]:
            del self.loads[key]
        for addresses in self.excluded.values():
            addresses.discard(address)

    def wanted_on(self, address: str) -> list[LoraSpec]:
        """The adapters the engine at `address` should hold, in the order they were loaded."""
        wanted: dict[str, LoraSpec] = {}
        for (name, on), spec in self.loads.items():
            if on == address or (on is None and address not in self.excluded.get(name, ())):
                wanted.setdefault(name, spec)
        return list(wanted.values())
