"""`kvplane engine serve` as a real process: port file, health, Generate, clean SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import typer
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.core import TyperGroup

from engine.config import EngineConfig
from kvplane.cli import app
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]


def _kvplane() -> list[str]:
    exe = Path(sys.executable).with_name("kvplane")
    return (
        [str(exe)]
        if exe.exists()
        else [sys.executable, "-c", "from kvplane.cli import main; main()"]
    )


def _wait_for_port(port_file: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise AssertionError(
                f"engine exited early: {proc.stderr.read() if proc.stderr else ''!r}"
            )
        time.sleep(0.05)
    raise AssertionError("engine did not write its port file")


@pytest.mark.timeout(60)
def test_serve_sim_answers_health_and_generate_then_stops_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    config = tmp_path / "engine.yaml"
    config.write_text(
        "sim:\n  time_scale: 0.5\nblock_size: 4\nnum_kv_blocks: 2048\n"
        "max_model_len: 8192\nshutdown_grace_s: 1.0\n"
    )
    proc = subprocess.Popen(
        [
            *_kvplane(),
            "engine",
            "serve",
            "--config",
            str(config),
            "--model",
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--instance-id",
            "cli-engine",
            "--port-file",
            str(port_file),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        port = _wait_for_port(port_file, proc, 30)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.OpenEngineStub(channel)
            assert stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=10).instance_id == (
                "cli-engine"
            )
            ready = stub.Health(pb.HealthRequest(include_inference_probe=True), timeout=10)
            assert ready.state == pb.HEALTH_STATE_READY
            responses = list(
                stub.Generate(
                    pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=list(range(1, 20))),
                        stopping=pb.StoppingOptions(max_tokens=3),
                    ),
                    timeout=10,
                )
            )
            assert responses[-1].usage.completion_tokens == 3
            # SIGTERM with a long request in flight: it gets the grace period, then is
            # cancelled with a proper final event, and the process exits 0.
            long_stream = stub.Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=list(range(1, 20))),
                    stopping=pb.StoppingOptions(max_tokens=5000),
                ),
                timeout=30,
            )
            first = next(long_stream)
            assert first.WhichOneof("event") == "token"
            proc.send_signal(signal.SIGTERM)
            rest = list(long_stream)
            assert rest[-1].finished.reason == pb.FINISH_REASON_CANCELLED
            assert rest[-1].HasField("usage")
        assert proc.wait(timeout=30) == 0
        assert b"stopped" in (proc.stderr.read() if proc.stderr else b"")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_serve_refuses_a_bad_model_flag_as_a_usage_error(tmp_path: Path) -> None:
    """Before anything is loaded; a model named by the config file is a config error naming
    the file, checked with the rest of the config (it was refused only when the engine
    started, naming neither)."""
    missing = tmp_path / "missing"
    result = subprocess.run(
        [*_kvplane(), "engine", "serve", "--model", str(missing)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    said = f"model '{missing}' is not 'sim', 'builtin' or an HF model directory"
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1] == (
        f"Error: Invalid value for --model: {said} (one holding config.json)"
    )
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {missing}\n")
    result = subprocess.run(
        [*_kvplane(), "engine", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.decode().strip().splitlines() == [
        f"kvplane: error: invalid config in {config}: {said} (one holding config.json)"
    ]


@pytest.mark.timeout(60)
def test_serve_refuses_a_zmq_endpoint_in_use_with_one_line(tmp_path: Path) -> None:
    """The KV-event PUB socket cannot bind: one line and exit 1, not a process that says it
    serves and then hangs on its ZMQ context."""
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        config = tmp_path / "engine.yaml"
        config.write_text(
            "listen: 127.0.0.1:0\n"
            f"kv_events: {{zmq_enabled: true, endpoint: 'tcp://127.0.0.1:{port}',"
            " replay_endpoint: null}\n"
        )
        result = subprocess.run(
            [*_kvplane(), "engine", "serve", "--config", str(config)],
            cwd=REPO,
            capture_output=True,
            timeout=50,
        )
    finally:
        taken.close(linger=0)
        ctx.term()
    assert result.returncode == 1, result.stderr
    assert f"cannot bind ZMQ KV events to tcp://127.0.0.1:{port}".encode() in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("key", "endpoint", "problem"),
    [
        ("endpoint", "tcp://127.0.0.1", "expected tcp://HOST:PORT, got 'tcp://127.0.0.1'"),
        (
            "replay_endpoint",
            "tcp://127.0.0.1:99999",
            "port out of range in 'tcp://127.0.0.1:99999'",
        ),
        ("endpoint", "pgm://eth0;239.1.1.1:5555", "unsupported ZMQ transport 'pgm'"),
    ],
)
def test_serve_refuses_a_zmq_endpoint_it_cannot_bind_before_serving(
    tmp_path: Path, key: str, endpoint: str, problem: str
) -> None:
    """A KV-event endpoint without a port (or out of range, or on a transport the publisher
    does not bind) is the config's error, naming the key, before anything serves. Was: the
    engine logged that it served, then exited on libzmq's `Invalid argument`, naming no key
    (and `kvplane up` had already started the members before it)."""
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"listen: 127.0.0.1:0\nkv_events: {{zmq_enabled: true, {key}: '{endpoint}'}}\n"
    )
    result = subprocess.run(
        [*_kvplane(), "engine", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        timeout=50,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines  # no "serving ..." before it
    assert lines[0].startswith(f"kvplane: error: invalid config in {config}: kv_events.{key}: ")
    assert problem in lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("config", "flags", "line"),
    [
        ("", ["--model", "sim", "--runner", "pooling"], b"runner: pooling needs a torch model"),
        (
            "kv_transfer: {session_ttl_s: 5}\n",
            ["--role", "aggregated"],
            b"kv_transfer.session_ttl_s applies to PREFILL engines only",
        ),
    ],
)
def test_serve_refuses_contradictory_config_with_one_line(
    tmp_path: Path, config: str, flags: list[str], line: bytes
) -> None:
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(config)
    result = subprocess.run(
        [*_kvplane(), "engine", "serve", "--config", str(config_file), *flags],
        cwd=REPO,
        capture_output=True,
        timeout=50,
    )
    assert result.returncode == 1, result.stderr
    assert line in result.stderr
    assert b"Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("field", ["model", "role", "runner", "generation_config"])
def test_serve_help_gives_each_override_flag_the_configs_default(field: str) -> None:
    """`engine serve --role` and the like say what they fall back to, the config's default
    (they said what the values are, not which one an engine gets without them)."""
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    ctx = root.make_context("kvplane", ["engine", "serve"], resilient_parsing=True)
    group = root.get_command(ctx, "engine")
    assert isinstance(group, TyperGroup)
    serve = group.get_command(ctx, "serve")
    assert serve is not None
    flag = "--" + field.replace("_", "-")
    (option,) = [p for p in serve.params if flag in getattr(p, "opts", ())]
    assert f"default: {EngineConfig.model_fields[field].default})" in getattr(option, "help", "")
