"""Whether this controller follows an engine's KV events into its index now, as an operator
reads it (`kvplane admin workers`, `kvplane_controller_engine_kv_events_up`).

An engine whose event stream is down while its polls succeed (its ZMQ publisher unreachable,
a SubscribeKvEvents call failing and retried) is routed on an index that is stale for it
alone: its health says nothing of that. What the fleet knows of the engine (its `kv_events`
mode, its writer lease on a shared index) and what its source's `Link` says
(`indexer.sources.link`) make one `EventFollowing` (`Fleet.event_following`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FollowingState(enum.Enum):
    FOLLOWING = "following"  # the engine's stream (or its ZMQ publisher) is connected
    CONNECTING = "connecting"  # not connected yet since it was added, restarted or taken over
    DOWN = "down"  # connected once, lost since (the engine's events are not indexed meanwhile)
    NOT_FOLLOWED = "not_followed"  # kv_events none, or a remote indexer follows it
    OTHER_REPLICA = "other_replica"  # another replica on the shared index holds its lease


@dataclass(frozen=True, slots=True)
class EventFollowing:
    state: FollowingState
    reason: str = ""  # why it is not following ("" when it is)
    since_unix_s: float | None = None  # when it entered `state` (None: unknown)
    last_event_unix_s: float | None = None  # when its last batch was indexed here

    @property
    def up(self) -> bool | None:
        """Whether this replica's index gets the engine's events now; None when they are not
        this replica's to follow (not followed, or another replica's)."""
        if self.state in (FollowingState.NOT_FOLLOWED, FollowingState.OTHER_REPLICA):
            return None
        return self.state is FollowingState.FOLLOWING
