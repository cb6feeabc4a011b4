"""EngineLoop's request ids against a naive model, under any order of submit, abandon (the
client gone), abort (the RPC), abort_all (which may fail in the core), an abort of one request
that fails in the core (at once, or partway through ending it), a sink that fails once,
a failing forward pass (as it runs, or before it starts: as its batch is built; the core's
abort of all after it may fail too), a request's end in a step that fails partway and the
engine thread held or let run, over three ids reused all the time (hypothesis stateful).

The model is each request's own outputs: the sim runner's tokens are a function of the prompt's
last token, so every request (a prompt of its own) knows the tokens it may get. Sinks may also
act on their k-th output (submit, abandon or abort an id, or leave and retry under their own,
from the engine thread, before the output is theirs and before they fail), which puts those
calls at the exact points of the engine thread's hand-over that other threads only hit by
chance. Once everything has settled:

- every request neither abandoned nor dropped with its failing sink got exactly one end (the
  output with `usage`), as its last output, with each of its outputs finished once, its
  prompt's usage and as many tokens as it got, and only tokens of its own (each output's a
  prefix of its expected sequence, at most `max_tokens`);
- an abandoned request got nothing after its abandon (but for the one output the engine
  thread was handing over to it as another thread abandoned it), a dropped one nothing after
  its sink failed;
- the loop holds no sink and no abandoned id, and accepts a new request under every id, which
  gets its own outputs to its end;
- every output reported (`on_step`) is a plain RequestOutput;
- the engine thread still runs (no failure, a failed step's included, stops it);
- right after an abort of all, the core runs no request on (a stray one included) but one
  whose own abort failed at once meanwhile, or one abandoned whose abort is queued still;
- while the engine thread is held (nothing runs on it), and in a sink (on it), an id is free
  exactly when the model says so (its request abandoned, ended or dropped): submit accepts it
  or refuses a duplicate.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from engine.core.api import (
    EngineRequest,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
    StepReport,
)
from engine.core.engine_core import EngineCore, EngineLoop
from engine.core.engine_loop import OutputSink
from engine.core.errors import AbortFailedError, DuplicateRequestError
from tests.engine.test_engine_loop import (
    AbortAllFails,
    AbortFailsKeeping,
    AbortFailsPartway,
    AllFails,
    BatchFailsInAStep,
    EndFailsInAStep,
    FlakyRunner,
)

IDS = ("a", "b", "c")


class FailingAborts(
    AbortAllFails, AbortFailsKeeping, AbortFailsPartway, EndFailsInAStep, BatchFailsInAStep
):
    """A core whose abort of every request fails as `armed` says (cancelling them) or as
    `error_armed` says (a failed step's), each failure as its own `AllFails` says (at once,
    partway, or after it ended them all), whose abort of one request fails as
    `abort_armed` says, before it did anything (the request runs on), or as `partway_armed`
    says, partway (it forgets the request, its end never emitted), whose end of an output
    in a step fails partway as `end_armed` says (the step fails, the request forgotten), and
    whose step fails as it builds the pass's batch as `batch_armed` says."""


WAIT_S = 10.0

# An action a sink runs on one of its outputs: ("submit", id, max_tokens, sequences),
# ("abandon", id), ("abort", id), or ("retry", _, max_tokens, sequences): its own request
# abandoned (its client gone) and another submitted under its id (the client's retry).
Action = tuple[str, str, int, int]

actions = st.tuples(
    st.sampled_from(["retry", "retry", "submit", "abandon", "abort"]),  # a retry more often
    st.sampled_from(IDS),
    st.integers(1, 5),
    st.integers(1, 2),
)


@dataclass
class Req:
    """One submitted request and what its sink got."""

    serial: int
    request: EngineRequest
    expected: tuple[tuple[int, ...], ...]  # per output index, its tokens to max_tokens
    at: int | None = None  # on this output (0-based) its sink runs `acts`, then maybe fails
    acts: list[Action] = field(default_factory=list)
    fails: bool = False  # raising (once, at `at`)
    outputs: list[RequestOutput] = field(default_factory=list)
    calls: int = 0  # sink calls, the failing one included
    abandoned: bool = False
    late: int = 0  # outputs got after it was abandoned
    failed: bool = False
    ended: bool = False  # its sink was called with its end (the loop let go of its id then)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def holds_id(self) -> bool:
        """Whether the loop must refuse its id (once nothing runs on the engine thread)."""
        return not (self.ended or self.failed or self.abandoned)


class EngineLoopIds(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runner = FlakyRunner(block_size=4, num_blocks=16, time_scale=0.0)
        config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8)
        self.core = FailingAborts(self.runner, config)
        self.core.abort_armed.acquire()  # its abort of one only as `fail_an_abort` arms it
        self.engine = EngineLoop(self.core, on_step=self._on_step)
        self.engine.start()
        # Guards the model; taken before the loop's lock (never held while waiting for the
        # engine thread), by the test thread and by sinks on the engine thread.
        self.lock = threading.RLock()
        self.reqs: list[Req] = []
        self.serials = itertools.count()
        self.holder: dict[str, Req] = {}  # the last request accepted under each id
        self.go_on: threading.Event | None = None  # the engine thread is held until set
        self.held: Future[None] | None = None
        self.futures: list[Future[Any]] = []
        self.abort_all_failures = 0  # how many of the core's aborts of all were armed to fail
        # Per abort of all: the core's failed aborts of one request just before it, and just
        # after it (the same, and the ids the core still runs that no queued abandon aborts).
        self.aborts_of_all: list[tuple[Future[int], Future[tuple[int, set[str]]]]] = []
        self.violations: list[str] = []

    # ------------------------------------------------------------------ the model's requests

    def _new_req(self, request_id: str, max_tokens: int, num_seqs: int) -> Req:
        serial = next(self.serials)
        # A prompt of its own (its last token decides every token the sim gives it).
        prompt = (1000 + serial,) * (1 + serial % 5)
        sampling = SamplingParams(max_tokens=max_tokens, num_sequences=num_seqs)
        expected = tuple(
            tuple(self.runner.next_tokens(prompt[-1], 0, index, max_tokens))
            for index in range(num_seqs)
        )
        return Req(serial, EngineRequest(request_id, prompt, sampling), expected)

    def _on_step(self, report: StepReport) -> None:
        """The report (metrics, publishers) holds the engine's outputs as they are: no mark
        of the loop's, no output type of its own."""
        for output in report.result.outputs:
            self._expect(type(output) is RequestOutput, f"reported {output!r}")

    def _expect(self, holds: bool, what: str) -> None:
        """A check that may run on the engine thread (inside a sink, where an AssertionError
        would count as the sink's failure): reported by `_check`."""
        if not holds:
            self.violations.append(what)

    def _submit(self, req: Req) -> bool:
        """Submit `req` (under `lock`); whether the loop accepted it."""
        with self.lock:
            previous = self.holder.get(req.request_id)
            # Nothing runs on the engine thread while it is held, and a sink runs on it: the
            # loop's ids are the model's there. Elsewhere, a request's end may be on its way
            # (its sink taken, not called yet), and a failed sink's request not dropped yet.
            exact = self.go_on is not None or threading.current_thread().name == "engine-step"
            free = previous is None or previous.ended or previous.abandoned
            must_accept = free or (previous is not None and previous.failed and exact)
            try:
                self.engine.submit(req.request, self._sink(req))
            except DuplicateRequestError:
                with self.engine._cond:  # (a request the core ran on after its abort failed)
                    stray = req.request_id in self.engine._stray
                self._expect(not must_accept or stray, f"{req.request_id!r} refused though free")
                return False
            self._expect(
                previous is None or not previous.holds_id or not exact,
                f"{req.request_id!r} accepted twice",
            )
            self.reqs.append(req)
            self.holder[req.request_id] = req
            return True

    def _abandon(self, request_id: str) -> None:
        """Abandon `request_id`; the model's request too if the loop held its sink."""
        engine = self.engine
        with self.lock, engine._cond:  # (reentrant: `abandon` takes it again)
            live = engine._sinks.get(request_id)
            engine.abandon(request_id)
            req = self.holder.get(request_id)
            if live is not None:
                assert req is not None and live.request is req.request
                req.abandoned = True

    def _sink(self, req: Req) -> OutputSink:
        def sink(output: RequestOutput) -> None:
            with self.lock:
                call = req.calls
                req.calls += 1
                name = f"{req.request_id} #{req.serial}"
                if req.abandoned:
                    # Only the output the engine thread was handing over as another thread
                    # abandoned it (taken before, handed after): one, never its end.
                    req.late += 1
                    self._expect(
                        req.late == 1 and output.usage is None, f"{name} got {output} abandoned"
                    )
                self._expect(not req.failed, f"{name} got {output} once dropped")
                req.ended = req.ended or output.usage is not None
                if call == req.at:
                    for action in req.acts:
                        self._act(req, action)
                if call == req.at and req.fails:
                    req.failed = True
                    raise RuntimeError("Event loop is closed")
                req.outputs.append(output)

        return sink

    def _act(self, req: Req, action: Action) -> None:
        verb, request_id, max_tokens, num_seqs = action
        if verb == "retry":
            self._abandon(req.request_id)
            self._submit(self._new_req(req.request_id, max_tokens, num_seqs))
        elif verb == "submit":
            self._submit(self._new_req(request_id, max_tokens, num_seqs))
        elif verb == "abandon":
            self._abandon(request_id)
        else:
            self.futures.append(self.engine.abort(request_id))

    # ------------------------------------------------------------------ rules

    @rule(
        request_id=st.sampled_from(IDS),
        max_tokens=st.integers(1, 5),
        num_seqs=st.integers(1, 2),
        at=st.none() | st.integers(0, 2),
        acts=st.lists(actions, max_size=2),
        fails=st.booleans(),
    )
    def submit(
        self,
        *,
        request_id: str,
        max_tokens: int,
        num_seqs: int,
        at: int | None,
        acts: list[Action],
        fails: bool,
    ) -> None:
        req = self._new_req(request_id, max_tokens, num_seqs)
        req.at, req.acts, req.fails = at, acts, fails
        self._submit(req)

    @rule(request_id=st.sampled_from(IDS))
    def abandon(self, request_id: str) -> None:
        self._abandon(request_id)

    @rule(
        request_id=st.none() | st.sampled_from(IDS),
        core_fails=st.booleans(),
        fails=st.sampled_from(AllFails),
    )
    def abort(self, request_id: str | None, core_fails: bool, fails: AllFails) -> None:
        """Abort (the RPC) of an id, or of all (None): then the core's abort of them all may
        fail (`fails`: before it did anything; partway, the ends of the requests it ended
        handed over, the one it was ending forgotten; or after it ended them all, their ends
        never emitted), when each request it did not end is aborted on its own."""
        if request_id is None:
            if core_fails:
                self.abort_all_failures += 1
                self.core.armed.append(fails)
            engine = self.engine
            with engine._cond:  # one batch of the engine thread: nothing runs between them
                before = engine.call(lambda _core: self.core.abort_failures)
                self.futures.append(engine.abort_all())
                after = engine.call(self._running_on)
            self.aborts_of_all.append((before, after))
        else:
            self.futures.append(self.engine.abort(request_id))

    @rule()
    def fail_an_abort(self) -> None:
        """The core's next abort of one request (abandon, abort, a failing sink's, one of an
        abort of all) fails before it did anything: the request runs on in the core, its
        outputs reaching no one, its id taken till it ends."""
        self.core.abort_armed.release()

    @rule()
    def fail_an_abort_partway(self) -> None:
        """The core's next abort of one request fails partway, as it frees the blocks of an
        output it marked finished: the core forgets the request, its end never emitted (the
        loop makes one up for its client, if any), and its id is free."""
        self.core.partway_armed.release()

    @rule()
    def fail_an_end(self) -> None:
        """The core's next end of an output in a step (its last token) fails partway: the
        step fails, the core forgets the request, its end never emitted (the loop makes one
        up for its client, ERROR), and its id is free."""
        self.core.end_armed.release()

    @rule(
        before_it_starts=st.booleans(),
        abort_all_fails=st.booleans(),
        fails=st.sampled_from(AllFails),
    )
    def fail_a_pass(self, before_it_starts: bool, abort_all_fails: bool, fails: AllFails) -> None:
        """The next forward pass fails, as it runs or before it starts (as the core builds its
        batch, the commands' outputs before it not published yet): every request it computes
        ends ERROR (those it ended before failing with their own end). The core's abort of all
        after a failed step may fail too, as `fails` says (as an abort's), when each request
        it did not end is aborted on its own; the engine thread carries on."""
        if before_it_starts:
            self.core.batch_armed.release()
        else:
            self.runner.armed = True
        if abort_all_fails:
            self.core.error_armed.append(fails)

    def _running_on(self, core: EngineCore) -> tuple[int, set[str]]:
        """The core's failed aborts of one request so far, and the ids it runs that no
        abandon queued aborts (engine thread)."""
        with self.engine._cond:
            abandoned = set(self.engine._abandoned)
        return self.core.abort_failures, {i for i in IDS if core.holds(i)} - abandoned

    @rule()
    def hold_or_release(self) -> None:
        """The engine thread busy in one command (what comes meanwhile waits for it), or let
        go on."""
        if self.go_on is not None:
            self._release()
            return
        in_command, go_on = threading.Event(), threading.Event()

        def long_command(_core: EngineCore) -> None:
            in_command.set()
            go_on.wait(WAIT_S)

        self.held = self.engine.call(long_command)
        assert in_command.wait(WAIT_S)
        self.go_on = go_on

    @rule()
    def settle(self) -> None:
        self._settle()
        self._check()

    def _release(self) -> None:
        if self.go_on is not None:
            self.go_on.set()
            assert self.held is not None
            self.held.result(WAIT_S)
            self.go_on = self.held = None

    def _settle(self) -> None:
        """Until nothing runs or waits: the core idle, no command queued, and a round of the
        engine thread that called no sink (so no sink queued anything since)."""
        self._release()
        engine = self.engine
        for _ in range(500):
            with self.lock:
                calls = sum(r.calls for r in self.reqs)
            first = engine.call(lambda core: core.has_work()).result(WAIT_S)
            busy, queued = engine.call(
                lambda core: (core.has_work(), len(engine._commands))
            ).result(WAIT_S)
            with self.lock:
                quiet = calls == sum(r.calls for r in self.reqs)
            if quiet and not (first or busy or queued):
                break
        else:
            raise AssertionError("the engine never settled")
        failed = 0  # every abort answered; those of all whose core failed with AbortFailedError
        for future in self.futures:
            if future.exception(WAIT_S) is not None:
                assert isinstance(future.exception(), AbortFailedError), future.exception()
                failed += 1
        assert failed == self.abort_all_failures == self.core.failures
        for before, after in self.aborts_of_all:
            failures, running_on = after.result(WAIT_S)
            if failures == before.result(WAIT_S):  # (no abort of one failed, keeping it)
                assert not running_on, f"the core runs {running_on} on after an abort of all"
        self.aborts_of_all.clear()

    def _check(self) -> None:
        engine = self.engine
        assert self.engine.running, "the engine thread stopped"
        with self.lock:
            assert not self.violations, self.violations
            for req in self.reqs:
                _check_own_outputs(req)
                if not (req.abandoned or req.failed):
                    assert req.ended, f"{req.request_id} #{req.serial} never ended"
                    _check_complete(req)
            with engine._cond:
                assert not engine._sinks, f"sinks left: {sorted(engine._sinks)}"
                assert not engine._abandoned, f"abandoned left: {engine._abandoned}"

    def teardown(self) -> None:
        try:
            self._settle()
            self._check()
            for request_id in IDS:  # every id takes a new request, which runs to its end
                req = self._new_req(request_id, 2, 2)
                assert self._submit(req)
            self._settle()
            self._check()
        finally:
            if self.go_on is not None:
                self.go_on.set()
            self.engine.stop(WAIT_S)


def _check_own_outputs(req: Req) -> None:
    """Every output `req`'s sink got is its own: its tokens, in order, the end last."""
    name = f"{req.request_id} #{req.serial}"
    got: dict[int, tuple[int, ...]] = {}
    for position, output in enumerate(req.outputs):
        assert output.request_id == req.request_id
        index = output.output_index
        assert 0 <= index < len(req.expected), f"{name}: output index {index}"
        tokens = got.get(index, ()) + output.new_token_ids
        assert tokens == req.expected[index][: len(tokens)], f"{name}: tokens not its own"
        got[index] = tokens
        if output.usage is not None:
            assert position == len(req.outputs) - 1, f"{name}: outputs after its end"
            assert output.usage.prompt_tokens == len(req.request.prompt_token_ids), name
            assert output.usage.completion_tokens == sum(map(len, got.values())), name


def _check_complete(req: Req) -> None:
    name = f"{req.request_id} #{req.serial}"
    finished = sorted(o.output_index for o in req.outputs if o.finished)
    assert finished == list(range(len(req.expected))), f"{name}: finished {finished}"
    ends = [o for o in req.outputs if o.usage is not None]
    assert len(ends) == 1, f"{name}: {len(ends)} ends"


EngineLoopIds.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineLoopIds = EngineLoopIds.TestCase
