"""The replicas' sync protocol (`controller.router.replica_protocol`, the code `ReplicaSync`
runs live) against a naive model: 2 to 4 replicas route, see first tokens and finish requests,
lose their subscription, restart, and time out, while the channel drops any message; once
the losses stop and every message has been delivered and the repairs answered, every
replica's router charges each engine with exactly the requests in flight on all replicas, and
no counter of any router ever went negative; and every replica sticks a session to the
engine of its latest route, as long as the replica that routed it still runs (the session's
requests in flight or all ended: a replica that joined learns it from its peers' snapshots)."""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controller.router import Candidate, Router, RouteRequest, make_policy
from controller.router.replica_protocol import VERSION, ReplicaProtocol, decode_event
from controller.router.router import SessionRoute

ENGINES = ("e1", "e2", "e3")
HEARTBEAT_S = 1.0
TIMEOUT_S = 5.0


@dataclass
class OwnRequest:
    engine: str
    prefill_tokens: int
    prefilling: bool = True


@dataclass(frozen=True)
class LatestRoute:
    """A session's latest route of all (by `SessionRoute.supersedes`): by which replica (its
    index, and the instance id of the process there then)."""

    route: SessionRoute
    replica: int
    instance_id: str


@dataclass
class Replica:
    router: Router
    protocol: ReplicaProtocol
    subscribed: bool = True
    own: dict[str, OwnRequest] = field(default_factory=dict)  # the model: its own in flight


class Fleet:
    """Replicas on one simulated pub/sub channel: what a replica publishes is queued for every
    subscribed replica, in order per origin; delivering a message may drop it instead."""

    def __init__(self, n: int) -> None:
        self.now = 0.0
        self.generation = 0
        self.replicas = [self._new_replica(i) for i in range(n)]
        # receiver index -> origin -> messages not delivered yet
        self.queues: list[dict[str, deque[bytes]]] = [{} for _ in range(n)]
        self.next_request = 0
        self.latest: dict[str, LatestRoute] = {}  # session -> its latest route of all
        for i in range(n):
            self.publish(i, self.replicas[i].protocol.message("hello"))

    def _new_replica(self, i: int) -> Replica:
        self.generation += 1
        router = Router(make_policy("kvplane"))
        protocol = ReplicaProtocol(router, f"r{i}.{self.generation}", resend_after_s=HEARTBEAT_S)
        router.publish_to(protocol.queue)
        return Replica(router, protocol)

    def publish(self, i: int, message: bytes) -> None:
        origin = self.replicas[i].protocol.instance_id
        for j, replica in enumerate(self.replicas):
            if j != i and replica.subscribed:
                self.queues[j].setdefault(origin, deque()).append(message)

    def route(
        self, i: int, engine: str, prompt_blocks: int, shared: int, session: str | None = None
    ) -> None:
        replica = self.replicas[i]
        self.next_request += 1
        request_id = f"q{self.next_request}"
        keys = tuple(range(shared * 100, shared * 100 + prompt_blocks))  # shared prefixes
        request = RouteRequest(request_id, 16 * prompt_blocks, 16, keys, session_key=session)
        decision = replica.router.route(request, [Candidate(engine)], random.Random(0), self.now)
        cached = min(decision.predicted_cached_tokens, request.num_prompt_tokens)
        replica.own[request_id] = OwnRequest(engine, request.num_prompt_tokens - cached)
        if session is not None:
            route = replica.router.session_route(session)
            assert route is not None and route.engine_id == engine
            latest = self.latest.get(session)
            if route.supersedes(latest.route if latest else None):
                self.latest[session] = LatestRoute(route, i, replica.protocol.instance_id)

    def first_token(self, i: int, pick: int) -> None:
        replica = self.replicas[i]
        prefilling = [r for r, own in replica.own.items() if own.prefilling]
        if prefilling:
            request_id = prefilling[pick % len(prefilling)]
            replica.router.first_token(request_id)
            replica.own[request_id].prefilling = False

    def finish(self, i: int, pick: int) -> None:
        replica = self.replicas[i]
        if replica.own:
            request_id = list(replica.own)[pick % len(replica.own)]
            replica.router.finish(request_id)
            del replica.own[request_id]

    def turn(self, i: int, lost: bool) -> None:
        """The publish loop's turn: its events (or a beat), which Redis may not take; then
        the peers it has not heard from for too long are forgotten."""
        protocol = self.replicas[i].protocol
        message = protocol.turn()
        if not lost:
            self.publish(i, message)
        for origin in protocol.silent_peers(self.now, TIMEOUT_S):
            protocol.forget(origin)

    def deliver(self, j: int, pick: int, drop: bool) -> None:
        waiting = [origin for origin, queue in self.queues[j].items() if queue]
        if not waiting:
            return
        message = self.queues[j][waiting[pick % len(waiting)]].popleft()
        if not drop:
            for reply in self.replicas[j].protocol.receive(message, self.now):
                self.publish(j, reply)

    def lose_subscription(self, i: int) -> None:
        replica = self.replicas[i]
        replica.subscribed = False
        replica.protocol.forget_all()
        self.queues[i] = {}

    def subscribe(self, i: int) -> None:
        replica = self.replicas[i]
        if not replica.subscribed:
            replica.subscribed = True
            self.publish(i, replica.protocol.message("hello"))

    def restart(self, i: int, says_bye: bool) -> None:
        """A new process in its place (a new instance id): its requests are gone with it;
        the old one said bye, or falls silent."""
        if says_bye:
            self.publish(i, self.replicas[i].protocol.message("bye"))
        self.replicas[i] = self._new_replica(i)
        self.queues[i] = {}
        self.publish(i, self.replicas[i].protocol.message("hello"))

    def tick(self, seconds: float) -> None:
        self.now += seconds

    def deliver_all(self) -> None:
        while True:
            busy = [(j, o) for j, queues in enumerate(self.queues) for o, q in queues.items() if q]
            if not busy:
                return
            for j, origin in busy:
                message = self.queues[j][origin].popleft()
                for reply in self.replicas[j].protocol.receive(message, self.now):
                    self.publish(j, reply)

    def settle(self) -> None:
        """No more losses: every replica subscribed, beating every heartbeat for longer than
        the timeout (a gone origin is forgotten), every message delivered."""
        for i in range(len(self.replicas)):
            self.subscribe(i)
        for _ in range(int(TIMEOUT_S / HEARTBEAT_S) + 3):
            self.deliver_all()
            self.tick(HEARTBEAT_S)
            for i in range(len(self.replicas)):
                self.turn(i, lost=False)
        self.deliver_all()

    def expected(self) -> dict[str, tuple[int, int, int]]:
        """The naive model: per engine, (requests, prefilling, prefill tokens) of every
        replica's own requests in flight."""
        out: dict[str, tuple[int, int, int]] = {}
        for replica in self.replicas:
            for own in replica.own.values():
                n, prefilling, tokens = out.get(own.engine, (0, 0, 0))
                if own.prefilling:
                    prefilling, tokens = prefilling + 1, tokens + own.prefill_tokens
                out[own.engine] = (n + 1, prefilling, tokens)
        return out

    def expected_sessions(self) -> dict[str, SessionRoute]:
        """The sessions whose latest route was made by a replica still running (whether its
        request is in flight or ended), and that route. (A route whose replica restarted may
        be known to none: its messages lost, the process gone.)"""
        return {
            session: latest.route
            for session, latest in self.latest.items()
            if self.replicas[latest.replica].protocol.instance_id == latest.instance_id
        }


def _sessions(router: Router, sessions: list[str]) -> dict[str, SessionRoute]:
    routes = {session: router.session_route(session) for session in sessions}
    return {session: route for session, route in routes.items() if route is not None}


def _view(router: Router) -> dict[str, tuple[int, int, int]]:
    out = {}
    for engine in ENGINES:
        f = router.inflight.of(engine)
        if f.requests:
            out[engine] = (f.requests, f.prefilling, f.prefill_tokens)
    return out


def _never_negative(fleet: Fleet) -> None:
    for replica in fleet.replicas:
        for engine in ENGINES:
            f = replica.router.inflight.of(engine)
            assert min(f.requests, f.prefilling, f.prefill_tokens, f.prefill_cached_tokens) >= 0
            assert min(f.active_blocks, f.prefilling) >= 0


replica_index = st.integers(0, 3)
operation = st.one_of(
    st.tuples(
        st.just("route"),
        replica_index,
        st.sampled_from(ENGINES),
        st.integers(1, 8),
        st.integers(0, 3),
        st.sampled_from([None, "s1", "s2"]),
    ),
    st.tuples(st.just("first_token"), replica_index, st.integers(0, 50)),
    st.tuples(st.just("finish"), replica_index, st.integers(0, 50)),
    st.tuples(st.just("turn"), replica_index, st.booleans()),
    st.tuples(st.just("deliver"), replica_index, st.integers(0, 50), st.booleans()),
    st.tuples(st.just("deliver"), replica_index, st.integers(0, 50), st.just(False)),
    st.tuples(st.just("lose_subscription"), replica_index),
    st.tuples(st.just("subscribe"), replica_index),
    st.tuples(st.just("restart"), replica_index, st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.5, 1.0, 3.0, 6.0])),
)


# A session's only request ends, then its peer restarts: the new process learns the session
# from the snapshot alone (they carried the sessions of requests in flight only).
_SESSION_ENDED_BEFORE_A_PEER_JOINED = [
    ("route", 0, "e2", 1, 0, "chat"),
    ("finish", 0, 0),
    ("turn", 0, False),
    ("restart", 1, True),
]


@settings(max_examples=1000, deadline=None)
@given(n=st.integers(2, 4), operations=st.lists(operation, max_size=80))
@example(n=2, operations=_SESSION_ENDED_BEFORE_A_PEER_JOINED)
def test_every_replica_charges_every_replicas_requests_once_settled(
    n: int, operations: list[tuple[object, ...]]
) -> None:
    fleet = Fleet(n)
    for name, *args in operations:
        if name != "tick":
            args[0] = int(str(args[0])) % n
        getattr(fleet, str(name))(*args)
        _never_negative(fleet)
    fleet.settle()
    _never_negative(fleet)
    expected = fleet.expected()
    sessions = fleet.expected_sessions()
    for replica in fleet.replicas:
        assert _view(replica.router) == expected, replica.protocol.instance_id
        assert _sessions(replica.router, list(sessions)) == sessions, replica.protocol.instance_id


def _settled_views(fleet: Fleet) -> list[dict[str, tuple[int, int, int]]]:
    fleet.settle()
    return [_view(replica.router) for replica in fleet.replicas]


def test_a_gap_just_before_a_hello_is_repaired() -> None:
    """Found by the property: a replica whose publish failed and whose subscription dropped
    (one network blip) comes back with a hello numbered past the lost message; its peer,
    which stayed subscribed, used to answer the hello without seeing the gap, and so never
    learnt the requests of the lost message until they ended."""
    fleet = Fleet(2)
    fleet.deliver_all()
    fleet.route(0, "e1", 1, 0)
    fleet.lose_subscription(0)
    fleet.route(0, "e1", 1, 0)
    fleet.turn(0, lost=True)
    assert _settled_views(fleet) == [{"e1": (2, 2, 32)}] * 2


def test_a_peer_heard_first_after_both_lost_the_channel_is_asked_for_its_snapshot() -> None:
    """Both replicas lose the channel (Redis restarted); the one back first says hello while
    the other is not subscribed yet, so only the second's hello is heard: the first answers
    it with its own snapshot, and must ask for the second's, which it knows nothing of."""
    fleet = Fleet(2)
    fleet.deliver_all()
    fleet.route(1, "e2", 2, 1)
    fleet.turn(1, lost=False)
    fleet.deliver_all()
    fleet.lose_subscription(0)
    fleet.lose_subscription(1)
    fleet.subscribe(0)  # its hello reaches no one
    fleet.subscribe(1)
    assert _settled_views(fleet) == [{"e2": (1, 1, 32)}] * 2


def test_a_lost_request_for_a_snapshot_is_asked_again() -> None:
    fleet = Fleet(2)
    fleet.deliver_all()
    fleet.route(0, "e3", 1, 0)
    fleet.turn(0, lost=False)
    fleet.deliver(1, 0, drop=True)  # replica 1 misses the events
    fleet.turn(0, lost=False)
    fleet.deliver(1, 0, drop=False)  # the next message: a gap, and its request for a snapshot
    fleet.deliver(0, 0, drop=True)  # ... lost on its way
    assert _settled_views(fleet) == [{"e3": (1, 1, 16)}] * 2


def test_a_session_routed_through_one_replica_sticks_on_its_peers_joined_late_too() -> None:
    """A session's route travels with its request: the peer that heard it, and one that
    joins later (by the snapshot), send the session's next request to the same engine."""
    fleet = Fleet(2)
    fleet.deliver_all()
    fleet.route(0, "e2", 1, 0, session="chat")
    fleet.turn(0, lost=False)
    fleet.restart(1, says_bye=True)  # a new replica: it knows only what snapshots bring
    fleet.deliver_all()
    for replica in fleet.replicas:
        assert replica.router.session_route("chat") == SessionRoute("e2", 1)
    # Its next request, through the new replica: the route is later, and its peer follows.
    fleet.route(1, "e3", 1, 0, session="chat")
    fleet.turn(1, lost=False)
    fleet.deliver_all()
    for replica in fleet.replicas:
        assert replica.router.session_route("chat") == SessionRoute("e3", 2)


def test_a_snapshot_brings_the_most_recent_sessions_and_a_later_route_wins() -> None:
    """A snapshot carries the `snapshot_sessions` sessions its sender routed or learnt last
    (their requests ended), oldest first; the replica that receives it sticks them, except a
    session it knows a later route of."""
    sender = Fleet(2)
    sender.deliver_all()
    for n, session in enumerate(["old", "mid", "new"]):
        sender.route(0, ENGINES[n], 1, n, session=session)
        sender.finish(0, 0)
    sender.deliver_all()
    receiver = Router(make_policy("kvplane"))
    receiver.learn_session("new", SessionRoute("e1", 2))  # later than the sender's
    protocol = ReplicaProtocol(receiver, "receiver")
    snapshot = sender.replicas[0].protocol
    snapshot.snapshot_sessions = 2
    _, origin, _, kind, (requests, sessions) = msgpack.unpackb(snapshot.snapshot())
    assert (kind, [decode_event(r) for r in requests]) == ("snapshot", [])
    assert sessions == [["mid", "e2", 1], ["new", "e3", 1]]
    protocol.receive(snapshot.snapshot(), 0.0)
    assert _sessions(receiver, ["old", "mid", "new"]) == {
        "mid": SessionRoute("e2", 1),
        "new": SessionRoute("e1", 2),
    }
    assert origin in protocol.peers.origins


@pytest.mark.parametrize("version", [1, 2, 4])
def test_a_peer_of_another_version_is_ignored_with_one_warning(
    version: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica of another release during a rolling upgrade (version 1: routes without
    their session; 2: snapshots without sessions; 4: a later one): its messages change
    nothing here, and it is named once, not at each of its messages."""
    caplog.set_level(logging.WARNING, logger="controller.router.replica_protocol")
    router = Router(make_policy("kvplane"))
    protocol = ReplicaProtocol(router, "new")
    routed = [0, "r1", "e1", 16, 0, [1], True]
    for seq, (kind, body) in enumerate([("hello", None), ("events", [routed])], start=1):
        message = msgpack.packb([version, "other", seq, kind, body])
        assert protocol.receive(message, 0.0) == []
    assert router.inflight.of("e1").requests == 0
    assert protocol.heard == {}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert f"ignoring controller other, which speaks version {version}" in said[0]


def test_a_message_that_is_not_msgpack_is_dropped_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """msgpack raises FormatError (a byte it never uses, 0xc1) and StackError (nesting too
    deep) without a message: the warning ended in "()" and told an operator nothing."""
    caplog.set_level(logging.WARNING, logger="controller.router.replica_protocol")
    protocol = ReplicaProtocol(Router(make_policy("kvplane")), "r0")
    for data in (b"\xc1", b"\x91" * 2000, msgpack.packb("hello")):
        assert protocol.receive(data, 0.0) == []
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "replica sync: dropping a message that is not one (FormatError: Invalid msgpack format)",
        "replica sync: dropping a message that is not one (StackError: Too nested)",
        "replica sync: dropping a message that is not one (TypeError: a str, not an array)",
    ]


def test_peers_of_another_version_are_forgotten_once_silent() -> None:
    """Every restart of a replica of another release is a new origin: each is remembered
    (to be warned about once) only while it speaks, so a long rolling upgrade of restarting
    replicas leaves none behind; one heard again after its silence is warned about again."""
    protocol = ReplicaProtocol(Router(make_policy("kvplane")), "new")
    for restart in range(100):
        message = msgpack.packb([VERSION + 1, f"old-{restart}", 1, "beat", None])
        protocol.receive(message, float(restart))
        protocol.forget_silent_other_versions(float(restart), TIMEOUT_S)
    assert protocol.num_other_versions == TIMEOUT_S + 1  # heard within the timeout


def test_a_peer_that_keeps_beating_is_never_silent() -> None:
    """Every message of a peer counts as hearing from it, not only the first: a peer beating
    every heartbeat is not taken for a silent one (its requests released) past the timeout."""
    a, b = (ReplicaProtocol(Router(make_policy("kvplane")), name) for name in ("a", "b"))
    now = 0.0
    for reply in b.receive(a.message("hello"), now):
        a.receive(reply, now)
    while now < 3 * TIMEOUT_S:
        now += HEARTBEAT_S
        b.receive(a.turn(), now)
        assert b.silent_peers(now, TIMEOUT_S) == []
    assert list(b.heard) == ["a"]


def test_each_event_is_published_once() -> None:
    """A turn publishes the events queued since the previous one, each once: a replica's
    messages do not grow with everything it ever routed; a turn with none is a beat."""
    fleet = Fleet(2)
    fleet.route(0, "e1", 1, 0)
    protocol = fleet.replicas[0].protocol
    kinds = [msgpack.unpackb(protocol.turn())[3:] for _ in range(2)]
    assert [kind for kind, _ in kinds] == ["events", "beat"]
    assert [decode_event(item).request_id for item in kinds[0][1]] == ["q1"]
