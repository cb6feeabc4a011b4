"""The fleet's run-time membership: engines registered and removed, and cordons, through the
admin API, shared by every controller replica of a Redis index.

Behind a load balancer an admin call lands on one replica: kept to itself, an engine the
planner registers would be routed to by that replica only, and a cordon would leave the
others sending the engine traffic. With `index.backend` on Redis every change is written into
the partition's membership hash (`<key_prefix>:{<model>:0}:fm`, docs/redis.md) before the
replica applies it, and every replica reads the hash when it starts and at every
`health.poll_interval_s`, applying what changed: a change made through any replica reaches
the others within a poll interval. A change reads the hash first (`_catch_up`): the call
before it may have landed on another replica. A call whose change Redis does not take is
refused (UNAVAILABLE) and changes nothing, so the hash never misses what a replica applied.

The hash's fields: `a:<address>` an engine registered through the admin API (its `kv_events`
mode; RegisterEngine takes no `array_tail`: every replica chooses the engine's from its
GetEngineInfo name, alike), `o:<address>` who registered it (its RegisterEngine's `owner`, when
it said; a replica applies it to an engine it already has too, one removed and registered again
between two reads; a replica older than the field ignores it), `c:<address>` a cordoned engine
(cleared when it is removed or registered),
`x:<address>` an engine of the replicas' config removed (config engines are in every replica's
config; removing one through any replica removes it from all, a replica started later included,
until it is registered again), `d:<address>` the engine process last drained through a
replica (a token of the drain and the process's instance id: another replica whose polls see
the engine leave ready without having seen it say DRAINING reads it then, and takes that
leave for the drain, not a flap, once per drain; cleared when the engine is removed or
registered, or did not take the drain; a drain Redis does not take goes on unshared),
`l:<name>` the fleet's LoRA intent for an adapter (controller.lora_intent: what is restored
on an engine's new process), as the replica a LoadLora or UnloadLora went through holds it
after the call (JSON: its id, path, loads, each load's place in the fleet's loading order
and the engines a fleet-wide load is kept off; no field: loaded nowhere; an unload of an
adapter the hash had no load of, found on the engines, `{"unloaded": <token>}`, so that
the replicas that found it drop it too, until its lifetime is over, below, or it is loaded
again); each replica reads the hash before a LoRA
call, writes the field after it, and takes a field that changed since its last read into its
own intent (one gone: unloaded; an unload marker gone: nothing), `#<field>` the stamp of
each field set or deleted (`_CHANGE`: Redis's clock in ms, above the field's last stamp and
the hash's highest), the stamp of a field deleted its tombstone, `#` the hash's highest
stamp, and `v`, the hash's generation:
set (to a fresh token) by whoever writes a hash Redis does not hold, kept by every change
after. A hash without it was
lost by Redis (or never written): the replica writes its own membership back instead of
dropping what it does not find (an engine's `a:` wherever the hash it read had one: a config
engine registered again, which a replica that had not read its removal holds as its config's,
included). A replica that finds another generation than it read last finds
a hash written back since by another replica, which knew only its own membership: it writes its
own back too (the fields merge) before applying the hash, so no replica takes what another did
not know for a removal. Once every running replica has read the new generation, the hash is the
union of their views, each field as the newest stamp any of them knew it by: a replica writes
every field back with the stamp it last read or wrote it with, its tombstones included, and
Redis takes a field only when its stamp is newer than the one the hash holds. So a removal or
an uncordon made through one replica that Redis lost before another replica read it stays
made: the other's write-back (the engine registered, cordoned) is older than its tombstone.
Redis restarted from a snapshot older than a change keeps the generation but goes back in
time: a replica that read or made a later change (its highest stamp above the hash's `#`)
writes its membership back into a new generation, which the others then find, adding theirs
(else they would apply the snapshot: a removal undone).
A tombstone, and an unload marker, lives `TOMBSTONE_READS` read intervals (the
`health.poll_interval_s` of the replica whose change drops it: the replicas share a config)
past its change, and as long past the generation's start (`#v`: after a loss, the write-backs
come within a read interval); then the next change of the hash (any replica's) drops it: the
hash holds no more tombstones than the changes of that lifetime leave. A replica that has not
read the hash for that long (cut off from Redis while it ran) may, after a loss, write back
what was deleted meanwhile, as before tombstones, and one that found an adapter on the engines
misses its unload.

Without a Redis index the calls change this replica's fleet only, as they always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from redis.exceptions import RedisError

from controller.config import ControllerConfig
from controller.fleet import BLIND_WARNING_INTERVAL_S, Fleet, ThrottledWarning
from controller.lora_intent import LoraSpec, SharedLora
from controller.registry import DuplicateEngineError, EngineRecord, UnknownEngineError
from indexer.redis_client import Client, RedisOptions, connect, stop_if_cancelled
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

_REGISTERED, _OWNER, _CORDONED, _REMOVED, _DRAINED = "a:", "o:", "c:", "x:", "d:"
_LORA, _MARKER, _STAMP = "l:", "v", "#"
# Deletes hash field ARGV[1] of KEYS[1] if it holds ARGV[2].
_DELETE_IF_EQUAL = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then "
    "return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0"
)
# An `l:<name>` field's key for an adapter unloaded that the hash had no load of.
_UNLOADED = "unloaded"
# A tombstone (and an unload marker) lives this many of the writing replica's read intervals
# (`health.poll_interval_s`) past its change, and past the hash's generation: every running
# replica reads the hash meanwhile.
TOMBSTONE_READS = 10
# One change (or a write-back, a merge) of the membership hash KEYS[1], atomically. ARGV: a
# fresh generation (set if the hash has none: lost, or never written), the tombstones'
# lifetime in ms, the mode ("c" a change, "m" a merge, "g" a merge into the fresh
# generation: the hash went back in time), the highest stamp the writer knows (`#`, below),
# then per field its name, "s" (set to the value) or "d" (delete), the value, and (a
# merge's) the stamp the writer knows the field by. Every field set or deleted has its
# stamp, `#<field>`: Redis's clock in ms when it changed, above the field's last stamp and
# the hash's highest (`#`, raised by every change and merge, and to what the writer knows:
# above every stamp written back, whatever the clock of a Redis restarted on another host),
# a field deleted that the hash did not hold included (a replica that knew it set, and had
# not read the hash since Redis lost it, may write it back). A merge takes a field only when
# its stamp is newer than the hash's: a view written back resurrects no field deleted since
# (its stamp, the tombstone, is newer). Tombstones (a stamp without its field) and unload
# markers older than the lifetime, in a generation as old, go. Returns the hash's highest
# stamp afterwards (a change's: its stamp).
_CHANGE = """
redis.replicate_commands()
local key, ttl, mode, known = KEYS[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local merge = mode ~= 'c'
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if mode == 'g' then
  redis.call('HSET', key, 'v', ARGV[1], '#v', now)
elseif redis.call('HSETNX', key, 'v', ARGV[1]) == 1 then
  redis.call('HSET', key, '#v', now)
end
local high = math.max(tonumber(redis.call('HGET', key, '#')) or 0, known)
local stamp = math.max(now, high + 1)
for i = 5, #ARGV, 4 do
  local last = tonumber(redis.call('HGET', key, '#' .. ARGV[i]))
  if not merge and last and last >= stamp then stamp = last + 1 end
end
if not merge then high = stamp end
for i = 5, #ARGV, 4 do
  local field, set, at = ARGV[i], ARGV[i + 1] == 's', stamp
  local last = tonumber(redis.call('HGET', key, '#' .. field))
  if merge then at = tonumber(ARGV[i + 3]) end
  if not merge or last == nil or at > last then
    if set then redis.call('HSET', key, field, ARGV[i + 2])
    else redis.call('HDEL', key, field) end
    redis.call('HSET', key, '#' .. field, at)
    high = math.max(high, at)
  end
end
redis.call('HSET', key, '#', high)
local old = now - ttl
if (tonumber(redis.call('HGET', key, '#v')) or 0) < old then
  local all, values = redis.call('HGETALL', key), {}
  for i = 1, #all, 2 do values[all[i]] = all[i + 1] end
  for name, value in pairs(values) do
    local field = string.sub(name, 2)
    if string.sub(name, 1, 1) == '#' and field ~= 'v' and field ~= '' and tonumber(value) < old then
      local held = values[field]
      if held == nil then redis.call('HDEL', key, name)
      elseif string.sub(field, 1, 2) == 'l:' and string.sub(held, 1, 11) == '{"unloaded"' then
        redis.call('HDEL', key, name, field)
      end
    end
  end
end
return high
"""


class MembershipUnavailableError(KvplaneError):
    """The shared membership could not be changed (Redis did not answer): nothing changed,
    retry later."""


class Membership:
    """RegisterEngine, RemoveEngine, Cordon and Uncordon of this replica, shared with the
    other replicas through Redis when the index is there (`start` opens it)."""

    def __init__(self, fleet: Fleet, config: ControllerConfig) -> None:
        self.fleet = fleet
        self._config = config
        self._client: Client | None = None
        self._key = ""
        # One change at a time, the periodic read's included: a read taken before a change
        # was written must not undo it.
        self._lock = asyncio.Lock()
        # The hash's generation (`v`) at this replica's last read; None before the first.
        self._generation: str | None = None
        # The `l:<name>` fields (the fleet's LoRA intent) as this replica last read or wrote
        # them: one that changed is taken into its intent, one gone is an unload.
        self._loras: dict[str, str] = {}
        # field -> its stamp and whether it is set (False: a tombstone), as this replica last
        # read or wrote it: what its write-back writes them with (`_write_back`).
        self._stamps: dict[str, tuple[int, bool]] = {}
        # The hash's highest stamp (`#`) as this replica last read or wrote it: a hash read
        # with a lower one went back in time (Redis restarted from an older snapshot).
        self._high = 0
        self._task: asyncio.Task[None] | None = None
        self._read_failed = ThrottledWarning(BLIND_WARNING_INTERVAL_S, time.monotonic, log)
        # The engines' adapters are listed after the first read (`start`): an unload the hash
        # holds then was written before any adapter this replica finds (`_apply_loras`).
        fleet.hold_lora_listings(_shares(config))

    @property
    def shared(self) -> bool:
        return self._client is not None

    async def start(self) -> None:
        if not _shares(self._config):
            return
        index = self._config.index
        options = RedisOptions(**index.backend_options())
        try:
            self._client, _ = connect(index.backend, options)
            self._key = options.partition_key("fm")
            self.fleet.shared_drains = self._drained
            await self._refresh_or_warn()
        finally:
            # (A first read Redis did not answer: the listings go on, and that read, when
            # one answers, takes the unloads it finds for older than what they found.)
            self.fleet.hold_lora_listings(False)
        self._task = asyncio.create_task(self._follow(), name="shared membership")

    async def close(self) -> None:
        # (The fleet's polls go on until it closes: their leaves are judged without it.)
        self.fleet.shared_drains = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---- the admin API's changes ----

    async def register(self, address: str, kv_events: str, owner: str = "") -> EngineRecord:
        while True:
            async with self._lock:
                await self._catch_up()
                removal = self.fleet.removal(address)
                if removal is None:
                    return await self._register(address, kv_events, owner)
            # Being removed (through any replica, this one's reads included): waited for
            # without the lock (dropping its index entries waits on Redis, which may be
            # slow), the other membership calls going on meanwhile; then read again.
            await asyncio.shield(removal)

    async def _register(self, address: str, kv_events: str, owner: str) -> EngineRecord:
        """`register` under the lock, the address removed nowhere now."""
        record = await self.fleet.add_engine(address, kv_events, source="admin", owner=owner)
        fields = {_REGISTERED + address: kv_events}
        # A fresh engine, not cordoned: a cordon left by a replica that had not read its
        # removal (Redis lost it meanwhile) is not this one's.
        deleted = [_REMOVED + address, _DRAINED + address, _CORDONED + address]
        if owner:
            fields[_OWNER + address] = owner
        else:
            deleted.append(_OWNER + address)
        try:
            await self._write(fields, deleted)
        except MembershipUnavailableError:
            await self.fleet.remove_engine(address)
            raise
        return record

    async def remove(self, key: str) -> EngineRecord:
        async with self._lock:
            await self._catch_up()
            record = self.fleet.registry.get(key)
            address = record.address
            # An engine of the config, even one registered again since its last removal (its
            # record's source is then "admin"): without its `x:` a replica started later would
            # route to it again.
            removed = {_REMOVED + address: "1"} if self._in_config(address) else {}
            await self._write(
                removed,
                [_REGISTERED + address, _OWNER + address, _CORDONED + address, _DRAINED + address],
            )
            # Out of the registry now; what it left is dropped out of the lock (a registration
            # of the address meanwhile waits for it).
            record, removal = self.fleet.begin_removal(address)
            # Its own adapters (`lora load --engine`) leave the fleet's LoRA intent with it.
            await self._share_loras(list(self._loras))
        await asyncio.shield(removal)
        return record

    async def set_cordoned(self, key: str, cordoned: bool) -> EngineRecord:
        async with self._lock:
            await self._catch_up()
            record = self.fleet.registry.get(key)
            field = _CORDONED + record.address
            if cordoned:
                await self._write({field: "1"}, [])
            else:
                await self._write({}, [field])
            return self.fleet.registry.set_cordoned(record.address, cordoned)

    async def record_drain(self, record: EngineRecord) -> str | None:
        """DrainEngine through this replica: the drained process (its instance id, and a
        token of this drain) goes into the shared hash, for the other replicas to read when
        the engine leaves ready (`_drained`), which their polls may see without its DRAINING
        (drained and stopped within a poll interval): a drain, not a flap. The drain goes
        on when Redis does not take it (the engine's own, not the membership's): the others
        may then count its leave as a flap, as before. Returns the drain as recorded (None:
        not), for `withdraw_drain`."""
        if self._client is None:
            return None
        drain = f"{uuid.uuid4().hex}:{record.engine_id}"
        async with self._lock:
            try:
                await self._write({_DRAINED + record.address: drain}, [])
            except MembershipUnavailableError as exc:
                log.warning("the drain of engine %s is not shared with the other controller "
                            "replicas (their polls count its leave as a flap): %s",
                            record.address, exc)  # fmt: skip
                return None
        return drain

    async def withdraw_drain(self, address: str, drain: str | None) -> None:
        """The engine at `address` did not take the drain `record_drain` recorded (`drain`):
        out of the shared hash, unless another was recorded since. Left there, another
        replica would take the process's next leave from ready (a hang, say) for that drain:
        no flap, and out of its routing as draining for as long as the process lives, while
        this replica routes to it again. Redis not answering, it stays (a warning says so)."""
        if self._client is None or drain is None:
            return
        try:
            await self._client.eval(_DELETE_IF_EQUAL, 1, self._key, _DRAINED + address, drain)
        except (RedisError, OSError) as exc:
            log.warning("the drain of engine %s that it did not take is still shared with the "
                        "other controller replicas (its next leave from ready is no flap "
                        "there, and may keep it out of their routing): %s",
                        address, exc)  # fmt: skip

    async def _drained(self, address: str) -> tuple[str, str] | None:
        """The last drain recorded for the engine at `address` (`record_drain`): its token
        and the instance id of the process drained; None when none is, or Redis does not
        answer (a leave is then judged as without the shared membership)."""
        assert self._client is not None
        try:
            value = await self._client.hget(self._key, _DRAINED + address)
        except (RedisError, OSError) as exc:
            # (redis-py's error for the poll's cancellation, RemoveEngine's: the poll ends.)
            stop_if_cancelled()
            self._read_failed.warn(
                f"the drains made through other controller replicas could not be read from "
                f"Redis (a drained engine's leave counts as a flap): {exc}"
            )
            return None
        if value is None:
            return None
        token, _, instance_id = _text(value).partition(":")
        return token, instance_id

    async def share_lora(self, lora_name: str, *, unloaded: bool = False) -> None:
        """A LoadLora or UnloadLora through this replica (under the fleet's `lora_changes`)
        changed the fleet's LoRA intent for `lora_name`: what it now holds for it goes into
        the shared hash (`l:<name>`; loaded nowhere, the field goes), which every replica
        takes into its intent at its next read. `unloaded`: an UnloadLora of an adapter the
        intent held; one the hash has no load of is then written as unloaded (the other
        replicas may hold it as found on the engines, which no field told them of). The
        change stands here when Redis does not take it (the engines have it): the others
        keep their intent for it, a warning says so."""
        if self._client is None:
            return
        async with self._lock:
            await self._share_loras([lora_name], unloaded=unloaded)

    async def _share_loras(self, names: list[str], *, unloaded: bool = False) -> None:
        """(Under the lock.) Write what the fleet's LoRA intent holds for `names` where it
        differs from the hash as last read or written here."""
        intent = self.fleet.lora_intent
        values = {name: _encode_lora(intent.shared(name)) for name in names}
        for name, value in values.items():
            last = self._loras.get(name)
            if value is None and (last is None or _is_unload(last)):
                # No load of it in the hash: the other replicas may hold it all the same,
                # found on the engines (a controller rebuilds its intent from them), and
                # an absent field would tell them nothing. An unload through this replica
                # says so (`_UNLOADED`, a fresh token); what was there stays otherwise.
                values[name] = json.dumps({_UNLOADED: uuid.uuid4().hex}) if unloaded else last
        changed = {name: v for name, v in values.items() if v != self._loras.get(name)}
        if not changed:
            return
        try:
            await self._write(
                {_LORA + name: v for name, v in changed.items() if v is not None},
                [_LORA + name for name, v in changed.items() if v is None],
            )
        except MembershipUnavailableError as exc:
            log.warning("the LoRA changes of %s are not shared with the other controller "
                        "replicas (their intent keeps what it held): %s",
                        sorted(changed), exc)  # fmt: skip
            return
        for name, value in changed.items():
            if value is None:
                self._loras.pop(name, None)
            else:
                self._loras[name] = value

    async def find(self, key: str) -> EngineRecord:
        """The engine `key` names (address or instance id), read from the shared membership
        first when this replica does not know it: registered through another replica since
        this one's last read, it is one the caller may drain already."""
        try:
            return self.fleet.registry.get(key)
        except UnknownEngineError:
            if self._client is None:
                raise
        await self.catch_up()
        return self.fleet.registry.get(key)

    async def catch_up(self) -> None:
        """Take what the shared membership says now, before an action that is no change of
        it (a drain of an engine this replica does not know, a LoRA load or unload: another
        replica's may have come since the last read). When Redis does not answer, the action
        goes on with this replica's view."""
        if self._client is None:
            return
        with contextlib.suppress(MembershipUnavailableError):
            async with self._lock:
                await self._catch_up()

    async def _catch_up(self) -> None:
        """Before a change (under the lock): take what the shared membership says now, so
        that the change is made to the fleet every replica has, not to this replica's view
        of up to a poll interval ago. Without it a call landing on another replica than the
        one before it (each CLI call is a connection of its own behind a load balancer) acted
        on a stale view: `register` then `cordon` X got NOT_FOUND; `remove` then `register` X
        got ALREADY_EXISTS, and X then left every replica at the next read; a cordon of an
        engine removed meanwhile stayed in the hash, cordoning X registered again later."""
        if self._client is None:
            return
        try:
            await self._update()
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from exc

    def _in_config(self, address: str) -> bool:
        return any(e.address == address for e in self._config.engines)

    async def _write(self, fields: dict[str, str], deleted: list[str]) -> None:
        """One change of the shared hash, atomically (nothing without a Redis index): every
        field set or deleted gets the change's stamp (`_CHANGE`)."""
        if self._client is None:
            return
        changes = [(f, "s", v, 0) for f, v in fields.items()] + [(f, "d", "", 0) for f in deleted]
        stamp = await self._change(changes, "c")
        self._stamps.update({f: (stamp, True) for f in fields})
        self._stamps.update({f: (stamp, False) for f in deleted})

    async def _change(self, changes: list[tuple[str, str, str, int]], mode: str) -> int:
        """`_CHANGE` of `changes` (field, "s" or "d", value, stamp) in `mode` ("c", "m" or
        "g"); returns its stamp (a merge's: the hash's highest)."""
        assert self._client is not None
        # A new generation only for a hash Redis does not hold (lost, or never written), or
        # one that went back in time ("g").
        lifetime_ms = int(TOMBSTONE_READS * self._config.health.poll_interval_s * 1000)
        args: list[Any] = [uuid.uuid4().hex, lifetime_ms, mode, self._high]
        for change in changes:
            args.extend(change)
        try:
            high = int(await self._client.eval(_CHANGE, 1, self._key, *args))
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from exc
        self._high = max(self._high, high)
        return high

    # ---- the other replicas' changes ----

    async def _follow(self) -> None:
        while True:
            stop_if_cancelled()
            await asyncio.sleep(self._config.health.poll_interval_s)
            await self._refresh_or_warn()

    async def _refresh_or_warn(self) -> None:
        try:
            await self.refresh()
        except (RedisError, OSError, MembershipUnavailableError) as exc:
            self._read_failed.warn(
                f"the fleet's shared membership could not be read from Redis (changes made "
                f"through other controller replicas wait): {exc}"
            )

    async def refresh(self) -> None:
        """Read the shared membership and apply what differs here."""
        async with self._lock:
            await self._update()

    async def _update(self) -> None:
        """`refresh` under the lock."""
        assert self._client is not None
        fields, stamps, high = await self._read()
        generation = fields.get(_MARKER)
        if generation is None or (self._generation is not None and generation != self._generation):
            await self._write_back("m")
            fields, stamps, high = await self._read()
        elif high < self._high:
            # Redis restarted from a snapshot older than a change this replica read or made:
            # its view goes back, into a new generation, so that every replica adds its own.
            log.warning("the fleet's shared membership went back in time in Redis (restarted "
                        "from an older snapshot): writing this replica's back")  # fmt: skip
            await self._write_back("g")
            fields, stamps, high = await self._read()
        first, self._generation = self._generation is None, fields.get(_MARKER)
        self._stamps, self._high = stamps, high
        await self._apply(fields, first)

    async def _read(self) -> tuple[dict[str, str], dict[str, tuple[int, bool]], int]:
        """The hash's fields, the stamp of each field (0: none, a field an older release
        wrote) and whether it is set (False: a tombstone), and the hash's highest stamp."""
        assert self._client is not None
        raw = {_text(k): _text(v) for k, v in (await self._client.hgetall(self._key)).items()}
        fields = {f: v for f, v in raw.items() if not f.startswith(_STAMP)}
        stamps = {f: (0, True) for f in fields if f != _MARKER}
        for name, value in raw.items():
            field = name.removeprefix(_STAMP)
            if name.startswith(_STAMP) and field not in (_MARKER, ""):
                stamps[field] = (int(value), field in fields)
        return fields, stamps, int(raw.get(_STAMP, 0))

    async def _apply(self, fields: dict[str, str], first: bool) -> None:
        """Take the hash's `fields` here (`first`: this replica's first read)."""
        registry = self.fleet.registry
        registered = {
            f.removeprefix(_REGISTERED): mode for f, mode in fields.items() if f[:2] == _REGISTERED
        }
        for record in registry.records():
            gone = (
                record.address not in registered
                if record.source == "admin"
                else _REMOVED + record.address in fields
            )
            if gone:
                log.info("engine %s removed through another controller replica", record.address)
                self.fleet.begin_removal(record.address)
        for address, mode in registered.items():
            owner = fields.get(_OWNER + address, "")
            known = registry.by_engine_id(address)
            if known is not None:
                # As its registration says: removed and registered again (another owner, or
                # none) between two reads, it is one this replica already has.
                known.owner = owner
                continue
            log.info("engine %s registered through another controller replica", address)
            # (Still being removed here: added at the next read.)
            with contextlib.suppress(DuplicateEngineError):
                await self.fleet.add_engine(address, mode, source="admin", owner=owner)
        for record in registry.records():
            cordoned = _CORDONED + record.address in fields
            if record.cordoned != cordoned:
                registry.set_cordoned(record.address, cordoned)
        self._apply_loras(fields, first)

    def _apply_loras(self, fields: dict[str, str], first: bool) -> None:
        """Take into the fleet's LoRA intent the adapters loaded or unloaded through other
        replicas since the last read (`share_lora`); at the `first` read, not the unloads
        written before: the engines' adapters are listed after it (`start`), so what this
        replica finds there was loaded since."""
        intent = self.fleet.lora_intent
        shared = {f.removeprefix(_LORA): v for f, v in fields.items() if f[:2] == _LORA}
        adopted: list[str] = []
        try:
            self._adopt_loras(shared, first, adopted)
        finally:
            if adopted:
                # Their loads in their places at once (at a start, thousands of fields each
                # put in place would move every load held, each time).
                intent.order()

    def _adopt_loras(self, shared: dict[str, str], first: bool, adopted: list[str]) -> None:
        """(`_apply_loras`.) Adopt the fields `shared` (by adapter name) that changed, each
        name adopted out of place (`LoraIntent.adopt`) added to `adopted`."""
        intent = self.fleet.lora_intent
        for name in [n for n in self._loras if n not in shared]:
            if _is_unload(self._loras.pop(name)):
                continue  # an unload marker expired (`TOMBSTONE_READS`): taken already
            log.info("LoRA adapter %r unloaded through another controller replica", name)
            intent.adopt(name, None)
        for name, value in shared.items():
            if self._loras.get(name) == value:
                continue
            self._loras[name] = value
            if first and _is_unload(value):
                continue
            try:
                lora = _decode_lora(name, value)
            except (ValueError, TypeError, KeyError) as exc:  # (another release's, say)
                log.warning("LoRA adapter %r of the shared membership not understood: %s",
                            name, exc)  # fmt: skip
                continue
            change = "changed" if lora is not None else "unloaded"
            log.info("LoRA adapter %r %s through another controller replica", name, change)
            adopted.append(name)
            intent.adopt(name, lora, ordered=False)

    async def _write_back(self, mode: str) -> None:
        """Redis lost the hash (or another replica wrote it back since this one's last read;
        `mode` "m"), or went back to an older one ("g": into a new generation): write this
        replica's membership into it, the config engines it removed included (a
        config engine is out of the registry only once removed: without its `x:` a replica
        started later would route to it again). Fields merge: each write-back is a hash set
        of its own."""
        records = self.fleet.registry.records()
        # Registered through the admin API: by this replica's record, or by the hash it read
        # (a config engine removed and registered again through another replica between two
        # reads here keeps its record of the config; without its `a:` the replicas that saw
        # the removal would not take it back, nor anyone its owner).
        fields = {
            _REGISTERED + r.address: r.kv_events
            for r in records
            if r.source == "admin" or self._held(_REGISTERED + r.address)
        }
        fields.update({_OWNER + r.address: r.owner for r in records if r.owner})
        fields.update({_CORDONED + r.address: "1" for r in records if r.cordoned})
        present = {r.address for r in records}
        fields.update(
            {_REMOVED + e.address: "1" for e in self._config.engines if e.address not in present}
        )
        fields.update({_LORA + name: value for name, value in self._loras.items()})
        # Each with the stamp this replica knows it by: a field deleted since through another
        # replica (its tombstone newer) stays deleted, and so do those this replica saw
        # deleted (their tombstones) when another replica writes back an older view.
        changes = [(f, "s", v, self._stamp_of(f)) for f, v in fields.items()]
        changes += [
            (f, "d", "", stamp)
            for f, (stamp, held) in self._stamps.items()
            if not held and f not in fields
        ]
        await self._change(changes, mode)

    def _held(self, field: str) -> bool:
        """Whether `field` was set (not deleted) as last read or written here; False for one
        never seen."""
        return self._stamps.get(field, (0, False))[1]

    def _stamp_of(self, field: str) -> int:
        """The stamp of `field` as last read or written here, if it was set then; else 0
        (older than any change)."""
        stamp, held = self._stamps.get(field, (0, False))
        return stamp if held else 0


def _shares(config: ControllerConfig) -> bool:
    """Whether the replica shares its membership: its index is on Redis."""
    return config.index.remote is None and config.index.backend.startswith("redis")


def _unavailable(exc: Exception) -> MembershipUnavailableError:
    return MembershipUnavailableError(
        f"the fleet's membership, shared by the controller replicas, is kept in Redis, which "
        f"did not take the change (nothing changed; retry): {exc}"
    )


def _encode_lora(shared: SharedLora | None) -> str | None:
    """An `l:<name>` field's value: the adapter's id and path, its loads in their order
    (address, "" for the fleet; model, null when none was named), each load's place in the
    fleet's loading order (`at`, one for each load: a replica adopting it restores the
    fleet's adapters in the order they were loaded, not in the hash's field order), the
    engines kept off; None for an adapter loaded nowhere (no field)."""
    if shared is None:
        return None
    return json.dumps(
        {
            "id": shared.spec.lora_id,
            "path": shared.spec.source_path,
            "on": [[address or "", model] for address, model in shared.on.items()],
            "at": [shared.seqs.get(address, 0) for address in shared.on],
            "off": sorted(shared.off),
        }
    )


def _is_unload(value: str) -> bool:
    """Whether an `l:<name>` field's value is an unload (`_UNLOADED`)."""
    try:
        record = json.loads(value)
    except ValueError:
        return False
    return isinstance(record, dict) and _UNLOADED in record


def _decode_lora(name: str, value: str) -> SharedLora | None:
    """An `l:<name>` field's adapter; None for an unload (`_UNLOADED`)."""
    if _is_unload(value):
        return None
    record = json.loads(value)
    on = {address or None: model for address, model in record["on"]}
    # (No `at`: an older release's field, its loads before any numbered.)
    seqs = record.get("at", [0] * len(on))
    return SharedLora(
        LoraSpec(int(record["id"]), name, str(record["path"])),
        on,
        frozenset(record["off"]),
        {address: int(seq) for address, seq in zip(on, seqs, strict=True)},
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
