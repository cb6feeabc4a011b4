"""What controller replicas tell each other, so that each routes knowing the others' requests.

Replicas behind one load balancer share the index (Redis) and poll the same engines, but a
router's own in-flight accounting, the lesson of routers that sent a whole burst to the engine
that looked idle at the last poll (`controller.router.inflight`), only holds the requests it
routed itself. With R replicas each sees a R-th of the burst: measured on the conversation
trace (2,048 blocks, trace speed), two replicas took the mean TTFT from 244 to 338 ms and
eight to 768 ms (docs/benchmarks/routing.md, "Controller replicas"). Dynamo's router syncs its
replicas' active sequences for the same reason (`router_replica_sync`).

So each replica publishes its router's accounting as events (`Routed` when it charges an
engine, `FirstToken`, `Finished`), and applies its peers' (`PeerRoutes`) to its own router as
if it had routed them: in-flight accounting, pending prefixes and session affinity (a
session's next request, through whichever replica, goes where its cached prefix is). The
transport (Redis pub/sub, with snapshots and liveness) is `controller.replica_sync`; this
module is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.router.router import Router


@dataclass(frozen=True, slots=True)
class Routed:
    """A request charged to an engine: its uncached prefill, its cached rest, its blocks;
    `claims_prefix` when its blocks count as pending there (a hop that reads the cache, not a
    decode engine taking a prefilled request); `session_key` when the route sticks its session
    to the engine, as the `session_version`-th route of the session this router knows of
    (`Router` keeps the latest: see `SessionRoute`)."""

    request_id: str
    engine_id: str
    prefill_tokens: int
    cached_tokens: int
    block_keys: Sequence[int]
    claims_prefix: bool = True
    session_key: str | None = None
    session_version: int = 0


@dataclass(frozen=True, slots=True)
class FirstToken:
    request_id: str


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str


RouteEvent = Routed | FirstToken | Finished


class PeerRoutes:
    """The requests peer replicas routed, accounted in this replica's router.

    A peer's request is charged under a name of its own here (origin and request id), so two
    replicas' request ids never collide. `forget` releases everything a peer had in flight (it
    left, fell silent or restarted); `replace` puts a peer's snapshot in place of what was
    known of it (after a lost message, or when this replica joins)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._requests: dict[str, set[str]] = {}  # origin -> its request ids in flight here

    @property
    def origins(self) -> list[str]:
        return list(self._requests)

    def num_requests(self, origin: str) -> int:
        return len(self._requests.get(origin, ()))

    def apply(self, origin: str, event: RouteEvent, now_s: float) -> None:
        name = f"{origin}\x00{event.request_id}"
        if isinstance(event, Routed):
            self._requests.setdefault(origin, set()).add(name)
            self.router.charge_peer(name, event, now_s)
        elif isinstance(event, FirstToken):
            self.router.release_prefill(name)
        else:
            self.router.release(name)
            requests = self._requests.get(origin)
            if requests is not None:
                requests.discard(name)

    def forget(self, origin: str) -> None:
        for name in self._requests.pop(origin, ()):
            self.router.release(name)

    def replace(self, origin: str, events: Sequence[RouteEvent], now_s: float) -> None:
        self.forget(origin)
        self._requests[origin] = set()
        for event in events:
            self.apply(origin, event, now_s)
