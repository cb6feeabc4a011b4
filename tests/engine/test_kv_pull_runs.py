"""The `kvplane-pull` stream's runs of blocks, as a DECODE engine's puller receives them: a
session spread over several messages arrives whole, one-block messages (a prefill engine from
before runs) still do, and every malformed run is refused (KvTransferError; UNAVAILABLE to the
client) before anything is imported. A scripted prefill engine sends what each test needs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from engine.core.api import EngineRequest
from engine.server.errors import KvTransferError
from engine.server.kv_pull import KvSessionPuller
from engine.server.kv_transfer import CHUNK_BYTES
from kvplane.channels import ClientChannels
from kvplane_api.v1 import kv_transfer_pb2 as kt
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    collect,
    fake_prefill_engine,
    generate_request,
    rpc_error,
    running_engine,
    sim_config,
)
from tests.partial_servicers import PartialKvTransfer

pytestmark = pytest.mark.timeout(60)

BLOCK_BYTES = 4
PROMPT = tuple(range(10, 24))  # block size 4: 3 full blocks transferred, block 3 holds the last
NUM_BLOCKS = 3
# Block i's bytes: recognisable, so that a block out of place shows.
BLOCKS = [bytes([i] * BLOCK_BYTES) for i in range(NUM_BLOCKS)]
Run = tuple[int, int, bytes]  # (index, num_blocks: 0 leaves it unset, data)


def run_of(index: int, num_blocks: int) -> Run:
    return (index, num_blocks, b"".join(BLOCKS[index : index + max(1, num_blocks)]))


class _ScriptedPrefillEngine(PartialKvTransfer):
    """Sends the header of PROMPT's 3-block session, then `runs`; records the requests."""

    def __init__(self, runs: Sequence[Run], *, block_size: int, kv_layout: str) -> None:
        self.runs = runs
        self.header = kt.KvSessionHeader(
            token_ids=PROMPT[: NUM_BLOCKS * block_size],
            block_size=block_size,
            kv_layout=kv_layout,
            num_blocks=NUM_BLOCKS,
        )
        self.requests: list[kt.PullKvSessionRequest] = []

    async def PullKvSession(
        self, request: kt.PullKvSessionRequest, context: Any
    ) -> AsyncIterator[kt.KvSessionChunk]:
        self.requests.append(request)
        yield kt.KvSessionChunk(header=self.header)
        for index, num_blocks, data in self.runs:
            yield kt.KvSessionChunk(
                block=kt.KvBlockData(index=index, num_blocks=num_blocks, data=data)
            )


@asynccontextmanager
async def scripted_prefill_engine(
    runs: Sequence[Run], *, block_size: int = 4, kv_layout: str = "test"
) -> AsyncIterator[tuple[_ScriptedPrefillEngine, pb.KvSessionRef]]:
    servicer = _ScriptedPrefillEngine(runs, block_size=block_size, kv_layout=kv_layout)
    async with fake_prefill_engine(servicer, "scripted") as session:
        yield servicer, session


@asynccontextmanager
async def puller(*, block_bytes: int = BLOCK_BYTES) -> AsyncIterator[KvSessionPuller]:
    kv_puller = KvSessionPuller(
        block_size=4,
        kv_layout="test",
        kv_block_bytes=block_bytes,
        channels=ClientChannels(),
        timeout_s=10,
    )
    try:
        yield kv_puller
    finally:
        await kv_puller.close()


async def pull(runs: Sequence[Run], *, block_bytes: int = BLOCK_BYTES) -> list[bytes]:
    async with (
        scripted_prefill_engine(runs) as (_, session),
        puller(block_bytes=block_bytes) as kv_puller,
    ):
        pulled = await kv_puller.pull(session, EngineRequest("d", PROMPT))
    assert pulled.token_ids == PROMPT[:12]
    return [bytes(block) for block in pulled.blocks]


@pytest.mark.parametrize(
    "runs",
    [
        pytest.param([run_of(0, 2), run_of(2, 1)], id="a run of two, then one"),
        pytest.param([run_of(0, 3)], id="one run of all"),
        pytest.param([run_of(0, 0), run_of(1, 0), run_of(2, 0)], id="one a chunk, unset count"),
        pytest.param([run_of(0, 1), run_of(1, 2)], id="one, then a run of two"),
    ],
)
async def test_a_session_arrives_whole_whatever_its_runs(runs: list[Run]) -> None:
    assert await pull(runs) == BLOCKS


async def test_the_puller_asks_for_runs_of_about_chunk_bytes() -> None:
    async with (
        scripted_prefill_engine([run_of(0, 3)]) as (prefiller, session),
        puller(block_bytes=CHUNK_BYTES // 4) as kv_puller,
    ):
        # Blocks of CHUNK_BYTES / 4 fail the size check here; only the request matters.
        with pytest.raises(KvTransferError):
            await kv_puller.pull(session, EngineRequest("d", PROMPT))
    assert prefiller.requests[0].max_blocks_per_chunk == 4
    async with puller(block_bytes=CHUNK_BYTES * 2) as kv_puller:  # a block over CHUNK_BYTES
        assert kv_puller._blocks_per_chunk == 1


@pytest.mark.parametrize(
    ("runs", "refusal"),
    [
        pytest.param([run_of(1, 2)], "unexpected chunk after 0 blocks", id="out of order"),
        pytest.param(
            [run_of(0, 2), run_of(1, 2)], "unexpected chunk after 2 blocks", id="overlapping"
        ),
        pytest.param([run_of(0, 1), run_of(2, 1)], "unexpected chunk after 1 blocks", id="a gap"),
        pytest.param(
            [run_of(0, 2), (2, 2, BLOCKS[2] * 2)], "a run of 2 blocks from block 2", id="past end"
        ),
        pytest.param(
            [(0, 2, BLOCKS[0])], r"blocks 0..1 have 4 bytes, expected 2 x 4", id="count too high"
        ),
        pytest.param(
            [(0, 1, BLOCKS[0] + BLOCKS[1]), run_of(2, 1)],
            r"blocks 0..0 have 8 bytes, expected 1 x 4",
            id="count too low",
        ),
        pytest.param(
            [(0, 2, BLOCKS[0] + b"\0\0")],
            r"have 6 bytes, expected 2 x 4",
            id="not a multiple of the block",
        ),
        pytest.param([run_of(0, 2)], "ended after 2 of 3 blocks", id="cut short"),
    ],
)
async def test_malformed_runs_are_refused(runs: list[Run], refusal: str) -> None:
    with pytest.raises(KvTransferError, match=refusal):
        await pull(runs)


async def test_a_run_longer_than_the_puller_asked_for_is_refused() -> None:
    # Blocks of CHUNK_BYTES / 2: the puller asks for runs of 2 and takes no more.
    big = CHUNK_BYTES // 2
    runs = [(0, 3, bytes(3 * big))]
    with pytest.raises(KvTransferError, match="more than the 2 asked for"):
        await pull(runs, block_bytes=big)


async def test_a_decode_engine_refuses_a_malformed_run_with_unavailable() -> None:
    overlapping = [(0, 2, b""), (1, 2, b"")]  # the sim runner's blocks are empty
    async with (
        scripted_prefill_engine(overlapping, kv_layout="sim:B4") as (_, session),
        running_engine(sim_config(role="decode")) as decoder,
    ):
        request = generate_request(list(PROMPT), max_tokens=2)
        request.kv.session.CopyFrom(session)
        error = await rpc_error(lambda: collect(decoder.stub, request))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "unexpected chunk after 2 blocks" in (error.details() or "")
