"""The local-process actuator (`planner.actuator.LocalProcesses`) against a naive model of the
rules docs/planner.md gives for it (the live mode's paragraph on local engines: port files,
the engines a killed planner left registered, a controller that restarts or does not answer,
removals, the close), driven by a hypothesis state machine the way `planner.live.LivePlanner`
drives it, over real `kvplane engine serve --model sim` processes and a real in-process
controller.

Rules: a start in one of two pools (refused while the controller is down: nothing spawned); a
drain of a serving engine; a removal (`stop`) of a draining one, or of one drained just now;
an engine hung (SIGSTOP) and killed by the planner (`kill`); an engine's process killed from
outside (a crash), which the next look reports; a tick's look (`adopt`, `exited`, the exited
engines stopped as the live planner does, `sync`); the controller stopped, and started again
on its port knowing no engine; a port file an operator leaves in the workdir (a stale port, or
no port at all); the planner killed (SIGKILL: its engines get their parent-death SIGTERM, the
actuator is never closed) and restarted on the workdir, its first look waited for; the planner
closed (Ctrl-C, or a second Ctrl-C: `kill_all`) and run again on the workdir. A rule is
drawn only where it applies (the model's state says so, never the processes').

The model: the planner's engines (address -> pool, port file, serving or draining, crashed,
whether the controller running now lists it), the engines left registered (a killed planner's,
or one stopped while the controller did not answer: address -> port file), the operator's
files, and the number the next engine gets (on from every engine file in the workdir). After
each rule, the invariants: the actuator runs the model's engines; each one not crashed is
alive, its port file naming its port; no process the model says is gone runs; the workdir's
port files are exactly the engines', those left registered and the operator's not taken; and,
while the controller runs, it lists exactly the engines the model says it does (the planner's
since its last registration or look, and those left registered since before it), routing
only to serving ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from kvplane.errors import KvplaneError
from planner.actuator import LocalProcesses
from tests.planner.test_planner_kubernetes_model import picks, replay_on
from tests.planner.test_planner_live import listen_at, passes
from tests.polling import eventually

pytestmark = pytest.mark.timeout(300)

# Two pools, one whose name holds the separator of a file's number (`pre-fill-3.port`).
POOLS = ("default", "pre-fill")
MAX_ENGINES = 3
SETTLE_S = 60.0
T = TypeVar("T")


@dataclass
class Engine:
    """One engine of the planner as the documented rules have it."""

    pool: str
    port_file: str  # its name in the workdir
    process: asyncio.subprocess.Process  # to check it against the model, never to drive it
    draining: bool = False
    crashed: bool = False  # its process killed from outside: the next look says so
    listed: bool = True  # the controller running now lists it


class LocalActuatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.workdir = Path(tempfile.mkdtemp(prefix="local-actuator-model-"))
        self.app: ControllerApp | None = self.run(start_controller(self.controller_config(0)))
        self.port = self.app.port
        self.actuator: LocalProcesses | None = None
        # The model.
        self.engines: dict[str, Engine] = {}  # by address
        # Engines left registered: address -> port file (the controller running now may list
        # them: `left_listed`).
        self.left: dict[str, str] = {}
        self.left_listed: set[str] = set()
        self.stale: dict[str, int] = {}  # the operator's port files naming a port, not read
        self.garbage: set[str] = set()  # the operator's port files naming no port
        self.next_number = 0
        # Every engine process the model says is gone.
        self.gone: list[asyncio.subprocess.Process] = []
        # Ports no engine gets (privileged): what the operator's stale port files name.
        self.stale_ports = itertools.count(1)

    # ---- plumbing -------------------------------------------------------------------------

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    @staticmethod
    def controller_config(port: int) -> ControllerConfig:
        health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1}
        config = {"listen": f"127.0.0.1:{port}", "health": health, "shutdown_grace_s": 0.5}
        return ControllerConfig.model_validate(config)

    def new_actuator(self) -> LocalProcesses:
        return self.run(self._new_actuator())

    async def _new_actuator(self) -> LocalProcesses:
        """Made on the machine's loop: its gRPC channels belong to the loop they are made on."""
        return LocalProcesses(
            controller=f"127.0.0.1:{self.port}",
            engine_args=("--model", "sim"),
            workdir=self.workdir,
            start_timeout_s=SETTLE_S,
        )

    def actor(self) -> LocalProcesses:
        assert self.actuator is not None
        return self.actuator

    def registered(self) -> dict[str, bool]:
        """The controller's engines: address -> whether it routes to it."""
        assert self.app is not None
        return {r.address: r.routable for r in self.app.controller.fleet.registry.records()}

    def controller_state(self, address: str) -> str | None:
        assert self.app is not None
        records = self.app.controller.fleet.registry.records()
        record = next((r for r in records if r.address == address), None)
        return None if record is None else record.state.value

    def serving(self) -> list[str]:
        return sorted(a for a, e in self.engines.items() if not e.draining and not e.crashed)

    def draining(self) -> list[str]:
        return sorted(a for a, e in self.engines.items() if e.draining and not e.crashed)

    def alive(self) -> list[str]:
        return sorted(a for a, e in self.engines.items() if not e.crashed)

    def file_number(self) -> int:
        """The number the next planner on the workdir gives its first engine: on from every
        engine's port file and log there (`POOL-N.port`, `POOL-N.log`)."""
        numbers = [-1]
        for path in self.workdir.iterdir():
            pool, _, number = path.stem.rpartition("-")
            if pool and number.isdigit() and path.suffix in (".port", ".log"):
                numbers.append(int(number))
        return max(numbers) + 1

    def gone_with(self, address: str) -> None:
        """`address`'s engine stopped: its process is waited for (its stop goes on beside)."""
        engine = self.engines.pop(address)
        self.gone.append(engine.process)
        self.run(asyncio.wait_for(engine.process.wait(), SETTLE_S))

    def removed(self, address: str, port_file: str) -> None:
        """The actuator took `address` out of the controller, or tried: without a controller,
        its port file stays, and the engine is left registered."""
        if self.app is None:
            self.left[address] = port_file

    def wait_routed(self, addresses: list[str]) -> None:
        assert self.app is not None
        fleet = self.app.controller.fleet
        registered = self.registered
        self.run(fleet.wait_for(lambda: all(registered().get(a) for a in addresses), SETTLE_S))

    # ---- the planner's tick ---------------------------------------------------------------

    def look(self) -> None:
        """A tick's look as `LivePlanner` makes it: the fleet looked at (the engines left
        registered taken out), the exited engines stopped, the fleet reconciled with the
        controller (the serving engines it does not list registered again)."""
        actuator = self.actor()
        assert self.run(actuator.adopt()) == []  # a previous planner's engines died with it
        if self.app is not None:  # out of the controller, or found not listed
            self.left.clear()
            self.left_listed.clear()
        exited = sorted(a for a, e in self.engines.items() if e.crashed)
        assert actuator.exited() == exited
        for address in exited:
            port_file = self.engines[address].port_file
            self.run(actuator.stop(address))
            self.gone_with(address)
            self.removed(address, port_file)
        self.reconcile()

    def reconcile(self) -> None:
        """The live planner's `sync` (each tick's, and at once when the controller is a new
        process): the serving engines the controller does not list registered again (not the
        drained ones: they are leaving), routed to once its health poll answers."""
        draining: dict[str, float | None] = {a: 30.0 for a in self.draining()}
        reconciled = self.run(self.actor().sync(self.serving(), draining))
        assert list(reconciled.begun) == [] and list(reconciled.withdrawn) == []
        if self.app is not None:
            for address in self.serving():
                self.engines[address].listed = True
            self.the_controller_lists_the_models_engines()  # registered again at once
            self.wait_routed(self.serving())

    # ---- rules ----------------------------------------------------------------------------

    @initialize(pools=st.lists(st.sampled_from(POOLS), min_size=1, max_size=2))
    def a_planner_with_engines(self, pools: list[str]) -> None:
        """A planner on a fresh workdir, its first look, and an engine started in each of
        `pools`."""
        self.actuator = self.new_actuator()
        self.look()
        for pool in pools:
            self.start(pool)

    @precondition(lambda self: len(self.engines) < MAX_ENGINES)
    @rule(pool=st.sampled_from(POOLS))
    def start(self, pool: str) -> None:
        """A start: refused without a controller (nothing spawned); else a new engine,
        numbered on, its port file written, routed to once the start returns."""
        actuator = self.actor()
        if self.app is None:
            with pytest.raises(KvplaneError, match=f"no engine of {pool} started: controller"):
                self.run(actuator.start(pool))
            return
        address = self.run(actuator.start(pool))
        number, self.next_number = self.next_number, self.next_number + 1
        port_file = f"{pool}-{number}.port"
        # An operator's file of that name is a stale port: written over.
        self.stale.pop(port_file, None)
        self.garbage.discard(port_file)
        # A dead engine whose port the new one got (one crashed, not reported by a look yet;
        # one left registered): settled by the start, the new one takes its place.
        if address in self.engines:
            assert self.engines[address].crashed
            self.gone_with(address)
        self.left.pop(address, None)
        self.left_listed.discard(address)
        self.engines[address] = Engine(pool, port_file, actuator._processes[address])
        assert (self.workdir / f"{pool}-{number}.log").exists()
        assert self.registered().get(address) is True

    @precondition(lambda self: self.app is not None and len(self.engines) < MAX_ENGINES)
    @precondition(lambda self: self.dead_addresses())
    @rule(pool=st.sampled_from(POOLS), pick=picks)
    def start_on_a_dead_engines_port(self, pool: str, pick: int) -> None:
        """A start whose engine gets the port of a dead engine (ports are reused; injected:
        the engine told to listen there): one of this run that crashed, which no look
        reported yet, or one left registered. The start takes the dead one out of the
        controller and drops its port file first (a crashed one is no longer run nor
        reported: the next look finds it gone), then registers the new one."""
        dead = self.dead_addresses()
        with pytest.MonkeyPatch.context() as monkeypatch:
            listen_at(monkeypatch, dead[pick % len(dead)])
            self.start(pool)

    def dead_addresses(self) -> list[str]:
        """Where dead engines were that a new engine may listen at: those crashed, and those
        left registered (not at the operator's stale ports: privileged, no engine gets them)."""
        crashed = [a for a, e in self.engines.items() if e.crashed]
        left = [a for a in self.left if int(a.rpartition(":")[2]) >= 1024]
        return sorted(crashed + left)

    @precondition(lambda self: self.serving())
    @rule(pick=picks)
    def drain(self, pick: int) -> None:
        """Out of routing at once (the controller drains it; listed as draining once its
        health says so). Without a controller, the drain is lost: no new controller lists
        a drained engine (its reconciliation registers serving ones only)."""
        if not (serving := self.serving()):
            return
        address = serving[pick % len(serving)]
        self.run(self.actor().drain(address, 30.0))
        engine = self.engines[address]
        engine.draining = True
        if self.app is not None and engine.listed:
            fleet = self.app.controller.fleet
            draining = self.controller_state
            self.run(fleet.wait_for(lambda: draining(address) == "draining", SETTLE_S))
            assert not self.registered()[address]

    @precondition(lambda self: self.serving() or self.draining())
    @rule(pick=picks)
    def stop(self, pick: int) -> None:
        """The removal of a drained engine: out of the controller, its port file dropped, its
        process stopped. None draining, one drained just now (the core drains an engine, then
        removes it once empty)."""
        if not (draining := self.draining()):
            self.drain(pick)
            if not (draining := self.draining()):
                return
        address = draining[pick % len(draining)]
        port_file = self.engines[address].port_file
        self.run(self.actor().stop(address))
        self.gone_with(address)
        self.removed(address, port_file)

    @precondition(lambda self: self.alive())
    @rule(pick=picks)
    def hung_engine_killed(self, pick: int) -> None:
        """An engine stops answering (SIGSTOP): the planner kills it (SIGKILL, out of the
        controller first)."""
        alive = self.alive()
        address = alive[pick % len(alive)]
        engine = self.engines[address]
        os.kill(engine.process.pid, signal.SIGSTOP)
        self.run(self.actor().kill(address))
        assert engine.process.returncode == -signal.SIGKILL
        self.gone_with(address)
        self.removed(address, engine.port_file)

    @precondition(lambda self: self.alive())
    @rule(pick=picks)
    def engine_crashes(self, pick: int) -> None:
        """An engine's process killed from outside: the actuator runs it still (and the
        controller lists it) until the next look reports it."""
        alive = self.alive()
        engine = self.engines[alive[pick % len(alive)]]
        os.kill(engine.process.pid, signal.SIGKILL)
        self.run(asyncio.wait_for(engine.process.wait(), SETTLE_S))
        engine.crashed = True

    @rule()
    def tick(self) -> None:
        self.look()

    @precondition(lambda self: self.app is not None)
    @rule()
    def controller_stops(self) -> None:
        assert self.app is not None
        self.run(self.app.close(0.2))
        self.app = None
        for engine in self.engines.values():
            engine.listed = False
        self.left_listed.clear()

    @precondition(lambda self: self.app is None)
    @rule()
    def controller_starts(self) -> None:
        """Again on its port, knowing no engine: once the planner's channel dials it again,
        the planner reconciles at once (its watch of the controller's instance id), not at
        its next tick."""
        self.app = self.run(start_controller(self.controller_config(self.port)))
        admin = self.actor()._admin  # its dial back-off: what a start's check waits out
        self.run(eventually(lambda: passes(admin.check_reachable("any")), SETTLE_S))
        self.reconcile()

    @rule(pool=st.sampled_from(POOLS), ahead=st.sampled_from([0, 3]), stale=st.booleans())
    def operator_leaves_a_port_file(self, pool: str, ahead: int, stale: bool) -> None:
        """A port file no engine of this run wrote: a stale port (an engine of a run long
        gone), or none (an empty file); named with the number the next start takes, or one
        further on. Read by the next planner on the workdir; a start that takes its name
        writes over it."""
        name = f"{pool}-{self.next_number + ahead}.port"
        if (self.workdir / name).exists():
            return
        if stale:
            port = next(self.stale_ports)
            (self.workdir / name).write_text(str(port))
            self.stale[name] = port
        else:
            (self.workdir / name).write_text("")
            self.garbage.add(name)

    @rule()
    def planner_killed_and_restarted(self) -> None:
        """`kvplane planner run` SIGKILLed: its engines get SIGTERM from the kernel (they ask
        for it as their parent dies), and the controller lists those it registered,
        unreachable. Restarted on the workdir, the planner numbers on from every engine file
        there, and its first look takes those its port files name out of the controller."""
        old = self.actor()
        for address in list(self.engines):
            engine = self.engines[address]
            if not engine.crashed:
                os.kill(engine.process.pid, signal.SIGTERM)
            self.gone_with(address)
            self.left[address] = engine.port_file
            if engine.listed:
                self.left_listed.add(address)
        self.run(_abandoned(old))
        self.planner_runs_again()

    @rule(second_signal=st.booleans())
    def planner_closed_and_run_again(self, second_signal: bool) -> None:
        """Ctrl-C: every engine drained, taken out of the controller and stopped (a second
        Ctrl-C: killed at once, taken out all the same); its port file dropped once out of
        the controller. Run again on the workdir, the planner finds no engine left
        registered but those the controller did not take out."""
        actuator = self.actor()
        if second_signal:
            actuator.kill_all()
        self.run(actuator.close())
        for address in list(self.engines):
            port_file = self.engines[address].port_file
            self.gone_with(address)
            self.removed(address, port_file)
        self.planner_runs_again()

    def planner_runs_again(self) -> None:
        """A new planner on the workdir: the operator's stale port files are engines left
        registered for it; it numbers on from every engine file there; its first look is
        waited for (`LivePlanner`'s first tick)."""
        for name, port in self.stale.items():
            self.left[f"127.0.0.1:{port}"] = name
        self.stale.clear()
        self.next_number = self.file_number()
        self.actuator = self.new_actuator()
        self.look()

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def the_actuator_runs_the_models_engines(self) -> None:
        if self.actuator is None:
            return
        assert self.actuator.running() == sorted(self.engines)
        assert self.actuator.num_alive() == len(self.alive())

    @invariant()
    def each_engine_not_crashed_runs_at_its_port_files_port(self) -> None:
        for address, engine in self.engines.items():
            if engine.crashed:
                continue
            assert engine.process.returncode is None, (address, engine.process.returncode)
            port = int((self.workdir / engine.port_file).read_text())
            assert address == f"127.0.0.1:{port}", (engine.port_file, port)

    @invariant()
    def no_process_the_model_says_is_gone_runs(self) -> None:
        for process in self.gone:
            assert process.returncode is not None, process.pid
            with pytest.raises(ProcessLookupError):  # reaped, not a zombie
                os.kill(process.pid, 0)

    @invariant()
    def the_port_files_are_the_models(self) -> None:
        expected = {e.port_file for e in self.engines.values()}
        expected |= set(self.left.values()) | set(self.stale) | self.garbage
        assert sorted(p.name for p in self.workdir.glob("*.port")) == sorted(expected)

    @invariant()
    def the_controller_lists_the_models_engines(self) -> None:
        if self.app is None:
            return
        registered = self.registered()
        listed = {a for a, e in self.engines.items() if e.listed} | self.left_listed
        assert sorted(registered) == sorted(listed)
        routed = {a for a, routable in registered.items() if routable}
        crashed = {a for a, e in self.engines.items() if e.crashed}
        assert routed <= set(self.serving()) | crashed | self.left_listed

    def teardown(self) -> None:
        try:
            if self.actuator is not None:
                self.run(self.actuator.close())
            if self.app is not None:
                self.run(self.app.close(0.2))
        finally:
            for engine in self.engines.values():  # a failed step's: none outlives the test
                with contextlib.suppress(ProcessLookupError):
                    os.kill(engine.process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            shutil.rmtree(self.workdir, ignore_errors=True)


async def _abandoned(actuator: LocalProcesses) -> None:
    """What a killed planner's process took with it: its channel to the controller, and its
    waits for its engines' exits (they die with it)."""
    await actuator._admin.close()
    await asyncio.gather(*actuator._stopping)


LocalActuatorMachine.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLocalActuatorModel = LocalActuatorMachine.TestCase


# Sequences the machine draws only now and then, replayed every run: each checks a rule whose
# breakage the random runs find only sometimes.


def replay(*steps: Callable[[LocalActuatorMachine], object]) -> None:
    """Run `steps` on a fresh machine (one engine of each pool started), its invariants
    checked after each, then a look."""
    machine = LocalActuatorMachine()
    invariants = (
        machine.the_actuator_runs_the_models_engines,
        machine.each_engine_not_crashed_runs_at_its_port_files_port,
        machine.no_process_the_model_says_is_gone_runs,
        machine.the_port_files_are_the_models,
        machine.the_controller_lists_the_models_engines,
    )
    first = LocalActuatorMachine.a_planner_with_engines
    replay_on(machine, (lambda m: first(m, list(POOLS)), *steps, Machine.tick), invariants)


Machine = LocalActuatorMachine


def test_a_killed_planners_engines_are_taken_out_by_the_next_one() -> None:
    """Serving, draining and crashed engines of a planner SIGKILLed: the controller lists
    them, their port files stay; the next planner's first look takes each out and drops its
    port file, and numbers its engines on."""
    replay(
        lambda m: m.drain(0),
        lambda m: m.start("default"),
        lambda m: m.engine_crashes(2),
        Machine.planner_killed_and_restarted,
        lambda m: m.start("pre-fill"),
    )


def test_an_engine_stopped_without_a_controller_is_taken_out_once_it_answers() -> None:
    """Removed, lost (killed) and crashed while the controller is down: stopped all the same,
    their port files kept until a look finds the controller again (which lists none of them)."""
    replay(
        lambda m: m.engine_crashes(0),
        Machine.controller_stops,
        lambda m: m.stop(1),
        Machine.tick,  # the crashed one stopped: its port file kept too
        Machine.controller_starts,
        lambda m: m.start("default"),
        Machine.tick,
    )


def test_a_restarted_controller_gets_the_serving_engines_back_at_the_next_look() -> None:
    replay(
        lambda m: m.drain(0),
        Machine.controller_stops,
        Machine.controller_starts,
        Machine.tick,
        lambda m: m.stop(0),
    )


def test_operators_port_files_a_stale_port_taken_out_none_kept() -> None:
    """A stale port file is one more engine left registered for the next planner (its first
    look drops it: the controller does not list it); a file naming no port is no engine's,
    left alone, though its number counts; one named as the next start's engine is written
    over."""
    replay(
        lambda m: m.operator_leaves_a_port_file("default", 0, True),
        lambda m: m.operator_leaves_a_port_file("pre-fill", 3, False),
        lambda m: m.operator_leaves_a_port_file("pre-fill", 4, True),
        lambda m: m.start("default"),
        Machine.planner_killed_and_restarted,
        lambda m: m.start("pre-fill"),
    )


def test_a_close_without_a_controller_leaves_the_engines_for_the_next_planner() -> None:
    """Closed (a second Ctrl-C: killed) with a controller, the engines leave no port file, and
    the next planner numbers on from their logs; closed without one, their port files stay,
    and the next planner takes them out once the controller answers."""
    replay(
        lambda m: m.planner_closed_and_run_again(True),
        lambda m: m.start("default"),
        Machine.controller_stops,
        lambda m: m.planner_closed_and_run_again(False),
        Machine.controller_starts,
        lambda m: m.start("pre-fill"),
    )


def test_a_start_on_a_dead_engines_port_takes_the_dead_one_out_first() -> None:
    """A crashed engine no look reported yet (the controller lists it still), and one a
    planner killed while the controller was down left registered: a start whose engine gets
    the dead one's port is not refused for it, and the dead one goes, out of the controller,
    its port file dropped."""
    replay(
        lambda m: m.engine_crashes(0),
        lambda m: m.start_on_a_dead_engines_port("default", 0),
        Machine.controller_stops,
        Machine.planner_killed_and_restarted,
        Machine.controller_starts,
        lambda m: m.start_on_a_dead_engines_port("pre-fill", 0),
    )


def test_a_hung_engine_is_killed_and_a_crashed_one_stopped_at_the_close() -> None:
    replay(
        lambda m: m.hung_engine_killed(0),
        lambda m: m.engine_crashes(0),
        lambda m: m.planner_closed_and_run_again(False),
    )
