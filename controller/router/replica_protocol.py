"""The messages controller replicas exchange to stay in sync, without the I/O.

`controller.replica_sync` moves these messages over Redis pub/sub; everything it decides (what
to publish, what a received message does to the router, when a peer is forgotten) is here, so
that the property test (tests/controller/test_replica_protocol.py) exercises the code that runs
live, over any interleaving, loss and restart of replicas.

Messages are msgpack arrays `[VERSION, origin, seq, kind, body]`; `origin` is the replica's
instance id, `seq` counts its messages from 1. A message of another version (a replica of
another kvplane release, during a rolling upgrade) is dropped, with one warning per such
replica: the two do not see each other's requests until every replica speaks one version.
Version 2 added the session of a route (`Routed.session_key`, `session_version`); version 3
the sessions of a snapshot. Kinds:

- `events`: the router's events since the last message (`controller.router.replicas`);
- `beat`: sent when there were no events for a while, so that peers know it is alive;
- `hello`: a replica joined (or lost its subscription and came back): every other replica
  answers with a `snapshot`, `[requests, sessions]`: its own requests in flight, which
  replace what was known of it, and the `snapshot_sessions` (`SNAPSHOT_SESSIONS`) sessions
  its router routed or learnt last, `[session, engine, version]` each, oldest first, which
  the receiver sticks as it sticks its peers' routes (a later route of a session it knows wins,
  whatever the order: `SessionRoute.supersedes`). So a replica that joins (scaled up,
  restarted) sends a session whose requests all ended to the engine that holds its prefix,
  as its peers do; a session older than the bound, of the up to `Router.session_capacity`
  (100,000) a router keeps, is routed by its policy there until its next route through a
  peer;
- `resend`: a peer needs this origin's snapshot (body: the origin): it found a gap in its
  `seq` (pub/sub delivers at most once: a message published while a subscriber was
  reconnecting is lost for it, and a message whose publish failed consumed its number), or
  heard it for the first time (what it routed before is unknown: the hello that would have
  brought its snapshot may have been published while it was not subscribed);
- `bye`: the replica stops; peers release its requests at once.

A request for a snapshot that stays unanswered (the request or the answer lost in turn) is
repeated once `resend_after_s` passed, at the origin's next message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgpack

from controller.router.replicas import Finished, FirstToken, PeerRoutes, Routed, RouteEvent
from controller.router.router import SessionRoute
from kvplane.unpack_failure import unpack_failure

if TYPE_CHECKING:
    from controller.router.router import Router

log = logging.getLogger(__name__)

VERSION = 3
# The most sessions a snapshot carries: 56 bytes each with UUID session keys and host:port
# engine ids (measured: 560 kB a snapshot, 7 ms to build, 9 ms to apply), so that the
# snapshots of eight replicas answering one hello at once stay under Redis's default soft
# limit of a pub/sub client's output buffer (8 MB, `client-output-buffer-limit pubsub`), past
# which Redis drops a subscriber.
SNAPSHOT_SESSIONS = 10_000
_ROUTED, _FIRST_TOKEN, _FINISHED = 0, 1, 2


def encode_event(event: RouteEvent) -> list[Any]:
    if isinstance(event, Routed):
        return [
            _ROUTED,
            event.request_id,
            event.engine_id,
            event.prefill_tokens,
            event.cached_tokens,
            list(event.block_keys),
            event.claims_prefix,
            event.session_key,
            event.session_version,
        ]
    return [_FIRST_TOKEN if isinstance(event, FirstToken) else _FINISHED, event.request_id]


def decode_event(item: Any) -> RouteEvent:
    kind = item[0]
    if kind == _ROUTED:
        _, request_id, engine_id, prefill, cached, keys, claims, session, session_version = item
        return Routed(
            str(request_id),
            str(engine_id),
            int(prefill),
            int(cached),
            tuple(keys),
            bool(claims),
            None if session is None else str(session),
            int(session_version),
        )
    if kind == _FIRST_TOKEN:
        return FirstToken(str(item[1]))
    if kind == _FINISHED:
        return Finished(str(item[1]))
    raise ValueError(f"unknown route event kind {kind!r}")


class ReplicaProtocol:
    """One replica's side of the sync: numbers its messages, applies its peers' to its router
    (`PeerRoutes`), and says what to publish in answer. Pure: the caller publishes the bytes
    and passes the time."""

    def __init__(
        self,
        router: Router,
        instance_id: str,
        *,
        resend_after_s: float = 1.0,
        snapshot_sessions: int = SNAPSHOT_SESSIONS,
    ) -> None:
        self.router = router
        self.instance_id = instance_id
        self.resend_after_s = resend_after_s
        self.snapshot_sessions = snapshot_sessions
        self.peers = PeerRoutes(router)
        self.num_gaps = 0  # messages of peers found missing (each answered by a snapshot)
        self.heard: dict[str, float] = {}  # origin -> when last heard from
        self._seq = 0
        self._outbox: list[list[Any]] = []
        self._last_seq: dict[str, int] = {}
        self._asked: dict[str, float] = {}  # origin -> when its snapshot was last asked for
        # Origins of another version, warned about -> when last heard from; forgotten once
        # silent (`forget_silent_other_versions`), as every replica restart is a new origin.
        self._other_versions: dict[str, float] = {}

    def queue(self, event: RouteEvent) -> None:
        """One of the router's own events, sent with the next `turn`."""
        self._outbox.append(encode_event(event))

    def turn(self) -> bytes:
        """The events queued since the last turn, or a beat when there were none."""
        events, self._outbox = self._outbox, []
        return self.message("events", events) if events else self.message("beat")

    def message(self, kind: str, body: Any = None) -> bytes:
        """The next message of this replica (each one, published or not, takes a number)."""
        self._seq += 1
        message: bytes = msgpack.packb([VERSION, self.instance_id, self._seq, kind, body])
        return message

    def snapshot(self) -> bytes:
        """This replica's requests in flight, and the sessions its router knows last."""
        requests = [encode_event(e) for e in self.router.own_routes()]
        sessions = [
            [key, route.engine_id, route.version]
            for key, route in self.router.recent_sessions(self.snapshot_sessions)
        ]
        return self.message("snapshot", [requests, sessions])

    def _apply_snapshot(self, origin: str, body: Any, now_s: float) -> None:
        requests, sessions = body
        self.peers.replace(origin, [decode_event(item) for item in requests], now_s)
        for key, engine_id, version in sessions:
            self.router.learn_session(str(key), SessionRoute(str(engine_id), int(version)))

    def receive(self, data: bytes, now_s: float) -> list[bytes]:
        """Apply a message from the channel; returns the messages to publish in answer. A
        message that is not one, or a peer's whose body is bad, is logged and dropped (its
        number counts: a peer's bad message is no gap)."""
        try:
            message = msgpack.unpackb(data)
            if not isinstance(message, list):
                raise TypeError(f"a {type(message).__name__}, not an array")
            version, origin = message[0], str(message[1])
            if version == VERSION:
                _, _, seq, kind, body = message
                seq = int(seq)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            log.warning(
                "replica sync: dropping a message that is not one (%s)", unpack_failure(exc)
            )
            return []
        if version != VERSION:
            self._other_version(origin, version, now_s)
            return []
        if origin == self.instance_id:
            return []
        if kind == "bye":
            self.forget(origin)
            return []
        self.heard[origin] = now_s
        last = self._last_seq.get(origin)
        self._last_seq[origin] = seq
        replies: list[bytes] = []
        try:
            if kind == "snapshot":
                self._asked.pop(origin, None)
                self._apply_snapshot(origin, body, now_s)
                return replies
            if kind == "hello" or (kind == "resend" and body == self.instance_id):
                replies.append(self.snapshot())
            gap = last is not None and seq != last + 1
            if gap:
                self.num_gaps += 1
            if last is None or gap or self._ask_again(origin, now_s):
                self._asked[origin] = now_s
                replies.append(self.message("resend", origin))
            if kind == "events":
                for item in body:
                    self.peers.apply(origin, decode_event(item), now_s)
        except (ValueError, TypeError, IndexError) as exc:
            log.warning("replica sync: dropping a bad message from %s (%s)", origin, exc)
        return replies

    def _other_version(self, origin: str, version: Any, now_s: float) -> None:
        """A peer of another release: said once per peer, not at each of its messages."""
        known = origin in self._other_versions
        self._other_versions[origin] = now_s
        if known:
            return
        log.warning(
            "replica sync: ignoring controller %s, which speaks version %s of the replicas' "
            "sync (this one speaks %d): the two do not see each other's requests until they "
            "run one kvplane release",
            origin,
            version,
            VERSION,
        )

    def _ask_again(self, origin: str, now_s: float) -> bool:
        asked = self._asked.get(origin)
        return asked is not None and now_s - asked >= self.resend_after_s

    @property
    def num_other_versions(self) -> int:
        """Peers of another version heard from lately (ignored)."""
        return len(self._other_versions)

    def forget_silent_other_versions(self, now_s: float, timeout_s: float) -> None:
        """Forget the peers of another version not heard from for `timeout_s` (heard again,
        they are warned about again)."""
        for origin, heard in list(self._other_versions.items()):
            if heard < now_s - timeout_s:
                del self._other_versions[origin]

    def silent_peers(self, now_s: float, timeout_s: float) -> list[str]:
        """The peers not heard from for `timeout_s`."""
        return [o for o, heard in self.heard.items() if heard < now_s - timeout_s]

    def forget(self, origin: str) -> None:
        """Release what the peer has in flight here (it left, fell silent or restarted)."""
        self.heard.pop(origin, None)
        self._last_seq.pop(origin, None)
        self._asked.pop(origin, None)
        self.peers.forget(origin)

    def forget_all(self) -> None:
        """Release every peer's requests (the subscription is lost: what they do meanwhile
        is unknown)."""
        for origin in [*self.heard, *self.peers.origins]:
            self.forget(origin)
