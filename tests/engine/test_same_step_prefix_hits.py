"""Prefix hits on blocks that the same step computes, as in vLLM v1 (`allocate_slots` caches a
block when the chunk that fills it is scheduled): a request admitted after another in the same
step, or another output of the same request, takes the blocks the first computes as prefix hits
and reports them cached; its forward pass writes them before attention reads them, so the
tokens are those of computing the prefix again. Real compute: the builtin model on the torch
runner, with the native kernels (where they build) and without (SDPA: the first prompt from
position 0 is a `FreshPrefill`, the hitting one reads the cache through the groups).

A step whose forward pass fails (a token outside the vocabulary, refused by the runner before
it computes anything) leaves no such block cached or announced, and no sequence holding it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.api import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    KvEvent,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.engine_core import EngineCore
from engine.core.sequence import SequenceStatus
from engine.torch_runner.errors import InvalidBatchError
from engine.torch_runner.native import compiler_available
from engine.torch_runner.runner import TorchModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 16
SHARED = [(7 * i + 3) % 250 + 3 for i in range(80)]  # five blocks
FIRST = (*SHARED, *range(10, 30))  # 100 tokens: a fresh prefill of >= 64 tokens
SECOND = (*SHARED, *range(40, 70))  # 110 tokens: hits the five shared blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KERNELS = pytest.mark.parametrize(
    "native_kernels", [None, False], ids=["kernel-if-built", "torch-sdpa"]
)


def engine(model_dir: Path, native_kernels: bool | None) -> EngineCore:
    runner = TorchModelRunner.from_pretrained(
        model_dir, block_size=BLOCK_SIZE, num_blocks=64, native_kernels=native_kernels
    )
    assert (runner.native_kernels is not None) == (native_kernels is None and compiler_available())
    return EngineCore(runner, SchedulerConfig(max_num_batched_tokens=512))


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, RequestOutput]:
    """Submit together, step to the end: the final output of each (request, output index),
    its tokens gathered into `new_token_ids`."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    while core.has_work():
        for out in core.step().outputs:
            name = f"{out.request_id}/{out.output_index}"
            tokens.setdefault(name, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                final[name] = out
    core.block_manager.check_invariants()
    return {
        name: RequestOutput(out.request_id, out.output_index, tuple(tokens[name]), usage=out.usage)
        for name, out in final.items()
    }


def alone(model_dir: Path, native_kernels: bool | None, request: EngineRequest) -> tuple[int, ...]:
    """The request's output 0 on a fresh engine (nothing cached: it computes its prompt)."""
    out = run(engine(model_dir, native_kernels), [request])[f"{request.request_id}/0"]
    assert out.usage is not None and out.usage.cached_prompt_tokens == 0
    return out.new_token_ids


@KERNELS
def test_a_request_admitted_in_the_same_step_hits_the_prefix_being_computed(
    builtin_dir: Path, native_kernels: bool | None
) -> None:
    core = engine(builtin_dir, native_kernels)
    first, second = EngineRequest("a", FIRST, GREEDY), EngineRequest("b", SECOND, GREEDY)
    core.add_request(first)
    core.add_request(second)
    step = core.step()
    assert step.stats is not None and step.stats.batch_size == 2
    # vLLM's count: the second request's five shared blocks are hits, not computed again.
    assert step.stats.num_cached_tokens == 80
    assert step.stats.num_prefill_tokens == len(FIRST) + len(SECOND) - 80
    events = core.take_kv_events()
    stored = [k for e in events if isinstance(e, BlockStored) for k in e.block_keys]
    # The first request's six blocks, then the second's own sixth: each key stored once.
    assert len(stored) == len(set(stored)) == 6 + 1
    outputs = run(core, [])
    cached = {name: out.usage.cached_prompt_tokens for name, out in outputs.items() if out.usage}
    assert cached == {"a/0": 0, "b/0": 80}
    # Greedy tokens are those of each request computed alone (its prefix computed by itself).
    step_tokens = {o.request_id: o.new_token_ids for o in step.outputs}
    together = {r: step_tokens[r] + outputs[f"{r}/0"].new_token_ids for r in ("a", "b")}
    assert together["a"] == alone(builtin_dir, native_kernels, first)
    assert together["b"] == alone(builtin_dir, native_kernels, second)


@KERNELS
def test_the_other_outputs_of_a_request_hit_the_prompt_its_first_output_computes(
    builtin_dir: Path, native_kernels: bool | None
) -> None:
    sampling = SamplingParams(
        temperature=0.9, top_p=0.95, seed=7, num_sequences=3, max_tokens=8, ignore_eos=True
    )
    core = engine(builtin_dir, native_kernels)
    core.add_request(EngineRequest("n", SECOND, sampling))
    first = core.step()
    # Outputs 1 and 2 took the prompt's six full blocks as hits (never the last token's)...
    assert first.stats is not None and first.stats.num_cached_tokens == 2 * 96
    outputs = run(core, [])
    # ... but the prompt itself found nothing cached: that is the request's usage.
    (usage,) = [out.usage for out in outputs.values() if out.usage is not None]
    assert usage.cached_prompt_tokens == 0
    # Output i samples with seed 7 + i: each equals a one-output request seeded so, alone.
    for index in range(3):
        seeded = SamplingParams(
            temperature=0.9, top_p=0.95, seed=7 + index, max_tokens=8, ignore_eos=True
        )
        expected = alone(builtin_dir, native_kernels, EngineRequest(f"s{index}", SECOND, seeded))
        first_token = tuple(o.new_token_ids for o in first.outputs if o.output_index == index)
        assert first_token[0] + outputs[f"n/{index}"].new_token_ids == expected


def test_a_failed_step_leaves_no_hit_on_blocks_it_never_wrote(builtin_dir: Path) -> None:
    core = engine(builtin_dir, None)
    first, second = EngineRequest("a", FIRST, GREEDY), EngineRequest("b", SECOND, GREEDY)
    core.add_request(first)
    core.add_request(second)
    # Refused by the runner before it computes anything: the whole pass fails.
    core.add_request(EngineRequest("bad", (5, 100_000, 6), GREEDY))
    with pytest.raises(InvalidBatchError):
        core.step()
    # The blocks the pass was to write are neither cached nor announced; the request that had
    # taken them as hits was preempted, the one that was to compute them computes them again.
    assert core.block_manager.cached_keys() == set()
    assert core.take_kv_events() == []
    core.block_manager.check_invariants()
    states = {s.request_id: s for s in core.scheduler.running + core.scheduler.waiting()}
    assert states["b"].status is SequenceStatus.WAITING and states["b"].num_computed_tokens == 0
    assert states["a"].num_computed_tokens == 0
    core.abort("bad")
    outputs = run(core, [])
    assert outputs["a/0"].new_token_ids == alone(builtin_dir, None, first)
    assert outputs["b/0"].new_token_ids == alone(builtin_dir, None, second)


def announced_keys(events: list[KvEvent], keys: set[int] | None = None) -> set[int]:
    """Replay `events` on `keys`: the keys they leave announced. Every BlockStored names a
    parent announced before it, every BlockRemoved keys announced before it."""
    keys = set() if keys is None else keys
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_key is None or event.parent_key in keys, "parent never announced"
            keys.update(event.block_keys)
        elif isinstance(event, BlockRemoved):
            assert keys.issuperset(event.block_keys), "removal of a key never announced"
            keys.difference_update(event.block_keys)
        elif isinstance(event, AllBlocksCleared):
            keys.clear()
    return keys


def test_a_failed_step_drops_the_kv_imported_on_top_of_blocks_it_never_wrote(
    builtin_dir: Path,
) -> None:
    """A DECODE engine imports a request's held (pulled) KV as it admits it, taking the blocks
    cached so far as hits: here the five shared blocks that a request admitted before it in
    the same step was to compute. The pass fails: those five leave the cache unannounced, and
    so does the imported sixth block chained on them (its BlockStored would name a parent the
    index never heard of)."""
    prefill = engine(builtin_dir, None)  # the prefill engine the KV is pulled from
    prefill.add_request(
        EngineRequest("p", SECOND, SamplingParams(temperature=0.0, max_tokens=1), kv_session_id="s")
    )
    run(prefill, [])
    session = prefill.kv_session_tokens("s")
    assert session is not None and len(session) == 6 * BLOCK_SIZE
    pulled = prefill.read_kv_session("s", 0, 6)
    size = len(pulled) // 6
    blocks = [pulled[i * size : (i + 1) * size] for i in range(6)]

    runner = TorchModelRunner.from_pretrained(
        builtin_dir, block_size=BLOCK_SIZE, num_blocks=16, native_kernels=False
    )
    core = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=512))
    # A running request fills the pool: the pulled KV is held, imported at admission.
    core.add_request(EngineRequest("full", tuple(range(3, 243)), GREEDY))
    core.step()
    core.add_request(EngineRequest("a", FIRST, GREEDY))
    second = EngineRequest("b", SECOND, GREEDY)
    assert core.import_or_hold_kv_blocks(second, blocks, max_held_bytes=len(pulled)) == "held"
    core.add_request(second)
    core.abort("full")
    announced = announced_keys(core.take_kv_events())
    core.add_request(EngineRequest("bad", (5, 100_000, 6), GREEDY))
    with pytest.raises(InvalidBatchError):
        core.step()
    announced = announced_keys(core.take_kv_events(), announced)
    assert announced == core.block_manager.cached_keys()
    core.block_manager.check_invariants()
    core.abort("bad")
    outputs = run(core, [])
    assert announced_keys(core.take_kv_events(), announced) == core.block_manager.cached_keys()
    assert outputs["b/0"].new_token_ids == alone(builtin_dir, False, second)


def test_a_failed_step_keeps_what_earlier_passes_computed_and_reports_no_unserved_hit(
    builtin_dir: Path,
) -> None:
    """The failed pass was to compute the rest of a chunked prompt ("a") and the start of a
    request admitted after it ("b") that hit, besides a's three blocks computed before, the
    two that pass was to fill. "a" keeps its computed tokens (its block being filled is its
    own: it recomputes just the chunk); "b" is preempted and, admitted again after "a" ended,
    reports the hits it is served then, not those of the failed admission."""
    runner = TorchModelRunner.from_pretrained(
        builtin_dir, block_size=BLOCK_SIZE, num_blocks=64, native_kernels=False
    )
    core = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=56))
    core.add_request(EngineRequest("a", FIRST, GREEDY))
    core.step()  # 56 of its 100 prompt tokens: three full blocks and half of the fourth
    core.add_request(EngineRequest("bad", (5, 100_000, 6), GREEDY))
    second = EngineRequest("b", SECOND, GREEDY)
    core.add_request(second)
    with pytest.raises(InvalidBatchError):
        core.step()
    states = {s.request_id: s for s in core.scheduler.running + core.scheduler.waiting()}
    assert states["a"].status is SequenceStatus.RUNNING
    assert states["a"].num_computed_tokens == 56 and states["a"].num_preemptions == 0
    assert states["b"].status is SequenceStatus.WAITING and states["b"].num_cached_tokens is None
    core.abort("a")
    core.abort("bad")
    outputs = run(core, [])
    usage = outputs["b/0"].usage
    assert usage is not None and usage.cached_prompt_tokens == 3 * BLOCK_SIZE  # a's three
    assert outputs["b/0"].new_token_ids == alone(builtin_dir, False, second)
