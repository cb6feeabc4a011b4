"""`kvplane up` starts a fleet of real processes, shows its status, checks it, and on Ctrl-C
drains and stops all of them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console

from kvplane.config import ClientTlsConfig
from kvplane.errors import ConfigError, KvplaneError
from kvplane.up.check import NUM_PREFIXES, check_fleet
from kvplane.up.command import admin_tls_flags
from kvplane.up.config import DEFAULT_FLEET, FleetConfig, load_fleet
from kvplane.up.fleet import WORKDIR_PREFIX, Fleet, remove_stale_workdirs
from kvplane.up.member import PARENT_ENV, member_environment
from kvplane.up.status import EngineStatus, FleetStatus, collect_status, render_status
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from planner.kube_api import SERVICE_ACCOUNT_DIR
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.engine.test_server_pooling_runner import write_headless_classifier
from tests.processes import DEFAULT_SIGNALS, running, wait_gone

REPO = Path(__file__).resolve().parents[2]
MEMBER_LINE = re.compile(r"fleet member (\S+) \((\w+)\) on (\S+) pid (\d+)")


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return int(reply.status)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


SIM_FLEET = (
    "members:\n"
    "  - {name: engine-0, kind: engine, config: {model: sim}}\n"
    "  - {name: engine-1, kind: engine, config: {model: sim}}\n"
    "  - name: controller\n"
    "    kind: controller\n"
    "    config: {engines: [{address: '${engine-0}'}, {address: '${engine-1}'}]}\n"
)


def _up(fleet: Path, tmp_path: Path, wrapper: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """`kvplane up FLEET --no-live` (this checkout's code), its log on a pipe; `wrapper`
    runs it (`nohup`)."""
    return subprocess.Popen(
        [*wrapper, sys.executable, "-m", "kvplane", "up", str(fleet), "--no-live"],
        stdout=subprocess.DEVNULL,  # not a terminal: nohup writes no nohup.out
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=_env(tmp_path / "cache"),
    )


def _up_check(fleet: Path, tmp_path: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`kvplane up FLEET --check` (this checkout's code) to its end."""
    return subprocess.run(
        [sys.executable, "-m", "kvplane", "up", str(fleet), "--check"],
        capture_output=True, text=True, cwd=REPO, timeout=timeout_s, env=_env(tmp_path / "cache"),
    )  # fmt: skip


def _serving_members(proc: subprocess.Popen[str], count: int) -> dict[str, tuple[str, int]]:
    """Name -> (address, pid) of the members, read from up's log once all `count` serve."""
    assert proc.stderr is not None
    members: dict[str, tuple[str, int]] = {}
    deadline = time.monotonic() + 90
    while len(members) < count and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        match = MEMBER_LINE.search(line)
        if match:
            members[match.group(1)] = (match.group(3), int(match.group(4)))
    return members


def _kill_leftovers(proc: subprocess.Popen[str], pids: list[int]) -> None:
    """After a test that failed half-way: neither up nor its members may outlive it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _sim_fleet_up(
    tmp_path: Path, text: str = SIM_FLEET, wrapper: tuple[str, ...] = ()
) -> Iterator[tuple[subprocess.Popen[str], dict[str, tuple[str, int]]]]:
    """`kvplane up` of a fleet of three members (`text`, SIM_FLEET's), once all serve: up and
    name -> (address, pid) of each; neither up nor a member outlives the block."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text)
    proc = _up(fleet, tmp_path, wrapper)
    pids: list[int] = []
    try:
        assert proc.stderr is not None
        members = _serving_members(proc, 3)
        pids = [pid for _, pid in members.values()]
        assert len(pids) == 3
        yield proc, members
    finally:
        _kill_leftovers(proc, pids)


def _default_fleet_on_free_ports() -> dict[str, Any]:
    fleet = yaml.safe_load(yaml.safe_dump(DEFAULT_FLEET))
    for member in fleet["members"]:
        member["config"]["listen"] = "127.0.0.1:0"
    return dict(fleet)


def _env(cache: Path) -> dict[str, str]:
    # A fresh model cache: the builtin model is built on first use, as on a fresh clone.
    # Up's own folder there too: a SIGKILLed up cannot remove it.
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "KVPLANE_CACHE_DIR": str(cache),
        "TMPDIR": str(cache.parent),
    }


@pytest.mark.timeout(120)
def test_ctrl_c_drains_in_flight_work_and_leaves_no_process(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "drain_deadline_s: 0.5\n"
        "members:\n"
        "  - {name: idx, kind: indexer}\n"
        "  - {name: engine-0, kind: engine, config: {model: sim}}\n"
        "  - name: controller\n"
        "    kind: controller\n"
        "    config: {engines: [{address: '${engine-0}'}]}\n"
    )
    proc = _up(fleet, tmp_path)
    try:
        assert proc.stderr is not None
        members = _serving_members(proc, 3)
        assert set(members) == {"idx", "engine-0", "controller"}
        for address, pid in members.values():
            assert _health(address) == health_pb2.HealthCheckResponse.SERVING
            assert _alive(pid)
        # The controller's metrics address (the live status reads its routing counters
        # there), announced after its member line.
        line = proc.stderr.readline()
        metrics = re.search(r"fleet member controller metrics on (http://\S+/metrics)", line)
        assert metrics, line
        with urllib.request.urlopen(metrics.group(1), timeout=10) as reply:
            assert b"kvplane_controller_route_decisions" in reply.read()

        # A long generation through the controller is in flight when Ctrl-C comes.
        events: list[str] = []
        first_token = threading.Event()

        def generate() -> None:
            with grpc.insecure_channel(members["controller"][0]) as channel:
                request = pb.GenerateRequest(
                    request_id="long",
                    model="sim",
                    token_ids=pb.TokenIds(ids=list(range(1, 33))),
                    stopping=pb.StoppingOptions(max_tokens=3000, ignore_eos=True),
                )
                try:
                    for response in pb_grpc.OpenEngineStub(channel).Generate(request, timeout=60):
                        events.append(response.WhichOneof("event") or "")
                        first_token.set()
                except grpc.RpcError as exc:
                    events.append(f"rpc error {exc.code().name}")
                finally:
                    first_token.set()

        client = threading.Thread(target=generate)
        client.start()
        assert first_token.wait(30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        client.join(timeout=30)
        assert not client.is_alive()
        assert events and events[0] == "token"
        # Cut short by the drain deadline (aborted), and the stream still ends properly.
        assert events.count("token") < 3000
        assert events[-1] == "finished"
        for address, pid in members.values():
            assert not _alive(pid)
            with pytest.raises(grpc.RpcError):
                _health(address)
        rest = proc.stderr.read()
        assert "fleet stopped" in rest
        # The indexer, which a draining controller may still read, ends last.
        ended = re.findall(r"(\S+) stopped with code 0", rest)
        assert sorted(ended[:2]) == ["controller", "engine-0"] and ended[2:] == ["idx"], rest
        assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # a run that went well
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_sigkill_of_up_takes_every_member_with_it(tmp_path: Path) -> None:
    """Nothing can catch SIGKILL: the members (in sessions of their own) must notice that
    their parent is gone, or they keep their ports (the default fleet's 127.0.0.1:8100)."""
    with _sim_fleet_up(tmp_path) as (proc, members):
        pids = [pid for _, pid in members.values()]
        assert all(running(pid) for pid in pids)
        assert remove_stale_workdirs(tmp_path) == []  # a running fleet's folder is kept
        proc.kill()
        proc.wait(timeout=10)
        assert wait_gone(pids, 15) == []
        # Its folder (member configs and logs) stays behind, for the next run to remove.
        [stale] = tmp_path.glob(f"{WORKDIR_PREFIX}{proc.pid}-*")
        assert (stale / "controller.log").exists()
        assert remove_stale_workdirs(tmp_path) == [stale] and not stale.exists()


@pytest.mark.timeout(120)
def test_a_member_that_dies_stops_the_fleet_and_fails_up(tmp_path: Path) -> None:
    with _sim_fleet_up(tmp_path) as (proc, members):
        assert proc.stderr is not None
        os.kill(members["engine-1"][1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        rest = proc.stderr.read()
        exit_line = re.search(
            r"ERROR .* engine-1 exited unexpectedly with code -9 \(SIGKILL\); "
            r"its log (\S+engine-1\.log) ends: .*serving",
            rest,
        )
        assert exit_line, rest
        assert "fleet stopped" in rest
        # The log named is still there: a failed run keeps its folder, and says where.
        log_path = Path(exit_line.group(1))
        assert "serving" in log_path.read_text()
        assert f"configs and logs are kept in {log_path.parent} (the next kvplane up" in rest
        assert "a member exited" in rest.splitlines()[-1]
        assert "Traceback" not in rest
        assert wait_gone([pid for _, pid in members.values()], 5) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("interrupt", "check"),
    [(signal.SIGINT, False), (signal.SIGHUP, False), (signal.SIGINT, True)],
    ids=["ctrl-c", "hangup", "ctrl-c-check"],
)
def test_interrupt_during_start_up_leaves_no_process(
    tmp_path: Path, interrupt: signal.Signals, check: bool
) -> None:
    """Ctrl-C, or the terminal going away (SIGHUP), stops every member: they run in sessions
    of their own, so nothing else would reach them. A check interrupted has failed, and says
    why."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(SIM_FLEET)
    proc = subprocess.Popen(
        [
            *DEFAULT_SIGNALS,
            sys.executable,
            "-m",
            "kvplane",
            "up",
            str(fleet),
            "--check" if check else "--no-live",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=_env(tmp_path / "cache"),
    )
    pids: list[int] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            match = re.search(r"engine-\d started \(pid (\d+)\)", line)
            if match:
                pids.append(int(match.group(1)))
        assert len(pids) == 2
        proc.send_signal(interrupt)  # the engines are starting; the controller is not
        assert proc.wait(timeout=60) == (1 if check else 0)
        rest = proc.stderr.read()
        assert "fleet stopped" in rest
        assert ("check failed: interrupted before it finished" in rest) == check, rest
        pids += [int(p) for p in re.findall(r"started \(pid (\d+)\)", rest)]
        assert not any(_alive(pid) for pid in pids)
    finally:
        _kill_leftovers(proc, pids)


@pytest.mark.timeout(120)
async def test_status_shows_load_cache_and_routing_of_a_running_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path / "cache"))
    config = FleetConfig.model_validate(
        {
            "members": [
                {"name": "engine-0", "kind": "engine", "config": {"model": "sim"}},
                {"name": "engine-1", "kind": "engine", "config": {"model": "sim"}},
                {
                    "name": "controller",
                    "kind": "controller",
                    "config": {
                        "tokenizer": "builtin",
                        "engines": [{"address": "${engine-0}"}, {"address": "${engine-1}"}],
                    },
                },
            ]
        }
    )
    fleet = Fleet(config, tmp_path)
    try:
        await fleet.start()
        assert await check_fleet(fleet.member("controller").address or "") == []
        # Nine routed requests (three per prefix), each repeat served from cache; the index
        # holds their blocks.
        deadline = time.monotonic() + 30
        status = await collect_status(fleet)
        while time.monotonic() < deadline and not (
            sum(status.decisions.values()) == 3 * NUM_PREFIXES
            and (status.index_blocks or 0) > 0
            and all(e.state == "ready" for e in status.engines)
        ):
            await asyncio.sleep(0.2)
            status = await collect_status(fleet)
        assert sum(status.decisions.values()) == 3 * NUM_PREFIXES
        assert status.policy == "kvplane"
        assert (status.index_blocks or 0) >= 3 * 256 // 16
        assert status.hit_ratio is not None and status.hit_ratio > 0.4
        engines = {e.name: e for e in status.engines}
        assert set(engines) == {"engine-0", "engine-1"}
        assert all(e.state == "ready" and e.total_kv_blocks for e in engines.values())
        assert sum(e.cached_blocks or 0 for e in engines.values()) >= 3 * 256 // 16
        assert sum(e.indexed_blocks or 0 for e in engines.values()) == status.index_blocks
        console = Console(record=True, width=80)  # a plain terminal's width
        console.print(render_status(status))
        text = console.export_text()
        for member in fleet.members:
            assert member.address is not None and member.address in text
        for name, engine in engines.items():
            row = next(line.split() for line in text.splitlines() if line.split()[:1] == [name])
            assert row[1:3] == ["ready", str(engine.running)], text  # nothing cut short
        assert "hit ratio" in text and "kvplane" in text
        # `tokenizer: builtin`: the controller tokenises text prompts for routing.
        async with grpc.aio.insecure_channel(fleet.member("controller").address or "") as ch:
            route = await apb_grpc.AdminStub(ch).Route(apb.PromptQuery(prompt="Hello, world"))
        assert route.tokenized and route.num_prompt_tokens > 0
    finally:
        await fleet.stop()  # drains first
    pids = [m.pid for m in fleet.members]
    assert all(pid is not None and not _alive(pid) for pid in pids)


def test_status_names_each_engines_model_when_the_fleet_serves_several() -> None:
    """The live view did not say which engine serves which model in a fleet of several
    (the JSON of `admin workers` did): it names them under the engines, within a plain
    terminal's width, long names whole; a fleet of one model goes without."""
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    engines = [
        EngineStatus("engine-0", "127.0.0.1:1", "ready", 0, 0, 3, 256, models=(llama,)),
        EngineStatus("engine-1", "127.0.0.1:2", "ready", 0, 0, 3, 256, models=(llama,)),
        EngineStatus("engine-2", "127.0.0.1:3", "unreachable", models=("b", "b-chat")),
    ]
    members: list[tuple[str, str, str, int | None, str]] = [
        ("controller", "controller", "127.0.0.1:4", 1, "running")
    ]
    console = Console(record=True, width=80)  # a plain terminal's width
    console.print(render_status(FleetStatus(members, engines)))
    text = " ".join(console.export_text().split())
    assert f"models {llama}: engine-0, engine-1; b: engine-2; b-chat: engine-2" in text
    assert "in flight" in text  # nothing cut short
    console = Console(record=True, width=80)
    console.print(render_status(FleetStatus(members, engines[:2])))
    assert "models" not in console.export_text()


def test_status_of_a_fleet_without_a_controller_shows_no_routing() -> None:
    """A fleet of engines alone routes nothing: the live view says so, where it showed a
    routing section of dashes and "decisions none yet", as if decisions were to come."""
    engines = [EngineStatus("engine-0", "127.0.0.1:1", "serving", 0, 0, 3, 256)]
    members: list[tuple[str, str, str, int | None, str]] = [
        ("engine-0", "engine", "127.0.0.1:1", 1, "serving")
    ]
    console = Console(record=True, width=80)  # a plain terminal's width
    console.print(render_status(FleetStatus(members, engines)))
    text = " ".join(console.export_text().split())
    assert "routing: none, the fleet has no controller" in text
    assert "decisions" not in text and "hit ratio" not in text
    assert "engine-0 serving 0 0 1%" in text  # the engines as before


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("fleet_name", "exit_code"), [("default", 0), ("round_robin", 1)])
def test_up_check_passes_only_when_prefixes_reach_their_holders(
    tmp_path: Path, fleet_name: str, exit_code: int
) -> None:
    fleet = tmp_path / "fleet.yaml"
    if fleet_name == "default":
        # The embedded defaults (three engines on the builtin model), on free ports.
        fleet.write_text(yaml.safe_dump(_default_fleet_on_free_ports()))
    else:
        # The smoke test must be able to fail: prefix-blind routing sends repeats elsewhere.
        fleet.write_text(
            "members:\n"
            "  - {name: engine-0, kind: engine, config: {model: sim}}\n"
            "  - {name: engine-1, kind: engine, config: {model: sim}}\n"
            "  - name: controller\n"
            "    kind: controller\n"
            "    config: {router: {policy: round_robin},\n"
            "             engines: [{address: '${engine-0}'}, {address: '${engine-1}'}]}\n"
        )
    result = _up_check(fleet, tmp_path, timeout_s=170)
    assert result.returncode == exit_code, result.stderr
    assert ("check passed" in result.stderr) == (exit_code == 0)
    assert "fleet stopped" in result.stderr
    pids = [int(m.group(4)) for m in MEMBER_LINE.finditer(result.stderr)]
    assert len(pids) == (4 if fleet_name == "default" else 3)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(180)
def test_up_check_passes_on_the_shipped_disaggregated_fleet(tmp_path: Path) -> None:
    """configs/local-disagg.yaml: a PREFILL and two DECODE engines on the builtin model, the
    decode engines pulling each prompt's KV from the prefill engine; the answers are complete
    and a repeated prompt gets the answer it got the first time."""
    fleet_config = yaml.safe_load((REPO / "configs" / "local-disagg.yaml").read_text())
    roles = {m["name"]: m["config"].get("role") for m in fleet_config["members"]}
    assert sorted(filter(None, roles.values())) == ["decode", "decode", "prefill"]
    for member in fleet_config["members"]:
        member["config"]["listen"] = "127.0.0.1:0"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(fleet_config))
    result = _up_check(fleet, tmp_path, timeout_s=170)
    assert result.returncode == 0, result.stderr
    assert "check passed" in result.stderr
    assert "drain failed" not in result.stderr
    pids = [int(m.group(4)) for m in MEMBER_LINE.finditer(result.stderr)]
    assert len(pids) == 4
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_up_check_reports_failed_requests_as_a_failed_check(tmp_path: Path) -> None:
    """A controller with no engine answers UNAVAILABLE: a failed check, not a traceback."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("members:\n  - {name: controller, kind: controller}\n")
    result = _up_check(fleet, tmp_path, timeout_s=110)
    assert result.returncode == 1, result.stderr
    assert "check failed: check-0-a: UNAVAILABLE" in result.stderr
    assert "check passed" not in result.stderr
    assert "Traceback" not in result.stderr
    assert "fleet stopped" in result.stderr


@pytest.mark.timeout(60)
def test_up_check_of_a_fleet_without_a_controller_starts_nothing(tmp_path: Path) -> None:
    """Nothing to check through: one error line before any member starts (an engine's model
    may take minutes to load), not after."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("members:\n  - {name: engine-0, kind: engine, config: {model: sim}}\n")
    result = _up_check(fleet, tmp_path, timeout_s=50)
    assert result.returncode == 1, result.stderr
    assert result.stderr == "kvplane: error: --check needs a controller in the fleet\n"
    assert not list(tmp_path.glob(f"{WORKDIR_PREFIX}*"))


def _pooling_fleet(tmp_path: Path, with_generating_engine: bool) -> Path:
    """A pooling-only engine (a classifier without an LM head, serving `a-classifier`) and,
    optionally, a sim engine (serving `sim`) behind a controller. The controller lists its
    models in the order of its engines' addresses: the pooling engine on 127.0.0.1 and the
    sim engine on 127.0.0.2 (loopback too) put `a-classifier` first."""
    classifier = write_headless_classifier(tmp_path / "models")
    pooling = {"model": str(classifier), "served_model_name": "a-classifier", "num_threads": 1}
    members: list[dict[str, Any]] = [{"name": "pool-0", "kind": "engine", "config": pooling}]
    if with_generating_engine:
        sim = {"model": "sim", "listen": "127.0.0.2:0"}
        members.append({"name": "gen-0", "kind": "engine", "config": sim})
    engines = [{"address": f"${{{m['name']}}}"} for m in members]
    members.append({"name": "controller", "kind": "controller", "config": {"engines": engines}})
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"members": members}))
    return fleet


@pytest.mark.timeout(180)
def test_up_check_sends_generate_to_a_model_that_generates_beside_a_pooling_engine(
    tmp_path: Path,
) -> None:
    """A healthy fleet with a pooling-only engine passes: the check generates on a model a
    generating engine serves, not on the first model the controller lists (the classifier's,
    where every Generate is FAILED_PRECONDITION)."""
    result = _up_check(_pooling_fleet(tmp_path, True), tmp_path, timeout_s=170)
    assert result.returncode == 0, result.stderr
    assert "check passed" in result.stderr
    assert "FAILED_PRECONDITION" not in result.stderr


@pytest.mark.timeout(180)
def test_up_check_of_a_pooling_only_fleet_is_one_problem_naming_why(tmp_path: Path) -> None:
    result = _up_check(_pooling_fleet(tmp_path, False), tmp_path, timeout_s=170)
    assert result.returncode == 1, result.stderr
    failed = [line for line in result.stderr.splitlines() if "check failed: " in line]
    assert len(failed) == 1, result.stderr
    assert failed[0].endswith(
        "check failed: no model generates: a-classifier served by pooling-only engines"
        " (runner: pooling) alone, and the check sends Generate requests"
    )
    assert "fleet stopped" in result.stderr


def _tls_fleet(pki: Path, client_tls: dict[str, Any]) -> str:
    """An engine and a controller serving mutual TLS (the controller dials the engine with
    `engine_tls`), and up's own `client_tls`."""
    mutual = {
        "cert_file": str(pki / "server.pem"),
        "key_file": str(pki / "server.key"),
        "client_ca_file": str(pki / "ca.pem"),
    }
    client = {
        "ca_file": str(pki / "ca.pem"),
        "cert_file": str(pki / "client.pem"),
        "key_file": str(pki / "client.key"),
    }
    return yaml.safe_dump(
        {
            "client_tls": {**client, **client_tls},
            "members": [
                {"name": "engine-0", "kind": "engine", "config": {"model": "sim", "tls": mutual}},
                {
                    "name": "controller",
                    "kind": "controller",
                    "config": {
                        "tls": mutual,
                        "engine_tls": client,
                        "engines": [{"address": "${engine-0}"}],
                    },
                },
            ],
        }
    )


@pytest.mark.timeout(120)
def test_up_check_dials_members_serving_tls_with_client_tls(tmp_path: Path, pki: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(_tls_fleet(pki, {}))
    result = _up_check(fleet, tmp_path, timeout_s=110)
    assert result.returncode == 0, result.stderr
    assert "check passed" in result.stderr
    assert "drain failed" not in result.stderr  # the engine was drained over TLS too
    assert "fleet stopped" in result.stderr
    pids = [int(m.group(4)) for m in MEMBER_LINE.finditer(result.stderr)]
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_up_check_reaches_members_run_with_auth_with_client_token_file(tmp_path: Path) -> None:
    """Members run with `auth` and `protect_reads` (every call needs the token): up sends
    `client_token_file` on every call (readiness, status, --check, the drain at the end), and
    the controller reaches its engine with `engine_token_file`."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    auth = {"token_file": str(token), "protect_reads": True}
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        yaml.safe_dump(
            {
                "client_token_file": str(token),
                "members": [
                    {
                        "name": "engine-0",
                        "kind": "engine",
                        "config": {"model": "sim", "auth": auth},
                    },
                    {
                        "name": "controller",
                        "kind": "controller",
                        "config": {
                            "auth": auth,
                            "engine_token_file": str(token),
                            "engines": [{"address": "${engine-0}"}],
                        },
                    },
                ],
            }
        )
    )
    result = _up_check(fleet, tmp_path, timeout_s=110)
    assert result.returncode == 0, result.stderr
    assert "check passed" in result.stderr
    assert "drain failed" not in result.stderr and "UNAUTHENTICATED" not in result.stderr
    assert "fleet stopped" in result.stderr


def test_up_refuses_an_unreadable_client_tls_file_before_starting_members(
    tmp_path: Path, pki: Path
) -> None:
    missing = tmp_path / "missing-ca.pem"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(_tls_fleet(pki, {"ca_file": str(missing)}))
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: client_tls: cannot read TLS CA file {missing}: No such file or directory"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("members: [{name: ../../x, kind: engine}]", "not a member name"),
        ("members: [{name: a/b, kind: engine}]", "not a member name"),
        ("members: [{name: 'a b', kind: engine}]", "not a member name"),
        ("members: [{name: '..', kind: engine}]", "not a member name"),
        ("members: [{name: '', kind: engine}]", "not a member name"),
        ("members: []", "members: List should have at least 1 item"),
        ("start_timeout_s: -1\nmembers: [{name: e, kind: engine}]", "start_timeout_s"),
        ("stop_timeout_s: 0\nmembers: [{name: e, kind: engine}]", "stop_timeout_s"),
        # Numbers are YAML numbers: lax pydantic took "120" as 120 s, `true` as 1 s.
        (
            "start_timeout_s: '120'\nmembers: [{name: e, kind: engine}]",
            "start_timeout_s: Input should be a valid number",
        ),
        (
            "drain_deadline_s: true\nmembers: [{name: e, kind: engine}]",
            "drain_deadline_s: Input should be a valid number",
        ),
        ("members: [{name: e, kind: engine, cpus: ['0']}]", "members.0.cpus.0: Input should be"),
    ],
)
def test_fleet_file_refuses(tmp_path: Path, text: str, message: str) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_fleet(fleet)


@pytest.mark.parametrize(
    ("kind", "config", "problem"),
    [
        ("engine", "{num_threads: 0}", "num_threads: Input should be greater than or equal to 1"),
        ("engine", "{lora: {enabled: 'yes'}}", "lora.enabled: Input should be a valid boolean"),
        ("engine", "{num_threads: '2'}", "num_threads: Input should be a valid integer"),
        (
            "controller",
            "{health: {poll_interval_s: true}}",
            "health.poll_interval_s: Input should be a valid number",
        ),
        ("engine", "{nosuch: 1}", "nosuch: Extra inputs are not permitted"),
        ("engine", "{model: /no/such/model}", "model '/no/such/model' is not 'sim', 'builtin'"),
        ("indexer", "{listen: nonsense}", "listen: expected HOST:PORT"),
        ("controller", "{engines: [{address: '${e0}:1'}]}", "engines.0.address: expected"),
    ],
)
def test_a_bad_member_config_is_reported_against_the_fleet_file_and_the_member(
    tmp_path: Path, kind: str, config: str, problem: str
) -> None:
    """Checked before any member starts (a member would report the copy up wrote for it)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: e0, kind: engine, config: {model: sim}}\n"
        f"  - {{name: m1, kind: {kind}, config: {config}}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_fleet(fleet)
    assert str(caught.value).startswith(f"invalid config in {fleet}, member m1: {problem}")


def test_up_with_a_bad_member_config_is_one_line_naming_the_fleet_file(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("members: [{name: e0, kind: engine, config: {model: sim, num_threads: 0}}]\n")
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member e0: num_threads: Input should be"
        " greater than or equal to 1"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member started


# A member whose file (TLS, token, tokenizer) is missing or unusable, and the line that says
# so: `{missing}` a path that does not exist, `{pki}` the test CA's folder.
BAD_FILES = [
    (
        "engine",
        "{model: sim, tls: {cert_file: '{missing}', key_file: '{missing}'}}",
        "tls: cannot read cert_file {missing}: No such file or directory",
    ),
    (
        "engine",
        "{model: sim, tls: {cert_file: '{pki}/server.pem', key_file: '{pki}/client.key'}}",
        "tls: key_file {pki}/client.key and cert_file {pki}/server.pem do not make a pair:"
        " not its key",
    ),
    (
        "engine",
        "{model: sim, role: decode, kv_transfer: {peer_token_file: '{missing}'}}",
        "cannot read kv_transfer.peer_token_file {missing}: No such file or directory",
    ),
    (
        "controller",
        "{tokenizer: '{missing}', engines: [{address: '${e0}'}]}",
        "cannot load tokenizer {missing}: No such file or directory (os error 2)",
    ),
    (
        "controller",
        "{tokenizers: {sim: '{missing}'}, engines: [{address: '${e0}'}]}",
        "cannot load tokenizer {missing}: No such file or directory (os error 2)",
    ),
    (
        "controller",
        "{engine_tls: {ca_file: '{missing}'}, engines: [{address: '${e0}'}]}",
        "engine_tls: cannot read TLS CA file {missing}: No such file or directory",
    ),
    (
        "indexer",
        "{auth: {token_file: '{missing}'}}",
        "cannot read auth.token_file {missing}: No such file or directory",
    ),
    (
        "indexer",
        "{tls: {cert_file: '{pki}/server.pem', key_file: '{pki}/server.key',"
        " client_ca_file: '{missing}'}}",
        "tls: cannot read client_ca_file {missing}: No such file or directory",
    ),
    (
        "planner",
        "{live: {controller_tls: {ca_file: '{missing}'}}}",
        "live.controller_tls: cannot read TLS CA file {missing}: No such file or directory",
    ),
    # Redis TLS files, read by the index as it opens (a controller's embedded one, an
    # indexer's), whether Redis is up or not.
    (
        "controller",
        "{index: {backend: 'redis://127.0.0.1:1/0', redis: {tls: {ca_file: '{missing}'}}},"
        " engines: [{address: '${e0}'}]}",
        "redis.tls: cannot read ca_file {missing}: No such file or directory",
    ),
    (
        "indexer",
        "{backend: 'rediss://127.0.0.1:1/0', redis: {tls: {cert_file: '{pki}/client.pem',"
        " key_file: '{missing}'}}}",
        "redis.tls: cannot read key_file {missing}: No such file or directory",
    ),
    # A Kubernetes planner's service-account files, where its config names them.
    (
        "planner",
        "{live: {kubernetes: {api_server: 'https://127.0.0.1:1', namespace: serving,"
        " token_file: '{missing}', deployments: {default: kvplane-engine}}}}",
        "cannot read live.kubernetes.token_file {missing}: No such file or directory",
    ),
    (
        "planner",
        "{live: {kubernetes: {api_server: 'https://127.0.0.1:1', namespace: serving,"
        " token_file: null, ca_file: '{missing}', deployments: {default: kvplane-engine}}}}",
        "live.kubernetes.ca_file {missing} is not a file",
    ),
]


@pytest.mark.parametrize(("kind", "config", "problem"), BAD_FILES)
def test_up_reads_every_members_files_before_starting_any(
    tmp_path: Path, pki: Path, kind: str, config: str, problem: str
) -> None:
    """A member's file that is missing or unusable is one line naming the fleet file, the
    member and the setting, before any member starts: before, the members listed above it
    were started, and stopped again once it failed on the file as it started."""
    missing = tmp_path / "missing"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: e0, kind: engine, config: {model: sim}}\n"
        "  - {name: c0, kind: controller, config: {engines: [{address: '${e0}'}]}}\n"
        f"  - {{name: m1, kind: {kind}, config: "
        f"{config.replace('{missing}', str(missing)).replace('{pki}', str(pki))}}}\n"
    )
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1
    said = problem.replace("{missing}", str(missing)).replace("{pki}", str(pki))
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member m1: {said}"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member started


@pytest.mark.skipif(SERVICE_ACCOUNT_DIR.exists(), reason="in a pod: the defaults exist")
def test_up_refuses_a_kubernetes_planner_left_to_a_pods_files_outside_a_pod(
    tmp_path: Path,
) -> None:
    """A Kubernetes planner member whose config leaves its token to the default, the pod's
    service-account token, is refused before any member starts where that file is not (up
    runs its members here, in its environment): before, it started, to fail on the file."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: c0, kind: controller}\n"
        "  - name: p\n"
        "    kind: planner\n"
        "    config: {live: {kubernetes: {api_server: 'http://127.0.0.1:1', namespace: serving,"
        " deployments: {default: kvplane-engine}}}}\n"
    )
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member p: cannot read"
        f" live.kubernetes.token_file {SERVICE_ACCOUNT_DIR}/token: No such file or directory"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member started


@pytest.mark.parametrize(
    ("setting", "conflict"),
    [
        (
            "role: decode",
            "serves Embed/Classify/Score only: role decode is for engines that generate"
            " (use role: aggregated)",
        ),
        (
            "lora: {enabled: true}",
            "takes no LoRA adapter (pooling tasks refuse lora_name): unset lora.enabled",
        ),
    ],
)
def test_up_refuses_a_headless_classifier_with_a_generating_setting_before_starting(
    tmp_path: Path, setting: str, conflict: str
) -> None:
    """`runner: auto` serves a classifier without an LM head for pooling only: a config it
    then refuses is one line naming the fleet file and the member before any member starts,
    as for an explicit `runner: pooling`, not an engine failing once the others run."""
    classifier = write_headless_classifier(tmp_path / "models")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: gen-0, kind: engine, config: {model: sim}}\n"
        f"  - {{name: pool-0, kind: engine, config: {{model: '{classifier}', {setting}}}}}\n"
    )
    result = _up_check(fleet, tmp_path, timeout_s=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvplane: error: invalid config in {fleet}, member pool-0: {classifier} is a sequence"
        f" classifier without an LM head, so runner auto serves it for pooling only, and"
        f" runner: pooling {conflict}"
    ]
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member started


def test_up_leaves_an_unreadable_checkpoint_to_the_engine(tmp_path: Path) -> None:
    """A checkpoint directory up cannot read (here: a config.json that is not JSON) is not a
    config error: the engine reports it when it starts, as for every engine."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"members: [{{name: e0, kind: engine, config: {{model: {model}, role: decode}}}}]\n"
    )
    assert [m.name for m in load_fleet(fleet).members] == ["e0"]


def test_member_names_may_use_what_a_placeholder_can_name(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: engine_0.a-1, kind: engine}\n"
        "  - {name: c, kind: controller, config: {engines: [{address: '${engine_0.a-1}'}]}}\n"
    )
    assert [m.name for m in load_fleet(fleet).members] == ["engine_0.a-1", "c"]


# A controller naming engine `${e}`.
_NAMING_E = "  - {name: c, kind: controller, config: {engines: [{address: '${e}'}]}}\n"


@pytest.mark.parametrize(
    ("members", "problem"),
    [
        (
            _NAMING_E + "  - {name: e, kind: engine}\n",
            "member 'c' refers to ${e} before it is defined: list 'e' above it",
        ),
        # A typo: it was said to come "before it is defined", as if a member further down
        # had the name.
        (
            "  - {name: e0, kind: engine}\n" + _NAMING_E,
            "member 'c' refers to ${e}, but no member is named 'e' (members: e0, c)",
        ),
    ],
    ids=["later", "nowhere"],
)
def test_fleet_refers_only_to_earlier_members(members: str, problem: str, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("members:\n" + members)
    with pytest.raises(ConfigError) as refused:
        load_fleet(fleet)
    assert str(refused.value) == f"invalid config in {fleet}: {problem}"


def test_configs_local_is_the_embedded_default() -> None:
    assert load_fleet(REPO / "configs" / "local.yaml").members == load_fleet(None).members


def test_embedded_defaults_are_three_builtin_engines_and_a_controller() -> None:
    members = load_fleet(None).members
    engines = [m for m in members if m.kind == "engine"]
    assert len(engines) == 3
    assert all(m.config["model"] == "builtin" for m in engines)
    assert [m.kind for m in members].count("controller") == 1


@pytest.mark.timeout(60)
async def test_a_member_with_cpus_runs_only_on_them(tmp_path: Path) -> None:
    """`cpus` pins the member's process (every thread it starts) to those CPUs."""
    cpu = max(os.sched_getaffinity(0))
    config = FleetConfig.model_validate(
        {
            "members": [
                {"name": "engine-0", "kind": "engine", "config": {"model": "sim"}, "cpus": [cpu]}
            ]
        }
    )
    fleet = Fleet(config, tmp_path)
    try:
        await fleet.start()
        pid = fleet.member("engine-0").pid
        assert pid is not None
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 1  # the gRPC server's threads too
        for thread in threads:
            assert os.sched_getaffinity(int(thread)) == {cpu}
    finally:
        await fleet.stop()


async def test_a_member_pinned_to_a_missing_cpu_is_refused_before_it_starts(
    tmp_path: Path,
) -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    config = FleetConfig.model_validate(
        {"members": [{"name": "engine-0", "kind": "engine", "cpus": [missing]}]}
    )
    fleet = Fleet(config, tmp_path)
    with pytest.raises(KvplaneError, match=rf"engine-0: cpus \[{missing}\] are not among"):
        await fleet.start()
    assert fleet.member("engine-0").pid is None
    empty = tmp_path / "fleet.yaml"
    empty.write_text("members: [{name: e, kind: engine, cpus: []}]\n")
    with pytest.raises(ConfigError, match="cpus"):
        load_fleet(empty)


def test_a_fleet_file_pinning_a_member_to_a_missing_cpu_is_refused_before_any_starts(
    tmp_path: Path,
) -> None:
    """Checked with the file, as every member's config is, naming the file and the member:
    the members listed before it were started first and stopped again (and the log said
    the fleet was stopping before the error)."""
    available = sorted(os.sched_getaffinity(0))
    missing = available[-1] + 1
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "members:\n"
        "  - {name: a, kind: engine, config: {model: sim}}\n"
        f"  - {{name: b, kind: engine, cpus: [{available[0]}, {missing}]}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_fleet(path)
    assert str(caught.value) == (
        f"invalid config in {path}, member b: cpus: [{missing}] are not among this "
        f"process's CPUs {available}"
    )


async def test_a_member_exiting_during_start_up_is_reported_with_its_exit_code(
    tmp_path: Path,
) -> None:
    config = FleetConfig.model_validate(
        {"members": [{"name": "engine-0", "kind": "engine", "config": {"nosuch": 1}}]}
    )
    fleet = Fleet(config, tmp_path)
    try:
        with pytest.raises(
            KvplaneError,
            match=r"engine-0 exited during start-up with code 1: .*nosuch: Extra inputs",
        ):
            await fleet.start()
    finally:
        await fleet.stop()


class _SlowFirstContact(Forwarding):
    """An engine whose GetEngineInfo (the controller's first contact) takes a second."""

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        await asyncio.sleep(1.0)  # a slow answer, not a wait for anything
        return await super().GetEngineInfo(request, context)


@pytest.mark.timeout(60)
async def test_a_member_that_never_listens_is_said_not_to_listen(tmp_path: Path) -> None:
    """A member that has not said where it listens by `start_timeout_s` (hung in its start:
    here stopped as it starts) fails the start as "not listening", and its empty log as
    empty. Before: "(not serving on None); its log ends: " and nothing."""
    config = {"start_timeout_s": 1, "members": [yaml.safe_load(SIM_FLEET)["members"][0]]}
    fleet = Fleet(FleetConfig.model_validate(config), tmp_path)
    engine = fleet.member("engine-0")
    starting = asyncio.ensure_future(fleet.start())
    try:
        while engine.process is None:  # noqa: ASYNC110 - no event to await
            await asyncio.sleep(0)
        os.kill(engine.process.pid, signal.SIGSTOP)
        with pytest.raises(KvplaneError) as caught:
            await starting
    finally:
        if engine.process is not None:
            os.kill(engine.process.pid, signal.SIGKILL)
        await fleet.stop()
    assert str(caught.value) == (
        "engine-0 did not become ready in 1.0s (not listening); its log is empty"
    )


@pytest.mark.timeout(60)
async def test_a_controller_is_up_once_it_has_reached_its_engines(tmp_path: Path) -> None:
    """A controller's health service serves before it has reached its engines, and until then
    it routes nothing: `up` waits for that too, so the check (or an operator) that starts at
    once finds the engines routable."""
    engine = await start_fronted_engine("slow-0", _SlowFirstContact)
    controller = {"engines": [{"address": f"127.0.0.1:{engine.port}"}]}
    config = FleetConfig.model_validate(
        {"members": [{"name": "controller", "kind": "controller", "config": controller}]}
    )
    fleet = Fleet(config, tmp_path)
    try:
        await fleet.start()
        assert await check_fleet(fleet.member("controller").address or "") == []
    finally:
        await fleet.stop()
        await engine.close()


async def _refused_while_stopping(stub: pb_grpc.OpenEngineAsyncStub) -> grpc.aio.AioRpcError:
    """Short requests sent until one is refused by the controller's own drain (those that
    come before it drains are served, or may meet an engine already draining)."""
    outcomes: list[str] = []
    try:
        async with asyncio.timeout(30):
            for n in itertools.count():
                request = pb.GenerateRequest(
                    request_id=f"late-{n}",
                    model="sim",
                    token_ids=pb.TokenIds(ids=[1, 2, 3]),
                    stopping=pb.StoppingOptions(max_tokens=1),
                )
                try:
                    _ = [r async for r in stub.Generate(request, timeout=10)]
                    outcomes.append("served")
                except grpc.aio.AioRpcError as exc:
                    if exc.details() == "the controller is draining":
                        return exc
                    outcomes.append(f"{exc.code().name}: {exc.details()}")
    except TimeoutError:
        pass
    raise AssertionError(f"the controller never refused as draining: {outcomes[-5:]}")


@pytest.mark.timeout(90)
async def test_stopping_drains_the_controller_too(tmp_path: Path) -> None:
    """While the fleet stops, a request reaching the controller is refused by the controller
    itself (UNAVAILABLE, it drains), not routed to an engine that is draining. A long
    generation in flight holds the controller's drain open (the deadline is far); once its
    client leaves, the drains end and the stop completes."""
    config = yaml.safe_load(SIM_FLEET)
    config["drain_deadline_s"] = 60
    fleet = Fleet(FleetConfig.model_validate(config), tmp_path)
    stopping: asyncio.Task[None] | None = None
    try:
        await fleet.start()
        async with grpc.aio.insecure_channel(fleet.member("controller").address or "") as ch:
            stub = pb_grpc.OpenEngineStub(ch)
            long = stub.Generate(
                pb.GenerateRequest(
                    request_id="long",
                    model="sim",
                    token_ids=pb.TokenIds(ids=list(range(1, 33))),
                    stopping=pb.StoppingOptions(max_tokens=3000, ignore_eos=True),
                )
            )
            first = await long.read()
            assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
            stopping = asyncio.create_task(fleet.stop())
            try:
                refused = await _refused_while_stopping(stub)
            finally:
                long.cancel()
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        await stopping
        codes = {m.name: m.process.returncode for m in fleet.members if m.process is not None}
        assert codes == {"engine-0": 0, "engine-1": 0, "controller": 0}
    finally:
        if stopping is not None:
            await asyncio.wait([stopping])
        await fleet.stop()


def test_the_admin_hint_dials_the_fleet_as_up_does(tmp_path: Path) -> None:
    """On a terminal, up names the `kvplane admin` command that shows the fleet: with the
    fleet's client_tls it must carry the same files, or it could not connect."""
    assert admin_tls_flags(None) == ""
    tls = ClientTlsConfig(
        ca_file=tmp_path / "ca.pem",
        cert_file=tmp_path / "client.pem",
        key_file=tmp_path / "client.key",
    )
    assert admin_tls_flags(tls) == (
        f" --tls-ca {tmp_path}/ca.pem --tls-cert {tmp_path}/client.pem"
        f" --tls-key {tmp_path}/client.key"
    )
    named = ClientTlsConfig(ca_file=tmp_path / "ca.pem", server_name="engine.test")
    assert admin_tls_flags(named) == f" --tls-ca {tmp_path}/ca.pem --tls-server-name engine.test"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_member_whose_up_is_already_gone_exits_at_once() -> None:
    """A member sets its parent-death signal itself, after exec; `up` dying before that is
    caught by comparing the parent it was given with its real one. The variables are not
    passed on to the member's own children; the stop grace `up` gave stays the member's."""
    script = (
        "import os; from kvplane.up.member import join_fleet, stop_within_s; join_fleet(); "
        "print(sorted(os.sched_getaffinity(0)), "
        "[k for k in os.environ if k.startswith('KVPLANE_UP_')], stop_within_s(os.environ))"
    )
    cpu = max(os.sched_getaffinity(0))
    ours = {**os.environ, **member_environment([cpu], stop_within_s=7.5)}  # we are its parent
    alive = subprocess.run([sys.executable, "-c", script], env=ours, capture_output=True)
    assert alive.returncode == 0, alive.stderr
    assert alive.stdout.decode().strip() == f"[{cpu}] [] 7.5"
    orphan = {**ours, PARENT_ENV: str(os.getpid() + 1_000_000)}
    gone = subprocess.run([sys.executable, "-c", script], env=orphan, capture_output=True)
    assert (gone.returncode, gone.stdout) == (1, b"")


@pytest.mark.timeout(60)
async def test_members_killed_by_a_second_ctrl_c_are_not_drained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second Ctrl-C kills every member: the stop that follows says so once, not a
    failed drain for each member (their processes are not reaped yet), and each reports
    the SIGKILL it ended with."""
    fleet = Fleet(FleetConfig.model_validate(yaml.safe_load(SIM_FLEET)), tmp_path)
    try:
        await fleet.start()
        fleet.kill_all()
        with caplog.at_level("WARNING", logger="kvplane.up.fleet"):
            await fleet.stop()
    finally:
        await fleet.stop()
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvplane.up.fleet" and r.levelno >= logging.WARNING
    ]
    assert warned == []
    codes = [m.process.returncode for m in fleet.members if m.process is not None]
    assert codes == [-signal.SIGKILL] * 3


@pytest.mark.timeout(60)
async def test_the_stop_says_how_each_member_ended_one_already_gone_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A member whose process has ended before the stop reaches it (dead beside the one whose
    exit stopped the fleet, or killed by a second Ctrl-C while its drain was under way) is
    still said to have stopped, and how. Before, only the members the stop itself signalled
    were, so how the others ended went unsaid, at random."""
    fleet = Fleet(FleetConfig.model_validate(yaml.safe_load(SIM_FLEET)), tmp_path)
    try:
        await fleet.start()
        gone = fleet.member("engine-0").process
        assert gone is not None
        os.kill(gone.pid, signal.SIGKILL)
        await gone.wait()
        with caplog.at_level("INFO", logger="kvplane.up.fleet"):
            await fleet.stop()
    finally:
        await fleet.stop()
    stopped = [m for m in caplog.messages if " stopped with " in m]
    assert sorted(stopped) == [
        "controller stopped with code 0",
        "engine-0 stopped with code -9 (SIGKILL)",
        "engine-1 stopped with code 0",
    ]


async def _stand_in_fleet(tmp_path: Path) -> Fleet:
    """SIM_FLEET's members as stand-in processes (`sleep`, in sessions of their own, as up
    starts its members): running at once, nothing to start, drain or serve."""
    fleet = Fleet(FleetConfig.model_validate(yaml.safe_load(SIM_FLEET)), tmp_path)
    for member in fleet.members:
        member.process = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    return fleet


async def test_an_exit_seen_but_not_yet_reported_is_said_by_the_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`first_exit` names the member that ended; `kvplane up` cancelled before it reported it
    (a stop signal in the same moment) left how it ended unsaid by anyone: the stop skipped
    it as said. Now the stop says it (stand-in processes: they start in no time)."""
    fleet = await _stand_in_fleet(tmp_path)
    gone = fleet.member("engine-0")
    assert gone.process is not None
    os.kill(gone.process.pid, signal.SIGKILL)
    assert await fleet.first_exit() is gone  # and not reported: its caller was cancelled
    with caplog.at_level("INFO", logger="kvplane.up.fleet"):
        await fleet.stop()
    stopped = [m for m in caplog.messages if " stopped with " in m]
    assert sorted(stopped) == [
        "controller stopped with code -15 (SIGTERM)",
        "engine-0 stopped with code -9 (SIGKILL)",
        "engine-1 stopped with code -15 (SIGTERM)",
    ]


async def test_members_killed_then_stopped_keep_their_exit_status(tmp_path: Path) -> None:
    """A member killed (a second Ctrl-C) that ends just as the stop signals it still reports
    its SIGKILL: the stop's SIGTERM does not collect its exit status before asyncio does
    (which then said "Unknown child process pid N, will report returncode 255"). That race
    is narrow, so it is run many times, with stand-in processes (they start in no time)."""
    for _ in range(30):
        fleet = await _stand_in_fleet(tmp_path)
        fleet.kill_all()
        await fleet.stop()
        assert [m.process.returncode for m in fleet.members if m.process is not None] == [
            -signal.SIGKILL
        ] * 3


@pytest.mark.timeout(60)
async def test_a_member_deaf_to_sigterm_is_killed_after_stop_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A member that does not act on SIGTERM (hung; here stopped, which holds the signal
    pending) is killed after `stop_timeout_s`; the others stop cleanly."""
    config = yaml.safe_load(SIM_FLEET)
    config["stop_timeout_s"] = 1
    fleet = Fleet(FleetConfig.model_validate(config), tmp_path)
    try:
        await fleet.start()
        hung = fleet.member("engine-1")
        assert hung.pid is not None
        os.kill(hung.pid, signal.SIGSTOP)
        with caplog.at_level("WARNING", logger="kvplane.up.fleet"):
            await fleet.stop()
    finally:
        await fleet.stop()
    assert "engine-1 did not stop in time; killing it" in caplog.messages
    codes = {m.name: m.process.returncode for m in fleet.members if m.process is not None}
    assert codes == {"engine-0": 0, "engine-1": -signal.SIGKILL, "controller": 0}


@pytest.mark.timeout(120)
def test_a_hung_member_holds_up_no_other_members_stop(tmp_path: Path) -> None:
    """A member that answers neither its drain nor SIGTERM (hung; here stopped, which holds
    the signal pending) is killed at the stop's deadline, and the others, stopped each as its
    own drain ends, are gone by then: before, a hung controller (stopped first, as the last
    started) held every engine's SIGTERM back for `stop_timeout_s`, and each engine was
    stopped only after it was killed."""
    hurried = "drain_deadline_s: 0\nstop_timeout_s: 10\n" + SIM_FLEET
    with _sim_fleet_up(tmp_path, hurried) as (proc, members):
        assert proc.stderr is not None
        os.kill(members["controller"][1], signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        rest = proc.stderr.read()
        events = re.findall(r"(\S+) (stopped with .*|did not stop in time)", rest)
        assert sorted(events[:2]) == [
            ("engine-0", "stopped with code 0"),
            ("engine-1", "stopped with code 0"),
        ], rest
        assert events[2:] == [
            ("controller", "did not stop in time"),
            ("controller", "stopped with code -9 (SIGKILL)"),
        ], rest
        assert wait_gone([pid for _, pid in members.values()], 5) == []


def _read_until(proc: subprocess.Popen[str], seen: str, *needles: str) -> str:
    """Up's log, `seen` and what follows, until it has said each of `needles` (all of it if
    it ends first)."""
    assert proc.stderr is not None
    while not all(needle in seen for needle in needles):
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    return seen


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_fleet_stops_after_a_member_exited_kills_every_member(
    tmp_path: Path,
) -> None:
    """A member's exit stops the rest; Ctrl-C during that stop (here held up by a hung
    controller, answering neither its drain nor SIGTERM, with a long `stop_timeout_s`) is the
    operator's "now": every member is killed at once, as by a second Ctrl-C. Before, it was
    taken as a first Ctrl-C, a stop already under way, and did nothing."""
    patient = "drain_deadline_s: 0\nstop_timeout_s: 3600\n" + SIM_FLEET
    with _sim_fleet_up(tmp_path, patient) as (proc, members):
        assert proc.stderr is not None
        os.kill(members["controller"][1], signal.SIGSTOP)
        os.kill(members["engine-1"][1], signal.SIGKILL)
        seen = _read_until(proc, "", "stopping the fleet")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 1
        rest = seen + proc.stderr.read()
        assert "engine-1 exited unexpectedly with code -9 (SIGKILL)" in rest, rest
        assert "engine-1 stopped with" not in rest, rest  # said once
        assert "interrupted while stopping: killing every member now" in rest, rest
        assert "controller stopped with code -9 (SIGKILL)" in rest, rest
        assert wait_gone([pid for _, pid in members.values()], 5) == []


@pytest.mark.timeout(120)
def test_a_closed_terminals_second_hangup_does_not_kill_the_draining_fleet(
    tmp_path: Path,
) -> None:
    """A terminal closing (an ssh session dropped) sends the foreground `kvplane up` two
    SIGHUPs: its shell passes on the one it got to its jobs, then the kernel sends the
    foreground job another as the shell exits. The second is no "now": the stop goes on, each
    engine drained and stopping on its own (code 0). Before, it was taken as a second Ctrl-C
    and every member was killed. (The controller is hung, answering neither its drain nor
    SIGTERM, so that the stop is still under way when the second hangup comes; a Ctrl-C ends
    it.)"""
    patient = "drain_deadline_s: 0\nstop_timeout_s: 3600\n" + SIM_FLEET
    with _sim_fleet_up(tmp_path, patient, wrapper=DEFAULT_SIGNALS) as (proc, members):
        os.kill(members["controller"][1], signal.SIGSTOP)
        proc.send_signal(signal.SIGHUP)
        seen = _read_until(proc, "", "stopping the fleet")
        proc.send_signal(signal.SIGHUP)
        seen = _read_until(proc, seen, "while stopping")  # either message says it
        assert "hung up while stopping: the stop goes on" in seen, seen
        seen = _read_until(proc, seen, "engine-0 stopped", "engine-1 stopped")
        proc.send_signal(signal.SIGINT)  # the hung controller: killed now
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None
        rest = seen + proc.stderr.read()
        stopped = dict(re.findall(r"(\S+) stopped with (.*)", rest))
        assert stopped == {
            "engine-0": "code 0",
            "engine-1": "code 0",
            "controller": "code -9 (SIGKILL)",
        }, rest
        assert wait_gone([pid for _, pid in members.values()], 5) == []


def _error_before_any_member_starts(config: dict[str, Any], tmp_path: Path) -> str:
    """`kvplane up` of the fleet `config`, failing (exit 1) before it starts any member: its
    error, the one line it prints (it was preceded by "stopping the fleet: draining the
    controller and engines ..." and "fleet stopped", of a fleet none of which had started)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(config))
    proc = _up(fleet, tmp_path)
    _, errors = proc.communicate(timeout=60)
    assert proc.returncode == 1, errors
    lines = errors.splitlines()
    assert len(lines) == 1, errors
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("member", "setting"),
    [("controller", "listen"), ("engine-1", "metrics_listen")],
)
def test_a_held_port_fails_the_start_before_any_member_starts(
    tmp_path: Path, member: str, setting: str
) -> None:
    """A port another process holds (another fleet's controller on 127.0.0.1:8100, say) is
    found before anything starts, not once the members before its own have started (engines
    load models first), and the error names the member, its setting and the port."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = f"127.0.0.1:{holder.getsockname()[1]}"
        config = yaml.safe_load(SIM_FLEET)
        next(m for m in config["members"] if m["name"] == member)["config"][setting] = held
        error = _error_before_any_member_starts(config, tmp_path)
    assert error == (
        f"kvplane: error: {member} (its {setting}): cannot listen on {held}: Address already in"
        " use; no member was started (a kvplane up already running? stop it, or give "
        f"{member} another {setting} in the fleet file)"
    )
    assert list(tmp_path.glob(f"{WORKDIR_PREFIX}*")) == []  # no member, no log to keep


def test_an_address_given_to_two_members_fails_the_start_before_either_starts(
    tmp_path: Path,
) -> None:
    """Each member alone could bind it, so only the second's start would fail, once the
    first is up."""
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        shared = f"127.0.0.1:{probe.getsockname()[1]}"
    config = yaml.safe_load(SIM_FLEET)
    for member in config["members"][:2]:
        member["config"]["metrics_listen" if member["name"] == "engine-0" else "listen"] = shared
    assert _error_before_any_member_starts(config, tmp_path) == (
        f"kvplane: error: engine-0 (its metrics_listen) and engine-1 (its listen) both listen"
        f" on {shared}; no member was started"
    )


@pytest.mark.timeout(120)
def test_up_under_nohup_outlives_the_terminal_hangup(tmp_path: Path) -> None:
    """`nohup kvplane up &` starts up with SIGHUP ignored: the terminal closing must not stop
    the fleet. Here the hangup comes first and Ctrl-C after it: only Ctrl-C stops the fleet,
    as a first interrupt (drained), not as a second one (every member killed)."""
    with _sim_fleet_up(tmp_path, wrapper=("nohup",)) as (proc, members):
        assert proc.stderr is not None
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        rest = proc.stderr.read()
        assert "fleet stopped" in rest
        assert "interrupted again" not in rest, rest
        assert wait_gone([pid for _, pid in members.values()], 5) == []
