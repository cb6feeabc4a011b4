"""EngineCore against a naive model (hypothesis stateful): any order of add_request (prompts
over a two-token alphabet, so prefixes are shared across requests, with cached blocks and with
generated tokens; n of 1 or 2; a stop token maybe; priorities, a cache salt, a bypass of the
prefix cache, prompt logprobs; a KV session asked for; pulled KV imported or held first),
abort, abort_all, step, a step whose forward pass fails (then every request failed, as
`EngineLoop` does, or the core steps on), reset_prefix_cache, and the KV sessions' read and
release, over a cache so small that sequences are preempted and recomputed all the time.

The runner is the sim's, whose KV slots hold, for real, a digest of the context up to their
position: every pass writes its chunks' slots, then checks that every slot each sequence
attends to holds its own context's (a prefix hit on the wrong block, a block reused while
still read, an import written to the wrong block: all read the wrong KV there). A session
reads back its prompt's digests; an import writes them.

After every rule:

1. the KV events taken so far, applied to a naive mirror (key -> parent and tokens; a key
   stored only while not cached, removed only while cached, its parent cached before it) give
   exactly the block manager's cached blocks: what a router believes is what the engine holds;
2. every request ends exactly once (one output with `usage`, its outputs each finished once,
   nothing after its end), each output with the sim's tokens, at most `max_tokens` of them,
   finished as the model says (CANCELLED when aborted, ERROR when failed, STOP at its stop
   token, else LENGTH), its prompt logprobs once, its usage's cached tokens whole blocks;
3. with no request, no session held, no block is in use (and otherwise exactly the blocks of
   the sessions' prompts are, with no request left);
4. `load()` agrees with the model: unfinished outputs (running + waiting), held sessions,
   cached blocks;
5. a request id is refused while its request runs, accepted again after its end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.core.api import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    FinishReason,
    KvBlockBytes,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
    ScheduledBatch,
    SchedulerConfig,
    SequenceResult,
    StopKind,
)
from engine.core.engine_core import EngineCore
from engine.core.errors import DuplicateRequestError
from engine.core.sim_runner import SimRunner

BLOCK = 2
NUM_BLOCKS = 8  # the longest context (9 + 6 tokens) fits alone: nothing ends "KV cache full"
VOCAB = 6  # the sim samples tokens 3..5 (2 is its EOS, never sampled)
ALPHABET = (3, 4)  # prompt tokens: the sim's own, so outputs share blocks with prompts
IDS = ("a", "b", "c", "d", "e")
SESSIONS = ("s0", "s1")
DIGEST = 8  # bytes per KV slot
EMPTY = bytes(DIGEST)


def digest(context: Sequence[int]) -> bytes:
    """The KV of the last position of `context`: what the runner writes in its slot."""
    return hashlib.blake2b(repr(tuple(context)).encode(), digest_size=DIGEST).digest()


def block_bytes(tokens: Sequence[int], index: int) -> bytes:
    """The KV of full block `index` of `tokens`, as the runner reads and writes it."""
    start = index * BLOCK
    return b"".join(digest(tokens[: start + j + 1]) for j in range(BLOCK))


class KvCheckingRunner(SimRunner):
    """A sim runner whose KV slots hold their context's digest, checked on every read."""

    def __init__(self) -> None:
        super().__init__(block_size=BLOCK, num_blocks=NUM_BLOCKS, vocab_size=VOCAB, time_scale=0)
        self.slots: dict[int, list[bytes]] = {}
        self.fail_next_pass = False  # the next pass raises, writing nothing

    @property
    def kv_layout(self) -> str:
        return "digests"

    @property
    def kv_block_bytes(self) -> int:
        return BLOCK * DIGEST

    def _block(self, block_id: int) -> list[bytes]:
        return self.slots.setdefault(block_id, [EMPTY] * BLOCK)

    def execute(self, batch: ScheduledBatch) -> list[SequenceResult]:
        if self.fail_next_pass:
            self.fail_next_pass = False
            raise RuntimeError("device lost")
        contexts = []
        for seq in batch.sequences:  # the pass writes every chunk's KV before any is read
            context = (*seq.prompt_token_ids, *seq.output_token_ids)
            contexts.append(context)
            for offset, token in enumerate(seq.token_ids):
                position = seq.start_position + offset
                assert context[position] == token
                block = seq.block_table[position // BLOCK]
                self._block(block)[position % BLOCK] = digest(context[: position + 1])
        for seq, context in zip(batch.sequences, contexts, strict=True):
            for position in range(seq.start_position + len(seq.token_ids)):
                block = seq.block_table[position // BLOCK]
                assert self._block(block)[position % BLOCK] == digest(context[: position + 1]), (
                    f"{seq.request_id}/{seq.output_index} reads wrong KV at position {position} "
                    f"(block {block})"
                )
        return super().execute(batch)

    def read_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        return b"".join(b"".join(self._block(b)) for b in block_ids)

    def write_kv_blocks(self, block_ids: Sequence[int], blocks: Sequence[KvBlockBytes]) -> None:
        assert len(block_ids) == len(blocks)
        for block_id, block in zip(block_ids, blocks, strict=True):
            data = bytes(block)
            assert len(data) == BLOCK * DIGEST
            self.slots[block_id] = [data[i * DIGEST : (i + 1) * DIGEST] for i in range(BLOCK)]


@dataclass
class Req:
    """One accepted request as the model sees it."""

    request: EngineRequest
    expected: list[list[int]]  # per output: the sim's tokens, `max_tokens` of them
    stop_at: list[int | None]  # per output: the index of its first stop token among them
    got: list[list[int]] = field(default_factory=list)
    finished: list[FinishReason | None] = field(default_factory=list)
    holds_session: bool = False  # its output 0 ended normally with its session free
    got_prompt_logprobs: bool = False
    held_bytes: int = 0  # its pulled KV, held by the core for its admission

    @property
    def num_unfinished(self) -> int:
        return sum(reason is None for reason in self.finished)


class EngineCoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runner = KvCheckingRunner()
        config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4)
        self.core = EngineCore(self.runner, config)
        self.live: dict[str, Req] = {}
        self.sessions: dict[str, tuple[int, ...]] = {}  # held session -> its tokens
        self.session_salts: dict[str, str | None] = {}  # ... and its cache salt
        self.mirror: dict[BlockKey, tuple[BlockKey | None, tuple[int, ...]]] = {}

    # ------------------------------------------------------------------ requests

    @rule(
        request_id=st.sampled_from(IDS),
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=9),
        max_tokens=st.integers(1, 6),
        num_sequences=st.integers(1, 2),
        stop=st.sampled_from([(), (), (3,), (5,)]),
        priority=st.integers(0, 1),
        cache_salt=st.sampled_from([None, None, None, "x"]),
        bypass=st.sampled_from([False, False, False, True]),
        prompt_logprobs=st.sampled_from([False, False, False, True]),  # no hits for output 0
        session=st.sampled_from([None, None, *SESSIONS]),
        pulled=st.sampled_from([None, None, 0, 1 << 20]),  # None: no pulled KV, else the bound
    )
    def add(
        self,
        *,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        num_sequences: int,
        stop: tuple[int, ...],
        priority: int,
        cache_salt: str | None,
        bypass: bool,
        session: str | None,
        pulled: int | None,
        prompt_logprobs: bool = False,
    ) -> None:
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            num_sequences=num_sequences,
            stop_token_ids=stop,
            prompt_logprobs=LogprobRequest() if prompt_logprobs else None,
        )
        request = EngineRequest(
            request_id,
            tuple(prompt),
            sampling,
            priority=priority,
            cache_salt=cache_salt,
            bypass_prefix_cache=bypass,
            kv_session_id=session,
        )
        held_bytes = 0
        if pulled is not None:
            # A DECODE engine's pull: the prompt's full blocks, imported (or held) just before
            # the request is added.
            blocks = [block_bytes(prompt, i) for i in range(len(prompt) // BLOCK)]
            before = self.core.held_import_bytes
            outcome = self.core.import_or_hold_kv_blocks(request, blocks, max_held_bytes=pulled)
            usable = (len(prompt) - 1) // BLOCK  # never the block of the last prompt token
            assert outcome in ("imported", "unused", "held", "dropped")
            if usable == 0:
                assert outcome == "unused"
            if outcome == "held":
                assert request_id not in self.live and not bypass
                held_bytes = usable * BLOCK * DIGEST
                assert self.core.held_import_bytes == before + held_bytes <= pulled
            else:
                assert self.core.held_import_bytes == before
            if outcome == "dropped":
                assert request_id in self.live or before + usable * BLOCK * DIGEST > pulled
        if request_id in self.live:
            with pytest.raises(DuplicateRequestError):
                self.core.add_request(request)
            return
        self.core.add_request(request)
        expected = [
            self.runner.next_tokens(prompt[-1], 0, index, max_tokens)
            for index in range(num_sequences)
        ]
        stop_at = [next((i for i, t in enumerate(e) if t in stop), None) for e in expected]
        self.live[request_id] = Req(
            request,
            expected,
            stop_at,
            got=[[] for _ in range(num_sequences)],
            finished=[None] * num_sequences,
            held_bytes=held_bytes,
        )

    @rule(
        request_id=st.sampled_from(IDS),
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=3, max_size=9),
        max_tokens=st.integers(1, 6),
        session=st.sampled_from([None, *SESSIONS]),
        pulled=st.sampled_from([0, 1 << 20]),
    )
    def add_pulled(
        self,
        *,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        session: str | None,
        pulled: int,
    ) -> None:
        """A DECODE engine's request with the KV of its prompt pulled (more often than `add`
        does it, so that some find the pool busy and their KV held)."""
        self.add(
            request_id=request_id,
            prompt=prompt,
            max_tokens=max_tokens,
            num_sequences=1,
            stop=(),
            priority=0,
            cache_salt=None,
            bypass=False,
            session=session,
            pulled=pulled,
        )

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for output in self.core.step().outputs:
                self._record(output)

    @rule(fail_requests=st.booleans())
    def failing_step(self, fail_requests: bool) -> None:
        """A step whose forward pass raises (if one runs): its scheduled blocks hold no KV. Then
        every request fails, as `EngineLoop` does, or the core just steps on."""
        self.runner.fail_next_pass = True
        try:
            outputs = self.core.step().outputs
        except RuntimeError:
            assert self.core.take_failed_outputs() == []  # nothing ends before a pass
            if fail_requests:
                expected = sum(req.num_unfinished for req in self.live.values())
                outputs = self.core.abort_all(FinishReason.ERROR, "engine step failed")
                assert len(outputs) == expected
                for output in outputs:
                    self._record(output, ended_by=FinishReason.ERROR)
                assert not self.live
            return
        assert self.runner.fail_next_pass  # no pass ran
        self.runner.fail_next_pass = False
        for output in outputs:
            self._record(output)

    @rule(request_id=st.sampled_from(IDS))
    def abort(self, request_id: str) -> None:
        req = self.live.get(request_id)
        outputs = self.core.abort(request_id)
        assert len(outputs) == (0 if req is None else req.num_unfinished)
        for output in outputs:
            self._record(output, ended_by=FinishReason.CANCELLED)
        assert request_id not in self.live

    @rule()
    def abort_all(self) -> None:
        expected = sum(req.num_unfinished for req in self.live.values())
        outputs = self.core.abort_all()
        assert len(outputs) == expected
        for output in outputs:
            self._record(output, ended_by=FinishReason.CANCELLED)
        assert not self.live

    @rule()
    def drain(self) -> None:
        """Step until every request ended, releasing the sessions whenever they block the rest
        (a request short of the blocks they hold waits for their release)."""
        for _ in range(1000):
            if not self.core.has_work():
                break
            result = self.core.step()
            for output in result.outputs:
                self._record(output)
            if result.stats is None and not result.outputs:  # waiting for the sessions
                assert self.sessions, "stuck with no session held"
                for session_id in list(self.sessions):
                    self.release(session_id)
        assert not self.core.has_work() and not self.live

    # ------------------------------------------------------------------ caches and sessions

    @rule()
    def reset_prefix_cache(self) -> None:
        # Refused while any block is in use: by a running sequence or a session's blocks.
        in_use = self.core.load().num_running > 0 or any(self.sessions.values())
        assert self.core.reset_prefix_cache() is not in_use

    @rule(session_id=st.sampled_from(SESSIONS))
    def release(self, session_id: str) -> None:
        assert self.core.release_kv_session(session_id) is (session_id in self.sessions)
        self.sessions.pop(session_id, None)

    @rule(session_id=st.sampled_from(SESSIONS))
    def read(self, session_id: str) -> None:
        tokens = self.sessions.get(session_id)
        if tokens is None:
            with pytest.raises(KeyError):
                self.core.read_kv_session(session_id, 0, 1)
            return
        num_blocks = len(tokens) // BLOCK
        data = self.core.read_kv_session(session_id, 0, num_blocks)
        assert data == b"".join(block_bytes(tokens, i) for i in range(num_blocks))

    # ------------------------------------------------------------------ the model's checks

    def _record(self, output: RequestOutput, *, ended_by: FinishReason | None = None) -> None:
        """Check `output` against the model. `ended_by`: the reason of an abort (not a step)."""
        req = self.live.get(output.request_id)
        assert req is not None, f"an output for {output.request_id!r}, not running: {output}"
        index = output.output_index
        assert req.finished[index] is None, f"an output after the end of {index}: {output}"
        if output.prompt_logprobs is not None:  # once, on output 0, every prompt position
            sampling = req.request.sampling
            assert sampling.prompt_logprobs is not None and index == 0, output
            assert not req.got_prompt_logprobs, output
            req.got_prompt_logprobs = True
            prompt = req.request.prompt_token_ids
            assert [None if e is None else e.token_id for e in output.prompt_logprobs] == [
                None,
                *prompt[1:],
            ]
        got = req.got[index]
        got.extend(output.new_token_ids)
        stop_at = req.stop_at[index]
        limit = len(req.expected[index]) if stop_at is None else stop_at
        assert got == req.expected[index][: len(got)] and len(got) <= limit, (output, req)
        reason = output.finish_reason
        if reason is not None:
            req.finished[index] = reason
            if ended_by is not None:
                assert reason is ended_by, output
            elif reason is FinishReason.STOP:
                assert stop_at is not None and len(got) == stop_at, (output, req)
                assert output.stop_match is not None
                assert output.stop_match.kind is StopKind.STOP_TOKEN
            else:
                assert reason is FinishReason.LENGTH, output
                assert len(got) == limit == req.request.sampling.max_tokens, (output, req)
            session_id = req.request.kv_session_id
            if (
                index == 0
                and session_id is not None
                and ended_by is None
                and session_id not in self.sessions
            ):
                prompt = req.request.prompt_token_ids
                self.sessions[session_id] = prompt[: (len(prompt) - 1) // BLOCK * BLOCK]
                self.session_salts[session_id] = req.request.cache_salt
                req.holds_session = True
        else:
            assert output.usage is None
        if req.num_unfinished:
            assert output.usage is None, output
            return
        assert output.usage is not None, f"the last output of {output.request_id!r}: {output}"
        stops = sum(r is FinishReason.STOP for r in req.finished)
        assert output.usage.prompt_tokens == len(req.request.prompt_token_ids)
        assert output.usage.completion_tokens == sum(map(len, req.got)) + stops
        # What output 0's prompt found cached: whole blocks, never the last prompt token's.
        cached = output.usage.cached_prompt_tokens
        prompt = req.request.prompt_token_ids
        assert cached % BLOCK == 0 and cached <= len(prompt) - 1, output
        if req.request.bypass_prefix_cache or req.request.sampling.prompt_logprobs is not None:
            assert cached == 0, output
        assert output.held_kv_session is req.holds_session
        del self.live[output.request_id]

    @invariant()
    def events_mirror_the_cache(self) -> None:
        for event in self.core.take_kv_events():
            if isinstance(event, BlockStored):
                parent = event.parent_key
                assert parent is None or parent in self.mirror, f"orphan store: {event}"
                for i, key in enumerate(event.block_keys):
                    assert key not in self.mirror, f"stored twice: {event}"
                    tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                    self.mirror[key] = (parent, tokens)
                    parent = key
            elif isinstance(event, BlockRemoved):
                for key in event.block_keys:
                    assert key in self.mirror, f"removed while not cached: {event}"
                    del self.mirror[key]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.mirror.clear()
        bm = self.core.block_manager
        bm.check_invariants()
        assert set(self.mirror) == bm.cached_keys()
        for stored in bm.snapshot():
            (key,) = stored.block_keys
            assert self.mirror[key] == (stored.parent_key, stored.token_ids)

    @invariant()
    def load_and_blocks_agree(self) -> None:
        load = self.core.load()
        bm = self.core.block_manager
        assert load.num_running + load.num_waiting == sum(
            req.num_unfinished for req in self.live.values()
        )
        assert load.num_kv_sessions == len(self.sessions)
        assert load.num_cached_blocks == len(self.mirror)
        assert load.num_used_blocks == bm.num_used_blocks
        assert load.num_total_blocks == NUM_BLOCKS
        assert bm.num_free_blocks + bm.num_used_blocks == NUM_BLOCKS
        for session_id in SESSIONS:
            assert self.core.kv_session_tokens(session_id) == self.sessions.get(session_id)
        # The sessions' blocks: one per distinct prefix of whole blocks (shared when equal).
        session_blocks = {
            (self.session_salts[session_id], tokens[: (i + 1) * BLOCK])
            for session_id, tokens in self.sessions.items()
            for i in range(len(tokens) // BLOCK)
        }
        assert bm.num_used_blocks >= len(session_blocks)
        if not self.live:
            assert bm.num_used_blocks == len(session_blocks), "blocks leaked"
            assert self.core.held_import_bytes == 0
            assert not self.core.has_work()
        assert self.core.held_import_bytes <= sum(req.held_bytes for req in self.live.values())


EngineCoreModel.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineCoreModel = EngineCoreModel.TestCase
