"""The shared `redis` index backend: `IndexBackend` on Redis or Redis Cluster.

Contract: the same semantics as the `memory` backend (one conformance suite), with the state in
Redis so that several indexer or router processes share one index. Every operation is one
Redis Functions call (`indexer/redis_functions.lua`, loaded with FUNCTION LOAD REPLACE on every
primary at start-up and again whenever Redis comes back without it): an ordered batch applies
atomically with FCALL; a prefix lookup is one FCALL_RO that stops at the first miss. All keys of
one partition share the hash tag `{model:0}`, so a partition sits in one cluster slot.
docs/redis.md describes the layout, its memory per placement and the failure behaviour.

Batches applied concurrently (several sources, several RPCs) share one function call (group
commit, at most 64 batches): each batch still applies atomically and in order, with less
per-call overhead.

Failure behaviour. A backend URL that names no usable Redis (not a Redis server, a DB it does
not have, cluster mode it lacks, credentials it refuses: `RedisMisconfiguredError`) is a
ConfigError at start-up; a Redis that is merely down is not. Queries fail fast with
`IndexUnavailableError` (a KvplaneError; servicers map it to UNAVAILABLE), and go on failing
until the batches buffered in the outage are applied (an answer without them would miss
acknowledged placements). Redis refusing writes is such an outage too (an answer could show a
block whose removal waits behind a refused report): at its `maxmemory`, where the buffered
removals that may go ahead of what is buffered before them, with the in-order result, still
apply (`_release_buffered`: they only free memory) and writer leases are kept (`_lease`), so
that the index shrinks back under the cap by itself; and unable to persist to disk (MISCONF),
until a save succeeds. Applies that cannot reach Redis are buffered in order (at most
`max_buffered_batches`); past that, the worker whose batch overflows loses its buffered batches
and is marked for resync. A background task brings the backend back by itself: it reloads the
functions, detects a Redis that lost its data (the partition's boot token changed), removes the
workers marked for resync (so nothing stale stays), replays the buffer in order, then asks the
sources to resync those workers (`take_resync_requests` / `add_resync_listener`). A batch is
never half-applied: each is one atomic function call. Re-applying one is not idempotent (a
REPORT or REVOKE with `copies` adds or drops one more copy), so a call whose outcome is unknown
(its connection dropped, or it timed out, after sending) is settled before its batches are
replayed (`_settle`): the call's write mark, and the outcome Redis records with it, say
whether Redis ran it and what it did with each batch.
Snapshots and stats read the partition in several bounded calls, not one atomic cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import json
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence, Set
from dataclasses import fields
from pathlib import Path
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    ClusterError,
    InvalidResponse,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from indexer import redis_codec as codec
from indexer.backend import (
    IndexStats,
    PrefixMatch,
    PrefixResult,
    TierPlacements,
    TierPrefix,
    TokenPrefixMatch,
    WorkerPlacements,
    WorkerStats,
)
from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec, Tier
from indexer.component_rule import (
    ROUTABLE_TIER_MASK,
    SERVABLE_TIER_MASK,
    resident_components,
    spec_prefix_blocks,
)
from indexer.early_removals import EarlySplit, early_removals
from indexer.index import PrefixIndex
from indexer.redis_client import (
    Client,
    IndexBackendError,
    IndexFullError,
    IndexUnavailableError,
    LeaseLostError,
    RedisMisconfiguredError,
    RedisOptions,
    connect,
    stop_if_cancelled,
)
from indexer.validation import MAX_ACTIONS_PER_BATCH, validate_batch
from kvplane.backoff import Backoff
from kvplane.errors import ConfigError, KvplaneError

__all__ = [
    "IndexBackendError",
    "IndexFullError",
    "IndexUnavailableError",
    "LeaseLostError",
    "LeaseState",
    "RedisBackend",
    "RedisMisconfiguredError",
    "RedisOptions",
    "open_redis_backend",
]

log = logging.getLogger(__name__)

FUNCTIONS_FILE = Path(__file__).with_name("redis_functions.lua")


def _abi_suffix() -> str:
    """The library's ABI version, from its first line (`#!lua name=kvplane_v<N>`): every
    function is called under its name plus this (`kvp_apply_v<N>`), its own version's."""
    first = FUNCTIONS_FILE.read_text().split("\n", 1)[0]
    match = re.fullmatch(r"#!lua name=kvplane(_v\d+)", first.strip())
    if match is None:
        raise ImportError(f"{FUNCTIONS_FILE} does not name a versioned kvplane library: {first}")
    return match.group(1)


ABI_SUFFIX = _abi_suffix()
# (InvalidResponse: the server does not speak Redis's protocol: no usable Redis is there.)
_UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    RedisClusterException,
    InvalidResponse,
)


# A Redis that stops answering without closing its connections (a stopped or wedged process,
# a host gone without a reset) costs every call `timeout_s`, and the calls queued behind the
# readying lock pay it one after another: each request's match would wait seconds, longer the
# more requests there are. So after a call that Redis let time out, queries fail at once for
# a pause, doubling while it stays silent, as a remote indexer is paused
# (controller/remote_index.py); then one query asks it again, and any answer ends the pause.
_SILENT_PAUSE_S = (0.5, 30.0)


_SERVABLE = (Tier.HBM, Tier.DRAM)
_ANY_TIER = frozenset(Tier)
# One kvp_apply call carries at most this much (bounded time inside Redis).
MAX_GROUP_BATCHES = 64
MAX_GROUP_HASHES = 65_536
# kvp_apply's status for a batch of a new worker when the partition has no id left for it.
_PARTITION_FULL = "KVP_WORKERS "
# kvp_apply's status (kvp_remove's error) for a fenced write of a process without the lease.
_FENCED = "KVP_FENCED "
# kvp_release's status for a batch it leaves to kvp_apply (it could grow the index).
_GROWS = "KVP_GROWS "
# A marked call whose mark Redis stored already (check_boot): it ran, or was settled as not
# run (`_settle_held`), before this copy of it arrived.
_STALE = "KVP_STALE "
# Functions Redis runs even at its maxmemory (allow-oom in redis_functions.lua: they only free
# memory, or rewrite a lease key that exists); every other writing function is refused there,
# so only those say Redis takes writes.
_RUN_AT_MAXMEMORY = frozenset({"kvp_release", "kvp_remove", "kvp_sweep", "kvp_renew"})
# How Redis starts its refusal of every write while it cannot persist to disk (an RDB snapshot
# failed under `stop-writes-on-bgsave-error yes`, or an AOF write failed).
_CANNOT_PERSIST = "MISCONF"
# Refusals that pass: a replica being promoted, a slot moving, memory pressure, a busy script.
_TRANSIENT = (OutOfMemoryError, ReadOnlyError, TryAgainError)
# KVP_MOVING: the partition's cluster slot is being moved to another node (redis_functions.lua).
_TRANSIENT_PREFIXES = (
    "BUSY",
    "LOADING",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "OOM",
    "KVP_MOVING",
)
# A block read by kvp_dump: key, token count, parent, placements (worker name, tier, mask, copies).
DumpedBlock = tuple[BlockKey, int, BlockKey | None, list[tuple[str, int, int, int]]]
# What to do when a marked call whose reply was lost turns out to have run (`_settle_held`),
# given the statuses of the batches Redis refused in it, by their index in the call (read back
# from `lo:<writer>`, record_outcome in redis_functions.lua; the others applied).
_IfRan = Callable[[dict[int, str]], None]


async def open_redis_backend(url: str, **options: Any) -> RedisBackend:
    """Connect, load the functions and claim the partition. A Redis that is down at start-up
    is not an error: the backend answers UNAVAILABLE until it comes back. One that answers
    in a way no retry cures (`RedisMisconfiguredError`) is a ConfigError."""
    known = {f.name for f in fields(RedisOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown redis backend options: {', '.join(unknown)}")
    opts = RedisOptions(**options)
    client, where = connect(url, opts)
    backend = RedisBackend(client, opts, where)
    try:
        await backend.start()
    except RedisMisconfiguredError as exc:
        await backend.close()
        raise ConfigError(f"index backend: {exc}") from None
    except IndexUnavailableError as exc:
        log.warning("%s; the indexer keeps trying", exc)
    return backend


class _OutcomeUnknown(IndexUnavailableError):
    """A marked call (`_fcall` with `boot`) whose reply never came: Redis may have run it, or
    not (`_settle` finds out from its `mark`); with `ran`, Redis refused it as already run
    (redis-py resent it after the first reply was lost): its reply, with the batches'
    statuses, is lost all the same."""

    def __init__(self, message: str, mark: int, ran: bool = False) -> None:
        super().__init__(message)
        self.mark = mark
        self.ran = ran


class _WritesRefused(IndexUnavailableError):
    """Redis answers, and runs queries, but refuses the index's writes (`_refusing_writes`)."""


class _RedisFull(_WritesRefused):
    """Redis at its `maxmemory` refused a write that could grow the index (`_out_of_memory`):
    the functions that only free memory still run."""


class LeaseState(enum.Enum):
    """What `RedisBackend.hold_lease` found (kvp_lease in redis_functions.lua)."""

    TAKEN = 1  # nobody held it: this process holds it now and must rebuild what it covers
    KEPT = 2  # this process held it and holds it for another term
    HELD_ELSEWHERE = 0  # another process holds it
    # Kept, and another replica handed this one a resync of the engine since the last renewal
    # (`ask_resync`): rebuild it; the second, only if its stream is lost.
    KEPT_RESYNC_ASKED = 3
    KEPT_RESYNC_IF_STREAM_LOST = 4


class RedisBackend:
    """`IndexBackend` over one partition in Redis (see the module docstring)."""

    name = "redis"

    def __init__(self, client: Client, options: RedisOptions, where: str) -> None:
        self._client = client
        self._options = options
        self._where = where
        self._meta_key = options.partition_key("m")
        self._nb = str(options.buckets)
        self._boot: bytes | None = None
        # This process's writes carry a mark (check_boot in redis_functions.lua): the next
        # one to give, and the highest Redis acknowledged. A stored mark below the latter
        # means Redis came back with older data; `_writes_lost` says so to `_ensure_ready`.
        # `close` deletes the mark (`_forget_mark`).
        self._writer = secrets.token_hex(8)
        self._next_mark = 1
        self._acked_mark = 0
        self._writes_lost = False
        # Marked calls go one at a time, so that the stored mark tells whether a call whose
        # reply was lost ran (`_settle`): that call's mark, and what to do should it have run
        # (given its refused batches; None: nothing), until settled.
        self._marks_lock = asyncio.Lock()
        self._in_doubt: tuple[int, _IfRan | None] | None = None
        # Writer leases (`fence_writes`): this process's holder id and the lease of a worker
        # (its engine). None: writes are unconditional (the indexer's, seed 004's KVIndexer).
        self._fence_holder: str | None = None
        self._lease_of: Callable[[str], str | None] = str
        self._ready = False
        self._ready_lock = asyncio.Lock()
        # Workers with a batch written to the partition (not just buffered): what a Redis that
        # lost its data lost. A worker whose first write is the one that found the loss (its
        # boot token refused, then written to the emptied partition) lost nothing.
        self._known_workers: set[str] = set()
        # Outage handling: batches waiting for Redis, workers whose batches were dropped.
        self._outage = False
        self._buffer: deque[Batch] = deque()
        self._dropping: set[str] = set()
        self._removals: set[str] = set()
        self._resync: set[str] = set()
        self._unannounced: set[str] = set()
        self._listeners: list[Callable[[str], None]] = []
        self._recovery: asyncio.Task[None] | None = None
        # Why the recovery's last attempt failed (None: it has not failed since Redis last
        # answered), so that a query during an outage says Redis is down, not recovering.
        self._recovery_error: str | None = None
        self._maintenance: asyncio.Task[None] | None = None
        # Group commit: batches waiting for the next kvp_apply call, and its task.
        self._group: list[tuple[Batch, asyncio.Future[None]]] = []
        # The batches `apply` is writing (by id: their worker), and those of them whose worker
        # was removed meanwhile (`remove_worker`): one of those whose write fails is not
        # buffered, as its replay would follow the removal and put the worker back.
        self._applying: dict[int, str] = {}
        self._superseded: set[int] = set()
        self._grouper: asyncio.Task[None] | None = None
        # Buffered batches the recovery found fenced (the lease's new holder rebuilt their
        # worker), by worker: how many and the refusal, logged once per worker as it ends.
        self._fenced: dict[str, tuple[int, str]] = {}
        # The pause after Redis let a call time out (0: it answers), when one call may ask it
        # again, whether one is asking, and how many calls it let time out (a caller that
        # waited for the readying lock while one did fails at once too).
        self._pause_s = 0.0
        self._ask_again_at = 0.0
        self._asking_again = False
        self._num_silences = 0
        # Why the last call failed for Redis being away (None: Redis answered since), kept by
        # every call, the maintenance task's included, so that `unavailable` asks nothing.
        self._failure: str | None = None
        # Why Redis refuses the writes that grow the index, at its `maxmemory` or unable to
        # persist (None: it took the last one; logged once when found, and when it takes them
        # again), the `maxmemory-policy` last read (`_check_eviction_policy`), and whether
        # Redis lets this process read it (CONFIG is often refused by managed Redis).
        self._writes_refused: str | None = None
        self._policy: str | None = None
        self._policy_readable = True

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._maintenance is None:
            self._maintenance = asyncio.get_running_loop().create_task(self._maintain())
        await self._ensure_ready()

    async def close(self) -> None:
        for task in (self._maintenance, self._recovery, self._grouper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._maintenance = self._recovery = self._grouper = None
        await self._forget_mark()
        await self._client.aclose()

    async def _forget_mark(self) -> None:
        """Delete this process's write mark (`lw:<writer>` in the meta hash) and its last
        call's outcome (`lo:<writer>`, if any): no process reads another's, and nobody writes
        under this process's random id after it, so the fields would only grow the hash by
        one or two per process start for good. (A process killed leaves them: one or two
        small fields per crash.)"""
        if self._next_mark == 1:  # it wrote nothing: no mark
            return
        try:
            await self._client.execute_command(
                "HDEL", self._meta_key, f"lw:{self._writer}", f"lo:{self._writer}"
            )
        except (*_UNREACHABLE, OSError, RedisError) as exc:
            log.debug("write mark not deleted (Redis unreachable): %s", exc)

    @property
    def healthy(self) -> bool:
        """Redis answered the last call and no batch is waiting for it."""
        return self._ready and not self._outage

    @property
    def described(self) -> str:
        """`ReachableIndex.described`: the Redis it uses (HOST:PORT, a cluster's nodes)."""
        return f"Redis at {self._where}"

    @property
    def unavailable(self) -> str | None:
        """`ReachableIndex.unavailable`: why a query fails now (None: queries are answered): Redis
        down or silent, or back but with buffered batches not replayed yet. Read from the state
        the calls and the background tasks keep (the maintenance task calls Redis every
        `maintenance_interval_s`): a health check asks this, never Redis itself."""
        if self._outage:
            return self._outage_reason()
        return self._writes_refused or self._failure

    @property
    def num_buffered_batches(self) -> int:
        return len(self._buffer)

    def add_resync_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(worker_id)` runs when a worker's index state was dropped (buffer overflow
        during an outage, or Redis lost its data): its source must rebuild it."""
        self._listeners.append(callback)

    def fence_writes(self, holder: str, lease_of: Callable[[str], str | None]) -> None:
        """From now on this process's writes made under a writer lease (batches
        `under_lease`, a source's, and removals of a worker under a lease; also those buffered
        in an outage, when they are replayed) are made only while `holder` holds the lease
        `lease_of(worker_id)` (`hold_lease`), checked atomically with the write inside Redis:
        a replica that lost an engine's lease, paused past its expiry or cut off from Redis,
        cannot write over the replica that took it over. A refused apply raises
        LeaseLostError; a refused removal is dropped (the new holder owns the worker). Other
        batches (the KVIndexer API's, seed 004: applies are unconditional) and removals of a
        worker whose `lease_of` is None are unconditional."""
        self._fence_holder = holder
        self._lease_of = lease_of

    def _fence(self, worker_id: str, under_lease: bool = True) -> bytes:
        if self._fence_holder is None or not under_lease:
            return b""
        lease = self._lease_of(worker_id)
        return b"" if lease is None else codec.fence_arg(self._fence_holder, lease)

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> LeaseState:
        """Take the writer lease `name` for `holder` if nobody holds it, or keep it another
        `ttl_s` if `holder` does (Redis's clock decides the expiry). IndexUnavailableError
        while Redis cannot answer (or cannot take it: `_lease`): the lease then runs out by
        itself."""
        reply = await self._lease([name, holder, max(1, round(ttl_s * 1000))])
        return LeaseState(int(reply))

    async def ask_resync(
        self, name: str, holder: str, ttl_s: float, *, only_if_stream_lost: bool
    ) -> tuple[LeaseState, str]:
        """A resync of the engine under the lease `name` asked of `holder` (ResyncEngine):
        when another process holds the lease, the resync is recorded for it in the same
        atomic call (its next `hold_lease` answers KEPT_RESYNC_ASKED or
        KEPT_RESYNC_IF_STREAM_LOST) and the answer is (HELD_ELSEWHERE, its holder id);
        otherwise the lease is taken or kept as by `hold_lease` ((TAKEN or KEPT, "")), and
        `holder` resyncs the engine itself."""
        mode = "lost" if only_if_stream_lost else "all"
        args: list[bytes | str | int] = [name, holder, max(1, round(ttl_s * 1000)), "resync", mode]
        state, holder_now = await self._lease(args)
        return LeaseState(int(state)), _text(holder_now)

    async def release_lease(self, name: str, holder: str) -> None:
        """Give up `holder`'s lease `name` (nothing when another holds it), so that another
        process takes it at its next try instead of after the expiry."""
        await self._lease([name, holder, "release"])

    async def _lease(self, args: Sequence[bytes | str | int]) -> Any:
        """kvp_lease; at maxmemory, where Redis refuses it (it may create a key), kvp_renew,
        which Redis runs even then and which does only what rewrites the lease key that
        exists: its holder keeps the lease (so that a writer under leases frees memory with
        its removals past a lease's term, not fenced), a restarted process of the holding
        replica takes it over, its holder releases it. Taking a lease nobody holds and
        handing a resync over to another holder wait for Redis to take writes: the refusal
        is raised."""
        try:
            return await self._fcall("kvp_lease", args)
        except _RedisFull as full:
            try:
                return await self._fcall("kvp_renew", args)
            except IndexBackendError as exc:
                if _GROWS not in str(exc):
                    raise
                raise full from None

    def take_resync_requests(self) -> frozenset[str]:
        """Workers to resync since the last call (the polling form of the listener)."""
        taken = frozenset(self._resync)
        self._resync.clear()
        return taken

    # ------------------------------------------------------------------ calls

    def _unavailable(self, exc: Exception) -> IndexUnavailableError:
        return IndexUnavailableError(
            f"shared index unavailable: Redis at {self._where} did not answer ({exc})"
        )

    def _check_readable(self) -> None:
        """Queries wait for the batches buffered in an outage: an answer without them would
        miss placements whose applies were already acknowledged (a router would take a cached
        prefix for a cold one). Until the recovery has replayed them, a query is UNAVAILABLE,
        as during the outage itself. So is any query while Redis refuses the writes that grow
        the index (`_refusing_writes`): another process may have such a batch buffered, a
        removal behind it."""
        if self._outage:
            raise IndexUnavailableError(self._outage_reason())
        if self._writes_refused is not None:
            raise IndexUnavailableError(self._writes_refused)

    def _outage_reason(self) -> str:
        """Why queries wait during an outage: the recovery's last failure, else its progress."""
        waiting = f"{len(self._buffer)} buffered batches not applied yet"
        if self._recovery_error is not None:
            return f"{self._recovery_error}; {waiting}"
        return f"shared index unavailable: Redis at {self._where} is recovering ({waiting})"

    def _not_ready(self, exc: Exception) -> IndexUnavailableError:
        """Why readying Redis failed: an answer no retry cures (`RedisMisconfiguredError`),
        a refusal, or an outage."""
        text = str(exc)
        if any(isinstance(e, InvalidResponse) for e in _causes(exc)):
            return RedisMisconfiguredError(
                f"{self._where} is not a Redis server (its reply is not Redis's protocol)"
            )
        if "DB index is out of range" in text:
            return RedisMisconfiguredError(
                f"Redis at {self._where} has no such DB ({text}): the backend URL's DB must be "
                "below its `databases` setting"
            )
        if any(isinstance(e, AuthenticationError) for e in _causes(exc)):
            return RedisMisconfiguredError(
                f"Redis at {self._where} refused the credentials ({text}): check "
                "redis.username and redis.password_file"
            )
        if "Cluster mode is not enabled" in text:
            return RedisMisconfiguredError(
                f"Redis at {self._where} is not a cluster node (cluster mode is not enabled): "
                "use redis://HOST:PORT/DB for a single Redis"
            )
        if isinstance(exc, OutOfMemoryError):  # FUNCTION LOAD and kvp_boot are writes
            return self._out_of_memory(exc)
        if text.startswith(_CANNOT_PERSIST):
            return self._cannot_persist(exc)
        if isinstance(exc, ResponseError):
            return IndexUnavailableError(f"Redis at {self._where} refused: {exc}")
        return self._unavailable(exc)

    def _out_of_memory(self, exc: OutOfMemoryError) -> IndexUnavailableError:
        """Redis at its `maxmemory` with nothing it may evict (`maxmemory-policy noeviction`,
        Redis's default): it refuses every function that could grow the index at its start
        (and FUNCTION LOAD), while queries (no-writes) and the functions that only free
        memory or rewrite a lease key that exists (`_RUN_AT_MAXMEMORY`) still run. An outage
        (`_refusing_writes`) in which the buffered removals that may go ahead are applied
        (`_release_buffered`), so that the index shrinks back under the cap as engines evict
        blocks, and writer leases are kept (`_lease`)."""
        return self._refusing_writes(
            "is out of memory", exc, "raise its maxmemory or free memory", _RedisFull
        )

    def _cannot_persist(self, exc: Exception) -> IndexUnavailableError:
        """Redis cannot persist to disk (MISCONF: an RDB snapshot failed under
        `stop-writes-on-bgsave-error yes`, Redis's default where it saves snapshots, or an
        AOF write failed): it refuses every function that writes, those that only free
        memory and kvp_renew included, until a save succeeds, while queries (no-writes) still
        run. The same outage as at maxmemory (`_refusing_writes`), but nothing is applied
        meanwhile, and writer leases are not renewed (they run out; their next takers
        rebuild the engines)."""
        return self._refusing_writes(
            "cannot persist to disk",
            exc,
            "fix what its log says (disk space, permissions of its dir) and run BGSAVE: it "
            "takes writes again once a save succeeds",
            _WritesRefused,
        )

    def _refusing_writes(
        self, state: str, exc: Exception, remedy: str, error: type[_WritesRefused]
    ) -> _WritesRefused:
        """Redis answers but refuses the index's writes (`state`: why). An outage, said as
        such: this process buffers its applies and its queries wait for them, and every
        process's queries fail until Redis takes writes again (another one may have a
        removal buffered behind a report: no answer shows a block whose removal waits); a
        process that only reads finds it at its next maintenance call (kvp_probe, refused
        as well). Logged once when found (and when the reason changes)."""
        said = f"Redis at {self._where} {state}"
        message = f"shared index unavailable: {said} and refuses writes ({exc}): {remedy}"
        if self._writes_refused is None or said not in self._writes_refused:
            log.warning("%s and refuses the index's writes (%s); queries answer UNAVAILABLE "
                        "until it takes them again: %s", said, exc, remedy)  # fmt: skip
        self._writes_refused = message
        return error(message)

    def _took_writes(self) -> None:
        """Redis took a write that could grow the index: a refusal it had (its maxmemory, a
        failed save) is over."""
        if self._writes_refused is not None:
            self._writes_refused = None
            log.info("Redis at %s takes the index's writes again", self._where)

    async def _check_eviction_policy(self) -> None:
        """Warn when Redis may evict the index's own keys under `maxmemory` (an `allkeys-*`
        `maxmemory-policy`): a bucket evicted loses blocks, but a worker's hash evicted
        brings back placements it had cleared, stale (docs/redis.md, "Redis configuration").
        Read at each readying (start-up, and each recovery: the policy may be changed at
        run time) and said once per policy. A Redis that refuses CONFIG (managed services
        often do) is not asked again, and nothing but a debug line is said."""
        if not self._policy_readable:
            return
        try:
            reply = await self._client.execute_command(
                "CONFIG", "GET", "maxmemory-policy", **self._partition_node()
            )
        except (*_UNREACHABLE, OSError, RedisError) as exc:
            log.debug("maxmemory-policy of Redis at %s not read: %s", self._where, exc)
            self._policy_readable = not isinstance(exc, ResponseError)
            return
        values = list(reply.values()) if isinstance(reply, dict) else list(reply)[1:]
        if not values or not isinstance(values[0], bytes | str):
            log.debug("maxmemory-policy of Redis at %s not read: %r", self._where, reply)
            return
        policy = _text(values[0])
        if policy != self._policy and policy.startswith("allkeys-"):
            log.warning("Redis at %s may evict the index's keys (maxmemory-policy %s): an "
                        "evicted worker hash can bring back placements it had cleared, and "
                        "evicted buckets lose blocks; set maxmemory-policy noeviction (or a "
                        "volatile-* policy) for the index's Redis",
                        self._where, policy)  # fmt: skip
        self._policy = policy

    async def _ensure_ready(self, silences_seen: int | None = None) -> None:
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            if silences_seen is not None and self._num_silences != silences_seen:
                raise self._silent()  # the call before it in the queue timed out meanwhile
            code = FUNCTIONS_FILE.read_text()
            refused: OutOfMemoryError | None = None
            try:
                try:
                    if isinstance(self._client, RedisCluster):
                        await self._client.initialize()  # learn every primary, not just seeds
                        await self._load_on_every_primary(code)
                    else:
                        await self._client.function_load(code, replace=True)
                except OutOfMemoryError as exc:
                    # Refused at maxmemory: the library loaded before serves (kvp_boot runs
                    # there too), so that the index can shrink back under the cap.
                    refused = exc
                boot, nb = await self._client.execute_command(
                    "FCALL",
                    "kvp_boot" + ABI_SUFFIX,
                    1,
                    self._meta_key,
                    self._nb,
                    secrets.token_hex(8),
                )
            except (*_UNREACHABLE, OSError, ResponseError) as exc:
                if refused is not None and "Function not found" in str(exc):
                    exc = refused  # no library to fall back on: say why it is not loaded
                not_ready = self._not_ready(exc)
                self._failure = str(not_ready)
                raise not_ready from exc
            if int(nb) != self._options.buckets:
                raise ConfigError(
                    f"redis partition {self._meta_key[:-2]} holds data laid out in {nb} buckets,"
                    f" configured {self._options.buckets}: use the same value or another model"
                )
            data_lost = self._boot is not None and boot != self._boot
            writes_lost = self._writes_lost and not data_lost
            if data_lost or writes_lost:
                self._acked_mark = 0  # the marks stored now are the ones to build on
            self._writes_lost = False
            self._boot = boot
            self._ready = True
            self._failure = None
            if refused is None:
                self._took_writes()  # (FUNCTION LOAD is refused at maxmemory)
            else:
                self._out_of_memory(refused)  # queries wait, as in any process then
        await self._check_eviction_policy()
        if data_lost:
            self._state_lost("the index")
        elif writes_lost:
            self._state_lost("some acknowledged writes (it came back with older data)")

    async def _load_on_every_primary(self, code: str) -> None:
        """FUNCTION LOAD on every cluster primary: the partition's slot may move to any of
        them (a reshard sends calls to its new node before the move ends). Only the node
        holding the partition must take it: a primary of another partition being down must
        not keep this one unready (the library reaches it when this is next readied: a call
        there finds it missing, "Function not found")."""
        assert isinstance(self._client, RedisCluster)
        home = self._client.get_node_from_key(self._meta_key)
        for node in self._client.get_primaries():
            try:
                await self._client.execute_command(
                    "FUNCTION", "LOAD", "REPLACE", code, target_nodes=node
                )
            except (*_UNREACHABLE, OSError, ResponseError) as exc:
                if home is None or node.name == home.name:
                    raise
                log.debug("functions not loaded on %s: %s", node.name, exc)

    def _state_lost(self, what: str) -> None:
        """Redis came back without this partition's data, or with older data: every worker
        this process wrote since the last loss must be rebuilt by its source; their buffered
        batches are superseded by that. Each is known again at its next write (its rebuild):
        one not written since (fed through ApplyExternalKvBatch by a client that has not sent
        again) has nothing of this process's left to lose, and a later loss does not ask it
        again."""
        workers, self._known_workers = self._known_workers, set()
        log.warning("Redis at %s lost %s; resyncing %d worker(s)", self._where, what, len(workers))
        self._buffer = deque(b for b in self._buffer if b.worker_id not in workers)
        self._dropping -= workers
        self._request_resync(workers)

    def _request_resync(self, workers: set[str]) -> None:
        """Marks workers for resync. Listeners hear of them once Redis takes writes again: a
        source that resyncs while Redis is still recovering would only be buffered (or
        dropped and asked again)."""
        self._resync |= workers
        self._unannounced |= workers
        if not self._outage:
            self._announce_resyncs()

    def _announce_resyncs(self) -> None:
        workers, self._unannounced = sorted(self._unannounced), set()
        for worker_id in workers:
            for callback in self._listeners:
                try:
                    callback(worker_id)
                except Exception:
                    log.exception("resync listener failed for worker %s", worker_id)

    async def _fcall(
        self,
        function: str,
        args: Sequence[bytes | str | int],
        *,
        readonly: bool = False,
        boot: bool = False,
        if_ran: _IfRan | None = None,
    ) -> Any:
        """One function call. With `boot` the partition's boot token goes first: the function
        refuses to write into a partition that lost its data without this process noticing;
        and the call carries this process's next write mark, one such call at a time, after
        the last one whose outcome is unknown is settled (`_settle`; `if_ran`: what to do
        if this one's outcome is unknown and it turns out to have run, given the batches
        it refused).
        A query fails at once while Redis is paused as silent (_SILENT_PAUSE_S); writes (the
        group commit, the recovery, which has its own backoff) still ask it, so that Redis back
        is found, and the pause ended, as soon as it answers."""
        gated = readonly and self._pause_s > 0
        if gated and (self._asking_again or time.monotonic() < self._ask_again_at):
            raise self._silent()
        self._asking_again = self._asking_again or gated
        silences_seen = self._num_silences
        try:
            if boot:
                async with self._marks_lock:
                    await self._settle_held()
                    try:
                        reply = await self._fcall_once(function, args, readonly=False, boot=True)
                    except _OutcomeUnknown as exc:
                        self._in_doubt = (exc.mark, if_ran)
                        raise IndexUnavailableError(str(exc)) from exc
            else:
                reply = await self._fcall_once(function, args, readonly=readonly, boot=False)
        except IndexUnavailableError as exc:
            self._failure = str(exc)
            if any(isinstance(e, RedisTimeoutError) for e in _causes(exc)):
                self._num_silences += 1
                initial_s, most_s = _SILENT_PAUSE_S
                self._pause_s = min(max(2 * self._pause_s, initial_s), most_s)
                self._ask_again_at = time.monotonic() + self._pause_s
            elif self._num_silences == silences_seen:
                self._pause_s = 0.0  # Redis answered (refused, say): it is not silent
            raise
        finally:
            if gated:
                self._asking_again = False
        self._pause_s = 0.0
        self._failure = None
        return reply

    def _silent(self) -> IndexUnavailableError:
        return IndexUnavailableError(
            f"shared index unavailable: Redis at {self._where} is not answering; asked again "
            f"within {self._pause_s:g} s"
        )

    async def _fcall_once(
        self,
        function: str,
        args: Sequence[bytes | str | int],
        *,
        readonly: bool,
        boot: bool,
        mark: int | None = None,
    ) -> Any:
        """`_fcall` without its pause; `mark`: the write mark to resend (`_settle_held`),
        else with `boot` the next one."""
        silences_seen = self._num_silences
        resent = mark
        for attempt in (0, 1):
            await self._ensure_ready(silences_seen)
            head: list[bytes | str | int] = [self._nb]
            mark = 0
            if boot:
                if resent is not None:
                    mark = resent
                else:
                    mark, self._next_mark = self._next_mark, self._next_mark + 1
                token = (self._boot or b"").decode()
                head.append(f"{token} {self._writer} {self._acked_mark} {mark}")
            try:
                reply = await self._client.execute_command(
                    "FCALL_RO" if readonly else "FCALL",
                    function + ABI_SUFFIX,
                    1,
                    self._meta_key,
                    *head,
                    *args,
                )
            except (*_UNREACHABLE, OSError) as exc:
                self._ready = False
                if boot:
                    raise _OutcomeUnknown(str(self._unavailable(exc)), mark) from exc
                raise self._unavailable(exc) from exc
            except ResponseError as exc:
                text = str(exc)
                if text.startswith("KVP_LOST"):
                    self._writes_lost = True
                stale = "Function not found" in text or text.startswith(("KVP_BOOT", "KVP_LOST"))
                if stale and attempt == 0:
                    self._ready = False
                    continue
                if boot and text.startswith(_STALE):
                    raise _OutcomeUnknown(
                        f"shared index unavailable: Redis at {self._where}: {text}", mark, ran=True
                    ) from exc
                if isinstance(exc, OutOfMemoryError):
                    raise self._out_of_memory(exc) from exc
                if text.startswith(_CANNOT_PERSIST):
                    raise self._cannot_persist(exc) from exc
                if isinstance(exc, _TRANSIENT) or text.startswith(_TRANSIENT_PREFIXES):
                    raise IndexUnavailableError(
                        f"shared index unavailable: Redis at {self._where}: {text}"
                    ) from exc
                raise IndexBackendError(
                    f"shared index error from Redis at {self._where}: {text}"
                ) from exc
            self._acked_mark = max(self._acked_mark, mark)
            if not readonly and function not in _RUN_AT_MAXMEMORY:
                self._took_writes()
            return reply
        raise AssertionError("unreachable")

    async def _settle(self) -> None:
        """`_settle_held`, for a caller not making a marked call."""
        async with self._marks_lock:
            await self._settle_held()

    async def _settle_held(self) -> None:
        """Finds out whether the marked call whose reply was lost ran, before any later marked
        call is sent (the caller holds `_marks_lock`): it ran, atomically, iff the stored mark
        (`lw:<writer>`) reached its mark and that mark was not claimed for it (below). If the
        stored mark is below it, the mark is claimed by resending it on an empty kvp_release
        (run even at maxmemory; behind the lost call if Redis still holds it, as under CLIENT
        PAUSE), so that the call, reaching Redis only afterwards, is refused as stale
        (check_boot in redis_functions.lua) instead of running after its batches were
        replayed. The claim records itself as such (`lo:<writer>`), as a call that ran
        records the batches it refused, so one read tells all three apart, however many
        replies were lost: the claim's own reply lost, or its resend refused as stale
        (the first send ran), is read again, never taken for the call having run."""
        if self._in_doubt is None:
            return
        mark, if_ran = self._in_doubt
        while True:
            settled, refused = await self._outcome_of(mark)
            if settled:
                break
            try:
                await self._fcall_once("kvp_release", [], readonly=False, boot=True, mark=mark)
            except _OutcomeUnknown as exc:
                if not exc.ran:
                    raise  # still in doubt: read again at the next settling
                continue  # refused as stale: the call or an earlier send of this claim ran
            refused = None
            break
        self._in_doubt = None
        self._acked_mark = max(self._acked_mark, mark)
        if refused is not None:
            log.info("Redis at %s ran the call whose reply was lost: not replayed", self._where)
            if if_ran is not None:
                if_ran(refused)

    async def _outcome_of(self, mark: int) -> tuple[bool, dict[int, str] | None]:
        """What the marked call `mark` did, read from the stored mark and outcome
        (record_outcome in redis_functions.lua): (False, None) while neither it nor a claim
        of its mark ran; (True, None) when its mark was claimed (it never runs); else it ran,
        (True, the batches it refused, by index in the call: empty when all applied)."""
        await self._ensure_ready()
        try:
            stored, outcome = await self._client.execute_command(
                "HMGET", self._meta_key, f"lw:{self._writer}", f"lo:{self._writer}"
            )
        except (*_UNREACHABLE, OSError) as exc:
            self._ready = False
            raise self._unavailable(exc) from exc
        if int(stored or 0) < mark:
            return False, None
        record: list[Any] = json.loads(outcome) if outcome else [0]
        if record[0] != mark:
            return True, {}  # it refused nothing
        if len(record) == 1:
            return True, None  # claimed
        flat = record[1]
        return True, {int(flat[j]) - 1: str(flat[j + 1]) for j in range(0, len(flat), 2)}

    # ------------------------------------------------------------------ apply

    async def apply(self, batch: Batch) -> None:
        # As the memory backend does: a bad batch is refused whole, before anything is sent
        # (a script that failed half-way would leave its earlier writes in place).
        validate_batch(batch)
        if batch.worker_id in self._dropping:
            raise IndexUnavailableError(
                f"shared index unavailable: Redis at {self._where} is down; worker "
                f"{batch.worker_id!r} is dropped until it is back, then resynced"
            )
        if self._outage:
            self._enqueue(batch)
            self._start_recovery()  # (running already, unless it ended without clearing it)
            return
        key = id(batch)
        self._applying[key] = batch.worker_id
        try:
            await self._apply_grouped(batch)
        except IndexUnavailableError as exc:
            if key in self._superseded:  # its removal comes after it: nothing to replay
                log.debug("batch of removed worker %s not buffered: %s", batch.worker_id, exc)
                return
            log.warning("%s; buffering batches", exc)
            self._recovery_error = str(exc)  # why queries wait, until the recovery says more
            self._outage = True
            self._enqueue(batch)
            self._start_recovery()
        finally:
            self._applying.pop(key, None)  # (the same batch may be applied twice at once)
            self._superseded.discard(key)

    async def _apply_batches(
        self,
        batches: Sequence[Batch],
        function: str = "kvp_apply",
        if_ran: Callable[[list[str | None]], object] | None = None,
    ) -> list[str | None]:
        """One atomic call applying `batches` in order: per batch None, or why it was refused
        (then nothing of it was written): by Redis, or here when it cannot be encoded, which
        validation should have made impossible; such a batch fails alone, never its group.
        `function`: kvp_apply, or kvp_release (`_release_buffered`). `if_ran`: what to do
        with these statuses should the call's reply be lost and the call turn out to have run
        (`_settle_held` reads them back); by default the batches, buffered meanwhile, leave
        the buffer as their replay's statuses say (`_ran_buffered`)."""
        statuses: list[str | None] = [None] * len(batches)
        args: list[bytes | str | int] = []
        sent: list[int] = []
        for i, batch in enumerate(batches):
            try:
                args += codec.batch_args(batch, self._fence(batch.worker_id, batch.under_lease))
            except Exception as exc:
                log.exception("batch of %s cannot be encoded for Redis", batch.worker_id)
                statuses[i] = f"cannot be encoded for Redis: {type(exc).__name__}: {exc}"
            else:
                sent.append(i)
        if sent:
            settled = if_ran or functools.partial(self._ran_buffered, batches)

            def ran(refused: dict[int, str]) -> None:
                for j, i in enumerate(sent):
                    statuses[i] = refused.get(j)
                settled(statuses)

            replies = await self._fcall(function, args, boot=True, if_ran=ran)
            for i, status in zip(sent, replies, strict=True):
                statuses[i] = None if status == 1 else _text(status)
        return statuses

    async def _apply_grouped(self, batch: Batch) -> None:
        """Group commit: batches applied concurrently (several sources, several RPCs) share
        one function call; a batch waits only for the call in flight, if any."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._group.append((batch, done))
        if self._grouper is None or self._grouper.done():
            self._grouper = loop.create_task(self._apply_groups())
        await done

    async def _apply_groups(self) -> None:
        group: list[tuple[Batch, asyncio.Future[None]]] = []
        try:
            while self._group:
                group = _take_group(self._group)
                try:
                    statuses = await self._apply_batches([b for b, _ in group])
                except KvplaneError as exc:
                    for _, done in group:
                        if not done.done():
                            done.set_exception(type(exc)(str(exc)))
                    continue
                except Exception as exc:
                    # Not Redis being away (that is a KvplaneError): a bug, or a reply this code
                    # does not understand. These batches fail (not buffered: they would fail
                    # again); the task goes on with the next group.
                    log.exception("applying %d batches failed", len(group))
                    for _, done in group:
                        if not done.done():
                            done.set_exception(IndexBackendError(f"shared index error: {exc!r}"))
                    continue
                for (b, done), status in zip(group, statuses, strict=True):
                    if done.done():
                        continue
                    if status is None:
                        self._known_workers.add(b.worker_id)
                        done.set_result(None)
                    else:
                        done.set_exception(_refused(b, status))
        finally:
            for _, done in [*group, *self._group]:
                if not done.done():
                    done.set_exception(IndexUnavailableError("shared index closed"))
            self._group.clear()

    def _ran_buffered(self, batches: Sequence[Batch], statuses: Sequence[str | None]) -> None:
        """`batches` went in a call whose reply was lost and which ran (`_settle`), with
        `statuses`, read back from Redis: they leave the buffer, where the outage put them,
        instead of applying twice, each as its replay would have (`_replayed`: a batch
        refused is logged, or its worker resynced, as when the reply arrives)."""
        ran = {id(b) for b in batches}
        self._buffer = deque(b for b in self._buffer if id(b) not in ran)
        for batch, status in zip(batches, statuses, strict=True):
            self._replayed(batch, status)

    def _start_recovery(self) -> None:
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    def _enqueue(self, batch: Batch) -> None:
        limit = self._options.max_buffered_batches
        if len(self._buffer) < limit:
            self._buffer.append(batch)
            return
        worker_id = batch.worker_id
        self._dropping.add(worker_id)
        self._buffer = deque(b for b in self._buffer if b.worker_id != worker_id)
        raise IndexUnavailableError(
            f"shared index unavailable: Redis at {self._where} is down and {limit} batches "
            f"are buffered; worker {worker_id!r} will be resynced when it is back"
        )

    async def _recover(self) -> None:
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                await self._ensure_ready()
                await self._settle()  # before the buffer is read: what ran leaves it
                # (Until a write is taken, the last failure still says why: a Redis that
                # answers may refuse every write, out of memory.)
                while self._removals:
                    worker_id = min(self._removals)
                    await self._remove(worker_id)
                    self._recovery_error = None
                    self._removals.discard(worker_id)
                while self._dropping:
                    worker_id = min(self._dropping)
                    fenced = await self._remove(worker_id) is None
                    self._recovery_error = None
                    self._dropping.discard(worker_id)
                    if not fenced:  # else the lease's holder owns the worker now
                        self._request_resync({worker_id})
                while self._buffer:
                    # Left in the buffer until applied, so new batches queue behind them.
                    head = list(itertools.islice(self._buffer, MAX_GROUP_BATCHES))
                    try:
                        statuses = await self._replay_head(head)
                    except _RedisFull:
                        if await self._release_buffered():
                            continue  # memory freed: the head may fit now
                        raise
                    self._recovery_error = None
                    for batch, status in zip(head, statuses, strict=True):
                        self._replayed(batch, status)
                        if self._buffer and self._buffer[0] is batch:  # not filtered meanwhile
                            self._buffer.popleft()
                if self._writes_refused is not None:
                    # Every buffered batch was one that frees memory: the outage ends once
                    # Redis takes writes again, as it would have with one that grows the index.
                    await self._fcall("kvp_probe", [])
                if not self._dropping and not self._removals:
                    break
            except KvplaneError as exc:
                stop_if_cancelled()
                self._recovery_error = str(exc)
                log.debug("Redis recovery: %s", exc)
                await asyncio.sleep(backoff.take())
            except Exception:  # never ends the task: the outage would never end either
                stop_if_cancelled()
                log.exception("Redis recovery failed; retrying")
                await asyncio.sleep(backoff.take())
        self._outage = False
        self._recovery_error = None
        self._recovery = None
        refused, self._fenced = self._fenced, {}
        for worker_id, (count, status) in sorted(refused.items()):
            log.info("buffered batch of %s not applied: %s (%d batches)", worker_id, status, count)
        log.info("Redis at %s is back; buffered batches applied", self._where)
        self._announce_resyncs()

    def _replayed(self, batch: Batch, status: str | None) -> None:
        """What a buffered batch's replay did (`status`: None, or why it was refused)."""
        if status is None:
            self._known_workers.add(batch.worker_id)
        elif status.startswith(_FENCED):  # the lease's new holder rebuilt it
            count, _ = self._fenced.get(batch.worker_id, (0, status))
            self._fenced[batch.worker_id] = (count + 1, status)
        else:
            log.error("buffered batch of %s refused: %s", batch.worker_id, status)
            self._request_resync({batch.worker_id})

    async def _release_buffered(self) -> bool:
        """At maxmemory: apply now, with kvp_release, which Redis runs even then, the buffered
        removals that may go ahead of what is buffered before them with the in-order result
        (`early_removals`: REVOKEs of blocks no buffered REPORT before them names, CLEARs
        before every buffered REPORT), so that the index shrinks back under the cap by itself
        as engines evict blocks, even while each of their batches also stores new ones (vLLM
        publishes one per engine step), and the rest can follow. Each batch's such removals
        apply as one batch of its worker and are struck from it (nothing applies twice), in
        calls of at most one group each. Found once: what is buffered meanwhile comes after
        them, and a batch filtered out meanwhile (its worker removed or dropped) only held
        back removals behind it. Whether it applied any."""
        splits = early_removals(list(self._buffer))
        applied = 0
        while splits:
            n = _group_size([s.early for s in splits])
            chunk, splits = splits[:n], splits[n:]
            released = functools.partial(self._released, chunk)
            applied += released(
                await self._replay_head([s.early for s in chunk], "kvp_release", released)
            )
        log.debug("Redis at %s is out of memory: removals of %d buffered batches applied, %d "
                  "batches wait", self._where, applied, len(self._buffer))  # fmt: skip
        return applied > 0

    def _released(self, chunk: Sequence[EarlySplit], statuses: Sequence[str | None]) -> int:
        """What the kvp_release call of `chunk` did (`statuses`, from its reply, or read back
        by `_settle` when the reply was lost): each batch's early removals that were not
        left for kvp_apply (KVP_GROWS: they stay buffered) are struck from it, as replayed
        (`_replayed`). How many batches' were."""
        left: dict[int, Batch | None] = {}
        for split, status in zip(chunk, statuses, strict=True):
            if status is None or not status.startswith(_GROWS):
                self._replayed(split.early, status)
                left[id(split.batch)] = split.rest
        self._strike(left)
        return len(left)

    def _strike(self, rests: dict[int, Batch | None]) -> None:
        """Replaces the buffered batches whose early removals applied (by id) with the rest of
        each (None: nothing is left of it)."""
        if rests:
            self._buffer = deque(
                rest for b in self._buffer if (rest := rests.get(id(b), b)) is not None
            )

    async def _replay_head(
        self,
        head: list[Batch],
        function: str = "kvp_apply",
        if_ran: Callable[[list[str | None]], object] | None = None,
    ) -> list[str | None]:
        """`_apply_batches` for buffered batches; an unexpected failure (not Redis being away)
        refuses them, since retrying them would keep the outage going forever."""
        try:
            return await self._apply_batches(head, function, if_ran)
        except KvplaneError:
            raise
        except Exception as exc:
            log.exception("replaying %d buffered batches failed", len(head))
            return [f"{type(exc).__name__}: {exc}"] * len(head)

    async def _maintain(self) -> None:
        """Notices a Redis that lost its data (boot token) and sweeps dead placements."""
        while True:
            stop_if_cancelled()
            await asyncio.sleep(self._options.maintenance_interval_s)
            try:
                if self._ready and not self._outage:
                    # A write acknowledged before this read has its mark stored, unless lost.
                    acked = self._acked_mark
                    boot, mark = await self._client.execute_command(
                        "HMGET", self._meta_key, "boot", f"lw:{self._writer}"
                    )
                    if boot != self._boot:
                        self._ready = False
                    elif int(mark or 0) < acked:
                        self._writes_lost = True
                        self._ready = False
                await self.sweep()  # (run even at maxmemory: it frees what CLEARs left)
                # Refused while Redis refuses writes (its maxmemory, a failed save): keeps
                # `_writes_refused` current, so that a process that only reads stops (and
                # starts) answering with the writers.
                await self._fcall("kvp_probe", [])
            except _WritesRefused as exc:
                log.debug("index maintenance: %s", exc)
            except (IndexUnavailableError, *_UNREACHABLE, OSError) as exc:
                self._ready = False
                if not isinstance(exc, IndexUnavailableError):  # those are already recorded
                    self._failure = str(self._unavailable(exc))
                log.debug("index maintenance skipped: %s", exc)
            except RedisError:
                log.exception("index maintenance failed")

    async def sweep(self) -> None:
        """Drop the records of cleared and removed placements now, in bounded calls (other
        clients run in between). The maintenance task does this in the background."""
        chunk = str(self._options.sweep_chunk_buckets)
        pending = True
        while pending:
            pending = bool(await self._fcall("kvp_sweep", [chunk]))

    def _partition_node(self) -> Any:
        """Keyword arguments that send a plain command to the node holding the partition."""
        if isinstance(self._client, RedisCluster):
            return {"target_nodes": self._client.get_node_from_key(self._meta_key)}
        return {}

    async def used_memory_bytes(self) -> int:
        """`used_memory` (INFO memory) of the Redis node holding this partition."""
        try:
            info = await self._client.info("memory", **self._partition_node())
        except (*_UNREACHABLE, OSError) as exc:
            raise self._unavailable(exc) from exc
        return int(info["used_memory"])

    async def function_stats(self, command: str) -> tuple[int, int]:
        """(calls, microseconds) Redis reports for `command` (e.g. "fcall_ro") on the node
        holding this partition (INFO commandstats): server-side time, without the network."""
        try:
            info = await self._client.info("commandstats", **self._partition_node())
        except (*_UNREACHABLE, OSError) as exc:
            raise self._unavailable(exc) from exc
        row = info.get(f"cmdstat_{command}", {"calls": 0, "usec": 0})
        return int(row["calls"]), int(row["usec"])

    async def drop_partition(self) -> int:
        """Delete every key of this partition (benchmarks); returns the number deleted.
        Background upkeep stops: call `close` next."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
            self._maintenance = None
        pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self._meta_key[:-1]) + "*"
        target = self._partition_node()
        deleted = 0
        cursor: Any = 0
        while True:
            reply = await self._client.execute_command(
                "SCAN", cursor, "MATCH", pattern, "COUNT", 1000, **target
            )
            cursor, keys = reply
            if isinstance(cursor, dict):  # the cluster client answers {node: cursor}
                cursor = next(iter(cursor.values()))
            if keys:
                deleted += int(await self._client.execute_command("UNLINK", *keys, **target))
            if int(cursor) == 0:
                break
        self._ready = False
        return deleted

    # ------------------------------------------------------------------ queries

    async def match(self, hashes: Sequence[BlockKey], count_as_hit: bool) -> list[WorkerPlacements]:
        self._check_readable()
        distinct = list(dict.fromkeys(hashes))
        reply = await self._fcall(
            "kvp_match" if count_as_hit else "kvp_match_ro",
            [codec.pack_keys(distinct), b"1" if count_as_hit else b"0"],
            readonly=not count_as_hit,
        )
        items = reply[: len(distinct)]
        names, addresses, _ = _worker_rows(reply[len(distinct) :])
        order: list[int] = []
        ordered: set[int] = set()
        rows: dict[int, dict[int, tuple[list[BlockKey], list[int], list[int]]]] = {}
        for key, item in zip(distinct, items, strict=True):
            if not item:
                continue
            size = codec.u32(item)
            holders: dict[int, None] = {}
            for wid, tier, mask, _copies in codec.iter_placements(item, 4):
                holders[wid] = None
                row = rows.setdefault(wid, {}).setdefault(tier, ([], [], []))
                row[0].append(key)
                row[1].append(mask)
                row[2].append(size)
            new = [wid for wid in holders if wid not in ordered]
            ordered.update(new)
            order.extend(sorted(new, key=names.__getitem__))
        return [
            WorkerPlacements(
                names[wid],
                addresses[wid],
                tuple(
                    TierPlacements(Tier(tier), tuple(r[0]), tuple(r[1]), tuple(r[2]))
                    for tier, r in sorted(rows[wid].items())
                ),
            )
            for wid in order
        ]

    async def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult:
        self._check_readable()
        limit = len(hashes) if max_blocks == 0 else min(len(hashes), max_blocks)
        if limit == 0:
            return PrefixResult((), 0, 0)
        reply = await self._fcall(
            "kvp_prefix", [codec.pack_keys(hashes[:limit]), limit], readonly=True
        )
        found = [
            PrefixMatch(_text(reply[i + 1]), _text(reply[i + 2]), int(reply[i + 3]))
            for i in range(1, len(reply), 4)
        ]
        found.sort(key=lambda m: (-m.matched_prefix_blocks, m.worker_id))
        best = found[0].matched_prefix_blocks if found else 0
        return PrefixResult(tuple(found), best, int(reply[0]))

    async def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        self._check_readable()
        limit = len(hashes) if max_blocks == 0 else min(len(hashes), max_blocks)
        if limit == 0:
            return []
        reply = await self._fcall(
            "kvp_scan", [codec.pack_keys(hashes[:limit]), limit], readonly=True
        )
        end = reply.index(b"")
        blocks = reply[:end]
        # Then the worker rows, the legacy workers failed closed past their run, their count.
        num_past = int(reply[-1])
        rows = reply[end + 1 : len(reply) - 1 - num_past]
        failed_past_run = {int(wid) for wid in reply[len(reply) - 1 - num_past : -1]}
        names, addresses, order = _worker_rows(rows)
        specs = _worker_specs(rows)
        cum_tokens = [0]
        sizes: list[int] = []
        held: list[dict[int, dict[int, int]]] = []  # per block: worker id -> tier -> mask
        for item in blocks:
            sizes.append(codec.u32(item))
            cum_tokens.append(cum_tokens[-1] + sizes[-1])
            per_block: dict[int, dict[int, int]] = {}
            for wid, tier, mask in codec.iter_scan_placements(item):
                per_block.setdefault(wid, {})[tier] = mask
            held.append(per_block)
        out = []
        for wid in order:
            # A worker reuses no more than MatchExternalKvPrefix's rule gives it: the component
            # rule with a cache spec, the legacy rule (which fails closed) without one.
            spec = specs[wid]
            if spec is not None:
                most = _spec_prefix(spec, held, sizes, wid)
            else:
                most = 0 if wid in failed_past_run else _legacy_prefix(held, wid)
            runs = {tier: min(_run(held, wid, {tier}), most) for tier in Tier}
            matched = min(_run(held, wid, set(_SERVABLE)), most)
            per_tier = tuple(TierPrefix(t, n, cum_tokens[n]) for t, n in runs.items() if n)
            any_tier, reach = matched, _run(held, wid, _ANY_TIER)
            if reach > matched:
                # Held past its servable run, on disk: the rule with SSD a resident tier.
                if spec is not None:
                    most = _spec_prefix(spec, held, sizes, wid, ROUTABLE_TIER_MASK)
                any_tier = max(min(reach, most), matched)
            out.append(
                TokenPrefixMatch(
                    names[wid],
                    addresses[wid],
                    matched,
                    cum_tokens[matched],
                    per_tier,
                    any_tier,
                    cum_tokens[any_tier],
                )
            )
        out.sort(key=lambda m: (-m.matched_blocks, m.worker_id))
        return out

    async def hit_counts(self, hashes: Sequence[BlockKey]) -> list[tuple[BlockKey, int]]:
        self._check_readable()
        distinct = list(dict.fromkeys(hashes))
        reply = await self._fcall("kvp_hits", [codec.pack_keys(distinct)], readonly=True)
        return [(k, int(n)) for k, n in zip(distinct, reply, strict=True) if int(n) >= 0]

    async def remove_worker(self, worker_id: str) -> int:
        """Removes the worker; while Redis is down the removal is queued (applied before any
        later batch of that worker) and IndexUnavailableError raised."""
        self._buffer = deque(b for b in self._buffer if b.worker_id != worker_id)
        self._drop_under_way(worker_id)
        # Nothing of it stays for a loss to lose: a later batch of it makes it known again
        # (kept, every engine ever met was asked to resync after each loss).
        self._known_workers.discard(worker_id)
        self._dropping.discard(worker_id)
        self._resync.discard(worker_id)
        self._unannounced.discard(worker_id)
        try:
            removed = await self._remove(worker_id)
        except IndexUnavailableError as exc:
            self._removals.add(worker_id)
            self._recovery_error = str(exc)
            self._outage = True
            self._start_recovery()
            raise
        return removed or 0

    def _drop_under_way(self, worker_id: str) -> None:
        """The worker's batches still on their way to Redis go in no later than its removal:
        those waiting for the call in flight (group commit) are not sent (their `apply`
        returns, as for a buffered batch the removal drops), and one in that call whose write
        fails is not buffered (`apply`). Either would follow the removal and put the worker
        back in the index, an engine that left holding blocks for good."""
        waiting = [(b, done) for b, done in self._group if b.worker_id == worker_id]
        self._group[:] = [item for item in self._group if item[0].worker_id != worker_id]
        for _, done in waiting:
            if not done.done():
                done.set_result(None)
        self._superseded.update(k for k, w in self._applying.items() if w == worker_id)

    async def _remove(self, worker_id: str) -> int | None:
        """kvp_remove; None when it was fenced (`fence_writes`) and refused: the process
        holding the worker's lease owns it, and nothing was removed. Once it ran, nothing this
        process wrote of the worker is left to lose: a batch of it whose call ran before (its
        reply, or `_settle`, made it known again as the removal waited) no longer counts."""
        args: list[bytes | str | int] = [worker_id, self._fence(worker_id)]
        try:
            removed: int = await self._fcall("kvp_remove", args, boot=True)
        except IndexBackendError as exc:
            if _FENCED not in str(exc):
                raise
            log.info("worker %s not removed: %s", worker_id, exc)
            return None
        self._known_workers.discard(worker_id)
        return removed

    # ------------------------------------------------------------------ views

    async def _workers(self) -> list[tuple[str, str, bytes, int]]:
        """Registered workers: name, address, packed spec, live placements. (Without their
        ids: another call may find an id serving another worker, see `_dump`.)"""
        reply = await self._fcall("kvp_workers", [], readonly=True)
        return [
            (
                _text(reply[i + 1]),
                _text(reply[i + 2]),
                reply[i + 3],
                int(reply[i + 4]) + int(reply[i + 5]) + int(reply[i + 6]),
            )
            for i in range(0, len(reply), 7)
        ]

    async def _dump(self) -> AsyncIterator[DumpedBlock]:
        """Every live block: key, token count, parent, and its placements as (worker name,
        tier, mask, copies). Each id is named by the call that read it: a removed worker's id
        goes to the next new worker, so between two calls an id may change hands."""
        step = self._options.dump_chunk_buckets
        for first in range(0, self._options.buckets, step):
            blocks, rows = await self._fcall("kvp_dump", [first, step], readonly=True)
            names, _, _ = _worker_rows(rows)
            for i in range(0, len(blocks), 4):
                parent = codec.unpack_key(blocks[i + 2]) if blocks[i + 2] else None
                placements = [
                    (names[wid], tier, mask, copies)
                    for wid, tier, mask, copies in codec.iter_placements(blocks[i + 3])
                ]
                yield codec.unpack_key(blocks[i]), int(blocks[i + 1]), parent, placements

    async def stats(self) -> IndexStats:
        workers = await self._workers()
        blocks_of: dict[str, int] = {}
        num_blocks = 0
        async for _key, _size, _parent, placements in self._dump():
            num_blocks += 1
            for name in {p[0] for p in placements}:
                blocks_of[name] = blocks_of.get(name, 0) + 1
        rows = sorted(workers)
        return IndexStats(
            backend=self.name,
            num_blocks=num_blocks,
            num_placements=sum(w[3] for w in rows),
            workers=tuple(
                WorkerStats(name, address, blocks_of.get(name, 0), placements)
                for name, address, _spec, placements in rows
            ),
        )

    async def snapshot(self, worker_id: str | None = None) -> AsyncIterator[Batch]:
        """Read into a pure in-memory index, which then writes the batches exactly as the
        memory backend does (parent-first chains, extra copies, wire-valid chunks)."""
        workers = {
            name: (address, spec)
            for name, address, spec, _ in await self._workers()
            if worker_id is None or name == worker_id
        }
        actions: dict[str, list[Action]] = {name: [] for name in workers}
        blocks = []
        async for key, size, parent, placements in self._dump():
            blocks.append((key, size, parent, placements))
        for key, size, stated, placements in _parent_first(blocks):
            # A block held as its own parent (a REPORT repeating a hash; or its head stated
            # so, written before v6: validate_batch refuses that now) is dumped as a root.
            parent = None if stated == key else stated
            for name, tier, mask, copies in placements:
                if name not in actions:  # registered after the worker table was read
                    continue
                sizes = (size,) if size else ()
                actions[name].append(
                    Action(ActionType.REPORT, Tier(tier), (key,), (mask,), sizes, parent)
                )
                actions[name].extend(
                    Action(ActionType.REPORT, Tier(tier), (key,), (mask,), copies=True)
                    for _ in range(copies - 1)
                )
        index = PrefixIndex()
        for name, (address, spec) in workers.items():
            todo = actions[name]
            for start in range(0, max(len(todo), 1), MAX_ACTIONS_PER_BATCH):
                chunk = tuple(todo[start : start + MAX_ACTIONS_PER_BATCH])
                index.apply(Batch(name, chunk, address, cache_spec=codec.unpack_spec(spec)))
        for batch in list(index.snapshot(worker_id)):
            yield batch


def _refused(batch: Batch, status: str) -> IndexBackendError:
    """The error for a batch kvp_apply refused (nothing of it written), from its status."""
    if status.startswith(_PARTITION_FULL):
        return IndexFullError(f"batch of {batch.worker_id}: {status.removeprefix(_PARTITION_FULL)}")
    if status.startswith(_FENCED):
        return LeaseLostError(f"batch of {batch.worker_id}: {status.removeprefix(_FENCED)}")
    return IndexBackendError(f"batch of {batch.worker_id}: {status}")


def _group_size(batches: Sequence[Batch]) -> int:
    """How many of the first `batches` one kvp_apply call carries (its limits above)."""
    n = 0
    num_hashes = 0
    while n < len(batches) and n < MAX_GROUP_BATCHES:
        num_hashes += sum(len(a.hashes) for a in batches[n].actions)
        if n and num_hashes > MAX_GROUP_HASHES:
            break
        n += 1
    return n


def _take_group(
    queue: list[tuple[Batch, asyncio.Future[None]]],
) -> list[tuple[Batch, asyncio.Future[None]]]:
    """The longest head of `queue` within one call's limits, removed from it."""
    n = _group_size([batch for batch, _ in queue])
    group = queue[:n]
    del queue[:n]
    return group


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling (redis-py's cluster client
    wraps what each node answered)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _worker_rows(flat: Sequence[Any]) -> tuple[dict[int, str], dict[int, str], list[int]]:
    """Worker rows (id, name, address, spec) as name and address maps and id order."""
    names: dict[int, str] = {}
    addresses: dict[int, str] = {}
    order: list[int] = []
    for i in range(0, len(flat), 4):
        wid = int(flat[i])
        names[wid] = _text(flat[i + 1])
        addresses[wid] = _text(flat[i + 2])
        order.append(wid)
    return names, addresses, order


def _worker_specs(flat: Sequence[Any]) -> dict[int, CacheSpec | None]:
    """The cache spec of each worker row (id, name, address, spec)."""
    return {int(flat[i]): codec.unpack_spec(flat[i + 3]) for i in range(0, len(flat), 4)}


def _run(held: list[dict[int, dict[int, int]]], wid: int, wanted: Set[int]) -> int:
    """Leading blocks that worker `wid` holds on some tier in `wanted`."""
    n = 0
    for per_block in held:
        tiers = per_block.get(wid)
        if tiers is None or tiers.keys().isdisjoint(wanted):
            break
        n += 1
    return n


def _legacy_prefix(held: list[dict[int, dict[int, int]]], wid: int) -> int:
    """Worker `wid`'s prefix by the legacy rule, over the scanned blocks: its run on any tier,
    or 0 (fail closed) when one of them carries component data for it (kvp_scan reports the
    blocks past its run)."""
    n = _run(held, wid, _ANY_TIER)
    if any(mask for per_block in held[:n] for mask in per_block[wid].values()):
        return 0
    return n


def _spec_prefix(
    spec: CacheSpec,
    held: list[dict[int, dict[int, int]]],
    sizes: list[int],
    wid: int,
    tiers: int = SERVABLE_TIER_MASK,
) -> int:
    """Worker `wid`'s prefix by the component rule, over the scanned blocks (`tiers`: where a
    component may be resident, the seed's servable set by default)."""
    blocks = (
        (resident_components(spec, per_block.get(wid, {}).items(), tiers), size)
        for per_block, size in zip(held, sizes, strict=True)
    )
    return spec_prefix_blocks(spec, blocks)


def _parent_first(blocks: list[DumpedBlock]) -> list[DumpedBlock]:
    """Blocks ordered so each comes after its indexed parent (roots by key, pre-order)."""
    by_key = {b[0]: b for b in blocks}
    children: dict[BlockKey, list[BlockKey]] = {}
    roots = []
    for key, _size, parent, _placements in blocks:
        if parent is None or parent not in by_key:
            roots.append(key)
        else:
            children.setdefault(parent, []).append(key)
    order: list[DumpedBlock] = []
    visited: set[BlockKey] = set()
    # A parent cycle (only from inconsistent reports) has no root: visit it last.
    for start in [*sorted(roots), *sorted(by_key)]:
        stack = [start]
        while stack:
            key = stack.pop()
            if key in visited:
                continue
            visited.add(key)
            order.append(by_key[key])
            stack.extend(sorted(children.get(key, ()), reverse=True))
    return order
