"""KV sessions in the engine core: a PREFILL request's blocks held under its session until
released, and pulled blocks imported into a DECODE core's prefix cache (engine_core.py)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import pytest

from engine.core.api import (
    BlockStored,
    EngineRequest,
    FinishReason,
    KvBlockBytes,
    KvImportOutcome,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.engine_core import EngineCore
from engine.core.lora import AdapterConfig, LoraAdapter, LoraLoad, TargetModules
from engine.core.sequence import Sequence as SchedulerSequence
from engine.core.sim_runner import SimRunner

BLOCK = 4
PROMPT = tuple(range(100, 110))  # 10 tokens: two full blocks reusable, the third holds the last


class BytesRunner(SimRunner):
    """A sim runner whose blocks hold bytes: what was written is what is read back."""

    def __init__(self, num_blocks: int = 16) -> None:
        super().__init__(block_size=BLOCK, num_blocks=num_blocks, vocab_size=1000, time_scale=0)
        self.data: dict[int, bytes] = {}
        self.fail_writes = False

    @property
    def kv_layout(self) -> str:
        return "bytes"

    @property
    def kv_block_bytes(self) -> int:
        return 2

    def read_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        return b"".join(self.data.get(b, b"??") for b in block_ids)

    def write_kv_blocks(self, block_ids: Sequence[int], blocks: Sequence[KvBlockBytes]) -> None:
        if self.fail_writes:
            raise ValueError("bad block")
        self.data.update(zip(block_ids, map(bytes, blocks), strict=True))


def run(core: EngineCore, request: EngineRequest) -> list[RequestOutput]:
    core.add_request(request)
    outputs: list[RequestOutput] = []
    while core.has_work():
        outputs.extend(o for o in core.step().outputs if o.request_id == request.request_id)
    return outputs


def run_all(core: EngineCore) -> dict[str, int]:
    """Step until idle: each ended request's cached prompt tokens."""
    cached: dict[str, int] = {}
    while core.has_work():
        for output in core.step().outputs:
            if output.usage is not None:
                cached[output.request_id] = output.usage.cached_prompt_tokens
    return cached


def prefill(session_id: str | None = "s1", prompt: tuple[int, ...] = PROMPT) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return EngineRequest("p", prompt, sampling, kv_session_id=session_id)


def test_a_prefill_holds_its_reusable_blocks_until_released() -> None:
    core = EngineCore(BytesRunner())
    bm = core.block_manager
    last = run(core, prefill())[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.held_kv_session
    assert core.kv_session_tokens("s1") == PROMPT[:8]
    assert bm.num_used_blocks == 2 and core.num_kv_sessions == 1
    # Held blocks are never evicted: fill the rest of the pool with other prompts.
    for i in range(6):
        other = tuple(range(500 + 8 * i, 508 + 8 * i))
        run(core, EngineRequest(f"o{i}", other, SamplingParams(max_tokens=1)))
    assert core.kv_session_tokens("s1") == PROMPT[:8]
    assert core.block_manager.count_hit_tokens(PROMPT) == 8
    assert core.release_kv_session("s1")
    assert not core.release_kv_session("s1")
    assert bm.num_used_blocks == 0 and core.kv_session_tokens("s1") is None
    # Released, the blocks stay in the prefix cache.
    assert core.block_manager.count_hit_tokens(PROMPT) == 8
    bm.check_invariants()


def test_a_request_short_of_blocks_held_by_a_session_waits_for_its_release() -> None:
    """A request that fits the KV cache, short only of the blocks a session holds, waits (a
    held session lasts until pulled, aborted or its TTL); it used to end at once as LENGTH
    "KV cache full", its output cut short. Here it outgrows what is free mid-decode."""
    core = EngineCore(BytesRunner(num_blocks=6))
    run(core, prefill())  # holds 2 blocks: 4 left
    # 13 prompt tokens and 8 new: 20 tokens computed, 5 blocks (of 6).
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request = EngineRequest("long", tuple(range(500, 513)), sampling)
    core.add_request(request)
    outputs: list[RequestOutput] = []
    for _ in range(100):
        result = core.step()
        outputs.extend(result.outputs)
        if result.stats is None and not result.outputs:
            break  # nothing can run until the session is released
    assert core.has_work() and not any(o.finished for o in outputs)
    assert core.step().outputs == []  # and stays so
    assert core.release_kv_session("s1")
    while core.has_work():
        outputs.extend(core.step().outputs)
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].message == ""
    alone = run(EngineCore(BytesRunner()), request)
    assert [t for o in outputs for t in o.new_token_ids] == [
        t for o in alone for t in o.new_token_ids
    ]
    assert core.block_manager.num_used_blocks == 0
    core.block_manager.check_invariants()


def test_an_uncached_request_short_of_session_blocks_waits_without_recomputing() -> None:
    """Its prefix not cached (`bypass_prefix_cache`) and its prompt chunked, a request that
    outgrew what the session left free used to be admitted again chunk by chunk, preempted
    again at the chunk that reaches the session's blocks, and so on: a forward pass every
    step, recomputing it for as long as the session is held. It waits, preempted once, until
    the release."""
    config = SchedulerConfig(max_num_batched_tokens=BLOCK * 2)
    core = EngineCore(BytesRunner(num_blocks=6), config)
    run(core, prefill())  # holds 2 blocks: 4 left
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request = EngineRequest("long", tuple(range(500, 513)), sampling, bypass_prefix_cache=True)
    core.add_request(request)
    outputs: list[RequestOutput] = []
    passes = 0
    for _ in range(100):
        result = core.step()
        outputs.extend(result.outputs)
        passes += result.stats is not None
    # Its prompt in 2 chunks and 4 tokens fill the 4 free blocks; nothing more runs.
    assert passes == 5 and not any(o.finished for o in outputs)
    assert core.load().num_waiting == 1
    assert core.release_kv_session("s1")
    while core.has_work():
        outputs.extend(core.step().outputs)
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].message == ""
    alone = run(EngineCore(BytesRunner(), config), request)
    assert [t for o in outputs for t in o.new_token_ids] == [
        t for o in alone for t in o.new_token_ids
    ]
    core.block_manager.check_invariants()


def test_a_request_without_a_session_or_aborted_holds_nothing() -> None:
    core = EngineCore(BytesRunner())
    assert not run(core, prefill(None))[-1].held_kv_session
    core.add_request(prefill("s2"))
    outputs = core.abort("p")
    assert outputs[-1].finish_reason is FinishReason.CANCELLED
    assert not outputs[-1].held_kv_session
    assert core.kv_session_tokens("s2") is None and core.block_manager.num_used_blocks == 0


def test_read_kv_session_copies_the_held_blocks_bytes() -> None:
    runner = BytesRunner()
    core = EngineCore(runner)
    run(core, prefill())
    # The sim computes nothing; give the held blocks recognisable bytes.
    table = core.block_manager.block_table(core._kv_sessions["s1"].seq_id)
    runner.write_kv_blocks(table, [b"k0", b"k1"])
    assert core.read_kv_session("s1", 0, 2) == b"k0k1"
    assert core.read_kv_session("s1", 1, 5) == b"k1"
    with pytest.raises(KeyError, match="nope"):  # the session asked for, not another key
        core.read_kv_session("nope", 0, 1)


def pulled(
    core: EngineCore, prompt: tuple[int, ...], blocks: list[KvBlockBytes]
) -> KvImportOutcome:
    """`blocks` pulled for a request of `prompt`, put into `core` as the engine thread does
    just before adding the request ("d"), with no room to hold them."""
    request = EngineRequest("d", prompt, SamplingParams(max_tokens=3))
    return core.import_or_hold_kv_blocks(request, blocks, max_held_bytes=0)


def test_imported_blocks_are_prefix_hits_of_the_request_and_stored_events() -> None:
    runner = BytesRunner()
    core = EngineCore(runner)
    assert pulled(core, PROMPT, [b"k0", b"k1"]) == "imported"
    events = core.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].token_ids == PROMPT[:8]
    assert core.block_manager.num_used_blocks == 0  # cached and evictable
    assert sorted(runner.data.values()) == [b"k0", b"k1"]
    outputs = run(core, EngineRequest("d", PROMPT, SamplingParams(max_tokens=3)))
    assert outputs[-1].usage is not None and outputs[-1].usage.cached_prompt_tokens == 8
    # Blocks already cached are not written again.
    assert pulled(core, PROMPT, [b"x0", b"x1"]) == "unused"
    assert b"x0" not in runner.data.values()
    core.block_manager.check_invariants()


def test_an_import_never_covers_the_block_of_the_last_prompt_token() -> None:
    runner = BytesRunner()
    core = EngineCore(runner)
    aligned = PROMPT[:8]  # block 1 holds the last token: recomputed, not imported
    assert pulled(core, aligned, [b"k0", b"k1"]) == "imported"
    assert core.block_manager.count_hit_tokens(aligned) == 4
    assert list(runner.data.values()) == [b"k0"]


def test_an_import_without_room_or_with_a_failing_write_changes_nothing() -> None:
    runner = BytesRunner(num_blocks=4)
    core = EngineCore(runner)
    core.add_request(EngineRequest("busy", tuple(range(500, 513)), SamplingParams(max_tokens=50)))
    core.step()  # holds all 4 blocks
    assert pulled(core, PROMPT, [b"k0", b"k1"]) == "dropped"
    core.abort("busy")
    core.take_kv_events()
    runner.fail_writes = True
    with pytest.raises(ValueError, match=r"^bad block$"):  # the runner's own error, passed on
        pulled(core, PROMPT, [b"k0", b"k1"])
    assert core.block_manager.count_hit_tokens(PROMPT) == 0
    assert not [e for e in core.take_kv_events() if isinstance(e, BlockStored)]
    assert core.block_manager.num_used_blocks == 0
    core.block_manager.check_invariants()


def _full_pool() -> tuple[BytesRunner, EngineCore]:
    """A core of 4 blocks, all held by its running request "busy"."""
    runner = BytesRunner(num_blocks=4)
    core = EngineCore(runner)
    core.add_request(EngineRequest("busy", tuple(range(500, 513)), SamplingParams(max_tokens=3)))
    core.step()  # holds all 4 blocks
    return runner, core


def test_pulled_blocks_without_room_are_held_until_admitted_then_dropped_past_the_bound() -> None:
    """With the pool full, a request's pulled blocks are held (bytes counted) and imported as
    the scheduler admits it, after the running request ends: its prompt's blocks come from
    them (cached 8). Past `max_held_bytes` another's are dropped; an aborted request's held
    blocks go with it."""
    runner, core = _full_pool()
    pulled = EngineRequest("pulled", PROMPT, SamplingParams(max_tokens=3))
    assert core.import_or_hold_kv_blocks(pulled, [b"k0", b"k1"], max_held_bytes=4) == "held"
    core.add_request(pulled)
    assert core.held_import_bytes == 4
    dropped = EngineRequest("dropped", tuple(range(200, 210)), SamplingParams(max_tokens=3))
    assert core.import_or_hold_kv_blocks(dropped, [b"d0", b"d1"], max_held_bytes=4) == "dropped"
    core.add_request(dropped)
    aborted = EngineRequest("aborted", tuple(range(300, 310)), SamplingParams(max_tokens=3))
    assert core.import_or_hold_kv_blocks(aborted, [b"a0", b"a1"], max_held_bytes=8) == "held"
    core.add_request(aborted)
    assert core.held_import_bytes == 8
    core.abort("aborted")
    assert core.held_import_bytes == 4
    assert run_all(core) == {"busy": 0, "pulled": 8, "dropped": 0}
    assert core.held_import_bytes == 0
    assert sorted(runner.data.values()) == [b"k0", b"k1"]
    core.block_manager.check_invariants()


def test_held_blocks_another_request_cached_meanwhile_are_not_stored_twice() -> None:
    """A higher-priority request with the same prompt, queued after the held one, is admitted
    first (priority, not arrival) and computes the blocks: the held request then finds them
    cached, writes none of its held bytes, and each key is stored once (one BlockStored)."""
    runner, core = _full_pool()
    pulled = EngineRequest("pulled", PROMPT, SamplingParams(max_tokens=3))
    assert core.import_or_hold_kv_blocks(pulled, [b"k0", b"k1"], max_held_bytes=4) == "held"
    core.add_request(pulled)
    core.add_request(EngineRequest("twin", PROMPT, SamplingParams(max_tokens=3), priority=1))
    cached = run_all(core)
    assert list(cached) == ["busy", "twin", "pulled"] and cached["pulled"] == 8
    assert core.held_import_bytes == 0 and runner.data == {}
    events = core.take_kv_events()
    stored = [k for e in events if isinstance(e, BlockStored) for k in e.block_keys]
    assert len(stored) == len(set(stored))
    core.block_manager.check_invariants()


def test_reloading_an_adapter_drops_the_pulled_blocks_held_with_its_old_weights() -> None:
    """Pulled KV held for a waiting request of an adapter is dropped, its bytes freed, once
    another adapter is loaded under the name: the request (on its old slot, out of the prefix
    cache) can never import it, and held bytes it kept until its end would refuse others'."""
    runner = BytesRunner(num_blocks=4)
    core = EngineCore(runner, max_loras=2)
    weights = AdapterConfig(
        rank=4, alpha=8.0, target_modules=TargetModules(names=frozenset({"q_proj"}))
    )
    core.load_lora(LoraAdapter(1, "ad", "/v1"), weights)
    core.add_request(EngineRequest("busy", tuple(range(500, 513)), SamplingParams(max_tokens=3)))
    core.step()  # holds all 4 blocks
    pulled = EngineRequest("pulled", PROMPT, SamplingParams(max_tokens=3), lora_name="ad")
    assert core.import_or_hold_kv_blocks(pulled, [b"k0", b"k1"], max_held_bytes=4) == "held"
    core.add_request(pulled)
    base = EngineRequest("base", tuple(range(200, 210)), SamplingParams(max_tokens=3))
    assert core.import_or_hold_kv_blocks(base, [b"b0", b"b1"], max_held_bytes=8) == "held"
    core.add_request(base)
    core.unload_lora("ad")
    core.load_lora(LoraAdapter(2, "ad", "/v2"), weights)
    assert core.held_import_bytes == 4  # the base model's stay held
    assert run_all(core) == {"busy": 0, "pulled": 0, "base": 8}
    assert core.held_import_bytes == 0
    assert sorted(runner.data.values()) == [b"b0", b"b1"]
    core.block_manager.check_invariants()


def test_a_session_moves_from_a_prefill_core_to_a_decode_core() -> None:
    prefill_runner, decode_runner = BytesRunner(), BytesRunner()
    prefill_core, decode_core = EngineCore(prefill_runner), EngineCore(decode_runner)
    run(prefill_core, prefill())
    table = prefill_core.block_manager.block_table(prefill_core._kv_sessions["s1"].seq_id)
    prefill_runner.write_kv_blocks(table, [b"k0", b"k1"])
    data = memoryview(prefill_core.read_kv_session("s1", 0, 2))
    request = EngineRequest("d", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    blocks = [data[:2], data[2:]]  # as the puller passes them
    assert decode_core.import_or_hold_kv_blocks(request, blocks, max_held_bytes=0) == "imported"
    decoded = run(decode_core, request)
    alone = run(EngineCore(BytesRunner()), request)
    assert [o.new_token_ids for o in decoded] == [o.new_token_ids for o in alone]
    assert decoded[-1].usage is not None and decoded[-1].usage.cached_prompt_tokens == 8
    assert sorted(decode_runner.data.values()) == [b"k0", b"k1"]


def test_reloading_an_adapter_drops_the_sessions_held_with_its_old_weights() -> None:
    """A session's KV was computed with the adapter of that name at the time: once another
    adapter is loaded under the name, that KV must not be handed over (as the name's cached
    blocks are dropped). Sessions of other adapters and of the base model stay."""
    core = EngineCore(BytesRunner(num_blocks=32), max_loras=2)
    weights = AdapterConfig(
        rank=4, alpha=8.0, target_modules=TargetModules(names=frozenset({"q_proj"}))
    )
    core.load_lora(LoraAdapter(1, "ad", "/v1"), weights)
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run(core, EngineRequest("a", PROMPT, sampling, lora_name="ad", kv_session_id="with-ad"))
    run(core, EngineRequest("b", PROMPT, sampling, kv_session_id="base"))
    assert core.kv_session_tokens("with-ad") == core.kv_session_tokens("base") == PROMPT[:8]
    core.unload_lora("ad")
    core.load_lora(LoraAdapter(2, "ad", "/v2"), weights)
    assert core.kv_session_tokens("with-ad") is None
    assert core.kv_session_tokens("base") == PROMPT[:8]
    assert core.block_manager.count_hit_tokens(PROMPT, lora_name="ad") == 0
    core.block_manager.check_invariants()


def test_the_same_adapter_loaded_back_while_its_requests_run_keeps_its_sessions() -> None:
    """Unloaded while a request still uses it, the very adapter (same triple) loaded back is
    resumed: its weights, its cached blocks and the sessions held with it are its own, so all
    stay; the request that outlived the unload ends without taking the weights away."""
    runner = BytesRunner(num_blocks=32)
    core = EngineCore(runner, max_loras=2)
    weights = AdapterConfig(
        rank=4, alpha=8.0, target_modules=TargetModules(names=frozenset({"q_proj"}))
    )
    adapter = LoraAdapter(1, "ad", "/v1")
    assert core.load_lora(adapter, weights) is LoraLoad.LOADED
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run(core, EngineRequest("a", PROMPT, sampling, lora_name="ad", kv_session_id="with-ad"))
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    core.add_request(EngineRequest("long", PROMPT, long, lora_name="ad"))
    core.step()
    core.unload_lora("ad")
    assert core.load_lora(LoraAdapter(1, "ad", "/v1/"), object()) is LoraLoad.RESUMED
    assert core.kv_session_tokens("with-ad") == PROMPT[:8]
    assert core.block_manager.count_hit_tokens(PROMPT, lora_name="ad") == 8
    outputs = run(core, EngineRequest("b", PROMPT, sampling, lora_name="ad"))
    assert outputs[-1].usage is not None and outputs[-1].usage.cached_prompt_tokens == 8
    assert not core.has_work()  # "long" ended too
    assert [w is weights for w in runner.loras.values()] == [True]
    assert core.load_lora(adapter, weights) is LoraLoad.ALREADY_LOADED
    core.block_manager.check_invariants()


def test_dropped_pulled_blocks_are_logged_with_their_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Pulled blocks are dropped for one of two causes, and the warning says which: no room
    (pool full, the held bound reached), or a request id in use already (a duplicate, which
    the engine refuses). It used to blame the room for both."""
    _runner, core = _full_pool()
    twin = EngineRequest("busy", PROMPT, SamplingParams(max_tokens=3))
    full = EngineRequest("full", PROMPT, SamplingParams(max_tokens=3))
    with caplog.at_level("WARNING", logger="engine.core.engine_core"):
        assert core.import_or_hold_kv_blocks(twin, [b"k0", b"k1"], max_held_bytes=4) == "dropped"
        assert core.import_or_hold_kv_blocks(full, [b"k0", b"k1"], max_held_bytes=2) == "dropped"
    duplicate, no_room = (r.getMessage() for r in caplog.records)
    assert "request busy" in duplicate and "id is in use already" in duplicate
    assert "no room" not in duplicate
    assert "request full" in no_room and "no room" in no_room
    assert "max_held_kv_bytes 2" in no_room
    assert core.held_import_bytes == 0


def failing_once(core: EngineCore) -> list[bool]:
    """Arm (append True to the list returned) the core's next removal of an output from its
    scheduler to fail before it did anything: the output is marked finished, its blocks not
    freed yet (an end that raises partway)."""
    armed: list[bool] = []
    remove = core.scheduler.remove

    def failing_remove(sequence: SchedulerSequence) -> None:
        if armed:
            armed.clear()
            raise RuntimeError("freeing the output's blocks failed")
        remove(sequence)

    core.scheduler.remove = failing_remove  # type: ignore[method-assign]
    return armed


@pytest.mark.parametrize("ending", ["its end in a step", "an abort"])
def test_a_request_whose_end_fails_partway_holds_no_session(ending: str) -> None:
    """A request with a KV session ends its first output (held the session for it), and
    its end fails partway: in the step that ends it (as it takes the output it marked
    finished out of the scheduler), or in an abort of its second output. The core forgets
    the request, its end (which alone announces the session) never emitted, and holds no
    session, no block: the session's blocks stay cached. The session was held for ever,
    its blocks with it, by no one who knew of it (and, failing in a step, the request
    too)."""
    runner = SimRunner(block_size=BLOCK, num_blocks=16, time_scale=0)
    core = EngineCore(runner)
    armed = failing_once(core)
    if ending == "an abort":  # its first output stops on its third token, its second runs on
        stop = runner.next_tokens(PROMPT[-1], 0, 0, 3)[-1]
        assert stop not in runner.next_tokens(PROMPT[-1], 0, 1, 30)
        sampling = SamplingParams(max_tokens=30, num_sequences=2, stop_token_ids=(stop,))
    else:
        sampling = SamplingParams(max_tokens=1)
        armed.append(True)
    core.add_request(EngineRequest("p", PROMPT, sampling, kv_session_id="s1"))
    with pytest.raises(RuntimeError, match="blocks failed") if armed else nullcontext():
        while core.holds("p") and not core.num_kv_sessions:
            core.step()
    if ending == "an abort":
        assert core.holds("p") and core.num_kv_sessions == 1  # its first output ended
        armed.append(True)
        with pytest.raises(RuntimeError, match="blocks failed"):
            core.abort("p")
    assert not core.holds("p") and not core.has_work()
    assert core.kv_session_tokens("s1") is None and core.block_manager.num_used_blocks == 0
    assert core.block_manager.count_hit_tokens(PROMPT) == 8
    core.block_manager.check_invariants()
