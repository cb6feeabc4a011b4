"""The engine's asyncio service layer: requests in flight, abort, drain, health, event fan-out.

Sits between the servicers (proto in, proto out) and the `EngineLoop` thread (dataclasses).
Every step report from the engine thread is handed to the event loop with
`call_soon_threadsafe`, after that step's outputs (so a request's outputs are always ahead of
the KV events of the same step); there it feeds the KV event log, the runtime-event hub and
the metrics. Nothing here blocks the event loop on a step.

Acceptance: `submit` validates synchronously (raising the domain errors the servicers map to
a status) and then commits the request; after that, the request's stream of outputs always
ends with the output that carries `usage` (finished, cancelled or failed). Before that, while a
front end converts it (tokenising a text prompt, compiling a guide: awaits), its id is held
(`converting`): an Abort then stops it as an accepted one, and it ends aborted, never run,
even when its conversion then fails (the abort wins over the refusal) or acceptance would
refuse what it converted to: then as far as it is known unconverted.

Pooling tasks (Embed/Classify/Score, `engine.server.pooling_tasks`) are not engine requests:
each runs as engine-thread commands (`run_task`), but shares the request ids' namespace,
counts as in flight (Drain waits for it) and answers Abort like a request (`begin_task`).
Stopped (Abort, a drain's deadline, the client gone or its deadline passed) while its batch
still waits for the engine thread, a task leaves at once: that batch never runs, and the task
is out of the counts before Abort answers (`_stop_task`).
A DECODE engine's request pulling its KV session is held the same way until it is submitted
(`begin_pull`): once the pull starts the request counts as in flight, its id is taken, and a
drain that begins meanwhile waits for it instead of refusing it after the pull.

Admission control (`max_queued_requests`; None: unbounded, as vLLM): a request or pooling
task arriving while that many are queued is refused before acceptance (`OverloadedError`,
RESOURCE_EXHAUSTED), after every check of the request itself, so that a malformed one is
refused for itself. Queued (`num_queued`): requests accepted and not yet running
(`EngineLoop.num_queued`), a DECODE engine's requests whose KV session is being pulled (each
joins the queue once pulled), and pooling tasks accepted whose first batch has not begun on
the engine thread (`TaskHandle.waiting`: behind a long step or other tasks' batches; once its
first batch runs a task counts running, as a scheduled request does between its steps). So a
pooling-only engine, which has no generation queue, is bounded too. The health probe is never
refused (the engine's own work, as while draining) nor counted, and goes ahead of every waiting
request (`PROBE_PRIORITY`); a pulled request is not refused again once its pull is over.

A pooling-only engine (`runner: pooling`, `ServedModel.generates` false) refuses every
generation request in `submit` (FAILED_PRECONDITION: the front ends refuse them earlier, this
is the backstop), and its health probe runs one pooling forward instead of generating.

A PREFILL engine's service also owns its KV sessions (`kv_sessions`,
`engine.server.kv_transfer.KvSessionStore`): sessions handed over and not yet pulled are work
a decode engine still needs, so Drain and shutdown wait for them as for requests in flight
(each lasts at most `kv_transfer.session_ttl_s`, or until the pull in progress ends), and
release them at the deadline when told to abort (pulls in progress included).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.core.api import (
    EngineRequest,
    FinishReason,
    LoadSnapshot,
    RequestOutput,
    SamplingParams,
    StepReport,
    Usage,
)
from engine.core.engine_core import EngineCore, EngineLoop, asyncio_sink
from engine.core.errors import (
    AbortFailedError,
    DuplicateRequestError,
    EngineStoppedError,
    InvalidRequestError,
)
from engine.core.guided import compile_guide
from engine.core.lora import LoraSlot
from engine.core.pooling import Pooler, PoolingParams, PoolingTask
from engine.server.errors import (
    DrainingError,
    FeatureDisabledError,
    KvSessionNotFoundError,
    KvSessionRefusedError,
    OverloadedError,
    RequestAbortedError,
    RequestNotFoundError,
)
from engine.server.info import POOLING_ONLY_MESSAGE, ServedModel
from engine.server.kv_event_log import KvEventLog
from engine.server.kv_transfer import KvSessionStore
from engine.server.metrics import EngineMetrics, ImportOutcome, PullOutcome
from engine.server.runtime_events import RuntimeEventHub
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

T = TypeVar("T")

_FINISHED_MEMORY = 10_000  # finished request ids remembered for ALREADY_FINISHED
_CLOSE_SLACK_S = 5.0


class AbortOutcome(enum.Enum):
    ABORTED = "aborted"
    ALREADY_FINISHED = "already_finished"


class DrainPhase(enum.Enum):
    STARTED = "started"
    IN_PROGRESS = "in_progress"
    COMPLETE = "complete"
    DEADLINE_EXCEEDED = "deadline_exceeded"  # no abort after the deadline: a failure


@dataclass(frozen=True, slots=True)
class DrainProgress:
    phase: DrainPhase
    in_flight_requests: int
    open_kv_sessions: int = 0
    message: str = ""


class RequestStream:
    """One accepted request's outputs, in order, ending with the one that carries usage.

    `ended`: the engine sent that last output (its work is over); `done`: the reader got it.
    A client that stops reading keeps the request between the two for as long as it likes."""

    def __init__(
        self,
        request: EngineRequest,
        on_done: Callable[[RequestStream], None],
        on_ended: Callable[[], None],
    ) -> None:
        self.request = request
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.ended = False
        self.done = False
        self._on_done = on_done
        self._on_ended = on_ended

    def put_nowait(self, output: RequestOutput) -> None:
        """The engine's next output (`asyncio_sink` calls this on the event loop)."""
        self.queue.put_nowait(output)
        if output.usage is not None:
            self.ended = True
            self._on_ended()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while not self.done:
            output = await self.queue.get()
            if output.usage is not None:
                self.done = True
                self._on_done(self)
            yield output


class TaskHandle:
    """One accepted pooling task, a request pulling its KV session, or a request still being
    converted (`converting`: `EngineService.converting`): its id, whether Abort (or a drain's
    deadline) stopped it, and whether it still waits for the engine thread.

    `waiting`: a pooling task until its first batch begins on the engine thread (set false
    there, read on the event loop: one attribute, so no lock); a pull never waits here (it is
    counted queued as a pull). `queued_batch`: the engine-thread command of a pooling task's
    current batch (`run_task`), which stopping the task cancels if it has not begun. `lora`: a
    pulling request's LoRA adapter, held since its admission (`begin_pull`)."""

    def __init__(self, request_id: str, *, waiting: bool, converting: bool = False) -> None:
        self.request_id = request_id
        self.aborted = asyncio.Event()
        self.waiting = waiting
        self.converting = converting
        self.queued_batch: Future[Any] | None = None
        self.lora: LoraSlot | None = None

    def take_lora(self) -> LoraSlot | None:
        """The adapter held, now the caller's to let go of (or hand on): once."""
        slot, self.lora = self.lora, None
        return slot

    def drop_queued_batch(self) -> bool:
        """Take the task's batch out of the engine thread's queue; True if it had not begun
        (so it never runs), False if it runs or ran, or there is none (a pull)."""
        batch, self.queued_batch = self.queued_batch, None
        # Atomic against the engine thread beginning it (`EngineLoop.call`).
        return batch is not None and batch.cancel()


# The health probe's request ids: the engine's own work, refused from clients and left out of
# the request metrics (frequent probing is not load).
PROBE_ID_PREFIX = "kvplane-health-probe-"
# The health probe's priority: above any client's (an int32 on both front ends) however long
# that one has waited (`aging_s`), so the probe is admitted ahead of every waiting request: a
# prefill at the head of the queue waiting for the blocks KV sessions hold does not hold it.
PROBE_PRIORITY = 2**62


def _not_a_probe(request_id: str) -> bool:
    return not request_id.startswith(PROBE_ID_PREFIX)


async def _count_probe_tokens(stream: RequestStream) -> int:
    tokens = 0
    async for output in stream.outputs():
        tokens += len(output.new_token_ids)
        if output.message and output.finish_reason is not None and not tokens:
            raise RuntimeError(output.message)
    return tokens


def _pull_outcome(error: BaseException) -> PullOutcome:
    if isinstance(error, asyncio.CancelledError | RequestAbortedError):
        return "cancelled"
    if isinstance(error, KvSessionNotFoundError):
        return "not_found"
    if isinstance(error, KvSessionRefusedError | InvalidRequestError):
        return "refused"
    return "failed"


class EngineService:
    """Owns the EngineLoop's asyncio side. Create inside the running event loop."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        model: ServedModel,
        kv_log: KvEventLog,
        runtime_events: RuntimeEventHub,
        metrics: EngineMetrics | None = None,
        *,
        kv_session_ttl_s: float | None = None,
        drain_progress_interval_s: float = 1.0,
        pooler: Pooler | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        """`kv_session_ttl_s`: a PREFILL engine's (it holds KV sessions), else None.
        `pooler`: a pooling-only engine's (`model.generates` false), which its probe runs.
        `max_queued_requests`: the admission bound (module doc); None: unbounded."""
        if not model.generates and pooler is None:
            raise ValueError("an engine that does not generate needs a pooler to probe")
        self.engine_loop = engine_loop
        self.model = model
        self._pooler = pooler
        self.kv_log = kv_log
        self.runtime_events = runtime_events
        self.metrics = metrics
        self._aio_loop = asyncio.get_running_loop()
        self._live: dict[str, RequestStream] = {}
        # The health probes among them: the engine's own work, not counted as in flight.
        self._live_internal: set[str] = set()
        self._live_tasks: dict[str, TaskHandle] = {}  # pooling tasks (not engine requests)
        self._max_queued_requests = max_queued_requests
        self._num_pulling = 0  # a DECODE engine's requests pulling their KV session
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._accepting = True
        self._draining = False
        self._serving_listeners: list[Callable[[], None]] = []
        # One compile at a time: compiling is pure Python and holds the GIL, so threads that
        # compile side by side finish no sooner, and each takes a share of the GIL from the
        # event loop that answers Health and GetLoad.
        self._guide_compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guide")
        self._in_flight_changed = asyncio.Event()
        self._progress_interval_s = drain_progress_interval_s
        self.kv_sessions: KvSessionStore | None = None
        if kv_session_ttl_s is not None:
            self.kv_sessions = KvSessionStore(
                engine_loop,
                ttl_s=kv_session_ttl_s,
                block_size=model.block_size,
                kv_layout=engine_loop.core.runner.kv_layout,
                on_change=self._in_flight_changed.set,
            )
            if metrics is not None:
                metrics.watch_open_kv_sessions(lambda: self.num_open_kv_sessions)

    # ---------------------------------------------------------------- engine thread -> loop

    def on_step_threadsafe(self, report: StepReport) -> None:
        """EngineLoop's `on_step` (engine thread): hand the report to the event loop."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
            self._aio_loop.call_soon_threadsafe(self._on_report, report)

    def on_exit_threadsafe(self) -> None:
        """EngineLoop's `on_exit` (engine thread): the engine serves no more."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
            self._aio_loop.call_soon_threadsafe(self._serving_changed)

    def _on_report(self, report: StepReport) -> None:
        self.kv_log.append(report.kv_events)
        self.runtime_events.publish_step(report.result.stats, report.load)
        if self.metrics is not None:
            self.metrics.on_report(report, counted=_not_a_probe)

    # ---------------------------------------------------------------- state

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def engine_running(self) -> bool:
        return self.engine_loop.running

    @property
    def serving(self) -> bool:
        """Whether new requests can be taken: not draining (or shutting down), and the engine
        thread running. Once false it stays so."""
        return self._accepting and self.engine_running

    def on_serving_changed(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the event loop) when `serving` turns false."""
        self._serving_listeners.append(listener)

    def _stop_accepting(self) -> None:
        self._draining = True
        if self._accepting:
            self._accepting = False
            self._serving_changed()

    def _serving_changed(self) -> None:
        for listener in self._serving_listeners:
            listener()

    @property
    def num_in_flight(self) -> int:
        """Requests clients sent that have not ended (what Drain counts and waits for).

        Health probes are left out: they are allowed while draining, so counting them would
        let Health calls hold a drain open; each lasts one token and never outlives its call.
        """
        return len(self._live) - len(self._live_internal) + len(self._live_tasks)

    @property
    def num_unended(self) -> int:
        """`num_in_flight` less the requests whose engine work is over, whose clients have
        not read everything yet: what a drain past its aborting deadline still waits for."""
        ended = sum(
            stream.ended
            for request_id, stream in self._live.items()
            if request_id not in self._live_internal
        )
        return self.num_in_flight - ended

    @property
    def num_open_kv_sessions(self) -> int:
        """KV sessions handed over and not yet pulled (a PREFILL engine's)."""
        return self.kv_sessions.num_open if self.kv_sessions is not None else 0

    def load(self) -> LoadSnapshot:
        """The engine's load now, for GetLoad: read from the engine thread's latest snapshot
        (`EngineLoop.load`), not from the reports this loop has processed, so that a prefill
        that just finished counts at once in `num_kv_sessions`, at the instant it leaves the
        running sequences (never in both, never in neither)."""
        return self.engine_loop.load()

    # ---------------------------------------------------------------- requests

    def _check_accepting(self, request_id: str, internal: bool, admitted: bool = False) -> None:
        if not self._accepting and not (internal or admitted):
            raise DrainingError("the engine is draining and accepts no new requests")
        if not internal and request_id.startswith(PROBE_ID_PREFIX):
            raise InvalidRequestError(
                f"request ids starting with {PROBE_ID_PREFIX!r} are the engine's own"
            )
        if not self.engine_loop.running:
            raise EngineStoppedError("the engine thread is not running")
        # An id stays taken until its client has read the last output or gone (`_live`), not
        # only while the engine runs it: the first request's client leaving would otherwise
        # cancel (`cancel_nowait`) a second request that took the id in between.
        if request_id in self._live_tasks or request_id in self._live:
            raise DuplicateRequestError(f"request {request_id!r} is already running")

    @property
    def num_queued(self) -> int:
        """What admission control bounds: requests queued, those pulling their KV, and pooling
        tasks waiting for the engine thread (module doc)."""
        return self.engine_loop.num_queued() + self._num_pulling + self.num_waiting_tasks

    @property
    def num_waiting_tasks(self) -> int:
        """Pooling tasks accepted whose first batch has not started on the engine thread."""
        return sum(handle.waiting for handle in self._live_tasks.values())

    def _check_admission(self, task: str) -> None:
        """Refuse a new request (of `task`, for the metrics) while `max_queued_requests` are
        queued; the last check before acceptance."""
        bound = self._max_queued_requests
        if bound is None:
            return
        queued = self.num_queued
        if queued < bound:
            return
        if self.metrics is not None:
            self.metrics.on_overloaded(task)
        raise OverloadedError(
            f"the engine is overloaded: {queued} queued, max_queued_requests is {bound}; "
            "retry later or on another engine"
        )

    async def compile_guide(self, request: EngineRequest) -> None:
        """Build a guided request's guide in a worker thread (memoised, so the core's
        `check_request` finds it built): a large JSON schema takes a few hundred ms, and the
        event loop serves every other call of this engine meanwhile. Raises as that check
        would for a malformed one."""
        if request.guided is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._guide_compiler, compile_guide, request.guided)

    def begin_pull(self, request: EngineRequest) -> TaskHandle:
        """Admit a DECODE engine's `request` whose KV session is about to be pulled: refuse
        now what `submit` would refuse (a refusal after the pull would waste the session);
        from here it counts as in flight, and as queued. End with `end_pull` or
        `abandon_pull`."""
        handle = self.begin_task(request.request_id, "generate", request)
        self._num_pulling += 1
        return handle

    def end_pull(
        self,
        handle: TaskHandle,
        request: EngineRequest,
        before: Callable[[EngineCore], object] | None,
        *,
        num_blocks: int,
    ) -> RequestStream:
        """The pull of `num_blocks` is over: submit the request (`before` imports the blocks,
        counting its outcome; not if its adapter's name serves other weights by then,
        `LoraSlot.superseded`), even if a drain began meanwhile; RequestAbortedError if Abort
        or a drain's deadline stopped it. A `before` that never runs counts why (`superseded`,
        `aborted`, `refused`): every pull that ended "ok" counts one import outcome."""
        self._end_pull(handle)
        metrics = self.metrics
        if metrics is not None:
            metrics.on_pull("ok", num_blocks)

        def never_imported(outcome: ImportOutcome) -> None:
            if metrics is not None and before is not None:
                metrics.on_kv_import(outcome)

        lora = handle.take_lora()
        if handle.aborted.is_set():
            self._release_lora(lora)
            never_imported("aborted")
            raise RequestAbortedError(f"request {request.request_id!r} was aborted")
        if before is not None and lora is not None:
            before = _unless_superseded(before, lora, lambda: never_imported("superseded"))
        return self.submit(  # `lora` now submit's
            request,
            before=before,
            admitted=True,
            lora=lora,
            not_taken=lambda: never_imported("refused"),
        )

    def abandon_pull(self, handle: TaskHandle, error: BaseException) -> None:
        """The pull failed (`error`) or the client left: the request was never submitted."""
        self._release_lora(handle.take_lora())
        self._end_pull(handle)
        if self.metrics is not None:
            self.metrics.on_pull(_pull_outcome(error))

    def aborted_before_prefill(self, request: EngineRequest) -> list[RequestOutput]:
        """The outputs that end `request`, aborted before the core took it (a DECODE engine's,
        while it pulls its KV session), as the core ends one aborted while queued
        (`EngineCore.abort`): each output finished CANCELLED ("aborted"), the last with the
        Usage of its prompt alone (no completion token, nothing read from the cache). Counted
        in the metrics as that one is: an accepted request and its finished outputs."""
        last = request.sampling.num_sequences - 1
        usage = Usage(len(request.prompt_token_ids), 0, 0)
        outputs = [
            RequestOutput(
                request.request_id,
                index,
                finish_reason=FinishReason.CANCELLED,
                message="aborted",
                usage=usage if index == last else None,
            )
            for index in range(last + 1)
        ]
        if self.metrics is not None:
            self.metrics.on_accept(request)
            self.metrics.on_outputs(outputs)
        return outputs

    def _release_lora(self, slot: LoraSlot | None) -> None:
        """Let go of the adapter a request admitted before held, never submitted (`end_pull`)."""
        if slot is not None:
            self.engine_loop.call(lambda core: core.release_lora(slot))

    def _end_pull(self, handle: TaskHandle) -> None:
        self._num_pulling -= 1
        self.end_task(handle)

    def submit(
        self,
        request: EngineRequest,
        *,
        internal: bool = False,
        admitted: bool = False,
        before: Callable[[EngineCore], object] | None = None,
        lora: LoraSlot | None = None,
        not_taken: Callable[[], object] | None = None,
    ) -> RequestStream:
        """Validate and accept `request` (raising before acceptance), or refuse while draining.
        `lora`: its adapter, held since its admission (`end_pull`), this call's to let go of:
        the request's once `EngineLoop.submit` took it (the core releases it at its end),
        released here if anything raises before, and `not_taken()` called then (`before`
        never runs). Anything raising after it was taken (`before` runs) aborts
        it there: a caller told it failed leaves no work behind (nor, on a PREFILL engine, a
        session the core would hold past the caller's release of it).

        `internal` requests (the health probe) are accepted while draining and past the
        admission bound, and so are those `admitted` before (`end_pull`). `before(core)` runs in
        the engine thread just before the request is added (`EngineLoop.submit`).
        """
        stream = RequestStream(request, self._on_stream_done, self._in_flight_changed.set)
        try:
            if not self.model.generates:
                raise FeatureDisabledError(POOLING_ONLY_MESSAGE)
            self._check_accepting(request.request_id, internal, admitted)
            self.engine_loop.submit(
                request,
                asyncio_sink(self._aio_loop, stream),
                before=before,
                admit=None if internal or admitted else lambda: self._check_admission("generate"),
                lora=lora,
            )
        except BaseException:
            self._release_lora(lora)  # not taken
            if not_taken is not None:
                not_taken()
            raise
        self._live[request.request_id] = stream
        if internal:
            self._live_internal.add(request.request_id)
        self._finished.pop(request.request_id, None)
        self._in_flight_changed.set()
        if self.metrics is not None and not internal:
            try:
                self.metrics.on_accept(request)
            except BaseException:  # refused after the engine thread took it: stop it there
                self.cancel_nowait(request.request_id)
                raise
        return stream

    def _on_stream_done(self, stream: RequestStream) -> None:
        request_id = stream.request.request_id
        if self._live.get(request_id) is stream:
            del self._live[request_id]
            self._live_internal.discard(request_id)
        self._finished[request_id] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        self._in_flight_changed.set()

    def cancel_nowait(self, request_id: str) -> None:
        """The client went away, or acceptance failed after the engine thread took the request:
        stop the work (nobody reads the outputs any more). The id is free at once, as the
        client sees its request over: one submitted with it next is accepted, even before the
        engine thread has run the abort (`EngineLoop.abandon`)."""
        stream = self._live.pop(request_id, None)
        if stream is None:
            return
        self._live_internal.discard(request_id)
        stream.done = True
        self._finished[request_id] = None
        self._in_flight_changed.set()
        if self.engine_loop.running:
            self.engine_loop.abandon(request_id)

    async def abort(self, request_id: str) -> AbortOutcome:
        task = self._live_tasks.get(request_id)
        if task is not None:
            self._stop_task(task)
            return AbortOutcome.ABORTED
        if request_id in self._live:
            stopped = await asyncio.wrap_future(self.engine_loop.abort(request_id))
            return AbortOutcome.ABORTED if stopped else AbortOutcome.ALREADY_FINISHED
        if request_id in self._finished:
            return AbortOutcome.ALREADY_FINISHED
        raise RequestNotFoundError(f"no request {request_id!r} on this engine")

    async def abort_all(self) -> list[str]:
        tasks = list(self._live_tasks.values())
        for task in tasks:
            self._stop_task(task)
        requests = await asyncio.wrap_future(self.engine_loop.abort_all())
        return sorted([*requests, *(t.request_id for t in tasks)])

    def _stop_task(self, handle: TaskHandle) -> None:
        """Abort (or a drain's deadline) stops a pooling task or a pull. A task whose batch
        has not begun on the engine thread ends now: that batch never runs, and the task
        leaves the counts (in flight, queued) before the Abort answer; its call then ends
        CANCELLED. A batch already running finishes, its result dropped (`unless_aborted`)."""
        handle.aborted.set()
        if handle.drop_queued_batch():
            self.end_task(handle)

    # ---------------------------------------------------------------- pooling tasks

    def begin_task(
        self, request_id: str, task: str, request: EngineRequest | None = None
    ) -> TaskHandle:
        """Accept a pooling `task` (embed, classify, score), or the `request` a DECODE engine
        is about to pull a KV session for (task generate; checked by the core as `submit`
        would: a refusal after the pull would waste the session), raising before acceptance
        as `submit` does; the caller ends it with `end_task`, whatever happens. The `request`'s
        LoRA adapter is held from here (`TaskHandle.lora`): an unload during the pull does not
        take it from the request."""
        self._check_accepting(request_id, internal=False)
        if request is not None:
            self.engine_loop.core.check_request(request)
        self._check_admission(task)
        handle = TaskHandle(request_id, waiting=request is None)
        if request is not None:
            handle.lora = self.engine_loop.core.acquire_lora(request)
        self._live_tasks[request_id] = handle
        self._finished.pop(request_id, None)
        self._in_flight_changed.set()
        return handle

    def end_task(self, handle: TaskHandle) -> None:
        if self._live_tasks.get(handle.request_id) is handle:
            del self._live_tasks[handle.request_id]
            self._finished[handle.request_id] = None
            while len(self._finished) > _FINISHED_MEMORY:
                self._finished.popitem(last=False)
            self._in_flight_changed.set()

    @property
    def num_running_tasks(self) -> int:
        return sum(not handle.converting for handle in self._live_tasks.values())

    @contextlib.contextmanager
    def converting(self, request_id: str) -> Iterator[TaskHandle]:
        """Hold `request_id` while its request is converted (a text prompt tokenised, a guide
        compiled: awaits before `submit` or `begin_task`), so that an Abort of it meanwhile
        answers as for an accepted one and the caller then ends the request aborted
        (`handle.aborted`) instead of running it; so does a drain's deadline. It counts as in
        flight, not as queued nor as a running task. An id already taken, or none (the engine
        names the request), is not held: acceptance refuses a duplicate as before, after the
        checks of the request itself. The hold ends with the block, before acceptance. The
        abort wins over a conversion that fails after it: the block raises RequestAbortedError
        instead of the conversion's refusal, since Abort told the client ABORTED (an error
        that is no refusal, a bug, is still logged with its traceback, as without the Abort)."""
        handle = TaskHandle(request_id, waiting=False, converting=True)
        held = bool(request_id) and not (request_id in self._live_tasks or request_id in self._live)
        if held:
            self._live_tasks[request_id] = handle
            self._in_flight_changed.set()
        try:
            yield handle
        except Exception as exc:
            if handle.aborted.is_set():
                if not isinstance(exc, KvplaneError):  # a bug, not a refusal: say so
                    log.error("converting aborted request %r failed", request_id, exc_info=exc)
                raise RequestAbortedError(f"request {request_id!r} was aborted") from exc
            raise
        finally:
            if held and handle.aborted.is_set():
                self.end_task(handle)  # remembered as finished: a second Abort says so
            elif held and self._live_tasks.get(request_id) is handle:
                del self._live_tasks[request_id]
                self._in_flight_changed.set()

    async def convert(
        self,
        request_id: str,
        conversion: Callable[[], Awaitable[EngineRequest]],
        unconverted: Callable[[], EngineRequest],
    ) -> tuple[EngineRequest, bool]:
        """A generation request converted (`conversion()`, then its guide compiled) while its
        id is held (`converting`), and whether an Abort (or a drain's deadline) ended it
        meanwhile: it then never runs, and the caller ends it aborted
        (`aborted_before_prefill`). A conversion that fails after such an Abort ends it so too,
        as `unconverted()`: what is known of it without the conversion
        (`engine.server.openengine_convert.unconverted_request`); so does a converted request
        that acceptance would refuse (the core's checks: more `num_sequences` than
        `max_num_seqs`, say), which ends as no more than the engine takes."""
        try:
            with self.converting(request_id) as held:
                request = await conversion()
                await self.compile_guide(request)
        except RequestAbortedError:
            return unconverted(), True
        if not held.aborted.is_set():
            return request, False
        try:
            self.engine_loop.core.check_request(request)
        except KvplaneError:  # never accepted: as one whose conversion refused it
            return unconverted(), True
        return request, True

    async def run_task(self, handle: TaskHandle, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` on the engine thread between steps (one pooling batch); raises
        RequestAbortedError if the task is aborted first. Aborted or abandoned (the client
        gone, its deadline passed) while the batch waits for the engine thread, the batch
        never runs; one already running finishes, its result dropped."""
        if handle.aborted.is_set():
            raise RequestAbortedError(f"request {handle.request_id!r} was aborted")

        def started(core: EngineCore) -> T:
            handle.waiting = False  # on the engine thread: the task's forward begins now
            return fn(core)

        handle.queued_batch = self.engine_loop.call(started)
        work = asyncio.wrap_future(handle.queued_batch)
        # Abandoned while running: nobody reads the result; retrieving it here keeps asyncio
        # from logging it as lost.
        work.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            return await self.unless_aborted(handle, work)
        except BaseException:  # aborted, or the caller cancelled (CancelledError)
            handle.drop_queued_batch()
            raise

    async def unless_aborted(self, handle: TaskHandle, work: asyncio.Future[T]) -> T:
        """`work`'s result, or RequestAbortedError as soon as Abort (or a drain's deadline)
        stops the task first; `work` is then left to finish unread (cancel it if it can be)."""
        aborted = asyncio.ensure_future(handle.aborted.wait())
        try:
            await asyncio.wait((work, aborted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
        # Cancelled: the abort took a pooling batch out of the engine thread's queue.
        if not work.done() or work.cancelled():
            raise RequestAbortedError(f"request {handle.request_id!r} was aborted")
        return work.result()

    async def probe(self, timeout_s: float) -> str:
        """Generate one greedy token end to end (a pooling-only engine: embed one token),
        ahead of every waiting request (`PROBE_PRIORITY`); returns "" or what went wrong.

        The probe request never outlives this call: timed out, failed, or cancelled with the
        Health RPC that asked for it (its deadline, the client going away), it is cancelled.
        """
        if self._pooler is not None and not self.model.generates:
            return await self._pooling_probe(self._pooler, timeout_s)
        request = EngineRequest(
            request_id=f"{PROBE_ID_PREFIX}{time.monotonic_ns()}",
            prompt_token_ids=(0,),
            sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            bypass_prefix_cache=True,
            priority=PROBE_PRIORITY,
        )
        try:
            stream = self.submit(request, internal=True)
        except Exception as exc:  # the probe reports, it never raises
            return f"probe failed: {exc}"
        try:
            async with asyncio.timeout(timeout_s):
                tokens = await _count_probe_tokens(stream)
        except TimeoutError:
            return f"no token within {timeout_s:.1f}s"
        except Exception as exc:
            return f"probe failed: {exc}"
        finally:  # CancelledError included
            if not stream.done:
                self.cancel_nowait(request.request_id)
        return "" if tokens == 1 else f"probe produced {tokens} tokens, expected 1"

    async def _pooling_probe(self, pooler: Pooler, timeout_s: float) -> str:
        """One forward of one token (token id 0) through the model on the engine thread, as
        an Embed runs: no request id, no seat, nothing counted. A forward already started when
        the deadline passes finishes on the engine thread and its result is dropped (one
        token: milliseconds)."""
        params = PoolingParams(task=PoolingTask.EMBED)
        work = asyncio.wrap_future(self.engine_loop.call(lambda _core: pooler.pool([(0,)], params)))
        work.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            async with asyncio.timeout(timeout_s):
                outputs = await asyncio.shield(work)
        except TimeoutError:
            return f"no pooled output within {timeout_s:.1f}s"
        except Exception as exc:  # the probe reports, it never raises
            return f"probe failed: {exc}"
        if len(outputs) != 1 or outputs[0].shape != (pooler.hidden_size,):
            return f"probe pooled {[o.shape for o in outputs]}, expected one [{pooler.hidden_size}]"
        return ""

    # ---------------------------------------------------------------- drain

    async def drain(
        self, *, stop_accepting: bool, deadline_s: float | None, abort_after_deadline: bool
    ) -> AsyncIterator[DrainProgress]:
        """STARTED, IN_PROGRESS (on every change, and every progress interval), then COMPLETE.

        `deadline_s` None: wait as long as it takes; 0: the deadline is now. After the deadline,
        `abort_after_deadline` cancels what is left (then COMPLETE once the engine's work has
        ended, whether or not every client has read its outputs); without it the drain ends
        with DEADLINE_EXCEEDED (still not accepting).
        """
        if stop_accepting:
            self._stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = None if deadline_s is None else loop.time() + deadline_s
        aborted = False
        abort_failed = ""

        def left() -> tuple[int, int]:
            # Past the aborting deadline, a request whose client stops reading (never
            # cancelling) must not hold the drain: what is left is the engine's work.
            requests = self.num_unended if aborted else self.num_in_flight
            return requests, self.num_open_kv_sessions

        yield DrainProgress(DrainPhase.STARTED, *left())
        last_reported = left()
        while any(left()):
            now = loop.time()
            if deadline is not None and now >= deadline and not aborted:
                if not abort_after_deadline:
                    requests, sessions = left()
                    yield DrainProgress(
                        DrainPhase.DEADLINE_EXCEEDED,
                        requests,
                        sessions,
                        f"deadline passed, requests in flight: {requests}, "
                        f"open KV sessions: {sessions}",
                    )
                    return
                aborted = True
                try:
                    await self.abort_all()
                except AbortFailedError as exc:  # each aborted on its own: every one ends
                    log.warning("drain: %s", exc)
                    abort_failed = f" ({exc})"
                if self.kv_sessions is not None:
                    self.kv_sessions.release_all()
                continue
            wait_s = self._progress_interval_s
            if deadline is not None and not aborted:
                wait_s = min(wait_s, max(deadline - now, 0.0))
            self._in_flight_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._in_flight_changed.wait()
            if left() != last_reported or not self._in_flight_changed.is_set():
                last_reported = left()
                if any(last_reported):
                    yield DrainProgress(DrainPhase.IN_PROGRESS, *last_reported)
        message = ""
        if aborted:
            message = f"aborted the requests and KV sessions left at the deadline{abort_failed}"
        yield DrainProgress(DrainPhase.COMPLETE, 0, 0, message)

    # ---------------------------------------------------------------- shutdown

    async def close(self, grace_s: float) -> None:
        """Stop accepting, give requests (and open KV sessions) `grace_s` to finish, then stop
        the engine thread."""
        self._stop_accepting()
        if self.num_in_flight or self.num_open_kv_sessions:

            async def drained() -> None:
                async for _ in self.drain(
                    stop_accepting=True, deadline_s=grace_s, abort_after_deadline=True
                ):
                    pass

            # Cancelled requests end only once their streams are read; a client that stops
            # reading must not hold the shutdown hostage.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s + _CLOSE_SLACK_S):
                    await drained()
        if self.kv_sessions is not None:
            await self.kv_sessions.close()
        await asyncio.to_thread(self.engine_loop.stop, 10.0)
        self._guide_compiler.shutdown(wait=False, cancel_futures=True)
        self.kv_log.close()
        self.runtime_events.close()


def _unless_superseded(
    before: Callable[[EngineCore], object], lora: LoraSlot, on_skip: Callable[[], object]
) -> Callable[[EngineCore], object]:
    """`before` (a pulled session's import into the prefix cache), skipped (`on_skip()`) if
    `lora` is superseded when it runs: the cache's namespace is the adapter's name, which
    other weights serve now, so KV computed with this slot's must not enter it (as the
    request's own blocks do not, `Sequence.caches_blocks`). Read on the engine thread, which
    loads adapters."""

    def prepare(core: EngineCore) -> object:
        return on_skip() if lora.superseded else before(core)

    return prepare
