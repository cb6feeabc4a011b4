"""Scheduler: chunked prefill under a token budget, max_num_seqs, priorities, preemption by
recompute with resumption, no starvation, abort. Driven through EngineCore + the sim runner."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.core.api import (
    BlockRemoved,
    BlockStored,
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.block_manager import BlockManager
from engine.core.engine_core import EngineCore
from engine.core.errors import PromptTooLongError
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.sim_runner import SimRunner, VirtualClock


def make_core(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    budget: int = 16,
    max_num_seqs: int = 8,
    aging_s: float | None = None,
    clock: VirtualClock | None = None,
) -> EngineCore:
    clock = clock or VirtualClock()
    runner = SimRunner(
        block_size=block_size,
        num_blocks=num_blocks,
        vocab_size=1000,
        max_model_len=512,
        clock=clock,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, aging_s=aging_s
    )
    return EngineCore(runner, config, clock=clock)


def request(
    request_id: str,
    num_prompt: int,
    max_tokens: int,
    *,
    priority: int = 0,
    base: int = 0,
    kv_session_id: str | None = None,
) -> EngineRequest:
    prompt = tuple(base + 10 + (i * 7) % 500 for i in range(num_prompt))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(
        request_id, prompt, sampling, priority=priority, kv_session_id=kv_session_id
    )


def follow_kv_events(core: EngineCore, live: set[int]) -> None:
    """Apply the core's new KV events to `live` (the keys an index following them holds): a
    block is stored under a parent the index still holds, and the result is the core's cache."""
    for event in core.take_kv_events():
        if isinstance(event, BlockStored):
            assert event.parent_key is None or event.parent_key in live, "parent not cached"
            live.update(event.block_keys)
        elif isinstance(event, BlockRemoved):
            assert live.issuperset(event.block_keys)
            live.difference_update(event.block_keys)
        else:
            live.clear()
    assert live == core.block_manager.cached_keys()


def run_to_end(
    core: EngineCore, hold_steps: int = 0, max_steps: int = 10_000
) -> dict[str, list[RequestOutput]]:
    """Step until nothing is left, releasing each KV session (named as its request)
    `hold_steps` steps after its request ended; the KV events are followed at every step."""
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    held: dict[str, int] = {}  # session id -> the step it was held at
    core.take_kv_events()  # followed from here: from the cache as it is now
    live = core.block_manager.cached_keys()
    for step in range(max_steps):
        for session_id, since in list(held.items()):
            if step - since >= hold_steps:
                assert core.release_kv_session(session_id)
                del held[session_id]
        if not core.has_work() and not held:
            return outputs
        for out in core.step().outputs:
            outputs[out.request_id].append(out)
            if out.held_kv_session:
                held[out.request_id] = step
        follow_kv_events(core, live)
    raise AssertionError("the engine did not finish")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = make_core(budget=16)
    core.add_request(request("long", 50, 3))
    core.add_request(request("short", 5, 3, base=1))
    scheduled: list[int] = []
    while core.has_work():
        stats = core.step().stats
        assert stats is not None
        assert stats.num_scheduled_tokens <= 16
        scheduled.append(stats.num_scheduled_tokens)
    # 50 prompt tokens in chunks of 16 (the short prompt fills the rest of a step), then decode.
    assert sum(scheduled) == 50 + 5 + 2 * 2
    assert scheduled[:3] == [16, 16, 16]


def test_max_num_seqs_caps_the_running_set() -> None:
    core = make_core(max_num_seqs=2, budget=64)
    for i in range(5):
        core.add_request(request(f"r{i}", 6, 4, base=i * 50))
    while core.has_work():
        core.step()
        load = core.load()
        assert load.num_running <= 2
    assert core.load().num_used_blocks == 0


def test_priority_larger_first_and_fcfs_within_a_level() -> None:
    bm = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, aging_s=None), bm)
    order: list[str] = []
    for arrival, (name, prio) in enumerate([("a", 0), ("b", 5), ("c", 1), ("d", 5)]):
        seq = Sequence(arrival, request(name, 4, 1, priority=prio), 0, arrival, 0.0)
        scheduler.add(seq)
    while scheduler.has_work():
        out = scheduler.schedule(now_s=0.0)
        (work,) = out.scheduled
        order.append(work.sequence.request_id)
        scheduler.remove(work.sequence)
    assert order == ["b", "d", "c", "a"]


def test_preemption_by_recompute_resumes_with_identical_output() -> None:
    # Reference: plenty of blocks, no preemption.
    reference = make_core(num_blocks=64, budget=64)
    for i in range(3):
        reference.add_request(request(f"r{i}", 8, 24, base=i * 100))
    expected = run_to_end(reference)
    # 12 blocks of 4 cannot hold three sequences of 32 tokens at once.
    core = make_core(num_blocks=12, budget=64)
    for i in range(3):
        core.add_request(request(f"r{i}", 8, 24, base=i * 100))
    preempted = 0
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    while core.has_work():
        result = core.step()
        assert result.stats is not None
        preempted += result.stats.num_preempted
        for out in result.outputs:
            outputs[out.request_id].append(out)
        core.block_manager.check_invariants()
    assert preempted > 0
    for request_id, outs in expected.items():
        assert tokens_of(outputs[request_id]) == tokens_of(outs)
        assert outputs[request_id][-1].finish_reason is FinishReason.LENGTH
    assert core.load().num_used_blocks == 0


def test_lower_priority_is_preempted_first() -> None:
    core = make_core(num_blocks=10, budget=64)
    core.add_request(request("low", 8, 24, priority=0))
    core.add_request(request("high", 8, 24, priority=9, base=100))
    finished_order: list[str] = []
    victims: set[str] = set()
    while core.has_work():
        running_before = {s.request_id for s in core.scheduler.running}
        result = core.step()
        running_after = {s.request_id for s in core.scheduler.running}
        victims |= running_before - running_after - {o.request_id for o in result.outputs}
        finished_order += [o.request_id for o in result.outputs if o.finished]
    assert victims == {"low"}
    assert finished_order == ["high", "low"]


def test_aging_prevents_starvation() -> None:
    def low_priority_finishes(aging_s: float | None) -> bool:
        clock = VirtualClock()
        core = make_core(max_num_seqs=1, budget=64, aging_s=aging_s, clock=clock)
        core.add_request(request("low", 4, 2, priority=0))
        for step in range(200):
            # A new high-priority request arrives at every step: strict priority starves "low".
            core.add_request(request(f"high{step}", 4, 2, priority=3, base=step))
            for out in core.step().outputs:
                if out.request_id == "low" and out.finished:
                    return True
        return False

    assert low_priority_finishes(aging_s=0.1)
    assert not low_priority_finishes(aging_s=None)


def test_abort_running_and_waiting_requests_frees_everything() -> None:
    core = make_core(max_num_seqs=1, budget=8)
    core.add_request(request("running", 20, 50))
    core.add_request(request("waiting", 6, 5, base=300))
    core.step()
    load = core.load()
    assert (load.num_running, load.num_waiting) == (1, 1)
    assert (load.running_tokens, load.waiting_tokens) == (20, 6)
    assert load.num_used_blocks == 2 and load.num_total_blocks == 64  # 8 tokens computed
    assert load.kv_usage == 2 / 64
    assert (load.prefill_batch_size, load.decode_batch_size) == (1, 0)
    (cancelled,) = core.abort("running")
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert cancelled.usage is not None and cancelled.usage.prompt_tokens == 20
    assert core.abort("running") == []  # already finished
    (waiting,) = core.abort("waiting")
    assert waiting.finish_reason is FinishReason.CANCELLED
    assert not core.has_work()
    assert core.load().num_used_blocks == 0
    # Idle: no batch, although the last step's batch was one prefill.
    assert (core.load().prefill_batch_size, core.load().decode_batch_size) == (0, 0)
    assert core.step().outputs == []
    core.block_manager.check_invariants()


def test_the_kv_cache_check_refuses_only_what_cannot_produce_its_shortest_output() -> None:
    """The KV a request holds is its prompt's and every output token's but the last (sampled,
    never computed): a prompt filling the cache exactly generates its token; one more is
    refused. With `min_tokens` the prompt and `min_tokens - 1` outputs must fit."""
    core = make_core(num_blocks=4)  # 16 slots
    slots = 16

    def generate(num_prompt: int, max_tokens: int, min_tokens: int = 0) -> list[RequestOutput]:
        sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=True)
        rid = f"p{num_prompt}-{max_tokens}-{min_tokens}"
        core.add_request(EngineRequest(rid, tuple(range(10, 10 + num_prompt)), sampling))
        return run_to_end(core)[rid]

    for num_prompt in (slots - 1, slots):  # one token under, exact
        outputs = generate(num_prompt, max_tokens=1)
        assert len(tokens_of(outputs)) == 1
        assert outputs[-1].finish_reason is FinishReason.LENGTH and not outputs[-1].message
    with pytest.raises(PromptTooLongError, match="does not fit the KV cache"):  # one over
        core.check_request(EngineRequest("over", tuple(range(slots + 1)), SamplingParams()))
    # A longer output than the cache holds ends at the cache, as before.
    outputs = generate(slots, max_tokens=3)
    assert len(tokens_of(outputs)) == 1 and outputs[-1].message == "KV cache full"
    assert len(tokens_of(generate(slots - 1, max_tokens=2, min_tokens=2))) == 2
    with pytest.raises(PromptTooLongError, match="min_tokens 2"):
        core.check_request(
            EngineRequest("min", tuple(range(slots)), SamplingParams(min_tokens=2, max_tokens=2))
        )


# A sequence whose KV fills the whole pool exactly, short of the block a KV session holds:
# it waits for the session's release, rather than end early.
@example(
    requests=[(5, 1, 0, 0, True), (20, 13, 0, 1, False)],
    num_blocks=8,
    budget=48,
    max_num_seqs=6,
    hold_steps=40,
)
@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 40),
            st.integers(1, 30),
            st.integers(0, 2),
            st.integers(0, 3),
            st.booleans(),
        ),
        min_size=1,
        max_size=8,
    ),
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    hold_steps=st.integers(0, 40),
)
def test_any_workload_finishes_with_the_same_tokens_as_an_unconstrained_engine(
    requests: list[tuple[int, int, int, int, bool]],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    hold_steps: int,
) -> None:
    """Some requests hold a KV session (a PREFILL engine's) when they end, released
    `hold_steps` steps later (as a decode engine's pull would): the blocks it holds make others
    wait, never end early."""

    def run(core: EngineCore) -> dict[str, list[int]]:
        for i, (num_prompt, max_tokens, priority, prefix, holds) in enumerate(requests):
            # A few shared prefixes so that prefix hits happen.
            session = f"r{i}" if holds else None
            core.add_request(
                request(
                    f"r{i}",
                    num_prompt,
                    max_tokens,
                    priority=priority,
                    base=prefix,
                    kv_session_id=session,
                )
            )
        outputs = run_to_end(core, hold_steps)
        core.block_manager.check_invariants()
        assert core.load().num_used_blocks == 0
        assert not core.has_work()
        return {rid: tokens_of(outs) for rid, outs in outputs.items()}

    constrained = run(make_core(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs))
    reference = run(make_core(num_blocks=512, budget=512, max_num_seqs=64))
    for i, (num_prompt, max_tokens, *_) in enumerate(requests):
        rid = f"r{i}"
        if len(reference[rid]) == len(constrained[rid]):
            assert constrained[rid] == reference[rid]
        else:  # only a sequence too big for the whole pool may end early ("KV cache full")
            assert -(-(num_prompt + max_tokens - 1) // 4) > num_blocks  # its KV: all but the last
            assert constrained[rid] == reference[rid][: len(constrained[rid])]


def rank(seq: Sequence) -> tuple[int, int]:
    """The scheduler's order without aging: larger priority first, then FCFS."""
    return (-seq.priority, seq.arrival_order)


# A victim and a later arrival that waited while it ran: the victim goes first.
@example(requests=[(12, 20, 0, 0)] * 3, num_blocks=8, budget=40, max_num_seqs=5)
@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 24), st.integers(1, 24), st.integers(0, 1), st.integers(0, 3)),
        min_size=2,
        max_size=7,
    ),
    num_blocks=st.integers(8, 16),
    budget=st.integers(2, 40),
    max_num_seqs=st.integers(1, 5),
)
def test_each_step_preempts_admits_and_batches_in_the_schedulers_order(
    requests: list[tuple[int, int, int, int]], num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    """Step by step, as vLLM: a step never schedules more tokens than the budget nor runs
    more sequences than the seats; when the pool is short, the victims are the running
    sequences of the lowest priority, the latest arrived first (every sequence that keeps
    running ranks above them); a step that preempts admits no one (the victims wait at the
    front of their queue); and admission takes the waiting sequences in order."""
    core = make_core(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs)
    # Some arrive while others run, so that newcomers and victims meet in the queue.
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    for step in range(10_000):
        while pending and pending[0][1][3] <= step:
            i, (num_prompt, max_tokens, priority, _) = pending.pop(0)
            core.add_request(request(f"r{i}", num_prompt, max_tokens, priority=priority, base=i))
        if not core.has_work() and not pending:
            break
        running, waiting = list(core.scheduler.running), core.scheduler.waiting()
        preemptions = {s: s.num_preemptions for s in running}
        result = core.step()
        assert result.stats is None or result.stats.num_scheduled_tokens <= budget
        assert core.scheduler.num_running <= max_num_seqs
        now_running = set(core.scheduler.running)
        victims = [s for s in running if s.num_preemptions > preemptions[s]]
        for victim in victims:
            assert victim not in now_running, "a victim admitted again in the step"
            for survivor in now_running:
                assert rank(survivor) < rank(victim), f"{victim.request_id} preempted first"
        admitted = [s for s in waiting if s in now_running]
        assert not (victims and admitted), "admitted in a step that preempted"
        still_waiting = [s for s in waiting if s.status is SequenceStatus.WAITING]
        for seq in admitted:
            for other in still_waiting:
                assert rank(seq) < rank(other), f"{seq.request_id} overtook {other.request_id}"
    assert not core.has_work() and not pending


def test_usage_counts_the_prefix_hits_of_the_first_admission_only() -> None:
    """A preempted sequence is admitted again with its own computed blocks as prefix hits;
    its request's usage (and the routing benchmark's hit count) still reports what the cache
    held for it on arrival."""
    core = make_core(num_blocks=8, budget=40)
    # Distinct prompts: no hit on arrival. "short" grows into the blocks of "long", preempted
    # (its prompt's blocks stay cached), and ends: "long" is admitted again, with hits.
    core.add_request(request("short", 12, 6))
    core.add_request(request("long", 12, 20, base=1))
    preempted = 0
    usage: dict[str, int] = {}
    while core.has_work():
        result = core.step()
        assert result.stats is not None
        preempted += result.stats.num_preempted
        for out in result.outputs:
            if out.usage is not None:
                usage[out.request_id] = out.usage.cached_prompt_tokens
    assert preempted > 0
    assert usage == {"short": 0, "long": 0}


def test_a_failed_step_preempts_a_sequence_that_hit_a_single_block_it_never_wrote() -> None:
    """Admitted in the same step as the sequence computing its one-block prefix, a sequence
    counts that block computed; the step's pass fails: it must compute the block again."""
    bm = BlockManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    prefix = (1, 2, 3, 4)
    computing, hitting = (
        Sequence(i, EngineRequest(f"r{i}", (*prefix, 5 + i), SamplingParams()), 0, i, 0.0)
        for i in range(2)
    )
    scheduler.add(computing)
    scheduler.add(hitting)
    out = scheduler.schedule(now_s=0.0)
    assert [w.num_new_tokens for w in out.scheduled] == [5, 1]  # the second hit the prefix
    assert scheduler.discard_step() == [hitting]
    assert hitting.num_computed_tokens == 0 and hitting.num_cached_tokens is None
    assert scheduler.running == [computing]
    bm.check_invariants()


def test_aging_raises_priority_a_whole_level_per_period() -> None:
    """With `aging_s`, a sequence gains one level per whole `aging_s` waited, not a fraction:
    after 1.5 periods a priority-0 sequence ties with a priority-1 one that waited 0.6 (and
    goes first, having arrived first); a fractional rank would put it behind."""
    bm = BlockManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, aging_s=1.0), bm)
    for i, (priority, arrival_s) in enumerate(((0, 0.0), (1, 0.9))):
        seq = Sequence(i, request(f"p{priority}", 4, 1, priority=priority), 0, i, arrival_s)
        scheduler.add(seq)
    (work,) = scheduler.schedule(now_s=1.5).scheduled
    assert work.sequence.request_id == "p0"
