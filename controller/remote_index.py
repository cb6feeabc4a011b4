"""The controller's remote index (`index: {remote: HOST:PORT}`): a `kvplane indexer` asked
through its KvIndex RPCs instead of an index in the controller's process."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from controller.router import PrefixHit
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


def keep_best_hit(hits: dict[str, PrefixHit], engine: str, hit: PrefixHit) -> None:
    """Record `hit` for `engine` unless it already has a better one: an engine followed rank
    by rank (one worker per data-parallel rank) holds what its best rank holds."""
    if engine not in hits or hit > hits[engine]:
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
# every query asked has been shed for this long (none answered since the first shed, and no
# two sheds this far apart: a lone shed after a quiet time begins the shedding again).
SHEDDING_DEGRADES_AFTER_S = 10.0


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


def _keyed_otherwise(
    keying: ipb.WorkerKeying, key_space: ipb.KeySpace.ValueType, hash_seed: str | None
) -> str | None:
    """How the indexer keys `keying`'s worker when no prompt hashed in `key_space` with
    `hash_seed` can match it there; None when one may: an engine's own hashes whose vLLM
    algorithm its source does not declare may be in any key space (a kvplane engine's own
    hashes are canonical keys, a vLLM engine's its algorithm's)."""
    if not keying.HasField("key_space"):
        return None
    seed = keying.hash_seed if keying.HasField("hash_seed") else None
    theirs = _keyed(keying.key_space, seed)
    return None if theirs == _keyed(key_space, hash_seed) else theirs


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
    controller's Health reads it); a query shed (RESOURCE_EXHAUSTED) counts only once every
    query asked has been shed for `SHEDDING_DEGRADES_AFTER_S`. `keying_mismatch` says whether
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
        self._pause_s = 0.0  # 0: the indexer answers
        self._ask_again_at = 0.0
        self._asking_again = False
        # Pauses ended so far: a call made before one ended that then times out is of that
        # pause (it waited on the silence that began it), and starts no other.
        self._pauses_ended = 0
        # Why the last call asked failed (None: it was answered, or none was asked yet).
        self._failure: str | None = None
        # When the queries asked began to be shed, none answered since (None: not shed),
        # and when the last was.
        self._shedding_since: float | None = None
        self._last_shed = 0.0
        # Why no prompt can match some worker the indexer keys otherwise (None: none known).
        self._keying_mismatch: str | None = None
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
        is an answer, nor for a query shed until the shedding has lasted
        `SHEDDING_DEGRADES_AFTER_S` (only MatchTokens is ever shed)."""
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._shedding_since = None
            return None if code in _ANSWERS else failure
        now = self._clock()
        if self._shedding_since is None or now - self._last_shed >= SHEDDING_DEGRADES_AFTER_S:
            self._shedding_since = now
        self._last_shed = now
        shed_s = now - self._shedding_since
        if shed_s < SHEDDING_DEGRADES_AFTER_S:
            return None
        return f"{failure} (every query shed for {shed_s:.0f} s)"

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
        if self._failure is None:
            return None
        return f"{self.described}: {self._failure}"

    @property
    def keying_mismatch(self) -> str | None:
        """Why no prompt can match some of the indexer's workers, one line: the indexer
        reports keying them (GetIndexStats `keyings`, read by `stats`) in another key space or
        with another hash seed than `remote_key_space` / `remote_hash_seed` (None: none
        reported otherwise, or an indexer that reports none)."""
        return self._keying_mismatch

    def _check_keyings(self, keyings: Sequence[ipb.WorkerKeying]) -> None:
        """Keep `keying_mismatch` to what the indexer last reported of the workers of engines
        the fleet routes to: an ERROR when a mismatch is found (or changes), a line when it
        is gone."""
        wrong = [
            (k.worker_id, theirs)
            for k in keyings
            if self._routes(k.worker_address or k.worker_id)
            and (theirs := _keyed_otherwise(k, self._key_space, self._hash_seed)) is not None
        ]
        mismatch = None
        if wrong:
            worker, theirs = wrong[0]
            more = f" (and {len(wrong) - 1} more worker(s))" if len(wrong) > 1 else ""
            mismatch = (
                f"{self.described}: worker {worker}{more} is keyed {theirs} there, but the "
                f"controller asks in {_keyed(self._key_space, self._hash_seed)} "
                "(index.remote_key_space, remote_hash_seed): no prompt can match it"
            )
        if mismatch is not None and mismatch != self._keying_mismatch:
            log.error("%s", mismatch)
        elif mismatch is None and self._keying_mismatch is not None:
            log.info("%s: its workers are keyed as the controller asks again", self.described)
        self._keying_mismatch = mismatch

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
        `restarted`); a KvplaneError of one line when the indexer fails or is paused."""
        request = self._match_request(token_ids, block_size, lora_name, cache_salt)
        reply = await self._ask(
            lambda: self._dialled.stub.MatchTokens(request, timeout=self._timeout_s)
        )
        self._shedding_since = None
        hits: dict[str, PrefixHit] = {}
        for m in reply.matches:
            if (m.worker_address or m.worker_id) in self.restarted:
                continue
            device = next((t.matched_blocks for t in m.tiers if int(t.tier) == int(Tier.HBM)), 0)
            hit = PrefixHit.along(device, m.matched_blocks, m.any_tier_blocks)
            keep_best_hit(hits, m.worker_address or m.worker_id, hit)
            hits.setdefault(m.worker_id, hit)
        return tuple(reply.block_keys), hits

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
