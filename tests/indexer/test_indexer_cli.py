"""End to end: `kvplane indexer serve` and `kvplane indexer bridge` as real subprocesses, fed by
a real ZMQ publisher replaying the vLLM capture, queried over gRPC, with `/metrics` and the
`kvplane admin index` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import msgpack
import pytest
import typer
import zmq.asyncio
from typer.testing import CliRunner, Result

from indexer.admin_cli import read_token_ids
from indexer.batch import Action, ActionType, Batch, Component, Tier, to_sfixed64
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.servicer import index_services
from indexer.sources.zmq import SourceCounters
from indexer.vllm_hash import VllmHashAlgo, block_hashes
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.cli import app
from kvplane.config import AuthConfig, ServerConfig
from kvplane.errors import KvplaneError
from kvplane.server import create_server
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from tests.boxed_text import unboxed
from tests.indexer.fake_kv_publisher import FakeKvPublisher
from tests.indexer.hybrid_events import hybrid_payload
from tests.indexer.vllm_capture import BLOCK_SIZE, final_live, live_messages, requests
from tests.polling import eventually
from tests.redis_servers import RedisServer
from tests.rotation import replace_file

pytestmark = pytest.mark.timeout(120)
KVPLANE = [str(Path(sys.executable).parent / "kvplane")]
WAIT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        return subprocess.Popen([*KVPLANE, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=20)


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_serve_ingests_zmq_answers_kvindexer_and_admin_cli(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    metrics_port = _free_port()
    config = tmp_path / "indexer.yaml"
    config.write_text(
        f"""
listen: 127.0.0.1:50051
metrics_listen: 127.0.0.1:{metrics_port}
backend: memory
block_size: {BLOCK_SIZE}
sources:
  - kind: zmq
    worker_id: w0
    worker_address: 10.0.0.1:8000
    endpoint: {publisher.endpoint}
    replay_endpoint: {publisher.replay_endpoint}
    topic: "kv@"
    hash: canonical
"""
    )
    port_file = tmp_path / "port"
    process = _spawn(
        [
            "indexer",
            "serve",
            "--config",
            str(config),
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
        ],
        tmp_path / "serve.log",
    )
    try:
        await eventually(lambda: port_file.exists() or process.poll() is not None, WAIT_S)
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        target = f"127.0.0.1:{int(port_file.read_text())}"
        await publisher.wait_subscribed()
        for message in live_messages():
            await publisher.publish(message.frames)
        async with grpc.aio.insecure_channel(target) as channel:
            index = api_grpc.KvIndexStub(channel)
            indexer = kv_grpc.KVIndexerStub(channel)
            final_blocks = len(final_live().live())

            async def indexed() -> int:
                return (await index.GetIndexStats(api.GetIndexStatsRequest())).num_blocks

            async def ingested() -> bool:
                return await indexed() == final_blocks and _source_messages(metrics_port) == 60

            await eventually(ingested, WAIT_S)
            # Every source counter is exported, with a HELP that says what it counts (not
            # the name of the field it is read from).
            helps = dict(
                line.removeprefix("# HELP ").split(" ", 1)
                for line in _metrics_text(metrics_port).splitlines()
                if line.startswith("# HELP kvplane_indexer_")
            )
            for field in SourceCounters.__slots__:
                assert f"kvplane_indexer_source_{field.removeprefix('num_')}_total" in helps
            assert {name: text for name, text in helps.items() if "num_" in text} == {}

            # The last request ran after the reset: all 5 full blocks of its prompt are live.
            prompt = requests()[-1]["prompt_token_ids"]
            match = await index.MatchTokens(api.MatchTokensRequest(token_ids=prompt))
            assert match.matches[0].worker_address == "10.0.0.1:8000"
            assert match.matches[0].matched_tokens == 5 * BLOCK_SIZE

            prefix = await indexer.MatchExternalKvPrefix(
                kv.MatchExternalKvPrefixRequest(hashes=list(match.block_keys))
            )
            assert prefix.best_prefix_blocks == 5
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await indexer.ApplyExternalKvBatch(kv.ApplyExternalKvBatchRequest(worker_id=""))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await indexer.ApplyExternalKvBatch(
                kv.ApplyExternalKvBatchRequest(
                    worker_id="ext",
                    worker_address="10.0.0.2:8000",
                    actions=[
                        kv.ExternalKvAction(type=kv.ACTION_REPORT, tier=kv.TIER_DRAM, hashes=[5, 6])
                    ],
                )
            )

        runner = CliRunner()
        stats = runner.invoke(app, ["admin", "index", "--target", target, "stats", "-o", "json"])
        assert stats.exit_code == 0, stats.output
        data = json.loads(stats.output)
        assert data["num_blocks"] == final_blocks + 2
        assert sorted(w["worker_id"] for w in data["workers"]) == ["ext", "w0"]
        # How its source keys w0 (`ext` is fed from outside: its keys are its client's), and
        # the latest plain prompt's first block, keyed as its tokens alone are canonically.
        root = data["keyings"][0].pop("root_block")
        assert root["key"] == block_keys(root["token_ids"], BLOCK_SIZE)[0], root
        assert data["keyings"] == [
            {
                "worker_id": "w0",
                "worker_address": "10.0.0.1:8000",
                "key_space": "KEY_SPACE_CANONICAL",
                "hash_seed": None,
            }
        ]
        table = runner.invoke(app, ["admin", "index", "--target", target, "stats"])
        assert (
            "  w0                       keyed KEY_SPACE_CANONICAL; its latest plain prompt root "
            f"block: key {root['key']}\n"
        ) in table.output, table.output

        tokens_file = tmp_path / "prompt.json"
        tokens_file.write_text(json.dumps(prompt))
        matched = runner.invoke(
            app,
            [
                "admin",
                "index",
                "match",
                "--target",
                target,
                "--tokens-file",
                str(tokens_file),
                "--block-size",
                str(BLOCK_SIZE),
                "-o",
                "json",
            ],
        )
        assert matched.exit_code == 0, matched.output
        assert json.loads(matched.output)["matches"][0]["matched_blocks"] == 5
        table = runner.invoke(
            app, ["admin", "index", "match", "-t", target, "--hashes", "5,6", "--hashes", "7"]
        )
        assert table.exit_code == 0, table.output
        assert "best prefix 2 of 3 blocks" in table.output and "10.0.0.2:8000" in table.output
        dumped = runner.invoke(
            app, ["admin", "index", "dump", "-t", target, "--worker-id", "ext", "-o", "json"]
        )
        assert dumped.exit_code == 0, dumped.output
        (batch,) = json.loads(dumped.output)
        assert batch["actions"][0]["hashes"] == [5, 6]
        assert batch["actions"][0]["tier"] == "TIER_DRAM"

        assert _stop(process) == 0
    finally:
        if process.poll() is None:
            process.kill()
        await publisher.close()


def _metrics_text(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _metric(metrics_port: int, series: str) -> float | None:
    """The value of one series on `/metrics` (None: not exported, or no answer yet)."""
    try:
        body = _metrics_text(metrics_port)
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def _source_messages(metrics_port: int) -> float:
    return _metric(metrics_port, 'kvplane_indexer_source_messages_total{worker_id="w0"}') or 0.0


async def test_serve_tells_a_publisher_it_cannot_reach_on_metrics_and_once_in_its_log(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    """A source's publisher address that nothing answers at (a wrong port, a firewall, an
    engine not up yet): ZMQ retries for ever and in silence, so the indexer said nothing and
    every counter stayed 0 as on an idle engine. It now warns once and exports
    `kvplane_indexer_source_up` 0, then 1 once the publisher is there."""
    pub_port = _free_port()
    metrics_port = _free_port()
    config = tmp_path / "indexer.yaml"
    config.write_text(
        f"""
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:{metrics_port}
backend: memory
sources:
  - kind: zmq
    worker_id: w0
    worker_address: 10.0.0.1:8000
    endpoint: tcp://127.0.0.1:{pub_port}
"""
    )
    log = tmp_path / "serve.log"
    process = _spawn(["indexer", "serve", "--config", str(config)], log)
    up = 'kvplane_indexer_source_up{worker_id="w0"}'
    unreachable = f"cannot reach publisher tcp://127.0.0.1:{pub_port}"
    publisher: FakeKvPublisher | None = None
    try:
        await eventually(lambda: unreachable in log.read_text(), WAIT_S)
        assert _metric(metrics_port, up) == 0
        publisher = FakeKvPublisher(context, endpoint=f"tcp://127.0.0.1:{pub_port}")
        await publisher.wait_subscribed()
        await eventually(lambda: _metric(metrics_port, up) == 1, WAIT_S)
        assert _stop(process) == 0
    finally:
        if process.poll() is None:
            process.kill()
        if publisher is not None:
            await publisher.close()
    assert log.read_text().count(unreachable) == 1


async def test_a_bridge_follows_its_token_file_rotated_with_the_indexers(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    """`kvplane indexer bridge --token-file F` and an indexer whose `auth.token_file` is F (one
    Secret mounted by both): a token rotated on disk is sent from the next batch, as every
    token file is followed (docs/architecture.md, "Rotation"). The bridge read it once, so the
    indexer, following its file, refused the next batch and the bridge stopped (exit 1)."""
    token = tmp_path / "token"
    token.write_text("first-token\n")
    config = tmp_path / "indexer.yaml"
    config.write_text(f"listen: 127.0.0.1:0\nauth: {{token_file: {token}}}\n")
    publisher = FakeKvPublisher(context)
    port_file = tmp_path / "port"
    serve = _spawn(
        ["indexer", "serve", "--config", str(config), "--port-file", str(port_file)],
        tmp_path / "serve.log",
    )
    bridge = None
    try:
        await eventually(lambda: port_file.exists() or serve.poll() is not None, WAIT_S)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        bridge = running = _spawn(
            [
                *("indexer", "bridge", "--endpoint", publisher.endpoint, "--target", target),
                *("--worker-id", "sgl-0", "--worker-address", "10.0.0.9:30000"),
                *("--nil-medium", "HBM", "--token-file", str(token)),
            ],
            tmp_path / "bridge.log",
        )
        await publisher.wait_subscribed()
        async with grpc.aio.insecure_channel(target) as channel:
            indexer = kv_grpc.KVIndexerStub(channel)

            def stored(seq: int, block: int) -> list[bytes]:
                batch = [0.0, [["BlockStored", [block], None, None, 4, None, None]], None]
                return [b"", seq.to_bytes(8, "big"), msgpack.packb(batch)]

            async def held(block: int) -> bool:
                request = kv.MatchExternalKvPrefixRequest(hashes=[block])
                return (await indexer.MatchExternalKvPrefix(request)).best_prefix_blocks == 1

            await publisher.send(stored(0, 11))
            await eventually(lambda: held(11), WAIT_S)
            replace_file(token, b"second-token\n")
            await publisher.send(stored(1, 21))

            async def delivered_after_the_rotation() -> bool:
                assert running.poll() is None, "the bridge exited"
                return await held(21)

            await eventually(delivered_after_the_rotation, WAIT_S)
        assert _stop(bridge) == 0
        assert _stop(serve) == 0
    finally:
        for process in (bridge, serve):
            if process is not None and process.poll() is None:
                process.kill()
        await publisher.close()
    assert "first-token" not in (tmp_path / "serve.log").read_text()
    assert "second-token" not in (tmp_path / "bridge.log").read_text()


async def test_bridge_subprocess_feeds_a_serve_subprocess(
    tmp_path: Path, context: zmq.asyncio.Context
) -> None:
    publisher = FakeKvPublisher(context)
    port_file = tmp_path / "port"
    serve = _spawn(
        ["indexer", "serve", "--listen", "127.0.0.1:0", "--port-file", str(port_file)],
        tmp_path / "serve.log",
    )
    bridge = None
    try:
        await eventually(lambda: port_file.exists() or serve.poll() is not None, WAIT_S)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        bridge = _spawn(
            [
                "indexer",
                "bridge",
                "--endpoint",
                publisher.endpoint,
                "--target",
                target,
                "--worker-id",
                "sgl-0",
                "--worker-address",
                "10.0.0.9:30000",
                "--nil-medium",
                "HBM",
                "--array-tail",
                "vllm",
            ],
            tmp_path / "bridge.log",
        )
        await publisher.wait_subscribed()
        batch = [0.0, [["BlockStored", [11, 12], None, None, 4, None, None]], None]
        await publisher.send([b"", (0).to_bytes(8, "big"), msgpack.packb(batch)])
        async with grpc.aio.insecure_channel(target) as channel:
            indexer = kv_grpc.KVIndexerStub(channel)
            request = kv.MatchExternalKvPrefixRequest(hashes=[11, 12])

            async def best() -> int:
                return (await indexer.MatchExternalKvPrefix(request)).best_prefix_blocks

            async def bridged() -> bool:
                return await best() == 2

            await eventually(bridged, WAIT_S)
            response = await indexer.MatchExternalKvPrefix(request)
            assert [m.worker_address for m in response.matches] == ["10.0.0.9:30000"]
            # A hybrid model's blocks 1-3, their groups past index 7 (--array-tail vllm reads
            # them). (It makes the worker hybrid: blocks 11 and 12 lose their prefix.)
            await publisher.send([b"", (1).to_bytes(8, "big"), hybrid_payload("array")])
            hybrid = kv.MatchExternalKvRequest(hashes=[1, 2, 3])

            async def hybrid_masks() -> list[int]:
                matches = (await indexer.MatchExternalKv(hybrid)).matches
                return [m for n in matches for t in n.hashes_by_tier for m in t.component_masks]

            async def hybrid_bridged() -> bool:
                return len(await hybrid_masks()) == 3

            await eventually(hybrid_bridged, WAIT_S)
            full, swa = Component.FULL, Component.SWA
            # Block 2 was evicted from the sliding-window group only.
            assert await hybrid_masks() == [full | swa, full, full | swa]
        assert _stop(bridge) == 0
        assert _stop(serve) == 0
    finally:
        for process in (serve, bridge):
            if process is not None and process.poll() is None:
                process.kill()
        await publisher.close()


def test_a_bad_config_is_one_line_and_exit_code_1(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("sources:\n  - kind: zmq\n    worker_id: ''\n    endpoint: tcp://x:1\n")
    result = subprocess.run(
        [*KVPLANE, "indexer", "serve", "--config", str(config)], capture_output=True, timeout=60
    )
    assert result.returncode == 1
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "sources.0.worker_id" in lines[0]


async def test_admin_match_prints_an_answer_beyond_grpcs_default_size(tmp_path: Path) -> None:
    """A long prompt at block size 1 (SGLang's page size) has a key per token: the answer's
    block keys pass gRPC's 4 MiB default for a reply."""
    services, _, _ = index_services(
        MemoryBackend(PrefixIndex()), default_block_size=1, max_concurrent_prefix_queries=4
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    tokens_file = tmp_path / "prompt.txt"
    tokens_file.write_text(" ".join(["7"] * 600_000))  # 600,000 8-byte keys: 4.8 MB
    command = ["admin", "index", "match", "-t", f"127.0.0.1:{port}", "-o", "json"]
    try:
        result = await asyncio.to_thread(
            CliRunner().invoke, app, [*command, "--tokens-file", str(tokens_file)]
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["num_query_blocks"] == 600_000
    finally:
        await server.stop(None)


async def test_admin_match_takes_unsigned_hashes_and_vllms_key_space(tmp_path: Path) -> None:
    backend = MemoryBackend(PrefixIndex())
    services, _, _ = index_services(backend, default_block_size=4, max_concurrent_prefix_queries=4)
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    target = f"127.0.0.1:{port}"
    tokens = list(range(10, 22))  # 3 blocks of 4
    vllm = block_hashes(tokens, 4, algo=VllmHashAlgo.SHA256_CBOR, python_hash_seed="0")
    try:
        await backend.apply(
            Batch(
                "vllm-0",
                (Action(ActionType.REPORT, Tier.HBM, tuple(to_sfixed64(h) for h in vllm)),),
                worker_address="10.0.0.3:8000",
            )
        )
        await backend.apply(
            Batch(
                "unsigned",
                (Action(ActionType.REPORT, Tier.HBM, (-1, -(1 << 63))),),
                worker_address="10.0.0.4:8000",
            )
        )
        runner = CliRunner()

        def match(*args: str) -> Result:
            return runner.invoke(app, ["admin", "index", "match", "-t", target, *args])

        # Engines print unsigned 64-bit hashes: 2**64 - 1 is -1 and 2**63 is -2**63 in sfixed64.
        unsigned = await asyncio.to_thread(
            match, "--hashes", f"{(1 << 64) - 1},{1 << 63}", "-o", "json"
        )
        assert unsigned.exit_code == 0, unsigned.output
        assert json.loads(unsigned.output)["best_prefix_blocks"] == 2
        for bad in ("x1", str(1 << 64)):
            rejected = await asyncio.to_thread(match, "--hashes", bad)
            assert rejected.exit_code == 2  # a usage error: no traceback, no RPC
            assert "Invalid value for --hashes" in rejected.output
            assert "Traceback" not in rejected.output

        tokens_file = tmp_path / "prompt.json"
        tokens_file.write_text(json.dumps(tokens))
        by_tokens = ["--tokens-file", str(tokens_file), "--block-size", "4", "-o", "json"]
        found = await asyncio.to_thread(
            match, *by_tokens, "--hash", "sha256_cbor", "--hash-seed", "0"
        )
        assert found.exit_code == 0, found.output
        (worker,) = json.loads(found.output)["matches"]
        assert (worker["worker_id"], worker["matched_blocks"], worker["matched_tokens"]) == (
            "vllm-0",
            3,
            12,
        )
        canonical = await asyncio.to_thread(match, *by_tokens)
        assert json.loads(canonical.output)["matches"] == []
        image = await asyncio.to_thread(match, *by_tokens, "--mm-item", "img:0:4:2")
        assert json.loads(image.output)["num_query_blocks"] == 3
        for item in ("img:0", "img:0:0"):  # no length; an item of no tokens
            malformed = await asyncio.to_thread(match, *by_tokens, "--mm-item", item)
            assert malformed.exit_code == 2 and "ID:OFFSET:LENGTH" in malformed.output
    finally:
        await server.stop(None)


BRIDGE = ["indexer", "bridge", "--target", "127.0.0.1:1", "--endpoint", "tcp://127.0.0.1:1"]
PROBE_INTERVAL_RULE = "must be 0 (off) or a positive, finite number of seconds"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--endpoint", "bogus", "expected a ZMQ endpoint like tcp://HOST:PORT, got 'bogus'"),
        ("--replay-endpoint", "127.0.0.1:5558", "expected a ZMQ endpoint"),
        ("--endpoint", "tcp://no-port", "expected tcp://HOST:PORT, got 'tcp://no-port'"),
        ("--endpoint", "nope://x", "unknown ZMQ transport 'nope' in 'nope://x'"),
        ("--worker-id", "", "must not be empty"),
        # Names the index refuses: every batch of the bridge would be refused.
        ("--worker-id", "w\t0", "worker_id must be printable text, got 'w\\t0'"),
        ("--worker-address", "a" * 257, "worker_address must be at most 256 characters, got 257"),
        ("--block-size", "0", "must be between 1 and 4294967295, got 0"),
        ("--block-size", str(1 << 32), f"must be between 1 and 4294967295, got {1 << 32}"),
        ("--hash", "bogus", "must be engine or canonical, got 'bogus'"),
        ("--array-tail", "vLLM", "Value error, 'vLLM' is not one of 'ignore', 'vllm'."),
        ("--clear-tier", "skip", "expected HBM, DRAM or SSD, got 'skip'"),
        ("--nil-medium", "GPU", "expected HBM, DRAM, SSD or skip, got 'GPU'"),
        ("--target", "", "is empty: give HOST:PORT"),
        ("--target", "127.0.0.1:73636", "port out of range in '127.0.0.1:73636'"),
        ("--probe-interval-s", "-1", f"{PROBE_INTERVAL_RULE}, got -1.0"),
        ("--probe-interval-s", "inf", f"{PROBE_INTERVAL_RULE}, got inf"),
        ("--heartbeat-interval-s", "0", "must be between 0.1 and 6553.5 seconds, got 0.0"),
        ("--heartbeat-timeout-s", "nan", "must be between 0.1 and 6553.5 seconds, got nan"),
    ],
)
def test_bridge_rejects_bad_options_before_starting(option: str, value: str, message: str) -> None:
    # (Wide enough that Typer's error box does not wrap the message.)
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, [*BRIDGE, "--worker-id", "w0", option, value])
    assert result.exit_code == 2
    # Named alike whether click checks the type itself (a Literal's choices) or we do.
    assert f"Invalid value for {option}: {message}" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("endpoint", "reason"), [("norm://x", "Protocol not supported")])
def test_bridge_exits_on_an_endpoint_zmq_cannot_parse(endpoint: str, reason: str) -> None:
    _assert_fails_with_one_line(
        [*BRIDGE, "--worker-id", "w0", "--endpoint", endpoint],
        f"kvplane: error: cannot connect ZMQ endpoint {endpoint!r}: {reason}",
    )


@pytest.mark.parametrize(
    ("option", "error"),
    [
        ("--token-file", "--token-file: token file {path} is empty"),
        ("--tls-ca", "--tls-ca: TLS CA file {path} does not hold a certificate in PEM"),
    ],
)
def test_bridge_refuses_an_unusable_file_as_a_usage_error_before_starting(
    tmp_path: Path, option: str, error: str
) -> None:
    """A file an option gives, as `kvplane admin` refuses its own (it was exit 1)."""
    blank = tmp_path / "blank"
    blank.write_text("  \n")
    result = subprocess.run(
        [sys.executable, "-m", "kvplane", *BRIDGE, "--worker-id", "w0", option, str(blank)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("Usage: ") and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"Error: Invalid value for {error.format(path=blank)}"


def test_serve_stops_with_one_line_on_a_source_endpoint_zmq_cannot_parse(tmp_path: Path) -> None:
    # Well-formed for the config (a transport libzmq knows), not supported by this libzmq.
    config = tmp_path / "indexer.yaml"
    config.write_text(
        "listen: 127.0.0.1:0\nsources:\n"
        "  - {kind: zmq, worker_id: w0, endpoint: 'norm://x', block_size: 16}\n"
    )
    _assert_fails_with_one_line(
        ["indexer", "serve", "--config", str(config)],
        "kvplane: error: cannot connect ZMQ endpoint 'norm://x': Protocol not supported",
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            "max_request_bytes: 99999999999\n",
            "max_request_bytes: must be at most 2147483647 (2 GiB - 1, gRPC's "
            "limit), got 99999999999",
        ),
        (
            "sources:\n  - {kind: zmq, worker_id: w0, endpoint: '127.0.0.1:5557'}\n",
            "sources.0: endpoint: expected a ZMQ endpoint like tcp://HOST:PORT, "
            "got '127.0.0.1:5557'",
        ),
        (
            "sources:\n  - {kind: zmq, worker_id: w0, endpoint: 'tcp://127.0.0.1'}\n",
            "sources.0: endpoint: expected tcp://HOST:PORT, got 'tcp://127.0.0.1'",
        ),
        (
            "sources:\n  - {kind: openengine, target: '127.0.0.1:9', data_parallel_ranks: [-1]}\n",
            "sources.0.data_parallel_ranks.0: Input should be greater than or equal to 0",
        ),
        (
            "backend: redis://127.0.0.1:6379/abc\n",
            "backend: backend 'redis://127.0.0.1:6379/abc': the DB must be a number, got 'abc'",
        ),
        (
            "redis: {buckets: 64}\n",
            "redis: options are for a Redis backend, but backend is memory: remove "
            "the redis: block or set backend to redis://HOST:PORT/DB",
        ),
    ],
    ids=["max-request-bytes", "endpoint-no-scheme", "endpoint-no-port", "rank", "db", "redis"],
)
def test_serve_refuses_a_config_that_could_not_run(
    tmp_path: Path, content: str, problem: str
) -> None:
    """Each of these once started serving and then failed: a gRPC OverflowError traceback, a
    ZMQ source that ended the process, a source failing forever, a DB silently taken as 0."""
    config = tmp_path / "indexer.yaml"
    _assert_serve_says(config, content, f"invalid config in {config}: {problem}")


def _assert_serve_says(config: Path, content: str, error: str) -> None:
    """`kvplane indexer serve` on `content` writes `kvplane: error: ERROR`, only that, and
    exits 1."""
    config.write_text("listen: 127.0.0.1:0\n" + content)
    args = ["indexer", "serve", "--config", str(config)]
    assert len(_assert_fails_with_one_line(args, f"kvplane: error: {error}")) == 1


def test_serve_stops_with_one_line_on_a_backend_that_is_not_redis(tmp_path: Path) -> None:
    not_redis = grpc.server(ThreadPoolExecutor(max_workers=1))  # a gRPC port, say
    port = not_redis.add_insecure_port("127.0.0.1:0")
    not_redis.start()
    try:
        for url in (f"redis://127.0.0.1:{port}/0", f"redis+cluster://127.0.0.1:{port}"):
            _assert_serve_says(
                tmp_path / "indexer.yaml",
                f"backend: {url}\n",
                f"index backend: 127.0.0.1:{port} is not a Redis server (its reply is not "
                "Redis's protocol)",
            )
    finally:
        not_redis.stop(None)


def test_serve_stops_with_one_line_on_what_a_redis_refuses_for_good(tmp_path: Path) -> None:
    """A DB index out of range, cluster mode on a Redis without it: no retry cures those
    (a Redis that is down at start-up is retried: test_redis_backend.py)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    config = tmp_path / "indexer.yaml"
    where = f"127.0.0.1:{server.port}"
    try:
        _assert_serve_says(
            config,
            f"backend: redis://{where}/99\n",
            f"index backend: Redis at {where} has no such DB (DB index is out of range): the "
            "backend URL's DB must be below its `databases` setting",
        )
        _assert_serve_says(
            config,
            f"backend: redis+cluster://{where}\n",
            f"index backend: Redis at {where} is not a cluster node (cluster mode is not "
            "enabled): use redis://HOST:PORT/DB for a single Redis",
        )
    finally:
        server.stop()
    guarded = RedisServer(tmp_path / "guarded", extra_args=("--requirepass", "s3cret"))
    guarded.start()
    wrong = tmp_path / "password"
    wrong.write_text("nope")
    where = f"127.0.0.1:{guarded.port}"
    try:
        _assert_serve_says(
            config,
            f"backend: redis://{where}/0\nredis: {{password_file: {wrong}}}\n",
            f"index backend: Redis at {where} refused the credentials (invalid "
            "username-password pair or user is disabled.): check redis.username and "
            "redis.password_file",
        )
    finally:
        guarded.stop()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read redis.password_file {file}: No such file or directory"),
        ("  \n", "redis.password_file {file} is empty"),
    ],
)
def test_serve_names_the_password_file_it_cannot_use(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    """Read as every secret file is (`kvplane.config.read_token_file`), before Redis is
    dialled: was `redis password_file` with Python's errno text naming the file twice, and an
    empty file sent as an empty password."""
    file = tmp_path / "password"
    if content is not None:
        file.write_text(content)
    _assert_serve_says(
        tmp_path / "indexer.yaml",
        f"backend: redis://127.0.0.1:1/0\nredis: {{password_file: {file}}}\n",
        problem.format(file=file),
    )


def _assert_fails_with_one_line(args: list[str], last_line: str) -> list[str]:
    """`kvplane ARGS` exits 1 with `last_line` last on stderr and no traceback; returns the
    lines of stderr. (`python -m` from the repository root runs this checkout's code.)"""
    result = subprocess.run(
        [sys.executable, "-m", "kvplane", *args],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == last_line
    assert "Traceback" not in result.stderr
    return result.stderr.splitlines()


@pytest.mark.parametrize(
    ("content", "bad"),
    [
        ("1 2 x", None),
        ('{"ids": [1]}', None),
        ("[1, true]", None),
        ("[-1, 5]", -1),
        ("[4294967296]", 4294967296),
        ("7 4294967296", 4294967296),
    ],
)
@pytest.mark.parametrize("command", [["admin", "index", "match"], ["admin", "match"]])
def test_both_admin_clis_refuse_a_tokens_file_without_uint32_ids(
    tmp_path: Path, content: str, bad: int | None, command: list[str]
) -> None:
    """`admin match` (controller) and `admin index match` read --tokens-file alike."""
    tokens_file = tmp_path / "prompt.txt"
    tokens_file.write_text(content)
    result = CliRunner().invoke(
        app, [*command, "-t", "127.0.0.1:1", "--tokens-file", str(tokens_file)]
    )
    # A file an option gives in the wrong format: a usage error naming the option (exit 2).
    assert result.exit_code == 2
    if bad is None:
        expected = (
            f"Invalid value for --tokens-file: {tokens_file} must hold token ids (a JSON array, "
            'a JSON object with "token_ids" or "prompt_token_ids", or ids separated by spaces, '
            "commas or newlines), integers in 0..4294967295"
        )
    else:
        expected = (
            f"Invalid value for --tokens-file: {tokens_file}: token id {bad} is out of range "
            "(0 to 4294967295)"
        )
    assert unboxed(expected) in unboxed(result.output)


def test_both_admin_clis_read_a_vllm_style_request_object(tmp_path: Path) -> None:
    tokens_file = tmp_path / "request.json"
    tokens_file.write_text('{"prompt_token_ids": [5, 6, 7]}')
    assert read_token_ids(tokens_file) == [5, 6, 7]
    tokens_file.write_bytes(b"\xff\xfe")
    with pytest.raises(typer.BadParameter, match=r"^cannot read .*: not UTF-8 text$") as refused:
        read_token_ids(tokens_file)
    assert refused.value.param_hint == "--tokens-file"


@pytest.mark.parametrize(
    ("block_size", "message"),
    [("-1", "greater than or equal to 0"), (str(1 << 32), "less than or equal to 4294967295")],
)
def test_admin_match_refuses_a_block_size_out_of_uint32(
    tmp_path: Path, block_size: str, message: str
) -> None:
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text("[1, 2, 3, 4]")
    runner = CliRunner(env={"COLUMNS": "200"})
    match = ["admin", "index", "match", "-t", "127.0.0.1:1", "--tokens-file", str(tokens_file)]
    result = runner.invoke(app, [*match, "--block-size", block_size])
    assert result.exit_code == 2
    assert f"Invalid value for --block-size: Input should be {message}" in result.output


async def test_admin_dump_streams_the_same_json_array_and_table(tmp_path: Path) -> None:
    backend = MemoryBackend(PrefixIndex())
    services, _, _ = index_services(backend, default_block_size=4, max_concurrent_prefix_queries=4)
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
    runner = CliRunner()

    def dump(*args: str) -> Result:
        return runner.invoke(app, ["admin", "index", "dump", "-t", f"127.0.0.1:{port}", *args])

    try:
        empty_json = await asyncio.to_thread(dump, "-o", "json")
        empty_table = await asyncio.to_thread(dump)
        for worker, hashes in (("w-a", (1, 2, 3)), ("w-b", (7,))):
            await backend.apply(
                Batch(worker, (Action(ActionType.REPORT, Tier.HBM, hashes),), worker_address="a:1")
            )
        full_json = await asyncio.to_thread(dump, "-o", "json")
        full_table = await asyncio.to_thread(dump)
        unknown_worker = await asyncio.to_thread(dump, "--worker-id", "w-nope")
    finally:
        await server.stop(None)
    assert (empty_json.exit_code, empty_json.output) == (0, "[]\n")
    assert (empty_table.exit_code, empty_table.output) == (0, "(empty index)\n")
    # Not "(empty index)": the index holds blocks, only not that worker's.
    assert (unknown_worker.exit_code, unknown_worker.output) == (
        0,
        "(no entries of worker w-nope)\n",
    )
    assert full_json.exit_code == 0, full_json.output
    batches = json.loads(full_json.output)
    # Byte for byte what printing the collected list prints (the format before streaming).
    assert full_json.output == json.dumps(batches, indent=2, sort_keys=True) + "\n"
    held = {(b["worker_id"], h) for b in batches for a in b["actions"] for h in a["hashes"]}
    assert held == {("w-a", 1), ("w-a", 2), ("w-a", 3), ("w-b", 7)}
    assert full_table.exit_code == 0
    assert "worker w-a (a:1)" in full_table.output and "worker w-b (a:1)" in full_table.output


async def test_admin_resync_drops_an_engines_entries_with_the_token(tmp_path: Path) -> None:
    """`kvplane admin index resync ENGINE`: the engine's workers (its own, its ranks) lose
    their entries, others keep theirs; the RPC needs the indexer's token (UNAUTHENTICATED
    without it, one line, exit 1); an engine it knows nothing of is NOT_FOUND (one line, exit
    1); an empty ENGINE is a usage error."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    backend = MemoryBackend(PrefixIndex())
    services, _, _ = index_services(backend, default_block_size=4, max_concurrent_prefix_queries=4)
    server, port = await create_server(
        ServerConfig(listen="127.0.0.1:0", auth=AuthConfig(token_file=token_file)), services
    )
    runner = CliRunner()
    env = {"KVPLANE_TOKEN": ""}

    def resync(*args: str) -> Result:
        command = ["admin", "index", "resync", "-t", f"127.0.0.1:{port}", *args]
        return runner.invoke(app, command, env=env)

    try:
        for worker in ("a:1", "a:1/dp1", "b:1"):
            address = worker.split("/")[0]
            await backend.apply(
                Batch(
                    worker, (Action(ActionType.REPORT, Tier.HBM, (1, 2)),), worker_address=address
                )
            )
        refused = await asyncio.to_thread(resync, "a:1")
        table = await asyncio.to_thread(resync, "a:1", "--token-file", str(token_file))
        again = await asyncio.to_thread(
            resync, "a:1", "--token-file", str(token_file), "-o", "json"
        )
        unknown = await asyncio.to_thread(resync, "NOSUCH", "--token-file", str(token_file))
        blank = await asyncio.to_thread(resync, " ")
        left = [w.worker_id for w in (await backend.stats()).workers]
    finally:
        await server.stop(None)
    # A KvplaneError: `kvplane` prints its message as one line and exits 1.
    assert refused.exit_code == 1 and isinstance(refused.exception, KvplaneError)
    assert ": UNAUTHENTICATED: missing or invalid bearer token" in str(refused.exception)
    assert table.exit_code == 0, table.output
    assert table.stdout == ("a:1: 2 worker(s) dropped (a:1, a:1/dp1), 0 source(s) resubscribing\n")
    # An engine the indexer knows nothing of (no entries, no source here): NOT_FOUND, one
    # line, exit 1; it was "0 worker(s) dropped", as if done. Once dropped, a:1 fed from
    # outside is such an engine too.
    for nothing_held, engine in ((unknown, "NOSUCH"), (again, "a:1")):
        assert nothing_held.exit_code == 1 and isinstance(nothing_held.exception, KvplaneError)
        assert str(nothing_held.exception) == (
            f"127.0.0.1:{port}: NOT_FOUND: engine {engine!r} is unknown to this indexer: no "
            "worker holds its entries and no source of this indexer follows it (give its "
            "address or worker id, as `kvplane admin index stats` lists them)"
        )
    assert blank.exit_code == 2 and "Invalid value for ENGINE: is empty" in blank.output
    assert left == ["b:1"]


async def test_admin_index_reads_a_read_protected_indexer_with_the_token(tmp_path: Path) -> None:
    """With `auth.protect_reads` every RPC needs the token: each `admin index` command sends
    the one of `--token-file`, else of $KVPLANE_TOKEN (the token resync already took). An
    empty token file is refused before any call, as the server refuses one in its config."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    backend = MemoryBackend(PrefixIndex())
    await backend.apply(Batch("w-a", (Action(ActionType.REPORT, Tier.HBM, (1, 2)),), "a:1"))
    services, _, _ = index_services(backend, default_block_size=4, max_concurrent_prefix_queries=4)
    auth = AuthConfig(token_file=token_file, protect_reads=True)
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0", auth=auth), services)
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[1, 2, 3, 4, 5]")
    commands = [
        ["stats"],
        ["dump"],
        ["match", "--tokens-file", str(prompt), "--block-size", "4"],
        ["match", "--hashes", "1,2"],
    ]

    def index(*args: str, env: dict[str, str] | None = None) -> Result:
        runner = CliRunner(env={"KVPLANE_TOKEN": "", **(env or {})})
        return runner.invoke(app, ["admin", "index", "-t", f"127.0.0.1:{port}", *args])

    try:
        for command in commands:
            anonymous = await asyncio.to_thread(index, *command)
            assert anonymous.exit_code == 1 and "UNAUTHENTICATED" in str(anonymous.exception)
            with_file = await asyncio.to_thread(index, *command, "--token-file", str(token_file))
            assert with_file.exit_code == 0, with_file.output
            with_env = await asyncio.to_thread(index, *command, env={"KVPLANE_TOKEN": "s3cret"})
            assert with_env.exit_code == 0, with_env.output
        empty = tmp_path / "empty"
        empty.write_text("\n")
        refused = await asyncio.to_thread(index, "stats", "--token-file", str(empty))
        assert refused.exit_code == 2
        assert unboxed(f"Invalid value for --token-file: token file {empty} is empty") in unboxed(
            refused.output
        )
    finally:
        await server.stop(None)
