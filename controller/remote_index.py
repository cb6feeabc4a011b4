"""The controller's remote index (`index: {remote: HOST:PORT}`): a `kvplane indexer` asked
through its KvIndex RPCs instead of an index in the controller's process."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, TypeVar

import grpc

from controller.router import PrefixHit, cacheable_blocks
from indexer.backend import IndexStats, WorkerStats
from indexer.batch import Tier
from indexer.servicer import prompt_block_keys
from kvplane.channels import (
    INSECURE,
    ClientChannels,
    ClientSettings,
    Redialling,
    failure_details,
)
from kvplane.errors import KvplaneError
from kvplane_api.v1 import index_pb2 as ipb
from kvplane_api.v1 import index_pb2_grpc as ipb_grpc

log = logging.getLogger(__name__)


def keep_best_hit(
    hits: dict[str, PrefixHit],
    engine: str,
    hit: PrefixHit,
    worth: Callable[[PrefixHit, int], float],
    cacheable: int,
) -> None:
    """Record `hit` for `engine` unless it already has one worth as much (`worth`: the
    routing policy's `Policy.hit_worth`, what a hit saves as the policy weighs the tiers, for
    a prompt that can be served `cacheable` blocks from cache, `cacheable_blocks`: never the
    block of its last token): an engine followed rank by rank (one worker per data-parallel
    rank) holds what its worthiest rank holds, the rank the policy would choose. Of equal
    worths, the larger hit by tier order (device, host, disk)."""
    kept = hits.get(engine)
    if kept is None or (worth(hit, cacheable), hit) > (worth(kept, cacheable), kept):
        hits[engine] = hit


_Reply = TypeVar("_Reply")

_KEY_SPACES = {
    "canonical": ipb.KEY_SPACE_CANONICAL,
    "sha256": ipb.KEY_SPACE_VLLM_SHA256,
    "sha256_cbor": ipb.KEY_SPACE_VLLM_SHA256_CBOR,
}
_KEY_SPACE_NAMES = {space: name for name, space in _KEY_SPACES.items()}

# An indexer that sheds queries (RESOURCE_EXHAUSTED: more in flight than it takes) protects
# itself, and the next query may well be answered: the index counts as not answering once
# queries have been shed for this long with none answered (at least two sheds, the first this
# long ago, by the time of the next query or of the read of `unavailable`, however far apart
# the queries were; a single shed never counts).
SHEDDING_DEGRADES_AFTER_S = 10.0

# The query that asks a shedding indexer whether it answers queries again while no request
# does (`ask_while_shedding`): a prompt of one block, admitted by the indexer as any query.
_ONE_BLOCK = tuple(range(16))


# Refusals that are answers (`resync_engine`): an indexer that knows nothing of the engine, or
# an older one without the RPC, is there all the same.
_ANSWERS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)

# The settings a failed call names when the indexer's TLS or token and the controller's do not
# match.
REMOTE_INDEX_SETTINGS = ClientSettings(
    "index.remote_tls",
    "index.remote_tls.cert_file and key_file",
    "index.remote_token_file",
    "index.remote_tls.server_name",
)


def _keyed(key_space: ipb.KeySpace.ValueType, hash_seed: str | None) -> str:
    """A key space as the controller's settings name it (with its seed, for vLLM's)."""
    name = _KEY_SPACE_NAMES.get(key_space, f"key space {key_space}")
    if key_space == ipb.KEY_SPACE_CANONICAL:
        return name
    seed = "vLLM's default hash seed" if hash_seed is None else f"hash seed {hash_seed!r}"
    return f"{name} with {seed}"


def _declared_otherwise(
    keying: ipb.WorkerKeying, key_space: ipb.KeySpace.ValueType, hash_seed: str | None
) -> str | None:
    """How the indexer's source declares keying `keying`'s worker when no prompt hashed in
    `key_space` with `hash_seed` can match it there; None when one may: an engine's own hashes
    whose vLLM algorithm its source does not declare may be in any key space (a kvplane
    engine's own hashes are canonical keys, a vLLM engine's its algorithm's)."""
    if not keying.HasField("key_space"):
        return None
    seed = keying.hash_seed if keying.HasField("hash_seed") else None
    theirs = _keyed(keying.key_space, seed)
    return None if theirs == _keyed(key_space, hash_seed) else theirs


class _KeyedOtherwise(NamedTuple):
    """How a worker is keyed when no prompt the controller hashes can match it (`how`), what
    shows it, when not its source's declaration (`shown_by`: a root block's keys, which every
    new prompt may change), and how the controller hashes prompts instead (`ours`: in its key
    space and seed, unless the block size is what differs)."""

    how: str
    shown_by: str = ""
    ours: str = ""


class _Shedding:
    """The queries shed since the last one answered: when the first was, how many, and the
    last one's failure."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.sheds = 0
        self.failure = ""

    def shed(self, failure: str) -> None:
        self.sheds += 1
        self.failure = failure

    def lasting(self, now: float) -> str | None:
        """The failure `unavailable` says at `now`: None until at least two queries were shed,
        the first `SHEDDING_DEGRADES_AFTER_S` ago or more (none answered since)."""
        shed_s = now - self.since
        if self.sheds < 2 or shed_s < SHEDDING_DEGRADES_AFTER_S:
            return None
        return f"{self.failure} (every query shed for {shed_s:.0f} s)"


class RemoteIndexError(KvplaneError):
    """A remote index call that failed, with its gRPC status (None: not asked, paused)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class RemoteIndex:
    """A remote `kvplane indexer` asked through its KvIndex RPCs (it hashes the prompt with
    the same canonical keys and is fed by its own event sources). Its workers are matched to
    fleet engines by worker address, else by worker id. The prompt is hashed in the key space
    its workers are in (`IndexConfig.remote_key_space`).

    An indexer that lets the deadline pass (hung, stopped, overloaded) is not asked again for
    `backoff_initial_s`, doubling up to `backoff_max_s` while it stays silent: until then
    every call fails at once, so it costs one request the deadline per pause, not every
    request. After the pause one call asks it again (the others still fail at once); an
    answer ends the pause, an error answered included (the indexer's Redis down, a query
    shed), as does a call that fails at once (the indexer down). Only the asking call's
    silence doubles the pause: the calls that were already waiting when the indexer stopped
    answering time out together, and count as one, also those that time out after that pause
    ended (an answer on the connection dialled afresh while the old one is silent): they start
    no pause of their own.
    Each call that starts or lengthens a pause dials the indexer afresh, so that the next one
    asked goes on a new connection: the one that went silent may be dead without a reset (the
    indexer's host gone, moved to another address behind the same name), and would swallow
    every call until the kernel gave up on it.
    One that is down fails at once by itself (UNAVAILABLE), its channel reconnecting at most
    `kvplane.channels.RECONNECT_MAX_S` apart, so it is used again within about a second of
    its return.
    `unavailable` says whether the last call failed, without a call of its own (the
    controller's Health reads it); a query shed (RESOURCE_EXHAUSTED) counts only once
    queries have been shed, none answered, for `SHEDDING_DEGRADES_AFTER_S` (two sheds at
    least: one alone never counts); `ask_while_shedding`, called by the controller's
    index-stats refresh, asks one query meanwhile, so that shedding ends without traffic once
    the indexer answers queries again. `keying_mismatch` says whether
    the indexer's last stats reported a worker keyed otherwise than the prompts are hashed.

    An engine the controller saw restart (`resync_engine`) has its hits ignored until the
    indexer has dropped what it held of the old process: its sources may still be waiting out
    a reconnect backoff, and the old blocks must not attract traffic meanwhile."""

    def __init__(
        self,
        target: str,
        timeout_s: float,
        key_space: str = "canonical",
        hash_seed: str | None = None,
        channels: ClientChannels = INSECURE,
        *,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        clock: Callable[[], float] = time.monotonic,
        routes: Callable[[str], bool] = lambda engine: True,
        block_size_of: Callable[[str], int | None] = lambda engine: None,
        hit_worth: Callable[[PrefixHit, int], float] = PrefixHit.blocks_within,
    ) -> None:
        initial_s, _ = backoff_s
        # Every call fails at once while the indexer is down, without asking it; every
        # routed request asks the index, so a restarted indexer must be found at once.
        self.channels = channels.reconnecting_promptly(initial_s)
        self.target = target
        self._dialled: Redialling[ipb_grpc.KvIndexAsyncStub] = Redialling(
            self.channels, target, ipb_grpc.KvIndexStub
        )
        self._timeout_s = timeout_s
        self._key_space = _KEY_SPACES[key_space]
        self._hash_seed = hash_seed
        self._backoff_s = backoff_s
        self._clock = clock
        # Whether the fleet routes to an engine (a worker named as `match` names it): only
        # its workers' keyings are checked (the indexer may follow other fleets' engines).
        self._routes = routes
        # The block size the controller hashes prompts for an engine in (None: not known
        # yet): a worker whose engine stores blocks of another size matches none of them.
        self._block_size_of = block_size_of
        # What a hit is worth to the routing policy (`Policy.hit_worth`; by default every
        # block served alike): `match` gives an engine indexed rank by rank its worthiest
        # rank's hit.
        self._hit_worth = hit_worth
        self._pause_s = 0.0  # 0: the indexer answers
        self._ask_again_at = 0.0
        self._asking_again = False
        # Pauses ended so far: a call made before one ended that then times out is of that
        # pause (it waited on the silence that began it), and starts no other.
        self._pauses_ended = 0
        # Why the last call asked failed (None: it was answered, or none was asked yet).
        self._failure: str | None = None
        # The queries shed since the last one answered (None: the last was not shed).
        self._shedding: _Shedding | None = None
        # Why no prompt can match some worker the indexer keys otherwise (None: none known),
        # and those workers with how each is keyed (what the ERROR logged for it named).
        self._keying_mismatch: str | None = None
        self._mismatched: tuple[tuple[str, str], ...] = ()
        # Engines restarted since the indexer last confirmed dropping their entries.
        self.restarted: set[str] = set()

    async def _ask(self, call: Callable[[], Awaitable[_Reply]]) -> _Reply:
        """One RPC under the pause; a RemoteIndexError of one line when it fails or is not
        asked (paused as not answering)."""
        paused = self._pause_s > 0
        if paused and (self._asking_again or self._clock() < self._ask_again_at):
            raise RemoteIndexError(
                f"remote index: not answering; asked again within {self._pause_s:g} s"
            )
        # The one call that asks a paused indexer again: only its silence lengthens the pause
        # (calls made before the pause began time out with the one that began it).
        asks_again = paused
        self._asking_again = self._asking_again or asks_again
        pauses_ended = self._pauses_ended
        try:
            reply = await call()
        except grpc.aio.AioRpcError as exc:
            await self._dialled.after_failure()
            if (
                exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                and (asks_again or self._pause_s == 0)
                and self._pauses_ended == pauses_ended
            ):
                initial, most = self._backoff_s
                self._pause_s = min(max(2 * self._pause_s, initial), most)
                self._ask_again_at = self._clock() + self._pause_s
                self._dialled.dial_afresh()  # its connection may be dead without a reset
            elif exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self._answered()  # an error is an answer, as is a call that failed at once
            details = failure_details(
                self.channels, exc.code(), exc.details() or "", REMOTE_INDEX_SETTINGS
            )
            failure = f"{exc.code().name}: {details}"
            self._failure = self._failure_of(exc.code(), failure)
            raise RemoteIndexError(f"remote index: {failure}", exc.code()) from None
        finally:
            if asks_again:
                self._asking_again = False
        self._answered()
        self._failure = None
        return reply

    def _failure_of(self, code: grpc.StatusCode, failure: str) -> str | None:
        """What `unavailable` says after a call failed with `code`: nothing for a refusal that
        is an answer, nor for a query shed (only MatchTokens is ever shed), which counts in
        `_shedding` instead (which only a query not shed ends: `match`)."""
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None if code in _ANSWERS else failure
        if self._shedding is None:
            self._shedding = _Shedding(self._clock())
        self._shedding.shed(failure)
        return None

    def _answered(self) -> None:
        """A call was answered: the pause, if any, is over."""
        if self._pause_s > 0:
            self._pause_s = 0.0
            self._pauses_ended += 1

    @property
    def described(self) -> str:
        """`ReachableIndex.described`."""
        return f"remote index at {self.target}"

    @property
    def unavailable(self) -> str | None:
        """`ReachableIndex.unavailable`: the last failure its calls met (every routed
        request's match and the controller's index-stats refresh ask it; None: the last was
        answered), never a call of its own."""
        failure = self._failure
        if failure is None and self._shedding is not None:
            failure = self._shedding.lasting(self._clock())
        if failure is None:
            return None
        return f"{self.described}: {failure}"

    @property
    def keying_mismatch(self) -> str | None:
        """Why no prompt can match some of the indexer's workers, one line: the indexer
        reports keying them (GetIndexStats `keyings`, read by `stats`) in another key space or
        with another hash seed than `remote_key_space` / `remote_hash_seed` (None: none
        reported otherwise, or an indexer that reports none)."""
        return self._keying_mismatch

    def _keyed_otherwise(self, keying: ipb.WorkerKeying) -> _KeyedOtherwise | None:
        """How the indexer keys `keying`'s worker when no prompt the controller hashes can
        match it there: as its source declares, or, whatever is declared, as shown by the
        latest root block its engine stored (`root_block`: the key it is indexed under is not
        what the controller's key space and seed make of its tokens, or its size is not the
        block size the controller hashes prompts for that engine in). None when one may."""
        declared = _declared_otherwise(keying, self._key_space, self._hash_seed)
        if declared is not None:
            return _KeyedOtherwise(declared)
        block = keying.root_block
        size = len(block.token_ids)
        if not size:
            return None
        (ours,) = self.prompt_keys(block.token_ids, size, "", "")
        if ours != block.key:
            return _KeyedOtherwise(
                "otherwise",
                f" (its engine stored a prompt's first block under key {block.key}; the "
                f"controller hashes its tokens to {ours})",
            )
        hashed_in = self._block_size_of(keying.worker_address or keying.worker_id)
        if hashed_in is None or hashed_in == size:
            return None
        return _KeyedOtherwise(
            f"in blocks of {size} tokens",
            " (the size of the first block of a prompt its engine stored)",
            f"hashes prompts for its engine in blocks of {hashed_in} (the block size its "
            "GetModelInfo reports, else default_block_size)",
        )

    def _check_keyings(self, keyings: Sequence[ipb.WorkerKeying]) -> None:
        """Keep `keying_mismatch` to what the indexer last reported of the workers of engines
        the fleet routes to: an ERROR when a mismatch is found (or its workers, or how they
        are keyed, change: not the root blocks that show it, which change with every new
        prompt), a line when it is gone."""
        wrong = [
            (k.worker_id, theirs)
            for k in keyings
            if self._routes(k.worker_address or k.worker_id)
            and (theirs := self._keyed_otherwise(k)) is not None
        ]
        mismatch = None
        if wrong:
            worker, theirs = wrong[0]
            more = f" (and {len(wrong) - 1} more worker(s))" if len(wrong) > 1 else ""
            ours = theirs.ours or (
                f"asks in {_keyed(self._key_space, self._hash_seed)} "
                "(index.remote_key_space, remote_hash_seed)"
            )
            mismatch = (
                f"{self.described}: worker {worker}{more} is keyed {theirs.how}"
                f"{theirs.shown_by} there, but the controller {ours}: no prompt can match it"
            )
        mismatched = tuple((worker, theirs.how) for worker, theirs in wrong)
        if mismatch is not None and mismatched != self._mismatched:
            log.error("%s", mismatch)
        elif mismatch is None and self._keying_mismatch is not None:
            log.info("%s: its workers are keyed as the controller asks again", self.described)
        self._keying_mismatch = mismatch
        self._mismatched = mismatched

    def _match_request(
        self, token_ids: Sequence[int], block_size: int, lora_name: str, cache_salt: str
    ) -> ipb.MatchTokensRequest:
        return ipb.MatchTokensRequest(
            token_ids=token_ids,
            block_size=block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            key_space=self._key_space,
            hash_seed=self._hash_seed,
        )

    def prompt_keys(
        self, token_ids: Sequence[int], block_size: int, lora_name: str, cache_salt: str
    ) -> tuple[int, ...]:
        """The prompt's block keys as `match` has the indexer give them (in its key space),
        computed here: when the indexer cannot answer, the router's record of the prompts it
        routed must still meet them (canonical keys would not, in a vLLM key space)."""
        request = self._match_request(token_ids, block_size, lora_name, cache_salt)
        return tuple(prompt_block_keys(request, block_size))

    async def match(
        self, token_ids: Sequence[int], block_size: int, lora_name: str, cache_salt: str
    ) -> tuple[tuple[int, ...], dict[str, PrefixHit]]:
        """The prompt's block keys and each worker's cached prefix (none for an engine in
        `restarted`; an engine's worthiest rank's, `keep_best_hit`); a KvplaneError of one
        line when the indexer fails or is paused."""
        request = self._match_request(token_ids, block_size, lora_name, cache_salt)
        try:
            reply = await self._ask(
                lambda: self._dialled.stub.MatchTokens(request, timeout=self._timeout_s)
            )
        except RemoteIndexError as exc:
            if exc.code not in (None, grpc.StatusCode.RESOURCE_EXHAUSTED):
                self._shedding = None  # a query not shed (refused, failed): no shedding
            raise
        self._shedding = None
        hits: dict[str, PrefixHit] = {}
        cacheable = cacheable_blocks(len(token_ids), block_size, len(reply.block_keys))
        for m in reply.matches:
            if (m.worker_address or m.worker_id) in self.restarted:
                continue
            device = next((t.matched_blocks for t in m.tiers if int(t.tier) == int(Tier.HBM)), 0)
            hit = PrefixHit.along(device, m.matched_blocks, m.any_tier_blocks)
            keep_best_hit(hits, m.worker_address or m.worker_id, hit, self._hit_worth, cacheable)
            hits.setdefault(m.worker_id, hit)
        return tuple(reply.block_keys), hits

    async def ask_while_shedding(self) -> None:
        """While queries are shed, none answered since: one query of a single block, which
        the indexer admits as any (`max_concurrent_prefix_queries`), so that the shedding
        ends (`unavailable`) once it answers one, with no request to ask; shed, it counts as
        any query shed. Nothing asked otherwise; a failure is what `unavailable` says."""
        if self._shedding is None:
            return
        with contextlib.suppress(RemoteIndexError):
            await self.match(_ONE_BLOCK, len(_ONE_BLOCK), "", "")

    async def resync_engine(self, engine: str, *, first_contact: bool = False) -> None:
        """A new process of `engine`: ignore its hits from now until the indexer has dropped
        its entries and resubscribed its sources (ResyncEngine). A RemoteIndexError when the
        indexer did not answer: the hits stay ignored until a later call succeeds. An indexer
        without the RPC (UNIMPLEMENTED, an older kvplane) is left to find the restart itself;
        one that knows nothing of the engine (NOT_FOUND: no entries, no source) holds no
        stale block of it, which is what the call is for.

        `first_contact`: the controller meets the engine for the first time, so it cannot
        tell whether the process is new. The indexer drops the entries only if its source of
        the engine has lost its stream (the engine may have restarted while no router
        watched it); one that follows the live process keeps them. The hits are ignored
        while the call lasts only: a failed call is not repeated."""
        self.restarted.add(engine)
        request = ipb.ResyncEngineRequest(engine=engine, only_if_stream_lost=first_contact)
        try:
            await self._ask(
                lambda: self._dialled.stub.ResyncEngine(request, timeout=self._timeout_s)
            )
        except RemoteIndexError as exc:
            if exc.code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                if first_contact:
                    self.restarted.discard(engine)
                raise
        self.restarted.discard(engine)

    async def stats(self) -> IndexStats:
        """The remote index's size; each worker named as the fleet knows its engine (its
        address when the indexer has one, else its worker id), as `match` does. A failed call
        is a KvplaneError of one line (callers log it)."""
        reply = await self._ask(
            lambda: self._dialled.stub.GetIndexStats(
                ipb.GetIndexStatsRequest(), timeout=self._timeout_s
            )
        )
        workers = tuple(
            WorkerStats(
                w.worker_address or w.worker_id, w.worker_address, w.num_blocks, w.num_placements
            )
            for w in reply.workers
        )
        self._check_keyings(reply.keyings)
        return IndexStats(reply.backend, reply.num_blocks, reply.num_placements, workers)

    async def close(self) -> None:
        await self._dialled.close()
