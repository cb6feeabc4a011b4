"""The live planner with a controller and engines that serve TLS: `live.controller_tls` for
every admin call, `live.engine_tls` for the engines' GetLoad and runtime events. The real
`kvplane planner run` process drives an in-process TLS (and a mutual-TLS) controller whose
engines, started by the planner, require a client certificate; a planner whose TLS settings do
not match its controller says which one it lacks; unusable TLS files stop it in one line
before anything starts. Certificates from the `pki` fixture (openssl)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from kvplane.channels import ClientChannels
from kvplane.config import ClientTlsConfig
from kvplane.errors import KvplaneError
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.actuator import LocalProcesses
from planner.live import LivePlanner
from tests.controller.conftest import generate_request, start_sim_engine
from tests.controller.test_client_tls import client_tls, server_tls
from tests.planner.fake_kube import FakeKube
from tests.planner.test_planner_kubernetes import DEPLOYMENT, LABELS, free_port
from tests.planner.test_planner_live import planner, scrape, value
from tests.polling import eventually

PLANNER = [sys.executable, "-m", "kvplane", "planner", "run", "--config"]


def paths(config: dict[str, Any]) -> dict[str, str]:
    """A TLS block with its paths as YAML strings."""
    return {key: str(path) for key, path in config.items() if path is not None}


@contextlib.asynccontextmanager
async def tls_controller(
    pki: Path, *, mutual: bool, engine_tls: dict[str, Any] | None
) -> AsyncIterator[ControllerApp]:
    """A controller serving TLS (`mutual`: requiring a client certificate) that dials its
    engines per `engine_tls` (None: insecurely)."""
    config = {
        "listen": "127.0.0.1:0",
        "tls": paths(server_tls(pki, mutual=mutual).model_dump()),
        "engine_tls": paths(engine_tls) if engine_tls is not None else None,
        "health": {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1},
        "shutdown_grace_s": 0.5,
    }
    app = await start_controller(ControllerConfig.model_validate(config))
    try:
        yield app
    finally:
        await app.close(0.2)


class PlannerProcess:
    """`kvplane planner run --config CONFIG` as a child process; its stderr (the log) is read
    line by line as it comes, so the pipe never fills."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._more = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, config: Path) -> PlannerProcess:
        process = await asyncio.create_subprocess_exec(
            *PLANNER, str(config), stderr=asyncio.subprocess.PIPE
        )
        return cls(process)

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            async with self._more:
                self.lines.append(line.decode().rstrip("\n"))
                self._more.notify_all()
        async with self._more:  # the end: no line will come
            self._more.notify_all()

    async def line(self, matches: Callable[[str], bool]) -> str:
        """The first log line that `matches` (waited for); fails if the process ends first."""
        async with self._more:
            while True:
                found = next((line for line in self.lines if matches(line)), None)
                if found is not None:
                    return found
                assert not self._reader.done(), "the planner ended:\n" + "\n".join(self.lines)
                await self._more.wait()

    async def stop(self) -> int:
        """SIGTERM (the planner stops its engines), then its exit status."""
        if self.process.returncode is None:
            self.process.terminate()
        code = await self.process.wait()
        await self._reader
        return code


@contextlib.asynccontextmanager
async def planner_run(config: Path) -> AsyncIterator[PlannerProcess]:
    process = await PlannerProcess.start(config)
    try:
        yield process
    finally:
        if process.process.returncode is None:
            process.process.kill()
        await process.stop()


async def planner_metrics_port(planner_process: PlannerProcess) -> int:
    """The port of its /metrics (`metrics_listen: 127.0.0.1:0`), from its log."""
    line = await planner_process.line(lambda line: "metrics on http://" in line)
    match = re.search(r":(\d+)/metrics", line)
    assert match is not None, line
    return int(match[1])


async def engines_answering(metrics_port: int, count: int) -> bool:
    """The planner's last tick saw `count` engines serving, every one answering GetLoad."""
    samples = await scrape(metrics_port)
    serving = value(samples, "kvplane_planner_engines", pool="default", state="serving")
    not_answering = value(samples, "kvplane_planner_engines_not_answering", pool="default")
    return serving == count and not_answering == 0


async def planner_serves_a_prompt(
    app: ControllerApp, config: Path, channels: ClientChannels
) -> list[str]:
    """`kvplane planner run --config config` against the controller `app` (dialled per
    `channels`): its engine is registered and routed a prompt, the planner sees its forward
    passes and load and never loses it, and stopped (exit 0) it takes the engine out of the
    controller. The planner's log lines."""
    fleet = app.controller.fleet
    async with planner_run(config) as planner_process:
        metrics_port = await planner_metrics_port(planner_process)
        await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 60)
        # The planner observes it (its runtime events followed since before that tick): the
        # prompt's passes are not sent before it subscribed (runtime events have no replay).
        await eventually(lambda: engines_answering(metrics_port, 1), 60)
        async with channels.aio_channel(f"127.0.0.1:{app.port}") as channel:
            request = generate_request("r1", list(range(1, 65)))
            async for _ in pb_grpc.OpenEngineStub(channel).Generate(request):
                pass

        async def passes_seen() -> bool:
            samples = await scrape(metrics_port)
            return (value(samples, "kvplane_planner_forward_passes_total", pool="default") or 0) > 0

        await eventually(passes_seen, 60)
        # Its last GetLoad answered, and it was never lost (as one failing every poll is).
        await eventually(lambda: engines_answering(metrics_port, 1), 60)
        samples = await scrape(metrics_port)
        assert value(samples, "kvplane_planner_engines", pool="default", state="serving") == 1
        # No leader election (the local actuator): the one planner acts.
        assert value(samples, "kvplane_planner_leader") == 1
        assert value(samples, "kvplane_planner_leader_transitions_total") == 0
        assert not any(
            value(samples, "kvplane_planner_engines_lost_total", pool="default", cause=cause)
            for cause in ("exited", "unresponsive")
        )
        assert await planner_process.stop() == 0
    assert not fleet.registry.records()
    return planner_process.lines


async def planner_start_refused(app: ControllerApp, config: Path, work: Path) -> str:
    """`kvplane planner run --config config` against a controller `app` that refuses how it
    dials: every start fails at once in one log line (returned), the planner goes on (it tries
    again next tick), no engine is spawned (no log in `work`: with a real model, minutes of
    loading for nothing) and nothing is registered."""
    async with planner_run(config) as planner_process:
        failed = await planner_process.line(lambda line: "no engine of default started" in line)
        assert planner_process.process.returncode is None
    assert not await asyncio.to_thread(lambda: list(work.glob("*.log")))
    assert not app.controller.fleet.registry.records()
    return failed


def planner_config(tmp_path: Path, live: dict[str, Any]) -> Path:
    """A planner of one pool of exactly one engine acting on `live` (local engines' logs in
    tmp_path/work), written to a file."""
    config = tmp_path / "planner.yaml"
    pools = [{"min_engines": 1, "max_engines": 1}]
    if "kubernetes" not in live:
        live = {"workdir": str(tmp_path / "work"), **live}
    body = {"pools": pools, "scaling": {"tick_s": 0.2}, "live": live}
    config.write_text(json.dumps(body))
    return config


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_planner_run_manages_engines_behind_a_tls_controller(
    pki: Path, tmp_path: Path, mutual: bool
) -> None:
    """The engine the planner starts is registered over TLS (with a client certificate for a
    mutual-TLS controller), the controller routes a prompt to it, and the planner sees its
    forward passes and load over the engine's own mutual TLS; stopped, the planner takes it
    out of the controller."""
    engine_config = mutual_tls_engine_config(pki, tmp_path)
    controller_tls = client_tls(pki) if mutual else {"ca_file": pki / "ca.pem"}
    async with tls_controller(pki, mutual=mutual, engine_tls=client_tls(pki)) as app:
        config = planner_config(
            tmp_path,
            {
                "controller": f"127.0.0.1:{app.port}",
                "controller_tls": paths(controller_tls),
                "engine_tls": paths(client_tls(pki)),
                "engine_args": ["--model", "sim", "--config", str(engine_config)],
                "metrics_listen": "127.0.0.1:0",
            },
        )
        channels = ClientChannels.load(ClientTlsConfig.model_validate(client_tls(pki)))
        lines = await planner_serves_a_prompt(app, config, channels)
        assert not any("ERROR" in line for line in lines), lines


def mutual_tls_engine_config(pki: Path, folder: Path) -> Path:
    """An engine config (for `--config`) serving TLS that requires a client certificate."""
    config = folder / "engine.yaml"
    config.write_text(json.dumps({"tls": paths(server_tls(pki, mutual=True).model_dump())}))
    return config


@pytest.mark.timeout(120)
async def test_planner_run_registers_a_deployments_pods_with_a_mutual_tls_controller(
    pki: Path, tmp_path: Path
) -> None:
    """The Kubernetes actuator dials the controller per `controller_tls` too (its pods serve
    plaintext here: the fake's readiness probe, like a kubelet's gRPC probe, has no TLS)."""
    async with tls_controller(pki, mutual=True, engine_tls=None) as app:
        settings = {"controller_tls": paths(client_tls(pki))}
        pod = await planner_registers_a_deployments_pod(app, tmp_path, settings)
        # The Deployment outlives the planner: its pod serves on, registered.
        assert [r.address for r in app.controller.fleet.registry.records()] == [pod]


async def planner_registers_a_deployments_pod(
    app: ControllerApp, tmp_path: Path, settings: dict[str, Any]
) -> str:
    """`kvplane planner run` scaling a Deployment (on the fake API server, by HTTP as through
    `kubectl proxy`) for the controller `app`, dialled with the `live:` `settings`: its pod
    is registered and routable, and the planner reads its load. Stopped (exit 0), the
    planner leaves it serving. The pod's address."""
    kube = FakeKube(tmp_path, engine_port=free_port())
    try:
        kube.add_deployment(DEPLOYMENT, 0, LABELS)
        kube_token = tmp_path / "kube-token"
        kube_token.write_text(kube.token)
        live = {
            "controller": f"127.0.0.1:{app.port}",
            **settings,
            "kubernetes": {
                "api_server": kube.url,
                "namespace": kube.namespace,
                "token_file": str(kube_token),
                "engine_port": kube.engine_port,
                "deployments": {"default": DEPLOYMENT},
                "poll_s": 0.1,
            },
            "metrics_listen": "127.0.0.1:0",
        }
        fleet = app.controller.fleet
        async with planner_run(planner_config(tmp_path, live)) as planner_process:
            metrics_port = await planner_metrics_port(planner_process)
            await fleet.wait_for(lambda: len(fleet.registry.routable()) == 1, 60)
            (pod,) = kube.ready_pods(DEPLOYMENT)
            assert [r.address for r in fleet.registry.routable()] == [kube.address(pod)]
            await eventually(lambda: engines_answering(metrics_port, 1), 60)
            assert await planner_process.stop() == 0
        return kube.address(pod)
    finally:
        kube.close()


@pytest.mark.timeout(60)
async def test_a_planner_without_controller_tls_says_the_controller_serves_tls(
    pki: Path, tmp_path: Path
) -> None:
    """Every start fails at once, in one log line naming the setting, and no engine is
    spawned."""
    async with tls_controller(pki, mutual=False, engine_tls=None) as app:
        config = planner_config(tmp_path, {"controller": f"127.0.0.1:{app.port}"})
        failed = await planner_start_refused(app, config, tmp_path / "work")
    assert " controller UNAVAILABLE: " in failed
    assert failed.endswith("(a TLS server? give live.controller_tls)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("serves", "dials", "hint"),
    [
        ("mutual-tls", "ca", "(a server requiring a client certificate? give "
         "live.controller_tls.cert_file and key_file)"),
        ("plaintext", "ca", "(a plaintext server? leave out live.controller_tls)"),
        ("tls", "plaintext", "(a TLS server? give live.controller_tls)"),
    ],
)  # fmt: skip
async def test_a_start_against_a_controller_the_tls_settings_do_not_match_names_the_setting(
    pki: Path, tmp_path: Path, serves: str, dials: str, hint: str
) -> None:
    tls = None if serves == "plaintext" else server_tls(pki, mutual=serves == "mutual-tls")
    app = await start_controller(ControllerConfig(listen="127.0.0.1:0", tls=tls))
    channels = ClientChannels.load(
        ClientTlsConfig(ca_file=pki / "ca.pem") if dials == "ca" else None
    )
    actuator = LocalProcesses(
        controller=f"127.0.0.1:{app.port}",
        engine_args=("--model", "sim"),
        workdir=tmp_path,
        start_timeout_s=60,
        channels=channels,
    )
    try:
        with pytest.raises(KvplaneError) as failed:
            await actuator.start("default")
    finally:
        await actuator.close()
        await app.close(0.2)
    message = str(failed.value)
    assert message.startswith("no engine of default started: controller UNAVAILABLE: ")
    assert message.endswith(hint) and "\n" not in message
    assert not actuator._spawned


@pytest.mark.timeout(60)
async def test_an_engine_the_controller_cannot_reach_is_no_start(pki: Path, tmp_path: Path) -> None:
    """The engines serve TLS; the controller dials them insecurely (no `engine_tls`): it
    takes the registration but never routes to the engine. The start fails in one line with
    what the controller says, the engine is taken out of it and stopped: the core must not
    count as serving an engine no request can reach."""
    engine_config = mutual_tls_engine_config(pki, tmp_path)
    async with tls_controller(pki, mutual=False, engine_tls=None) as app:
        actuator = LocalProcesses(
            controller=f"127.0.0.1:{app.port}",
            engine_args=("--model", "sim", "--config", str(engine_config)),
            workdir=tmp_path,
            start_timeout_s=3,
            channels=ClientChannels.load(ClientTlsConfig(ca_file=pki / "ca.pem")),
        )
        try:
            with pytest.raises(KvplaneError) as failed:
                await actuator.start("default")
        finally:
            await actuator.close()
        assert not app.controller.fleet.registry.records()
    message = str(failed.value)
    assert message.startswith(
        "engine default-0 did not start: the controller did not route to it within "
        "start_timeout_s (3 s): unreachable: "
    ), message
    assert "\n" not in message
    assert actuator.num_alive() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("live", "error"),
    [
        (
            {"controller_tls": {"ca_file": "{pki}/missing.pem"}},
            "live.controller_tls: cannot read TLS CA file {pki}/missing.pem: No such file or "
            "directory",
        ),
        (
            {"engine_tls": {"ca_file": "{pki}/ca.key"}},
            "live.engine_tls: TLS CA file {pki}/ca.key does not hold a certificate in PEM",
        ),
        (
            {"controller_tls": {"cert_file": "{pki}/client.pem", "key_file": "{pki}/server.key"}},
            "live.controller_tls: TLS key file {pki}/server.key cannot be used with certificate "
            "{pki}/client.pem: not its key",
        ),
        (
            {"engine_tls": {"cert_file": "{pki}/client.pem"}},
            "invalid config in {config}: live.engine_tls: cert_file and key_file go "
            "together (a client certificate)",
        ),
    ],
    ids=["missing-file", "not-a-certificate", "not-its-key", "cert-without-key"],
)
async def test_unusable_tls_settings_stop_the_planner_in_one_line_before_any_start(
    pki: Path, tmp_path: Path, live: dict[str, Any], error: str
) -> None:
    with socket.socket() as unused:  # bound, not listening: no controller
        unused.bind(("127.0.0.1", 0))
        controller = f"127.0.0.1:{unused.getsockname()[1]}"
        filled = json.loads(json.dumps(live).replace("{pki}", str(pki)))
        config = planner_config(tmp_path, {"controller": controller, **filled})
        process = await asyncio.create_subprocess_exec(
            *PLANNER, str(config), stderr=asyncio.subprocess.PIPE
        )
        _, stderr = await process.communicate()
    assert process.returncode == 1
    expected = error.format(pki=pki, config=config)
    assert stderr.decode().splitlines() == [f"kvplane: error: {expected}"]
    assert not (tmp_path / "work").exists()  # nothing started


@pytest.mark.timeout(60)
async def test_a_getload_refused_by_a_tls_engine_names_live_engine_tls(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A planner without `live.engine_tls` polling an engine that serves TLS: the failed
    GetLoad's warning says which setting is missing (else it loses the engine, once
    `lost_after_failed_polls` polls failed, without saying why)."""
    engine = await start_sim_engine("e0", tls=server_tls(pki))
    actuator = LocalProcesses(
        controller="127.0.0.1:1", engine_args=(), workdir=tmp_path, start_timeout_s=1
    )
    live = LivePlanner(planner(1, 1), actuator)
    address = f"127.0.0.1:{engine.port}"
    try:
        live._serve(address, "default")
        await live._poll(live.engines[address])
    finally:
        await live.close()
        await engine.close()
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GetLoad")]
    assert warning.startswith(f"GetLoad {address}: ")
    assert warning.endswith("(a TLS server? give live.engine_tls)")
