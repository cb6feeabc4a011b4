"""EngineLoop: steps run in one thread; asyncio consumers get outputs through their own queues
without blocking; validation fails before acceptance; abort, call and stop are thread-safe."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import replace
from enum import Enum
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from engine.core.api import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    ScheduledBatch,
    SchedulerConfig,
    SequenceResult,
    StepReport,
    StepResult,
)
from engine.core.engine_core import EngineCore, EngineLoop, asyncio_sink
from engine.core.engine_loop import OutputSink
from engine.core.errors import (
    AbortFailedError,
    DuplicateRequestError,
    EngineStoppedError,
    InvalidRequestError,
)
from engine.core.lora import AdapterConfig, LoraAdapter, TargetModules
from engine.core.sequence import Sequence
from engine.core.sim_runner import SimRunner
from engine.server.metrics import EngineMetrics
from tests.engine.test_kv_sessions_core import BytesRunner
from tests.polling import eventually


def make_loop(
    time_scale: float = 0.0,
    reports: list[StepReport] | None = None,
    on_step: Callable[[StepReport], None] | None = None,
) -> EngineLoop:
    runner = SimRunner(block_size=4, num_blocks=256, time_scale=time_scale)
    core = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=64))
    return EngineLoop(core, on_step=reports.append if reports is not None else on_step)


async def collect(queue: asyncio.Queue[RequestOutput]) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while not outputs or outputs[-1].usage is None:
        outputs.append(await asyncio.wait_for(queue.get(), timeout=10))
    return outputs


@asynccontextmanager
async def engine_thread_held(engine: EngineLoop) -> AsyncIterator[None]:
    """The engine thread busy in one command until the block ends: what is submitted
    meanwhile waits for it."""
    in_command, go_on = threading.Event(), threading.Event()

    def long_command(_core: EngineCore) -> None:
        in_command.set()
        go_on.wait(10)

    held = engine.call(long_command)
    assert await asyncio.to_thread(in_command.wait, 10)
    try:
        yield
    finally:
        go_on.set()
        await asyncio.wrap_future(held)


@pytest.mark.timeout(30)
async def test_concurrent_requests_stream_to_their_own_queues() -> None:
    reports: list[StepReport] = []
    engine = make_loop(reports=reports)
    engine.start()
    loop = asyncio.get_running_loop()
    queues: dict[str, asyncio.Queue[RequestOutput]] = {}
    for i in range(8):
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        queues[f"r{i}"] = queue
        sampling = SamplingParams(max_tokens=5 + i, num_sequences=1 + i % 2)
        request = EngineRequest(f"r{i}", tuple(range(10 + i, 30 + i)), sampling)
        engine.submit(request, asyncio_sink(loop, queue))
    results = await asyncio.gather(*(collect(q) for q in queues.values()))
    for i, outputs in enumerate(results):
        assert all(o.request_id == f"r{i}" for o in outputs)
        n = 1 + i % 2
        finished = [o for o in outputs if o.finished]
        assert sorted(o.output_index for o in finished) == list(range(n))
        assert sum(len(o.new_token_ids) for o in outputs) == n * (5 + i)
        assert outputs[-1].usage is not None
        assert outputs[-1].usage.completion_tokens == n * (5 + i)
    engine.stop(timeout_s=10)
    assert not engine.running
    assert any(r.kv_events for r in reports)
    assert all(r.result.stats is None or r.result.stats.batch_size > 0 for r in reports)
    assert engine.load().num_running == 0 and engine.num_live_requests() == 0


@pytest.mark.timeout(30)
async def test_bad_requests_fail_before_acceptance() -> None:
    engine = make_loop()
    engine.start()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    sink = asyncio_sink(loop, queue)
    with pytest.raises(InvalidRequestError):
        engine.submit(EngineRequest("a", (1, 2), SamplingParams(num_sequences=0)), sink)
    with pytest.raises(InvalidRequestError):
        engine.submit(EngineRequest("a", ()), sink)
    with pytest.raises(InvalidRequestError):  # longer than the KV cache
        engine.submit(EngineRequest("a", tuple(range(2000))), sink)
    engine.submit(EngineRequest("dup", (1, 2, 3), SamplingParams(max_tokens=1000)), sink)
    with pytest.raises(DuplicateRequestError):
        engine.submit(EngineRequest("dup", (1, 2, 3)), sink)
    assert await asyncio.wrap_future(engine.abort("dup"))
    outputs = await collect(queue)
    assert outputs[-1].finish_reason is FinishReason.CANCELLED
    engine.stop(timeout_s=10)
    with pytest.raises(EngineStoppedError):
        engine.submit(EngineRequest("late", (1, 2, 3)), sink)


class _Refused(Exception):
    pass


def _refuse() -> None:
    raise _Refused


@pytest.mark.timeout(30)
async def test_a_request_counts_as_queued_from_its_submit_until_it_runs() -> None:
    """`num_queued` (what admission control bounds) counts a request the engine thread has
    not added yet, then the scheduler's waiting ones, and not one `admit` refused."""
    runner = SimRunner(block_size=4, num_blocks=256, time_scale=0.0)
    engine = EngineLoop(EngineCore(runner, SchedulerConfig(max_num_seqs=1)))
    engine.start()
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue(), asyncio.Queue()]
    async with engine_thread_held(engine):
        engine.submit(
            EngineRequest("a", (1, 2, 3), SamplingParams(max_tokens=3)),
            asyncio_sink(loop, queues[0]),
        )
        engine.submit(
            EngineRequest("b", (4, 5, 6), SamplingParams(max_tokens=3)),
            asyncio_sink(loop, queues[1]),
        )
        assert engine.num_queued() == 2  # submitted while the engine thread is busy
        with pytest.raises(_Refused):
            engine.submit(
                EngineRequest("c", (7,)), asyncio_sink(loop, asyncio.Queue()), admit=_refuse
            )
        assert engine.num_queued() == 2 and engine.num_live_requests() == 2
    await asyncio.gather(*(collect(q) for q in queues))
    assert engine.num_queued() == 0
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_an_abandoned_requests_id_is_free_at_once_and_its_end_reaches_no_one() -> None:
    """`abandon` frees the id before the engine thread runs the abort: two requests abandoned
    in turn under one id, then a third submitted with it, all while the engine thread is busy.
    The third runs to its end and its sink gets its outputs alone: the abandoned ones' ends
    (CANCELLED, published first) reach no sink. Then the core holds nothing."""
    engine = make_loop()
    engine.start()
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue() for _ in range(3)]
    async with engine_thread_held(engine):
        for i, queue in enumerate(queues):
            sampling = SamplingParams(max_tokens=3, num_sequences=2)
            engine.submit(
                EngineRequest("same", (1, 2, 3, 4, 5), sampling), asyncio_sink(loop, queue)
            )
            if i < 2:
                engine.abandon("same")
        with pytest.raises(DuplicateRequestError):  # the third holds the id
            engine.submit(EngineRequest("same", (1,)), asyncio_sink(loop, asyncio.Queue()))
    outputs = await collect(queues[2])
    finished = [o for o in outputs if o.finished]
    assert [o.finish_reason for o in finished] == [FinishReason.LENGTH] * 2
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 6
    assert queues[0].empty() and queues[1].empty()
    assert engine.load().num_running == 0 and engine.num_live_requests() == 0
    engine.stop(timeout_s=10)


def leaving_and_retried(
    engine: EngineLoop, prompt: tuple[int, ...], retried: OutputSink
) -> OutputSink:
    """The sink of a request "same" whose client goes away as it gets its first output
    (`abandon`) and retries under its id (`prompt`, 3 tokens, outputs to `retried`), the
    hand-over failing meanwhile (its consumer's event loop closing)."""

    def leaving(output: RequestOutput) -> None:
        engine.abandon("same")
        engine.submit(EngineRequest("same", prompt, SamplingParams(max_tokens=3)), retried)
        raise RuntimeError("Event loop is closed")

    return leaving


@pytest.mark.timeout(30)
async def test_a_request_abandoned_as_its_sink_fails_leaves_the_next_one_of_its_id_alone() -> None:
    """The client of a request goes away (`abandon`) and a retry takes its id while the engine
    thread hands the request an output, and that hand-over fails (its consumer's event loop
    closing): the retry still gets every output of its own, to its end, and a request after it
    with the id too. The failed hand-over used to drop the retry's sink (taken for the failing
    one's) and end the abandoned request out of `abandon`'s count, so that every output of
    the retry was dropped as the abandoned one's."""
    engine = make_loop()
    engine.start()
    loop = asyncio.get_running_loop()
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)
    engine.submit(
        EngineRequest("same", (1, 2, 3, 4, 5), long),
        leaving_and_retried(engine, (1, 2, 3), asyncio_sink(loop, retried)),
    )
    outputs = await collect(retried)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 3
    after: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=2)), asyncio_sink(loop, after)
    )
    assert (await collect(after))[-1].finish_reason is FinishReason.LENGTH
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_retry_gets_no_output_of_the_failed_request_it_replaced() -> None:
    """As `test_a_request_abandoned_as_its_sink_fails_leaves_the_next_one_of_its_id_alone`,
    with two sequences: their outputs of one pass are handed over one after the other, the
    first's fails (the client gone: abandoned, its retry submitted meanwhile). The retry gets
    its own tokens alone (the sim's are a function of the prompt): the abandoned request's
    second output, left in the same pass, used to reach it (the abort of the failing request
    had ended the abandon's wait for its end before that output was handed over)."""
    runner = SimRunner(block_size=4, num_blocks=64, time_scale=0)
    engine = EngineLoop(EngineCore(runner))
    engine.start()
    loop = asyncio.get_running_loop()
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    long = SamplingParams(max_tokens=100, num_sequences=2, ignore_eos=True)
    engine.submit(
        EngineRequest("same", (1, 2, 3, 4, 5), long),
        leaving_and_retried(engine, (7, 8, 9), asyncio_sink(loop, retried)),
    )
    outputs = await collect(retried)
    assert [(o.output_index, t) for o in outputs for t in o.new_token_ids] == [
        (0, t) for t in runner.next_tokens(9, 0, 0, 3)
    ]
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 3
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")
    engine.stop(timeout_s=10)


class AbortFailsOnce(EngineCore):
    """A core whose abort of a request fails once after it ended the request (as one whose
    freeing of the request's resources raises): the request is gone, its end never emitted."""

    failed = False

    def abort(self, request_id: str, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        outputs = super().abort(request_id, *args, **kwargs)
        if not self.failed:
            self.failed = True
            raise RuntimeError("freeing the request's resources failed")
        return outputs


async def a_request_of_the_id_runs_to_its_end(engine: EngineLoop) -> None:
    """A request submitted now under the id "same" gets its outputs to its end (LENGTH), and
    the engine goes idle after it."""
    after: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("same", (4, 5), SamplingParams(max_tokens=2)),
        asyncio_sink(asyncio.get_running_loop(), after),
    )
    assert (await collect(after))[-1].finish_reason is FinishReason.LENGTH
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")


def engine_with_abort_failing_once() -> tuple[EngineLoop, AbortFailsOnce]:
    """A started engine whose core's abort fails once."""
    core = AbortFailsOnce(SimRunner(block_size=4, num_blocks=256, time_scale=0))
    engine = EngineLoop(core)
    engine.start()
    return engine, core


@pytest.mark.timeout(30)
async def test_a_request_of_an_id_whose_abandoned_request_never_ended_completes() -> None:
    """A request is abandoned (its client gone), and the core's abort of it fails after it
    ended the request, so its end never comes. A retry under its id still gets every
    output of its own, to its end, and so does a request after it. Every later request of
    the id used to have all its outputs dropped as the abandoned one's, whose end never
    came: its client waited for ever."""
    engine, core = engine_with_abort_failing_once()
    loop = asyncio.get_running_loop()
    first: asyncio.Queue[RequestOutput] = asyncio.Queue()
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    # Held: the request is in the core (added) when its abort runs, whatever the pace.
    async with engine_thread_held(engine):
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=100_000)),
            asyncio_sink(loop, first),
        )
        engine.abandon("same")
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=3)),
            asyncio_sink(loop, retried),
        )
    outputs = await collect(retried)
    assert core.failed
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 3
    await a_request_of_the_id_runs_to_its_end(engine)
    engine.stop(timeout_s=10)


async def aborted_in_the_core(engine: EngineLoop, max_tokens: int) -> list[RequestOutput]:
    """The outputs of a request "same" aborted once the core has it (the engine thread held
    as it is submitted and aborted, whatever the pace), whose abort says it was running."""
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    async with engine_thread_held(engine):
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=max_tokens)),
            asyncio_sink(asyncio.get_running_loop(), queue),
        )
        aborted = engine.abort("same")
    assert await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    return await collect(queue)


@pytest.mark.timeout(30)
async def test_a_request_whose_abort_fails_ends_and_its_abort_is_answered() -> None:
    """A request is aborted (its client's Abort), and the core's abort of it fails after it
    ended the request, so its end never comes. The abort is answered all the same, the
    request's stream ends (ERROR), and a request after it under its id runs to its end. The
    abort's future was never resolved (the Abort call waited for ever), and the request's
    stream never ended."""
    engine, core = engine_with_abort_failing_once()
    outputs = await aborted_in_the_core(engine, max_tokens=100_000)
    assert core.failed
    assert outputs[-1].finish_reason is FinishReason.ERROR
    await a_request_of_the_id_runs_to_its_end(engine)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sent", [True, False])
async def test_an_end_made_up_for_a_request_carries_what_its_client_was_sent(sent: bool) -> None:
    """A request of two outputs: the first stops early on a stop token (sent to the client,
    or left out of its tokens), the second streams on; the request is aborted, and the core's
    abort of it fails after it ended the request, its end never emitted. The end made up for
    it (ERROR) ends the second output alone and counts every token its client got, and the
    stop token left out, as the core's own end counts it (`completion_tokens`). It used to
    end both outputs again, the first a second time, and count no token at all; then to
    count a stop token left out as no token, one below the core's count."""
    engine, core = engine_with_abort_failing_once()
    runner = core.runner
    assert isinstance(runner, SimRunner)
    stop = runner.next_tokens(3, 0, 0, 3)[-1]  # the first output's third token
    assert stop not in runner.next_tokens(3, 0, 1, 10_000)
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    sampling = SamplingParams(
        max_tokens=10_000, num_sequences=2, stop_token_ids=(stop,), include_stop_in_output=sent
    )
    to_queue = asyncio_sink(asyncio.get_running_loop(), queue)
    aborted: list[Future[bool]] = []

    def aborting(output: RequestOutput) -> None:
        to_queue(output)
        if output.output_index == 0 and output.finished:  # on the engine thread: the second
            aborted.append(engine.abort("same"))  # output is far from its end as it runs
        # (aborted from the event loop, the request could end first: the sim has no pace)

    engine.submit(EngineRequest("same", (1, 2, 3), sampling), aborting)
    outputs = await collect(queue)
    assert len(aborted) == 1
    assert await asyncio.wait_for(asyncio.wrap_future(aborted[0]), timeout=10)
    assert core.failed
    assert [(o.output_index, o.finish_reason) for o in outputs if o.finished] == [
        (0, FinishReason.STOP),
        (1, FinishReason.ERROR),
    ]
    usage = outputs[-1].usage
    assert usage is not None and usage.prompt_tokens == 3
    withheld = 0 if sent else 1
    assert usage.completion_tokens == sum(len(o.new_token_ids) for o in outputs) + withheld > 3
    engine.stop(timeout_s=10)


class AbortFailsKeeping(EngineCore):
    """A core whose abort of a request fails once (per `armed.release()`, once at first)
    before it did anything (as one whose abort raises at once): the request runs on."""

    abort_failures = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.abort_armed = threading.Semaphore(1)

    def abort(self, request_id: str, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        if self.abort_armed.acquire(blocking=False):
            self.abort_failures += 1
            raise RuntimeError("aborting the request failed")
        return super().abort(request_id, *args, **kwargs)


class AbortFailsPartway(EngineCore):
    """A core whose abort of a request fails once (per `partway_armed.release()`, none at
    first) partway: as it frees the blocks of the request's first output, which it marked
    finished already (as a block free that raises)."""

    partway_failures = 0
    _aborting = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.partway_armed = threading.Semaphore(0)
        free = self.block_manager.free

        def failing_free(seq_id: int) -> None:
            if self._aborting and self.partway_armed.acquire(blocking=False):
                self.partway_failures += 1
                raise RuntimeError("freeing the request's blocks failed")
            free(seq_id)

        self.block_manager.free = failing_free  # type: ignore[method-assign]

    def abort(self, request_id: str, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        self._aborting = True
        try:
            return super().abort(request_id, *args, **kwargs)
        finally:
            self._aborting = False


def engine_with_an_abort_failing_at_once() -> tuple[EngineLoop, AbortFailsKeeping, SimRunner]:
    """A started engine whose core's first abort of a request fails before it did anything
    (the request runs on), and its runner."""
    runner = SimRunner(block_size=4, num_blocks=256, time_scale=0)
    core = AbortFailsKeeping(runner)
    engine = EngineLoop(core)
    engine.start()
    return engine, core, runner


def submit_or_refused(engine: EngineLoop, request: EngineRequest, sink: OutputSink) -> bool:
    """Whether `engine` accepted `request` (False: its id is taken)."""
    try:
        engine.submit(request, sink)
    except DuplicateRequestError:
        return False
    return True


async def own_outputs_once_its_id_is_free(engine: EngineLoop, runner: SimRunner) -> None:
    """A request under the id "same", submitted until it is accepted (refused while its id
    is taken), gets its own tokens and its end (LENGTH), and nothing else."""
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    request = EngineRequest("same", (4, 5), SamplingParams(max_tokens=2))
    sink = asyncio_sink(asyncio.get_running_loop(), queue)
    await eventually(lambda: submit_or_refused(engine, request, sink), what="the id free")
    outputs = await collect(queue)
    assert [t for o in outputs for t in o.new_token_ids] == runner.next_tokens(5, 0, 0, 2)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]


@pytest.mark.timeout(60)
async def test_a_request_whose_abort_fails_as_it_runs_on_keeps_its_id_till_it_ends() -> None:
    """A request is aborted and the core's abort of it fails before it did anything: the
    request runs on in the core. Its client gets its end (ERROR), and its id is refused
    (a duplicate) until the core ends the request; then a request of the id gets its own
    outputs. The id was free at once, and the request that took it got the tokens of the one
    still running, then an ERROR end (the core refused it as a duplicate)."""
    engine, core, runner = engine_with_an_abort_failing_at_once()
    outputs = await aborted_in_the_core(engine, max_tokens=3000)
    assert core.abort_failures == 1
    assert outputs[-1].finish_reason is FinishReason.ERROR
    running = await asyncio.wrap_future(engine.call(lambda core: core.holds("same")))
    assert running  # (3000 tokens: it runs on long after its abort)
    with pytest.raises(DuplicateRequestError, match="still runs in the engine"):
        engine.submit(EngineRequest("same", (4, 5), SamplingParams(max_tokens=2)), lambda _o: None)
    await own_outputs_once_its_id_is_free(engine, runner)
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_sequences", [1, 2])
async def test_a_request_whose_abort_fails_partway_leaves_the_core(num_sequences: int) -> None:
    """A request is aborted, and the core's abort of it fails partway, as it frees the
    blocks of an output it marked finished. Its client gets its end (ERROR); the core holds
    neither the request nor its blocks, and a request of its id is accepted at once and gets
    its own outputs to its end. The core kept the request with nothing left to finish (one
    output) or ran its other output on, its blocks held: its id was refused as still running
    in the engine, for ever with one output."""
    runner = SimRunner(block_size=4, num_blocks=256, time_scale=0)
    core = AbortFailsPartway(runner)
    core.partway_armed.release()
    engine = EngineLoop(core)
    engine.start()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    to_queue = asyncio_sink(asyncio.get_running_loop(), queue)
    commands: list[Future[Any]] = []

    def aborting(output: RequestOutput) -> None:
        to_queue(output)
        if not commands:  # on the engine thread, its blocks held: aborted before its next step
            commands.append(engine.abort("same"))
            commands.append(
                engine.call(lambda core: (core.holds("same"), core.load().num_used_blocks))
            )

    sampling = SamplingParams(max_tokens=3000, num_sequences=num_sequences)
    engine.submit(EngineRequest("same", (1, 2, 3, 4, 5, 6), sampling), aborting)
    outputs = await collect(queue)
    aborted, left = commands
    assert await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    assert core.partway_failures == 1
    assert sorted(o.output_index for o in outputs if o.finished) == list(range(num_sequences))
    assert {o.finish_reason for o in outputs if o.finished} == {FinishReason.ERROR}
    assert await asyncio.wait_for(asyncio.wrap_future(left), timeout=10) == (False, 0)
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    request = EngineRequest("same", (4, 5), SamplingParams(max_tokens=2))
    engine.submit(request, asyncio_sink(asyncio.get_running_loop(), retried))
    outputs = await collect(retried)
    assert [t for o in outputs for t in o.new_token_ids] == runner.next_tokens(5, 0, 0, 2)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_an_abort_of_all_names_only_the_requests_clients_wait_on() -> None:
    """A request's abort fails in the core, which runs it on (no client's now); an abort of
    all then comes, with another request running. The core ends both, but the abort of all
    names the other alone: the one the core ran on was no client's any more (its client had
    its ERROR end), and its id is free again once the core ended it. It used to be named,
    an aborted request no client waited on (AbortAll's "aborted 2 requests")."""
    engine, core, runner = engine_with_an_abort_failing_at_once()
    loop = asyncio.get_running_loop()
    same: asyncio.Queue[RequestOutput] = asyncio.Queue()
    other: asyncio.Queue[RequestOutput] = asyncio.Queue()
    sampling = SamplingParams(max_tokens=3000)
    async with engine_thread_held(engine):  # one round: both in the core as the aborts run
        engine.submit(EngineRequest("same", (1, 2, 3), sampling), asyncio_sink(loop, same))
        aborted = engine.abort("same")
        engine.submit(EngineRequest("other", (1, 2, 3), sampling), asyncio_sink(loop, other))
        aborted_all = engine.abort_all()
    assert await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    assert core.abort_failures == 1
    assert await asyncio.wait_for(asyncio.wrap_future(aborted_all), timeout=10) == ["other"]
    assert (await collect(same))[-1].finish_reason is FinishReason.ERROR
    assert (await collect(other))[-1].finish_reason is FinishReason.CANCELLED
    await own_outputs_once_its_id_is_free(engine, runner)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_request_submitted_after_an_abort_that_fails_is_left_alone() -> None:
    """An abort of an id comes before any request of it, and the core's abort fails; a
    request of the id is submitted before that abort runs (its add after it). The abort, of
    nothing, says so (not running); the request, not in the core as the abort ran, runs to
    its own end. It used to get an ERROR end made up as though the core had forgotten it,
    the core then ran it with no sink, and a request taking its id got its tokens."""
    engine, core, runner = engine_with_an_abort_failing_at_once()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    async with engine_thread_held(engine):
        aborted = engine.abort("same")
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=3)),
            asyncio_sink(asyncio.get_running_loop(), queue),
        )
    assert not await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    assert core.abort_failures == 1
    outputs = await collect(queue)
    assert [t for o in outputs for t in o.new_token_ids] == runner.next_tokens(3, 0, 0, 3)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]
    await own_outputs_once_its_id_is_free(engine, runner)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(60)
async def test_a_retry_of_an_abandoned_request_that_runs_on_gets_none_of_its_outputs() -> None:
    """A request is abandoned (its client gone) and retried under its id at once; the core's
    abort of it fails before it did anything: it runs on in the core. The retry, queued
    already, ends ERROR (its id taken), with no output of the old request; a request of the
    id is refused until the core ends the old one, then gets its own outputs. A request
    that took the id as the old one ran on used to get its tokens."""
    engine, core, runner = engine_with_an_abort_failing_at_once()
    loop = asyncio.get_running_loop()
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    async with engine_thread_held(engine):
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=3000)), lambda _o: None
        )
        engine.abandon("same")
        engine.submit(
            EngineRequest("same", (4, 5), SamplingParams(max_tokens=2)),
            asyncio_sink(loop, retried),
        )
    outputs = await collect(retried)
    assert core.abort_failures == 1
    assert [o.new_token_ids for o in outputs] == [()]
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert "still runs in the engine" in outputs[-1].message
    await own_outputs_once_its_id_is_free(engine, runner)
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")
    engine.stop(timeout_s=10)


class AllFails(Enum):
    """How an armed abort of every request fails (`AbortAllFails`)."""

    AT_ONCE = "before it did anything: every request runs on"
    # As it takes its last sequence, marked finished, out of the scheduler (its blocks not freed
    # yet; at once if it runs none): the requests before that one's ended, their ends handed
    # over (`EngineCore.take_failed_outputs`), and that one forgotten, its end never emitted.
    PARTWAY = "partway, as it ends its last sequence"
    # As one whose freeing of their resources raises: those are gone, their ends never emitted.
    FORGETTING = "after it ended every request, their ends lost"


class AbortAllFails(EngineCore):
    """A core whose abort of every request fails as armed (none at first), each failure as
    its own `AllFails` says. Its abort that cancels them all (AbortAll, stop) fails once per
    `armed.append(fails)`; its abort that ends them all ERROR (a failed step's, or the engine
    thread's as it ends) once per `error_armed.append(fails)`: each failure in turn."""

    failures = 0
    error_failures = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Appended by any thread, taken by the engine thread alone (a deque's ends are
        # thread-safe).
        self.armed: deque[AllFails] = deque()
        self.error_armed: deque[AllFails] = deque()

    def abort_all(
        self, reason: FinishReason = FinishReason.CANCELLED, message: str = "aborted"
    ) -> list[RequestOutput]:
        cancels = reason is FinishReason.CANCELLED
        armed = self.armed if cancels else self.error_armed
        if not armed:
            return super().abort_all(reason, message)
        fails = armed.popleft()
        if cancels:
            self.failures += 1
        else:
            self.error_failures += 1
        scheduler = self.scheduler
        if fails is AllFails.PARTWAY and scheduler.has_work():
            remove = scheduler.remove
            left = scheduler.num_running + scheduler.num_waiting

            def failing_remove(sequence: Sequence) -> None:
                nonlocal left
                left -= 1
                if not left:
                    raise RuntimeError("freeing the output's blocks failed")
                remove(sequence)

            scheduler.remove = failing_remove  # type: ignore[method-assign]
            try:
                return super().abort_all(reason, message)  # (raises at the last sequence)
            finally:
                scheduler.remove = remove  # type: ignore[method-assign]
        if fails is AllFails.FORGETTING:
            super().abort_all(reason, message)
        raise RuntimeError("freeing the requests' resources failed")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("fails", "finish"),
    [(AllFails.AT_ONCE, FinishReason.CANCELLED), (AllFails.FORGETTING, FinishReason.ERROR)],
)
async def test_an_abort_of_all_that_fails_in_the_core_ends_every_request_and_is_answered(
    fails: AllFails, finish: FinishReason
) -> None:
    """Every request is aborted (the AbortAll RPC) and the core's abort of them all fails.
    The abort is answered (AbortFailedError), every request's stream ends, each aborted on its
    own (CANCELLED), or ERROR where the core had ended it without emitting its end, the engine
    goes idle, and a request under a used id runs to its end. The abort's future was never
    resolved (the RPC waited for ever), and the requests ran on."""
    core = AbortAllFails(SimRunner(block_size=4, num_blocks=256, time_scale=0))
    core.armed.append(fails)
    engine = EngineLoop(core)
    engine.start()
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue(), asyncio.Queue()]
    # Held: the requests are in the core (added) when the abort runs, whatever the pace.
    async with engine_thread_held(engine):
        for request_id, queue in zip(["same", "other"], queues, strict=True):
            engine.submit(
                EngineRequest(
                    request_id, (1, 2, 3), SamplingParams(max_tokens=100_000, num_sequences=2)
                ),
                asyncio_sink(loop, queue),
            )
        aborted = engine.abort_all()
    errors = 2 if fails is AllFails.FORGETTING else 0
    with pytest.raises(AbortFailedError, match=f"each was aborted on its own: {errors} of 2 "):
        await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    assert core.failures == 1
    for queue in queues:
        outputs = await collect(queue)
        assert sorted(o.output_index for o in outputs if o.finished) == [0, 1]
        assert {o.finish_reason for o in outputs if o.finished} == {finish}
    await a_request_of_the_id_runs_to_its_end(engine)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_request_an_abort_of_all_ended_before_it_failed_gets_its_end() -> None:
    """Every request is aborted, and the core's abort of them all fails partway at the second
    request, having ended the first. The first's client gets its end (CANCELLED), the
    second's an ERROR one, the abort's error counts the second alone, and the core holds
    neither nor their blocks. The first's end was lost with the failed abort: its client got
    an ERROR end made up for it, counted in the error."""
    core = AbortAllFails(SimRunner(block_size=4, num_blocks=256, time_scale=0))
    core.armed.append(AllFails.PARTWAY)
    engine = EngineLoop(core)
    engine.start()
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue(), asyncio.Queue()]
    async with engine_thread_held(engine):  # both added, in turn, before the abort runs
        for request_id, queue in zip(["first", "second"], queues, strict=True):
            sampling = SamplingParams(max_tokens=100_000)
            engine.submit(EngineRequest(request_id, (1, 2, 3), sampling), asyncio_sink(loop, queue))
        aborted = engine.abort_all()
        left = engine.call(
            lambda core: (core.holds("first"), core.holds("second"), core.load().num_used_blocks)
        )
    with pytest.raises(AbortFailedError, match="each was aborted on its own: 1 of 2 "):
        await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    assert core.failures == 1
    ends = [(await collect(queue))[-1].finish_reason for queue in queues]
    assert ends == [FinishReason.CANCELLED, FinishReason.ERROR]
    assert await asyncio.wait_for(asyncio.wrap_future(left), timeout=10) == (False, False, 0)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_retry_taken_as_its_aborted_request_ends_gets_no_end_made_up_for_it() -> None:
    """A request is aborted, and an abort of all comes in the same round of the engine thread,
    where the core's abort of them all fails: aborted on its own, the request, ended already
    (its end not handed over yet), is no longer in the core, so it ends ERROR once more. Its
    client retries under its id as it gets its (CANCELLED) end. The retry gets its own
    outputs to its end; it used to get that second, stale end (ERROR) instead."""
    core = AbortAllFails(SimRunner(block_size=4, num_blocks=256, time_scale=0))
    core.armed.append(AllFails.AT_ONCE)
    engine = EngineLoop(core)
    engine.start()
    loop = asyncio.get_running_loop()
    first: asyncio.Queue[RequestOutput] = asyncio.Queue()
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    to_first = asyncio_sink(loop, first)

    def retrying(output: RequestOutput) -> None:
        to_first(output)
        if output.usage is not None:  # on the engine thread, as its end is handed over
            engine.submit(
                EngineRequest("same", (4, 5), SamplingParams(max_tokens=2)),
                asyncio_sink(loop, retried),
            )

    async with engine_thread_held(engine):  # the abort and the abort of all: one round
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=100_000)), retrying
        )
        aborted = engine.abort("same")
        aborted_all = engine.abort_all()
    assert await asyncio.wait_for(asyncio.wrap_future(aborted), timeout=10)
    with pytest.raises(AbortFailedError):
        await asyncio.wait_for(asyncio.wrap_future(aborted_all), timeout=10)
    assert (await collect(first))[-1].finish_reason is FinishReason.CANCELLED
    outputs = await collect(retried)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 2
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_stop_whose_abort_of_all_fails_in_the_core_cancels_each_request() -> None:
    """The engine stops as two requests stream, and the core's abort of them all fails before
    it did anything: each is aborted on its own, as an abort of all does then, and ends
    CANCELLED (both its outputs), and the core holds none of them. The engine thread failed
    instead ("the engine thread failed"): each request ended ERROR, "the engine stopped"."""
    core = AbortAllFails(SimRunner(block_size=4, num_blocks=256, time_scale=0.05))
    core.armed.append(AllFails.AT_ONCE)
    engine = EngineLoop(core)
    engine.start()
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue(), asyncio.Queue()]
    for request_id, queue in zip(["a", "b"], queues, strict=True):
        sampling = SamplingParams(max_tokens=100_000, num_sequences=2, ignore_eos=True)
        engine.submit(EngineRequest(request_id, (5, 6, 7), sampling), asyncio_sink(loop, queue))
    for queue in queues:  # streaming has started: both are in the core
        assert (await asyncio.wait_for(queue.get(), timeout=10)).new_token_ids
    await asyncio.to_thread(engine.stop, 10)
    assert core.failures == 1
    for queue in queues:
        outputs = await collect(queue)
        assert sorted(o.output_index for o in outputs if o.finished) == [0, 1]
        assert {o.finish_reason for o in outputs if o.finished} == {FinishReason.CANCELLED}
    assert not core.holds("a") and not core.holds("b")


class AbortAndAbortAllFail(AbortAllFails, AbortFailsKeeping):
    """A core whose first abort of a request fails before it did anything (the request runs
    on), and whose abort of every request fails as armed."""


@pytest.mark.timeout(60)
async def test_a_failed_abort_of_all_ends_a_request_the_core_ran_on_after_its_abort() -> None:
    """A request's abort fails in the core, which runs it on (its client had its ERROR end:
    no client's now); an abort of all then comes, with another request running, and the
    core's abort of them all fails before it did anything. Each is aborted on its own, the
    one run on too: right after, the core holds neither. The abort's error counts the other
    alone, and a request of the first one's id runs to its end. The one run on used to be
    left running after the abort of all, holding its blocks (and a LoRA slot) for as long as
    it ran."""
    runner = SimRunner(block_size=4, num_blocks=256, time_scale=0)
    core = AbortAndAbortAllFail(runner)
    core.armed.append(AllFails.AT_ONCE)
    engine = EngineLoop(core)
    engine.start()
    outputs = await aborted_in_the_core(engine, max_tokens=100_000)
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert core.abort_failures == 1
    other: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("other", (1, 2, 3), SamplingParams(max_tokens=100_000)),
        asyncio_sink(asyncio.get_running_loop(), other),
    )
    async with engine_thread_held(engine):  # one round: nothing runs between them
        aborted_all = engine.abort_all()
        left = engine.call(lambda core: (core.holds("same"), core.holds("other")))
    with pytest.raises(AbortFailedError, match="each was aborted on its own: 0 of 1 "):
        await asyncio.wait_for(asyncio.wrap_future(aborted_all), timeout=10)
    assert core.failures == 1
    assert await asyncio.wait_for(asyncio.wrap_future(left), timeout=10) == (False, False)
    assert (await collect(other))[-1].finish_reason is FinishReason.CANCELLED
    await own_outputs_once_its_id_is_free(engine, runner)
    await eventually(lambda: engine.load().num_running == 0, what="the engine idle")
    engine.stop(timeout_s=10)


class AdapterFreeingFailsOnce(SimRunner):
    """A runner whose freeing of an adapter's weights fails once (a device error, say)."""

    failed = False

    def remove_lora(self, key: str) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("freeing the adapter's weights failed")
        super().remove_lora(key)


@pytest.mark.timeout(30)
async def test_the_last_request_of_an_unloaded_adapter_ends_though_freeing_it_fails() -> None:
    """A request of an adapter unloaded while it runs ends, and its end frees the adapter's
    weights, which fails: the request still gets its end, and a request after it under its
    id runs. The core forgot the request, then raised before emitting its end (the step
    failed): its client waited for ever, and its id stayed taken (DuplicateRequestError)."""
    runner = AdapterFreeingFailsOnce(block_size=4, num_blocks=256, time_scale=0)
    engine = EngineLoop(EngineCore(runner, max_loras=2))
    engine.start()
    weights = AdapterConfig(
        rank=4, alpha=8.0, target_modules=TargetModules(names=frozenset({"q_proj"}))
    )
    await asyncio.wrap_future(
        engine.call(lambda core: core.load_lora(LoraAdapter(1, "ad", "/ad"), weights))
    )
    loop = asyncio.get_running_loop()
    first: asyncio.Queue[RequestOutput] = asyncio.Queue()
    async with engine_thread_held(engine):  # unloaded before it runs a step
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=3), lora_name="ad"),
            asyncio_sink(loop, first),
        )
        unloaded = engine.call(lambda core: core.unload_lora("ad"))
    await asyncio.wrap_future(unloaded)
    outputs = await collect(first)
    assert runner.failed
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 3
    await a_request_of_the_id_runs_to_its_end(engine)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(60)
async def test_a_retry_refused_as_its_id_runs_on_ends_though_freeing_its_adapter_fails() -> None:
    """A request is abandoned and retried under its id at once, the retry with an adapter it
    holds (acquired at acceptance) and that is unloaded before the retry is taken in; the
    core's abort of the old request fails before it did anything: it runs on. The retry,
    refused (its id taken), frees the adapter's weights, which fails: it still ends ERROR,
    and its id takes a request once the old one ends. Its client waited for ever (the
    command taking it in failed, no end made), and its id stayed taken for good."""
    runner = AdapterFreeingFailsOnce(block_size=4, num_blocks=256, time_scale=0)
    core = AbortFailsKeeping(runner, max_loras=2)
    engine = EngineLoop(core)
    engine.start()
    weights = AdapterConfig(
        rank=4, alpha=8.0, target_modules=TargetModules(names=frozenset({"q_proj"}))
    )
    await asyncio.wrap_future(
        engine.call(lambda core: core.load_lora(LoraAdapter(1, "ad", "/ad"), weights))
    )
    retry = EngineRequest("same", (4, 5), SamplingParams(max_tokens=2), lora_name="ad")
    slot = core.acquire_lora(retry)  # (as a server's `end_pull` holds one for its request)
    retried: asyncio.Queue[RequestOutput] = asyncio.Queue()
    async with engine_thread_held(engine):
        engine.submit(
            EngineRequest("same", (1, 2, 3), SamplingParams(max_tokens=3000)), lambda _o: None
        )
        engine.abandon("same")
        unloaded = engine.call(lambda core: core.unload_lora("ad"))  # its slot held: kept
        engine.submit(retry, asyncio_sink(asyncio.get_running_loop(), retried), lora=slot)
    await asyncio.wrap_future(unloaded)
    outputs = await collect(retried)
    assert core.abort_failures == 1 and runner.failed
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert "still runs in the engine" in outputs[-1].message
    await own_outputs_once_its_id_is_free(engine, runner)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_call_cancelled_while_queued_never_runs() -> None:
    """`call` is an executor's: cancelled before the engine thread begins it, `fn` never runs
    (the call after it does); begun, it cannot be cancelled and runs to its end."""
    engine = make_loop()
    engine.start()
    in_command, go_on = threading.Event(), threading.Event()
    ran: list[str] = []

    def long_command(_core: EngineCore) -> str:
        in_command.set()
        go_on.wait(10)
        ran.append("held")
        return "held"

    held = engine.call(long_command)
    assert await asyncio.to_thread(in_command.wait, 10)
    dropped = engine.call(lambda _core: ran.append("dropped"))
    after = engine.call(lambda _core: ran.append("after"))
    assert dropped.cancel()
    assert not held.cancel()  # running
    go_on.set()
    assert await asyncio.wrap_future(held) == "held"
    await asyncio.wrap_future(after)
    assert ran == ["held", "after"]
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_abort_mid_stream_and_stop_cancel_everything() -> None:
    engine = make_loop(time_scale=0.05)  # real (scaled) step time: requests stay live
    engine.start()
    loop = asyncio.get_running_loop()
    first: asyncio.Queue[RequestOutput] = asyncio.Queue()
    second: asyncio.Queue[RequestOutput] = asyncio.Queue()
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)
    engine.submit(EngineRequest("a", (5, 6, 7), long), asyncio_sink(loop, first))
    engine.submit(EngineRequest("b", (8, 9, 10), long), asyncio_sink(loop, second))
    head = await asyncio.wait_for(first.get(), timeout=10)  # streaming has started
    assert head.new_token_ids and head.finish_reason is None
    assert await asyncio.wrap_future(engine.abort("a"))
    rest = await collect(first)
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert not await asyncio.wrap_future(engine.abort("a"))  # already finished
    # The engine thread is free to run other work between steps.
    name = await asyncio.wrap_future(engine.call(lambda core: threading.current_thread().name))
    assert name == "engine-step"
    await asyncio.to_thread(engine.stop, 10)
    tail = await collect(second)
    assert tail[-1].finish_reason is FinishReason.CANCELLED
    assert engine.num_live_requests() == 0
    with pytest.raises(EngineStoppedError):
        await asyncio.wrap_future(engine.call(lambda core: core.load()))


class FlakyRunner(SimRunner):
    """A sim runner whose next forward pass fails once when armed."""

    armed = False

    def execute(self, batch: ScheduledBatch) -> list[SequenceResult]:
        if self.armed:
            self.armed = False
            raise RuntimeError("device lost")
        return super().execute(batch)


@pytest.mark.timeout(30)
async def test_a_failing_step_errors_its_requests_and_the_engine_carries_on() -> None:
    runner = FlakyRunner(block_size=4, num_blocks=64, time_scale=0)
    core = EngineCore(runner)

    def broken_observer(report: StepReport) -> None:
        raise ValueError("observer bug")

    engine = EngineLoop(core, on_step=broken_observer)
    engine.start()
    loop = asyncio.get_running_loop()
    runner.armed = True
    failed: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("a", (5, 6, 7), SamplingParams(max_tokens=4, num_sequences=2)),
        asyncio_sink(loop, failed),
    )
    outputs = await collect(failed)
    assert {o.finish_reason for o in outputs if o.finished} == {FinishReason.ERROR}
    assert sorted(o.output_index for o in outputs if o.finished) == [0, 1]
    used = await asyncio.wrap_future(engine.call(lambda c: c.load().num_used_blocks))
    assert used == 0
    ok: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("b", (5, 6, 7), SamplingParams(max_tokens=4)), asyncio_sink(loop, ok)
    )
    outputs = await collect(ok)
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    engine.stop(timeout_s=10)


class ForgetfulRunner(SimRunner):
    """A sim runner whose next forward pass that computes the request `forget` returns no
    result for it (a runner bug, which fails the step: `EngineCore.step`)."""

    forget: str | None = None

    def execute(self, batch: ScheduledBatch) -> list[SequenceResult]:
        results = super().execute(batch)
        forgotten = {s.seq_id for s in batch.sequences if s.request_id == self.forget}
        if forgotten:
            self.forget = None
        return [r for r in results if r.seq_id not in forgotten]


class EndFailsInAStep(EngineCore):
    """A core whose end of an output in a step (STOP, LENGTH, "KV cache full") fails once per
    `end_armed.release()` (none at first) partway: as it takes the output it marked finished
    out of the scheduler, its blocks not freed yet."""

    end_failures = 0
    _stepping = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.end_armed = threading.Semaphore(0)
        remove = self.scheduler.remove

        def failing_remove(sequence: Sequence) -> None:
            if self._stepping and self.end_armed.acquire(blocking=False):
                self.end_failures += 1
                raise RuntimeError("freeing the output's blocks failed")
            remove(sequence)

        self.scheduler.remove = failing_remove  # type: ignore[method-assign]

    def step(self, on_pass_start: Callable[[], object] | None = None) -> StepResult:
        self._stepping = True
        try:
            return super().step(on_pass_start)
        finally:
            self._stepping = False


class BatchFailsInAStep(EngineCore):
    """A core whose step fails once per `batch_armed.release()` (none at first) as it builds
    the pass's batch, scheduled and not started yet (no `on_pass_start`): as it next reads a
    block table (the block manager's public seam; `_build_batch` is private), which a step
    does there alone but for an import of pulled KV, a KV session read or a fast-forward."""

    batch_failures = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_armed = threading.Semaphore(0)
        block_table = self.block_manager.block_table

        def failing_block_table(seq_id: int) -> list[int]:
            if self.batch_armed.acquire(blocking=False):
                self.batch_failures += 1
                raise RuntimeError("building the batch failed")
            return block_table(seq_id)

        self.block_manager.block_table = failing_block_table  # type: ignore[method-assign]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("end", "num_sequences"),
    [("length", 1), ("length", 2), ("stop token", 1), ("KV cache full", 1)],
)
async def test_a_request_whose_end_fails_in_a_step_ends_and_leaves_the_core(
    end: str, num_sequences: int
) -> None:
    """A request's end in a step (its last token, its stop token, or the KV cache full)
    fails partway, as the core takes an output it marked finished out of the scheduler. The
    step fails; the request's client gets an ERROR end for each output, its usage counting
    the tokens it got; the core holds neither the request nor its blocks, and a request of
    its id is accepted at once and gets its own outputs to its end. The core kept the request
    with nothing left to finish, which the failed step's abort of every request passed over:
    its client waited for ever, and its id was refused for ever."""
    runner = SimRunner(block_size=4, num_blocks=4 if end == "KV cache full" else 256, time_scale=0)
    core = EndFailsInAStep(runner)
    core.end_armed.release()
    engine = EngineLoop(core)
    engine.start()
    stop = runner.next_tokens(3, 0, 0, 3)[-1]  # the output's third token
    sampling = SamplingParams(
        max_tokens=3 if end == "length" else 100,
        num_sequences=num_sequences,
        stop_token_ids=(stop,) if end == "stop token" else (),
    )
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("same", (1, 2, 3), sampling),
        asyncio_sink(asyncio.get_running_loop(), queue),
    )
    outputs = await collect(queue)
    assert core.end_failures == 1
    assert sorted(o.output_index for o in outputs if o.finished) == list(range(num_sequences))
    assert {o.finish_reason for o in outputs if o.finished} == {FinishReason.ERROR}
    usage = outputs[-1].usage
    assert usage is not None and usage.prompt_tokens == 3
    assert usage.completion_tokens == sum(len(o.new_token_ids) for o in outputs)
    left = engine.call(lambda core: (core.holds("same"), core.load().num_used_blocks))
    assert await asyncio.wait_for(asyncio.wrap_future(left), timeout=10) == (False, 0)
    await own_outputs_once_its_id_is_free(engine, runner)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
async def test_a_request_a_failing_step_ended_before_it_failed_gets_its_end() -> None:
    """One pass computes two requests: the first ends in it (its one token), then the step
    fails on the second (the runner returned nothing for it). The first's client gets its
    end (LENGTH, its token), the second's its ERROR, and the first's id is taken again by a
    request that runs. The first's end used to be lost with the failed step: its client waited
    for ever (and, once it left, `abandon` waited for that end for ever too, dropping every
    output of the next request of the id as the dead one's)."""
    runner = ForgetfulRunner(block_size=4, num_blocks=64, time_scale=0)
    engine = EngineLoop(EngineCore(runner))
    engine.start()
    loop = asyncio.get_running_loop()
    ends, fails = asyncio.Queue[RequestOutput](), asyncio.Queue[RequestOutput]()
    async with engine_thread_held(engine):  # both in the first pass
        runner.forget = "fails"
        engine.submit(
            EngineRequest("ends", (1, 2, 3), SamplingParams(max_tokens=1)), asyncio_sink(loop, ends)
        )
        engine.submit(
            EngineRequest("fails", (4, 5, 6), SamplingParams(max_tokens=3)),
            asyncio_sink(loop, fails),
        )
    ended = await collect(ends)
    assert [o.finish_reason for o in ended if o.finished] == [FinishReason.LENGTH]
    assert ended[-1].usage is not None and ended[-1].usage.completion_tokens == 1
    assert (await collect(fails))[-1].finish_reason is FinishReason.ERROR
    again: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("ends", (1, 2, 3), SamplingParams(max_tokens=2)), asyncio_sink(loop, again)
    )
    assert (await collect(again))[-1].finish_reason is FinishReason.LENGTH
    assert engine.num_live_requests() == 0
    engine.stop(timeout_s=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fails", list(AllFails))
async def test_a_failed_step_whose_abort_of_all_fails_ends_each_request_and_serves_on(
    fails: AllFails,
) -> None:
    """A forward pass fails, and the core's abort of every request after it (ERROR) fails
    too, as `fails` says. Each request it did not end is aborted on its own (one it ended
    gets its end, one it forgot an end made up): each output of each ends ERROR, "engine step
    failed", the core holds none of them nor their blocks, and the engine goes on: a request
    of a used id runs to its end. The engine thread died instead (the abort's error escaped
    it): each request ended "the engine stopped", and the engine served no more."""
    runner = FlakyRunner(block_size=4, num_blocks=256, time_scale=0)
    core = AbortAllFails(runner)
    core.error_armed.append(fails)
    engine = EngineLoop(core)
    engine.start()
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue(), asyncio.Queue()]
    async with engine_thread_held(engine):  # both in the pass that fails
        runner.armed = True
        for request_id, queue in zip(["same", "other"], queues, strict=True):
            sampling = SamplingParams(max_tokens=100_000, num_sequences=2)
            engine.submit(EngineRequest(request_id, (1, 2, 3), sampling), asyncio_sink(loop, queue))
    for queue in queues:
        outputs = await collect(queue)
        assert sorted(o.output_index for o in outputs if o.finished) == [0, 1]
        ends = {(o.finish_reason, o.message) for o in outputs if o.finished}
        assert ends == {(FinishReason.ERROR, "engine step failed")}
    assert core.error_failures == 1
    left = engine.call(
        lambda core: (core.holds("same"), core.holds("other"), core.load().num_used_blocks)
    )
    assert await asyncio.wait_for(asyncio.wrap_future(left), timeout=10) == (False, False, 0)
    await a_request_of_the_id_runs_to_its_end(engine)
    engine.stop(timeout_s=10)


@pytest.mark.timeout(60)
async def test_a_request_whose_consumer_is_gone_leaves_the_load() -> None:
    """The consumer's event loop closed (its sink raises): the request is aborted, and the
    load (GetLoad's) says so at once, not only once other work comes (an idle engine used to
    report it running, holding its blocks, until then). Its end, CANCELLED, is counted as an
    aborted request's (kvplane_engine_finished_outputs_total): it was dropped with the sink."""
    registry = CollectorRegistry()
    engine = make_loop(on_step=EngineMetrics(registry, "m").on_report)
    engine.start()
    gone = asyncio.new_event_loop()
    gone.close()
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)
    unread: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(EngineRequest("a", tuple(range(5, 30)), long), asyncio_sink(gone, unread))
    await eventually(lambda: engine.num_live_requests() == 0, what="the request dropped")
    # Nothing else is submitted: the engine thread is idle from here on.
    await eventually(
        lambda: (engine.load().num_running, engine.load().num_used_blocks) == (0, 0),
        what="the load without the dropped request",
    )
    cancelled = {"reason": FinishReason.CANCELLED.value}
    await eventually(  # (reported after the load is measured)
        lambda: _counted(registry, "kvplane_engine_finished_outputs_total", **cancelled) == 1,
        what="the dropped request counted finished",
    )
    engine.stop(timeout_s=10)


@pytest.mark.timeout(60)
async def test_a_request_waiting_for_blocks_a_session_holds_runs_once_it_is_released() -> None:
    """The engine thread waits (for a command, or a while) instead of stepping in vain while
    a request waits for blocks a KV session holds; the release wakes it. Its preemption, in a
    step that runs no pass, is counted (kvplane_engine_preemptions_total counted only a
    pass's: it read 0)."""
    registry = CollectorRegistry()
    core = EngineCore(SimRunner(block_size=4, num_blocks=6, time_scale=0))
    engine = EngineLoop(core, on_step=EngineMetrics(registry, "m").on_report)
    engine.start()
    loop = asyncio.get_running_loop()
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill = EngineRequest("p", tuple(range(100, 110)), greedy, kv_session_id="s1")
    done: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(prefill, asyncio_sink(loop, done))
    assert (await collect(done))[-1].held_kv_session  # 2 blocks held, 4 free
    long = EngineRequest("long", tuple(range(500, 513)), replace(greedy, max_tokens=8))
    engine.submit(long, asyncio_sink(loop, done))
    # 4 tokens fill the 4 free blocks; the 5th token's KV needs a 5th block.
    head = [await asyncio.wait_for(done.get(), timeout=10) for _ in range(4)]
    assert not any(o.finished for o in head)
    await eventually(
        lambda: (engine.load().num_running, engine.load().num_waiting) == (0, 1),
        what="the request waiting for the session's blocks",
    )
    assert await asyncio.wrap_future(engine.call(lambda c: c.release_kv_session("s1")))
    outputs = await collect(done)
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].message == ""
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 8
    assert len(head + outputs) == 8
    assert _counted(registry, "kvplane_engine_preemptions_total") == 1
    engine.stop(timeout_s=10)


def _counted(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model": "m", **labels}) or 0.0


class DyingCore(AbortAllFails):
    """A core whose `has_work` raises once armed: the engine thread fails outside a step (its
    abort of every request failing as `AbortAllFails` arms it)."""

    dying = False

    def has_work(self) -> bool:
        if self.dying:
            raise RuntimeError("engine bug")
        return super().has_work()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("abort_all_fails", [False, True])
def test_a_failed_engine_thread_releases_what_its_requests_held(abort_all_fails: bool) -> None:
    """The engine thread failing (not a step: the thread itself) ends its requests in the core
    too: their blocks return to the pool and the pulled KV a DECODE engine held for a waiting
    one (`import_or_hold_kv_blocks`) is dropped, not kept as long as the process lives; and
    each client gets its ERROR end, "the engine stopped". Should the core's abort of them all
    fail (before it did anything), each is aborted on its own: that failure used to be only
    logged, the core holding both requests, the blocks and the pulled KV."""
    core = DyingCore(BytesRunner(num_blocks=4))
    if abort_all_fails:
        core.error_armed.append(AllFails.AT_ONCE)
    exited = threading.Event()
    engine = EngineLoop(core, on_exit=exited.set)
    pulled = EngineRequest("pulled", tuple(range(100, 110)), SamplingParams(max_tokens=3))
    outputs: dict[str, list[RequestOutput]] = {"busy": [], "pulled": []}
    imports: list[str] = []

    def pulled_kv(core: EngineCore) -> None:
        imports.append(core.import_or_hold_kv_blocks(pulled, [b"k0", b"k1"], max_held_bytes=4))

    def busy_sink(output: RequestOutput) -> None:
        # On the engine thread, once the pass that gave "busy" all 4 blocks is over: the
        # thread fails right after it adds "pulled" (its KV held: no room in the pool).
        if not outputs["busy"]:
            engine.submit(pulled, outputs["pulled"].append, before=pulled_kv)
            core.dying = True
        outputs["busy"].append(output)

    engine.start()
    busy = EngineRequest("busy", tuple(range(500, 513)), SamplingParams(max_tokens=3))
    engine.submit(busy, busy_sink)
    assert exited.wait(timeout=10)
    assert not engine.running
    core.dying = False
    assert imports == ["held"] and core.error_failures == int(abort_all_fails)
    assert not core.holds("busy") and not core.holds("pulled")
    assert core.held_import_bytes == 0
    assert core.block_manager.num_used_blocks == 0 and not core.has_work()
    for got in outputs.values():
        assert got[-1].usage is not None
        assert (got[-1].finish_reason, got[-1].message) == (
            FinishReason.ERROR,
            "the engine stopped",
        )


@pytest.mark.timeout(30)
def test_a_request_abandoned_as_the_engine_thread_ends_is_released_too() -> None:
    """The engine thread fails (the thread itself), and a request is abandoned (its client
    gone) once the thread took its last commands, so the abort `abandon` queues never runs;
    the core's abort of every request fails then (before it did anything). The request is
    aborted on its own all the same, its blocks freed. The abort of each on its own covered
    only the live requests and the stray ones: the core held it, and its blocks."""
    core = DyingCore(SimRunner(block_size=4, num_blocks=256, time_scale=0))
    core.error_armed.append(AllFails.AT_ONCE)
    exited = threading.Event()
    engine = EngineLoop(core, on_exit=exited.set)
    engine.start()
    got: list[RequestOutput] = []
    gone = EngineRequest("gone", (1, 2, 3), SamplingParams(max_tokens=100_000))
    engine.submit(gone, got.append)

    def dies(_core: EngineCore) -> None:
        # The thread fails right after this command; the abandon comes in a command it runs
        # as it ends (as one from another thread racing its end would come).
        engine.call(lambda _core: engine.abandon("gone"))
        core.dying = True

    engine.call(dies)
    assert exited.wait(timeout=10)
    core.dying = False
    assert core.error_failures == 1
    assert not core.holds("gone") and core.block_manager.num_used_blocks == 0
    assert all(output.usage is None for output in got)  # (abandoned: its end reaches no one)


@pytest.mark.timeout(30)
def test_a_request_submitted_once_the_engine_thread_died_is_refused() -> None:
    """The engine thread fails (not a step: the thread itself); a request submitted after it
    (a server that checked `running` just before) is refused: the engine stopped. It used to
    be accepted, its add queued for a thread that would never run it: its client waited for
    an output for ever."""
    core = DyingCore(SimRunner(block_size=4, num_blocks=256, time_scale=0))
    exited = threading.Event()
    engine = EngineLoop(core, on_exit=exited.set)
    core.dying = True
    engine.start()
    assert exited.wait(timeout=10)
    core.dying = False
    got: list[RequestOutput] = []
    with pytest.raises(EngineStoppedError):
        engine.submit(EngineRequest("late", (1, 2, 3), SamplingParams(max_tokens=2)), got.append)
    assert engine.num_live_requests() == 0


@pytest.mark.timeout(30)
async def test_a_long_prefill_step_lands_in_a_bucket_of_the_step_histogram() -> None:
    """A CPU engine's prefill step of a full token budget (docs/benchmarks/e2e.md's torch
    model prefills about 800 tokens/s: 8,192 tokens take about 10 s) is counted in a finite
    bucket of `kvplane_engine_step_seconds`: its buckets ended at 2.5 s, so every such step
    fell in +Inf and no quantile above 2.5 s could be read."""
    reports: list[StepReport] = []
    engine = make_loop(reports=reports)
    engine.start()
    loop = asyncio.get_running_loop()
    done: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(
        EngineRequest("a", tuple(range(5, 30)), SamplingParams(max_tokens=1)),
        asyncio_sink(loop, done),
    )
    await collect(done)
    engine.stop(timeout_s=10)
    ran = next(r for r in reports if r.result.stats is not None)
    assert ran.result.stats is not None
    long = replace(ran, result=replace(ran.result, stats=replace(ran.result.stats, duration_s=9.5)))
    registry = CollectorRegistry()
    EngineMetrics(registry, "m").on_report(long)
    assert _counted(registry, "kvplane_engine_step_seconds_bucket", le="10.0") == 1
    assert _counted(registry, "kvplane_engine_step_seconds_bucket", le="2.5") == 0
