"""End to end: the live planner over real `kvplane engine serve --model sim` processes and an
in-process controller. It starts the pool's minimum (and asks once while they start), the
controller routes to them; lowered to one engine, it drains the least loaded through the
controller, removes it once drained, and stops its process; closing stops the rest, also
engines still starting. An engine that stops answering (SIGSTOP) is killed and replaced after
`lost_after_failed_polls` ticks in a row, not after one. /metrics is scraped over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from controller.registry import EngineState as RegistryState
from kvplane.channels import INSECURE, ClientChannels, Redialling
from kvplane.child_signals import signal_child
from kvplane.config import ClientTlsConfig, TlsConfig
from kvplane.errors import KvplaneError
from kvplane.metrics import start_metrics_server
from kvplane.process_exit import log_tail
from kvplane.server_tls import server_credentials
from kvplane.up.member import STOP_TIMEOUT_S
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner import live as live_module
from planner.actuator import LocalProcesses
from planner.config import PlannerConfig, PoolConfig, ScalingConfig
from planner.controller_admin import (
    ADMIN_TIMEOUT_S,
    DRAIN_ANSWER_S,
    NOT_RECONCILED,
    ControllerAdmin,
    Reconciliation,
)
from planner.core.actions import removals
from planner.core.decisions import Decision, DrainEngine, Reason, RemoveEngine, ScalePool
from planner.core.observations import (
    IDLE,
    EngineObservation,
    EngineRole,
    EngineState,
    Observations,
)
from planner.core.planner import Planner
from planner.engine_args import serve_args
from planner.live import LivePlanner, _load
from planner.metrics import PlannerMetrics
from planner.start_backoff import StartBackoff
from tests.controller.conftest import generate_request, start_sim_engine
from tests.controller.test_processes import controller_process
from tests.interrupted import interrupted
from tests.partial_servicers import PartialAdmin, PartialOpenEngine
from tests.polling import eventually
from tests.processes import DEFAULT_SIGNALS
from tests.rotation import replace_file
from tests.tcp_forwarder import TcpForwarder


def planner(min_engines: int, max_engines: int) -> Planner:
    pool = PoolConfig(min_engines=min_engines, max_engines=max_engines)
    return Planner(PlannerConfig(pools=(pool,), scaling=ScalingConfig(tick_s=0.2)))


@dataclass
class Setup:
    app: ControllerApp
    actuator: LocalProcesses


def local_processes(
    controller_port: int, workdir: Path, stop_within_s: float = STOP_TIMEOUT_S
) -> LocalProcesses:
    return LocalProcesses(
        controller=f"127.0.0.1:{controller_port}",
        engine_args=("--model", "sim"),
        workdir=workdir,
        start_timeout_s=120,
        stop_within_s=stop_within_s,
    )


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1}
    config = {"listen": "127.0.0.1:0", "health": health, "shutdown_grace_s": 0.5}
    app = await start_controller(ControllerConfig.model_validate(config))
    actuator = local_processes(app.port, tmp_path)
    try:
        yield Setup(app, actuator)
    finally:
        await actuator.close()  # idempotent: the planner's close already closed it
        await app.close(0.2)


@contextlib.asynccontextmanager
async def serving(
    setup: Setup, count: int, **options: Any
) -> AsyncIterator[tuple[LivePlanner, list[str]]]:
    """A live planner (LivePlanner `options`) with `count` engines serving (their addresses),
    closed at the end."""
    fleet = setup.app.controller.fleet
    live = LivePlanner(planner(count, count), setup.actuator, **options)
    try:
        await live.tick()
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == count, 120)
        await fleet.wait_for(lambda: len(live._starts) == 0, 30)
        yield live, sorted(live.engines)
    finally:
        await live.close()


@pytest.mark.timeout(180)
async def test_live_planner_starts_drains_and_removes_engines(setup: Setup) -> None:
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    live = LivePlanner(planner(2, 2), actuator)
    try:
        assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
        # While they start, the pool counts them: no second ask.
        assert await live.tick() == []
        assert [e.state for e in live.engines.values()] == [EngineState.STARTING] * 2
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 2, 120)
        await fleet.wait_for(lambda: len(live._starts) == 0, 30)
        addresses = sorted(live.engines)
        assert {r.address for r in fleet.registry.records()} == set(addresses)
        # Each leads a session of its own: Ctrl-C in the planner's terminal reaches the planner
        # only, which takes them out of the controller before it stops them.
        for address in addresses:
            pid = actuator._processes[address].pid
            assert os.getsid(pid) == pid

        live.policy = planner(1, 1)
        (drain,) = await live.tick()
        assert isinstance(drain, DrainEngine) and drain.reason is Reason.ABOVE_MAX
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 30)
        # The next tick sees it draining and empty (it served nothing): removed, stopped.
        assert await live.tick() == [RemoveEngine(drain.engine_id, "default", Reason.DRAINED)]
        await asyncio.gather(*live._removals)  # the stop runs beside the ticks
        assert drain.engine_id not in actuator.running()
        assert sorted(live.engines) == sorted(set(addresses) - {drain.engine_id})
        assert [r.address for r in fleet.registry.records()] == sorted(live.engines)
    finally:
        await live.close()
    assert not live.engines
    assert not actuator.running() and actuator.num_alive() == 0


def test_a_getload_with_open_kv_sessions_is_not_a_drained_engine() -> None:
    """GetLoad's active_kv_sessions reaches the core: a draining prefill engine with no
    request but sessions not pulled yet is not taken for drained; an answer without the
    field keeps the last count."""
    handed_over = _load(
        pb.LoadInfo(running_requests=0, queued_requests=0, active_kv_sessions=2), IDLE
    )
    assert not EngineObservation("p", "prefill", EngineState.DRAINING, handed_over).is_drained
    same = _load(pb.LoadInfo(running_requests=0, queued_requests=0), handed_over)
    assert same.active_kv_sessions == 2
    pulled = _load(pb.LoadInfo(running_requests=0, queued_requests=0, active_kv_sessions=0), same)
    assert EngineObservation("p", "prefill", EngineState.DRAINING, pulled).is_drained


def test_a_getload_without_a_field_keeps_its_last_value_not_zero() -> None:
    """An answer that leaves out the KV or waiting-token figures (unavailable in that
    snapshot) does not make a busy engine look empty: the last reported stand."""
    full = pb.LoadInfo(
        running_requests=3,
        queued_requests=2,
        waiting_tokens=4_000,
        used_kv_blocks=80,
        total_kv_blocks=100,
    )
    last = _load(full, IDLE)
    partial = _load(pb.LoadInfo(running_requests=3, queued_requests=2), last)
    assert partial == last
    assert partial.kv_usage == pytest.approx(0.8)


@pytest.mark.timeout(180)
async def test_each_pool_starts_its_engines_with_its_own_arguments(
    setup: Setup, tmp_path: Path
) -> None:
    """A disaggregated fleet's pools: `pools[].engine_args` give one pool prefill engines,
    the other decode engines (a role per pool; `live.engine_args` is every engine's). The
    roles the engines report (GetEngineInfo) reach the core, which sizes each pool by its
    role's bounds (no `role` is configured)."""
    fleet = setup.app.controller.fleet
    (tmp_path / "pools").mkdir()
    actuator = LocalProcesses(
        controller=f"127.0.0.1:{setup.app.port}",
        engine_args=("--model", "sim"),
        workdir=tmp_path / "pools",
        start_timeout_s=120,
        pool_args={"prefill": ("--role", "prefill"), "decode": ("--role", "decode")},
    )
    pools = tuple(PoolConfig(name=n, min_engines=1, max_engines=1) for n in ("prefill", "decode"))
    config = PlannerConfig(pools=pools, scaling=ScalingConfig(tick_s=0.2))
    core = Planner(config)
    live = LivePlanner(core, actuator)
    try:
        await live.tick()
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 2, 120)
        await fleet.wait_for(lambda: len(live._starts) == 0, 30)
        roles = {
            live.engines[r.address].pool: r.identity.role.value
            for r in fleet.registry.routable()
            if r.identity is not None
        }
        assert roles == {"prefill": "prefill", "decode": "decode"}
        assert await live.tick() == []  # the first sizing tick only observes
        assert await live.tick() == []
        observed = {e.pool: e.observation().role for e in live.engines.values()}
        assert observed == {"prefill": EngineRole.PREFILL, "decode": EngineRole.DECODE}
        sized = {name: core.estimate(name) for name in ("prefill", "decode")}
        assert {name: e.role if e else None for name, e in sized.items()} == {
            "prefill": EngineRole.PREFILL,
            "decode": EngineRole.DECODE,
        }
        prefill = sized["prefill"]
        assert prefill is not None and prefill.need.itl == 0
    finally:
        await live.close()
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_closing_while_engines_start_leaves_no_process(setup: Setup) -> None:
    live = LivePlanner(planner(3, 3), setup.actuator)
    try:
        assert await live.tick() == [ScalePool("default", 3, Reason.BELOW_MIN)]
    finally:
        await live.close()
    assert setup.actuator.num_alive() == 0 and not live.engines


@pytest.mark.timeout(120)
async def test_closing_while_the_controller_registers_an_engine_leaves_it_out(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after the controller took an engine's RegisterEngine, before the answer came
    back (a slow network, played by holding the answer): the engine is taken out of the
    controller, not left listed there without a process."""
    fleet, admin = setup.app.controller.fleet, setup.actuator._admin
    register = admin.register
    registered = asyncio.Event()

    async def register_answered_late(address: str, *, existing_ok: bool = False) -> None:
        await register(address, existing_ok=existing_ok)
        registered.set()
        await asyncio.Event().wait()  # the answer is still on its way

    monkeypatch.setattr(admin, "register", register_answered_late)
    live = LivePlanner(planner(1, 1), setup.actuator)
    try:
        assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
        async with asyncio.timeout(60):
            await registered.wait()
        assert len(fleet.registry.records()) == 1
    finally:
        await live.close()
    assert not fleet.registry.records()
    assert setup.actuator.num_alive() == 0


@pytest.mark.timeout(180)
async def test_a_request_running_when_the_planner_closes_finishes(setup: Setup) -> None:
    # Ctrl-C of the planner (or of `kvplane up`) stops its engines: a stream the controller
    # relays from one of them runs to its end, as a drained engine's does.
    fleet = setup.app.controller.fleet
    max_tokens = 40
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel,
        serving(setup, 1) as (live, (address,)),
    ):
        request = generate_request("at-close", [1, 2, 3], max_tokens=max_tokens)
        stream = pb_grpc.OpenEngineStub(channel).Generate(request)
        first = await anext(aiter(stream))  # it runs on the engine
        await live.close()  # `serving` closes it again: idempotent
        rest = [response async for response in stream]
    events = [r.WhichOneof("event") for r in [first, *rest]]
    assert events[-1] == "finished"
    tokens = sum(len(r.token.tokens) for r in [first, *rest] if r.HasField("token"))
    assert tokens == max_tokens
    # Then stopped and out of the controller.
    assert setup.actuator.num_alive() == 0
    assert address not in {r.address for r in fleet.registry.records()}


@pytest.mark.timeout(180)
async def test_an_engine_killed_is_removed_and_replaced(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "planner.live")
    caplog.set_level(logging.INFO, "planner.actuator")
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    metrics = PlannerMetrics()
    async with serving(setup, 2, metrics=metrics) as (live, (victim, _)):
        assert await live.tick() == []  # its first poll: it answers
        assert live.engines[victim].info_read
        process = actuator._processes[victim]
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
        # Its runtime-event stream ends as the process does: said so, without the hint of a
        # TLS server hanging up on plaintext (it answered over this channel).
        prefix = f"runtime events of {victim} ended (UNAVAILABLE)"
        await eventually(lambda: any(prefix in r.getMessage() for r in caplog.records), 30)
        assert not [r for r in caplog.records if "live.engine_tls" in r.getMessage()]
        # The next tick forgets it (and takes it out of the controller): the pool is below
        # its minimum again, rather than counting a dead engine as serving.
        assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
        # How it ended and where its log is, said once: the operator's first question.
        said = [r.getMessage() for r in caplog.records if r.name == "planner.actuator"]
        (exit_line,) = [m for m in said if f"({victim}) exited" in m]
        name = exit_line.split()[1]  # default-N, the name of its log
        log_path = tmp_path / f"{name}.log"
        assert exit_line == (
            f"engine {name} ({victim}) exited with code -9 (SIGKILL); its log {log_path} "
            f"ends: {log_tail(log_path)}"
        )
        await asyncio.gather(*live._removals)  # the stop runs beside the ticks
        assert victim not in live.engines and victim not in actuator.running()
        assert victim not in {r.address for r in fleet.registry.records()}
        lost = {"pool": "default", "cause": "exited"}
        assert metrics.registry.get_sample_value("kvplane_planner_engines_lost_total", lost) == 1
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 2, 120)
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_a_reused_workdir_does_not_give_a_stale_address(setup: Setup, tmp_path: Path) -> None:
    # A previous run's port file for the same pool and number (the workdir is the fixture's).
    (tmp_path / "default-0.port").write_text("1")
    address = await setup.actuator.start("default")
    assert address != "127.0.0.1:1"
    fleet = setup.app.controller.fleet
    await fleet.wait_for(lambda: [r.address for r in fleet.registry.routable()] == [address], 60)


@pytest.mark.timeout(120)
async def test_an_engine_the_controller_forgot_is_registered_again(setup: Setup) -> None:
    fleet = setup.app.controller.fleet
    async with serving(setup, 1) as (live, (address,)):
        # What a controller restarted with no engines in its config knows of the fleet.
        await fleet.remove_engine(address)
        assert not fleet.registry.records()
        await live.tick()
        await fleet.wait_for(
            lambda: [r.address for r in fleet.registry.routable()] == [address], 60
        )


@pytest.mark.timeout(120)
async def test_a_restarted_controller_gets_the_fleet_back(setup: Setup) -> None:
    """The controller's process restarts on its port, knowing no engine: while it is down the
    planner's ticks go on (its engines keep serving), and once it is back the planner
    registers them again."""
    port = setup.app.port
    async with serving(setup, 1) as (live, (address,)):
        await setup.app.close(0.2)
        assert await live.tick() == []  # the reconciliation fails: logged, the tick goes on
        assert sorted(live.engines) == [address]
        health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1}
        config = {"listen": f"127.0.0.1:{port}", "health": health, "shutdown_grace_s": 0.5}
        restarted = await start_controller(ControllerConfig.model_validate(config))
        try:
            fleet = restarted.controller.fleet
            async with asyncio.timeout(60):  # ticks until the planner's channel reconnects
                for _ in itertools.count():
                    assert await live.tick() == []
                    if fleet.registry.records():
                        break
                    await asyncio.sleep(0.2)
            await fleet.wait_for(
                lambda: [r.address for r in fleet.registry.routable()] == [address], 60
            )
            await live.close()  # takes its engine out of the restarted controller
            assert not fleet.registry.records()
        finally:
            await restarted.close(0.2)


@pytest.mark.timeout(120)
async def test_an_engine_starting_while_the_controller_restarts_is_routed_by_the_new_one(
    setup: Setup,
) -> None:
    """The controller restarts while a start waits for it to route the new engine: the wait
    outlasts the controller's absence and gives the new process the engine, rather than
    failing the start (which stopped a serving engine, for the next tick to start another)."""
    port = setup.app.port
    async with serving(setup, 1) as (_, (address,)):
        # The engine as a start has it once registered: serving, not routed yet.
        await setup.app.controller.fleet.remove_engine(address)
        await setup.app.close(0.2)
        admin = ControllerAdmin(f"127.0.0.1:{port}")
        try:
            waiting = asyncio.create_task(admin.wait_routed(address))
            await asyncio.sleep(1.0)  # a few of its polls find no controller
            assert not waiting.done()
            health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1}
            config = {"listen": f"127.0.0.1:{port}", "health": health, "shutdown_grace_s": 0.5}
            restarted = await start_controller(ControllerConfig.model_validate(config))
            try:
                async with asyncio.timeout(60):
                    await waiting
                routable = restarted.controller.fleet.registry.routable()
                assert [r.address for r in routable] == [address]
            finally:
                await restarted.close(0.2)
        finally:
            await admin.close()


@pytest.mark.timeout(180)
async def test_a_controller_killed_and_restarted_gets_the_engines_back_before_the_next_tick(
    tmp_path: Path,
) -> None:
    """`kill -9` of the controller process, and a new one on its port, knowing no engine: the
    running planner sees a new process (its instance id) and registers its engines again at
    once, not at its next tick (an hour away here). A client retrying meanwhile is told
    UNAVAILABLE (the controller has no engine yet), never NOT_FOUND, until it is served."""
    processes: list[subprocess.Popen[bytes]] = []
    stop = asyncio.Event()
    try:
        controller, target = await asyncio.to_thread(
            controller_process, tmp_path, "controller", "127.0.0.1:0", processes
        )
        actuator = local_processes(int(target.rsplit(":", 1)[1]), tmp_path)
        live = LivePlanner(planner(1, 1), actuator)
        running = asyncio.create_task(live.run(stop, tick_s=3600))
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                admin = apb_grpc.AdminStub(channel)
                await eventually(lambda: routed(admin), 120, "the planner's engine routed")
                engines = await routed(admin)
            await eventually(lambda: sorted(live.engines) == engines, 30, "the start's end")

            controller.kill()
            await asyncio.to_thread(controller.wait)
            _, again = await asyncio.to_thread(
                controller_process, tmp_path, "restarted", target, processes
            )
            assert again == target
            async with grpc.aio.insecure_channel(target) as channel:
                gateway = pb_grpc.OpenEngineStub(channel)

                async def served() -> bool:
                    request = generate_request(f"r{next(ids)}", [1, 2, 3])
                    try:
                        [response async for response in gateway.Generate(request)]
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc.details()
                        return False
                    return True

                ids = itertools.count()
                await eventually(served, 60, "a Generate served by the restarted controller")
                assert await routed(apb_grpc.AdminStub(channel)) == engines
        finally:
            stop.set()
            await running
            await live.close()
    finally:
        for proc in processes:
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def routed(admin: apb_grpc.AdminAsyncStub) -> list[str]:
    """The addresses the controller routes to."""
    workers = (await admin.ListWorkers(apb.ListWorkersRequest())).workers
    return sorted(w.address for w in workers if w.routable)


async def killed_planner(setup: Setup, workdir: Path) -> str:
    """The real command, keeping one engine in `workdir`, SIGKILLed once the controller routes
    to its engine (which it no longer does once it returns): that engine's address."""
    config = workdir.parent / "planner.yaml"
    live = {"controller": f"127.0.0.1:{setup.app.port}", "workdir": str(workdir)}
    config.write_text(json.dumps({"pools": [{"min_engines": 1, "max_engines": 1}], "live": live}))
    fleet = setup.app.controller.fleet
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvplane", "planner", "run", "--config", str(config),
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 60)
        (address,) = (r.address for r in fleet.registry.routable())
    finally:
        process.kill()
        await process.wait()
    await fleet.wait_for(lambda: not fleet.registry.routable(), 30)
    return address


@pytest.mark.timeout(120)
async def test_engines_die_with_a_killed_planner(setup: Setup, tmp_path: Path) -> None:
    # SIGKILL gives it no chance to stop its engines; they must not outlive it.
    address = await killed_planner(setup, tmp_path / "work")
    host, port = address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(host, int(port))


def processes_running(marker: str) -> list[int]:
    """Pids of the processes whose command line holds `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # not a process, or gone
            continue
        if proc.name.isdigit() and marker.encode() in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.timeout(120)
async def test_ctrl_c_while_the_planner_scales_up_leaves_no_engine_behind(
    setup: Setup, tmp_path: Path
) -> None:
    """SIGINT to `kvplane planner run` while its engines start: it exits cleanly, and no
    engine process outlives it, nor stays registered with the controller."""
    workdir = tmp_path / "work"
    config = tmp_path / "planner.yaml"
    live = {"controller": f"127.0.0.1:{setup.app.port}", "workdir": str(workdir)}
    config.write_text(json.dumps({"pools": [{"min_engines": 2, "max_engines": 2}], "live": live}))
    fleet = setup.app.controller.fleet

    async def spawned(process: asyncio.subprocess.Process) -> None:
        async with asyncio.timeout(60):  # both engines spawned (their logs opened)
            for _ in itertools.count():
                if len(list(workdir.glob("*.log"))) == 2:
                    break
                await asyncio.sleep(0.01)

    result = await interrupted(["planner", "run", "--config", str(config)], spawned)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert processes_running(str(workdir)) == []
    await fleet.wait_for(lambda: not fleet.registry.records(), 30)


@pytest.mark.timeout(120)
async def test_a_start_against_another_kind_of_server_spawns_nothing_and_names_it(
    tmp_path: Path,
) -> None:
    """live.controller given an engine's address (or an indexer's): said to be no controller,
    not gRPC's "UNIMPLEMENTED: Method not found!", logged at every tick."""
    engine = await start_sim_engine("e0")
    actuator = local_processes(engine.port, tmp_path)
    try:
        with pytest.raises(KvplaneError) as failed:
            await actuator.start("default")
    finally:
        await actuator.close()
        await engine.close()
    assert str(failed.value) == (
        f"no engine of default started: controller 127.0.0.1:{engine.port} is not a kvplane "
        "controller: it does not serve the admin API (does live.controller give another "
        "server's address?)"
    )
    assert not actuator._spawned


@pytest.mark.timeout(120)
async def test_a_start_without_a_controller_spawns_nothing_and_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    with socket.socket() as unused:  # bound, not listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        actuator = local_processes(unused.getsockname()[1], tmp_path)
        try:
            with pytest.raises(KvplaneError) as failed:
                await actuator.start("default")
        finally:
            await actuator.close()
    assert str(failed.value).startswith("no engine of default started: controller UNAVAILABLE: ")
    assert "\n" not in str(failed.value)
    assert not actuator._spawned  # no process (with a real model, minutes of loading)


@pytest.mark.timeout(120)
async def test_an_engine_drained_by_hand_is_replaced_and_removed(setup: Setup) -> None:
    fleet = setup.app.controller.fleet
    async with serving(setup, 1) as (live, (address,)):
        # `kvplane admin drain ADDRESS`: the controller stops routing to it, for good.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel:
            drain = apb.DrainEngineRequest(engine=address)
            async for _ in apb_grpc.AdminStub(channel).DrainEngine(drain):
                pass
        assert await live.tick() == [
            RemoveEngine(address, "default", Reason.DRAINED),
            ScalePool("default", 1, Reason.BELOW_MIN),
        ]
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 120)
        assert address not in {r.address for r in fleet.registry.records()}


def forward_pass(**attributes: str) -> pb.SubscribeRuntimeEventsResponse:
    event = pb.RuntimeEvent(type=pb.RUNTIME_EVENT_TYPE_FORWARD_PASS, attributes=attributes)
    return pb.SubscribeRuntimeEventsResponse(runtime_event=event)


@contextlib.asynccontextmanager
async def following(
    engine_servicer: pb_grpc.OpenEngineServicer,
    tls: tuple[TlsConfig, ClientChannels] | None = None,
) -> AsyncIterator[tuple[live_module._Engine, asyncio.Task[None]]]:
    """A real gRPC server playing an engine's part with `engine_servicer`, and the planner
    following its runtime events (the engine it observes, the following task). `tls`: the
    server's TLS and the planner's channels to it."""
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(engine_servicer, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", server_credentials(tls[0]))
    await server.start()
    engine = live_module._Engine(f"127.0.0.1:{port}", "default", EngineState.SERVING)
    channels = INSECURE if tls is None else tls[1]
    engine.dialled = Redialling(channels, engine.engine_id, pb_grpc.OpenEngineStub)
    planner_ = LivePlanner(planner(1, 1), local_processes(1, Path("/nonexistent")))
    follower = asyncio.create_task(planner_._follow_passes(engine))
    try:
        yield engine, follower
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await engine.dialled.close()
        await server.stop(None)


async def until_passes(engine: live_module._Engine, count: int) -> None:
    async with asyncio.timeout(30):
        for _ in itertools.count():  # until `count` passes arrived
            if len(engine.passes) >= count:
                break
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def two_busy_engines(
    setup: Setup, **options: Any
) -> AsyncIterator[tuple[LivePlanner, list[asyncio.Task[None]]]]:
    """Two engines each running a long generation through the controller (the planner, with
    LivePlanner `options`; the generations: each ends with its engine's request)."""
    fleet = setup.app.controller.fleet
    async with (
        serving(setup, 2, **options) as (live, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel,
    ):
        stub = pb_grpc.OpenEngineStub(channel)

        async def generate(request_id: str) -> None:
            request = generate_request(request_id, [1, 2, 3], max_tokens=1_000_000)
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in stub.Generate(request):
                    pass

        generations = [asyncio.create_task(generate(f"r{n}")) for n in range(2)]
        try:
            await fleet.wait_for(
                lambda: all(r.load.running_requests for r in fleet.registry.routable()), 60
            )
            yield live, generations
        finally:
            for task in generations:
                task.cancel()
            await asyncio.gather(*generations, return_exceptions=True)


async def next_decisions(live: LivePlanner) -> list[Decision]:
    """The first decisions of the ticks from now (a request aborted at the client may still
    count at the engine for a moment)."""
    async with asyncio.timeout(30):
        for _ in itertools.count():
            decisions = await live.tick()
            if decisions:
                return decisions
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def lower_to_one(live: LivePlanner, drain_deadline_s: float) -> DrainEngine:
    """The pool's maximum lowered to one: the planner drains one engine, with that deadline."""
    pool = PoolConfig(min_engines=1, max_engines=1)
    scaling = ScalingConfig(tick_s=0.2, drain_deadline_s=drain_deadline_s)
    live.policy = Planner(PlannerConfig(pools=(pool,), scaling=scaling))
    (drain,) = await live.tick()
    assert isinstance(drain, DrainEngine)
    assert live.engines[drain.engine_id].state is EngineState.DRAINING
    return drain


@pytest.mark.timeout(180)
async def test_a_drain_whose_deadline_passes_aborts_the_request_and_the_engine_is_removed(
    setup: Setup,
) -> None:
    async with two_busy_engines(setup) as (live, generations):
        drain = await lower_to_one(live, drain_deadline_s=1)
        # At the deadline the engine aborts what it still runs (abort_after_deadline).
        done, _ = await asyncio.wait(generations, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        assert await next_decisions(live) == [
            RemoveEngine(drain.engine_id, "default", Reason.DRAINED)
        ]
        await asyncio.gather(*live._removals)  # the stop runs beside the ticks
        assert drain.engine_id not in setup.actuator.running()
        registered = {r.address for r in setup.app.controller.fleet.registry.records()}
        assert registered == set(live.engines) and drain.engine_id not in registered


@contextlib.asynccontextmanager
async def drained_by_hand(setup: Setup, address: str) -> AsyncIterator[None]:
    """`kvplane admin drain ADDRESS` under way (the controller lists the engine as draining)
    while in the block; its stream cancelled at the end."""
    fleet = setup.app.controller.fleet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel:

        async def drain_by_hand() -> None:
            request = apb.DrainEngineRequest(engine=address)
            async for _ in apb_grpc.AdminStub(channel).DrainEngine(request):
                pass

        drain = asyncio.create_task(drain_by_hand())
        try:
            await fleet.wait_for(
                lambda: fleet.registry.get(address).state is RegistryState.DRAINING, 30
            )
            yield
        finally:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)


@pytest.mark.timeout(180)
async def test_a_drain_found_at_the_controller_that_never_ends_is_removed_past_its_deadline(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A drain this planner did not ask for (an operator's, or its predecessor's before a
    restart or a leader change), of an engine whose request runs on (no deadline, nothing
    aborted): the planner gives it its own drain deadline from when it first saw it, and
    takes it as drained `DRAIN_OVERRUN_S` past that, as it does its own drains; not kept
    draining for good, serving nothing, uncounted, holding its GPU."""
    async with two_busy_engines(setup) as (live, _):
        stuck = sorted(live.engines)[0]
        async with drained_by_hand(setup, stuck):
            live.policy = planner(1, 2)  # one engine left is enough: none started meanwhile
            now_s = 1000.0
            live._clock = lambda: now_s
            assert await live.tick() == []  # first seen draining, with its request
            assert live.engines[stuck].state is EngineState.DRAINING
            now_s += 300 + 59  # scaling.drain_deadline_s (its default), and 59 s
            assert RemoveEngine(stuck, "default", Reason.DRAINED) not in await live.tick()
            assert live.engines[stuck].load.running_requests == 1
            now_s += 1  # live.DRAIN_OVERRUN_S past the deadline
            assert RemoveEngine(stuck, "default", Reason.DRAINED) in await live.tick()
            assert stuck not in live.engines
    said = f"engine {stuck} still reports requests (1) or KV sessions (0) 60 s past its "
    assert any(r.getMessage().startswith(said) for r in caplog.records)


@pytest.mark.timeout(180)
async def test_an_engine_drained_by_hand_while_busy_is_replaced_at_once(setup: Setup) -> None:
    """A pool of two, one drained by hand while it still runs a request: it leaves, so the
    pool is below its minimum, and the planner starts an engine in its place at once, not
    once the drained one is gone (it counts no longer, though still running)."""
    async with (
        two_busy_engines(setup) as (live, _),
        drained_by_hand(setup, sorted(live.engines)[0]),
    ):
        assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
        states = sorted(e.state.value for e in live.engines.values())
        assert states == ["draining", "serving", "starting"]


@pytest.mark.timeout(180)
async def test_of_idle_engines_the_one_caching_the_least_prefix_is_drained(
    setup: Setup,
) -> None:
    """Two idle engines (no request, no KV in use): the one whose cached prefix the
    controller's index holds is kept, the one without is drained, whatever their ids (the
    id alone drained the first, losing its cache to the fleet)."""
    async with serving(setup, 2) as (live, (cached, empty)):
        async with grpc.aio.insecure_channel(cached) as channel:
            prompt = generate_request("cached", list(range(1, 161)), max_tokens=1)
            async for _ in pb_grpc.OpenEngineStub(channel).Generate(prompt):
                pass
        async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel:
            admin = apb_grpc.AdminStub(channel)

            async def indexed() -> dict[str, int]:
                listed = await admin.ListWorkers(apb.ListWorkersRequest())
                return {w.address: w.indexed_blocks for w in listed.workers}

            async def cached_indexed() -> bool:
                return (await indexed())[cached] > 0

            await eventually(cached_indexed, 30, "the prompt's blocks indexed")
            assert (await indexed())[empty] == 0
        drain = await lower_to_one(live, drain_deadline_s=30)
        assert drain.engine_id == empty
        assert live.engines[cached].observation().indexed_blocks > 0


@pytest.mark.timeout(180)
async def test_a_drain_the_engine_did_not_take_is_asked_again(setup: Setup) -> None:
    """The engines hang (SIGSTOP) through the planner's drain: the controller's Drain gets no
    answer in time, and it routes to the engine again once it answers its health. Kept busy,
    it would serve on while the planner counts it as leaving: the planner drains it again."""
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    async with two_busy_engines(setup) as (live, _):
        pids = [process.pid for process in actuator._processes.values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            drain = await lower_to_one(live, drain_deadline_s=300)
            admin = actuator._admin
            await fleet.wait_for(lambda: not admin._drains, 30)  # the controller gave up
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        # Both answer their health again: the victim is routed to again, unless it took the
        # Drain it woke up to (a race of its own: then it drains all the same).
        answered = {RegistryState.READY, RegistryState.DRAINING}
        await fleet.wait_for(lambda: all(r.state in answered for r in fleet.registry.records()), 60)

        # Drained again: the controller routes no more to it while it finishes its request.
        def victim_draining() -> bool:
            records = {r.address: r for r in fleet.registry.records()}
            victim = records.get(drain.engine_id)
            return victim is not None and victim.state is RegistryState.DRAINING

        await live.tick()
        await fleet.wait_for(victim_draining, 30)
        assert live.engines[drain.engine_id].state is EngineState.DRAINING


@pytest.mark.timeout(180)
async def test_an_engine_that_dies_while_draining_is_forgotten_not_replaced(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """It was leaving: nothing is started in its place. Nor is its loss a failure of its
    pool: the engine that dies next, soon after it began serving (a crash: `crash_within_s`
    is an hour here), is the pool's first failure, replaced at once, not backed off."""
    caplog.set_level(logging.WARNING, "planner.live")
    metrics = PlannerMetrics()
    backoff = StartBackoff(3600.0, 3600.0, 3600.0)
    async with two_busy_engines(setup, metrics=metrics, start_backoff=backoff) as (live, _):
        drain = await lower_to_one(live, drain_deadline_s=300)
        process = setup.actuator._processes[drain.engine_id]
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
        # It was leaving: the pool keeps its one engine, nothing is started in its place.
        assert await live.tick() == []
        assert drain.engine_id not in live.engines and len(live.engines) == 1
        registered = {r.address for r in setup.app.controller.fleet.registry.records()}
        assert registered == set(live.engines)
        lost = {"pool": "default", "cause": "exited"}
        assert metrics.registry.get_sample_value("kvplane_planner_engines_lost_total", lost) == 1
        (survivor,) = live.engines
        process = setup.actuator._processes[survivor]
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
        assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
        assert not [r for r in caplog.records if "keep failing" in r.getMessage()]
        assert backoff.wait_s("default", live._clock()) == 0.0


@pytest.mark.parametrize(
    ("code", "named"),
    [(pb.ERROR_CODE_OVERLOADED, "ERROR_CODE_OVERLOADED"), (99, "ErrorCode 99")],
)
async def test_a_runtime_event_stream_that_ends_is_subscribed_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int, named: str
) -> None:
    """An engine ends a subscriber that fell too far behind (one EngineError event, then the
    end, as engine.server's SubscribeRuntimeEvents does): the planner says why and subscribes
    again, so later passes still reach the core. An error code this build does not know is
    named by its number (it failed the subscription with ValueError)."""
    monkeypatch.setattr(live_module, "RESUBSCRIBE_S", 0.01)
    subscriptions = 0

    class OverrunEngine(PartialOpenEngine):
        async def SubscribeRuntimeEvents(
            self, request: object, context: object
        ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
            nonlocal subscriptions
            subscriptions += 1
            if subscriptions == 1:
                yield forward_pass(duration_ms="10", batch_size="1")
                overrun = pb.EngineError(code=code, message="fell behind")  # type: ignore[arg-type]
                yield pb.SubscribeRuntimeEventsResponse(error=overrun)
                return
            yield forward_pass(duration_ms="20", batch_size="1")
            await asyncio.Event().wait()  # open until cancelled

    caplog.set_level(logging.INFO, "planner.live")
    async with following(OverrunEngine()) as (engine, _):
        await until_passes(engine, 2)
    assert [p.duration_s for p in engine.passes] == [0.01, 0.02]
    assert subscriptions == 2
    ended = f"runtime events of {engine.engine_id} ended by the engine ({named}"
    assert any(r.getMessage().startswith(f"{ended}: fell behind)") for r in caplog.records)


class BroadcastingEngine(PartialOpenEngine):
    """An engine whose runtime events (`publish`) go to every subscription open, each with its
    own id, as engine.server's do."""

    def __init__(self) -> None:
        self.subscriptions: list[asyncio.Queue[pb.SubscribeRuntimeEventsResponse]] = []
        self.opened = 0
        self.changed = asyncio.Condition()

    async def SubscribeRuntimeEvents(
        self, request: object, context: object
    ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
        queue: asyncio.Queue[pb.SubscribeRuntimeEventsResponse] = asyncio.Queue()
        async with self.changed:
            self.subscriptions.append(queue)
            self.opened += 1
            self.changed.notify_all()
        try:
            while True:
                yield await queue.get()
        finally:
            self.subscriptions.remove(queue)
            async with self.changed:
                self.changed.notify_all()

    def publish(self, number: int) -> None:
        """FORWARD_PASS number `number` (its duration `number` ms) to every subscription."""
        response = forward_pass(duration_ms=str(number), batch_size="1")
        response.runtime_event.event_id = f"engine-{number}"
        for queue in self.subscriptions:
            queue.put_nowait(response)

    async def until(self, opened: int, open_now: int) -> None:
        """Return once `opened` subscriptions were opened and `open_now` are open."""
        async with asyncio.timeout(30), self.changed:
            await self.changed.wait_for(
                lambda: self.opened == opened and len(self.subscriptions) == open_now
            )


async def test_runtime_events_move_to_the_new_channel_after_a_tls_rotation_with_none_lost(
    pki: Path, tmp_path: Path
) -> None:
    """The engine's TLS files renewed: the planner's next call dials it again, and its
    runtime-event subscription moves to the new channel by itself, make-before-break: a
    second subscription is opened there while the first goes on, and the first is ended once
    both carried the same event. Every pass reaches the planner once, those published while
    both were open included. (The stream stayed on the old channel until it was closed an
    hour later, then was subscribed again a second later: the passes in between were lost.)"""
    engine_servicer = BroadcastingEngine()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes((pki / "ca.pem").read_bytes())
    server_tls = TlsConfig(cert_file=pki / "server.pem", key_file=pki / "server.key")
    channels = ClientChannels.load(ClientTlsConfig(ca_file=ca_file))
    async with following(engine_servicer, (server_tls, channels)) as (engine, follower):
        assert engine.dialled is not None
        await engine_servicer.until(opened=1, open_now=1)
        engine_servicer.publish(1)
        await until_passes(engine, 1)
        old = engine.dialled.channel
        replace_file(ca_file, (pki / "ca.pem").read_bytes())  # renewed
        assert engine.dialled.channel is not old  # the next call's
        await engine_servicer.until(opened=2, open_now=2)  # made before the break
        for number in (2, 3, 4):
            engine_servicer.publish(number)
        await engine_servicer.until(opened=2, open_now=1)  # the old one ended
        engine_servicer.publish(5)
        await until_passes(engine, 5)
        assert not follower.done()
    assert [p.duration_s for p in engine.passes] == [0.001, 0.002, 0.003, 0.004, 0.005]


async def test_a_runtime_event_that_is_not_numbers_is_skipped_not_the_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another engine's attributes, or a NaN: skipped with one line, and the passes after it
    still reach the core (a NaN taken would poison the cost model)."""

    class OddEngine(PartialOpenEngine):
        async def SubscribeRuntimeEvents(
            self, request: object, context: object
        ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
            yield forward_pass(duration_ms="12", num_prefill_tokens="7.5", batch_size="1")
            yield forward_pass(duration_ms="nan", batch_size="1")
            yield forward_pass(duration_ms="30", num_prefill_tokens="64", batch_size="2")
            await asyncio.Event().wait()

    async with following(OddEngine()) as (engine, _):
        await until_passes(engine, 1)
    assert [
        (p.duration_s, p.num_prefill_tokens, p.num_prefill_sequences) for p in engine.passes
    ] == [(0.03, 64, 2)]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        f"runtime events of {engine.engine_id}: skipped: FORWARD_PASS attribute "
        "num_prefill_tokens='7.5' is not a number >= 0"
    ]


async def test_runtime_events_of_other_kinds_are_not_taken_for_passes() -> None:
    """The planner asks for FORWARD_PASS only, but applying the filter is the engine's: one
    that sends every kind (the bundled engine's BATCH and QUEUE, a TRANSFER) must not have
    them read as passes of no duration, which would halve the learned pass cost and size
    the fleet for twice the load it can serve."""

    def event(
        kind: pb.RuntimeEventType.ValueType, **attributes: str
    ) -> pb.SubscribeRuntimeEventsResponse:
        runtime_event = pb.RuntimeEvent(type=kind, attributes=attributes)
        return pb.SubscribeRuntimeEventsResponse(runtime_event=runtime_event)

    class UnfilteredEngine(PartialOpenEngine):
        async def SubscribeRuntimeEvents(
            self, request: object, context: object
        ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
            yield forward_pass(duration_ms="20", num_prefill_tokens="64", batch_size="3")
            yield event(pb.RUNTIME_EVENT_TYPE_BATCH, batch_size="3", prefill_sequences="1")
            yield event(pb.RUNTIME_EVENT_TYPE_QUEUE, running_requests="3", queued_requests="1")
            yield event(pb.RUNTIME_EVENT_TYPE_TRANSFER, duration_ms="400")
            yield event(pb.RUNTIME_EVENT_TYPE_UNSPECIFIED)
            yield forward_pass(duration_ms="30", batch_size="2", num_decode_sequences="2")
            await asyncio.Event().wait()

    async with following(UnfilteredEngine()) as (engine, _):
        await until_passes(engine, 2)  # the other kinds came before the second pass
    assert [
        (p.duration_s, p.num_prefill_tokens, p.num_prefill_sequences) for p in engine.passes
    ] == [(0.02, 64, 3), (0.03, 0, 0)]


async def test_a_pass_with_more_decoding_sequences_than_its_batch_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A negative count of prompt sequences would turn the running means of the prompt and
    decode lengths negative: the event is skipped, said once, like one that is not numbers."""

    class OddEngine(PartialOpenEngine):
        async def SubscribeRuntimeEvents(
            self, request: object, context: object
        ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
            yield forward_pass(duration_ms="12", batch_size="1", num_decode_sequences="4")
            yield forward_pass(duration_ms="30", num_prefill_tokens="64", batch_size="2")
            await asyncio.Event().wait()

    async with following(OddEngine()) as (engine, _):
        await until_passes(engine, 1)
    assert [(p.duration_s, p.num_prefill_sequences) for p in engine.passes] == [(0.03, 2)]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        f"runtime events of {engine.engine_id}: skipped: FORWARD_PASS attribute "
        "num_decode_sequences=4 is above batch_size=1"
    ]


async def test_an_engine_without_runtime_events_is_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """UNIMPLEMENTED will not change by asking every second: one line, and following ends."""
    subscriptions = 0

    class EngineWithoutEvents(PartialOpenEngine):
        async def SubscribeRuntimeEvents(
            self,
            request: object,
            context: grpc.aio.ServicerContext[
                pb.SubscribeRuntimeEventsRequest, pb.SubscribeRuntimeEventsResponse
            ],
        ) -> AsyncIterator[pb.SubscribeRuntimeEventsResponse]:
            nonlocal subscriptions
            subscriptions += 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no runtime events")
            yield pb.SubscribeRuntimeEventsResponse()

    async with following(EngineWithoutEvents()) as (engine, follower):
        async with asyncio.timeout(30):
            await follower
    assert subscriptions == 1
    said = [r for r in caplog.records if r.name.startswith("planner.")]  # not grpc's or asyncio's
    assert [r.getMessage() for r in said if r.levelno >= logging.WARNING] == [
        f"engine {engine.engine_id} has no runtime events (UNIMPLEMENTED): its forward passes "
        "are not observed"
    ]


@pytest.mark.parametrize(
    "unknown_load",
    [
        pb.LoadInfo(used_kv_blocks=1, total_kv_blocks=99),  # no request counts
        pb.LoadInfo(running_requests=0, used_kv_blocks=1, total_kv_blocks=99),  # none queued
        pb.LoadInfo(queued_requests=0, used_kv_blocks=1, total_kv_blocks=99),  # none running
    ],
    ids=["no-counts", "running-only", "queued-only"],
)
async def test_an_engine_that_does_not_report_its_requests_is_not_taken_for_drained(
    unknown_load: pb.LoadInfo,
) -> None:
    """GetLoad's counts are optional: absent is unknown, not zero. A drained engine that
    reports not both is not removed (it may still hold requests) until its drain's deadline has
    passed, when its Drain (abort_after_deadline) has ended what was left."""

    busy_load = pb.LoadInfo(
        running_requests=2, queued_requests=0, used_kv_blocks=9, total_kv_blocks=99
    )
    now_s = 1000.0
    async with loaded_engines(busy_load, unknown_load) as (live, (busy, unknown)):
        live._clock = lambda: now_s
        (drain,) = await live.tick()
        assert isinstance(drain, DrainEngine) and drain.engine_id == unknown
        now_s = drain.deadline_s - 1
        assert await live.tick() == []  # its requests are unknown: kept
        assert live.engines[unknown].load.used_kv_blocks == 1
        now_s = drain.deadline_s
        assert await live.tick() == [RemoveEngine(unknown, "default", Reason.DRAINED)]
        assert sorted(live.engines) == [busy]


class RemovesDrained:
    """A policy that only removes the engines it sees drained (the planner core's rule)."""

    def decide(self, observations: Observations, now_s: float) -> list[Decision]:
        return removals(observations.engines)


async def test_a_drain_by_hand_of_an_engine_that_does_not_report_its_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drain found at the controller (an operator's) of an engine that reports no request
    counts is not the planner's: it may not abort at its deadline (the planner gave it one
    from when it saw it), so the engine is taken as drained only `DRAIN_OVERRUN_S` past it;
    the planner does not ask the controller to drain it again (the operator's to ask), and
    once the controller routes to it again (the drain was not taken), it serves again."""
    busy_load = pb.LoadInfo(
        running_requests=2, queued_requests=0, used_kv_blocks=9, total_kv_blocks=99
    )
    unknown_load = pb.LoadInfo(used_kv_blocks=1, total_kv_blocks=99)  # no request counts
    now_s = 1000.0
    async with loaded_engines(busy_load, unknown_load) as (live, (busy, unknown)):
        live.policy = RemovesDrained()
        live._clock = lambda: now_s
        # What the controller says at each reconciliation (it stands in for `kvplane admin
        # drain` and for an engine that did not take the drain), and what it was asked.
        answers = {
            1000.0: Reconciliation([unknown], [], {}),
            1100.0: Reconciliation([], [unknown], {}),
        }
        answers[1200.0] = answers[1000.0]
        asked: list[dict[str, float | None]] = []

        async def sync(serving: list[str], draining: dict[str, float | None]) -> Reconciliation:
            asked.append(dict(draining))
            return answers.get(now_s, NOT_RECONCILED)

        monkeypatch.setattr(live.actuator, "sync", sync)
        assert await live.tick() == []
        assert live.engines[unknown].state is EngineState.DRAINING
        now_s = 1100.0
        assert await live.tick() == []
        assert asked[-1] == {unknown: None}  # the operator's drain: not asked again
        assert live.engines[unknown].state is EngineState.SERVING  # the drain was not taken
        now_s = 1200.0
        assert await live.tick() == []
        now_s = 1200.0 + 300  # the drain deadline (scaling.drain_deadline_s) it was given
        assert await live.tick() == []
        assert unknown in live.engines
        now_s += 60  # live.DRAIN_OVERRUN_S
        assert await live.tick() == [RemoveEngine(unknown, "default", Reason.DRAINED)]
        assert sorted(live.engines) == [busy]


async def test_a_drained_engine_that_keeps_its_requests_past_the_deadline_is_removed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its Drain was to abort what was left at the deadline; an engine that did not (no
    abort after the deadline, a wedged request) is kept a while past it, then removed, not
    kept draining for good: serving nothing, uncounted, holding its GPU."""
    busy_load = pb.LoadInfo(
        running_requests=2, queued_requests=0, used_kv_blocks=9, total_kv_blocks=99
    )
    stuck_load = pb.LoadInfo(
        running_requests=1, queued_requests=0, used_kv_blocks=1, total_kv_blocks=99
    )
    now_s = 1000.0
    async with loaded_engines(busy_load, stuck_load) as (live, (busy, stuck)):
        live._clock = lambda: now_s
        (drain,) = await live.tick()
        assert isinstance(drain, DrainEngine) and drain.engine_id == stuck
        now_s = drain.deadline_s + 1
        assert await live.tick() == []  # the abort may take a moment
        now_s = drain.deadline_s + 60  # live.DRAIN_OVERRUN_S
        assert await live.tick() == [RemoveEngine(stuck, "default", Reason.DRAINED)]
        assert sorted(live.engines) == [busy]
    said = f"engine {stuck} still reports requests (1) or KV sessions (0) 60 s past its "
    said += "drain's deadline (its Drain did not abort them): taken as drained"
    assert said in [r.getMessage() for r in caplog.records]


async def test_an_engine_that_has_not_answered_yet_is_not_taken_for_drained() -> None:
    """Until its first GetLoad answer, an engine's requests are unknown, not none: one whose
    first polls fail (a busy engine's timing out, one adopted while drained by hand) is not
    removed as drained while it may still hold requests."""
    busy_load = pb.LoadInfo(
        running_requests=2, queued_requests=0, used_kv_blocks=9, total_kv_blocks=99
    )
    async with loaded_engines(busy_load) as (live, _):
        with socket.socket() as silent:  # bound, not listening: its GetLoad fails
            silent.bind(("127.0.0.1", 0))
            unanswered = f"127.0.0.1:{silent.getsockname()[1]}"
            live._serve(unanswered, "default")
            (drain,) = await live.tick()  # one engine too many: the least loaded drained
            assert isinstance(drain, DrainEngine) and drain.engine_id == unanswered
            assert await live.tick() == []  # not a word from it yet: kept
            assert unanswered in live.engines


async def test_the_kv_demand_of_queued_prompts_is_counted_in_the_engine_s_own_blocks() -> None:
    """An engine of 32-token blocks (GetModelInfo): 100 blocks hold 3200 tokens, so 1600
    queued prompt tokens are half its cache, not all of it (16-token blocks)."""
    load = pb.LoadInfo(
        running_requests=0,
        queued_requests=1,
        waiting_tokens=1600,
        used_kv_blocks=0,
        total_kv_blocks=100,
    )
    async with loaded_engines(load, kv_block_size=32) as (live, (address,)):
        await live.tick()
        assert live.engines[address].observation().load.kv_demand(1.0) == 0.5


class LoadEngine(PartialOpenEngine):
    """An engine's part as far as the planner polls it: GetLoad, GetEngineInfo and
    GetModelInfo (which, as the seed says, needs a model it serves)."""

    def __init__(self, load: pb.LoadInfo, kv_block_size: int | None) -> None:
        self.load = load
        self.kv_block_size = kv_block_size

    async def GetLoad(self, request: object, context: object) -> pb.LoadInfo:
        return self.load

    async def GetEngineInfo(self, request: object, context: object) -> pb.EngineInfo:
        return pb.EngineInfo(supported_models=["sim"])

    async def GetModelInfo(
        self,
        request: pb.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetModelInfoRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        if request.model != "sim":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served")
        return pb.ModelInfo(model_id="sim", kv_block_size=self.kv_block_size)


@contextlib.asynccontextmanager
async def loaded_engines(
    *loads: pb.LoadInfo, kv_block_size: int | None = None
) -> AsyncIterator[tuple[LivePlanner, list[str]]]:
    """A live planner (one engine wanted) observing a real gRPC server per load in `loads`
    (their addresses), its controller not answering (its failures are only logged)."""
    servers = []
    addresses = []
    for load in loads:
        server = grpc.aio.server()
        pb_grpc.add_OpenEngineServicer_to_server(LoadEngine(load, kv_block_size), server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    with socket.socket() as unused:  # bound, not listening: the controller refuses
        unused.bind(("127.0.0.1", 0))
        live = LivePlanner(planner(1, 1), local_processes(unused.getsockname()[1], Path("/x")))
        try:
            for address in addresses:
                live._serve(address, "default")
            yield live, addresses
        finally:
            await live.close()
            for server in servers:
                await server.stop(None)


@contextlib.asynccontextmanager
async def metrics_endpoint(metrics: PlannerMetrics) -> AsyncIterator[int]:
    """`metrics` served as `kvplane planner run` serves them; the port."""
    server, port = start_metrics_server("127.0.0.1:0", metrics.registry)
    try:
        yield port
    finally:
        server.shutdown()


@pytest.mark.timeout(180)
async def test_an_engine_s_prefix_cache_hits_reach_the_core(setup: Setup) -> None:
    """The same prompt twice through a real engine: the second finds the first's blocks in
    its prefix cache, and the FORWARD_PASS that admits it says so (num_cached_tokens), which
    the planner takes into its passes: what sizes an aggregated pool's queued prefill by the
    share of admitted prompt tokens the engines computed."""
    async with serving(setup, 1) as (live, (address,)):
        cached: list[int] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel:
            for request_id in ("first", "second"):
                request = generate_request(request_id, list(range(1, 301)))
                async for response in pb_grpc.OpenEngineStub(channel).Generate(request):
                    if response.WhichOneof("event") == "finished":
                        cached.append(response.usage.cached_prompt_tokens)
        engine = live.engines[address]
        assert cached[0] == 0 and cached[1] > 0
        await setup.app.controller.fleet.wait_for(
            lambda: sum(p.num_cached_tokens for p in engine.passes) >= cached[1], 30
        )
        assert sum(p.num_cached_tokens for p in engine.passes) == cached[1]


async def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of http://127.0.0.1:port/metrics, by name and labels."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def measured(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """The sample `value` finds, which the test needs there to compare it."""
    found = value(samples, name, **labels)
    assert found is not None, f"no sample {name} {labels}"
    return found


@pytest.mark.timeout(180)
async def test_metrics_show_the_fleet_the_decisions_and_the_sizing(setup: Setup) -> None:
    metrics = PlannerMetrics()
    async with (
        metrics_endpoint(metrics) as port,
        serving(setup, 1, metrics=metrics) as (
            live,
            (address,),
        ),
    ):
        # The pool's first tick within its bounds only observes (no rate yet).
        await live.tick()
        # A prompt through the controller: its forward passes reach the planner.
        prompt_tokens = 300
        async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel:
            request = generate_request("r1", list(range(1, prompt_tokens + 1)))
            async for _ in pb_grpc.OpenEngineStub(channel).Generate(request):
                pass
        engine = live.engines[address]
        await setup.app.controller.fleet.wait_for(
            lambda: sum(p.num_prefill_tokens for p in engine.passes) >= prompt_tokens, 30
        )
        await live.tick()  # a rate: the core sizes the pool
        samples = await scrape(port)
    pool = {"pool": "default"}
    assert value(samples, "kvplane_planner_engines", **pool, state="serving") == 1
    assert value(samples, "kvplane_planner_engines", **pool, state="starting") == 0
    assert value(samples, "kvplane_planner_engines", **pool, state="draining") == 0
    decisions = "kvplane_planner_decisions_total"
    assert value(samples, decisions, **pool, kind="scale_pool", reason="below_min") == 1
    assert value(samples, "kvplane_planner_tick_seconds_count") == 3
    assert measured(samples, "kvplane_planner_forward_passes_total", **pool) >= 1
    assert measured(samples, "kvplane_planner_prompt_tokens_per_second", **pool) > 0
    assert measured(samples, "kvplane_planner_forecast_prompt_tokens_per_second", **pool) > 0
    assert measured(samples, "kvplane_planner_mean_prompt_tokens", **pool) > 0
    assert measured(samples, "kvplane_planner_forecast_error_prompt_tokens_per_second", **pool) >= 0
    # 0 here: the request had ended by the tick, so no pass had a running request to count.
    assert value(samples, "kvplane_planner_mean_decode_passes", **pool) is not None
    # Named with its unit: engines' worth of KV cache.
    assert value(samples, "kvplane_planner_kv_demand_engines", **pool) is not None
    assert value(samples, "kvplane_planner_forecast_kv_demand_engines", **pool) is not None
    assert measured(samples, "kvplane_planner_pass_cost_fixed_seconds", **pool) > 0
    assert measured(samples, "kvplane_planner_pass_cost_prefill_seconds_per_token", **pool) > 0
    assert value(samples, "kvplane_planner_pass_cost_kv_seconds", **pool) is not None
    assert value(samples, "kvplane_planner_engines_wanted", **pool) == 1  # min = max = 1
    needed = "kvplane_planner_engines_needed"
    assert measured(samples, needed, **pool, constraint="itl") > 0  # the prompts arriving
    assert measured(samples, needed, **pool, constraint="ttft") > 0
    assert value(samples, needed, **pool, constraint="kv") is not None  # finished: none held


@pytest.mark.timeout(60)
async def test_a_failed_start_is_counted(tmp_path: Path) -> None:
    with socket.socket() as unused:  # bound, not listening: the controller refuses
        unused.bind(("127.0.0.1", 0))
        metrics = PlannerMetrics()
        live = LivePlanner(
            planner(1, 1), local_processes(unused.getsockname()[1], tmp_path), metrics=metrics
        )
        async with metrics_endpoint(metrics) as port:
            try:
                assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
                await asyncio.gather(*live._starts)  # the start fails (no controller)
                samples = await scrape(port)
            finally:
                await live.close()
    assert value(samples, "kvplane_planner_actuator_failures_total", operation="start") == 1


def sample(metrics: PlannerMetrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@contextlib.contextmanager
def stop_process(pid: int) -> Iterator[None]:
    """SIGSTOP `pid` (alive to the OS, answering nothing) until the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed meanwhile
            os.kill(pid, signal.SIGCONT)


async def answers(address: str) -> None:
    """Wait until the engine at `address` answers GetLoad again."""
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.OpenEngineStub(channel).GetLoad(
            pb.GetLoadRequest(), timeout=30, wait_for_ready=True
        )


@pytest.mark.timeout(60)
async def test_closing_stops_the_engines_at_once(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung engine (SIGSTOPped: its SIGTERM stays pending) does not hold up the stop of
    the others, which end gracefully while it is still waited for."""
    from planner import actuator as actuator_module

    monkeypatch.setattr(actuator_module, "_STOP_GRACE_S", 3600.0)
    actuator = setup.actuator
    hung = await actuator.start("default")  # the first one stopped
    healthy = await actuator.start("default")
    hung_process, healthy_process = actuator._processes[hung], actuator._processes[healthy]
    with stop_process(hung_process.pid):
        closing = asyncio.create_task(actuator.close())
        assert await healthy_process.wait() == 0
        assert hung_process.returncode is None
    await closing
    assert actuator.num_alive() == 0


@pytest.mark.timeout(180)
async def test_a_drained_engine_that_hangs_as_it_stops_does_not_hold_up_the_ticks(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drained engine that does not exit at SIGTERM (hung: SIGSTOPped, its SIGTERM stays
    pending) is waited for beside the ticks, not in them: meanwhile the planner goes on
    observing and deciding (a load spike would be answered), and the engine still ends."""
    from planner import actuator as actuator_module

    monkeypatch.setattr(actuator_module, "_STOP_GRACE_S", 3600.0)
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    async with serving(setup, 2) as (live, _):
        live.policy = planner(1, 1)
        (drain,) = await live.tick()
        assert isinstance(drain, DrainEngine)
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 30)
        process = actuator._processes[drain.engine_id]
        with stop_process(process.pid):
            assert await live.tick() == [RemoveEngine(drain.engine_id, "default", Reason.DRAINED)]
            await asyncio.gather(*live._removals)  # the stop runs beside the ticks
            assert process.returncode is None  # still hung, and the stop is over
            assert drain.engine_id not in actuator.running()
            assert drain.engine_id not in {r.address for r in fleet.registry.records()}
            assert await live.tick() == []  # and the next one
        assert await process.wait() == 0  # resumed, it takes its SIGTERM
    assert actuator.num_alive() == 0


@pytest.mark.timeout(180)
async def test_an_engine_slow_for_one_tick_is_kept(setup: Setup) -> None:
    async with serving(setup, 1, lost_after_failed_polls=2) as (
        live,
        (address,),
    ):
        process = setup.actuator._processes[address]
        with stop_process(process.pid):
            assert await live.tick() == []  # one GetLoad unanswered
        await answers(address)
        assert await live.tick() == []  # answered: its count starts over
        with stop_process(process.pid):
            assert await live.tick() == []  # one more unanswered, not two in a row
        assert list(live.engines) == [address]
        assert live.engines[address].state is EngineState.SERVING
        assert process.returncode is None


@pytest.mark.timeout(180)
async def test_a_hung_engine_is_killed_and_replaced(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from planner import actuator as actuator_module

    # A graceful stop would wait for ever on a stopped process (its SIGTERM stays pending):
    # the tick must kill it instead.
    monkeypatch.setattr(actuator_module, "_STOP_GRACE_S", 3600.0)
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    metrics = PlannerMetrics()
    async with serving(setup, 2, lost_after_failed_polls=2, metrics=metrics) as (
        live,
        (victim, _),
    ):
        process = actuator._processes[victim]
        not_answering = {"pool": "default"}
        with stop_process(process.pid):
            assert await live.tick() == []
            assert sample(metrics, "kvplane_planner_engines_not_answering", not_answering) == 1
            # The second tick in a row without an answer: lost. Killed (a stopped process
            # holds SIGTERM pending), out of the controller, and the pool is short again.
            assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
            await asyncio.gather(*live._removals)  # the kill runs beside the ticks
            assert process.returncode == -signal.SIGKILL
            assert sample(metrics, "kvplane_planner_engines_not_answering", not_answering) == 0
        assert victim not in live.engines and victim not in actuator.running()
        assert victim not in {r.address for r in fleet.registry.records()}
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 2, 120)
        lost = metrics.registry.get_sample_value(
            "kvplane_planner_engines_lost_total", {"pool": "default", "cause": "unresponsive"}
        )
        assert lost == 1
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_a_stop_that_raises_at_close_stops_every_engine_and_names_it(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose stop raises at the close (its port file, which the stop drops once the
    controller no longer lists it, became a folder) is stopped and out of the controller all
    the same, as the others are: the failure is logged once, naming it, and the close ends."""
    caplog.set_level(logging.ERROR, logger="planner.actuator")
    actuator = setup.actuator
    failing = await actuator.start("default")
    other = await actuator.start("default")
    processes = [actuator._processes[failing], actuator._processes[other]]
    port_file = actuator._port_files[failing]
    port_file.unlink()
    port_file.mkdir()
    await actuator.close()
    assert [await process.wait() for process in processes] == [0, 0]
    assert actuator.num_alive() == 0 and actuator.running() == []
    assert len(setup.app.controller.fleet.registry) == 0
    (said,) = [r for r in caplog.records if r.name == "planner.actuator"]
    assert said.getMessage() == f"stopping engine {failing} at close failed"
    assert said.exc_info is not None and isinstance(said.exc_info[1], IsADirectoryError)


@pytest.mark.timeout(180)
async def test_a_removal_whose_stop_raises_stops_the_engine_and_says_so_truly(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A removal while the planner runs whose stop raises (the engine's port file, which the
    stop drops once the controller no longer lists it, became a folder): the engine is out of
    the controller and its process ended all the same, and the planner's one error line says
    the stop failed and why, counted. It used to add "(it may run on)", untrue of a local
    engine, which the stop terminates whatever its removal did."""
    caplog.set_level(logging.ERROR, logger="planner.live")
    fleet = setup.app.controller.fleet
    async with serving(setup, 1) as (live, [address]):
        process = setup.actuator._processes[address]
        port_file = setup.actuator._port_files[address]
        port_file.unlink()
        port_file.mkdir()
        await live._remove(live.engines[address])
        await asyncio.gather(*live._removals)
        assert await process.wait() == 0
        assert address not in {r.address for r in fleet.registry.records()}
        (said,) = [r for r in caplog.records if r.name == "planner.live"]
        assert said.getMessage().startswith(f"stopping {address} failed: ")
        assert "may run on" not in said.getMessage()
        failures = live.metrics.registry.get_sample_value(
            "kvplane_planner_actuator_failures_total", {"operation": "stop"}
        )
        assert failures == 1


def admin_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the planner's admin client logged: not grpc.aio's spurious wake-up errors
    (tests/logged_errors.py), which a loaded machine adds to `caplog`'s records."""
    return [r for r in caplog.records if r.name == "planner.controller_admin"]


async def test_a_removal_the_controller_does_not_take_is_said(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """RemoveEngine of an engine the controller does not list is no news; one that fails
    otherwise (here: no controller answers) is logged, not swallowed."""
    caplog.set_level(logging.WARNING, logger="planner.controller_admin")
    listed = ControllerAdmin(f"127.0.0.1:{setup.app.port}")
    try:
        await listed.remove("127.0.0.1:1")
    finally:
        await listed.close()
    assert not admin_records(caplog)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        gone = ControllerAdmin(f"127.0.0.1:{unused.getsockname()[1]}")
        try:
            await gone.remove("127.0.0.1:1")
        finally:
            await gone.close()
    (said,) = admin_records(caplog)
    assert said.getMessage().startswith("controller: RemoveEngine of 127.0.0.1:1: UNAVAILABLE")


@pytest.mark.timeout(60)
async def test_a_drain_at_close_the_controller_does_not_answer_is_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The planner's close drains each engine, then removes it (RemoveEngine, bounded on its
    own): a controller that accepts connections but answers nothing (hung) is not waited
    for past its first answer's time, else the drain's deadline plus that and the removal's
    would outlast the 15 s `kvplane up` gives a planner to stop (a hung controller: 10 s of
    drain, 5 s of removal). Here the drain's deadline is an hour: before, the close waited on
    it until gRPC gave up its connection attempt (20 s)."""
    caplog.set_level(logging.WARNING, logger="planner.controller_admin")
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()  # the kernel accepts; nothing reads or answers
        admin = ControllerAdmin(f"127.0.0.1:{hung.getsockname()[1]}")
        try:
            await admin.drain_all(["127.0.0.1:1"], 3600.0)
        finally:
            await admin.close()
    (said,) = admin_records(caplog)
    assert said.getMessage() == "drain of 127.0.0.1:1: the controller did not answer in 5 s"


@contextlib.asynccontextmanager
async def serving_admin(servicer: PartialAdmin) -> AsyncIterator[int]:
    """A server of `servicer`, a controller's admin API, until the block ends; its port."""
    server = grpc.aio.server()
    apb_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


class ControllerHungInDrains(PartialAdmin):
    """A controller that registers engines and routes to them at once, and answers each
    DrainEngine's first message (STARTED), then nothing more (hung, the stream open)."""

    routes = True  # whether it routes to the engines registered

    def __init__(self) -> None:
        self.registered: set[str] = set()

    async def CheckAccess(
        self, request: apb.CheckAccessRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.CheckAccessResponse:
        return apb.CheckAccessResponse()

    async def RegisterEngine(
        self, request: apb.RegisterEngineRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.WorkerInfo:
        self.registered.add(request.address)
        return apb.WorkerInfo(address=request.address)

    async def ListWorkers(
        self, request: apb.ListWorkersRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.ListWorkersResponse:
        state = "ready" if self.routes else "starting"
        workers = [
            apb.WorkerInfo(address=address, state=state, routable=self.routes)
            for address in sorted(self.registered)
        ]
        return apb.ListWorkersResponse(workers=workers)

    async def RemoveEngine(
        self, request: apb.EngineRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.WorkerInfo:
        self.registered.discard(request.engine)
        return apb.WorkerInfo(address=request.engine)

    async def DrainEngine(
        self, request: apb.DrainEngineRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.DrainResponse]:
        yield pb.DrainResponse(state=pb.DRAIN_STATE_STARTED)
        await asyncio.Event().wait()


@pytest.mark.timeout(120)
async def test_a_controller_hung_after_a_drain_s_first_answer_holds_the_close_drain_no_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The close's drain of all the engines together ends at its deadline (and
    `DRAIN_ANSWER_S` for the answers), whatever the controller does after it answered: here
    the admin calls' own bound is an hour. Before, each drain was bounded by its deadline
    plus `ADMIN_TIMEOUT_S` after its first answer, then RemoveEngine's `ADMIN_TIMEOUT_S`: a
    hung controller held the close 15 s, all of the time `kvplane up` gives a planner."""
    from planner import controller_admin as controller_admin_module

    monkeypatch.setattr(controller_admin_module, "ADMIN_TIMEOUT_S", 3600.0)
    caplog.set_level(logging.WARNING, logger="planner.controller_admin")
    controller = ControllerHungInDrains()
    async with serving_admin(controller) as port:
        actuator = local_processes(port, tmp_path)
        try:
            engines = [await actuator.start("default") for _ in range(2)]
            await actuator.close()
        finally:
            await actuator.close()
    said = [r.getMessage() for r in admin_records(caplog)]
    assert said == [f"drain of {', '.join(sorted(engines))}: not ended 1 s past its deadline"]
    assert not controller.registered  # then taken out of the controller
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_a_hung_engine_at_close_is_killed_at_the_close_s_end(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung engine (SIGSTOPped: its drain unanswered, its SIGTERM pending) is killed at
    the close's end, whatever a stop's own grace (here an hour): `kvplane up` kills a planner
    that has not stopped within its `stop_timeout_s`, and the engines, in sessions of their
    own, then get only their parent-death SIGTERM, which a stopped one never handles.
    Before, the close waited the stop's grace (20 s), past up's 15 s."""
    from planner import actuator as actuator_module

    monkeypatch.setattr(actuator_module, "_STOP_GRACE_S", 3600.0)
    actuator = setup.actuator
    hung = await actuator.start("default")
    process = actuator._processes[hung]
    caplog.set_level(logging.WARNING, logger="planner.actuator")
    with stop_process(process.pid):
        await actuator.close()
        assert process.returncode == -signal.SIGKILL
    (said,) = [r.getMessage() for r in caplog.records if r.name == "planner.actuator"]
    assert said.startswith(f"engine process(es) {process.pid} still running at the close's end")
    assert hung not in {r.address for r in setup.app.controller.fleet.registry.records()}


class ControllerRecording(ControllerHungInDrains):
    """A controller that registers engines and routes to them at once, ends each drain at
    once, answers each RemoveEngine `remove_s` late, and records the drains and removals
    asked of it, in order."""

    remove_s = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, str]] = []

    async def RemoveEngine(
        self, request: apb.EngineRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.WorkerInfo:
        self.asked.append(("remove", request.engine))
        await asyncio.sleep(self.remove_s)
        return await super().RemoveEngine(request, context)

    async def DrainEngine(
        self, request: apb.DrainEngineRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.DrainResponse]:
        self.asked.append(("drain", request.engine))
        yield pb.DrainResponse(state=pb.DRAIN_STATE_STARTED)
        yield pb.DrainResponse(state=pb.DRAIN_STATE_COMPLETE)


class ControllerRoutingNothing(ControllerRecording):
    """As `ControllerRecording`, but it routes to no engine (its first health poll not
    answered yet)."""

    routes = False

    def __init__(self) -> None:
        super().__init__()
        self.listed = False  # listed with an engine registered: its start waits for a route

    async def ListWorkers(
        self, request: apb.ListWorkersRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.ListWorkersResponse:
        self.listed = bool(self.registered)
        return await super().ListWorkers(request, context)


@pytest.mark.timeout(120)
async def test_an_engine_registered_but_not_routed_yet_at_close_is_drained_first(
    tmp_path: Path,
) -> None:
    """A start still waiting for the controller to route to its engine when the planner
    closes: the engine is registered, and the controller may route requests to it already
    (it lists it routable once its health poll answers), so the close drains it with the
    others before taking it out of the controller. Before, the cancelled start took it out
    at once, ending the streams the controller relays from it."""
    controller = ControllerRoutingNothing()
    async with serving_admin(controller) as port:
        actuator = local_processes(port, tmp_path)
        start = asyncio.create_task(actuator.start("default"))
        try:
            # Registered (the answer came), the start waits for the controller to route.
            await eventually(lambda: controller.listed, 60, "the start waiting to be routed")
            (engine,) = controller.registered
        finally:
            await close_during(actuator, start)
    assert controller.asked == [("drain", engine), ("remove", engine)]
    assert actuator.num_alive() == 0


async def close_during(actuator: LocalProcesses, start: asyncio.Task[str]) -> None:
    """The planner's close with `start` under way: the start cancelled, then the close."""
    start.cancel()
    await asyncio.wait([start])
    await actuator.close()


@pytest.mark.timeout(120)
async def test_the_close_s_time_counts_from_the_planner_s_first_signal(tmp_path: Path) -> None:
    """The time `kvplane up` gives the planner runs from its SIGTERM, not from the close's
    start: a removal under way then (its RemoveEngine answered late: a loaded controller),
    which the planner finishes first, uses part of it, and the close's drain gets only what
    is left; here nothing, so the other engine is taken out undrained rather than the close
    running past up's grace. Before, the close's time began once those removals had ended."""
    from planner.actuator import _AFTER_DRAIN_S, _EXIT_MARGIN_S

    controller = ControllerRecording()
    async with serving_admin(controller) as port:
        # A drain of 1 s at most.
        actuator = local_processes(port, tmp_path, _EXIT_MARGIN_S + _AFTER_DRAIN_S + 1.0)
        try:
            removed, other = [await actuator.start("default") for _ in range(2)]
            controller.remove_s = 1.5  # more than the drain's second
            actuator.closing()  # the planner's first signal (`run_live`)
            await actuator.stop(removed)  # the removal under way, finished first
            await actuator.close()
        finally:
            await actuator.close()
    assert controller.asked == [("remove", removed), ("remove", other)]
    assert actuator.num_alive() == 0


class ControllerRemovingTogether(ControllerRecording):
    """As `ControllerRecording`, but it answers no RemoveEngine until `together` of them are
    under way at once (a controller that takes removals only in a batch plays one that hangs
    for those asked one at a time)."""

    together = 3

    def __init__(self) -> None:
        super().__init__()
        self.removing = 0
        self.all_asked = asyncio.Event()

    async def RemoveEngine(
        self, request: apb.EngineRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.WorkerInfo:
        self.removing += 1
        if self.removing == self.together:
            self.all_asked.set()
        await self.all_asked.wait()
        return await super().RemoveEngine(request, context)


@pytest.mark.timeout(180)
async def test_removals_of_one_pool_queued_at_close_go_at_once(tmp_path: Path) -> None:
    """Removals of one pool under way when the planner closes are finished first, each
    RemoveEngine bounded: one after another, as a pool's removals go while the planner runs,
    a hung controller would have them use up the planner's time to stop in turn (three of
    them, all of it). They go at once: here the controller answers only once all three are
    asked, and every engine is taken out of it and stopped. Before, the first was given up
    alone, and the others after it, each in turn: none was taken out."""
    controller = ControllerRemovingTogether()
    async with serving_admin(controller) as port:
        actuator = local_processes(port, tmp_path)
        live = LivePlanner(planner(3, 3), actuator)
        try:
            await live.tick()
            await eventually(lambda: len(live._starts) == 0, 120, "the engines started")
            engines = sorted(live.engines)
            assert len(engines) == 3 and set(engines) == controller.registered
            for engine in list(live.engines.values()):
                await live._remove(engine)  # queued: each waits for the one before it
        finally:
            await live.close()
    assert not controller.registered  # each taken out of the controller
    assert actuator.num_alive() == 0 and not actuator.running()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".port")]  # none left to remove


@pytest.mark.timeout(120)
async def test_a_hung_controllers_removal_at_close_leaves_the_engines_their_time_to_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the close a RemoveEngine the controller does not answer is given up no later
    than `_CLOSE_EXIT_S` before the close's end, whatever its own bound (here an hour), so
    the engine still gets that time to exit on its SIGTERM; it is stopped, not killed, and
    its port file is kept for the next planner to take it out. Before, the removal was
    waited for its own bound whatever the close's time left."""
    from planner import actuator as actuator_module

    monkeypatch.setattr(actuator_module, "_CLOSE_REMOVE_S", 3600.0)
    monkeypatch.setattr(actuator_module, "_CLOSE_EXIT_S", 30.0)
    controller = ControllerRecording()
    async with serving_admin(controller) as port:
        # Half a second for the drain (answered at once) and the removal.
        stop_within_s = actuator_module._EXIT_MARGIN_S + 30.0 + 0.5
        actuator = local_processes(port, tmp_path, stop_within_s)
        try:
            engine = await actuator.start("default")
            process = actuator._processes[engine]
            controller.remove_s = 3600.0  # hung
            await actuator.close()
        finally:
            await actuator.close()
    assert controller.asked == [("drain", engine), ("remove", engine)]
    assert process.returncode != -signal.SIGKILL
    assert actuator.num_alive() == 0
    assert [p for p in os.listdir(tmp_path) if p.endswith(".port")] == ["default-0.port"]


@pytest.mark.timeout(180)
async def test_a_removal_sent_before_the_first_signal_is_given_up_by_the_close_s_deadline_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A RemoveEngine sent before the planner's first signal (a scale-down's) that the
    controller does not answer is given up, as one sent once the planner closes, no later
    than `_CLOSE_EXIT_S` before the close's end, whatever its own bound (here a minute, more
    than the close's time): the engine is then sent SIGTERM with that time left to exit, it
    is stopped, not killed, and its port file is kept for the next planner to take it out.
    Before, only the calls sent once the planner closed were bounded so: this one ran to its
    own bound, past the close's end, and its engine was killed as it was sent SIGTERM."""
    from planner import actuator as actuator_module

    monkeypatch.setattr(actuator_module, "_CLOSE_EXIT_S", 30.0)
    caplog.set_level(logging.WARNING, logger="planner.actuator")
    controller = ControllerRecording()
    async with serving_admin(controller) as port:
        stop_within_s = actuator_module._EXIT_MARGIN_S + 30.0 + 0.5
        actuator = local_processes(port, tmp_path, stop_within_s)
        removal = None
        try:
            engine = await actuator.start("default")
            process = actuator._processes[engine]
            controller.remove_s = 3600.0  # hung
            removal = asyncio.create_task(actuator.stop(engine, remove_within_s=60.0))
            await eventually(lambda: controller.asked, 60, "the RemoveEngine sent")
            actuator.closing()  # the planner's first signal (`run_live`)
            await removal  # the removal under way, finished first
            await actuator.close()
        finally:
            if removal is not None:
                removal.cancel()
            await actuator.close()
    assert controller.asked == [("remove", engine)]
    assert process.returncode != -signal.SIGKILL
    assert actuator.num_alive() == 0
    assert [p for p in os.listdir(tmp_path) if p.endswith(".port")] == ["default-0.port"]
    assert [r.getMessage() for r in caplog.records] == [
        f"controller: RemoveEngine of {engine}: not answered 30 s before the close's end"
        " (the engine's time to exit): given up"
    ]


class ControllerHungInRegistrations(ControllerRecording):
    """As `ControllerRecording`, but it answers no RegisterEngine (hung), recording each."""

    async def RegisterEngine(
        self, request: apb.RegisterEngineRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> apb.WorkerInfo:
        self.asked.append(("register", request.address))
        await asyncio.Event().wait()
        raise AssertionError("never answered")


@pytest.mark.timeout(180)
async def test_a_start_cancelled_at_close_is_taken_out_by_the_close_s_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A start whose RegisterEngine the controller has not answered when the planner closes
    is cancelled: its engine is taken out of the controller (which may have taken it) and
    stopped. That RemoveEngine, not answered either, is given up as the close's others are,
    `_CLOSE_EXIT_S` before the close's end (one warning saying so), the engine stopped, not
    killed, its port file kept for the next planner. Before, it was waited for its own bound
    whatever the close's time left (a gRPC deadline's warning)."""
    from planner import actuator as actuator_module

    monkeypatch.setattr(actuator_module, "_CLOSE_EXIT_S", 30.0)
    caplog.set_level(logging.WARNING)
    controller = ControllerHungInRegistrations()
    controller.remove_s = 3600.0  # hung
    async with serving_admin(controller) as port:
        stop_within_s = actuator_module._EXIT_MARGIN_S + 30.0 + 0.5
        actuator = local_processes(port, tmp_path, stop_within_s)
        start = asyncio.create_task(actuator.start("default"))
        try:
            await eventually(lambda: controller.asked, 60, "the RegisterEngine sent")
            ((_, engine),) = controller.asked
            (process,) = actuator._spawned
            actuator.closing()  # the planner's first signal (`run_live`)
        finally:
            await close_during(actuator, start)
    assert controller.asked == [("register", engine), ("remove", engine)]
    assert process.returncode != -signal.SIGKILL
    assert actuator.num_alive() == 0
    assert [p for p in os.listdir(tmp_path) if p.endswith(".port")] == ["default-0.port"]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("planner.")] == [
        f"controller: RemoveEngine of {engine}: not answered 30 s before the close's end"
        " (the engine's time to exit): given up"
    ]


def test_the_close_leaves_the_engines_time_to_exit_within_up_s_grace() -> None:
    """By default the close ends `_EXIT_MARGIN_S` before `kvplane up` kills the planner, and
    its drain, the answers' wait and a hung controller's RemoveEngine leave the engines
    `_CLOSE_EXIT_S` between their SIGTERM and the close's end."""
    from planner.actuator import (
        _CLOSE_DRAIN_S,
        _CLOSE_EXIT_S,
        _CLOSE_REMOVE_S,
        _EXIT_MARGIN_S,
    )

    needed_s = _CLOSE_DRAIN_S + DRAIN_ANSWER_S + _CLOSE_REMOVE_S + _CLOSE_EXIT_S
    assert needed_s <= STOP_TIMEOUT_S - _EXIT_MARGIN_S


@pytest.mark.timeout(120)
async def test_a_second_ctrl_c_stops_the_engines_at_once(setup: Setup, tmp_path: Path) -> None:
    """`kvplane planner run`: the first SIGINT drains the engines (a request running on,
    for up to 5 s); a second one cuts the drain: the engines are killed, as a second Ctrl-C
    to `kvplane up` kills its members, and the planner exits cleanly, leaving none
    registered. Before, the second was ignored and the drain ran to its deadline: the
    request ended aborted, not cut."""
    workdir = tmp_path / "work"
    config = tmp_path / "planner.yaml"
    live = {"controller": f"127.0.0.1:{setup.app.port}", "workdir": str(workdir)}
    config.write_text(json.dumps({"pools": [{"min_engines": 1, "max_engines": 1}], "live": live}))
    fleet = setup.app.controller.fleet
    process = await asyncio.create_subprocess_exec(
        *DEFAULT_SIGNALS, sys.executable, "-m", "kvplane", "planner", "run",
        "--config", str(config), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        async with asyncio.timeout(60):  # started: the planner's, not a start under way
            while b"serves in pool default" not in (line := await process.stderr.readline()):
                assert line, "the planner exited"
        (engine,) = (record.address for record in fleet.registry.routable())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{setup.app.port}") as channel:
            request = generate_request("long", [1, 2, 3], max_tokens=1_000_000)
            stream = pb_grpc.OpenEngineStub(channel).Generate(request)
            await anext(aiter(stream))  # it runs on the engine
            signal_child(process, signal.SIGINT)
            await fleet.wait_for(
                lambda: fleet.registry.get(engine).state is RegistryState.DRAINING, 30
            )
            signal_child(process, signal.SIGINT)
            events = []
            with contextlib.suppress(grpc.aio.AioRpcError):
                events = [response.WhichOneof("event") async for response in stream]
        _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            signal_child(process, signal.SIGKILL)
            await process.wait()
    log = stderr.decode()
    assert "finished" not in events  # cut, not aborted at the drain's deadline
    assert process.returncode == 0, log
    assert "interrupted while closing: killing the engines now" in log
    assert processes_running(str(workdir)) == []
    await fleet.wait_for(lambda: not fleet.registry.records(), 30)


async def failed_start(actuator: LocalProcesses) -> str:
    """Why `actuator`'s start of an engine of `default` failed (it is closed then)."""
    try:
        with pytest.raises(KvplaneError) as failed:
            await actuator.start("default")
    finally:
        await actuator.close()
    return str(failed.value)


def engines_spawned(workdir: Path) -> int:
    """How many engine processes of pool default a LocalProcesses in `workdir` ever spawned:
    each writes a log of its own, kept when it ends."""
    return len(list(workdir.glob("default-*.log")))


def failing_engines(workdir: Path, controller_port: int) -> LocalProcesses:
    """Engines that exit at once, as an operator's typo in the model path makes them."""
    return LocalProcesses(
        controller=f"127.0.0.1:{controller_port}",
        engine_args=("--model", str(workdir / "no-such-model")),
        workdir=workdir,
        start_timeout_s=120,
    )


@pytest.mark.timeout(120)
async def test_an_engine_that_exits_at_once_is_said_with_its_log(
    setup: Setup, tmp_path: Path
) -> None:
    """The failed start's line says why (its log's last lines) and where to read more, not
    only "exited with 2"."""
    actuator = failing_engines(tmp_path, setup.app.port)
    message = await failed_start(actuator)
    assert message.startswith("engine default-0 did not start: exited with code 2; its log ")
    assert f"{tmp_path / 'default-0.log'} ends: " in message
    assert "Invalid value for --model" in message and "\n" not in message
    assert actuator.num_alive() == 0 and not setup.app.controller.fleet.registry.records()


@pytest.mark.timeout(120)
async def test_a_pool_whose_engines_fail_to_start_backs_off(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A start that fails is retried at the next tick once; after a second failure in a row
    the pool's next start waits (here an hour), counted as STARTING meanwhile: no process
    spawned and no engine log written at every tick."""
    caplog.set_level(logging.INFO, "planner.live")
    actuator = failing_engines(tmp_path, setup.app.port)
    live = LivePlanner(planner(1, 1), actuator, start_backoff=StartBackoff(3600.0, 3600.0, 3600.0))
    try:
        for _ in range(2):
            assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
            await asyncio.gather(*live._starts)
        failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(failures) == 2
        assert "(the next start waits" not in failures[0]  # the first is retried at once
        assert failures[1].endswith("(the next start waits 3600 s)")
        assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
        # It waits as STARTING: the core asks for nothing more, nothing is spawned.
        assert [e.state for e in live.engines.values()] == [EngineState.STARTING]
        assert await live.tick() == []
        done, _ = await asyncio.wait(live._starts, timeout=2)
        assert not done
        assert engines_spawned(tmp_path) == 2  # not one a tick
    finally:
        await live.close()
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_engines_of_a_pool_that_fail_to_start_together_are_one_failure(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two engines one decision starts that both fail (a model path that does not exist) are
    one failure of their pool, as two lost in one look are: both retried at once at the next
    tick, and the pool waits (an hour here) only once those fail too. Counted one by one,
    the pool waited after its first attempt."""
    caplog.set_level(logging.ERROR, "planner.live")
    actuator = failing_engines(tmp_path, setup.app.port)
    live = LivePlanner(planner(2, 2), actuator, start_backoff=StartBackoff(3600.0, 3600.0, 3600.0))
    try:
        for attempt in range(2):
            assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
            await asyncio.gather(*live._starts)
            failures = [r.getMessage() for r in caplog.records]
            caplog.clear()
            assert len(failures) == 2
            waits = [f.endswith("(the next start waits 3600 s)") for f in failures]
            assert waits == [attempt == 1] * 2, failures
        assert engines_spawned(tmp_path) == 4
    finally:
        await live.close()
    assert actuator.num_alive() == 0


@pytest.mark.timeout(180)
async def test_engines_that_keep_crashing_while_serving_back_off(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that exits on its own soon after it began serving (within `crash_within_s`:
    an hour here) is replaced at the next tick; when its replacement exits too,
    the pool's next start waits: a crash loop is not a new engine every tick."""
    caplog.set_level(logging.WARNING, "planner.live")
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    backoff = StartBackoff(3600.0, 3600.0, 3600.0)
    async with serving(setup, 1, start_backoff=backoff) as (live, _):
        for crash in range(2):
            (victim,) = live.engines
            process = actuator._processes[victim]
            os.kill(process.pid, signal.SIGKILL)
            await process.wait()
            assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
            if crash == 0:  # the first: replaced at once
                await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 120)
                await fleet.wait_for(lambda: len(live._starts) == 0, 30)
        assert any(
            r.getMessage() == "engines of default keep failing: (the next start waits 3600 s)"
            for r in caplog.records
        )
        assert [e.state for e in live.engines.values()] == [EngineState.STARTING]
        done, _ = await asyncio.wait(live._starts, timeout=2)
        assert not done
        assert engines_spawned(tmp_path) == 2  # the first and its replacement
    assert actuator.num_alive() == 0


@pytest.mark.timeout(240)
async def test_engines_lost_after_serving_a_while_are_replaced_at_once(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine killed after it served longer than `crash_within_s` (a minute here; killed
    by hand, its node lost) proves its pool's engines start and serve: no crash
    loop. Each is replaced at the next tick, however many in a row, and a pool below its
    minimum never waits (an hour here) empty: the kubelet backs off a container that keeps
    crashing, a ReplicaSet replaces a lost pod at once."""
    caplog.set_level(logging.WARNING, "planner.live")
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    now_s = 1000.0
    backoff = StartBackoff(3600.0, 3600.0, 60.0)
    async with serving(setup, 1, start_backoff=backoff, clock=lambda: now_s) as (live, _):
        for _ in range(3):
            now_s += 120.0
            assert await live.tick() == []  # it answers, two minutes after it began serving
            (victim,) = live.engines
            process = actuator._processes[victim]
            os.kill(process.pid, signal.SIGKILL)
            await process.wait()
            assert await live.tick() == [ScalePool("default", 1, Reason.BELOW_MIN)]
            assert not [r for r in caplog.records if "keep failing" in r.getMessage()]
            await fleet.wait_for(lambda: len(live._starts) == 0, 30)
            assert [e.state for e in live.engines.values()] == [EngineState.SERVING]
            assert victim not in live.engines
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 120)
        assert engines_spawned(tmp_path) == 4  # the first and one replacement per kill
    assert actuator.num_alive() == 0


@pytest.mark.timeout(180)
async def test_engines_of_a_pool_lost_at_once_are_one_failure(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """Two engines of a pool killed together (a node failure) are found in one look at the
    fleet: one failure, retried at once as a single crash is, not a back-off (an hour here)."""
    caplog.set_level(logging.WARNING, "planner.live")
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    async with serving(setup, 2, start_backoff=StartBackoff(3600.0, 3600.0, 3600.0)) as (
        live,
        victims,
    ):
        processes = [actuator._processes[victim] for victim in victims]
        for process in processes:
            os.kill(process.pid, signal.SIGKILL)
        await asyncio.gather(*(process.wait() for process in processes))
        assert await live.tick() == [ScalePool("default", 2, Reason.BELOW_MIN)]
        assert not [r for r in caplog.records if "keep failing" in r.getMessage()]
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 2, 120)
        await fleet.wait_for(lambda: len(live._starts) == 0, 30)
        assert not set(live.engines) & set(victims)
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_an_engine_on_a_dead_engines_port_is_not_taken_out_in_its_place(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planner restarted on a killed one's workdir whose controller did not answer its
    first looks (the dead engines' port files are kept) starts an engine that gets the port
    of one of them: ports are reused (injected here: the dead run's port file is written,
    with the new engine's port, as the new engine's port is read). The next look must not
    take the new engine out of the controller as the dead one: it is routed to still, and
    the dead run's port file is gone."""
    from planner import actuator as actuator_module

    fleet, actuator = setup.app.controller.fleet, setup.actuator
    dead_port_file = tmp_path / "default-7.port"
    read_port = actuator_module._read_port

    def port_of_a_dead_engine(path: Path) -> int | None:
        port = read_port(path)
        if port is not None and path != dead_port_file and not dead_port_file.exists():
            dead_port_file.write_text(str(port))
            actuator._left_registered[f"127.0.0.1:{port}"] = dead_port_file
        return port

    monkeypatch.setattr(actuator_module, "_read_port", port_of_a_dead_engine)
    try:
        address = await actuator.start("default")
        assert await actuator.adopt() == []
        assert [r.address for r in fleet.registry.routable()] == [address]
        assert not dead_port_file.exists()
        assert (tmp_path / "default-0.port").exists()  # the new engine's
    finally:
        await actuator.close()


def listen_at(monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    """The local actuator's next engines listen at `address` rather than at a port the OS
    picks: an address the OS may give again once its engine is dead (ports are reused)."""
    from planner import actuator as actuator_module

    def serve_args_at(*args: Any) -> list[str]:
        return [address if arg == "127.0.0.1:0" else arg for arg in serve_args(*args)]

    monkeypatch.setattr(actuator_module, "serve_args", serve_args_at)


async def crash(actuator: LocalProcesses, address: str) -> None:
    """The engine at `address` killed from outside (SIGKILL), its exit collected."""
    process = actuator._processes[address]
    os.kill(process.pid, signal.SIGKILL)
    await process.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controller_restarts", [False, True])
async def test_a_start_that_gets_a_crashed_engines_port_settles_it_first(
    setup: Setup,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    controller_restarts: bool,
) -> None:
    """An engine crashes and, before the next look (`exited`), a start's engine gets its port
    (ports are reused: injected here). The start settles the dead engine first: its exit
    said, its port file dropped, taken out of the controller (which would refuse the new
    engine's registration while it lists the dead one; a restarted one lists neither), and
    no longer reported by `exited`; then the new engine is registered and routed to."""
    actuator, app = setup.actuator, setup.app
    dead = await actuator.start("default")
    await crash(actuator, dead)
    if controller_restarts:
        await app.close(0.2)
        config = {"listen": f"127.0.0.1:{app.port}", "shutdown_grace_s": 0.5}
        app = await start_controller(ControllerConfig.model_validate(config))
        admin = actuator._admin  # its dial back-off: what a start's check waits out
        await eventually(lambda: passes(admin.check_reachable("default")), 60)
    try:
        fleet = app.controller.fleet
        listed = [r.address for r in fleet.registry.records()]
        assert listed == ([] if controller_restarts else [dead])
        listen_at(monkeypatch, dead)
        assert await actuator.start("default") == dead
        assert actuator.exited() == []
        assert actuator.running() == [dead]
        assert [r.address for r in fleet.registry.routable()] == [dead]
        assert not (tmp_path / "default-0.port").exists()
        assert dead == f"127.0.0.1:{int((tmp_path / 'default-1.port').read_text())}"
        assert f"({dead}) exited with code -9 (SIGKILL)" in caplog.text
        await actuator.close()
        assert not fleet.registry.records()
    finally:
        await actuator.close()
        await app.close(0.2)


async def passes(check: Awaitable[None]) -> bool:
    """Whether `check` raises no KvplaneError."""
    try:
        await check
    except KvplaneError:
        return False
    return True


@pytest.mark.timeout(120)
async def test_an_engine_whose_address_a_start_got_is_lost_and_its_channel_closed(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine crashes and, before the next tick's look, a start under way (one the core
    asked for earlier) gets its port: the planner observes the new engine at that address in
    place of the dead one, which is lost as an engine that exited (counted), its channel
    closed and its runtime events no longer followed; the next tick finds nothing exited."""
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    metrics = PlannerMetrics()
    async with serving(setup, 1, metrics=metrics) as (live, (dead,)):
        gone = live.engines[dead]
        await crash(actuator, dead)
        listen_at(monkeypatch, dead)
        await live._apply(ScalePool("default", 2, Reason.BELOW_MIN), live._clock())
        await fleet.wait_for(lambda: len(live._starts) == 0, 60)
        assert list(live.engines) == [dead]
        assert live.engines[dead] is not gone
        assert gone.events is not None and gone.events.done()
        assert gone.dialled is not None
        assert gone.dialled.channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN
        lost = {"pool": "default", "cause": "exited"}
        assert metrics.registry.get_sample_value("kvplane_planner_engines_lost_total", lost) == 1
        assert await live.tick() == []
        assert list(live.engines) == [dead] and actuator.running() == [dead]
        assert [r.address for r in fleet.registry.routable()] == [dead]
    assert actuator.num_alive() == 0


class HeldRemoval:
    """The actuator's first RemoveEngine held (`entered` set) until `go` is set; and whether
    `starting` waited for `_registering` while another held it (`start_waits`)."""

    def __init__(self, actuator: LocalProcesses) -> None:
        self.entered, self.go, self.start_waits = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.starting: asyncio.Task[str] | None = None
        remove, held = actuator._admin.remove, self

        async def held_remove(address: str, within_s: float = ADMIN_TIMEOUT_S) -> bool:
            if not held.entered.is_set():
                held.entered.set()
                await held.go.wait()
            return await remove(address, within_s)

        class WatchedLock(asyncio.Lock):
            async def acquire(self) -> Literal[True]:
                if asyncio.current_task() is held.starting and self.locked():
                    held.start_waits.set()
                return await super().acquire()

        actuator._admin.remove = held_remove  # type: ignore[method-assign]
        actuator._registering = WatchedLock()


@pytest.mark.timeout(120)
async def test_a_crashed_engines_stop_under_way_leaves_a_start_on_its_port_alone(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crashed engine's stop (`exited` reported it) is under way, its RemoveEngine not
    answered yet, when a start's engine gets its port. The stop takes out the dead engine
    only: not the new engine's registration, nor its process; the start registers its engine
    once the dead one is out of the controller."""
    actuator, fleet = setup.actuator, setup.app.controller.fleet
    dead = await actuator.start("default")
    await crash(actuator, dead)
    assert actuator.exited() == [dead]
    held = HeldRemoval(actuator)
    stopping = asyncio.create_task(actuator.stop(dead))
    await held.entered.wait()
    listen_at(monkeypatch, dead)
    held.starting = starting = asyncio.create_task(actuator.start("default"))
    # The start ends, or waits for the stop to end first.
    start_waits = asyncio.ensure_future(held.start_waits.wait())
    await asyncio.wait([starting, start_waits], return_when=asyncio.FIRST_COMPLETED)
    start_waits.cancel()
    held.go.set()
    await stopping
    assert await starting == dead
    assert actuator.running() == [dead] and actuator.num_alive() == 1
    assert actuator._processes[dead].returncode is None
    assert [r.address for r in fleet.registry.routable()] == [dead]


@pytest.mark.timeout(120)
async def test_a_removal_made_after_a_start_got_its_address_leaves_the_new_engine_alone(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine crashes; a tick finds it exited while a start under way waits to register
    its engine, which got the dead one's port; its removal waits for an earlier one of its
    pool. The start settles the dead engine, and the planner observes the new one; the
    removal, for the dead engine, is not made: the new engine serves on."""
    fleet, actuator = setup.app.controller.fleet, setup.actuator
    async with serving(setup, 1) as (live, (dead,)):
        await crash(actuator, dead)
        listen_at(monkeypatch, dead)
        await actuator._registering.acquire()  # the start waits before it takes the port over
        await live._apply(ScalePool("default", 2, Reason.BELOW_MIN), live._clock())
        await eventually((actuator._workdir / "default-1.port").exists, 60)
        earlier = asyncio.Event()

        async def earlier_removal() -> None:  # of the pool, under way
            await earlier.wait()

        removal = asyncio.create_task(earlier_removal())
        live._removals[removal] = "default"
        removal.add_done_callback(live._removals.pop)
        await live.tick()
        assert dead not in live.engines and len(live._removals) == 2
        actuator._registering.release()
        await fleet.wait_for(lambda: len(live._starts) == 0, 60)
        assert list(live.engines) == [dead]
        earlier.set()
        await asyncio.wait(list(live._removals))
        assert actuator.running() == [dead] and actuator.num_alive() == 1
        assert [r.address for r in fleet.registry.routable()] == [dead]
        assert await live.tick() == []
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_a_crashed_engine_whose_port_a_failed_start_got_is_lost_at_the_next_tick(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine crashes and a start's engine gets its port, settles it, then fails (its
    registration refused). The dead engine is the planner's still: the next tick finds it
    exited, lost as such, at once (not polled until it counts as unresponsive)."""
    actuator = setup.actuator
    metrics = PlannerMetrics()

    async def refused(address: str) -> None:
        raise KvplaneError(f"registration of {address} refused")

    async with serving(setup, 1, metrics=metrics) as (live, (dead,)):
        await crash(actuator, dead)
        listen_at(monkeypatch, dead)
        monkeypatch.setattr(actuator._admin, "register", refused)
        await live._apply(ScalePool("default", 2, Reason.BELOW_MIN), live._clock())
        await asyncio.gather(*live._starts)
        assert list(live.engines) == [dead]
        await live.tick()
        assert dead not in live.engines
        lost = {"pool": "default", "cause": "exited"}
        assert metrics.registry.get_sample_value("kvplane_planner_engines_lost_total", lost) == 1
        await asyncio.gather(*live._removals)
        assert actuator.exited() == [] and actuator.running() == []
    assert actuator.num_alive() == 0


@pytest.mark.timeout(120)
async def test_an_engine_stopped_while_the_controller_is_unreachable_is_taken_out_later(
    setup: Setup, tmp_path: Path
) -> None:
    """An engine of this run stopped while the controller does not answer (a partition
    between the planner and it): its RemoveEngine fails, its port file is kept, and a later
    look (each tick's `adopt`) takes it out once the controller answers again. Else the
    controller lists the dead engine, unreachable, for good."""
    fleet = setup.app.controller.fleet
    partition = await TcpForwarder.start(f"127.0.0.1:{setup.app.port}")
    workdir = tmp_path / "behind-a-partition"
    workdir.mkdir()
    actuator = LocalProcesses(
        controller=partition.address,
        engine_args=("--model", "sim"),
        workdir=workdir,
        start_timeout_s=120,
    )
    try:
        address = await actuator.start("default")
        port_file = workdir / "default-0.port"
        await partition.cut()
        await actuator.stop(address)
        assert port_file.exists()  # its RemoveEngine failed
        assert await actuator.adopt() == []  # still unreachable: tried again at the next
        assert port_file.exists()
        assert [r.address for r in fleet.registry.records()] == [address]

        await partition.mend()

        async def taken_out() -> bool:
            await actuator.adopt()
            return not fleet.registry.records()

        await eventually(taken_out, 60, "the next looks to take the stopped engine out")
        assert not port_file.exists()
    finally:
        await actuator.close()
        await partition.cut()


class RemoveEngineOnAClosedChannel:
    """The planner's admin stub, each call made as it is, but RemoveEngine, made on a
    channel closed under it: grpc.aio raises UsageError, no gRPC status, nothing sent."""

    def __init__(self, stub: apb_grpc.AdminAsyncStub, closed: grpc.aio.Channel) -> None:
        self._stub = stub
        self.RemoveEngine = apb_grpc.AdminStub(closed).RemoveEngine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


@pytest.mark.timeout(120)
async def test_an_engine_whose_removal_raises_is_stopped_and_taken_out_by_the_next_look(
    setup: Setup, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine stopped whose RemoveEngine raises an exception that is no gRPC status (the
    call made on a channel closed under it): the engine is stopped, the error said once with
    its traceback, and its port file kept, so that the next look takes the engine, which the
    controller lists still, out, then drops the file. The stop used to raise before its
    port-file bookkeeping: this run never took the engine out of the controller, and the file
    stayed for a later planner on the workdir."""
    caplog.set_level(logging.WARNING, logger="planner")
    actuator, fleet = setup.actuator, setup.app.controller.fleet
    address = await actuator.start("default")
    process, port_file = actuator._processes[address], actuator._port_files[address]
    dialled = actuator._admin._dialled
    admin, gateway = dialled.stub
    closed = grpc.aio.insecure_channel(dialled.target)
    await closed.close()
    monkeypatch.setattr(dialled, "_stub", (RemoveEngineOnAClosedChannel(admin, closed), gateway))
    await actuator.stop(address)
    assert await process.wait() == 0
    assert port_file.exists()
    assert [r.address for r in fleet.registry.records()] == [address]
    (said,) = [r for r in caplog.records if r.name.startswith("planner")]
    assert said.getMessage() == f"controller: RemoveEngine of {address} failed"
    assert said.exc_info is not None and isinstance(said.exc_info[1], grpc.aio.UsageError)

    monkeypatch.undo()  # the channel as it was
    assert await actuator.adopt() == []
    assert not fleet.registry.records()
    assert not port_file.exists()


@pytest.mark.timeout(60)
async def test_a_planner_cancelled_as_its_run_ends_is_cancelled(tmp_path: Path) -> None:
    """`run` cancelled as it ends (it waits for its watch of the controller to end: a term
    as leader ending, a task group failing) raises CancelledError to its caller: swallowed
    with the watch's own, the caller went on as if `run` had returned."""
    live = LivePlanner(planner(1, 1), local_processes(1, tmp_path))
    stop = asyncio.Event()
    stop.set()  # it ends at once
    try:
        running = asyncio.create_task(live.run(stop, 1.0))
        await asyncio.sleep(0)  # it waits for its watch to end
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    finally:
        await live.close()


@pytest.mark.timeout(120)
async def test_children_that_exited_are_not_kept(setup: Setup, tmp_path: Path) -> None:
    """A pool whose engines fail for days: the actuator's table of its children holds those
    alive (here none) and at most the last one started, not every child ever started."""
    actuator = failing_engines(tmp_path, setup.app.port)
    try:
        for _ in range(3):
            with pytest.raises(KvplaneError):
                await actuator.start("default")
        assert engines_spawned(tmp_path) == 3
        assert len(actuator._spawned) == 1 and actuator.num_alive() == 0
    finally:
        await actuator.close()


@pytest.mark.timeout(180)
async def test_a_planner_restarted_after_sigkill_takes_its_dead_engines_out(
    setup: Setup, tmp_path: Path
) -> None:
    """`kvplane planner run` SIGKILLed: its engine dies with it, but the controller still
    lists it. Restarted on the same workdir, the planner takes it out of the controller (its
    port file names it) and starts its own anew, writing over none of the dead run's logs."""
    workdir = tmp_path / "work"
    fleet = setup.app.controller.fleet
    dead = await killed_planner(setup, workdir)
    assert [r.address for r in fleet.registry.records()] == [dead]  # listed, unreachable
    dead_log = (workdir / "default-0.log").read_bytes()

    restarted = local_processes(setup.app.port, workdir)
    live = LivePlanner(planner(1, 1), restarted)
    try:
        await live.tick()
        assert dead not in {r.address for r in fleet.registry.records()}
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 120)
        await fleet.wait_for(lambda: len(live._starts) == 0, 30)
        assert [r.address for r in fleet.registry.records()] == sorted(live.engines)
    finally:
        await live.close()
    assert (workdir / "default-0.log").read_bytes() == dead_log
    assert (workdir / "default-1.log").exists()
    # Stopped cleanly, it leaves no port file: nothing for the next start to take out.
    assert not list(workdir.glob("*.port"))


async def test_a_controller_whose_connection_went_silent_is_asked_on_a_new_one() -> None:
    """The planner's connection to its controller goes silent without a reset (a host gone,
    a blackholed path: a forwarder that drops what it reads, both ways), while the
    controller answers new connections: the tick's ListWorkers that times out has the next
    one made on a new connection, which the controller answers. Before, every tick asked on
    the silent connection, each timing out, until the kernel gave up on it (some 15
    minutes): the planner could not see its engines, nor register one."""
    app = await start_controller(ControllerConfig.model_validate({"listen": "127.0.0.1:0"}))
    forwarder = await TcpForwarder.start(f"127.0.0.1:{app.port}")
    admin = ControllerAdmin(forwarder.address)
    try:
        assert await admin.registered_by("planner") == []
        forwarder.silence()
        assert await admin.registered_by("planner") is None  # timed out
        assert await admin.registered_by("planner") == []
        assert forwarder.tunnels == 2
    finally:
        await admin.close()
        await forwarder.cut()
        await app.close(0.2)


@pytest.mark.timeout(180)
async def test_an_engine_whose_connection_went_silent_is_polled_on_a_new_one(
    setup: Setup,
) -> None:
    """The planner's connection to a serving engine (here through a forwarder) goes silent
    without a reset, while the engine answers new connections: the GetLoad that times out
    has the next made on a new connection, which the engine answers, and the engine is
    kept. Before, every GetLoad went on the silent connection, and after
    `lost_after_failed_polls` ticks the planner killed the healthy engine and started
    another."""
    async with serving(setup, 1, lost_after_failed_polls=2) as (live, (address,)):
        forwarder = await TcpForwarder.start(address)
        engine = live.engines[address]
        engine.dialled = Redialling(INSECURE, forwarder.address, pb_grpc.OpenEngineStub)
        try:
            assert await live.tick() == []
            forwarder.silence()
            assert await live.tick() == []  # its GetLoad unanswered
            assert await live.tick() == []  # answered on a new connection: kept
            assert live.engines[address].failed_polls == 0
            assert setup.actuator._processes[address].returncode is None
        finally:
            await forwarder.cut()
