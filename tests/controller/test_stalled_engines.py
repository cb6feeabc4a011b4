"""Streams held by an engine that stops answering without closing its connections (a
SIGSTOPped process here, as a wedged process or a host gone without a TCP reset): once the
health poller has found it unreachable for `health.abandon_streams_after_s`, the gateway ends
them as it ends a removed engine's (a stream without output is answered by another engine,
one with output ends with the error for a lost engine, naming it and why); an engine back
before that keeps its streams. The stopped engine is a real `kvplane engine serve` process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from controller.outcomes import ENGINE_METADATA_KEY
from controller.registry import EngineState
from engine.config import LoraConfig
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    ServedEngine,
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_admin_cli import cli
from tests.controller.test_gateway import PREFIX
from tests.controller.test_processes import _wait_port
from tests.engine.lora_adapters import write_adapter_config
from tests.grpc_streams import next_reply, remaining_replies
from tests.polling import eventually

pytestmark = pytest.mark.timeout(120)


class EngineProcess:
    """`kvplane engine serve --model sim` in its own process (real-time sim timing), which a
    test can stop (SIGSTOP: its sockets stay open, nothing answers) and resume."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port

    @classmethod
    async def start(
        cls,
        tmp_path: Path,
        instance_id: str,
        role: str = "aggregated",
        config: str = "{}",
        port: int = 0,
    ) -> EngineProcess:
        """`config`: the engine's YAML (the options given here override it); `port`: 0 for
        a free one."""
        port_file = tmp_path / f"{instance_id}.port"
        config_file = tmp_path / f"{instance_id}.yaml"
        config_file.write_text(config)
        proc = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, "-m", "kvplane", "engine", "serve", "--model", "sim",
             "--listen", f"127.0.0.1:{port}", "--instance-id", instance_id, "--role", role,
             "--config", str(config_file), "--port-file", str(port_file)],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{instance_id}.log").open("wb"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # A SIGSTOPped process in the launcher's group would get SIGHUP if that group were
            # orphaned (a launching shell that exits); a session of its own is never.
            start_new_session=True,
        )  # fmt: skip
        try:
            port = await asyncio.to_thread(_wait_port, port_file, proc)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return cls(proc, port)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    async def close(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
async def stalling(tmp_path: Path) -> AsyncIterator[EngineProcess]:
    engine = await EngineProcess.start(tmp_path, "stalling")
    try:
        yield engine
    finally:
        await engine.close()


async def fleet_with(
    stalling: EngineProcess, abandon_after_s: float, **controller: Any
) -> EngineFleet[ServedEngine]:
    """A controller in front of the process and an in-process sim engine ("healthy")."""
    healthy = await start_sim_engine("healthy", time_scale=1.0)
    return await make_fleet(
        engines=[stalling, healthy],
        health={"abandon_streams_after_s": abandon_after_s},
        **controller,
    )


async def only_on(fleet: EngineFleet[Any], stalling: EngineProcess) -> str:
    """Route every new request to the process (the healthy engine cordoned); its address."""
    await fleet.admin.Cordon(apb.EngineRef(engine="healthy"))
    return f"127.0.0.1:{stalling.port}"


async def nothing_in_flight(fleet: EngineFleet[Any]) -> None:
    """What the controller counts in flight is back to zero (`kvplane admin workers`)."""
    workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    assert [w.inflight_requests for w in workers.workers] == [0, 0], workers
    relay = fleet.app.gateway.relay
    assert not relay.holding and not relay.running


async def engine_runs_nothing(address: str) -> None:
    """The engine process itself freed every request (the gateway's calls to it ended)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.OpenEngineStub(channel)

        async def idle() -> bool:
            load = await stub.GetLoad(pb.GetLoadRequest(), timeout=5)
            return load.running_requests == 0 and load.queued_requests == 0

        await eventually(idle, timeout_s=20)


async def test_a_stream_stopped_before_its_first_token_is_answered_by_another_engine(
    stalling: EngineProcess,
) -> None:
    fleet = await fleet_with(stalling, abandon_after_s=1.0, router={"session_metadata_key": "s"})
    try:
        # A session started on the process: its next request goes there too while it is
        # routable, and, once abandoned there, to the other engine.
        stopped = await only_on(fleet, stalling)
        warm = [r async for r in fleet.gateway.Generate(generate_request("warm", [1], s="pin"))]
        assert warm[-1].WhichOneof("event") == "finished", warm[-1]
        await fleet.admin.Uncordon(apb.EngineRef(engine="healthy"))
        stalling.stop()  # before the request arrives: it cannot have answered anything
        request = generate_request("held", [*PREFIX, 1], max_tokens=8, s="pin")
        stream = asyncio.create_task(remaining_replies(fleet.gateway.Generate(request)))

        async def held_by_the_stopped_engine() -> bool:
            return fleet.app.gateway.relay.holding.get("held") == stopped

        await eventually(held_by_the_stopped_engine)
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            responses = await stream
        # Answered while the process is still stopped: by the other engine, in full.
        assert stalling.proc.poll() is None
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]
        assert num_tokens(responses) == 8
        assert not [r for r in responses if r.WhichOneof("event") == "error"]
        await nothing_in_flight(fleet)
        stalling.resume()
        await engine_runs_nothing(stopped)
    finally:
        await close_fleet(fleet)


async def test_streams_stopped_after_output_end_with_an_error_naming_the_engine(
    stalling: EngineProcess,
) -> None:
    """OpenEngine: one in-band EngineError; vllm.Generate (no in-band error): UNAVAILABLE."""
    fleet = await fleet_with(stalling, abandon_after_s=1.0)
    try:
        stopped = await only_on(fleet, stalling)
        streams = await two_streams_past_their_first_token(fleet)
        stalling.stop()
        await streams.end_naming(f"engine {stopped} unreachable for ")
        await nothing_in_flight(fleet)
        # Back, the engine finds both streams cancelled and frees their requests.
        stalling.resume()
        await engine_runs_nothing(stopped)
    finally:
        await close_fleet(fleet)


class TwoStreams(NamedTuple):
    """An OpenEngine Generate and a vllm.Generate stream through the controller."""

    openengine: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]
    vllm: grpc.aio.UnaryStreamCall[Any, Any]

    async def end_naming(self, why: str) -> None:
        """Both end as on an engine lost after output, saying `why` (the engine and what
        happened to it): OpenEngine with one in-band EngineError, vllm.Generate (no in-band
        error) UNAVAILABLE."""
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            rest = await remaining_replies(self.openengine)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await remaining_replies(self.vllm)
        error = rest[-1]
        assert error.WhichOneof("event") == "error", error
        assert [r.WhichOneof("event") for r in rest].count("error") == 1
        assert why in error.error.message, error
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert (err.value.details() or "").startswith(why), err.value


async def two_streams_past_their_first_token(fleet: EngineFleet[Any]) -> TwoStreams:
    """Long streams (OpenEngine and vllm.Generate), each read up to its first token."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    openengine = fleet.gateway.Generate(generate_request("oe", [*PREFIX, 1], max_tokens=100_000))
    vllm = vpb_grpc.GenerateStub(fleet.channel).GenerateStream(
        vpb.GenerateRequest(
            request_id="vllm", model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 2]),
            stopping=vpb.StoppingCriteria(max_new_tokens=100_000, ignore_eos=True),
        )
    )  # fmt: skip
    while (await next_reply(openengine)).WhichOneof("event") != "token":
        pass
    while not (await next_reply(vllm)).outputs.num_tokens:
        pass
    return TwoStreams(openengine, vllm)


async def test_an_engine_back_before_the_limit_keeps_its_streams(
    stalling: EngineProcess,
) -> None:
    """A pause longer than a poll's timeout, shorter than the limit: the connection holding
    the stream, on which a poll timed out, answers the poll made on it once the engine
    answers on a new one (`Fleet._end_silent_calls`), and keeps the stream."""
    fleet = await fleet_with(stalling, abandon_after_s=10.0)
    try:
        stopped = await only_on(fleet, stalling)
        registry = fleet.app.controller.fleet.registry
        request = generate_request("paused", [*PREFIX, 1], max_tokens=400)
        stream = fleet.gateway.Generate(request)
        first = await next_reply(stream)
        stalling.stop()
        # Stopped until the poller has noticed (out of routing), then resumed.
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(stopped).state is EngineState.UNREACHABLE, 15
        )
        stalling.resume()
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            responses = [first, *await remaining_replies(stream)]
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]
        assert num_tokens(responses) == 400
        await fleet.wait_routable(1)  # the healthy engine is still cordoned
        await nothing_in_flight(fleet)
    finally:
        await close_fleet(fleet)


async def test_admin_abort_all_exits_1_naming_a_stopped_engine_and_shows_every_outcome(
    stalling: EngineProcess,
) -> None:
    """`kvplane admin abort --all` while an engine holding a stream is stopped: for scripts,
    exit 1 and one line naming the engine that did not abort its requests (its stream runs on
    once it resumes); the JSON (and the table) still show every engine's outcome. Before, it
    exited 0 with the engine's DEADLINE_EXCEEDED buried in the message."""
    fleet = await fleet_with(stalling, abandon_after_s=0)  # streams wait for the engine
    try:
        stopped = await only_on(fleet, stalling)
        registry = fleet.app.controller.fleet.registry
        healthy = next(r.address for r in registry.records() if r.address != stopped)
        stream = fleet.gateway.Generate(
            generate_request("running", [*PREFIX, 1], max_tokens=100_000)
        )
        while (await next_reply(stream)).WhichOneof("event") != "token":
            pass
        stalling.stop()
        t = ["--target", fleet.target]
        as_json = await cli("abort", "--all", *t, "--output", "json")
        assert as_json.exit_code == 1, as_json.output
        assert str(as_json.exception) == (
            f"not every request was aborted: {stopped} (DEADLINE_EXCEEDED) did not abort theirs"
        )
        outcomes = {e["engine"]: e["outcome"] for e in json.loads(as_json.stdout)["engines"]}
        assert outcomes == {stopped: "DEADLINE_EXCEEDED", healthy: "ok"}, as_json.stdout
        table = await cli("abort", "--all", *t)
        assert table.exit_code == 1, table.output
        assert f"{stopped}: DEADLINE_EXCEEDED" in table.stdout, table.stdout
        assert f"{healthy}: ok" in table.stdout, table.stdout
        stalling.resume()
        stream.cancel()
    finally:
        await close_fleet(fleet)


async def test_abort_of_every_request_does_not_pass_over_a_stopped_engine_holding_streams(
    stalling: EngineProcess,
) -> None:
    """Abort(all_requests) while the engine running a stream is stopped (its polls unanswered,
    so it is out of routing) asks that engine too: its silence is among the outcomes, not
    passed over as if it had nothing to abort, for the stream runs on once the engine is back;
    the operator's retry then ends it."""
    fleet = await fleet_with(stalling, abandon_after_s=0)  # streams wait for the engine
    try:
        stopped = await only_on(fleet, stalling)
        registry = fleet.app.controller.fleet.registry
        stream = fleet.gateway.Generate(
            generate_request("running", [*PREFIX, 1], max_tokens=100_000)
        )
        while (await next_reply(stream)).WhichOneof("event") != "token":
            pass
        stalling.stop()
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(stopped).state is EngineState.UNREACHABLE, 15
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()), timeout=30)
        # The stopped engine is asked and its silence fails the call (its stream runs on),
        # every outcome reported, as a wedged one's is.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        message = err.value.details() or ""
        healthy = next(r.address for r in registry.records() if r.address != stopped)
        assert f"{healthy}: ok" in message, message
        assert f"{stopped}: DEADLINE_EXCEEDED" in message, message
        assert message.startswith(f"not every request was aborted: {stopped} did not"), message
        # Back, the engine ends the stream as aborted once the operator retries (the first
        # Abort, held in its socket while it was stopped, may reach it first).
        stalling.resume()
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(stopped).state is EngineState.READY, 30
        )
        await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            rest = await remaining_replies(stream)
        assert rest[-1].WhichOneof("event") == "finished", rest[-1]
        assert rest[-1].finished.reason == pb.FINISH_REASON_CANCELLED, rest[-1]
        await nothing_in_flight(fleet)
    finally:
        await close_fleet(fleet)


async def test_unloading_an_adapter_a_stopped_engine_holds_fails_naming_it(
    tmp_path: Path,
) -> None:
    """UnloadLora across the fleet while an engine holding the adapter is stopped (out of the
    fan-out: its polls go unanswered): the call fails UNAVAILABLE naming that engine, which
    keeps the adapter for now, instead of passing for a fleet-wide unload; the engines that
    answered did unload it. Once back (the same process), it is unloaded there too: it kept
    the adapter, and its requests, for good."""
    lora = "lora: {enabled: true}"
    stopped = await EngineProcess.start(tmp_path, "stopped", config=lora)
    healthy = await start_sim_engine("healthy", lora=LoraConfig(enabled=True))
    fleet = await make_fleet(engines=engines_of_kinds(stopped, healthy))
    try:
        adapter = pb.LoraAdapter(
            lora_name="x", lora_id=1, source_path=str(write_adapter_config(tmp_path / "x"))
        )
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter))
        registry = fleet.app.controller.fleet.registry
        address = f"127.0.0.1:{stopped.port}"
        stopped.stop()
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.UNREACHABLE, 15
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        details = str(err.value.details())
        assert f"{address}: UNAVAILABLE (not unloaded there" in details, details
        assert f"127.0.0.1:{fleet.engines[1].port}: ok" in details, details
        stopped.resume()
        await fleet.wait_routable(2)
        await eventually(lambda: registry.get(address).lora_adapters == frozenset(), 15)
        listed = await fleet.gateway.ListLoras(pb.ListLorasRequest())
        assert list(listed.adapters) == []
    finally:
        await close_fleet(fleet)


async def test_an_adapter_unloaded_while_an_engine_holding_it_was_stopped_stays_unloaded(
    tmp_path: Path,
) -> None:
    """x was loaded on both engines (by a controller since killed). A new controller, which
    learns the fleet's adapters from its engines, meets "healthy" and is given "stopped",
    stopped (unreachable, not read yet), and x is unloaded through it. Back, the stopped
    engine is unloaded too (it held x still, `lora unload` again the cure), and does not
    bring x back into the fleet's intent: killed and started again on its port, it stays
    without x, as does the healthy engine restarted."""
    lora = "lora: {enabled: true}"
    stopped = await EngineProcess.start(tmp_path, "stopped", config=lora)
    healthy = await start_sim_engine("healthy", lora=LoraConfig(enabled=True))
    adapter = pb.LoraAdapter(
        lora_name="x", lora_id=1, source_path=str(write_adapter_config(tmp_path / "x"))
    )
    for port in (stopped.port, healthy.port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await pb_grpc.OpenEngineStub(channel).LoadLora(pb.LoadLoraRequest(adapter=adapter))
    stopped.stop()
    fleet = await make_fleet(engines=engines_of_kinds(healthy))
    fleet.engines.append(stopped)  # registered below, through the admin API
    registry = fleet.app.controller.fleet.registry
    address = f"127.0.0.1:{stopped.port}"
    try:
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.UNREACHABLE, 15
        )
        await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"), timeout=30)
        stopped.resume()
        await fleet.wait_routable(2)
        # Back, and unloaded there.
        await eventually(lambda: registry.get(address).lora_adapters == frozenset(), 15)

        stopped.proc.kill()
        await asyncio.to_thread(stopped.proc.wait)
        stopped = await EngineProcess.start(tmp_path, "again", config=lora, port=stopped.port)
        fleet.engines[1] = stopped
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).engine_id == "again" and registry.get(address).routable,
            30,
        )  # its adapters restored before it is routed to
        restarted_healthy = fleet.address(healthy)
        await fleet.restart_engine(
            restarted_healthy, "healthy-again", lora=LoraConfig(enabled=True)
        )
        listed = await fleet.gateway.ListLoras(pb.ListLorasRequest())
        assert list(listed.adapters) == []
    finally:
        await close_fleet(fleet)


async def test_a_lora_load_a_stopped_engine_never_answers_holds_up_no_other_for_long(
    tmp_path: Path,
) -> None:
    """LoRA changes run one at a time; an engine stopped just before a fleet-wide LoadLora
    (still routable: no poll has gone unanswered yet) never answers its part. After
    `lora_timeout_s` the load fails naming that engine, and a load on the healthy engine alone,
    queued behind it, goes through: the wedged engine does not hold the fleet's LoRA calls up
    until the client gives up."""
    lora = "lora: {enabled: true}"
    stopped = await EngineProcess.start(tmp_path, "stopped", config=lora)
    healthy = await start_sim_engine("healthy", lora=LoraConfig(enabled=True))
    engines: list[ServedEngine] = [stopped, healthy]
    fleet = await make_fleet(engines=engines, lora_timeout_s=1.0)
    address = f"127.0.0.1:{stopped.port}"
    try:

        def adapter(name: str, lora_id: int) -> pb.LoraAdapter:
            path = write_adapter_config(tmp_path / name)
            return pb.LoraAdapter(lora_name=name, lora_id=lora_id, source_path=str(path))

        stopped.stop()
        everywhere = asyncio.ensure_future(
            fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter("x", 1)), timeout=20)
        )
        stopped_calls = fleet.app.controller.fleet._engines[address].lora_calls
        # The fleet-wide load holds the LoRA calls: its call to the stopped engine is sent.
        await eventually(stopped_calls.locked, what="the load's call to the stopped engine")
        on_healthy = ((ENGINE_METADATA_KEY, "healthy"),)
        reply = await fleet.gateway.LoadLora(
            pb.LoadLoraRequest(adapter=adapter("y", 2)), metadata=on_healthy, timeout=10
        )
        assert reply.adapter.lora_name == "y"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await everywhere
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert f"{address}: DEADLINE_EXCEEDED" in str(err.value.details()), err.value
    finally:
        await close_fleet(fleet)


def num_tokens(responses: list[pb.GenerateResponse]) -> int:
    return sum(len(r.token.tokens) for r in responses if r.WhichOneof("event") == "token")
