"""`kvplane up` starts a fleet of real processes and stops all of them on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.errors import ConfigError
from kvplane.up import load_fleet

REPO = Path(__file__).resolve().parents[2]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return int(reply.status)


@pytest.mark.timeout(120)
def test_up_starts_members_and_stops_them_on_sigint(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n  - {name: idx-a, kind: indexer}\n  - {name: idx-b, kind: indexer}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplane", "up", str(fleet), "--no-live"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        addresses: dict[str, str] = {}
        deadline = time.monotonic() + 90
        while len(addresses) < 2 and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            match = re.search(r"fleet member (\S+) \(indexer\) on (\S+)", line)
            if match:
                addresses[match.group(1)] = match.group(2)
        assert set(addresses) == {"idx-a", "idx-b"}
        for address in addresses.values():
            assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for address in addresses.values():
            with pytest.raises(grpc.RpcError):
                _health(address)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_up_runs_a_routed_fleet_of_sim_engines(tmp_path: Path) -> None:
    # The main job's shape (the embedded defaults, with the controller on a free port).
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: engine-0, kind: engine, config: {model: sim}}\n"
        "  - {name: engine-1, kind: engine, config: {model: sim}}\n"
        "  - name: controller\n"
        "    kind: controller\n"
        "    config: {engines: [{address: '${engine-0}'}, {address: '${engine-1}'}]}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplane", "up", str(fleet), "--no-live"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        controller = None
        deadline = time.monotonic() + 150
        while controller is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            match = re.search(r"fleet member controller \(controller\) on (\S+)", line)
            if match:
                controller = match.group(1)
        assert controller, "the controller never came up"
        ready: list[str] = []
        while len(ready) < 2 and time.monotonic() < deadline:
            result = subprocess.run(
                [sys.executable, "-m", "kvplane", "admin", "--target", controller,
                 "workers", "--output", "json"],
                capture_output=True, text=True, cwd=REPO, timeout=60,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            workers = json.loads(result.stdout)["workers"]
            ready = [w["address"] for w in workers if w["state"] == "ready"]
        assert len(ready) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fleet_refers_only_to_earlier_members(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: c, kind: controller, config: {engines: [{address: '${e}'}]}}\n"
        "  - {name: e, kind: engine}\n"
    )
    with pytest.raises(ConfigError, match="before it is defined"):
        load_fleet(fleet)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("policy", "exit_code"), [("kvplane", 0), ("round_robin", 1)])
def test_up_check_passes_only_when_prefixes_reach_their_holders(
    tmp_path: Path, policy: str, exit_code: int
) -> None:
    # The smoke test must be able to fail: prefix-blind routing sends each repeat elsewhere.
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "members:\n"
        "  - {name: engine-0, kind: engine, config: {model: sim}}\n"
        "  - {name: engine-1, kind: engine, config: {model: sim}}\n"
        "  - name: controller\n"
        "    kind: controller\n"
        f"    config: {{router: {{policy: {policy}}},\n"
        "             engines: [{address: '${engine-0}'}, {address: '${engine-1}'}]}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "kvplane", "up", str(fleet), "--check"],
        capture_output=True, text=True, cwd=REPO, timeout=200,
    )  # fmt: skip
    assert result.returncode == exit_code, result.stderr
    assert ("check passed" in result.stderr) == (exit_code == 0)
    assert "fleet stopped" in result.stderr


def test_configs_local_is_the_embedded_default() -> None:
    assert load_fleet(REPO / "configs" / "local.yaml").members == load_fleet(None).members


def test_embedded_defaults_are_a_valid_fleet() -> None:
    kinds = [m.kind for m in load_fleet(None).members]
    assert kinds.count("engine") >= 2
    assert "controller" in kinds
