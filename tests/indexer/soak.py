"""A seeded fault soak of an indexer fleet (tests/soak_fleet.py's cycle, docs/soak.md): one
redis-server, two `kvplane indexer serve` replicas on it (short writer lease) with the same
`sources:` of three sim engines (two followed over their ZMQ publishers with a replay
endpoint, one over `SubscribeKvEvents`), a `kvplane indexer bridge` from a fourth engine's ZMQ
publisher into one replica through `ApplyExternalKvBatch`, a light stream of Generate
requests into the engines directly (64 KV blocks each, so prompts evict each other) and of
prefix queries against both replicas (the KVIndexer API's `MatchExternalKvPrefix`, the
kvplane index API's `MatchTokens`), and faults drawn at random from the seed: an engine, a
replica or the bridge killed with -9 and started again, a replica SIGSTOPped past its lease,
redis-server restarted empty, `ResyncEngine` asked of the replica not holding the engine's
lease (of either replica for the bridged engine).

After each fault, polled until all hold (bounded):

- the shared index places on each engine's worker exactly the blocks the engine holds (its
  `SubscribeKvEvents` snapshot), the bridged one's included;
- both replicas answer every prefix query (the six shared prefixes and the latest prompts)
  alike, with both APIs, and `MatchExternalKvPrefix` gives each engine the leading blocks it
  holds;

and throughout: a query or request failed only during a fault window, and then with a
retryable status. At the end no process the soak started is left. `drive(IndexerSoak(workdir,
seed), seconds=...)` returns a `SoakReport`; `docs/benchmarks/soak.py --fleet indexer` runs it
from the command line, tests/indexer/test_indexer_soak.py as a short CI test.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from indexer.keys import block_keys
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc
from tests.redis_servers import RedisServer, restartable_port
from tests.soak_fleet import (
    BLOCK,
    KVPLANE,
    PREFIXES,
    Process,
    SeededSoak,
    SoakEngine,
    engine_keys,
    index_mismatch,
    indexed_keys,
    prefix_head,
)

LEASE_S = 1.5
QUERY_DEADLINE_S = 15.0  # longer than any pause of a replica: a query to it waits
QUERY_APIS = ("MatchTokens", "MatchExternalKvPrefix")
RECENT_PROMPTS = 8  # besides the shared prefixes, the replicas are compared on these


@dataclass
class Engine(SoakEngine):
    zmq_ports: tuple[int, int] | None
    worker_id: str  # the index's worker for it
    bridged: bool = False  # fed by the bridge, not by the replicas' sources


class IndexerSoak(SeededSoak):
    """The indexer fleet, its traffic and its faults for one seeded run."""

    FAULTS = (
        "engine_restart",
        "indexer_restart",
        "indexer_pause",
        "bridge_restart",
        "redis_restart",
        "resync_elsewhere",
        "fault_while_paused",
    )

    def __init__(self, workdir: Path, seed: int) -> None:
        super().__init__(workdir, seed)
        # Ports below the ephemeral range: a process killed and started again finds its own
        # free (redis-server, engines and replicas restart on the ports they had).
        self.redis = RedisServer(workdir / "redis", port=restartable_port())
        self.engines: list[Engine] = [
            self._engine("e0", zmq=True),
            self._engine("e1", zmq=False),  # followed over SubscribeKvEvents
            self._engine("e2", zmq=True),
            self._engine("e3", zmq=True, bridged=True),
        ]
        self.indexers = [self._indexer(f"i{n}") for n in range(2)]
        self.bridge = self._bridge(self.engines[3], self.indexers[0][1])
        self.prompts: collections.deque[tuple[int, ...]] = collections.deque(maxlen=RECENT_PROMPTS)
        self.query_number = 0
        self.indexed: dict[str, int] = {}  # blocks per worker when last compared

    # -- the fleet ---------------------------------------------------------------------------

    def _engine(self, name: str, *, zmq: bool, bridged: bool = False) -> Engine:
        zmq_ports = (restartable_port(), restartable_port()) if zmq else None
        process, port = self._sim_engine(name, zmq_ports)
        worker_id = name if zmq else f"127.0.0.1:{port}"  # an OpenEngine source's: its target
        return Engine(process, port, zmq_ports, worker_id, bridged)

    def _indexer(self, name: str) -> tuple[Process, int]:
        port = restartable_port()
        sources = ""
        for engine in self.engines:
            if engine.bridged:
                continue
            if engine.zmq_ports is None:
                sources += f"  - {{kind: openengine, target: '{engine.address}'}}\n"
                continue
            publish, replay = engine.zmq_ports
            sources += (
                f"  - {{kind: zmq, worker_id: {engine.worker_id}, "
                f"worker_address: '{engine.address}', hash: engine, "
                f"endpoint: 'tcp://127.0.0.1:{publish}', "
                f"replay_endpoint: 'tcp://127.0.0.1:{replay}'}}\n"
            )
        config = (
            f"listen: 127.0.0.1:{port}\n"
            f"backend: '{self.redis.url}'\n"
            f"writer_lease_s: {LEASE_S}\n"
            f"replica_name: {name}\n"
            f"sources:\n{sources}"
        )
        return self._serve(name, "indexer", config), port

    def _bridge(self, engine: Engine, target_port: int) -> Process:
        assert engine.zmq_ports is not None
        publish, replay = engine.zmq_ports
        args = [
            *KVPLANE,
            "indexer",
            "bridge",
            "--endpoint",
            f"tcp://127.0.0.1:{publish}",
            "--replay-endpoint",
            f"tcp://127.0.0.1:{replay}",
            "--target",
            f"127.0.0.1:{target_port}",
            "--worker-id",
            engine.worker_id,
            "--worker-address",
            engine.address,
            "--probe-interval-s",
            "0.5",
        ]
        return Process("bridge", args, self.workdir)

    async def start(self) -> None:
        self.redis.start()
        for engine in self.engines:
            engine.process.start()
        for engine in self.engines:
            await engine.process.started()
        for process, _ in self.indexers:
            process.start()
        for process, _ in self.indexers:
            await process.started()
        self.bridge.start()
        await self.bridge.started()

    def stop(self) -> None:
        self.bridge.stop()
        for process, _ in self.indexers:
            process.stop()
        for engine in self.engines:
            engine.process.stop()
        self.redis.stop()

    # -- the client --------------------------------------------------------------------------

    async def _one_request(self, engine: Engine) -> None:
        prompt = self.prompt()
        kind = f"request to {engine.process.name}"
        if await self.request(engine.address, prompt, kind) is not None:
            self.report.requests["request ok"] += 1
            self.prompts.append(prompt)

    async def _one_query(self, replica: int, prompt: tuple[int, ...], api_name: str) -> None:
        started_in_fault = self.in_fault
        try:
            await self._query(replica, prompt, api_name)
        except grpc.aio.AioRpcError as exc:
            in_window = started_in_fault or self.in_fault
            kind = f"{api_name} to i{replica}"
            self.failed(kind, exc, kind, in_window)
            return
        self.report.requests[f"{api_name} ok"] += 1

    async def _query(self, replica: int, prompt: tuple[int, ...], api_name: str) -> bytes:
        """One prefix query of `prompt` to a replica: its answer, serialized (answers to
        compare between replicas)."""
        _, port = self.indexers[replica]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            if api_name == "MatchTokens":
                tokens_reply = await api_grpc.KvIndexStub(channel).MatchTokens(
                    api.MatchTokensRequest(token_ids=prompt, block_size=BLOCK),
                    timeout=QUERY_DEADLINE_S,
                )
                return tokens_reply.SerializeToString(deterministic=True)
            hashes = block_keys(prompt, BLOCK)
            prefix_reply = await kv_grpc.KVIndexerStub(channel).MatchExternalKvPrefix(
                kv.MatchExternalKvPrefixRequest(hashes=hashes),
                timeout=QUERY_DEADLINE_S,
            )
            prefix_reply.ClearField("blocks_read")  # observability only
            return prefix_reply.SerializeToString(deterministic=True)

    def traffic(self) -> list[Coroutine[Any, Any, None]]:
        """A request into a random engine and a prefix query to the replicas in turn."""
        engine = self.engines[self.traffic_rng.randrange(len(self.engines))]
        self.query_number += 1
        replica = self.query_number % 2
        api_name = QUERY_APIS[self.query_number // 2 % 2]
        return [self._one_request(engine), self._one_query(replica, self.prompt(), api_name)]

    # -- faults ------------------------------------------------------------------------------

    async def fault_indexer_restart(self) -> str:
        return await self.restart(self.rng.choice(self.indexers)[0])

    async def fault_indexer_pause(self) -> str:
        return await self.pause(self.rng.choice(self.indexers)[0], LEASE_S)

    async def fault_fault_while_paused(self) -> str:
        """A replica SIGSTOPped past its lease while an engine restarts (cold), redis-server
        restarts empty, or the other replica is asked to resync an engine (handed to the
        stopped one when it holds the lease): it resumes with a state of the world that is
        gone."""
        paused = self.rng.randrange(2)
        process, _ = self.indexers[paused]
        pause_s = self.rng.uniform(LEASE_S, 3 * LEASE_S)
        process.pause()
        started = asyncio.get_running_loop().time()
        inner = self.rng.choice(("engine_restart", "redis_restart", "resync"))
        if inner == "resync":
            engine = self.rng.choice([e for e in self.engines if not e.bridged])
            what = await self._resync(engine, 1 - paused, only_if_stream_lost=False)
        else:
            what = await getattr(self, f"fault_{inner}")()
        await asyncio.sleep(max(0.0, pause_s - (asyncio.get_running_loop().time() - started)))
        process.resume()
        return f"{what} while {process.name} is stopped ({pause_s:.1f} s)"

    async def fault_bridge_restart(self) -> str:
        return await self.restart(self.bridge)

    async def _lease_holder(self, engine: Engine) -> str | None:
        """The replica id holding the engine's writer lease (`P:l:<engine>`, docs/redis.md:
        `<partition>:l:<engine>` in Redis)."""

        def read() -> str | None:
            client = self.redis.client()
            for key in client.scan_iter(match=f"*:l:{engine.worker_id}"):
                holder = client.get(key)
                if holder is None:
                    return None
                assert isinstance(holder, bytes)  # the client does not decode responses
                return holder.decode()
            return None

        return await asyncio.to_thread(read)

    async def fault_resync_elsewhere(self) -> str:
        """`ResyncEngine` (sometimes `only_if_stream_lost`) through the replica not holding
        the engine's lease (the holder must do it); for the bridged engine (no lease), through
        either replica (its worker goes, and the bridge's probe must find that)."""
        engine = self.rng.choice(self.engines)
        replica = self.rng.randrange(2)  # drawn either way: the seed draws the same faults
        only_if_stream_lost = self.rng.random() < 0.3  # as a controller's first contact asks
        holder = None if engine.bridged else await self._lease_holder(engine)
        if holder is not None:
            replica = 1 if holder.startswith("i0/") else 0
        return await self._resync(engine, replica, only_if_stream_lost)

    async def _resync(self, engine: Engine, replica: int, only_if_stream_lost: bool) -> str:
        """`ResyncEngine` of `engine` through replica number `replica`: what it did."""
        holder = None if engine.bridged else await self._lease_holder(engine)
        _, port = self.indexers[replica]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                reply = await api_grpc.KvIndexStub(channel).ResyncEngine(
                    api.ResyncEngineRequest(
                        engine=engine.worker_id, only_if_stream_lost=only_if_stream_lost
                    ),
                    timeout=10,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # nothing of it indexed: done
                    raise
                return f"resync {engine.process.name} through i{replica}: not found"
        lost = " if its stream is lost" if only_if_stream_lost else ""
        return (
            f"resync {engine.process.name}{lost} through i{replica} (holder {holder}): dropped "
            f"{list(reply.dropped_worker_ids)}, handed to {list(reply.handed_to)}"
        )

    # -- invariants --------------------------------------------------------------------------

    async def disagreements(self) -> list[str]:
        found = []
        placed = await indexed_keys(self.redis.url, [e.worker_id for e in self.engines])
        self.indexed = {name: len(keys) for name, keys in placed.items()}
        truth: dict[str, set[int]] = {}
        for engine in self.engines:
            held = truth[engine.worker_id] = await engine_keys(engine.address)
            found += index_mismatch(engine.process.name, placed[engine.worker_id], held)
        queries = [prefix_head(p) for p in range(PREFIXES)] + list(self.prompts)
        for prompt in queries:
            answers = {}
            for api_name in QUERY_APIS:
                answers[api_name] = [await self._query(n, prompt, api_name) for n in range(2)]
                if answers[api_name][0] != answers[api_name][1]:
                    found.append(f"the replicas' {api_name} answers differ")
            expected = _prefix_matches(block_keys(prompt, BLOCK), truth)
            for replica, answer in enumerate(answers["MatchExternalKvPrefix"]):
                if (matched := _matched(answer)) != expected:
                    found.append(f"i{replica} matches {matched}, the engines hold {expected}")
        return found

    async def converged(self) -> None:
        """Both replicas answer a query of each API (outside a fault window now)."""
        print(f"    blocks indexed (each its engine's): {self.indexed}", flush=True)
        for replica in range(2):
            for api_name in QUERY_APIS:
                await self._one_query(replica, self.prompt(), api_name)


def _prefix_matches(keys: list[int], truth: dict[str, set[int]]) -> dict[str, int]:
    """Per worker, the leading blocks of `keys` its engine holds (those holding any)."""
    matches = {}
    for worker_id, held in truth.items():
        leading = 0
        while leading < len(keys) and keys[leading] in held:
            leading += 1
        if leading:
            matches[worker_id] = leading
    return matches


def _matched(answer: bytes) -> dict[str, int]:
    """A `MatchExternalKvPrefix` answer (as `_query` gives it) per worker."""
    reply = kv.MatchExternalKvPrefixResponse.FromString(answer)
    return {match.worker_id: match.matched_prefix_blocks for match in reply.matches}
