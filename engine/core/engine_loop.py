"""EngineLoop: runs `EngineCore.step()` in one dedicated thread, for asyncio servers.

Callers on any thread `submit(request, sink)`: validation happens at once in the caller's thread
(so a server can fail before acceptance), then the request is queued to the engine thread,
which calls `sink(output)` for each output, in order, ending with the one that carries `usage`.
For asyncio consumers use `asyncio_sink(loop, queue)`: it hands each output to
`loop.call_soon_threadsafe(queue.put_nowait, output)`, so the event loop never blocks on a
step (this module itself imports no asyncio: the loop and queue are duck-typed). Commands
(`abort`, `abort_all`, `call`) return `concurrent.futures.Future`s (`asyncio.wrap_future`); a
`call` cancelled while it waits for the engine thread never runs. `abandon` cancels a request
nobody reads any more and frees its id at once (the core's abort of it is still queued): a
request submitted with the id right after is accepted, and the old one's end never reaches it.

Request ids: the engine thread hands each output to the sink of the live request of its id.
1. Live: a request holds its id from `submit` (which refuses an id held, as a duplicate) until
   its end (the output with `usage`) is handed over, or it is abandoned.
2. Abandoned (`abandon`, or its sink failed: the request is aborted): its id is free at once.
   The core's outputs of the id up to that abort (`_AbandonSettled`) reach no one.
3. Stray (`_stray`): a request the core still runs after its abort failed (in `abort`,
   `abandon`, an abort of all's, a failing sink's). Its outputs from the core reach no one,
   and its id, no sink's, is taken until the core ends it (seen at the end of each round of the
   engine thread): `submit` refuses it as a duplicate, a request queued under it ends ERROR;
   an abort of all (`abort_all`, `stop`, a failed step's, the stopped thread's) ends it in the
   core too, on its own if the core's abort of all fails, but `abort_all` does not name it nor
   count it in its error (no client waits on it).
4. Made up (`_Failed`): an ERROR end the loop makes up for a request reaches it if it is still
   live when handed over (else no one), and ends only its outputs not ended yet, its usage
   counting the tokens its sink was handed and each matched stop token left out of them (as
   the core's end counts them). Made up for: a request whose abort fails in the
   core (or that the core forgot, its end never emitted); one whose add fails or whose id is
   stray; after a failed step, every live one the core no longer runs (its end raised in the
   step: forgotten, its end never emitted); every live one when the engine thread dies.

Failure handling: a failing step fails every live request (FinishReason.ERROR), after the
outputs it produced before it failed (the ends of requests it ended; one whose end raised, the
core forgot: made up), and the loop carries on; a failing sink aborts its request; if the
core's abort of every request fails (`abort_all`, `stop`, or a failed step's, whose ends are
ERROR), the ends it emitted before it failed are handed over, and each request it did not end
is aborted on its own (by `abort`'s rule), stray ones too, `abort_all`'s future failing
(AbortFailedError), and the loop carries on; a failing `on_step` observer is logged;
once the thread ends (stopped, or it died), the core's abort of every request that is left
(the same way, each on its own should it fail: live, stray, and abandoned ones, whose queued
abort never runs then) releases what the core holds for them, every live request still gets
a terminal ERROR output, and `submit` refuses from then on.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from engine.core.api import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    ForwardPassStats,
    LoadSnapshot,
    RequestOutput,
    StepReport,
    StepResult,
    StopKind,
    Usage,
)
from engine.core.errors import AbortFailedError, DuplicateRequestError, EngineStoppedError
from engine.core.lora import LoraSlot

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

T = TypeVar("T")

OutputSink = Callable[[RequestOutput], None]

_STRAY = "request {!r} still runs in the engine, its abort failed: its id is taken until it ends"

# After a step that changed nothing, the next waits for a command or this long.
_STALLED_RETRY_S = 0.1


class _CallSoonThreadsafe(Protocol):
    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> object: ...


class _PutNowait(Protocol):
    def put_nowait(self, item: RequestOutput, /) -> None: ...


def asyncio_sink(loop: _CallSoonThreadsafe, queue: _PutNowait) -> OutputSink:
    """A sink that hands each output to an asyncio queue on `loop`, from any thread."""

    def sink(output: RequestOutput) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, output)

    return sink


@dataclass(eq=False)
class _Live:
    """A request the loop holds a sink for, and what that sink was handed so far (its tokens,
    the outputs it saw end): kept by the engine thread alone, which hands outputs over."""

    sink: OutputSink
    request: EngineRequest
    added: bool = False  # by the core (a command queued before its add finds it not there)
    # The tokens the core counted for what its sink was handed: theirs, and each matched stop
    # token the core left out of them (`completion_tokens` counts it, docs/engine.md).
    counted_tokens: int = 0
    ended: set[int] = field(default_factory=set)


def _failed_outputs(live: _Live, message: str) -> list[RequestOutput]:
    """ERROR outputs ending every output of a request the core never finished that has not
    ended yet; the last carries the usage of what its sink was handed (the tokens it got, and
    a matched stop token left out of them, counted as the core's own end counts it)."""
    request = live.request
    last = request.sampling.num_sequences - 1
    left = [i for i in range(last + 1) if i not in live.ended] or [last]  # (its end lost)
    return [
        RequestOutput(
            request_id=request.request_id,
            output_index=index,
            finish_reason=FinishReason.ERROR,
            message=message,
            error=ErrorKind.ENGINE,
            usage=(
                Usage(len(request.prompt_token_ids), live.counted_tokens, 0)
                if index == left[-1]
                else None
            ),
        )
        for index in left
    ]


def _withheld_stop(live: _Live, output: RequestOutput) -> int:
    """1 where `output` ends on a matched stop token (a caller's id or EOS) that the core
    counted but left out of its tokens (neither `include_stop_in_output` nor
    `emit_stop_token`), else 0."""
    match = output.stop_match
    if match is None or match.kind not in (StopKind.EOS, StopKind.STOP_TOKEN):
        return 0
    sampling = live.request.sampling
    return 0 if sampling.include_stop_in_output or sampling.emit_stop_token else 1


class _Failed(NamedTuple):
    """Not an output: `live` ends ERROR here (`_failed_outputs`, made as it is handed over,
    from what its sink had by then) if it is still its id's live request; else no one."""

    live: _Live
    message: str


class _AbandonSettled(NamedTuple):
    """Not an output: where `abandon`'s abort of a request ran, among the outputs the engine
    thread publishes. Every output of the abandoned request comes before it, whether or not
    the core emitted its end; any of a request that took the id since comes after it."""

    request_id: str


# How the core ends a request it aborts (its reason and message): by default, as a client's abort.
_End = tuple[FinishReason, str]
_CANCELLED: _End = (FinishReason.CANCELLED, "aborted")

# What the engine thread publishes: the core's outputs, and the loop's marks among them.
_Item = RequestOutput | _Failed | _AbandonSettled
_Command = Callable[[], list[_Item]]


def _ended(items: list[_Item]) -> set[str]:
    """The ids of the core's outputs among `items`."""
    return {item.request_id for item in items if isinstance(item, RequestOutput)}


class _Submitted(NamedTuple):
    """Sequences of submitted requests, and their prompt tokens (each sequence's own)."""

    seqs: int
    tokens: int


class EngineLoop:
    """Runs `EngineCore.step()` in one dedicated thread; see the module docstring.

    `on_step(report)` runs in the engine thread after every step or command that changed
    something (outputs, KV events or the load), and at the start of every pass (once it is
    scheduled, with the outputs of the commands before it), with the drained KV events and a
    fresh load snapshot: publishers forward them from there (thread-safely). It must not block
    for long.
    """

    def __init__(
        self,
        core: EngineCore,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        thread_name: str = "engine-step",
    ) -> None:
        """`on_exit` is called on the engine thread as it ends (stopped or failed), once
        `running` is false."""
        self.core = core
        self._on_step = on_step
        self._on_exit = on_exit
        self._thread_name = thread_name
        # Reentrant: `submit`'s `admit` reads `num_queued` under it.
        self._cond = threading.Condition(threading.RLock())
        self._commands: deque[_Command] = deque()
        self._sinks: dict[str, _Live] = {}
        # Requests abandoned (`abandon`, a failing sink) whose abort the engine thread has not
        # published yet, by id: their outputs up to it reach no sink, whatever took the id
        # since. Settled by the abort, not by the request's end, which a core that failed
        # as it ended the request never emits.
        self._abandoned: Counter[str] = Counter()
        # Ids of requests the core still ran after its abort of them failed, no sink theirs:
        # the core's outputs of the id reach no sink nor the report, and no request takes
        # the id (refused at `submit`, ERROR if queued already) until the core has let go of
        # it, seen at the end of a round of the engine thread (`_let_go`). Changed on the
        # engine thread only, under `_cond`.
        self._stray: set[str] = set()
        self._stopping = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._load = core.load()
        # Sequences (and their prompt tokens) of every request submitted so far, and how many
        # of them the engine thread had taken in when `_load` was measured (all only grow;
        # guarded by `_cond`).
        self._submitted = _Submitted(0, 0)
        self._submitted_in_load = _Submitted(0, 0)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop already started")
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Cancel every live request (their sinks get CANCELLED outputs) and end the thread."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not (self._stopping or self._stopped)
        )

    def load(self) -> LoadSnapshot:
        """The engine's load now (any thread): measured at the start and at the end of each
        pass and after commands, with the sequences submitted since and not yet taken in by
        the engine thread counted waiting, with their prompts in `waiting_tokens`. So a request
        counts from its acceptance: waiting until the pass that admits it starts, running from
        then until it finishes (`LoadSnapshot`)."""
        with self._cond:
            load, submitted, in_load = self._load, self._submitted, self._submitted_in_load
        if submitted == in_load:
            return load
        return replace(
            load,
            num_waiting=load.num_waiting + submitted.seqs - in_load.seqs,
            waiting_tokens=load.waiting_tokens + submitted.tokens - in_load.tokens,
        )

    def num_live_requests(self) -> int:
        with self._cond:
            return len(self._sinks)

    def num_queued(self) -> int:
        """Sequences accepted and not yet running: waiting in the scheduler (preempted ones
        included), or submitted and not yet taken in (any thread; `load`)."""
        return self.load().num_waiting

    # ---------------------------------------------------------------- any thread

    def submit(
        self,
        request: EngineRequest,
        sink: OutputSink,
        *,
        before: Callable[[EngineCore], object] | None = None,
        admit: Callable[[], object] | None = None,
        lora: LoraSlot | None = None,
    ) -> None:
        """Validate (raising before acceptance) and queue a request; outputs go to `sink`.

        `admit()` runs once the request is valid, before it is queued: admission control,
        which refuses by raising (a malformed request or a duplicate id is refused for itself
        first). It runs under the loop's lock, which it may take again (`num_queued`).
        `before(core)` runs in the engine thread just before the request is added, in the same
        command (nothing is scheduled in between): a DECODE engine imports the request's
        pulled KV blocks there. It only prepares: if it fails, the request runs without it.

        The request's LoRA adapter is acquired last (`EngineCore.acquire_lora`: raising
        LoraNotFoundError if it was unloaded since the check) and held from here to the
        request's end: an unload before the engine thread adds it does not take it away.
        `lora`: the slot the caller acquired already (a request admitted before, `end_pull`);
        the request owns it once this returns, the caller still if it raises."""
        self.core.check_request(request, lora=lora)
        with self._cond:
            if self._stopping or self._stopped:  # (stopped: its thread died)
                raise EngineStoppedError("the engine is stopping")
            if request.request_id in self._sinks:
                raise DuplicateRequestError(f"request {request.request_id!r} is already running")
            if request.request_id in self._stray:
                raise DuplicateRequestError(_STRAY.format(request.request_id))
            if admit is not None:  # under the lock: no other submit between check and queue
                admit()
            if lora is None:
                lora = self.core.acquire_lora(request)  # nothing raises after this
            entry = self._sinks[request.request_id] = _Live(sink, request)
            num_seqs = request.sampling.num_sequences
            self._submitted = _Submitted(
                self._submitted.seqs + num_seqs,
                self._submitted.tokens + num_seqs * len(request.prompt_token_ids),
            )

            def add() -> list[_Item]:
                with self._cond:
                    stray = request.request_id in self._stray
                if stray:  # queued before its id's request ran on in the core
                    if lora is not None:
                        try:
                            self.core.release_lora(lora)
                        except Exception:  # (its weights freed by the runner): it ends all
                            # the same, or its client would wait for ever (as the core's end)
                            logger.exception("freeing LoRA slot %s failed", lora.key)
                    return [_Failed(entry, _STRAY.format(request.request_id))]
                if before is not None:
                    try:
                        before(self.core)
                    except Exception:
                        logger.exception("preparing request %s failed", request.request_id)
                try:
                    self.core.add_request(request, lora=lora)
                except Exception as exc:  # cannot happen after check_request; never hang
                    logger.exception("could not add request %s", request.request_id)
                    return [_Failed(entry, str(exc))]
                entry.added = True
                return []

            self._commands.append(add)
            self._cond.notify()

    def abort(self, request_id: str) -> Future[bool]:
        """Cancel a request; the future says whether it was still running. One whose abort
        fails in the core (which may have forgotten it, its end never emitted) ends ERROR; one
        submitted after the abort, whose add comes after it, is left alone as when it works."""
        future: Future[bool] = Future()

        def command() -> list[_Item]:
            try:
                outputs = self.core.abort(request_id)
            except Exception as exc:
                logger.exception("aborting request %s failed", request_id)
                self._keep_off(request_id)
                with self._cond:
                    live = self._sinks.get(request_id)
                if live is None or not live.added:  # (not in the core yet: not aborted)
                    future.set_result(False)
                    return []
                future.set_result(True)
                return [_Failed(live, f"aborting the request failed: {exc}")]
            future.set_result(bool(outputs))
            return [*outputs]

        self._enqueue(command, future)
        return future

    def abandon(self, request_id: str) -> None:
        """Cancel a request nobody reads any more (its client went away, or its acceptance
        failed after `submit` took it), and free its id at once: a request submitted with the
        id from now on is accepted, and the abandoned one's last outputs (its CANCELLED end,
        once the engine thread aborts it) reach no sink, the new request's included. The abort
        is queued ahead of anything submitted after this, so the core has ended the old
        request before it takes the new one; the new one's outputs reach it even if that abort
        fails and the old one's end never comes (`_AbandonSettled`). A request that ended
        already is left alone."""
        with self._cond:
            if self._sinks.pop(request_id, None) is None:
                return
            self._abandoned[request_id] += 1

            def command() -> list[_Item]:
                # (One whose abort fails, ended or not, its end may never come: settled all
                # the same.)
                return [*self._abort_one(request_id), _AbandonSettled(request_id)]

            self._commands.append(command)  # ahead of any request submitted from now on
            self._cond.notify()

    def _keep_off(self, request_id: str) -> None:
        """After the core's abort of `request_id` failed (engine thread): if the core still
        runs the request, its outputs from now on reach no sink, and its id takes no request
        until the core lets go of it (`_stray`)."""
        if self.core.holds(request_id):
            with self._cond:
                self._stray.add(request_id)

    def _let_go(self) -> None:
        """Free the ids of stray requests the core no longer runs (engine thread, at the end
        of a round: every output of theirs was published)."""
        if not self._stray:
            return
        gone = {request_id for request_id in self._stray if not self.core.holds(request_id)}
        with self._cond:
            self._stray -= gone

    def _settle_abandoned(self, request_id: str) -> None:
        """One abandoned request of `request_id` is over; under `_cond`."""
        self._abandoned[request_id] -= 1
        if not self._abandoned[request_id]:
            del self._abandoned[request_id]

    def abort_all(self) -> Future[list[str]]:
        """Cancel every request submitted so far; the future lists those still running (the
        requests clients wait on: not a stray one, which the core ends too). Should the core's
        abort of them all fail, each is aborted on its own, a stray one too (`abort`'s rules:
        one whose abort fails too, or that the core forgot, its end never emitted, ends
        ERROR), and the future fails with AbortFailedError."""
        future: Future[list[str]] = Future()

        def command() -> list[_Item]:
            with self._cond:  # (ids of requests no client waits on, whose ends reach no one)
                stray = set(self._stray)
            items, error = self._abort_all(taken_in, stray)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(sorted(_ended(items).intersection(taken_in) - stray))
            return items

        with self._cond:  # the requests the core has taken in when the command runs
            taken_in = dict(self._sinks)
            self._enqueue(command, future)
        return future

    def _abort_all(
        self, requests: dict[str, _Live], stray: set[str], failure: str | None = None
    ) -> tuple[list[_Item], Exception | None]:
        """The core's abort of every request (engine thread): CANCELLED, or ERROR with
        `failure` (a failed step's). Should it fail, the ends it emitted before it failed
        come first, then each request it did not end is aborted on its own (`_abort_each`:
        `requests`, the ones clients wait on, and `stray` ones, the core's of ids no client
        waits on), and the error says so, counting `requests` alone. One made up ends with
        `failure`, or says that the abort of every request failed."""
        end = _CANCELLED if failure is None else (FinishReason.ERROR, failure)
        try:
            return [*self.core.abort_all(*end)], None
        except Exception as exc:
            logger.exception("aborting every request failed; aborting them one by one")
            made_up = failure or f"aborting every request failed: {exc}"
            ended_first = self.core.take_failed_outputs()
            over = {output.request_id for output in ended_first if output.usage is not None}
            left = {rid: live for rid, live in requests.items() if rid not in over}
            items = [*ended_first, *self._abort_each(left, stray - over, end, made_up)]
        ended = _ended(items) - stray
        failed = {i.live.request.request_id for i in items if isinstance(i, _Failed)}
        return items, AbortFailedError(
            "aborting every request failed in the engine; each was aborted on its own: "
            f"{len(failed)} of {len(ended | failed)} ended with an error"
        )

    def _abort_every_request(self) -> list[_Item]:
        """`_abort_all` of every request (engine thread): the live ones and the stray ones
        as they are now; its error (logged) dropped."""
        with self._cond:
            live, stray = dict(self._sinks), set(self._stray)
        return self._abort_all(live, stray)[0]

    def _abort_each(
        self,
        requests: dict[str, _Live],
        stray: set[str],
        end: _End,
        made_up: str,
    ) -> list[_Item]:
        """Abort in the core, on the engine thread, each of `requests` still live (not ended,
        abandoned or replaced since), ending it as `end` says; one whose abort fails, or that
        the core no longer holds (it ended it without emitting the end), ends ERROR with
        `made_up`. Then each `stray` one (its outputs reach no one), which the core would
        otherwise run on, holding its blocks and LoRA slot."""
        items: list[_Item] = []
        for request_id, entry in requests.items():
            with self._cond:
                if self._sinks.get(request_id) is not entry:
                    continue
            items.extend(self._abort_one(request_id, end) or [_Failed(entry, made_up)])
        for request_id in stray:
            items.extend(self._abort_one(request_id, end))
        return items

    def _abort_one(self, request_id: str, end: _End = _CANCELLED) -> list[RequestOutput]:
        """The core's abort of `request_id` (engine thread), its outputs; [] where it fails
        (logged; the request kept off if the core runs it on, `_keep_off`)."""
        try:
            return self.core.abort(request_id, *end)
        except Exception:
            logger.exception("aborting request %s failed", request_id)
            self._keep_off(request_id)
            return []

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run `fn(core)` in the engine thread between steps (snapshots, cache resets).

        As an executor's: cancelling the future before `fn` begins (`Future.cancel`, or the
        asyncio future `asyncio.wrap_future` made of it) drops it from the queue, so it never
        runs; once begun it cannot be cancelled and runs to its end."""
        future: Future[T] = Future()

        def command() -> list[_Item]:
            if not future.set_running_or_notify_cancel():
                return []  # cancelled while queued
            try:
                result = fn(self.core)
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            return []

        self._enqueue(command, future)
        return future

    def _enqueue(self, command: _Command, future: Future[Any]) -> None:
        with self._cond:
            if self._stopped:
                future.set_exception(EngineStoppedError("the engine has stopped"))
                return
            self._commands.append(command)
            self._cond.notify()

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        stalled = False
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not self.core.has_work():
                        self._cond.wait()
                    if stalled and not self._commands and not self._stopping:
                        # The last step changed nothing (its sequences wait for blocks that KV
                        # sessions hold): the next one would not either until a command comes
                        # (a release), or time passes (aging reorders the queue).
                        self._cond.wait(_STALLED_RETRY_S)
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                    # Every request submitted so far is among `commands`: the load measured
                    # after them counts its sequences.
                    submitted = self._submitted
                items: list[_Item] = []
                for command in commands:
                    items.extend(self._run_command(command))
                if stopping:  # (every request: none is submitted from now on)
                    items.extend(self._abort_every_request())
                    self._publish(items, submitted)
                    return
                stepped = self.core.has_work()
                result = self._step(items, submitted) if stepped else StepResult([], None)
                changed = self._publish(items, submitted, result.stats, result.num_preempted)
                stalled = not changed and stepped
                self._let_go()
        except Exception:
            logger.exception("the engine thread failed; failing every live request")
        finally:
            with self._cond:
                self._stopped = True
                pending = list(self._commands)
                self._commands.clear()
            for command in pending:  # resolve futures of commands that raced the stop
                self._run_command(command)
            try:  # a failed thread's requests (or ones added as it stopped) release what the
                # core holds for them: blocks, LoRA slots, pulled KV; each on its own should
                # the core's abort of them all fail: every id the core may hold, a live
                # request's (its sink hears below, not from the abort), a stray one's, and
                # an abandoned one's (its abort, queued once the last commands ran, never runs)
                with self._cond:
                    held = {*self._sinks, *self._stray, *self._abandoned}
                self._abort_all({}, held, "the engine stopped")
            except Exception:
                logger.exception("releasing the requests of the stopped engine failed")
            with self._cond:  # whatever is still live ends now, so no consumer waits forever
                orphans = list(self._sinks.values())
                self._sinks.clear()
            for live in orphans:
                for output in _failed_outputs(live, "the engine stopped"):
                    try:
                        live.sink(output)
                    except Exception:
                        logger.warning("output sink of %s failed", live.request.request_id)
            if self._on_exit is not None:
                self._on_exit()

    def _run_command(self, command: _Command) -> list[_Item]:
        try:
            return command()
        except Exception as exc:  # a request that failed validation late, e.g. a duplicate
            logger.warning("engine command failed: %s", exc)
            return []

    def _step(self, items: list[_Item], submitted: _Submitted) -> StepResult:
        """One pass, its outputs appended to `items` (the commands' before them): their
        start is published at the pass's (and `items` cleared), so the load says what runs
        during the pass (`EngineCore.step`). Returns the pass's stats (no outputs)."""

        def on_pass_start() -> None:
            self._publish(list(items), submitted)
            items.clear()

        try:
            result = self.core.step(on_pass_start)
        except Exception:
            logger.exception("engine step failed; failing every running request")
            # What it produced before it failed first: the ends of requests it ended included.
            items.extend(self.core.take_failed_outputs())
            with self._cond:  # (a request queued and not added yet is not in the core)
                taken_in = {rid: live for rid, live in self._sinks.items() if live.added}
                stray = set(self._stray)
            aborted, abort_failed = self._abort_all(taken_in, stray, "engine step failed")
            items.extend(aborted)
            if abort_failed is None:
                # A request whose end raised in the step is gone from the core, its end never
                # emitted (and not the abort's): made up (as `_abort_each` makes it up where
                # the abort of all failed). Stale at hand-over for one whose end is in `items`.
                items.extend(
                    _Failed(live, "engine step failed")
                    for request_id, live in taken_in.items()
                    if not self.core.holds(request_id)
                )
            return StepResult([], None)
        items.extend(result.outputs)
        return StepResult([], result.stats, result.num_preempted)

    def _publish(
        self,
        items: list[_Item],
        submitted: _Submitted,
        stats: ForwardPassStats | None = None,
        num_preempted: int = 0,
    ) -> bool:
        """Hand `items` over in order, by the id rules (the module docstring), and report them
        (`on_step`). `submitted`: the submitted sequences the engine thread has taken in.
        Returns whether anything changed (outputs, a pass, KV events or the load)."""
        load = self.core.load()
        with self._cond:
            previous, self._load = self._load, load
            self._submitted_in_load = submitted
        reported: list[RequestOutput] = []  # (an abandoned request's outputs too)
        failed: list[str] = []  # requests whose sink failed, dropped as abandoned ones
        for item in items:
            if isinstance(item, _AbandonSettled):
                with self._cond:  # the id's next outputs are a newer request's
                    if item.request_id in self._abandoned:  # (else abandoned as it stopped)
                        self._settle_abandoned(item.request_id)
                continue
            if isinstance(item, _Failed):
                with self._cond:  # an end made up for a request ended or dropped since: stale
                    current = self._sinks.get(item.live.request.request_id) is item.live
                outputs = _failed_outputs(item.live, item.message) if current else []
            elif item.request_id in self._stray:  # the core's, of a request no one's
                continue
            else:
                outputs = [item]
            for output in outputs:
                reported.append(output)
                with self._cond:
                    if output.request_id in self._abandoned:
                        continue
                    live = self._sinks.get(output.request_id)
                    if live is not None and output.usage is not None:
                        del self._sinks[output.request_id]
                if live is not None:
                    self._hand_over(live, output, failed)
        # Aborted once every output of this result is handed over: the core has not taken a
        # request of those ids since (commands run on this thread only).
        dropped: list[RequestOutput] = []
        for request_id in failed:  # (one whose abort fails, its end may never come: settled)
            dropped.extend(self._abort_one(request_id))
            with self._cond:
                self._settle_abandoned(request_id)
        if dropped:  # its blocks are free now: the load measured above still holds them
            with self._cond:
                self._load = self.core.load()
        result = StepResult([*reported, *dropped], stats, num_preempted)
        events = self.core.take_kv_events()
        # A command may change the load alone (releasing a KV session frees blocks).
        changed = bool(
            result.outputs
            or result.stats
            or result.num_preempted
            or events
            or self._load != previous
        )
        if self._on_step is not None and changed:
            try:
                self._on_step(StepReport(result, events, self._load))
            except Exception:  # a broken observer must not take the engine thread down
                logger.exception("on_step observer failed")
        return changed

    def _hand_over(self, live: _Live, output: RequestOutput, failed: list[str]) -> None:
        """`output` to `live`'s sink; a sink that fails drops its request (as abandoned) into
        `failed`, to abort once the result is handed over."""
        live.counted_tokens += len(output.new_token_ids) + _withheld_stop(live, output)
        if output.finished:
            live.ended.add(output.output_index)
        try:
            live.sink(output)
        except Exception:  # e.g. the consumer's event loop is closed: drop the request
            logger.warning("output sink of %s failed; aborting it", output.request_id)
            with self._cond:
                # Unless it was abandoned (its abort queued) or ended while its sink ran, when
                # the id may be another request's by now: dropped as abandoned, so its outputs
                # left in this result and the end of its abort reach no sink, a request that
                # takes the id once it is free included.
                if self._sinks.get(output.request_id) is live:
                    del self._sinks[output.request_id]
                    self._abandoned[output.request_id] += 1
                    failed.append(output.request_id)
