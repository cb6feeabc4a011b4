"""The live planner with a controller and engines run with `auth` (bearer tokens):
`live.controller_token_file` on every admin call, `live.engine_token_file` on the engines'
GetLoad and runtime events. The real `kvplane planner run` process drives an in-process
controller that asks for one token, whose engines, started by the planner, ask for another on
every call (`protect_reads`); a planner without the controller's token says which setting to
give and starts no engine; an unusable token file stops it in one line before anything
starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from kvplane.channels import INSECURE
from kvplane.errors import KvplaneError
from kvplane.server import bearer_token_metadata
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from planner.actuator import LocalProcesses
from planner.controller_admin import ControllerAdmin
from planner.live import LivePlanner
from tests.controller.conftest import start_sim_engine
from tests.planner.test_planner_live import planner
from tests.planner.test_planner_tls import (
    PLANNER,
    planner_config,
    planner_registers_a_deployments_pod,
    planner_serves_a_prompt,
    planner_start_refused,
)
from tests.polling import eventually


def token_file(folder: Path, name: str, token: str) -> Path:
    path = folder / name
    path.write_text(f"{token}\n")  # surrounding whitespace is not part of the token
    return path


@contextlib.asynccontextmanager
async def auth_controller(
    token: Path, *, engine_token: Path | None = None
) -> AsyncIterator[ControllerApp]:
    """A controller run with `auth` (the admin API's changes need `token`) that sends its
    engines `engine_token`."""
    config = ControllerConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "auth": {"token_file": token},
            "engine_token_file": engine_token,
            "health": {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1},
            "shutdown_grace_s": 0.5,
        }
    )
    app = await start_controller(config)
    try:
        yield app
    finally:
        await app.close(0.2)


def engine_with_auth(folder: Path, token: Path) -> Path:
    """An engine config (for `--config`) asking for `token` on every call."""
    config = folder / "engine.yaml"
    config.write_text(f"auth: {{token_file: '{token}', protect_reads: true}}\n")
    return config


@pytest.mark.timeout(120)
async def test_planner_run_manages_engines_behind_a_controller_with_auth(tmp_path: Path) -> None:
    """The engine the planner starts is registered with the controller's token, the
    controller routes a prompt to it, and the planner sees its forward passes and load with
    the engines' own token (another one: each setting goes where it belongs); stopped, the
    planner takes it out of the controller (RemoveEngine needs the token too)."""
    controller_token = token_file(tmp_path, "controller-token", "controller-s3cret")
    engine_token = token_file(tmp_path, "engine-token", "engine-s3cret")
    engine_config = engine_with_auth(tmp_path, engine_token)
    async with auth_controller(controller_token, engine_token=engine_token) as app:
        config = planner_config(
            tmp_path,
            {
                "controller": f"127.0.0.1:{app.port}",
                "controller_token_file": str(controller_token),
                "engine_token_file": str(engine_token),
                "engine_args": ["--model", "sim", "--config", str(engine_config)],
                "metrics_listen": "127.0.0.1:0",
            },
        )
        lines = await planner_serves_a_prompt(app, config, INSECURE)
        assert not any("UNAUTHENTICATED" in line for line in lines), lines


@pytest.mark.timeout(120)
async def test_planner_run_registers_a_deployments_pods_with_a_controller_with_auth(
    tmp_path: Path,
) -> None:
    """The Kubernetes actuator sends `controller_token_file` too (both tokens, the API
    server's and the controller's, on their own connections)."""
    controller_token = token_file(tmp_path, "controller-token", "controller-s3cret")
    async with auth_controller(controller_token) as app:
        settings = {"controller_token_file": str(controller_token)}
        pod = await planner_registers_a_deployments_pod(app, tmp_path, settings)
        assert [r.address for r in app.controller.fleet.registry.records()] == [pod]


@pytest.mark.timeout(60)
async def test_a_planner_without_controller_token_file_names_the_setting_and_spawns_nothing(
    tmp_path: Path,
) -> None:
    """The controller answers ListWorkers to anyone (no `protect_reads`), yet every start
    fails at once, in one log line naming the setting, and no engine is spawned (with a real
    model, minutes of loading for a registration refused)."""
    controller_token = token_file(tmp_path, "controller-token", "controller-s3cret")
    async with auth_controller(controller_token) as app:
        config = planner_config(tmp_path, {"controller": f"127.0.0.1:{app.port}"})
        failed = await planner_start_refused(app, config, tmp_path / "work")
    assert " controller UNAUTHENTICATED: " in failed
    assert failed.endswith("(a server requiring a token? give live.controller_token_file)")


@pytest.mark.timeout(60)
async def test_a_start_with_a_token_the_controller_does_not_take_says_to_check_it(
    tmp_path: Path,
) -> None:
    right = token_file(tmp_path, "controller-token", "controller-s3cret")
    wrong = token_file(tmp_path, "old-token", "last-years-s3cret")
    async with auth_controller(right) as app:
        actuator = LocalProcesses(
            controller=f"127.0.0.1:{app.port}",
            engine_args=("--model", "sim"),
            workdir=tmp_path,
            start_timeout_s=60,
            channels=INSECURE.with_token_file(wrong, "live.controller_token_file"),
        )
        try:
            with pytest.raises(KvplaneError) as failed:
                await actuator.start("default")
        finally:
            await actuator.close()
    message = str(failed.value)
    assert message.startswith("no engine of default started: controller UNAUTHENTICATED: ")
    assert message.endswith("(not the server's token? check live.controller_token_file)")
    assert "\n" not in message
    assert not actuator._spawned


@pytest.mark.timeout(60)
async def test_a_dead_engine_whose_removal_is_refused_keeps_its_port_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A planner restarted on a killed one's workdir whose RemoveEngine of the dead engine
    fails (here refused: it lacks the controller's token) does not say it took the engine
    out, and keeps its port file, so that each look tries again; given the token, a planner
    takes it out. Both were lost: the controller listed the dead engine for good."""
    caplog.set_level(logging.WARNING, "planner")
    right = token_file(tmp_path, "controller-token", "controller-s3cret")
    workdir = tmp_path / "work"
    workdir.mkdir()
    with socket.socket() as unused:  # the dead engine's port: nothing listens there
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]
    dead = f"127.0.0.1:{dead_port}"
    port_file = workdir / "default-0.port"
    port_file.write_text(str(dead_port))

    def restarted(**options: Any) -> LocalProcesses:
        controller = f"127.0.0.1:{app.port}"
        return LocalProcesses(
            controller=controller, engine_args=(), workdir=workdir, start_timeout_s=60, **options
        )

    async with (
        auth_controller(right) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel,
    ):
        await apb_grpc.AdminStub(channel).RegisterEngine(
            apb.RegisterEngineRequest(address=dead),
            metadata=bearer_token_metadata("controller-s3cret"),
        )
        refused = restarted()
        try:
            for _ in range(2):
                assert await refused.adopt() == []
        finally:
            await refused.close()
        said = [r.getMessage() for r in caplog.records]
        refusals = [m for m in said if m.startswith(f"controller: RemoveEngine of {dead}: ")]
        assert len(refusals) == 2  # each look tried again
        for refusal in refusals:
            assert refusal.endswith("(a server requiring a token? give live.controller_token_file)")
        assert not [m for m in said if "taken out of the controller" in m]
        assert port_file.exists()
        assert [r.address for r in app.controller.fleet.registry.records()] == [dead]

        with_token = restarted(
            channels=INSECURE.with_token_file(right, "live.controller_token_file")
        )
        try:
            assert await with_token.adopt() == []
        finally:
            await with_token.close()
        assert not app.controller.fleet.registry.records()
        assert not port_file.exists()


@pytest.mark.timeout(60)
async def test_check_access_answers_the_token_alone_and_changes_nothing(tmp_path: Path) -> None:
    """What the planner asks before a start: refused without the token that RegisterEngine
    needs, answered with it, whatever the order of the controller's checks (there is no
    request to check); ListWorkers, answered to anyone without `protect_reads`, cannot
    tell."""
    right = token_file(tmp_path, "controller-token", "controller-s3cret")
    async with (
        auth_controller(right) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel,
    ):
        admin = apb_grpc.AdminStub(channel)
        await admin.ListWorkers(apb.ListWorkersRequest())
        for token in (None, "last-years-s3cret"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.CheckAccess(
                    apb.CheckAccessRequest(), metadata=bearer_token_metadata(token)
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await admin.CheckAccess(
            apb.CheckAccessRequest(), metadata=bearer_token_metadata("controller-s3cret")
        )
        assert reply == apb.CheckAccessResponse()
        assert not app.controller.fleet.registry.records()


@pytest.mark.timeout(60)
async def test_a_controller_older_than_check_access_is_left_to_register_engine() -> None:
    """A controller whose admin API has no CheckAccess (UNIMPLEMENTED, as grpc answers for a
    method a server lacks) does not stop every start: the registration says whether the
    planner's token is right."""

    async def list_workers(_request: apb.ListWorkersRequest, _context: object) -> object:
        return apb.ListWorkersResponse()

    older_admin = grpc.method_handlers_generic_handler(
        "kvplane.v1.Admin",
        {
            "ListWorkers": grpc.unary_unary_rpc_method_handler(
                list_workers,
                request_deserializer=apb.ListWorkersRequest.FromString,
                response_serializer=apb.ListWorkersResponse.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((older_admin,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    admin = ControllerAdmin(f"127.0.0.1:{port}")
    try:
        await admin.check_reachable("default")
    finally:
        await admin.close()
        await server.stop(None)


@pytest.mark.timeout(60)
async def test_a_getload_refused_by_an_engine_with_auth_names_live_engine_token_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A planner without `live.engine_token_file` polling an engine that asks for a token on
    reads: the failed GetLoad's warning says which setting is missing, and the engine, alive
    and serving, is not counted as failing its polls (it was lost and killed after
    `lost_after_failed_polls` of them, and its replacement refused the planner alike)."""
    token = token_file(tmp_path, "engine-token", "engine-s3cret")
    engine = await start_sim_engine("e0", auth={"token_file": token, "protect_reads": True})
    actuator = LocalProcesses(
        controller="127.0.0.1:1", engine_args=(), workdir=tmp_path, start_timeout_s=1
    )
    live = LivePlanner(planner(1, 1), actuator)
    address = f"127.0.0.1:{engine.port}"
    caplog.set_level(logging.INFO, logger="planner.live")

    def said(start: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]

    async def events_refused() -> bool:
        return bool(said(f"runtime events of {address}"))

    try:
        live._serve(address, "default")  # follows its runtime events too
        for _ in range(live._lost_after_failed_polls):
            await live._poll(live.engines[address])
        assert live.engines[address].failed_polls == 0
        await eventually(events_refused)
    finally:
        await live.close()
        await engine.close()
    warning = said("GetLoad")[0]
    assert warning.startswith(f"GetLoad {address}: missing or invalid bearer token")
    assert warning.endswith("(a server requiring a token? give live.engine_token_file)")
    assert said(f"runtime events of {address}")[0] == (
        f"runtime events of {address} ended (UNAUTHENTICATED) (a server requiring a token? "
        "give live.engine_token_file); subscribing again"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("token", "error"),
    [
        (None, "cannot read live.controller_token_file {path}: No such file or directory"),
        (" \n", "live.controller_token_file {path} is empty"),
    ],
    ids=["missing", "empty"],
)
async def test_an_unusable_controller_token_file_stops_the_planner_in_one_line(
    tmp_path: Path, token: str | None, error: str
) -> None:
    path = tmp_path / "token"
    if token is not None:
        path.write_text(token)
    stderr, code = await planner_run_refused(tmp_path, {"controller_token_file": str(path)})
    assert code == 1
    assert stderr.splitlines() == [f"kvplane: error: {error.format(path=path)}"]
    assert not (tmp_path / "work").exists()  # nothing started


@pytest.mark.timeout(60)
async def test_an_unusable_engine_token_file_stops_the_planner_in_one_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"\xff\xfe")
    stderr, code = await planner_run_refused(tmp_path, {"engine_token_file": str(path)})
    assert code == 1
    assert stderr.splitlines() == [
        f"kvplane: error: live.engine_token_file {path} is not UTF-8 text (byte 0)"
    ]
    assert not (tmp_path / "work").exists()


async def planner_run_refused(tmp_path: Path, live: dict[str, Any]) -> tuple[str, int]:
    """`kvplane planner run` with `live`, and no controller: its stderr and exit status."""
    with socket.socket() as unused:  # bound, not listening: no controller
        unused.bind(("127.0.0.1", 0))
        controller = f"127.0.0.1:{unused.getsockname()[1]}"
        config = planner_config(tmp_path, {"controller": controller, **live})
        process = await asyncio.create_subprocess_exec(
            *PLANNER, str(config), stderr=asyncio.subprocess.PIPE
        )
        _, stderr = await process.communicate()
    assert process.returncode is not None
    return stderr.decode(), process.returncode
