"""End to end with real processes: two `kvplane engine serve --model sim` and one
`kvplane controller serve`, driven through the gateway and `kvplane admin`."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

import controller.service
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.controller.test_gateway import holder_of
from tests.controller.test_gateway_scripted import outcomes
from tests.engine.lora_adapters import write_adapter_config
from tests.polling import eventually

KVPLANE = [sys.executable, "-m", "kvplane"]


def _wait_port(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}")
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no port in {path}")


@pytest.mark.timeout(120)
def test_controller_and_engines_as_processes(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ports = []
    for i in range(2):
        port_file = tmp_path / f"e{i}.port"
        proc = subprocess.Popen(
            [*KVPLANE, "engine", "serve", "--model", "sim", "--listen", "127.0.0.1:0",
             "--instance-id", f"e{i}", "--port-file", str(port_file)],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / f"e{i}.log").open("wb"), env=env,
        )  # fmt: skip
        processes.append(proc)
        ports.append(_wait_port(port_file, proc))
    config = tmp_path / "controller.yaml"
    config.write_text(
        "listen: 127.0.0.1:0\nrouter: {policy: kvplane, seed: 1}\n"
        "health: {poll_interval_s: 0.2, load_poll_interval_s: 0.1}\nengines:\n"
        + "".join(f"  - {{address: 127.0.0.1:{p}}}\n" for p in ports)
    )
    port_file = tmp_path / "controller.port"
    controller = subprocess.Popen(
        [*KVPLANE, "controller", "serve", "--config", str(config), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "controller.log").open("wb"), env=env,
    )  # fmt: skip
    processes.append(controller)
    target = f"127.0.0.1:{_wait_port(port_file, controller)}"

    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(
            [*KVPLANE, "admin", "workers", "--target", target, "--output", "json"],
            capture_output=True, check=True, env=env,
        )  # fmt: skip
        workers = json.loads(out.stdout)["workers"]
        if sum(w["routable"] for w in workers) == 2:
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.1)
    assert sorted(w["instance_id"] for w in workers) == ["e0", "e1"]
    # Healthy engines show no error (their health checks' messages are information).
    assert [w["last_error"] for w in workers] == ["", ""]

    # A fleet command sent to an engine: one line that says so, exit 1 (README, exit codes).
    engine = f"127.0.0.1:{ports[0]}"
    for command in (["match", "--prompt", "hi"], ["route", "--prompt", "hi"], ["cordon", "e0"]):
        out = subprocess.run(
            [*KVPLANE, "admin", "--target", engine, *command], capture_output=True, env=env
        )
        message = out.stderr.decode()
        assert out.returncode == 1, message
        assert message.count("\n") == 1 and "Method not found" not in message, message
        assert f"`{command[0]}` needs a controller: {engine}" in message, message

    prefix = list(range(500, 1524))  # 64 blocks of 16
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.OpenEngineStub(channel)

        def run(rid: str, tail: int) -> pb.GenerateResponse:
            request = pb.GenerateRequest(
                request_id=rid, model="sim", token_ids=pb.TokenIds(ids=[*prefix, tail]),
                stopping=pb.StoppingOptions(max_tokens=3, ignore_eos=True),
            )  # fmt: skip
            return list(stub.Generate(request))[-1]

        assert run("a", 1).usage.cached_prompt_tokens == 0
        deadline = time.monotonic() + 60
        while True:  # the KV events reach the controller's index
            cached = run(f"b{time.monotonic_ns()}", 2).usage.cached_prompt_tokens
            if cached == 1024:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert all(run(f"c{i}", 10 + i).usage.cached_prompt_tokens == 1024 for i in range(5))

    controller.send_signal(signal.SIGTERM)
    assert controller.wait(timeout=20) == 0


async def indexer_process(
    tmp_path: Path,
    engines: list[str],
    processes: list[subprocess.Popen[bytes]],
    listen: str = "127.0.0.1:0",
    backend: str = "memory",
    *,
    keyed: str = "hash: canonical",
    settings: str = "",
    sources: str = "",
) -> str:
    """A `kvplane indexer serve` process following `engines` (OpenEngine sources, keyed as
    `keyed` says), and more `sources` (YAML list items), into `backend`, listening on
    `listen` (a fixed port: one started again where the last one was), with more `settings`
    (YAML lines); its address."""
    config = tmp_path / "indexer.yaml"
    config.write_text(
        f"listen: {listen}\nbackend: {backend}\nblock_size: 16\n{settings}"
        + ("sources:\n" if engines or sources else "sources: []\n")
        + "".join(f"  - {{kind: openengine, target: '{a}', {keyed}}}\n" for a in engines)
        + sources
    )
    port_file = tmp_path / "indexer.port"
    port_file.unlink(missing_ok=True)  # the last process's
    indexer = await asyncio.to_thread(
        subprocess.Popen,
        [*KVPLANE, "indexer", "serve", "--config", str(config), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "indexer.log").open("wb"),
    )
    processes.append(indexer)
    return f"127.0.0.1:{await asyncio.to_thread(_wait_port, port_file, indexer)}"


@pytest.mark.timeout(120)
async def test_remote_indexer_feeds_the_router(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`index: {remote: ...}`: a `kvplane indexer` process follows the engines' KV events and
    the controller asks it (MatchTokens) instead of keeping its own index."""
    engines = [await start_sim_engine(f"r{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    remote = await indexer_process(tmp_path, addresses, processes)
    monkeypatch.setattr(controller.service, "INDEX_STATS_INTERVAL_S", 0.05)
    fleet = await make_fleet(engines=engines, index={"remote": remote})
    try:
        assert fleet.app.controller.index is None
        prefix = list(range(700, 764))
        [r async for r in fleet.gateway.Generate(generate_request("a", [*prefix, 1]))]
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prefix, 2]))
        async with asyncio.timeout(20):
            for _ in itertools.count():
                match = await fleet.admin.Match(query)
                if any(m.device_blocks >= 4 for m in match.matches):
                    break
                await asyncio.sleep(0.05)
        route = await fleet.admin.Route(query)
        assert (route.reason, route.predicted_cached_tokens) == ("cache", 64)
        reply = [r async for r in fleet.gateway.Generate(generate_request("b", [*prefix, 2]))]
        assert reply[-1].usage.cached_prompt_tokens == 64
        # The index's size reaches the controller too: per engine (ListWorkers, the router's
        # cache pressure) and in its metrics.
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        indexed = {w.address: w.indexed_blocks for w in workers.workers}
        assert set(indexed) == set(addresses) and indexed[route.engine] >= 4
        stats = await fleet.app.controller.index_stats()
        assert stats is not None and stats.num_blocks >= 4
        controller_fleet = fleet.app.controller.fleet
        await controller_fleet.wait_for(
            lambda: controller_fleet.indexed_blocks.get(route.engine, 0) >= 4, 20
        )
        registry = fleet.app.controller.metrics.registry
        assert (registry.get_sample_value("kvplane_controller_index_blocks") or 0) >= 4
    finally:
        await close_fleet(fleet)


@pytest.mark.timeout(120)
async def test_a_remote_indexer_process_drops_a_restarted_engines_blocks_at_once(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """The `kvplane indexer` process wires ResyncEngine to its sources: an engine down long
    enough for the indexer's reconnect backoff to grow comes back as a new process, and the
    moment the controller routes to it again the indexer holds none of the old blocks; what the
    new process caches is indexed again within seconds."""
    engines = [await start_sim_engine(f"r{i}") for i in range(2)]
    remote = await indexer_process(tmp_path, [f"127.0.0.1:{e.port}" for e in engines], processes)
    fleet = await make_fleet(engines=engines, index={"remote": remote})
    try:
        prefix = list(range(900, 964))
        [r async for r in fleet.gateway.Generate(generate_request("a", [*prefix, 1]))]
        holder = await holder_of(fleet, prefix, 4)
        # Down long enough for the indexer's source to wait its longest (5 s) between tries,
        # while the controller (backoff at most 1 s here) is back within a second.
        await fleet.restart_engine(holder, "r-new", down_s=6.5)
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=prefix)))
        assert [m.device_blocks for m in match.matches] == [0, 0]

        fresh_prompt = list(range(2000, 2064))
        async with grpc.aio.insecure_channel(holder) as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            [r async for r in stub.Generate(generate_request("direct", [*fresh_prompt, 1]))]
        assert await holder_of(fleet, fresh_prompt, 4) == holder
    finally:
        await close_fleet(fleet)


def controller_process(
    tmp_path: Path,
    name: str,
    listen: str,
    processes: list[subprocess.Popen[bytes]],
    engines: Sequence[str] = (),
    *,
    settings: str = "",
) -> tuple[subprocess.Popen[bytes], str]:
    """A `kvplane controller serve` process with `engines` (addresses; none by default) and
    `settings` (more YAML lines) in its config, listening on `listen`; it and its address."""
    config = tmp_path / f"{name}.yaml"
    listed = "".join(f"  - {{address: {address}}}\n" for address in engines)
    config.write_text(
        f"listen: {listen}\nhealth: {{poll_interval_s: 0.2}}\n"
        + (f"engines:\n{listed}" if engines else "")
        + settings
    )
    port_file = tmp_path / f"{name}.port"
    proc = subprocess.Popen(
        [*KVPLANE, "controller", "serve", "--config", str(config), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{name}.log").open("wb"),
    )  # fmt: skip
    processes.append(proc)
    return proc, f"127.0.0.1:{_wait_port(port_file, proc)}"


def sim_engine_process(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    name: str = "engine",
    listen: str = "127.0.0.1:0",
    *,
    lora: bool = False,
) -> str:
    """A `kvplane engine serve --model sim` process (`name`: its instance id, and its files';
    `lora`: it serves LoRA adapters); its address."""
    port_file = tmp_path / f"{name}.port"
    port_file.unlink(missing_ok=True)  # a restart on its port waits for the new process's
    options = []
    if lora:
        config = tmp_path / f"{name}.yaml"
        config.write_text("lora: {enabled: true}\n")
        options = ["--config", str(config)]
    proc = subprocess.Popen(
        [*KVPLANE, "engine", "serve", "--model", "sim", "--listen", listen,
         "--instance-id", name, "--port-file", str(port_file), *options],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{name}.log").open("wb"),
    )  # fmt: skip
    processes.append(proc)
    return f"127.0.0.1:{_wait_port(port_file, proc)}"


def _calls_naming(gateway: pb_grpc.OpenEngineAsyncStub, model: str) -> dict[str, Any]:
    """Every gateway call that names `model` (made at once), to await, by name."""
    context = pb.TaskRequestContext(request_id=f"{model}-task", model=model)
    text = [pb.TaskInput(text="hi")]
    generate = pb.GenerateRequest(request_id=f"{model}-gen", model=model, prompt="hi")
    return {
        "Generate": _first(gateway.Generate(generate)),
        "Embed": gateway.Embed(pb.EmbedRequest(context=context, inputs=text)),
        "Classify": gateway.Classify(pb.ClassifyRequest(context=context, inputs=text)),
        "Score": gateway.Score(pb.ScoreRequest(context=context)),
        "GetModelInfo": gateway.GetModelInfo(pb.GetModelInfoRequest(model=model)),
    }


async def _first(stream: AsyncIterable[pb.GenerateResponse]) -> pb.GenerateResponse:
    async for response in stream:
        return response
    raise AssertionError("the stream ended without a response")


async def _statuses(calls: dict[str, Any]) -> dict[str, tuple[grpc.StatusCode, str]]:
    """The status and message each of `calls` ends with (each must fail)."""
    out = {}
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        out[name] = (caught.value.code(), caught.value.details() or "")
    return out


async def _assert_not_known_yet(gateway: pb_grpc.OpenEngineAsyncStub) -> None:
    """What a client of a controller with no engine at all gets: UNAVAILABLE (retry) for
    every call naming a model, and a Health that says not ready, naming why."""
    for name, (code, message) in (await _statuses(_calls_naming(gateway, "sim"))).items():
        assert code is grpc.StatusCode.UNAVAILABLE, (name, code, message)
        assert "no engine is registered yet" in message, (name, message)
    assert (await gateway.Health(pb.HealthRequest())).state == pb.HEALTH_STATE_NOT_READY
    health = await gateway.Health(pb.HealthRequest(model="sim"))
    assert health.state == pb.HEALTH_STATE_NOT_READY
    assert [(c.name, c.state) for c in health.checks] == [("model", pb.HEALTH_STATE_NOT_READY)]


@pytest.mark.timeout(120)
async def test_a_controller_with_no_engine_yet_answers_unavailable_not_not_found(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """A controller process that has no engine at all (started before its planner registered
    any, or killed and restarted on its port: engines registered at run time are gone) cannot
    tell whether a model is served. A client, or a load balancer, takes NOT_FOUND as final:
    every call naming a model is UNAVAILABLE (worth retrying) instead, and Health is
    NOT_READY. Once an engine is registered, a model it does not serve is NOT_FOUND."""
    controller, target = await asyncio.to_thread(
        controller_process, tmp_path, "controller", "127.0.0.1:0", processes
    )
    engine_address = await asyncio.to_thread(sim_engine_process, tmp_path, processes)
    async with grpc.aio.insecure_channel(target) as channel:
        gateway, admin = pb_grpc.OpenEngineStub(channel), apb_grpc.AdminStub(channel)
        await _assert_not_known_yet(gateway)

        await admin.RegisterEngine(apb.RegisterEngineRequest(address=engine_address))
        await eventually(lambda: _routable(admin), 30, "the engine routed")
        info = await gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        assert info.served_model_name == "sim", info
        refusals = await _statuses(_calls_naming(gateway, "nope"))
        not_found = (grpc.StatusCode.NOT_FOUND, "no engine serves model 'nope'")
        assert refusals == dict.fromkeys(refusals, not_found)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await gateway.Health(pb.HealthRequest(model="nope"))
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND

    controller.kill()  # kill -9: nothing is said to anyone
    await asyncio.to_thread(controller.wait)
    _, again = await asyncio.to_thread(controller_process, tmp_path, "restarted", target, processes)
    assert again == target
    async with grpc.aio.insecure_channel(target) as channel:
        await _assert_not_known_yet(pb_grpc.OpenEngineStub(channel))


async def _routable(admin: apb_grpc.AdminAsyncStub, count: int = 1) -> bool:
    """Whether the controller knows `count` engines and routes to each."""
    workers = (await admin.ListWorkers(apb.ListWorkersRequest())).workers
    return [w.routable for w in workers] == [True] * count


@pytest.mark.timeout(180)
async def test_a_controller_killed_and_restarted_gives_a_restarted_engine_the_fleets_adapters(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Adapter x is loaded on the fleet through the controller, which is then killed (kill -9)
    and started again on its port: the new process learns x from the engines, so e1, killed
    and started again on its port afterwards, gets x back, and with e0 cordoned a request
    naming x is served, by e1. (A controller that kept the fleet's adapters only in its
    memory left e1 without x for good: that request was refused, UNAVAILABLE.)"""
    engines = [
        await asyncio.to_thread(sim_engine_process, tmp_path, processes, f"e{i}", lora=True)
        for i in range(2)
    ]
    controller, target = await asyncio.to_thread(
        controller_process, tmp_path, "controller", "127.0.0.1:0", processes, engines
    )
    x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
    write_adapter_config(Path(x.source_path), r=4)
    async with grpc.aio.insecure_channel(target) as channel:
        admin = apb_grpc.AdminStub(channel)
        await eventually(lambda: _routable(admin, 2), 30, "both engines routed")
        await pb_grpc.OpenEngineStub(channel).LoadLora(pb.LoadLoraRequest(adapter=x))

    controller.kill()  # kill -9: what it kept in memory is gone
    await asyncio.to_thread(controller.wait)
    _, again = await asyncio.to_thread(
        controller_process, tmp_path, "restarted", target, processes, engines
    )
    assert again == target
    async with grpc.aio.insecure_channel(target) as channel:
        gateway, admin = pb_grpc.OpenEngineStub(channel), apb_grpc.AdminStub(channel)
        await eventually(lambda: _routable(admin, 2), 30, "both engines routed again")
        e1 = processes[1]
        e1.kill()
        await asyncio.to_thread(e1.wait)
        await asyncio.to_thread(
            sim_engine_process, tmp_path, processes, "e1-again", engines[1], lora=True
        )

        async def e1_holds_x() -> bool:
            async with grpc.aio.insecure_channel(engines[1]) as direct:
                held = await pb_grpc.OpenEngineStub(direct).ListLoras(pb.ListLorasRequest())
            listing = gateway.ListLoras(pb.ListLorasRequest())
            await listing
            known = outcomes(await listing.trailing_metadata()).get("e1-again", {})
            return [a.lora_name for a in held.adapters] == known.get("adapters") == ["x"]

        await eventually(e1_holds_x, 30, "x back on the restarted e1, as the controller knows")
        await admin.Cordon(apb.EngineRef(engine="e0"))
        request = generate_request("on-e1", [1, 2, 3])
        request.lora_name = "x"
        events = [r.WhichOneof("event") async for r in gateway.Generate(request)]
        assert events[-1] == "finished"


@pytest.mark.timeout(120)
async def test_a_burst_sharing_a_long_system_prompt_is_spread_over_the_engines(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Three `kvplane engine serve --model sim` processes behind `kvplane controller serve`
    (`kvplane` policy): one engine has served a 640-token system prompt, then 30 requests
    that start with it and differ in a 20-token question arrive at once. The requests in
    flight sharing the prompt amortise computing it again elsewhere (`hot_prefix_requests`),
    so no engine serves more than two thirds of the burst. (Without the discount,
    recomputing the prompt elsewhere cost about 30 x 660 token equivalents with caches nearly
    empty, far more than the holder's load: it served 28 of the 30.) Which engine served a
    request is the one the index places its whole prompt on (its question is its own)."""
    engines = [
        await asyncio.to_thread(sim_engine_process, tmp_path, processes, f"e{i}") for i in range(3)
    ]
    _, target = await asyncio.to_thread(
        controller_process, tmp_path, "controller", "127.0.0.1:0", processes, engines,
        settings="router: {policy: kvplane, seed: 1}\n",
    )  # fmt: skip
    system = list(range(3000, 3640))  # 40 blocks of 16

    def prompt(question: int) -> list[int]:
        return [*system, *range(10_000 + 20 * question, 10_020 + 20 * question)]

    async with grpc.aio.insecure_channel(target) as channel:
        gateway, admin = pb_grpc.OpenEngineStub(channel), apb_grpc.AdminStub(channel)
        await eventually(lambda: _routable(admin, 3), 30, "the three engines routed")

        async def ask(question: int) -> None:
            request = generate_request(f"q{question}", prompt(question), max_tokens=64)
            events = [r.WhichOneof("event") async for r in gateway.Generate(request)]
            assert events[-1] == "finished"

        servers: dict[int, list[str]] = {}

        async def served(questions: range) -> bool:
            """Whether the index places each question's prompt (41 full blocks) on one engine
            (noted in `servers`)."""
            for question in questions:
                query = apb.PromptQuery(token_ids=pb.TokenIds(ids=prompt(question)))
                matches = (await admin.Match(query)).matches
                servers[question] = [m.engine for m in matches if m.device_blocks >= 41]
            return all(len(servers[q]) == 1 for q in questions)

        await ask(0)
        await eventually(lambda: served(range(1)), 30, "the first prompt indexed")
        await asyncio.gather(*(ask(q) for q in range(1, 31)))
        await eventually(lambda: served(range(1, 31)), 30, "the burst's prompts indexed")
        shares = Counter(servers[q][0] for q in range(1, 31))
        assert len(shares) > 1 and max(shares.values()) <= 20, shares
