"""End to end, as an operator runs it: a real `kvplane engine serve` publishing its KV events on
ZMQ, `kvplane indexer bridge` following it into a `kvplane indexer serve`, all subprocesses.
An engine killed outright (kill -9) leaves no stale blocks in the index, though it never
publishes again; restarted on the same endpoints, its new blocks are indexed, and only those."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from indexer.keys import block_keys
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.polling import eventually

pytestmark = pytest.mark.timeout(120)
WAIT_S = 30.0
BLOCK_SIZE = 16
WORKER = "engine-0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """The subprocesses of one test, each logging to a file; all killed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.running: list[subprocess.Popen[bytes]] = []
        self._arguments: list[tuple[str, ...]] = []  # each process's `kvplane` arguments

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.tmp_path / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvplane", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.running.append(process)
        self._arguments.append(args)
        return process

    def started_with(self, argument: str) -> list[subprocess.Popen[bytes]]:
        """The processes whose `kvplane` arguments include `argument` (a command's name)."""
        return [
            p for p, args in zip(self.running, self._arguments, strict=True) if argument in args
        ]

    async def serving(self, name: str, *args: str) -> str:
        """Spawn a server with a port file; its address once it listens."""
        port_file = self.tmp_path / f"{name}.port"
        port_file.unlink(missing_ok=True)
        process = self.spawn(name, *args, "--listen", "127.0.0.1:0", "--port-file", str(port_file))

        def listening() -> bool:
            assert process.poll() is None, (self.tmp_path / f"{name}.log").read_text()
            return port_file.exists()

        await eventually(listening, WAIT_S, f"{name} to listen")
        return f"127.0.0.1:{int(port_file.read_text())}"


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Processes]:
    spawned = Processes(tmp_path)
    yield spawned
    for process in spawned.running:
        if process.poll() is None:
            process.kill()
        process.wait()


async def _generate(engine: str, token_ids: list[int]) -> None:
    async with grpc.aio.insecure_channel(engine) as channel:
        request = pb.GenerateRequest(
            request_id="r",
            model="sim",
            token_ids=pb.TokenIds(ids=token_ids),
            stopping=pb.StoppingOptions(max_tokens=1, ignore_eos=True),
        )
        async for _ in pb_grpc.OpenEngineStub(channel).Generate(request):
            pass


async def _engine_cached_blocks(engine: str) -> int:
    async with grpc.aio.insecure_channel(engine) as channel:
        load = await pb_grpc.OpenEngineStub(channel).GetLoad(pb.GetLoadRequest())
    return int(load.attributes["cached_kv_blocks"])


async def _indexed_blocks(indexer: str) -> int:
    async with grpc.aio.insecure_channel(indexer) as channel:
        stats = await api_grpc.KvIndexStub(channel).GetIndexStats(api.GetIndexStatsRequest())
    return sum(w.num_blocks for w in stats.workers if w.worker_id == WORKER)


async def _prefix_blocks(indexer: str, token_ids: list[int]) -> int:
    """How many leading blocks of `token_ids` the index says the engine holds."""
    hashes = block_keys(token_ids, BLOCK_SIZE)
    async with grpc.aio.insecure_channel(indexer) as channel:
        response = await kv_grpc.KVIndexerStub(channel).MatchExternalKvPrefix(
            kv.MatchExternalKvPrefixRequest(hashes=hashes)
        )
    return max((m.matched_prefix_blocks for m in response.matches), default=0)


async def _engine_followed_by_a_bridge(
    tmp_path: Path, processes: Processes, *bridge_options: str
) -> tuple[str, str, Path, list[int]]:
    """A sim engine publishing over ZMQ (with replay), an indexer, and a bridge between them;
    returns the engine's and the indexer's addresses, the engine's config, and a prompt whose
    4 blocks are indexed. (A new prompt each try: what the engine publishes before the bridge
    has connected is lost (ZMQ), and the bridge rebuilds everything from the replay once it
    hears a batch.)"""
    zmq_port, replay_port = _free_port(), _free_port()
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"model: sim\nblock_size: {BLOCK_SIZE}\nnum_kv_blocks: 256\nsim:\n  time_scale: 0\n"
        f"kv_events:\n  zmq_enabled: true\n  endpoint: tcp://127.0.0.1:{zmq_port}\n"
        f"  replay_endpoint: tcp://127.0.0.1:{replay_port}\n"
    )
    engine = await processes.serving("engine", "engine", "serve", "--config", str(config))
    indexer = await processes.serving("indexer", "indexer", "serve")
    processes.spawn(
        "bridge",
        *("indexer", "bridge", "--target", indexer, "--worker-id", WORKER),
        *("--worker-address", engine),  # (prefix matches leave out workers without one)
        *("--endpoint", f"tcp://127.0.0.1:{zmq_port}"),
        *("--replay-endpoint", f"tcp://127.0.0.1:{replay_port}"),
        *bridge_options,
    )
    prompts = ([n, *range(1, 4 * BLOCK_SIZE)] for n in itertools.count(10_000))
    prompt: list[int] = []

    async def indexed() -> bool:
        nonlocal prompt
        prompt = next(prompts)
        await _generate(engine, prompt)
        return await _prefix_blocks(indexer, prompt) == 4

    await eventually(indexed, WAIT_S, "the engine's blocks in the index", every_s=0.2)
    return engine, indexer, config, prompt


async def test_a_killed_engine_leaves_no_stale_blocks_and_its_restart_is_indexed(
    tmp_path: Path, processes: Processes
) -> None:
    engine, indexer, config, first_prompt = await _engine_followed_by_a_bridge(tmp_path, processes)
    assert await _indexed_blocks(indexer) == await _engine_cached_blocks(engine)

    (engine_process,) = processes.started_with("engine")
    engine_process.send_signal(signal.SIGKILL)
    engine_process.wait()

    async def none_indexed() -> bool:
        return await _indexed_blocks(indexer) == 0

    # The dead engine publishes nothing more: only its connection's end can tell.
    await eventually(none_indexed, WAIT_S, "the killed engine's blocks to leave the index")

    engine = await processes.serving("engine", "engine", "serve", "--config", str(config))
    second_prompt = list(range(1000, 1000 + 3 * BLOCK_SIZE))
    await _generate(engine, second_prompt)

    async def second_indexed() -> bool:
        return await _prefix_blocks(indexer, second_prompt) == 3

    await eventually(second_indexed, WAIT_S, "the restarted engine's blocks in the index")
    assert await _prefix_blocks(indexer, first_prompt) == 0
    assert await _indexed_blocks(indexer) == await _engine_cached_blocks(engine)


async def test_a_stopped_engine_is_cleared_by_heartbeats_and_rebuilt_when_it_resumes(
    tmp_path: Path, processes: Processes
) -> None:
    """A stopped engine (SIGSTOP: the kernel keeps its connections up, as for a frozen host or
    a cut network) never closes its connection; only the bridge's heartbeats tell it is gone.
    Resumed, it publishes nothing new: its blocks come back from its replay at the
    reconnection, exactly those it holds."""
    engine, indexer, _, prompt = await _engine_followed_by_a_bridge(
        tmp_path,
        processes,
        # Short, so that the test is quick; the defaults are for real networks.
        *("--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "1"),
    )
    num_cached = await _engine_cached_blocks(engine)
    assert await _indexed_blocks(indexer) == num_cached

    (engine_process,) = processes.started_with("engine")
    engine_process.send_signal(signal.SIGSTOP)
    try:

        async def none_indexed() -> bool:
            return await _indexed_blocks(indexer) == 0

        await eventually(none_indexed, WAIT_S, "the stopped engine's blocks to leave the index")
    finally:
        engine_process.send_signal(signal.SIGCONT)

    async def all_back() -> bool:
        return await _indexed_blocks(indexer) == num_cached

    await eventually(all_back, WAIT_S, "the resumed engine's blocks back in the index")
    assert await _prefix_blocks(indexer, prompt) == 4
    assert await _engine_cached_blocks(engine) == num_cached  # (nothing new was generated)
