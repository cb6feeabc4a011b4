"""EngineCore: scheduler + block manager + runner + stop checks + detokenisation, one `step()`
at a time.

EngineCore is synchronous and single-threaded: `add_request`, `abort`, `step` and friends must be
called from one thread (`engine.core.engine_loop.EngineLoop` runs them in a dedicated one; it is
re-exported here). A step: schedule (which caches the full blocks the step's chunks fill, so
that a sequence admitted after them in the same step hits them) -> `runner.execute(batch)` ->
release the KV events of those blocks (or, if the pass failed, take them out of the cache) ->
mark the computed tokens -> for every sequence that sampled, stop checks and text deltas ->
`RequestOutput`s. Time comes from the `clock` passed in (a virtual clock
in replay), so the same core runs live and simulated.

KV sessions (disaggregated serving). A PREFILL engine's request carries `kv_session_id`: when
it ends normally with its prompt computed, the prompt blocks a decode engine can reuse (the
full blocks before the one holding the last prompt token) are held under that id by a scratch
block table (ref-counted, so never evicted) until `release_kv_session`; `read_kv_session`
copies their bytes out. A DECODE engine puts pulled blocks into its prefix cache with
`import_or_hold_kv_blocks` just before adding the request they belong to, so that admission
finds them as ordinary prefix hits. Both go through the block manager's own verbs (`allocate`
of the cached prefix or new blocks, `cache_blocks`, `free`) under a scratch sequence id. When
the pool has no room for them then (busy with running sequences), it holds the pulled bytes
instead (host memory, up to a bound) and the scheduler imports them as it admits the request,
in its FCFS turn, once its blocks and first chunk fit (`HeldKv`): the request reports them
cached rather than computing its prompt again. Ended before admission, it drops them.

Guided decoding (`engine.core.guided`, `guided_vocab`): each guided output carries its guide
state; when it samples, the batch gives the runner the token ids its guide allows (EOS only
once the text is complete, and not before `min_tokens`), and the sampled token advances the
state. An output whose guide allows nothing fails its request (FinishReason.ERROR with
ErrorKind.REQUEST, which the servers turn into a terminal INVALID_ARGUMENT error). Unguided
sequences pay one attribute test a step.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable
from collections.abc import Sequence as PySequence
from dataclasses import dataclass, field

from engine.core.api import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    ForwardPassStats,
    KvBlockBytes,
    KvEvent,
    KvImportOutcome,
    LoadSnapshot,
    ModelRunner,
    RequestOutput,
    ScheduledBatch,
    ScheduledSequence,
    SchedulerConfig,
    SequenceResult,
    StepResult,
    StopMatch,
    TokenLogprob,
    Usage,
)
from engine.core.block_manager import BlockManager
from engine.core.detokenizer import IncrementalDetokenizer, Tokenizer
from engine.core.engine_loop import EngineLoop, OutputSink, asyncio_sink
from engine.core.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    LoraNotFoundError,
    PromptTooLongError,
)
from engine.core.guided import compile_guide
from engine.core.guided_vocab import GuidedState, GuideRegistry, GuideTooCostlyError, TokenMasker
from engine.core.lora import LoraAdapter, LoraLoad, LoraRegistry, LoraRunner, LoraSlot
from engine.core.scheduler import ScheduledWork, Scheduler
from engine.core.sequence import Sequence
from engine.core.sim_runner import SimRunner
from engine.core.stopping import StopChecker

__all__ = ["EngineCore", "EngineLoop", "OutputSink", "asyncio_sink"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Output:
    sequence: Sequence
    stop: StopChecker
    detokenizer: IncrementalDetokenizer | None
    finished: bool = False
    masker: TokenMasker | None = None  # guided decoding: the guide and its token masks
    guided: GuidedState | None = None  # ... and where this output is in it


@dataclass(frozen=True, slots=True)
class _HeldSession:
    """A KV session's blocks, held by a scratch block table (`seq_id`)."""

    seq_id: int
    token_ids: tuple[int, ...]  # the tokens whose KV the blocks hold: whole blocks
    lora_name: str | None  # the adapter the KV was computed with


@dataclass(frozen=True, slots=True)
class _HeldImport:
    """A request's pulled KV blocks, held until the scheduler admits it (`import_held_kv`)."""

    token_ids: PySequence[int]
    blocks: PySequence[KvBlockBytes]
    lora_name: str | None
    cache_salt: str | None
    num_tokens: int  # the prompt tokens the blocks cover (whole blocks, never the last token)
    num_bytes: int


@dataclass(slots=True, eq=False)
class _RequestState:
    request: EngineRequest
    lora: LoraSlot | None = None  # held from acceptance to the end (`EngineCore.acquire_lora`)
    outputs: list[_Output] = field(default_factory=list)
    num_unfinished: int = 0
    held_kv_session: bool = False
    # Logprob of the prompt token at each position (index = position; position 0 has none).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=sum(len(o.sequence.output_token_ids) for o in self.outputs),
            # What the prompt found cached when the request was admitted: output 0's hits.
            # The other outputs, admitted after it, also hit the prompt blocks it computes
            # (that same step), which the prompt did not find cached (the router's prediction,
            # vLLM's streamed usage: its first output's).
            cached_prompt_tokens=self.outputs[0].sequence.num_cached_tokens or 0,
        )


class EngineCore:
    """The synchronous engine (see module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: serve up to that many LoRA adapters at once (the runner must be a
        `LoraRunner`); None: no LoRA, a request naming an adapter is refused."""
        self.config = config or SchedulerConfig()
        self.runner = runner
        self.loras: LoraRegistry | None = None
        if max_loras is not None:
            if not isinstance(runner, LoraRunner):
                raise ValueError(f"{type(runner).__name__} does not serve LoRA adapters")
            self.loras = LoraRegistry(max_loras)
        self.tokenizer = tokenizer
        self._guides = (
            GuideRegistry(tokenizer, runner.eos_token_ids) if tokenizer is not None else None
        )
        self.clock = clock
        self.block_manager = BlockManager(
            runner.num_blocks,
            runner.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            medium=self.config.medium,
        )
        self.scheduler = Scheduler(self.config, self.block_manager, held_kv=self)
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = runner.eos_token_ids
        self._requests: dict[str, _RequestState] = {}
        self._outputs_by_seq: dict[int, _Output] = {}
        self._kv_sessions: dict[str, _HeldSession] = {}
        self._held_imports: dict[str, _HeldImport] = {}  # request id -> its pulled KV
        self._held_import_bytes = 0
        self._next_seq_id = 0
        self._next_arrival = 0
        self._last_prefill_batch = 0
        self._last_decode_batch = 0
        # What the last step or abort of all produced before it raised (`take_failed_outputs`).
        self._failed_outputs: list[RequestOutput] = []

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    # ---------------------------------------------------------------- requests

    def check_request(self, request: EngineRequest, *, lora: LoraSlot | None = None) -> None:
        """Validate without side effects; reads only immutable configuration and the LoRA
        registry's immutable snapshot (thread-safe). `lora`: the slot the request holds
        already (`acquire_lora`), which serves it whether or not its name is loaded now."""
        if not request.request_id:
            raise InvalidRequestError("request_id must be non-empty")
        if not request.prompt_token_ids:
            raise InvalidRequestError("the prompt must have at least one token")
        try:  # one C-speed pass: an unsigned 32-bit array refuses anything out of range
            array("I", request.prompt_token_ids)
        except (OverflowError, TypeError):
            raise InvalidRequestError("token ids must be integers in [0, 2**32)") from None
        request.sampling.validate()
        if request.sampling.num_sequences > self.config.max_num_seqs:
            # One sequence per output, built at once on the engine thread: bounded by the seats
            # (what ModelInfo advertises as max_num_sequences).
            raise InvalidRequestError(
                f"num_sequences {request.sampling.num_sequences} is more than this engine's "
                f"max_num_seqs {self.config.max_num_seqs}"
            )
        if request.sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
        if request.guided is not None:
            if self.tokenizer is None or isinstance(self.runner, SimRunner):
                raise InvalidRequestError(
                    "guided decoding needs a tokenizer and a model's logits; this engine "
                    "(sim runner or no tokenizer) has none"
                )
            compile_guide(request.guided)  # memoised: add_request's masker reuses it
        if request.lora_name is not None and lora is None:
            # The registry's snapshot: the request holds the adapter from `acquire_lora`.
            if self.loras is None:
                raise LoraNotFoundError("this engine serves no LoRA adapters")
            self.loras.check_request(request.lora_name)
        num_prompt = len(request.prompt_token_ids)
        if num_prompt + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {num_prompt} tokens leaves no room for output in a context of "
                f"{self.max_model_len}"
            )
        room = self.max_model_len - num_prompt
        if request.sampling.min_tokens > room:
            # The output ends at the context (LENGTH) before its minimum: refused, as vLLM
            # refuses a minimum above the maximum it caps at the context.
            raise InvalidRequestError(
                f"a minimum of {request.sampling.min_tokens} new tokens does not fit: the "
                f"context of {self.max_model_len} leaves {room} after a prompt of {num_prompt}"
            )
        # The KV of the prompt and of every output token but the last (a sampled token is
        # computed only to sample the next): what the shortest output the request must produce
        # (one token, or `min_tokens`) holds at its end. Beyond that, an output ends at the
        # cache (LENGTH, "KV cache full") as it ends at the context.
        min_tokens = request.sampling.min_tokens
        bm = self.block_manager
        if bm.blocks_for(num_prompt + max(min_tokens, 1) - 1) > bm.num_blocks:
            with_min = f" and min_tokens {min_tokens}" if min_tokens > 1 else ""
            raise PromptTooLongError(
                f"prompt of {num_prompt} tokens{with_min} does not fit the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size})"
            )

    def acquire_lora(self, request: EngineRequest) -> LoraSlot | None:
        """The slot of the request's adapter, held from now (any thread: a server calls this
        as it accepts the request) until the request ends: an unload, or another adapter
        loaded under the name, never takes it from the request. None without an adapter;
        raises LoraNotFoundError when its adapter is not loaded."""
        if request.lora_name is None:
            return None
        if self.loras is None:
            raise LoraNotFoundError("this engine serves no LoRA adapters")
        return self.loras.acquire(request.lora_name)

    def add_request(self, request: EngineRequest, *, lora: LoraSlot | None = None) -> None:
        """Queue a request (one sequence per output). Raises before accepting anything.
        `lora`: its adapter's slot, acquired at acceptance (`acquire_lora`); None: acquired
        here. The request owns the slot from here: released when it ends, or at once if this
        raises."""
        try:
            self.check_request(request, lora=lora)
            if request.request_id in self._requests:
                raise DuplicateRequestError(f"request {request.request_id!r} is already running")
            if lora is None:
                lora = self.acquire_lora(request)
        except Exception:
            if lora is not None:
                self.release_lora(lora)
            if request.request_id not in self._requests:
                self._drop_held_import(request.request_id)
            raise
        sampling = request.sampling
        num_prompt = len(request.prompt_token_ids)
        room = self.max_model_len - num_prompt
        max_new = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        state = _RequestState(request, lora, num_unfinished=sampling.num_sequences)
        if sampling.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * num_prompt
        now_s = self.clock()
        for index in range(sampling.num_sequences):
            seq = Sequence(self._new_seq_id(), request, index, self._next_arrival, now_s, lora=lora)
            self._next_arrival += 1
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
            output = _Output(seq, StopChecker(sampling, self.eos_token_ids, max_new), detok)
            if request.guided is not None and self._guides is not None:
                output.masker = self._guides.masker(request.guided)
                output.guided = output.masker.start()
            state.outputs.append(output)
            self._outputs_by_seq[seq.seq_id] = output
            self.scheduler.add(seq)
        self._requests[request.request_id] = state

    def _new_seq_id(self) -> int:
        """Sequences and the scratch tables of KV sessions share one id space."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id runs (added and not ended)."""
        return request_id in self._requests

    def abort(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.CANCELLED,
        message: str = "aborted",
    ) -> list[RequestOutput]:
        """Finish every unfinished output as `reason` (CANCELLED; ERROR where a failure ends
        the request); [] when unknown or already finished. One that raises partway has
        forgotten the request all the same (`holds` is false, its blocks free), its end never
        emitted."""
        return self._finish_request(request_id, reason, message)

    def abort_all(
        self, reason: FinishReason = FinishReason.CANCELLED, message: str = "aborted"
    ) -> list[RequestOutput]:
        """`abort` of every request. One that raises has ended requests maybe (their ends
        nowhere else), which `take_failed_outputs` hands over; the one whose end raised it
        forgot (`abort`), and it left the others running."""
        outputs: list[RequestOutput] = []
        try:
            for request_id in list(self._requests):
                outputs.extend(self._finish_request(request_id, reason, message))
        except BaseException:
            self._failed_outputs = outputs
            raise
        return outputs

    def _finish_request(
        self,
        request_id: str,
        reason: FinishReason,
        message: str,
        error: ErrorKind = ErrorKind.ENGINE,
    ) -> list[RequestOutput]:
        """End each unfinished output of a request (`_finish`: one that raises forgets it)."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        return [
            self._finish(state, out, reason, None, out.stop.finish(), message=message, error=error)
            for out in state.outputs
            if not out.finished
        ]

    def _forget(self, state: _RequestState) -> None:
        """A request whose end raised partway (an output marked finished, its blocks not freed
        yet, say; in an abort or in a step): out of the core all the same, its end never
        emitted, rather than held with nothing left to finish, its id taken for ever. Each of
        its sequences leaves the scheduler wherever it is and frees its blocks, its LoRA slot
        and held pulled KV go, and so does the KV session it held (which only its end
        announces). Forgetting it again does nothing."""
        request_id = state.request.request_id
        if self._requests.get(request_id) is state:  # (else its end got that far)
            del self._requests[request_id]
        self._drop_held_import(request_id)
        for out in state.outputs:
            out.finished = True
            self._outputs_by_seq.pop(out.sequence.seq_id, None)
            try:
                self.scheduler.forget(out.sequence)
            except Exception:
                logger.exception("freeing sequence %d failed", out.sequence.seq_id)
        state.num_unfinished = 0
        if state.held_kv_session:
            state.held_kv_session = False
            session_id = state.request.kv_session_id
            assert session_id is not None  # (held for it alone)
            try:
                self.release_kv_session(session_id)
            except Exception:
                logger.exception("releasing KV session %s failed", session_id)
        self._release_request_lora(state)

    def _release_request_lora(self, state: _RequestState) -> None:
        """Release the LoRA slot `state` holds, once (its end, or `_forget`)."""
        lora, state.lora = state.lora, None
        if lora is not None:
            try:
                self.release_lora(lora)
            except Exception:  # (its weights freed by the runner): the request ends all the
                # same, or its end, the request forgotten already, would never come
                logger.exception("freeing LoRA slot %s failed", lora.key)

    def _finish(
        self,
        state: _RequestState,
        out: _Output,
        reason: FinishReason,
        stop_match: StopMatch | None,
        text: str,
        *,
        message: str = "",
        error: ErrorKind = ErrorKind.ENGINE,
        new_token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> RequestOutput:
        """End `out` (its request too, with `usage`, if it was the last): an abort's, or a
        step's (STOP, LENGTH, "KV cache full", a guide's dead end). One that raises partway
        forgets the request (`_forget`), its end never emitted: a step that raises so leaves
        it to `EngineLoop`, which makes up an ERROR end for it."""
        try:
            out.finished = True
            if (
                state.request.kv_session_id is not None
                and out.sequence.output_index == 0
                and reason in (FinishReason.STOP, FinishReason.LENGTH)
            ):
                if out.sequence.caches_blocks:
                    # Before `remove` frees the sequence's blocks: they must not become evictable.
                    state.held_kv_session = self._hold_kv_session(state.request, out.sequence)
                else:
                    message = message or _superseded_session_message(state.request)
            self.scheduler.remove(out.sequence)
            del self._outputs_by_seq[out.sequence.seq_id]
            state.num_unfinished -= 1
            usage = None
            if state.num_unfinished == 0:
                usage = state.usage()
                del self._requests[state.request.request_id]
                self._drop_held_import(state.request.request_id)
                self._release_request_lora(state)
            return RequestOutput(
                request_id=state.request.request_id,
                output_index=out.sequence.output_index,
                new_token_ids=new_token_ids,
                new_text=text,
                logprobs=logprobs,
                prompt_logprobs=self._take_prompt_logprobs(state, out),
                finish_reason=reason,
                stop_match=stop_match,
                message=message,
                error=error,
                usage=usage,
                held_kv_session=usage is not None and state.held_kv_session,
            )
        except BaseException:
            self._forget(state)
            raise

    # ---------------------------------------------------------------- LoRA adapters

    def _lora_runner(self) -> tuple[LoraRegistry, LoraRunner]:
        if self.loras is None or not isinstance(self.runner, LoraRunner):
            raise LoraNotFoundError("this engine serves no LoRA adapters")
        return self.loras, self.runner

    def load_lora(self, adapter: LoraAdapter, weights: object) -> LoraLoad:
        """Serve `weights` (the runner's `read_lora`) as `adapter` (`LoraLoad` says what was
        done). Loaded afresh, in a new slot (`LoraSlot`), the name's cached blocks, computed
        with an earlier adapter of that name, are dropped first (BlockRemoved), and so are the
        KV sessions held with it (a later pull of one is NOT_FOUND) and the pulled KV held for
        its waiting requests (`import_or_hold_kv_blocks`: they compute their prompts): prefix
        hits never cross adapters. Requests still holding the name's earlier slot (unloaded
        while they ran) run on with its weights, out of the prefix cache
        (`LoraSlot.superseded`). Resumed (this very adapter, unloaded while its requests still
        run), it is served again as it is: the runner's weights, its cached blocks and sessions
        are its own (`weights` is unused)."""
        loras, runner = self._lora_runner()
        if loras.check_load(adapter) is LoraLoad.LOADED:
            stale = [
                sid for sid, held in self._kv_sessions.items() if held.lora_name == adapter.name
            ]
            for session_id in stale:
                self.release_kv_session(session_id)
            for request_id in [
                rid for rid, held in self._held_imports.items() if held.lora_name == adapter.name
            ]:  # their requests, out of the prefix cache now, compute their prompts
                self._drop_held_import(request_id)
            self.block_manager.drop_lora_blocks(adapter.name)
        outcome, slot = loras.load(adapter)
        if outcome is LoraLoad.LOADED:
            runner.add_lora(slot.key, weights)
        return outcome

    def unload_lora(self, name: str) -> LoraAdapter:
        """Forget the name for new requests; the runner keeps the weights until the requests
        already holding them end (as vLLM: a request accepted before the unload is served)."""
        loras, runner = self._lora_runner()
        adapter, freed = loras.remove(name)
        if freed is not None:
            runner.remove_lora(freed.key)
        return adapter

    def release_lora(self, slot: LoraSlot) -> None:
        """A request holding `slot` ended, or was never added (engine thread)."""
        loras, runner = self._lora_runner()
        if loras.release(slot):
            runner.remove_lora(slot.key)

    # ---------------------------------------------------------------- KV sessions

    def _hold_kv_session(self, request: EngineRequest, seq: Sequence) -> bool:
        """Hold the prompt's reusable blocks under `request.kv_session_id` (False when the
        prompt was never computed in full, e.g. the KV cache was full, or the id is taken).

        The sequence has just cached its full blocks, so they are the prompt's prefix hits;
        a scratch table takes them (no new block: hits only), so they outlive the sequence.
        Hits never cover the last prompt token, and neither does a session: a decode engine
        computes that token itself."""
        session_id = request.kv_session_id
        if (
            session_id is None
            or session_id in self._kv_sessions
            or seq.num_computed_tokens < seq.num_prompt_tokens
        ):
            return False
        bm = self.block_manager
        prompt = request.prompt_token_ids
        lora_name, cache_salt = request.lora_name, request.cache_salt
        num_tokens = bm.count_hit_tokens(prompt, lora_name=lora_name, cache_salt=cache_salt)
        scratch = self._new_seq_id()
        bm.allocate(scratch, prompt, num_tokens, lora_name=lora_name, cache_salt=cache_salt)
        self._kv_sessions[session_id] = _HeldSession(scratch, prompt[:num_tokens], lora_name)
        return True

    @property
    def num_kv_sessions(self) -> int:
        return len(self._kv_sessions)

    def kv_session_tokens(self, session_id: str) -> tuple[int, ...] | None:
        """The tokens whose KV a held session has (whole blocks); None if not held."""
        held = self._kv_sessions.get(session_id)
        return None if held is None else held.token_ids

    def read_kv_session(self, session_id: str, first_block: int, num_blocks: int) -> bytes:
        """The bytes of `num_blocks` of a held session's blocks from `first_block`, one block
        after another (KeyError when the session is not held)."""
        table = self.block_manager.block_table(self._kv_sessions[session_id].seq_id)
        return self.runner.read_kv_blocks(table[first_block : first_block + num_blocks])

    def release_kv_session(self, session_id: str) -> bool:
        """Stop holding a session's blocks: they stay in the prefix cache, evictable as any
        cached block. False when it was not held."""
        held = self._kv_sessions.pop(session_id, None)
        if held is None:
            return False
        self.block_manager.free(held.seq_id)
        return True

    def import_or_hold_kv_blocks(
        self, request: EngineRequest, blocks: PySequence[KvBlockBytes], *, max_held_bytes: int
    ) -> KvImportOutcome:
        """Put KV computed elsewhere into the prefix cache: `blocks[i]` holds the KV of full
        block i of `request`'s prompt (the request about to be added). Blocks already cached
        here are kept (allocate takes them as hits); the others get new blocks, written by
        the runner, then cached (recording BlockStored) and freed, evictable as any cached
        prefix: "imported". Hits never cover the last prompt token: a block holding it is
        neither used nor imported. When the pool has no room now, hold the blocks (their
        bytes, while all the requests' held bytes stay within `max_held_bytes`) for the
        scheduler to import as it admits the request: "held". Beyond the bound (or for a
        request whose id is in use already) they are "dropped", a warning saying which, and
        the request computes its prompt. "unused": nothing to import (cached here already,
        or no full block before the last token), or no room and a request that bypasses the
        prefix cache. A write the runner refuses raises its error, nothing cached."""
        token_ids = request.prompt_token_ids
        lora_name, cache_salt = request.lora_name, request.cache_salt
        # Whole blocks, never the one holding the last prompt token (its KV is recomputed).
        num_blocks = max(0, min(len(blocks), (len(token_ids) - 1) // self.block_size))
        blocks = blocks[:num_blocks]
        written = self._import(token_ids, blocks, lora_name=lora_name, cache_salt=cache_salt)
        if written is not None:
            return "imported" if written else "unused"
        if request.bypass_prefix_cache:
            return "unused"  # it would not read them
        num_bytes = sum(len(block) for block in blocks)
        if request.request_id in self._held_imports or request.request_id in self._requests:
            logger.warning(
                "request %s: its %d pulled KV blocks dropped: its id is in use already (a "
                "duplicate, which the engine refuses)", request.request_id, num_blocks,
            )  # fmt: skip
            return "dropped"
        if self._held_import_bytes + num_bytes > max_held_bytes:
            logger.warning(
                "request %s: no room for its %d pulled KV blocks (%d bytes) in the pool nor "
                "beside the %d bytes held already (kv_transfer.max_held_kv_bytes %d): it "
                "computes its prompt", request.request_id, num_blocks, num_bytes,
                self._held_import_bytes, max_held_bytes,
            )  # fmt: skip
            return "dropped"
        self._held_imports[request.request_id] = _HeldImport(
            token_ids,
            blocks,
            lora_name,
            cache_salt,
            num_blocks * self.block_size,
            num_bytes,
        )
        self._held_import_bytes += num_bytes
        return "held"

    @property
    def held_import_bytes(self) -> int:
        """The bytes of pulled KV held for requests not yet admitted."""
        return self._held_import_bytes

    def held_kv_tokens(self, seq: Sequence) -> int:
        """`HeldKv`: the prompt tokens whose pulled KV is held for `seq`'s request (0: none)."""
        held = self._held_imports.get(seq.request_id)
        return 0 if held is None or not seq.use_prefix_cache else held.num_tokens

    def import_held_kv(self, seq: Sequence) -> None:
        """`HeldKv`: the scheduler admits `seq` and has room for its held KV: import it."""
        held = self._drop_held_import(seq.request_id)
        if held is None:
            return
        try:  # as `EngineLoop.submit`'s `before`: on failure, the request computes its prompt
            self._import(
                held.token_ids, held.blocks, lora_name=held.lora_name, cache_salt=held.cache_salt
            )
        except Exception:
            logger.exception("importing the held KV of request %s failed", seq.request_id)

    def _drop_held_import(self, request_id: str) -> _HeldImport | None:
        held = self._held_imports.pop(request_id, None)
        if held is not None:
            self._held_import_bytes -= held.num_bytes
        return held

    def _import(
        self,
        token_ids: PySequence[int],
        blocks: PySequence[KvBlockBytes],
        *,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> int | None:
        """Import `blocks`, the first full blocks of `token_ids` (`import_or_hold_kv_blocks`,
        which counts them): how many were written; None when the pool has no room."""
        bm = self.block_manager
        size = bm.block_size
        num_blocks = len(blocks)
        if num_blocks == 0 or not bm.enable_prefix_caching:
            return 0
        num_tokens = num_blocks * size
        if not bm.can_allocate(token_ids, num_tokens, lora_name=lora_name, cache_salt=cache_salt):
            return None
        scratch = self._new_seq_id()
        num_hit = (
            bm.allocate(scratch, token_ids, num_tokens, lora_name=lora_name, cache_salt=cache_salt)
            // size
        )
        try:
            if num_hit >= num_blocks:
                return 0
            table = bm.block_table(scratch)
            # The runner checks sizes before writing anything; a failure leaves the new
            # blocks uncached, so `free` returns them with nothing recorded.
            self.runner.write_kv_blocks(table[num_hit:num_blocks], blocks[num_hit:num_blocks])
            bm.cache_blocks(scratch, token_ids, num_tokens)
        finally:
            bm.free(scratch)
        return num_blocks - num_hit

    # ---------------------------------------------------------------- one step

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, on_pass_start: Callable[[], object] | None = None) -> StepResult:
        """Schedule and run one forward pass. `on_pass_start()` runs once the pass is decided,
        before it computes: `load()` then describes the pass in progress (the sequences it
        admitted count running, its batch sizes are this pass's), which `EngineLoop` publishes
        so that GetLoad never misses a request during the pass that admits it.

        One that raises has produced outputs maybe (a request it ended among them, whose end
        is nowhere else): `take_failed_outputs` hands them over. One that raised as it
        ended a request has forgotten it (`holds` is false), its end never emitted."""
        outputs: list[RequestOutput] = []
        try:
            return self._step(outputs, on_pass_start)
        except BaseException:
            self._failed_outputs = outputs
            raise

    def take_failed_outputs(self) -> list[RequestOutput]:
        """The outputs the last `step` or `abort_all` produced before it raised, once: a
        caller failing or aborting the requests left hands them over first."""
        outputs, self._failed_outputs = self._failed_outputs, []
        return outputs

    def _step(
        self, outputs: list[RequestOutput], on_pass_start: Callable[[], object] | None
    ) -> StepResult:
        """`step`, its outputs appended to `outputs` as they come."""
        started_s = self.clock()
        sched = self.scheduler.schedule(started_s)
        try:
            for seq in sched.out_of_capacity:
                out = self._outputs_by_seq[seq.seq_id]
                state = self._requests[seq.request_id]
                outputs.append(
                    self._finish(
                        state,
                        out,
                        FinishReason.LENGTH,
                        None,
                        out.stop.finish(),
                        message="KV cache full",
                    )
                )
            if not sched.scheduled:
                self._last_prefill_batch = self._last_decode_batch = 0
                return StepResult(outputs, None, len(sched.preempted))
            batch, dead_ends = self._build_batch(sched.scheduled)
            num_decode = batch.num_decode_sequences
            self._last_decode_batch = num_decode
            self._last_prefill_batch = len(batch.sequences) - num_decode
            if on_pass_start is not None:
                on_pass_start()
            results = {r.seq_id: r for r in self.runner.execute(batch)}
        except BaseException:
            # The pass did not run: the blocks it was to fill hold no KV (the block manager's
            # Scheduled blocks); the caller fails the requests (`EngineLoop`).
            self.scheduler.discard_step()
            raise
        self.block_manager.commit_scheduled()
        duration_s = self.clock() - started_s
        for work, scheduled in zip(sched.scheduled, batch.sequences, strict=True):
            if work.sequence.seq_id not in self._outputs_by_seq:
                continue  # its request failed earlier in this loop (a guide's dead end)
            if work.sequence.seq_id in dead_ends:
                outputs.extend(self._fail_guided(work.sequence, dead_ends[work.sequence.seq_id]))
                continue
            output = self._on_computed(work, scheduled, results.get(work.sequence.seq_id))
            if output is not None:
                outputs.append(output)
        stats = ForwardPassStats(
            duration_s=duration_s,
            batch_size=len(batch.sequences),
            num_scheduled_tokens=batch.num_scheduled_tokens,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_sequences=num_decode,
            num_cached_tokens=sched.num_cached_tokens,
            num_preempted=len(sched.preempted),
        )
        return StepResult(outputs, stats, len(sched.preempted))

    def fast_forward_decode(self, until_s: float) -> list[RequestOutput]:
        """Offline replay with the sim runner only: run consecutive pure-decode passes in one
        call, as `step()` would, while they start before `until_s` (the next arrival).

        Applies only when nothing waits, every running sequence decodes, no block fills or
        needs allocating, no output can finish (it stops one token short of its limit) and no
        stop token, stop string, EOS, tokenizer or logprobs is involved; otherwise it does
        nothing and returns []. The tokens, timing and block state are exactly those of the
        same passes run by `step()`; only the per-pass outputs are merged (one output per
        sequence) and no ForwardPassStats are produced. KV events cannot occur in such passes.
        """
        runner = self.runner
        scheduler = self.scheduler
        running = scheduler.running
        if (
            not isinstance(runner, SimRunner)
            or runner.clock is None
            or scheduler.num_waiting
            or not running
            or len(running) > self.config.max_num_batched_tokens
        ):
            return []
        size = self.block_size
        max_steps: int | None = None
        context = 0
        for seq in running:
            out = self._outputs_by_seq[seq.seq_id]
            sampling = seq.request.sampling
            if (
                seq.num_uncomputed_tokens != 1
                or not seq.output_token_ids
                or out.detokenizer is not None
                or sampling.stop
                or sampling.stop_token_ids
                or sampling.logprobs is not None
                or (runner.may_emit_eos and not sampling.ignore_eos)
            ):
                return []
            computed = seq.num_computed_tokens
            if len(self.block_manager.block_table(seq.seq_id)) * size <= computed:
                return []  # the next pass needs a new block
            # Stay inside the current block without filling it; stop one token short of LENGTH.
            limit = min(size - 1 - computed % size, out.stop.num_remaining_tokens - 1)
            max_steps = limit if max_steps is None else min(max_steps, limit)
            context += seq.num_tokens
        num_steps, end_s = runner.timing.decode_run(
            start_s=self.clock(),
            until_s=until_s,
            max_steps=max_steps or 0,
            num_sequences=len(running),
            context_tokens=context,
            capacity_tokens=self.block_manager.num_blocks * size,
        )
        if num_steps == 0:
            return []
        runner.pass_time_until(end_s, num_steps)
        outputs: list[RequestOutput] = []
        for seq in running:
            new_tokens = runner.next_tokens(
                seq.token_ids[-1], len(seq.output_token_ids), seq.output_index, num_steps
            )
            seq.token_ids.extend(new_tokens)
            seq.output_token_ids.extend(new_tokens)
            seq.num_computed_tokens += num_steps
            self._outputs_by_seq[seq.seq_id].stop.skip_tokens(num_steps)
            outputs.append(
                RequestOutput(seq.request_id, seq.output_index, new_token_ids=tuple(new_tokens))
            )
        self._last_prefill_batch, self._last_decode_batch = 0, len(running)
        return outputs

    def _build_batch(self, scheduled: list[ScheduledWork]) -> tuple[ScheduledBatch, dict[int, str]]:
        """The runner's batch, and the guided sequences whose guide allows no token (seq id ->
        why): they compute this step, but what they sample is dropped."""
        sequences: list[ScheduledSequence] = []
        dead_ends: dict[int, str] = {}
        num_prefill = num_decode = decode_context = 0
        for work in scheduled:
            seq = work.sequence
            start = seq.num_computed_tokens
            end = start + work.num_new_tokens
            # Decode: computing the one token it sampled itself (a last prompt token is prefill).
            if seq.num_uncomputed_tokens == 1 and seq.output_token_ids:
                num_decode += 1
                decode_context += seq.num_tokens
            else:
                num_prefill += work.num_new_tokens
            sampling = seq.request.sampling
            want_prompt_logprobs = (
                sampling.prompt_logprobs is not None
                and seq.output_index == 0
                and not self._requests[seq.request_id].prompt_logprobs_sent
                and start < seq.num_prompt_tokens - 1
            )
            allowed: tuple[int, ...] | None = None
            if seq.request.guided is not None and end == seq.num_tokens:
                found = self._allowed_tokens(self._outputs_by_seq[seq.seq_id])
                if isinstance(found, str):
                    dead_ends[seq.seq_id] = found
                else:
                    allowed = found
            sequences.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    request_id=seq.request_id,
                    output_index=seq.output_index,
                    token_ids=seq.token_ids[start:end],
                    start_position=start,
                    block_table=self.block_manager.block_table(seq.seq_id),
                    sample=end == seq.num_tokens,
                    sampling=sampling,
                    seed=None if sampling.seed is None else sampling.seed + seq.output_index,
                    prompt_token_ids=seq.request.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    prompt_logprobs=sampling.prompt_logprobs if want_prompt_logprobs else None,
                    lora_key=None if seq.lora is None else seq.lora.key,
                    allowed_token_ids=allowed,
                )
            )
        batch = ScheduledBatch(
            sequences=tuple(sequences),
            num_scheduled_tokens=sum(w.num_new_tokens for w in scheduled),
            num_prefill_tokens=num_prefill,
            num_decode_sequences=num_decode,
            num_decode_context_tokens=decode_context,
        )
        return batch, dead_ends

    def _allowed_tokens(self, out: _Output) -> tuple[int, ...] | str:
        """The ids a guided output may sample next, or why there are none."""
        assert out.masker is not None and out.guided is not None  # a guided request's output
        try:
            allowed, complete = out.masker.allowed(out.guided)
        except GuideTooCostlyError as exc:
            return str(exc)
        sampling = out.sequence.request.sampling
        early = len(out.sequence.output_token_ids) < sampling.min_tokens
        if early and sampling.stop_token_ids:
            stops = set(sampling.stop_token_ids)
            allowed = tuple(t for t in allowed if t not in stops)
        if complete and not early and not sampling.ignore_eos:
            allowed += tuple(sorted(self.eos_token_ids))
        if sampling.allowed_token_ids is not None:
            allow_list = set(sampling.allowed_token_ids)
            narrowed = tuple(t for t in allowed if t in allow_list)
            if allowed and not narrowed:
                return (
                    "guided decoding: allowed_token_ids holds none of the tokens that continue "
                    "or end the constrained output"
                )
            allowed = narrowed
        if allowed:
            return allowed
        if complete:
            return (
                "guided decoding: the output is complete and cannot be extended, but "
                "min_tokens or ignore_eos forbid ending it"
            )
        return "guided decoding: no token of the vocabulary continues the constrained output"

    def _fail_guided(self, seq: Sequence, why: str) -> list[RequestOutput]:
        """End the whole request: an application failure is one terminal error (the seed). Its
        guide, not the engine, failed: the constraint cannot be met with this vocabulary (or
        within the work bound), so it is the request's error."""
        return self._finish_request(seq.request_id, FinishReason.ERROR, why, ErrorKind.REQUEST)

    def _on_computed(
        self, work: ScheduledWork, scheduled: ScheduledSequence, result: SequenceResult | None
    ) -> RequestOutput | None:
        seq = work.sequence
        seq.num_computed_tokens += work.num_new_tokens  # its full blocks are cached (scheduler)
        state = self._requests[seq.request_id]
        out = self._outputs_by_seq[seq.seq_id]
        if result is None:
            raise RuntimeError(f"runner returned no result for sequence {seq.seq_id}")
        if scheduled.prompt_logprobs is not None and state.prompt_logprobs is not None:
            first = scheduled.start_position + 1
            for offset, entry in enumerate(result.prompt_logprobs):
                state.prompt_logprobs[first + offset] = entry
        if not scheduled.sample:
            return None
        if result.token_id is None:
            raise RuntimeError(f"runner sampled no token for sequence {seq.seq_id}")
        token_id = result.token_id
        if out.masker is not None and out.guided is not None and token_id not in self.eos_token_ids:
            guided = out.masker.advance(out.guided, token_id)
            if guided is None:  # the runner sampled outside the mask: a runner bug
                raise RuntimeError(f"sequence {seq.seq_id} sampled {token_id} against its guide")
            out.guided = guided
        seq.append_token(token_id)
        delta = out.detokenizer.add(token_id) if out.detokenizer is not None else ""
        decision = out.stop.on_token(token_id, delta)
        emitted = (token_id,) if decision.emit_token else ()
        logprobs = None
        if seq.request.sampling.logprobs is not None:
            chosen = result.logprob
            logprobs = (chosen,) if decision.emit_token and chosen is not None else ()
        if decision.finish_reason is None:
            return RequestOutput(
                request_id=seq.request_id,
                output_index=seq.output_index,
                new_token_ids=emitted,
                new_text=decision.text_delta,
                logprobs=logprobs,
                prompt_logprobs=self._take_prompt_logprobs(state, out),
            )
        # Bytes of an unfinished character that the detokenizer still holds are not emitted,
        # whatever ends the output (vLLM's final text): the text ends on its last whole character.
        return self._finish(
            state,
            out,
            decision.finish_reason,
            decision.stop_match,
            decision.text_delta,
            new_token_ids=emitted,
            logprobs=logprobs,
        )

    def _take_prompt_logprobs(
        self, state: _RequestState, out: _Output
    ) -> tuple[TokenLogprob | None, ...] | None:
        """The request's prompt logprobs, once, on output 0's first output after the prompt."""
        seq = out.sequence
        if (
            state.prompt_logprobs is None
            or state.prompt_logprobs_sent
            or seq.output_index != 0
            or seq.num_computed_tokens < seq.num_prompt_tokens
        ):
            return None
        state.prompt_logprobs_sent = True
        start = seq.request.sampling.prompt_logprob_start
        return tuple(state.prompt_logprobs[start:])

    # ---------------------------------------------------------------- observations

    def take_kv_events(self) -> list[KvEvent]:
        return self.block_manager.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def load(self) -> LoadSnapshot:
        running = self.scheduler.running
        waiting = self.scheduler.waiting()
        bm = self.block_manager
        return LoadSnapshot(
            num_running=len(running),
            num_waiting=len(waiting),
            num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            num_total_blocks=bm.num_blocks,
            running_tokens=sum(s.num_tokens for s in running),
            waiting_tokens=sum(s.num_uncomputed_tokens for s in waiting),
            num_kv_sessions=len(self._kv_sessions),
            # The batch of the pass in progress, else of the last one while its sequences still
            # run; an engine that ran its last request out is idle, not still "batching" it
            # (GetLoad is a point-in-time snapshot).
            prefill_batch_size=self._last_prefill_batch if running else 0,
            decode_batch_size=self._last_decode_batch if running else 0,
        )


def _superseded_session_message(request: EngineRequest) -> str:
    """Why a prefill's KV is not held for its session: its adapter's name serves other weights
    now (`LoraSlot.superseded`), and its KV, computed with the earlier ones, is not theirs."""
    return (
        f"LoRA adapter {request.lora_name!r} was loaded again, with other weights, while the "
        "prefill ran: its KV, computed with the earlier weights, is not held for a session "
        "(the name serves the new ones now; a retry prefills with them)"
    )
